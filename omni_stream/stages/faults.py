"""Fault injection: make one stream fail inside a chosen stage, for tests and the soak.

``OMNI_STREAM_FAULTS="talker:3:5,codec:7:2"`` lists ``stage:stream_id:frame`` entries. When
that stream reaches that frame, the stage corrupts what it is about to compute the way a real
per-stream fault shows up, and its own checks must then fail that stream alone:

- ``talker``: the stream's text-track input row becomes NaN, so its talker logits go NaN;
- ``code_predictor``: the talker hidden state the code predictor reads for the stream becomes
  NaN (in the split placement it crosses to the code-predictor process like that);
- ``codec``: the frame arriving at the codec stage carries a code outside the codebook.

Unset (the normal case), every check is a dict lookup that finds nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FAULTS_ENV = "OMNI_STREAM_FAULTS"
STAGES = ("talker", "code_predictor", "codec")


@dataclass(frozen=True)
class Fault:
    stage: str
    stream_id: int
    frame: int


class FaultPlan:
    def __init__(self, faults: tuple[Fault, ...] = ()) -> None:
        self._at = {(f.stage, f.stream_id): f.frame for f in faults}

    @classmethod
    def parse(cls, text: str) -> "FaultPlan":
        faults = []
        for item in filter(None, (t.strip() for t in text.split(","))):
            parts = item.split(":")
            if len(parts) != 3 or parts[0] not in STAGES:
                raise ValueError(f"{FAULTS_ENV}: '{item}' is not stage:stream_id:frame with a "
                                 f"stage in {', '.join(STAGES)}")
            try:
                sid, frame = int(parts[1]), int(parts[2])
            except ValueError:
                raise ValueError(f"{FAULTS_ENV}: '{item}': stream_id and frame must be "
                                 "integers") from None
            faults.append(Fault(parts[0], sid, frame))
        return cls(tuple(faults))

    @classmethod
    def from_env(cls) -> "FaultPlan":
        return cls.parse(os.environ.get(FAULTS_ENV, ""))

    def __bool__(self) -> bool:
        return bool(self._at)

    def fires(self, stage: str, stream_id: int, frame: int) -> bool:
        """True when ``stream_id`` is at ``frame`` and a fault is planned there in ``stage``."""
        return self._at.get((stage, stream_id)) == frame

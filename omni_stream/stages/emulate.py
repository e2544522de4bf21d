"""An emulated slow machine: ``OMNI_STREAM_EMULATE_COSTS`` makes the talker's frame step take
at least a given time, so capacity, hold-back and their tests can be shown on any machine.

The variable holds JSON, or the path of a JSON file that is read again whenever it changes
(a test or an operator raises the costs mid-run that way):

    {"frame_ms": [base, per_stream], "scale": s}

A frame step of ``n`` streams then lasts at least ``base + per_stream x n`` ms and at least
``s`` times its real duration (the stage sleeps the difference). Both are optional; the
start-up measurement goes through the same padding, so the server measures the machine it
emulates. Costs measured under emulation are never cached.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "OMNI_STREAM_EMULATE_COSTS"
RECHECK_S = 0.5


class Emulation:
    def __init__(self, spec: str | None = None) -> None:
        self.spec = os.environ.get(ENV) if spec is None else spec
        self.base_s = self.per_stream_s = 0.0
        self.scale = 1.0
        self._path: Path | None = None
        self._mtime: float | None = None
        self._checked = 0.0
        if self.spec:
            text = self.spec.strip()
            if not text.startswith("{"):
                self._path = Path(text)
                text = self._path.read_text()
                self._mtime = self._path.stat().st_mtime
            self._apply(json.loads(text))

    @property
    def active(self) -> bool:
        return bool(self.spec)

    def _apply(self, d: dict) -> None:
        bad = sorted(set(d) - {"frame_ms", "scale"})
        if bad:
            raise ValueError(f"{ENV}: unknown key(s) {bad}; valid: frame_ms, scale")
        base, per = d.get("frame_ms", [0.0, 0.0])
        scale = float(d.get("scale", 1.0))
        if base < 0 or per < 0 or scale < 1:
            raise ValueError(f"{ENV}: frame_ms must be >= 0 and scale >= 1, got {d}")
        self.base_s, self.per_stream_s, self.scale = base / 1e3, per / 1e3, scale

    def _reload(self) -> None:
        now = time.monotonic()
        if self._path is None or now - self._checked < RECHECK_S:
            return
        self._checked = now
        try:
            mtime = self._path.stat().st_mtime
            if mtime != self._mtime:
                self._mtime = mtime
                self._apply(json.loads(self._path.read_text()))
                log.info("emulated costs now: %.0f + %.0f ms per stream, x%.2f",
                         1e3 * self.base_s, 1e3 * self.per_stream_s, self.scale)
        except (OSError, ValueError) as e:
            log.warning("%s: keeping the previous costs (%s)", ENV, e)

    def pad(self, took_s: float, streams: int) -> float:
        """Sleep so that a step of ``streams`` streams that took ``took_s`` lasts what the
        emulated machine takes; returns the seconds slept."""
        if not self.active:
            return 0.0
        self._reload()
        want = max(self.base_s + self.per_stream_s * streams, self.scale * took_s)
        extra = want - took_s
        if extra > 0:
            time.sleep(extra)
            return extra
        return 0.0


__all__ = ["ENV", "Emulation"]

"""Talker-stage scheduler: which stream holds which slot, what to prefill next, when streams end.

Plain Python bookkeeping (no torch, no I/O), apart from the runner that makes the engine calls
(``talker_stage.TalkerStage``), in the manner of nano-vllm's Scheduler / ModelRunner. The runner
asks and reports; the scheduler decides:

- admission: streams wait in a FIFO (``pending``); the head takes the lowest free slot when one
  is free (``assign``), so the batched step covers ``[0, highest decoding slot + 1)`` with few
  idle rows;
- prefill: how much of the head's prompt to prefill before the next frame step (``decide``:
  playback-slack throttling, ``scheduling.throttle``), fed by the measured prefill costs
  (``prefilled``) and decode-step times (``stepped``);
- frames: after each step, whether a stream goes on, ended on eos, reached its frame cap, or
  drew an INVALID code (``advance``); ``release`` frees a stream's slot for the next one.

Every stream is one :class:`StreamState` from arrival to its end; ``slots[i]`` is the stream
holding slot ``i`` (prefilling or decoding) or None.
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from omni_stream.scheduling.throttle import (Action, Decision, PendingPrefill, PrefillCostModel,
                                            RunningStream, decide_prefill, slack_s)


@dataclass(frozen=True)
class ThrottleSettings:
    """Playback-slack prefill throttling (see omni_stream.scheduling.throttle)."""

    enabled: bool = True
    margin_s: float = 0.12  # covers frames still buffered in the codec stage (not yet delivered)
    max_split_tokens: int = 64
    min_split_tokens: int = 8
    starvation_s: float = 2.0


@dataclass(eq=False)
class StreamState:
    """One stream in the talker stage: waiting, prefilling (``slot`` set, ``fed`` < prompt) or
    decoding (``decoding``; ``frames`` made so far)."""

    stream_id: int
    max_frames: int
    arrived: float
    request: Any = None  # the AddStream (the runner's; opaque here)
    prompt: Any = None  # the built prompt (the runner's; opaque here)
    prompt_len: int = 0
    slot: int | None = None
    fed: int = 0  # prompt positions already prefilled (chunked prefill)
    decoding: bool = False
    frames: int = 0
    first_t: float | None = None  # when its first frame left (the playback clock's origin)
    # continuous text (AppendText): the text may still grow; the stream waits (sits out frame
    # steps) while it has no text-track row left for its next step
    text_open: bool = False
    rows_in: int = 0  # text-track rows the engine holds for it (one per decode step)
    text_len: int = 0  # text tokens so far (its frame cap follows them)
    new_ids: list[int] = field(default_factory=list)  # arrived, not yet in the engine
    close_pending: bool = False  # the text was closed; tts_eos not yet in the engine
    waiting_since: float | None = None

    def starved(self) -> bool:
        """Waiting for text: the next step would need a text row that has not arrived."""
        return self.text_open and not self.new_ids and not self.close_pending \
            and self.frames >= self.rows_in


class FrameEnd(enum.Enum):
    """What a frame step meant for one decoding stream."""

    NONE = "none"  # goes on
    EOS = "eos"  # the model ended it
    LENGTH = "length"  # it reached its frame cap
    INVALID = "invalid"  # its code failed the engine's check: fail the stream


class TalkerScheduler:
    """See the module docstring. ``eos`` / ``invalid``: the engine's codebook-0 end-of-speech
    and failed-check ids; ``frame_audio_s``: audio per frame (the playback clock's unit)."""

    def __init__(self, max_slots: int, *, eos: int, invalid: int, frame_audio_s: float,
                 throttle: ThrottleSettings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.slots: list[StreamState | None] = [None] * max_slots
        self.pending: collections.deque[StreamState] = collections.deque()
        self.eos, self.invalid, self.frame_audio_s = eos, invalid, frame_audio_s
        self.throttle = throttle or ThrottleSettings()
        self.clock = clock
        self.cost = PrefillCostModel(per_token_s=1e-4, fixed_s=1e-3)
        self._cost_samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)
        self.frame_s = 0.05  # EMA of the measured decode-step wall time
        self.decisions: collections.Counter = collections.Counter()

    # ------------------------------------------------------------------ queries
    def decoding(self) -> list[StreamState]:
        """Decoding streams in slot order."""
        return [s for s in self.slots if s is not None and s.decoding]

    def width(self) -> int:
        """Rows the next frame step covers: highest decoding slot + 1 (0: no step)."""
        return max((i + 1 for i, s in enumerate(self.slots) if s is not None and s.decoding),
                   default=0)

    def free_slots(self) -> int:
        return sum(s is None for s in self.slots)

    def busy(self) -> bool:
        """Work to do now: a prefill, or a stream in a slot that is not waiting for its text."""
        return bool(self.pending) or any(s is not None and not (s.decoding and s.starved())
                                         for s in self.slots)

    def head(self) -> StreamState | None:
        return self.pending[0] if self.pending else None

    # ------------------------------------------------------------------ admission
    def submit(self, stream_id: int, max_frames: int, request: Any = None) -> StreamState:
        """A new stream joins the back of the FIFO."""
        st = StreamState(stream_id, max_frames, self.clock(), request)
        self.pending.append(st)
        return st

    def assign(self, st: StreamState, prompt_len: int) -> bool:
        """Give ``st`` (the head) the lowest free slot for a prompt of ``prompt_len`` positions;
        False when every slot is taken."""
        assert st.slot is None and prompt_len >= 1
        for i, s in enumerate(self.slots):
            if s is None:
                self.slots[i] = st
                st.slot, st.prompt_len = i, prompt_len
                return True
        return False

    def decide(self, st: StreamState) -> Decision:
        """How many of ``st``'s remaining prompt positions to prefill before the next frame
        step (RUN / SPLIT) or none (DEFER), from the decoding streams' playback slack."""
        left = st.prompt_len - st.fed
        th = self.throttle
        if not th.enabled:
            d = Decision(Action.RUN, left, 0, reason="throttling off")
        else:
            now = self.clock()
            # a stream waiting for its text is not late: its client is (not counted)
            running = [RunningStream(slack_s(s.frames * self.frame_audio_s, s.first_t, now))
                       for s in self.decoding() if s.waiting_since is None]
            d = decide_prefill([PendingPrefill(left, now - st.arrived)], running, self.cost,
                               self.frame_s, th.margin_s, th.max_split_tokens,
                               min_split_tokens=min(th.min_split_tokens, left),
                               starvation_s=th.starvation_s)
        self.decisions[d.action.value] += 1
        return d

    def piece(self, st: StreamState, tokens: int) -> tuple[int, bool]:
        """The next prefill piece of ``st`` for a decision of ``tokens``: (positions, final);
        the final piece takes all that is left."""
        final = st.fed + tokens >= st.prompt_len
        return (st.prompt_len - st.fed if final else tokens), final

    def prefilled(self, st: StreamState, n: int, seconds: float) -> None:
        """``n`` positions of ``st`` were prefilled in ``seconds``: refit the cost model."""
        self._cost_samples.append((n, seconds))
        if len({t for t, _ in self._cost_samples}) >= 2:
            self.cost = PrefillCostModel.fit(list(self._cost_samples))
        st.fed += n

    def start_decoding(self, st: StreamState) -> None:
        """``st``'s prompt is in: it leaves the FIFO and joins the frame steps."""
        assert st.slot is not None and st.fed >= st.prompt_len
        self.pending.remove(st)
        st.decoding = True

    # ------------------------------------------------------------------ frames and ends
    def resumed(self, st: StreamState, now: float) -> float:
        """``st`` got its text and goes on: returns the seconds it waited. A listener whose
        buffer ran dry meanwhile starts again from here (its slack restarts at 0)."""
        assert st.waiting_since is not None
        waited = now - st.waiting_since
        st.waiting_since = None
        if st.first_t is not None:
            st.first_t = max(st.first_t, now - st.frames * self.frame_audio_s)
        return waited

    def stepped(self, seconds: float) -> None:
        """One batched frame step took ``seconds`` (the throttle's decode-step estimate)."""
        self.frame_s = 0.8 * self.frame_s + 0.2 * seconds

    def advance(self, st: StreamState, code0: int, now: float) -> FrameEnd:
        """``st`` drew ``code0`` in the last step: count the frame and say whether it ends."""
        if code0 == self.invalid:
            return FrameEnd.INVALID
        st.frames += 1
        if st.first_t is None:
            st.first_t = now
        if code0 == self.eos:
            return FrameEnd.EOS
        if st.frames >= st.max_frames:
            return FrameEnd.LENGTH
        return FrameEnd.NONE

    def release(self, st: StreamState) -> int | None:
        """Forget ``st`` (ended, failed or cancelled): out of the FIFO, its slot free again.
        Returns the slot it held (the runner resets or scrubs it), or None."""
        if st in self.pending:
            self.pending.remove(st)
        slot = st.slot
        if slot is not None and self.slots[slot] is st:
            self.slots[slot] = None
        st.slot = None
        return slot

    def find(self, stream_id: int) -> StreamState | None:
        """The waiting or running stream ``stream_id`` (waiting ones first), or None."""
        for st in self.pending:
            if st.stream_id == stream_id:
                return st
        for st in self.slots:
            if st is not None and st.stream_id == stream_id:
                return st
        return None

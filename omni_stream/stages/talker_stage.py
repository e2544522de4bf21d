"""Talker stage: talker + code predictor over fixed slots, one frame per loop iteration.

Control (AddStream / CancelStream / Shutdown / StatsRequest) arrives on a ControlChannel; frames
leave on the ``frames`` ring as CODES messages ([1, 16] int64, seq = frame index, END on the
last frame). A stream's first message is an EVENT with FIRST set whose payload is a ``StreamStart`` (chunk
policy, codes-only mode, input tokens; msgpack bytes), so the codec never sees a frame of a
stream it has not been told about. Errors for a stream travel in-band as EVENT with
ERROR|END; a cancelled stream gets an EVENT with END and aux=1 (nothing more will come). The
last frame of a stream stopped by its frame cap carries END|LENGTH.

A fault stays with its stream: a prompt that fails to build or prefill, a frame whose codes
fail the engine's checks (``INVALID``), or a frame that cannot be handed on fails that stream
alone (ERROR|END, its slot scrubbed) and the others go on; an exception inside the batched step
fails the streams of that step, never the process.

Streams join the running batch at frame boundaries; slots are taken lowest-first so the step
covers ``[0, highest active + 1)`` with few idle rows.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from omni_stream.checkpoints.io import LoadedModel
from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.models.prompt import Prompt, PromptBuilder, PromptRequest
from omni_stream.engine.sampling import INVALID
from omni_stream.observability import stepstats
from omni_stream.scheduling.throttle import (Action, Decision, PendingPrefill, PrefillCostModel,
                                            RunningStream, decide_prefill, slack_s)
from omni_stream.transport import (AddStream, CancelStream, ChannelClosed, ControlChannel,
                                   FailReason, Flags, MsgKind, Ring, Shutdown, StatsReply,
                                   StatsRequest, StreamStart)
from omni_stream.stages.faults import FaultPlan
from omni_stream.stages.proc import start_stage

log = logging.getLogger(__name__)

CANCELLED = 1  # aux value of the END event of a cancelled stream


class InvalidCode(ValueError):
    """A code failed the engine's check where it was drawn."""


@dataclass
class _Active:
    stream_id: int
    frames: int
    max_frames: int
    first_t: float | None = None  # when its first frame left (the playback clock's origin)


@dataclass
class _Pending:
    msg: AddStream
    arrived: float
    prompt: Prompt | None = None
    slot: int | None = None
    fed: int = 0  # prompt positions already prefilled (chunked prefill)


@dataclass(frozen=True)
class ThrottleSettings:
    """Playback-slack prefill throttling (see omni_stream.scheduling.throttle)."""

    enabled: bool = True
    margin_s: float = 0.12  # covers frames still buffered in the codec stage (not yet delivered)
    max_split_tokens: int = 64
    min_split_tokens: int = 8
    starvation_s: float = 2.0


class TalkerStage:
    def __init__(self, model: LoadedModel, shape: EngineShape, out: Ring,
                 device: str = "cpu", throttle: ThrottleSettings | None = None,
                 faults: FaultPlan | None = None) -> None:
        self.model = model
        self.engine = FrameEngine(model.weights.talker, shape, device=device)
        self._step = self.engine.step  # replaced by a CUDA-graph runner on GPUs (enable_graphs)
        self.builder = PromptBuilder(model.config, model.weights.talker, model.tokenizer)
        self.out = out
        self.eos = model.config.talker.special.codec_eos
        self.frame_audio_s = 1.0 / model.config.frame_rate_hz
        self.free = list(range(shape.max_slots))
        self.active: dict[int, _Active] = {}
        self.pending: collections.deque[_Pending] = collections.deque()
        self.throttle = throttle or ThrottleSettings()
        self.cost = PrefillCostModel(per_token_s=1e-4, fixed_s=1e-3)
        self._cost_samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)
        self.frame_s = 0.05  # EMA of the measured decode-step wall time
        self.decisions: collections.Counter = collections.Counter()
        self.faults = faults or FaultPlan()
        self.failed = 0  # streams failed in this stage (not cancelled)
        self.steps = 0
        self.prefills = 0
        self.step_s = 0.0
        self.prefill_s = 0.0

    # ------------------------------------------------------------------ control
    def handle(self, msg) -> bool:
        """Apply one control message; False on Shutdown."""
        if isinstance(msg, AddStream):
            self.pending.append(_Pending(msg, time.monotonic()))
        elif isinstance(msg, CancelStream):
            self.cancel(msg.stream_id)
        elif isinstance(msg, Shutdown):
            return False
        return True

    def cancel(self, stream_id: int) -> None:
        for pend in list(self.pending):
            if pend.msg.stream_id == stream_id:
                self.pending.remove(pend)
                if pend.slot is not None:
                    self._free_slot(pend.slot)
                self._event(stream_id, Flags.END, aux=CANCELLED)
                return
        for slot, a in list(self.active.items()):
            if a.stream_id == stream_id:
                self._release(slot)
                self._event(stream_id, Flags.END, aux=CANCELLED)
                return

    def enable_graphs(self) -> None:
        """Capture the frame step as CUDA graphs (one per padded batch size)."""
        from omni_stream.engine.graphs import GraphedStep

        self._step = GraphedStep(self.engine, enabled=True).step

    def stats(self) -> dict[str, float]:
        return dict(active=len(self.active), pending=len(self.pending), free_slots=len(self.free),
                    steps=self.steps, prefills=self.prefills, failed=self.failed,
                    step_ms_mean=1e3 * self.step_s / max(self.steps, 1),
                    prefill_ms_mean=1e3 * self.prefill_s / max(self.prefills, 1),
                    prefill_ms_per_token=1e3 * self.cost.per_token_s,
                    **{f"throttle_{k}": v for k, v in self.decisions.items()})

    # ------------------------------------------------------------------ work
    def _event(self, stream_id: int, flags: int, payload: np.ndarray | None = None, aux: int = 0) -> None:
        if not self.out.put(payload, kind=MsgKind.EVENT, stream_id=stream_id, flags=flags, aux=aux,
                            timeout=5.0):
            log.error("stream %d: event %d could not be handed to the codec stage in 5 s",
                      stream_id, flags)

    def _error(self, stream_id: int, text: str, reason: int = FailReason.OTHER) -> None:
        self.failed += 1
        self._event(stream_id, Flags.ERROR | Flags.END,
                    np.frombuffer(text.encode()[:2000], dtype=np.uint8).copy(), aux=reason)

    def _free_slot(self, slot: int) -> None:
        self.engine.release(slot)
        self.free.append(slot)
        self.free.sort()

    def _release(self, slot: int) -> None:
        del self.active[slot]
        self._free_slot(slot)

    def _scrub_slot(self, slot: int) -> None:
        """Free a failed stream's slot and wipe what it may have poisoned (NaN KV rows)."""
        self.engine.scrub(slot)
        self.free.append(slot)
        self.free.sort()

    def _fail(self, pend: _Pending, e: Exception) -> None:
        log.warning("stream %d failed at admission: %s", pend.msg.stream_id, e)
        if pend.slot is not None:
            self._scrub_slot(pend.slot)
        self._error(pend.msg.stream_id, str(e),
                    FailReason.INVALID_CODE if isinstance(e, InvalidCode) else FailReason.OTHER)

    def _fail_active(self, slot: int, text: str, reason: int = FailReason.OTHER) -> None:
        a = self.active.pop(slot)
        log.warning("stream %d failed at frame %d: %s", a.stream_id, a.frames, text)
        self._scrub_slot(slot)
        self._error(a.stream_id, text, reason)

    def _start(self, pend: _Pending) -> None:
        """Build the prompt, take a slot, tell the codec stage about the stream."""
        msg, p = pend.msg, pend.msg.prompt
        req = PromptRequest(text=p.text, language=p.language or "auto", speaker=p.speaker,
                            instructions=p.instructions, stream_text=p.stream_text)
        prompt = self.builder.build(req)
        if prompt.length + msg.max_frames + 1 > self.engine.shape.max_seq_len:
            raise ValueError(f"prompt ({prompt.length}) + max_frames ({msg.max_frames}) exceeds "
                             f"the slot's {self.engine.shape.max_seq_len} positions")
        pend.prompt = prompt
        pend.slot = self.free.pop(0)
        start = StreamStart(msg.chunk, codes_only=msg.stream_codes,
                            input_tokens=len(prompt.text_ids))
        self._event(msg.stream_id, Flags.FIRST, start.to_payload())

    def _feed(self, pend: _Pending, n: int) -> bool:
        """Prefill the next ``n`` prompt positions; True when the stream became active."""
        prompt, msg = pend.prompt, pend.msg
        assert prompt is not None and pend.slot is not None
        final = pend.fed + n >= prompt.length
        n = prompt.length - pend.fed if final else n
        t0 = time.perf_counter()
        code0 = self.engine.prefill(pend.slot, prompt.embeds[pend.fed:pend.fed + n], prompt.trailing,
                                    msg.sampling, msg.seed, start=pend.fed,
                                    final=final)
        dt = time.perf_counter() - t0
        stepstats.record("talker.prefill", dt)
        self.prefill_s += dt
        self._cost_samples.append((n, dt))
        if len({t for t, _ in self._cost_samples}) >= 2:
            self.cost = PrefillCostModel.fit(list(self._cost_samples))
        pend.fed += n
        if not final:
            return False
        self.prefills += 1
        if code0 == INVALID:
            raise InvalidCode("the model produced no valid first code for this stream "
                              "(non-finite logits); the stream was stopped")
        self.pending.remove(pend)
        if code0 == self.eos:  # nothing to say: end at once
            self._free_slot(pend.slot)
            self._event(msg.stream_id, Flags.END)
            return True
        self.active[pend.slot] = _Active(msg.stream_id, 0, msg.max_frames)
        return True

    def _prefill_decision(self, pend: _Pending) -> Decision:
        assert pend.prompt is not None
        left = pend.prompt.length - pend.fed
        th = self.throttle
        if not th.enabled:
            return Decision(Action.RUN, left, 0, reason="throttling off")
        now = time.monotonic()
        running = [RunningStream(slack_s(a.frames * self.frame_audio_s, a.first_t, now))
                   for a in self.active.values()]
        return decide_prefill([PendingPrefill(left, now - pend.arrived)], running, self.cost,
                              self.frame_s, th.margin_s, th.max_split_tokens,
                              min_split_tokens=min(th.min_split_tokens, left),
                              starvation_s=th.starvation_s)

    def _advance_prefill(self) -> bool:
        """Work on the head pending stream (FIFO): start it, then prefill what the running
        streams' playback slack allows. True if anything ran."""
        pend = self.pending[0]
        try:
            if pend.slot is None:
                if not self.free:
                    return False
                self._start(pend)
            d = self._prefill_decision(pend)
            self.decisions[d.action.value] += 1
            if d.action is Action.DEFER:
                return False
            self._feed(pend, d.tokens)
            return True
        except Exception as e:  # bad prompt or engine failure: this stream only
            if pend in self.pending:
                self.pending.remove(pend)
            self._fail(pend, e)
            return True

    @torch.inference_mode()
    def iterate(self) -> bool:
        """Advance the head pending prefill (as far as slack allows), then run one frame for
        every active slot. Returns True if it did any work."""
        did = False
        if self.pending:
            did = self._advance_prefill()
        if not self.active:
            return did
        p = max(self.active) + 1
        if self.faults:
            self._inject_faults()
        t0 = time.perf_counter()
        try:
            codes, code0 = self._step(p)
            codes_np = codes.cpu().numpy()
            nxt = code0.tolist()
        except Exception as e:  # not attributable to one stream: fail this step's streams only
            log.exception("frame step failed; failing its %d streams", len(self.active))
            for slot in list(self.active):
                self._fail_active(slot, f"synthesis failed in the talker stage: {e}")
            return True
        dt = time.perf_counter() - t0
        stepstats.record("talker.step", dt)
        self.frame_s = 0.8 * self.frame_s + 0.2 * dt
        self.step_s += dt
        self.steps += 1
        t_ns = time.monotonic_ns()
        t_emit = time.perf_counter()
        now = time.monotonic()
        for slot, a in list(self.active.items()):
            if nxt[slot] == INVALID:
                self._fail_active(slot, f"the model produced an invalid code at frame {a.frames} "
                                  "(non-finite logits); the stream was stopped",
                                  FailReason.INVALID_CODE)
                continue
            a.frames += 1
            if a.first_t is None:
                a.first_t = now
            flags = 0
            if nxt[slot] == self.eos:
                flags = Flags.END
            elif a.frames >= a.max_frames:
                flags = Flags.END | Flags.LENGTH
            if not self.out.put(codes_np[slot:slot + 1], kind=MsgKind.CODES, stream_id=a.stream_id,
                                seq=a.frames - 1, flags=flags, enqueue_ns=t_ns, timeout=5.0):
                self._fail_active(slot, "the codec stage did not take a frame within 5 s")
                continue
            if flags:
                self._release(slot)
        stepstats.record("talker.emit", time.perf_counter() - t_emit)
        return True


    def _inject_faults(self) -> None:
        """Planned faults (``stages.faults``): poison the inputs of one stream's next frame."""
        for slot, a in self.active.items():
            if self.faults.fires("talker", a.stream_id, a.frames):
                self.engine.trailing[slot] = float("nan")
            if self.faults.fires("code_predictor", a.stream_id, a.frames):
                self.engine.last_hidden[slot] = float("nan")


@dataclass(frozen=True)
class StageSpec:
    """Picklable description of how a stage process loads its model."""

    model_path: str
    dtype: str = "float32"
    max_slots: int = 4
    max_seq_len: int = 2048
    threads: int = 1
    device: str = "cpu"
    throttle: bool = True
    cpus: tuple[int, ...] = ()  # pin the stage to these CPUs (empty: no pinning)
    weight_path: str | None = None  # None: weights in dtype; int8/int4: models.quant
    compile: bool = False  # torch.compile the decoder steps (models.compiled)


def run_talker_stage(spec: StageSpec, ctrl: ControlChannel, frames_handle,
                     cp_handles: tuple | None = None) -> None:
    """Process entry point. ``cp_handles`` (to_cp producer, from_cp consumer) selects the split
    placement: the code predictor runs in its own stage process."""
    start_stage("talker", spec)
    from omni_stream.engine.loading import load_model

    out = frames_handle.open()
    model = load_model(spec.model_path, dtype=getattr(torch, spec.dtype), device=spec.device,
                       weight_path=spec.weight_path)
    stage = TalkerStage(model, EngineShape(max_slots=spec.max_slots, max_seq_len=spec.max_seq_len),
                        out, device=spec.device, throttle=ThrottleSettings(enabled=spec.throttle),
                        faults=FaultPlan.from_env())
    if spec.compile:
        from omni_stream.engine.compiled import compile_engine, warm_up

        compile_engine(stage.engine)
        warm_up(stage.engine)
    if spec.device.startswith("cuda") and cp_handles is None:
        stage.enable_graphs()
    if cp_handles is not None:
        from omni_stream.stages.cp_stage import RemoteResidual

        remote = RemoteResidual(stage.engine, cp_handles[0].open(), cp_handles[1].open())
        remote.wait_ready(timeout=300)
        stage.engine.residual_fn = remote
    stage.engine.residual_fn = _timed(stage.engine.residual_fn, "talker.code_predictor")
    ctrl.send(StatsReply(stage="talker", pid=_pid(), stats={"ready": 1}))
    try:
        running = True
        last_push = time.monotonic()
        pushed: dict = stepstats.snapshot()
        while running:
            busy = bool(stage.active or stage.pending)
            msg = ctrl.recv(timeout=0 if busy else 0.05)
            t_top = time.perf_counter()
            steps_before = stage.steps
            while msg is not None and running:
                if isinstance(msg, StatsRequest):
                    ctrl.send(StatsReply(stage="talker", pid=_pid(), request_id=msg.request_id,
                                         stats=stage.stats()))
                else:
                    running = stage.handle(msg)
                msg = ctrl.recv(timeout=0) if running else None
            stepstats.record("talker.control", time.perf_counter() - t_top)
            if running:
                stage.iterate()
                if stage.steps != steps_before:
                    stepstats.record("frame.total", time.perf_counter() - t_top)
            if time.monotonic() - last_push >= 1.0:  # ship new timings to the server's /metrics
                snap = stepstats.snapshot()
                delta = stepstats.diff_snapshots(snap, pushed)
                if delta.get("phases"):
                    ctrl.send(StatsReply(stage="talker", pid=_pid(), request_id=-1,
                                         stats=stepstats.flatten_snapshot(delta)))
                pushed, last_push = snap, time.monotonic()
    except ChannelClosed:
        log.info("control channel closed: exiting")
    finally:
        stepstats.dump()
        out.close()


def _timed(fn, name: str):
    def wrapped(p: int):
        with stepstats.phase(name):
            return fn(p)
    return wrapped


def _pid() -> int:
    import os

    return os.getpid()

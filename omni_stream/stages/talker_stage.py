"""Talker stage: talker + code predictor over fixed slots, one frame per loop iteration.

Control (AddStream / CancelStream / Shutdown / StatsRequest) arrives on a ControlChannel; frames
leave on the ``frames`` ring as CODES messages ([1, 16] int64, seq = frame index, END on the
last frame). A stream's first message is an EVENT with FIRST set whose payload carries what the
codec stage needs to know about it (chunk schedule, codes-only mode), so the codec never sees a
frame of a stream it has not been told about. Errors for a stream travel in-band as EVENT with
ERROR|END; a cancelled stream gets an EVENT with END and aux=1 (nothing more will come).

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

from omni_stream.models.checkpoint import LoadedModel
from omni_stream.models.frame import EngineShape, FrameEngine
from omni_stream.models.prompt import PromptBuilder, PromptRequest
from omni_stream.models.sampling import SamplingParams
from omni_stream.observability import stepstats
from omni_stream.transport import (AddStream, CancelStream, ChannelClosed, ControlChannel, Flags,
                                   MsgKind, Ring, Shutdown, StatsReply, StatsRequest)

log = logging.getLogger(__name__)

CANCELLED = 1  # aux value of the END event of a cancelled stream


@dataclass
class _Active:
    stream_id: int
    frames: int
    max_frames: int


class TalkerStage:
    def __init__(self, model: LoadedModel, shape: EngineShape, out: Ring,
                 device: str = "cpu") -> None:
        self.model = model
        self.engine = FrameEngine(model.weights.talker, shape, device=device)
        self.builder = PromptBuilder(model.config, model.weights.talker, model.tokenizer)
        self.out = out
        self.eos = model.config.talker.special.codec_eos
        self.free = list(range(shape.max_slots))
        self.active: dict[int, _Active] = {}
        self.pending: collections.deque[AddStream] = collections.deque()
        self.steps = 0
        self.prefills = 0
        self.step_s = 0.0
        self.prefill_s = 0.0

    # ------------------------------------------------------------------ control
    def handle(self, msg) -> bool:
        """Apply one control message; False on Shutdown."""
        if isinstance(msg, AddStream):
            self.pending.append(msg)
        elif isinstance(msg, CancelStream):
            self.cancel(msg.stream_id)
        elif isinstance(msg, Shutdown):
            return False
        return True

    def cancel(self, stream_id: int) -> None:
        for m in list(self.pending):
            if m.stream_id == stream_id:
                self.pending.remove(m)
                self._event(stream_id, Flags.END, aux=CANCELLED)
                return
        for slot, a in list(self.active.items()):
            if a.stream_id == stream_id:
                self._release(slot)
                self._event(stream_id, Flags.END, aux=CANCELLED)
                return

    def stats(self) -> dict[str, float]:
        return dict(active=len(self.active), pending=len(self.pending), free_slots=len(self.free),
                    steps=self.steps, prefills=self.prefills,
                    step_ms_mean=1e3 * self.step_s / max(self.steps, 1),
                    prefill_ms_mean=1e3 * self.prefill_s / max(self.prefills, 1))

    # ------------------------------------------------------------------ work
    def _event(self, stream_id: int, flags: int, payload: np.ndarray | None = None, aux: int = 0) -> None:
        self.out.put(payload, kind=MsgKind.EVENT, stream_id=stream_id, flags=flags, aux=aux, timeout=5.0)

    def _release(self, slot: int) -> None:
        self.engine.release(slot)
        del self.active[slot]
        self.free.append(slot)
        self.free.sort()

    def _admit(self, msg: AddStream) -> None:
        slot = self.free.pop(0)
        p = msg.prompt
        t0 = time.perf_counter()
        try:
            req = PromptRequest(text=str(p.get("text", "")), language=str(p.get("language") or "auto"),
                                speaker=p.get("speaker"), instructions=p.get("instructions"),
                                stream_text=bool(p.get("stream_text", False)))
            prompt = self.builder.build(req)
            if prompt.length + msg.max_frames + 1 > self.engine.shape.max_seq_len:
                raise ValueError(f"prompt ({prompt.length}) + max_frames ({msg.max_frames}) exceeds "
                                 f"the slot's {self.engine.shape.max_seq_len} positions")
            info = np.asarray(list(p.get("chunk", [1, 2000, 8])) + [int(bool(p.get("stream_codes"))),
                              len(prompt.text_ids)], dtype=np.int64)
            self._event(msg.stream_id, Flags.FIRST, info)
            code0 = self.engine.prefill(slot, prompt.embeds, prompt.trailing,
                                        SamplingParams(**msg.sampling()), msg.seed)
        except Exception as e:  # bad prompt or engine failure: this stream only
            log.warning("stream %d failed at admission: %s", msg.stream_id, e)
            self.free.insert(0, slot)
            self.free.sort()
            self._event(msg.stream_id, Flags.ERROR | Flags.END,
                        np.frombuffer(str(e).encode()[:2000], dtype=np.uint8).copy())
            return
        dt = time.perf_counter() - t0
        stepstats.record("talker.prefill", dt)
        self.prefill_s += dt
        self.prefills += 1
        if code0 == self.eos:  # nothing to say: end at once
            self.free.insert(0, slot)
            self.free.sort()
            self._event(msg.stream_id, Flags.END)
            return
        self.active[slot] = _Active(msg.stream_id, 0, msg.max_frames)

    @torch.inference_mode()
    def iterate(self) -> bool:
        """Admit at most one pending stream, then run one frame for every active slot.
        Returns True if it did any work."""
        did = False
        if self.pending and self.free:
            self._admit(self.pending.popleft())
            did = True
        if not self.active:
            return did
        p = max(self.active) + 1
        t0 = time.perf_counter()
        codes, code0 = self.engine.step(p)
        codes_np = codes.cpu().numpy()
        nxt = code0.tolist()
        dt = time.perf_counter() - t0
        stepstats.record("talker.step", dt)
        self.step_s += dt
        self.steps += 1
        t_ns = time.monotonic_ns()
        t_emit = time.perf_counter()
        for slot, a in list(self.active.items()):
            a.frames += 1
            last = nxt[slot] == self.eos or a.frames >= a.max_frames
            self.out.put(codes_np[slot:slot + 1], kind=MsgKind.CODES, stream_id=a.stream_id,
                         seq=a.frames - 1, flags=Flags.END if last else 0, enqueue_ns=t_ns,
                         timeout=5.0)
            if last:
                self._release(slot)
        stepstats.record("talker.emit", time.perf_counter() - t_emit)
        return True


@dataclass(frozen=True)
class StageSpec:
    """Picklable description of how a stage process loads its model."""

    model_path: str
    dtype: str = "float32"
    max_slots: int = 4
    max_seq_len: int = 2048
    threads: int = 1
    device: str = "cpu"


def run_talker_stage(spec: StageSpec, ctrl: ControlChannel, frames_handle,
                     cp_handles: tuple | None = None) -> None:
    """Process entry point. ``cp_handles`` (to_cp producer, from_cp consumer) selects the split
    placement: the code predictor runs in its own stage process."""
    from omni_stream.models.checkpoint import load_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s talker: %(message)s")
    torch.set_num_threads(spec.threads)
    stepstats.configure("talker")
    out = frames_handle.open()
    model = load_model(spec.model_path, dtype=getattr(torch, spec.dtype), device=spec.device)
    stage = TalkerStage(model, EngineShape(max_slots=spec.max_slots, max_seq_len=spec.max_seq_len),
                        out, device=spec.device)
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

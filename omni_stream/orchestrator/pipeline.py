"""The stage processes and their rings, and the supervisor that keeps them running.

A :class:`Pipeline` is one incarnation: the talker (+ code predictor, or a code-predictor
process of its own with the split placement) and the codec stage, the shared-memory rings
between them and the control pipe to the talker. It is replaced whole when a stage dies.

The :class:`Supervisor` runs one incarnation at a time. Its reader thread drains the audio
ring (handing each message to the backend), relays the stages' timing pushes into this
process's step-timing listeners (the server's /metrics), and checks every ~0.1 s that every
stage is alive; when one is not, the streams in flight are failed (``on_lost``), the
incarnation is torn down and a new one started, at most 5 times a minute.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from typing import Callable

from omni_stream.contract import BackendError
from omni_stream.observability import stepstats
from omni_stream.orchestrator.settings import PipelineSettings
from omni_stream.stages.codec_proc import run_codec_stage
from omni_stream.stages.codec_stage import READY_STREAM_ID
from omni_stream.stages.cp_stage import run_cp_stage
from omni_stream.stages.proc import StageSpec
from omni_stream.stages.talker_proc import run_talker_stage
from omni_stream.transport import (ChannelClosed, ControlChannel, Message, Ring, Shutdown,
                                   StatsReply)

log = logging.getLogger(__name__)

MAX_RESTARTS_PER_MINUTE = 5


def stage_specs(s: PipelineSettings) -> dict[str, StageSpec]:
    """What each stage process runs with: 'talker', 'codec', and 'cp' with the split placement."""
    specs = {
        "talker": StageSpec(model_path=s.model_path, dtype=s.dtype, max_slots=s.max_streams,
                            max_seq_len=s.max_seq_len, threads=s.talker_threads, device=s.device,
                            weight_path=s.weight_path, compile=s.compile, throttle=s.throttle,
                            cuda_graphs=s.cuda_graphs, engine=s.engine,
                            speculative_cp=s.speculative_cp,
                            cpus=tuple(s.cpu_sets.get("talker", ())),
                            lent_cpus=tuple(s.cpu_sets.get("codec", ())) if s.lend_cores else ()),
        "codec": StageSpec(model_path=s.model_path, dtype=s.decode_dtype, max_slots=s.max_streams,
                           threads=s.codec_threads, device=s.device,
                           cpus=tuple(s.cpu_sets.get("codec", ())), lends_cores=s.lend_cores),
    }
    if s.placement == "split":
        specs["cp"] = StageSpec(model_path=s.model_path, dtype=s.dtype, max_slots=s.max_streams,
                                threads=s.cp_threads, device=s.device, weight_path=s.weight_path,
                                compile=s.compile, engine=s.engine,
                                cpus=tuple(s.cpu_sets.get("cp", ())))
    return specs


class Pipeline:
    """One incarnation of the stage processes and rings (replaced whole on a crash)."""

    def __init__(self, s: PipelineSettings) -> None:
        specs = stage_specs(s)
        ctx = mp.get_context("spawn")
        self.frames = Ring.create("frames", 8 << 20)
        self.audio = Ring.create("audio", 32 << 20, role="consumer")
        self.ctrl, child_ctrl = ControlChannel.pair(ctx)
        # the codec stage's own control path (cost measurement: orchestrator.costs), apart from
        # its data rings
        self.codec_ctrl, codec_child_ctrl = ControlChannel.pair(ctx)
        self.rings = [self.frames, self.audio]
        cp_handles = None
        self.cp = None
        if s.placement == "split":
            to_cp, from_cp = Ring.create("cp_in", 4 << 20), Ring.create("cp_out", 1 << 20)
            self.rings += [to_cp, from_cp]
            cp_handles = (to_cp.handle("producer"), from_cp.handle("consumer"))
            self.cp = ctx.Process(target=run_cp_stage, name="omni-code-predictor", daemon=True,
                                  args=(specs["cp"], to_cp.handle("consumer"),
                                        from_cp.handle("producer")))
        self.talker = ctx.Process(target=run_talker_stage, name="omni-talker", daemon=True,
                                  args=(specs["talker"], child_ctrl,
                                        self.frames.handle("producer"), cp_handles))
        self.codec = ctx.Process(target=run_codec_stage, name="omni-codec", daemon=True,
                                 args=(specs["codec"], codec_child_ctrl,
                                       self.frames.handle("consumer"),
                                       self.audio.handle("producer")))
        self.procs = [p for p in (self.talker, self.cp, self.codec) if p is not None]
        for p in self.procs:
            p.start()
        child_ctrl.close()
        codec_child_ctrl.close()
        self.lock = threading.Lock()  # control sends come from the loop thread and the reader

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        msg = self.ctrl.recv(timeout=timeout)
        if not isinstance(msg, StatsReply):
            raise RuntimeError(f"talker stage did not start (got {msg!r}); see its log")
        while time.monotonic() < deadline:
            m = self.audio.get(timeout=0.5)
            if m is not None and m.stream_id == READY_STREAM_ID:
                return
            if not self.codec.is_alive():
                break
        raise RuntimeError("codec stage did not start; see its log")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def send(self, msg, stage: str = "talker") -> None:
        """A control message to ``stage`` ("talker": every stream's lifecycle, stats and
        costs; "codec": its cost measurement)."""
        with self.lock:
            (self.codec_ctrl if stage == "codec" else self.ctrl).send(msg)

    def close(self) -> None:
        try:
            self.send(Shutdown(reason="server closing"))
        except (ChannelClosed, OSError):
            pass
        for p in self.procs:
            p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join(timeout=3)
        self.ctrl.close()
        self.codec_ctrl.close()
        for r in self.rings:
            r.close()
            r.unlink()


class Supervisor:
    """Runs one :class:`Pipeline` at a time (see the module docstring). ``on_audio(m)`` gets
    every message of the audio ring, on the reader thread; ``on_lost(err)`` is called once per
    lost incarnation with the error its streams in flight must end with."""

    def __init__(self, settings: PipelineSettings, on_audio: Callable[[Message], None],
                 on_lost: Callable[[BackendError], None],
                 on_reply: Callable[[StatsReply], None] | None = None) -> None:
        self.s = settings
        self.on_audio = on_audio
        self.on_lost = on_lost
        self.on_reply = on_reply  # stage answers to requests (reader thread)
        self.pipe: Pipeline | None = None  # None while (re)starting or after a give-up
        self.restarts = 0
        self._restart_times: list[float] = []
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()
        self.closing = False

    def start(self) -> None:
        """Start an incarnation and its reader (blocking: waits until the stages are ready)."""
        pipe = Pipeline(self.s)
        try:
            pipe.wait_ready(self.s.start_timeout_s)
        except Exception:
            pipe.close()
            raise
        self.pipe = pipe
        self._stop.clear()
        self._reader = threading.Thread(target=self._read_loop, args=(pipe,),
                                        name="omni-audio-reader", daemon=True)
        self._reader.start()
        log.info("pipeline ready (talker pid %d, codec pid %d)", pipe.talker.pid, pipe.codec.pid)

    def close(self) -> None:
        """Stop the reader and the running incarnation (blocking)."""
        self.closing = True
        self._stop.set()
        if self._reader is not None:
            self._reader.join(5)
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None

    def _read_loop(self, pipe: Pipeline) -> None:
        last_check = time.monotonic()
        while not self._stop.is_set():
            m = pipe.audio.get(timeout=0.05)
            if m is not None:
                stepstats.record_ns("hop.audio.enqueue_put", m.enqueue_ns, m.put_ns)
                stepstats.record_ns("hop.audio.put_get", m.put_ns, m.get_ns)
                self.on_audio(m)
            now = time.monotonic()
            if now - last_check >= 0.1:
                last_check = now
                self._drain_control(pipe)
                if not pipe.alive():
                    self._recover(pipe)
                    return

    def _drain_control(self, pipe: Pipeline) -> None:
        """Stage timing pushes (StatsReply with request_id -1) -> this process's /metrics; the
        stages' answers to requests -> ``on_reply``."""
        for ch in (pipe.ctrl, pipe.codec_ctrl):
            try:
                while (msg := ch.recv(timeout=0)) is not None:
                    if isinstance(msg, StatsReply) and msg.request_id == -1:
                        replay_stage_timings(msg.stats, msg.stage, msg.pid)
                    elif isinstance(msg, StatsReply) and self.on_reply is not None:
                        self.on_reply(msg)
            except (ChannelClosed, OSError):
                pass

    def _recover(self, pipe: Pipeline) -> None:
        time.sleep(0.2)  # a shutdown signal that also hit the stages is noticed here first
        dead = [p.name for p in pipe.procs if not p.is_alive()]
        self.pipe = None
        closing = self.closing or self._stop.is_set()
        if closing:
            log.info("stage processes exited during shutdown (%s)", ", ".join(dead))
        else:
            log.error("stage process died (%s): failing the streams in flight and restarting",
                      ", ".join(dead))
        self.on_lost(BackendError(503 if closing else 500, "stage_failed",
                                  f"a pipeline stage ({', '.join(dead)}) stopped; the stream was "
                                  "aborted, retry the request", retry_after=2 if closing else None))
        pipe.close()
        if closing:
            return
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < 60] + [now]
        if len(self._restart_times) > MAX_RESTARTS_PER_MINUTE:
            log.error("stages died 6 times within a minute: not restarting again; the server "
                      "answers 503 until it is restarted (see the stage logs)")
            return
        self.restarts += 1
        try:
            self.start()
        except Exception as e:  # keep serving errors rather than dying
            log.error("pipeline restart failed: %s", e)


def replay_stage_timings(flat: dict, stage: str, pid: int) -> None:
    """Feed a stage's timing delta to this process's step-timing listeners (the server's
    Prometheus histograms): one sample per recorded phase event, at its histogram bin's
    geometric centre. Not recorded in this process's own stepstats registry."""
    snap = stepstats.unflatten_snapshot(flat, stage, pid)
    for name, p in snap["phases"].items():
        for b, n in p["bins"]:
            lo, hi = stepstats.bin_edges(b)
            centre = (lo * hi) ** 0.5 if lo > 0 and hi != float("inf") else (hi if lo == 0 else lo)
            for _ in range(min(int(n), 1000)):
                stepstats.notify(name, centre)

"""Talker stage: talker + code predictor over fixed slots, one frame per loop iteration.

Control (AddStream / CancelStream / Shutdown / StatsRequest) arrives on a ControlChannel; frames
leave on the ``frames`` ring as CODES messages ([1, 16] int64, seq = frame index, END on the
last frame). A stream's first message is an EVENT with FIRST set whose payload is a
``StreamStart`` (chunk policy, codes-only mode, input tokens; msgpack bytes), so the codec never
sees a frame of a stream it has not been told about. Errors for a stream travel in-band as EVENT
with ERROR|END; a cancelled stream gets an EVENT with END and aux=1 (nothing more will come).
The last frame of a stream stopped by its frame cap carries END|LENGTH.

A fault stays with its stream: a prompt that fails to build or prefill, a frame whose codes
fail the engine's checks (``INVALID``), or a frame that cannot be handed on fails that stream
alone (ERROR|END, its slot scrubbed) and the others go on; an exception inside the batched step
fails the streams of that step, never the process. Planned faults (``stages.faults``) poison
one stream's inputs to exercise exactly these paths.

The decisions (slots, the pending FIFO, prefill throttling, which streams end) are the
:class:`~omni_stream.stages.talker_scheduler.TalkerScheduler`'s, plain Python; this module is
the runner (engine calls, ring writes); ``talker_proc`` is the process around it. Streams join the running batch at
frame boundaries; slots are taken lowest-first so the step covers ``[0, highest active + 1)``
with few idle rows. On a GPU the step can run as CUDA graphs (``enable_graphs``); with the
split placement the code predictor answers from its own process (``cp_stage.RemoteResidual``).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from omni_stream.checkpoints.io import LoadedModel
from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.models.prompt import PromptBuilder, PromptRequest
from omni_stream.models.voice_clone import VoiceClone
from omni_stream.engine.sampling import INVALID
from omni_stream.observability import stepstats
from omni_stream.scheduling.attribution import talker_phase_sums
from omni_stream.scheduling.throttle import Action, PrefillCostModel
from omni_stream.stages.talker_scheduler import (FrameEnd, StreamState, TalkerScheduler,
                                                 ThrottleSettings)
from omni_stream.transport import (AddStream, AppendText, CancelStream, CostUpdate, FailReason,
                                   Flags, MsgKind, PromptSpec, Ring, Shutdown, StreamStart)
from omni_stream.stages.emulate import Emulation
from omni_stream.stages.faults import FaultPlan

log = logging.getLogger(__name__)

CANCELLED = 1  # aux value of the END event of a cancelled stream
_END_FLAGS = {FrameEnd.NONE: 0, FrameEnd.EOS: Flags.END, FrameEnd.LENGTH: Flags.END | Flags.LENGTH}


def prompt_request(p: PromptSpec, clone: VoiceClone | None, *, text_open: bool,
                   text_ids: tuple[int, ...] | None = None) -> PromptRequest:
    """The prompt ``p`` asks for, with the ids the server tokenized (``text_ids``: a continuous
    stream's text so far, in place of ``p.text_ids``)."""
    def ids(got: list[int] | None) -> tuple[int, ...] | None:
        return None if got is None else tuple(got)

    return PromptRequest(text=p.text, language=p.language or "auto", speaker=p.speaker,
                         instructions=p.instructions, stream_text=p.stream_text or p.continuous,
                         clone=clone, text_ids=ids(p.text_ids) if text_ids is None else text_ids,
                         text_open=text_open, role_ids=ids(p.role_ids),
                         instruct_ids=ids(p.instruct_ids), ref_ids=ids(p.ref_ids))


class InvalidCode(ValueError):
    """A code failed the engine's check where it was drawn."""


class TalkerStage:
    """The runner: engine calls (prompt build, prefill pieces, the batched frame step, slot
    reset and scrub) and the frames ring, driven by a :class:`TalkerScheduler`."""

    def __init__(self, model: LoadedModel, shape: EngineShape, out: Ring,
                 device: str = "cpu", throttle: ThrottleSettings | None = None,
                 faults: FaultPlan | None = None) -> None:
        self.model = model
        self.engine = FrameEngine(model.weights.talker, shape, device=device)
        self._step = self.engine.step  # replaced by a CUDA-graph runner on GPUs (enable_graphs)
        self.builder = PromptBuilder(model.config, model.weights.talker, model.tokenizer)
        self.out = out
        self.sched = TalkerScheduler(shape.max_slots, eos=model.config.talker.special.codec_eos,
                                     invalid=INVALID,
                                     frame_audio_s=1.0 / model.config.frame_rate_hz,
                                     throttle=throttle)
        self.faults = faults or FaultPlan()
        self.emulation = Emulation()  # OMNI_STREAM_EMULATE_COSTS: a slower machine, on purpose
        self.failed = 0  # streams failed in this stage (not cancelled)
        self.steps = 0
        self.prefills = 0
        self.step_s = 0.0
        self.prefill_s = 0.0

    # ------------------------------------------------------------------ control
    def handle(self, msg) -> bool:
        """Apply one control message; False on Shutdown."""
        if isinstance(msg, AddStream):
            st = self.sched.submit(msg.stream_id, msg.max_frames, msg)
            st.text_open = msg.prompt.continuous
        elif isinstance(msg, AppendText):
            st = self.sched.find(msg.stream_id)
            if st is not None and st.text_open:  # else: gone, or a duplicate close
                st.new_ids.extend(msg.ids)
                st.close_pending |= msg.close
        elif isinstance(msg, CancelStream):
            self.cancel(msg.stream_id)
        elif isinstance(msg, CostUpdate):
            self.set_costs(msg)
        elif isinstance(msg, Shutdown):
            return False
        return True

    def cancel(self, stream_id: int) -> None:
        st = self.sched.find(stream_id)
        if st is None:
            return
        slot = self.sched.release(st)
        if slot is not None:
            self.engine.release(slot)
        self._event(stream_id, Flags.END, aux=CANCELLED)

    def set_costs(self, msg: CostUpdate) -> None:
        """The deployment's measured costs seed the prefill throttle (it refits from the
        prefills it runs from then on)."""
        self.sched.cost = PrefillCostModel(per_token_s=msg.prefill_token_s,
                                           fixed_s=msg.prefill_fixed_s)
        self.sched.frame_s = msg.frame_s

    @torch.inference_mode()
    def measure(self) -> dict[str, float]:
        """Time the frame step alone at each batch size up to the slot count, and the prefill
        (``edge.measure``). Run only while no stream is in a slot (the backend measures before
        it admits any, then asks the codec stage for its own)."""
        from omni_stream.edge.measure import measure_frame_steps

        assert not any(self.sched.slots), "measure() needs every slot free"
        frame_s, prefills = measure_frame_steps(self.engine, self._frame,
                                                self.engine.shape.max_slots)
        self.sched.cost = cost = PrefillCostModel.fit(prefills)
        self.sched.frame_s = frame_s[0]
        out = {f"frame_s_{i + 1}": v for i, v in enumerate(frame_s)}
        return dict(out, prefill_fixed_s=cost.fixed_s, prefill_token_s=cost.per_token_s,
                    emulated=int(self.emulation.active))

    def _frame(self, p: int, streams: int | None = None):
        """One frame step over ``p`` rows (``streams`` of them decoding), padded to the
        emulated machine's cost when one is set."""
        t0 = time.perf_counter()
        out = self._step(p)
        if self.emulation.active:
            self.emulation.pad(time.perf_counter() - t0, p if streams is None else streams)
        return out

    def enable_graphs(self) -> None:
        """Capture the frame step as CUDA graphs (one per padded batch size)."""
        from omni_stream.engine.graphs import GraphedStep

        self._step = GraphedStep(self.engine, enabled=True).step

    def busy(self) -> bool:
        return self.sched.busy()

    def stats(self) -> dict[str, float]:
        sc = self.sched
        lent = self.engine.runtime.stats()  # e.g. jobs run on lent cores (the CPU runtime)
        # the cumulative phase sums the server's part attribution reads (scheduling.attribution)
        parts = talker_phase_sums(stepstats.snapshot()["phases"])
        return dict(**lent,active=len(sc.decoding()), pending=len(sc.pending), free_slots=sc.free_slots(),
                    steps=self.steps, prefills=self.prefills, failed=self.failed,
                    step_ms_mean=1e3 * self.step_s / max(self.steps, 1),
                    prefill_ms_mean=1e3 * self.prefill_s / max(self.prefills, 1),
                    prefill_ms_per_token=1e3 * sc.cost.per_token_s,
                    **{f"throttle_{k}": v for k, v in sc.decisions.items()}, **parts)

    # ------------------------------------------------------------------ events
    def _event(self, stream_id: int, flags: int, payload: np.ndarray | None = None, aux: int = 0) -> None:
        if not self.out.put(payload, kind=MsgKind.EVENT, stream_id=stream_id, flags=flags, aux=aux,
                            timeout=5.0):
            log.error("stream %d: event %d could not be handed to the codec stage in 5 s",
                      stream_id, flags)

    def _error(self, stream_id: int, text: str, reason: int = FailReason.OTHER) -> None:
        self.failed += 1
        self._event(stream_id, Flags.ERROR | Flags.END,
                    np.frombuffer(text.encode()[:2000], dtype=np.uint8).copy(), aux=reason)

    def _fail(self, st: StreamState, text: str, reason: int = FailReason.OTHER) -> None:
        """Fail one stream: free its slot, wiping what it may have poisoned (NaN KV rows)."""
        if st.decoding:
            log.warning("stream %d failed at frame %d: %s", st.stream_id, st.frames, text)
        else:
            log.warning("stream %d failed at admission: %s", st.stream_id, text)
        slot = self.sched.release(st)
        if slot is not None:
            self.engine.scrub(slot)
        self._error(st.stream_id, text, reason)

    # ------------------------------------------------------------------ prefill
    def _start(self, st: StreamState) -> bool:
        """Build the prompt, take a slot, tell the codec stage about the stream. False when no
        slot is free (the stream waits)."""
        if not self.sched.free_slots():
            return False
        msg, p = st.request, st.request.prompt
        clone = VoiceClone(*p.clone.arrays(), p.clone.ref_text) if p.clone is not None else None
        text_ids = None
        if p.continuous:  # the text so far, with what arrived since the AddStream
            text_ids = tuple(p.text_ids or ()) + tuple(st.new_ids)
            st.new_ids = []
            st.text_open = not st.close_pending
            st.close_pending = False
            st.text_len = len(text_ids)
            self._cap(st)
        prompt = self.builder.build(prompt_request(p, clone, text_open=st.text_open,
                                                   text_ids=text_ids))
        st.rows_in = int(prompt.trailing.shape[0])
        if prompt.length + msg.max_frames + 1 > self.engine.shape.max_seq_len:
            raise ValueError(f"prompt ({prompt.length}) + max_frames ({msg.max_frames}) exceeds "
                             f"the slot's {self.engine.shape.max_seq_len} positions")
        st.prompt = prompt
        self.sched.assign(st, prompt.length)
        prime = clone.prime_codes() if clone is not None else None
        start = StreamStart(msg.chunk, codes_only=msg.stream_codes,
                            input_tokens=len(prompt.text_ids),
                            prime_codes=b"" if prime is None else prime.astype("<i8").tobytes())
        self._event(msg.stream_id, Flags.FIRST, start.to_payload())
        return True

    def _cap(self, st: StreamState) -> None:
        """A continuous stream's frame cap follows its text so far."""
        msg = st.request
        if msg.text_cap is not None:
            st.max_frames = min(msg.max_frames, msg.text_cap.frames(st.text_len))

    def _feed_text(self, st: StreamState) -> None:
        """Move ``st``'s newly arrived text (and its close: tts_eos) into the engine."""
        ids, close = st.new_ids, st.close_pending
        rows = self.builder.text_rows(ids, eos=close)
        self.engine.append_trailing(st.slot, rows)
        st.rows_in += int(rows.shape[0])
        st.text_len += len(ids)
        st.new_ids, st.close_pending = [], False
        if close:
            st.text_open = False
        self._cap(st)

    def _wait_for_text(self, running: list[StreamState]) -> list[StreamState]:
        """Feed arrived text to the running streams; return those that must sit out this step
        (no text row for it yet), telling the codec stage when one starts or stops waiting."""
        now = time.monotonic()
        held = []
        for st in list(running):
            if st.new_ids or st.close_pending:
                try:
                    self._feed_text(st)
                except ValueError as e:  # past the engine's text rows: this stream only
                    self._fail(st, str(e))
                    running.remove(st)
                    continue
            if st.starved():
                held.append(st)
                if st.waiting_since is None:
                    st.waiting_since = now
                    self._event(st.stream_id, Flags.WAIT, aux=st.frames)
            elif st.waiting_since is not None:
                waited = self.sched.resumed(st, now)
                stepstats.record("talker.text_wait", waited)
                self._event(st.stream_id, Flags.RESUME, aux=round(waited * 1e3))
        return held

    def _feed(self, st: StreamState, tokens: int) -> None:
        """Prefill the next piece of ``st``'s prompt; the last piece makes it decode."""
        prompt, msg = st.prompt, st.request
        assert prompt is not None and st.slot is not None
        n, final = self.sched.piece(st, tokens)
        t0 = time.perf_counter()
        code0 = self.engine.prefill(st.slot, prompt.embeds[st.fed:st.fed + n], prompt.trailing,
                                    msg.sampling, msg.seed, start=st.fed, final=final,
                                    total=len(prompt.embeds))
        dt = time.perf_counter() - t0
        stepstats.record("talker.prefill", dt)
        self.prefill_s += dt
        self.sched.prefilled(st, n, dt)
        if not final:
            return
        self.prefills += 1
        if code0 == INVALID:
            raise InvalidCode("the model produced no valid first code for this stream "
                              "(non-finite logits); the stream was stopped")
        if code0 == self.sched.eos:  # nothing to say: end at once
            self.engine.release(self.sched.release(st))
            self._event(msg.stream_id, Flags.END)
            return
        self.sched.start_decoding(st)

    def _advance_prefill(self) -> bool:
        """Work on the head pending stream (FIFO): start it, then prefill what the running
        streams' playback slack allows. True if anything ran."""
        st = self.sched.head()
        assert st is not None
        try:
            if st.slot is None and not self._start(st):
                return False
            d = self.sched.decide(st)
            if d.action is Action.DEFER:
                return False
            self._feed(st, d.tokens)
            return True
        except Exception as e:  # bad prompt or engine failure: this stream only
            self._fail(st, str(e),
                       FailReason.INVALID_CODE if isinstance(e, InvalidCode) else FailReason.OTHER)
            return True

    # ------------------------------------------------------------------ frames
    @torch.inference_mode()
    def iterate(self) -> bool:
        """Advance the head pending prefill (as far as slack allows), then run one frame for
        every decoding slot. Returns True if it did any work."""
        did = False
        if self.sched.pending:
            did = self._advance_prefill()
        p = self.sched.width()
        if not p:
            return did
        running = self.sched.decoding()
        held = self._wait_for_text(running)
        if held:
            running = [st for st in running if st not in held]
            if not running:
                return did
        if self.faults:
            self._inject_faults(running)
        t0 = time.perf_counter()
        try:
            with self.engine.holding([st.slot for st in held]):
                codes, code0 = self._frame(p, len(running))
            codes_np = codes.cpu().numpy()
            nxt = code0.tolist()
        except Exception as e:  # not attributable to one stream: fail this step's streams only
            log.exception("frame step failed; failing its %d streams", len(running))
            for st in running:
                self._fail(st, f"synthesis failed in the talker stage: {e}")
            return True
        dt = time.perf_counter() - t0
        stepstats.record("talker.step", dt)
        self.sched.stepped(dt)
        self.step_s += dt
        self.steps += 1
        t_ns = time.monotonic_ns()
        t_emit = time.perf_counter()
        now = time.monotonic()
        for st in running:
            slot = st.slot
            end = self.sched.advance(st, nxt[slot], now)
            if end is FrameEnd.INVALID:
                self._fail(st, f"the model produced an invalid code at frame {st.frames} "
                           "(non-finite logits); the stream was stopped", FailReason.INVALID_CODE)
                continue
            flags = _END_FLAGS[end]
            if not self.out.put(codes_np[slot:slot + 1], kind=MsgKind.CODES, stream_id=st.stream_id,
                                seq=st.frames - 1, flags=flags, enqueue_ns=t_ns, timeout=5.0):
                self._fail(st, "the codec stage did not take a frame within 5 s")
                continue
            if flags:
                self.engine.release(self.sched.release(st))
        stepstats.record("talker.emit", time.perf_counter() - t_emit)
        return True

    def _inject_faults(self, running: list[StreamState]) -> None:
        """Planned faults (``stages.faults``): poison the inputs of one stream's next frame."""
        for st in running:
            for part in ("talker", "code_predictor"):
                if self.faults.fires(part, st.stream_id, st.frames):
                    self.engine.inject_fault(st.slot, part)

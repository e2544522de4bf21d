"""Code2Wav stage: stateful streaming decode of every stream's frames, batched across streams.

Input: the talker's ``frames`` ring (EVENT FIRST carrying the stream's ``StreamStart``: its
chunk policy, codes-only mode and input token count; CODES frames; END / ERROR / cancel
events). Output: the ``audio`` ring to the server: PCM chunks (float32, n_frames * 1920
samples) or, for codes-only streams, the frames themselves; END on the last chunk, ERROR|END
(payload = utf-8 message) on failure. Each stream owns a decoder slot from its FIRST event to
its END; streams whose next chunk has the same length are decoded in one batch.
When the stage falls behind, a stream's whole backlog is decoded in one call (never more than
``max_chunk`` frames), which both catches up and amortises the per-call cost. A final chunk
carries LENGTH when the talker stopped the stream at its frame cap.

A fault stays with its stream: a frame that is not [n, 16] codes inside the codebook fails its
stream (ERROR|END to the server; its later frames are dropped until the talker's END or cancel
arrives), and an exception in a batched decode fails the streams of that call. The stage itself
keeps serving the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_stream.models.code2wav import Code2Wav, Code2WavStream
from omni_stream.observability import stepstats
from omni_stream.scheduling.chunking import ChunkPolicy
from omni_stream.stages.codec_kernels import same_bits
from omni_stream.stages.faults import FaultPlan
from omni_stream.transport import FailReason, Flags, Message, MsgKind, Ring, StreamStart

log = logging.getLogger(__name__)

READY_STREAM_ID = (1 << 62)  # stream id of the stage's "ready" event on the audio ring
_NO_LEASE = contextlib.nullcontext()
PRIMED_CACHE = 8  # cloned voices whose primed Code2Wav state is kept (a few MB each)


@dataclass
class _Decoding:
    slot: int
    policy: ChunkPolicy
    codes_only: bool
    input_tokens: int
    buf: list[np.ndarray] = field(default_factory=list)
    chunks: int = 0
    frames_out: int = 0
    ended: bool = False
    first_ns: int = 0
    first_out_t: float | None = None  # when its first chunk left: the listener's clock origin
    last_frame_t: float | None = None
    frame_dt: float = 0.08  # EMA of the time between its frames (generation speed)
    prev_chunk: int | None = None
    frames_in: int = 0
    length: bool = False  # the talker stopped it at its frame cap

    def slack_s(self, now: float) -> float:
        """Audio sent minus audio played (playback assumed to start at the first chunk)."""
        if self.first_out_t is None:
            return 0.0
        played = max(0.0, now - self.first_out_t - self.policy.hold_s)
        return self.frames_out * self.policy.audio_frame_s - played


class CodecStage:
    def __init__(self, model: Code2Wav, max_slots: int, out: Ring, max_chunk: int = 32,
                 faults: FaultPlan | None = None) -> None:
        self.faults = faults or FaultPlan()
        self.codebooks = model.cfg.num_quantizers
        self.codebook_size = model.cfg.codebook_size
        self.failed: set[int] = set()  # failed here; the talker's END / cancel not yet seen
        self.failed_total = 0
        self.dec = Code2WavStream(model, max_slots)
        self.spf = model.samples_per_frame
        self.out = out
        self.max_chunk = max_chunk
        self.free = list(range(max_slots))
        self.streams: dict[int, _Decoding] = {}
        self.waiting: dict[int, list[Message]] = {}
        self.decode_s = 0.0
        self.decoded_frames = 0
        self.primed: dict[bytes, list[torch.Tensor]] = {}  # reference frames -> primed state
        self.primes_decoded = 0
        self.calls = 0
        # the core lease this stage lends its cores through (run_codec_stage sets it when the
        # talker borrows them): held for the length of each decode
        self.lease = None

    def on_message(self, m: Message) -> None:
        stepstats.record_ns("hop.frames.enqueue_put", m.enqueue_ns, m.put_ns)
        stepstats.record_ns("hop.frames.put_get", m.put_ns, m.get_ns)
        sid = m.stream_id
        if m.kind == MsgKind.EVENT and m.flags & Flags.FIRST:
            try:
                start = StreamStart.from_payload(m.payload)
            except ValueError as e:
                self._error(sid, f"codec stage could not read the stream's start: {e}")
                return
            if not self.free:  # cannot happen while codec slots >= talker slots
                self._error(sid, "codec stage has no free decoder slot")
                return
            try:
                prime = start.prime(self.codebooks)
                problem = None if prime is None else self._check_frames(prime)
                if problem is not None:
                    raise ValueError(f"priming codes: {problem}")
            except ValueError as e:
                self._error(sid, f"codec stage could not read the stream's start: {e}")
                return
            slot = self.free.pop(0)
            self.dec.reset(slot)
            self.streams[sid] = _Decoding(slot, start.chunk, start.codes_only, start.input_tokens,
                                        first_ns=m.enqueue_ns)
            if prime is not None:  # ICL voice: the reference as left context, not played
                t0 = time.perf_counter()
                try:
                    self._prime(slot, prime)
                except Exception as e:  # this stream only
                    log.exception("stream %d: priming Code2Wav failed", sid)
                    self._fail(sid, f"codec stage could not prime the cloned voice: {e}")
                    return
                stepstats.record("codec.prime", time.perf_counter() - t0)
            return
        if sid in self.failed:  # already failed here: drop the rest quietly
            if m.kind == MsgKind.EVENT and m.flags & Flags.END:
                self.failed.discard(sid)
            return
        st = self.streams.get(sid)
        if m.kind == MsgKind.EVENT and m.flags & (Flags.WAIT | Flags.RESUME):
            # a continuous stream waits for (or got) its text: the server tells its client
            self.out.put(None, kind=MsgKind.EVENT, stream_id=sid, flags=m.flags, aux=m.aux,
                         timeout=5.0)
            return
        if m.kind == MsgKind.EVENT:
            if m.flags & Flags.ERROR:
                self.out.put(m.payload, kind=MsgKind.EVENT, stream_id=sid,
                             flags=Flags.ERROR | Flags.END, aux=m.aux, timeout=5.0)
            elif m.flags & Flags.END and m.aux == 0 and st is None:
                # ended before any frame (eos first): an empty final chunk
                self.out.put(None, kind=MsgKind.EVENT, stream_id=sid, flags=Flags.END, timeout=5.0)
            elif m.flags & Flags.END and st is not None and m.aux != 0:
                pass  # cancelled: drop silently below
            if st is not None:
                self._drop(sid)
            return
        if st is None:
            log.warning("frame for unknown stream %d dropped", sid)
            return
        payload = m.payload
        if self.faults and self.faults.fires("codec", sid, st.frames_in):
            payload = np.full((1, self.codebooks), self.codebook_size, dtype=np.int64)
        problem = self._check_frames(payload)
        if problem is not None:
            st.ended = bool(m.flags & Flags.END)
            self._fail(sid, f"frame {st.frames_in} reached the codec stage invalid: {problem}; "
                       "the stream was stopped", FailReason.INVALID_CODE)
            return
        st.frames_in += len(payload)
        st.buf.append(payload)
        now = time.monotonic()
        if st.last_frame_t is not None:
            st.frame_dt = 0.8 * st.frame_dt + 0.2 * (now - st.last_frame_t)
        st.last_frame_t = now
        if m.flags & Flags.END:
            st.ended = True
            st.length = bool(m.flags & Flags.LENGTH)

    @torch.inference_mode()
    def _prime(self, slot: int, prime: np.ndarray) -> None:
        """Decode an ICL voice's reference frames into ``slot`` (output dropped). The state it
        leaves is kept for the next stream of the same voice (LRU of PRIMED_CACHE voices), so an
        uploaded voice pays the decode once, not per request."""
        key = hashlib.sha1(prime.tobytes()).digest()
        snap = self.primed.pop(key, None)
        if snap is None:
            with self.lease.held() if self.lease is not None else _NO_LEASE:
                self.dec.decode([slot], torch.from_numpy(prime.T.copy())[None])
            snap = self.dec.snapshot(slot)
            self.primes_decoded += 1
        else:
            self.dec.restore(slot, snap)
        self.primed[key] = snap  # most recent last
        while len(self.primed) > PRIMED_CACHE:
            self.primed.pop(next(iter(self.primed)))

    def _check_frames(self, codes) -> str | None:
        """Why ``codes`` is not a valid [n, codebooks] int64 block inside the codebook, or None."""
        if not isinstance(codes, np.ndarray) or codes.dtype != np.int64:
            return f"expected int64 codes, got {getattr(codes, 'dtype', type(codes).__name__)}"
        if codes.ndim != 2 or codes.shape[0] < 1 or codes.shape[1] != self.codebooks:
            return f"expected shape [n, {self.codebooks}], got {list(codes.shape)}"
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= self.codebook_size:
            return f"codes must lie in [0, {self.codebook_size}), got values in [{lo}, {hi}]"
        return None

    def _fail(self, sid: int, text: str, reason: int = FailReason.OTHER) -> None:
        """Fail one stream: ERROR|END to the server, free its decoder slot, drop what follows."""
        log.warning("stream %d failed: %s", sid, text)
        self.failed_total += 1
        self._error(sid, text, reason)
        st = self.streams.get(sid)
        if st is not None:
            self._drop(sid)
        if st is None or not st.ended:  # the talker still has frames or an END on the way
            self.failed.add(sid)

    def _error(self, sid: int, text: str, reason: int = FailReason.OTHER) -> None:
        self.out.put(np.frombuffer(text.encode(), dtype=np.uint8).copy(), kind=MsgKind.EVENT,
                     stream_id=sid, flags=Flags.ERROR | Flags.END, aux=reason, timeout=5.0)

    def _drop(self, sid: int) -> None:
        st = self.streams.pop(sid)
        self.free.append(st.slot)
        self.free.sort()

    def _ready(self) -> list[tuple[int, _Decoding, int]]:
        out = []
        now = time.monotonic()
        decode_ms = 1e3 * self.decode_s / max(self.decoded_frames, 1)
        for sid, st in self.streams.items():
            have = len(st.buf)
            if not have:
                continue
            # adaptive: grow toward the steady size only while the listener's buffer allows
            want = self._first_size(st) if st.chunks == 0 else st.policy.next_chunk(
                st.chunks, st.slack_s(now), st.frame_dt, decode_ms, prev=st.prev_chunk)
            if have >= want or st.ended:
                n = min(have, self.max_chunk) if have >= want else have
                out.append((sid, st, n))
        return out

    @torch.inference_mode()
    def iterate(self) -> bool:
        """Decode every stream that has a full chunk (or its tail). True if it did work."""
        ready = self._ready()
        if not ready:
            return False
        by_len: dict[int, list[tuple[int, _Decoding]]] = {}
        for sid, st, n in ready:
            if st.codes_only:
                self._emit(sid, st, n, None)
            else:
                by_len.setdefault(n, []).append((sid, st))
        self._piggyback(by_len, {sid for sid, _, _ in ready})
        for n, group in by_len.items():
            codes = np.stack([np.concatenate(st.buf[:n], axis=0).T for _, st in group])  # [k,16,n]
            t0 = time.perf_counter()
            try:
                with self.lease.held() if self.lease is not None else _NO_LEASE:
                    pcm = self.dec.decode([st.slot for _, st in group], torch.from_numpy(codes))
                pcm = pcm.float().cpu().numpy()
            except Exception as e:  # this call's streams (their decoder state is half-written)
                log.exception("decode of %d streams failed", len(group))
                for sid, _ in group:
                    self._fail(sid, f"synthesis failed in the codec stage: {e}")
                continue
            dt = time.perf_counter() - t0
            stepstats.record("codec.decode", dt)
            self.decode_s += dt
            self.decoded_frames += n * len(group)
            self.calls += 1
            for i, (sid, st) in enumerate(group):
                self._emit(sid, st, n, pcm[i])
        return True

    @torch.inference_mode()
    def warm_up(self, max_frames: int = 8, max_batch: int = 2) -> float:
        """Decode each chunk shape a stream's ramp meets (1..``max_frames`` frames, batches of
        1..``max_batch`` streams) once, then reset the slots: oneDNN builds its kernels for a
        shape on first use (~40-60 ms each at the released dims on a CPU), which would
        otherwise land on the first streams' first chunks. Returns the seconds it took."""
        t0 = time.perf_counter()
        batch = min(max_batch, self.dec.max_slots)
        for b in range(1, batch + 1):
            for n in range(1, max_frames + 1 if b == 1 else max_frames // 2 + 1):
                self.dec.decode(list(range(b)), torch.zeros(b, self.codebooks, n, dtype=torch.long))
        for slot in range(batch):
            self.dec.reset(slot)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def check_invariance(self, frames: int = 4, seed: int = 0) -> bool:
        """Whether one stream's decode is the same bits in single frames as in one chunk (what
        the packed bf16 kernels promise at ``onednn.DECODE_LEVEL``): decodes ``frames`` random
        frames both ways on slot 0, then resets it. Measured here, at start-up, because the
        kernel oneDNN runs depends on the CPU and on the cap this process got. About two
        decode calls of ``frames`` frames."""
        g = torch.Generator().manual_seed(seed)
        size = self.dec.model.cfg.codebook_size
        codes = torch.randint(0, size, (1, self.codebooks, frames), generator=g)
        one = self.dec.decode([0], codes)[0]
        self.dec.reset(0)
        parts = [self.dec.decode([0], codes[:, :, i:i + 1])[0] for i in range(frames)]
        self.dec.reset(0)
        return same_bits(one, torch.cat(parts))

    @torch.inference_mode()
    def measure(self) -> dict[str, float]:
        """Time Code2Wav calls per chunk size and batch (``edge.measure``): {codec_call_s,
        codec_frame_s, and call_s_n<frames>_b<batch> per size timed}, or {busy_streams} while
        streams hold slots (asked on the stage's control channel: ``orchestrator.costs``)."""
        from omni_stream.edge.measure import measure_codec_calls

        if self.streams:
            log.warning("cost measurement asked while %d streams run: skipped", len(self.streams))
            return {"busy_streams": len(self.streams)}

        def decode(slots, codes):
            with self.lease.held() if self.lease is not None else _NO_LEASE:
                return self.dec.decode(slots, codes)

        call_s, frame_s, table = measure_codec_calls(decode, self.codebooks,
                                                     self.dec.max_slots, self.dec.reset)
        return dict({f"call_s_n{n}_b{b}": s for n, b, s in table},
                    codec_call_s=call_s, codec_frame_s=frame_s)

    def _first_size(self, st: _Decoding) -> int:
        """A stream's first chunk: its policy's, one frame more when other streams are active.
        Its next frames then come at the pace of a batched step and its chunks wait for the
        others' decodes, so a first chunk sized for a lone stream runs dry before the second
        arrives (measured: 0.6B on 2 cores, a stream joining a running one). A size the request
        asked for (``initial_codec_chunk_frames``) is kept as it is."""
        if st.policy.first_requested:
            return st.policy.first
        return st.policy.first + (1 if len(self.streams) > 1 else 0)

    def _piggyback(self, by_len: dict[int, list[tuple[int, _Decoding]]], ready: set[int]) -> None:
        """Streams not due yet that hold enough frames join a decode of that length: a row more
        in a call costs far less than a call of its own (on a CPU each call reads the decoder's
        weights), and their audio leaves early. A stream's first chunk keeps at least its
        first size (``_first_size``)."""
        for n, group in sorted(by_len.items()):
            for sid, st in self.streams.items():
                if (sid in ready or st.codes_only or len(st.buf) < n
                        or (st.chunks == 0 and n < self._first_size(st))):
                    continue
                group.append((sid, st))
                ready.add(sid)

    def _emit(self, sid: int, st: _Decoding, n: int, pcm: np.ndarray | None) -> None:
        frames = np.concatenate(st.buf[:n], axis=0)
        del st.buf[:n]
        if st.first_out_t is None:
            st.first_out_t = time.monotonic()
        st.prev_chunk = n
        st.chunks += 1
        st.frames_out += n
        last = st.ended and not st.buf
        flags = Flags.END if last else 0
        if last and st.length:
            flags |= Flags.LENGTH
        if st.chunks == 1:
            flags |= Flags.FIRST
        kind, payload = (MsgKind.CODES, frames) if pcm is None else (MsgKind.PCM, pcm)
        if not self.out.put(payload, kind=kind, stream_id=sid, seq=st.chunks - 1, flags=flags,
                            aux=st.input_tokens, timeout=5.0):
            self._fail(sid, "the server did not take an audio chunk within 5 s")
            return
        if last:
            self._drop(sid)

    def stats(self) -> dict[str, float]:
        return dict(streams=len(self.streams), free_slots=len(self.free), failed=self.failed_total,
                    decode_ms_per_frame=1e3 * self.decode_s / max(self.decoded_frames, 1),
                    decode_calls=self.calls, voice_primes_decoded=self.primes_decoded,
                    voice_primes_cached=len(self.primed))

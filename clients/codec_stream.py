"""Stream codec frames over the WebSocket and decode them here (client-side Code2Wav).

The server sends 16 codes per 80 ms frame (128 bytes as int64) instead of 3840 bytes of PCM, in
the same chunk schedule it would use for audio; each ``codec.frames`` header is followed by one
binary message with those frames, and ``audio.done`` ends the utterance. The decoder is checked
against the codec the server announces before any text is sent, so a decoder for another model
costs the user one round trip, not a synthesis.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import numpy as np

from clients.decoders import DecoderError, FrameDecoder
from clients.result import ClientError, StreamResult

WS_PATH = "/v1/audio/speech/stream"
USE_SERVER = "use --decoder-backend server"


def to_s16(pcm: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16, rounded exactly as the server encodes PCM."""
    return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")


async def stream_codes(url: str, text: str, decoder: FrameDecoder, voice: str | None = None,
                       language: str = "auto", seed: int | None = None,
                       model: str | None = None, api_key: str | None = None,
                       timeout: float = 120.0, extra: dict | None = None,
                       on_chunk: Callable[[np.ndarray], None] | None = None) -> StreamResult:
    """Speak ``text`` as one utterance with codec frames decoded by ``decoder``."""
    import aiohttp

    config: dict[str, Any] = {"type": "session.config", "codec_frames": True,
                              "split_sentences": False, "language": language}
    for k, v in (("model", model), ("voice", voice), ("seed", seed)):
        if v is not None:
            config[k] = v
    config.update(extra or {})
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res = _Collect(decoder, on_chunk)
    t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async with s.ws_connect(url.rstrip("/") + WS_PATH, headers=headers,
                                    max_msg_size=64 << 20) as ws:
                created = await _next_event(ws)
                if created.get("type") != "session.created":
                    raise ClientError(f"unexpected first WebSocket event {created.get('type')!r}")
                await ws.send_str(json.dumps(config))
                updated = await _next_event(ws)
                notes = _check_session(updated, decoder)
                await ws.send_str(json.dumps({"type": "input.text", "text": text}))
                await ws.send_str(json.dumps({"type": "session.close"}))
                await res.read(ws)
    except aiohttp.WSServerHandshakeError as e:
        raise ClientError(f"{url} does not offer the WebSocket speech stream (HTTP {e.status} on "
                          f"{WS_PATH}), so it cannot send codec frames: {USE_SERVER}") from e
    except aiohttp.ClientConnectorError as e:
        raise ClientError(f"cannot reach {url}: {e}; is `omni-stream serve` running?") from e
    except DecoderError as e:
        raise ClientError(str(e)) from e
    if not res.pcm:
        raise ClientError("the server sent no codec frames")
    t_end = time.monotonic()
    pcm = np.concatenate(res.pcm)
    return StreamResult(pcm, res.arrivals[0] - t0, t_end - t0, res.arrivals, res.durations,
                        wire_bytes=res.wire_bytes, notes=notes)


async def _next_event(ws) -> dict:
    import aiohttp

    msg = await ws.receive()
    if msg.type == aiohttp.WSMsgType.TEXT:
        return json.loads(msg.data)
    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
        raise ClientError(f"the server closed the WebSocket ({ws.close_code}) before the stream")
    raise ClientError(f"unexpected WebSocket message {msg.type!r} before the stream")


def _raise_error_event(ev: dict) -> None:
    err = ev.get("error") or {}
    code, msg = err.get("code", ""), err.get("message", "unknown error")
    if code == "codec_frames_unsupported":
        raise ClientError(f"the server does not offer codec frames ({msg}): {USE_SERVER}")
    raise ClientError(f"server error ({code or 'error'}): {msg}")


def _check_session(ev: dict, decoder: FrameDecoder) -> list[str]:
    """The session.updated answer to our config: codec frames on, and the decoder matches.
    Returns notes for the user (a server decoding in another dtype)."""
    if ev.get("type") == "error":
        _raise_error_event(ev)
    if ev.get("type") != "session.updated":
        raise ClientError(f"expected session.updated, got {ev.get('type')!r}")
    session = ev.get("session") or {}
    if not session.get("codec_frames"):
        raise ClientError(f"the server ignored codec_frames (it does not offer codec frames): "
                          f"{USE_SERVER}")
    codec = session.get("codec")
    if codec is None:
        raise ClientError("the server does not announce its codec, so the local decoder cannot "
                          f"be checked against it: update the server or {USE_SERVER}")
    decoder.check_server(codec, session.get("model", ""))
    dtype, here = codec.get("decode_dtype", "float32"), getattr(decoder, "dtype", "float32")
    if dtype != here:
        closer = " (this side is the closer one to the fp32 reference)" if here == "float32" else ""
        fix = decoder.dtype_fix(dtype)
        return [f"the server decodes in {dtype} and the {decoder.name} decoder here in {here}: "
                f"the audio differs from --decoder-backend server by that rounding{closer}"
                + (f"; {fix}" if fix else "")]
    return []


class _Collect:
    """Reads one utterance: audio.start, (codec.frames + binary)*, audio.done, session.done."""

    def __init__(self, decoder: FrameDecoder, on_chunk) -> None:
        self.decoder = decoder
        self.on_chunk = on_chunk
        self.pcm: list[np.ndarray] = []
        self.arrivals: list[float] = []
        self.durations: list[float] = []
        self.wire_bytes = 0
        self.frames = 0

    async def read(self, ws) -> None:
        import aiohttp

        header: dict | None = None
        self.decoder.reset()
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                if header is None:
                    raise ClientError("binary frame without a codec.frames header: the server "
                                      f"is sending audio, not codec frames; {USE_SERVER}")
                self.wire_bytes += len(msg.data)
                if header.get("type") == "codec.prime":
                    self._prime(header, msg.data)
                else:
                    self._frames(header, msg.data)
                header = None
                continue
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            self.wire_bytes += len(msg.data)
            ev = json.loads(msg.data)
            kind = ev.get("type")
            if kind == "error":
                _raise_error_event(ev)
            elif kind == "audio.start":
                self._start(ev)
            elif kind in ("codec.frames", "codec.prime"):
                header = ev
            elif kind == "session.done":
                return
        if ws.close_code not in (None, 1000):
            raise ClientError(f"the stream broke off (WebSocket close {ws.close_code}) after "
                              f"{self.frames} frames")

    def _start(self, ev: dict) -> None:
        if ev.get("format") != "codec_frames":
            raise ClientError(f"the server streams {ev.get('format')!r}, not codec frames: "
                              f"{USE_SERVER}")
        self.decoder.check_server({k: ev[k] for k in ("num_codebooks", "sample_rate",
                                                      "codebook_size", "samples_per_frame",
                                                      "codec_sha256") if k in ev})

    def _codes(self, header: dict, data: bytes) -> np.ndarray:
        q = self.decoder.identity.num_codebooks
        n = int(header.get("frames", -1))
        if header.get("dtype", "int64") != "int64" or len(data) != n * q * 8:
            raise ClientError(f"codec frame message of {len(data)} bytes does not hold {n} "
                              f"int64 frames of {q} codes")
        return np.frombuffer(data, dtype="<i8").reshape(n, q)

    def _prime(self, header: dict, data: bytes) -> None:
        """A cloned voice's reference frames: decoded as left context, their audio dropped."""
        if self.frames:
            raise ClientError("codec.prime after the first codec frames")
        self.decoder.decode(self._codes(header, data))

    def _frames(self, header: dict, data: bytes) -> None:
        codes = self._codes(header, data)
        n = len(codes)
        if int(header.get("offset", self.frames)) != self.frames:
            raise ClientError(f"codec frames out of order: offset {header.get('offset')} after "
                              f"{self.frames} frames")
        pcm = to_s16(self.decoder.decode(codes))
        self.frames += n
        self.pcm.append(pcm)
        self.arrivals.append(time.monotonic())
        self.durations.append(len(pcm) / self.decoder.sample_rate)
        if self.on_chunk is not None:
            self.on_chunk(pcm)

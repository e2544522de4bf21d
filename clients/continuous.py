"""Speak text while it is being written: one continuous utterance over the WebSocket.

An LLM writes its answer token by token; ``speak_continuous`` sends every piece as it comes
(``session.config`` ``text_mode: "continuous"``) while it reads the audio back, so the first
words play before the answer is finished. The server speaks exactly what the whole text sent at
once would give (text-streaming mode); when the speech catches up with the text it waits
(``text.waiting`` / ``text.resumed``), and the result counts that time.

    async def tokens():
        async for tok in llm.stream(prompt):
            yield tok
    res = await speak_continuous("http://127.0.0.1:8000", tokens(), voice="ryan")
    print(res.first_audio_after_text_s, res.text_waited_ms, res.playback(0.2).underruns)

``stdin_pieces`` turns a blocking byte stream (a pipe on stdin) into such an iterator, piece by
piece as it is written: ``llm ... | omni-stream-client --text-stdin --continuous``.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable

import numpy as np

from clients.result import SAMPLE_RATE, ClientError, StreamResult

__all__ = ["ContinuousResult", "speak_continuous", "stdin_pieces", "fd_pieces"]

WS_PATH = "/v1/audio/speech/stream"


@dataclass
class ContinuousResult(StreamResult):
    """A ``StreamResult`` whose clock starts at the first text piece sent (``ttfa_s`` is the
    time from the first text to the first audio; ``total_s`` runs to the end of the session),
    plus what the text writer did to the speech. ``arrivals`` and the times below are
    ``time.monotonic()`` values."""

    first_text_at: float | None = None  # when the first piece was sent
    first_audio_at: float | None = None  # when the first audio arrived
    last_text_at: float | None = None  # when input.done was sent
    pieces: int = 0  # text pieces sent (empty ones skipped)
    waits: list[dict] = field(default_factory=list)  # text.waiting / text.resumed, with "at"
    text_waited_ms: int = 0  # sum over the utterances' audio.done text_waited_ms
    utterances: list[dict] = field(default_factory=list)  # the audio.done events

    @property
    def first_audio_after_text_s(self) -> float | None:
        if self.first_text_at is None or self.first_audio_at is None:
            return None
        return self.first_audio_at - self.first_text_at

    @property
    def finish_reason(self) -> str | None:
        """The last utterance's: "stop", or "length" when it reached its frame cap."""
        return self.utterances[-1].get("finish_reason") if self.utterances else None


async def speak_continuous(url: str, pieces: AsyncIterator[str] | Iterable[str], *,
                           voice: str | None = None, language: str = "auto",
                           model: str | None = None, api_key: str | None = None,
                           seed: int | None = None, greedy: bool = False,
                           max_new_tokens: int | None = None,
                           on_chunk: Callable[[np.ndarray], None] | None = None,
                           timeout: float = 300.0, extra: dict | None = None,
                           ) -> ContinuousResult:
    """Feed ``pieces`` (any split of the text, as they come) to one continuous utterance and
    collect its speech. An async iterator is consumed concurrently with reading the audio, so
    the audio plays while the text is still being produced; ``on_chunk`` gets each int16 block
    as it arrives. ``extra`` adds ``session.config`` fields (``{"text_mode": "sentences"}``
    sends the same pieces to the sentence splitter instead). After the last piece the utterance
    is closed (``input.done``) and the session too; the result holds every utterance the
    session spoke (one, unless the model ended the speech before the text did, in which case
    the rest of the text starts a new one). A server ``error`` event raises ``ClientError`` with
    the server's message."""
    import aiohttp

    config: dict[str, Any] = {"type": "session.config", "text_mode": "continuous",
                              "language": language}
    for k, v in (("model", model), ("voice", voice), ("seed", seed),
                 ("max_new_tokens", max_new_tokens), ("greedy", greedy or None)):
        if v is not None:
            config[k] = v
    config.update(extra or {})
    if config.get("codec_frames") or config.get("stream_format", "audio") != "audio":
        raise ClientError("speak_continuous reads pcm binary frames: leave codec_frames and "
                          "stream_format out of extra")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res = ContinuousResult(np.zeros(0, "<i2"), 0.0, 0.0)
    reader = _Reader(res, on_chunk)
    try:
        async with asyncio.timeout(timeout):
            async with aiohttp.ClientSession() as s:
                async with s.ws_connect(url.rstrip("/") + WS_PATH, headers=headers,
                                        max_msg_size=64 << 20) as ws:
                    await _expect(ws, "session.created")
                    await ws.send_str(json.dumps(config))
                    await _expect(ws, "session.updated")
                    writer = asyncio.create_task(_write(ws, pieces, res))
                    try:
                        await reader.read(ws, writer)
                    finally:  # the writer's failure, if any, was raised by the reader
                        writer.cancel()
                        await asyncio.wait({writer})
                        if not writer.cancelled():
                            writer.exception()  # retrieved: no "never retrieved" warning
    except aiohttp.WSServerHandshakeError as e:
        raise ClientError(f"{url} does not offer the WebSocket speech stream (HTTP {e.status} "
                          f"on {WS_PATH}): is it an omni-stream server?") from e
    except aiohttp.ClientConnectorError as e:
        raise ClientError(f"cannot reach {url}: {e}; is `omni-stream serve` running?") from e
    except TimeoutError as e:
        raise ClientError(f"the session did not end within timeout={timeout} s") from e
    if not reader.chunks:
        raise ClientError("the server sent no audio" if res.pieces else
                          "no text to speak: every piece was empty")
    end = time.monotonic()
    res.pcm = np.concatenate(reader.chunks)
    t0 = res.first_text_at if res.first_text_at is not None else res.arrivals[0]
    res.ttfa_s = res.arrivals[0] - t0
    res.total_s = end - t0
    return res


async def _expect(ws, kind: str) -> dict:
    import aiohttp

    msg = await ws.receive()
    if msg.type != aiohttp.WSMsgType.TEXT:
        raise ClientError(f"the server closed the WebSocket ({ws.close_code}) before "
                          f"{kind}" if msg.type in (aiohttp.WSMsgType.CLOSE,
                                                    aiohttp.WSMsgType.CLOSED,
                                                    aiohttp.WSMsgType.CLOSING)
                          else f"unexpected WebSocket message {msg.type!r} before {kind}")
    ev = json.loads(msg.data)
    if ev.get("type") == "error":
        _raise(ev)
    if ev.get("type") != kind:
        raise ClientError(f"expected {kind}, got {ev.get('type')!r}")
    return ev


def _raise(ev: dict) -> None:
    err = ev.get("error") or {}
    code = err.get("code") or err.get("type") or "error"
    param = f" [{err['param']}]" if err.get("param") else ""
    raise ClientError(f"server error ({code}){param}: {err.get('message', 'unknown error')}")


async def _write(ws, pieces: AsyncIterator[str] | Iterable[str], res: ContinuousResult) -> None:
    """Send every non-empty piece as it comes, then close the utterance and the session."""

    async def send(text: str) -> None:
        if not text:
            return
        await ws.send_str(json.dumps({"type": "input.text", "text": text}))
        if res.first_text_at is None:
            res.first_text_at = time.monotonic()
        res.pieces += 1

    if hasattr(pieces, "__aiter__"):
        async for p in pieces:
            await send(p)
    else:
        for p in pieces:
            await send(p)
    await ws.send_str(json.dumps({"type": "input.done"}))
    res.last_text_at = time.monotonic()
    await ws.send_str(json.dumps({"type": "session.close"}))


def _reraise(writer: asyncio.Task) -> None:
    """A writer's failure, raised here, unless the socket went away under it (the reader then
    sees the close, with the server's reason)."""
    exc = writer.exception()
    if exc is not None and not isinstance(exc, ConnectionError):
        raise exc


class _Reader:
    """Reads the session until ``session.done``: audio frames and the events around them. A
    writer that fails (the text source raised) ends the read with its exception."""

    def __init__(self, res: ContinuousResult, on_chunk) -> None:
        self.res = res
        self.on_chunk = on_chunk
        self.chunks: list[np.ndarray] = []
        self.sample_rate = SAMPLE_RATE

    async def read(self, ws, writer: asyncio.Task) -> None:
        import aiohttp

        while True:
            if writer.done():
                _reraise(writer)
                msg = await ws.receive()
            else:  # wait for a message, or for the writer to end (a failed text source)
                recv = asyncio.ensure_future(ws.receive())
                await asyncio.wait({recv, writer}, return_when=asyncio.FIRST_COMPLETED)
                if not recv.done():
                    try:
                        _reraise(writer)
                    except BaseException:
                        recv.cancel()
                        raise
                    msg = await recv
                else:
                    msg = recv.result()
            if msg.type == aiohttp.WSMsgType.BINARY:
                self.audio(msg.data)
            elif msg.type == aiohttp.WSMsgType.TEXT:
                if self.event(json.loads(msg.data)):
                    return
            else:
                raise ClientError(f"the stream broke off (WebSocket close {ws.close_code}) "
                                  f"after {sum(map(len, self.chunks))} samples")

    def audio(self, data: bytes) -> None:
        res = self.res
        now = time.monotonic()
        if len(data) % 2:
            raise ClientError(f"binary frame of {len(data)} bytes is not s16le pcm")
        pcm = np.frombuffer(data, dtype="<i2")
        if not len(pcm):
            return
        if res.first_audio_at is None:
            res.first_audio_at = now
        self.chunks.append(pcm)
        res.arrivals.append(now)
        res.durations.append(len(pcm) / self.sample_rate)
        res.wire_bytes += len(data)
        if self.on_chunk is not None:
            self.on_chunk(pcm)

    def event(self, ev: dict) -> bool:
        """Handle one JSON event; True at the end of the session."""
        kind = ev.get("type")
        if kind == "error":
            _raise(ev)
        elif kind == "audio.start":
            if ev.get("format", "pcm_s16le") != "pcm_s16le":
                raise ClientError(f"the server streams {ev.get('format')!r}, not pcm_s16le")
            self.sample_rate = int(ev.get("sample_rate") or SAMPLE_RATE)
            if self.sample_rate != SAMPLE_RATE:
                self.res.notes.append(f"the server speaks at {self.sample_rate} Hz, "
                                      f"not {SAMPLE_RATE}")
        elif kind in ("text.waiting", "text.resumed"):
            self.res.waits.append({**ev, "at": time.monotonic()})
        elif kind == "audio.done":
            self.res.utterances.append(ev)
            self.res.text_waited_ms += int(ev.get("text_waited_ms") or 0)
        return kind == "session.done"


# ----------------------------------------------------------------------------- text sources
async def fd_pieces(fd: int, read_size: int = 4096) -> AsyncIterator[str]:
    """The text written to file descriptor ``fd`` (a pipe, a tty), piece by piece as it is
    written: ``os.read`` returns what is there without waiting for a full buffer. UTF-8 is
    decoded incrementally, so a character split across two writes comes out whole once its
    last byte is in. The read runs on a daemon thread (a blocked read never holds up exit)."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

    def post(item: bytes | BaseException | None) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop closed while this thread was blocked: nobody listens
            pass

    def pump() -> None:
        try:
            while data := os.read(fd, read_size):
                post(data)
            post(None)
        except OSError as e:  # also the fd closed under a blocked read after the reader left
            post(e)

    threading.Thread(target=pump, name=f"text-fd-{fd}", daemon=True).start()
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    while True:
        item = await q.get()
        if isinstance(item, BaseException):
            raise ClientError(f"cannot read the text: {item}") from item
        final = item is None
        try:
            text = decoder.decode(item or b"", final=final)
        except UnicodeDecodeError as e:
            raise ClientError(f"the text is not UTF-8 (byte {offset + e.start}): convert it, "
                              "e.g. `iconv -t UTF-8`") from e
        offset += len(item or b"")
        if text:
            yield text
        if final:
            return


def stdin_pieces(read_size: int = 4096) -> AsyncIterator[str]:
    """``fd_pieces`` on standard input (its file descriptor, bypassing Python's buffering)."""
    import sys

    return fd_pieces(sys.stdin.fileno(), read_size)

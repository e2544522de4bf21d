"""Checks and inputs shared by the tests that speak through a real server (continuous text,
voice agents): the same-speech comparison, LLM-like text pieces, a voice uploaded by name."""

from __future__ import annotations

import contextlib
import io
from typing import AsyncIterator

import aiohttp
import numpy as np


def same_speech(a: np.ndarray, b: np.ndarray) -> None:
    """The same speech: equal (non-zero) length, samples within 2 LSB. Not bit-equal: the
    server's codec decodes in the chunks the stream's timing gives (1, 4, ... frames), which
    moves float32 rounding, so even the same request twice differs by 1 LSB in a few hundred
    samples. The codes themselves are exactly equal (tests/test_continuous_text.py)."""
    assert len(a) == len(b) and len(a) > 0, (len(a), len(b))
    diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
    assert diff.max() <= 2, (diff.max(), int((diff > 0).sum()))


def llm_pieces(text: str) -> list[str]:
    """LLM-like tokens: each word with its leading space, long words cut in two."""
    out = []
    for i, w in enumerate(text.split(" ")):
        w = w if i == 0 else " " + w
        out += [w[:4], w[4:]] if len(w) > 5 else [w]
    return [p for p in out if p]


@contextlib.asynccontextmanager
async def uploaded_voice(url: str, name: str) -> AsyncIterator[str]:
    """A voice cloned from a synthetic clip, uploaded under ``name`` to the Base model's
    server at ``url`` for the block, deleted after it."""
    import soundfile as sf

    from omni_stream.voices.synthetic import voiced_clip

    buf = io.BytesIO()
    sf.write(buf, voiced_clip(2.5), 24000, format="WAV", subtype="PCM_16")
    async with aiohttp.ClientSession() as http:
        async with http.delete(f"{url}/v1/audio/voices/{name}"):
            pass  # left by an interrupted run on the same server: 404 otherwise
        form = aiohttp.FormData()
        form.add_field("audio", buf.getvalue(), filename="ref.wav", content_type="audio/wav")
        form.add_field("name", name)
        form.add_field("ref_text", "A short reference sentence for the cloned voice.")
        async with http.post(url + "/v1/audio/voices", data=form) as r:
            assert r.status == 201, await r.text()
        try:
            yield name
        finally:
            async with http.delete(f"{url}/v1/audio/voices/{name}"):
                pass


async def greedy_frames(url: str, text: str, voice: str | None = None,
                        timeout: float = 120.0) -> np.ndarray:
    """The codec frames [F, 16] of one greedy utterance over the WebSocket (codec_frames
    mode: the codes themselves, no decode in between)."""
    import json

    config = {"type": "session.config", "codec_frames": True, "greedy": True,
              "split_sentences": False}
    if voice is not None:
        config["voice"] = voice
    frames: list[np.ndarray] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.ws_connect(url.rstrip("/") + "/v1/audio/speech/stream") as ws:
            await ws.send_str(json.dumps(config))
            await ws.send_str(json.dumps({"type": "input.text", "text": text}))
            await ws.send_str(json.dumps({"type": "session.close"}))
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    frames.append(np.frombuffer(msg.data, dtype="<i8").reshape(-1, 16))
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    ev = json.loads(msg.data)
                    if ev["type"] == "error":
                        raise AssertionError(f"server error: {ev}")
                    if ev["type"] == "session.done":
                        break
                else:
                    break
    return np.concatenate(frames) if frames else np.zeros((0, 16), dtype=np.int64)

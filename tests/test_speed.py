"""OpenAI ``speed``: the stretcher (pitch, exact length, joins, edge chunks), the server paths
(HTTP audio / SSE / whole file, WebSocket session and per utterance) against FakeBackend, and
the duration ratio of a seeded request on the tiny model's real server."""

from __future__ import annotations

import base64
import json

import aiohttp
import numpy as np
import pytest

from omni_stream.server.fake_backend import FakeBackend
from omni_stream.server.speed import Stretcher
from omni_stream.server.testing import post_speech as post
from omni_stream.server.testing import run_async as arun
from omni_stream.server.testing import running_server

pytest.importorskip("pylibrb")

SR = 24000
SPEEDS = (0.5, 1.5, 2.0)
WS_PATH = "/v1/audio/speech/stream"


def stretch_chunks(speed: float, x: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """``x`` pushed chunk by chunk (sizes, then the rest) and finished: the outputs."""
    st, outs, i = Stretcher(speed, SR), [], 0
    for n in [*sizes, len(x)]:
        outs.append(st.push(x[i:i + n]))
        i += n
    outs.append(st.finish())
    return outs


def dominant_hz(y: np.ndarray) -> float:
    y = y[len(y) // 4: 3 * len(y) // 4]  # the steady middle
    spec = np.abs(np.fft.rfft(y * np.hanning(len(y)), 8 * len(y)))
    return float(np.argmax(spec)) * SR / (8 * len(y))


@pytest.mark.parametrize("speed", SPEEDS)
@pytest.mark.parametrize("hz", [220.0, 1000.0])
def test_stretch_keeps_pitch_exact_length_and_joins(speed, hz):
    x = (0.5 * np.sin(2 * np.pi * hz * np.arange(SR) / SR)).astype(np.float32)  # 1 s
    sizes = [1920, 1920, 3840, 7680]  # the server's ramp: 1, 1, 2, 4 frames
    outs = stretch_chunks(speed, x, sizes)
    y = np.concatenate(outs)
    assert len(y) == round(len(x) / speed)
    assert abs(dominant_hz(y) / hz - 1) < 0.02
    joins = np.cumsum([len(o) for o in outs[:-1]])
    joins = joins[(joins > 0) & (joins < len(y))]
    d = np.abs(np.diff(y))
    inner = np.delete(d, joins - 1)  # the stretched tone's own steps, joins left out
    body = slice(SR // 20, len(y) - SR // 20)  # the fade-in and the flushed tail aside
    own = float(np.max(np.abs(np.diff(x))))
    assert np.max(d[joins - 1]) <= max(float(np.max(inner[body])), own) * 1.01
    assert float(np.max(d[body])) <= own * 1.05  # no click anywhere in the body


@pytest.mark.parametrize("sizes", [[], [0], [1], [1, 1, 1], [7, 0, 100], [300] * 7])
def test_stretch_edge_chunks_give_the_exact_length(sizes):
    """Empty audio, 1-sample chunks, chunks shorter than the stretcher's block."""
    total = sum(sizes)
    x = (0.3 * np.sin(2 * np.pi * 440 * np.arange(total) / SR)).astype(np.float32)
    for speed in (0.25, 2.0, 4.0):
        st = Stretcher(speed, SR)
        outs = [st.push(x[i - n:i]) for i, n in zip(np.cumsum(sizes, dtype=int), sizes)]
        y = np.concatenate([*outs, st.finish()])
        assert y.dtype == np.float32 and len(y) == round(total / speed)


# --- the server, against FakeBackend --------------------------------------------------------
def test_speed_one_is_byte_identical_to_omitted_and_other_speeds_scale_every_mode():
    async def main():
        out = {}
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            for speed in (None, 1.0, 0.5, 2.0):
                for fmt, extra in (("pcm", {}), ("wav", {}), ("pcm", {"stream_format": "sse"}),
                                   ("flac", {}), ("wav", {"stream": False})):
                    body = {"input": "Hello there, a short test.", "seed": 3,
                            "response_format": fmt, **extra}
                    if speed is not None:
                        body["speed"] = speed
                    status, _, raw = await post(s, url, body)
                    assert status == 200, raw[:300]
                    out[speed, fmt, json.dumps(extra)] = raw
        return out

    out = arun(main())
    for key in {k[1:] for k in out}:
        assert out[(1.0, *key)] == out[(None, *key)], key
    base = out[None, "pcm", "{}"]
    for speed in (0.5, 2.0):
        assert len(out[speed, "pcm", "{}"]) // 2 == round(len(base) // 2 / speed)
        sse = [json.loads(r[6:]) for r in out[speed, "pcm", '{"stream_format": "sse"}']
               .decode().split("\n\n") if r.strip()]
        pcm = b"".join(base64.b64decode(e["audio"]) for e in sse if "audio" in e)
        assert pcm == out[speed, "pcm", "{}"]  # same stretcher path, same samples
        assert out[speed, "wav", '{"stream": false}'][44:] == pcm
        assert out[speed, "flac", "{}"][:4] == b"fLaC"


def test_stretcher_fault_fails_that_stream_only(monkeypatch):
    from omni_stream.server import speed as speed_mod

    real = speed_mod.Stretcher.push

    def push(self, pcm):
        if self.speed == 3.0:
            raise RuntimeError("boom")
        return real(self, pcm)

    monkeypatch.setattr(speed_mod.Stretcher, "push", push)

    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            bad = await post(s, url, {"input": "Hello.", "speed": 3.0, "response_format": "pcm",
                                      "stream": False})
            good = await post(s, url, {"input": "Hello.", "speed": 2.0,
                                       "response_format": "pcm", "stream": False})
            return bad, good

    bad, good = arun(main())
    assert bad[0] == 500 and json.loads(bad[2])["error"]["code"] == "speed_failed"
    assert good[0] == 200 and len(good[2]) > 0


def test_without_the_stretcher_speed_is_refused_by_name_and_one_still_serves(monkeypatch):
    from omni_stream.server import speed as speed_mod

    monkeypatch.setattr(speed_mod, "speed_available", lambda: False)

    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            refused = await post(s, url, {"input": "Hello.", "speed": 1.5,
                                          "response_format": "pcm", "stream": False})
            one = await post(s, url, {"input": "Hello.", "speed": 1.0, "response_format": "pcm",
                                      "stream": False})
            return refused, one

    refused, one = arun(main())
    err = json.loads(refused[2])["error"]
    assert refused[0] == 400 and err["code"] == "unsupported_speed" and err["param"] == "speed"
    assert "omni-stream[speed]" in err["message"]
    assert one[0] == 200 and len(one[2]) > 0


async def _ws_pcm(ws) -> list[tuple[dict, bytes]]:
    """(audio.start, pcm) per utterance until session.done."""
    out: list[tuple[dict, bytes]] = []
    while True:
        msg = await ws.receive(timeout=30)
        if msg.type == aiohttp.WSMsgType.BINARY:
            out[-1] = (out[-1][0], out[-1][1] + msg.data)
            continue
        event = json.loads(msg.data)
        assert event["type"] != "error", event
        if event["type"] == "audio.start":
            out.append((event, b""))
        elif event["type"] == "audio.done":
            out[-1] = ({**out[-1][0], "frames": event["usage"]["output_tokens"]}, out[-1][1])
        elif event["type"] == "session.done":
            return out


async def ws_speeds(url: str, sentences: list[tuple[str, float | None]], *,
                    session_speed: float | None = None, continuous: bool = False):
    """One session: its speed, then each (text, speed) as an input.text; the utterances."""
    async with aiohttp.ClientSession() as s, s.ws_connect(url + WS_PATH) as ws:
        assert (await ws.receive_json())["type"] == "session.created"
        await ws.send_json({"type": "session.config", "seed": 5,
                            **({"text_mode": "continuous"} if continuous else {}),
                            **({"speed": session_speed} if session_speed is not None else {})})
        assert (await ws.receive_json())["session"]["speed"] == (session_speed or 1.0)
        for text, speed in sentences:
            await ws.send_json({"type": "input.text", "text": text,
                                **({"speed": speed} if speed is not None else {})})
        await ws.send_json({"type": "session.close"})
        return await _ws_pcm(ws)


def check_utterance_speeds(utts, speeds: list[float]) -> None:
    assert [u[0].get("speed", 1.0) for u in utts] == speeds
    for start, pcm in utts:
        assert len(pcm) // 2 == round(start["frames"] * 1920 / start.get("speed", 1.0))


@pytest.mark.parametrize("continuous", [False, True])
def test_websocket_session_and_per_utterance_speed(continuous):
    async def main():
        async with running_server(FakeBackend()) as url:
            return await ws_speeds(url, [("One sentence here. ", None),
                                         ("Two sentences now. ", 2.0), ("Three at last. ", None)],
                                   session_speed=0.5, continuous=continuous)

    check_utterance_speeds(arun(main()), [0.5, 2.0, 0.5])


def test_websocket_refuses_speed_with_codec_frames():
    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s, \
                s.ws_connect(url + WS_PATH) as ws:
            await ws.receive_json()
            await ws.send_json({"type": "session.config", "codec_frames": True, "speed": 1.5})
            e1 = await ws.receive_json()
            await ws.send_json({"type": "session.config", "codec_frames": True})
            await ws.receive_json()
            await ws.send_json({"type": "input.text", "text": "Hi. ", "speed": 2.0})
            e2 = await ws.receive_json()
            await ws.send_str('{"type": "input.text", "text": "Hi. ", "speed": NaN}')
            return e1, e2, await ws.receive_json()

    e1, e2, e3 = arun(main())
    assert e3["error"]["code"] == "invalid_value" and "0.25 and 4.0" in e3["error"]["message"]
    for e in (e1, e2):
        assert e["type"] == "error" and e["error"]["code"] == "speed_with_codec_frames"
        assert e["error"]["param"] == "speed"


# --- the tiny model's real server -----------------------------------------------------------
def test_seeded_request_duration_scales_with_speed_on_the_tiny_model(agents_server):
    async def main():
        out = {}
        async with aiohttp.ClientSession() as s:
            for speed in (1.0, *SPEEDS):
                status, _, raw = await post(s, agents_server, {
                    "input": "A short seeded test.", "seed": 11, "response_format": "pcm",
                    "max_new_tokens": 24, "speed": speed})
                assert status == 200, raw[:300]
                out[speed] = len(raw) // 2
        return out

    n = arun(main(), timeout=180)
    assert n[1.0] > 0
    for speed in SPEEDS:
        assert abs(n[speed] / (n[1.0] / speed) - 1) < 0.03, (speed, n)


def test_websocket_per_utterance_speed_on_the_tiny_model(agents_server):
    utts = arun(ws_speeds(agents_server, [("Hello there. ", 1.5), ("And again. ", None)]),
                timeout=180)
    check_utterance_speeds(utts, [1.5, 1.0])

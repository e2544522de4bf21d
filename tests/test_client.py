"""Streaming client and the real-time playback model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

from clients.playback import simulate_playback
from clients.stream_client import main as client_main
from omni_stream.server.audio import to_s16le
from omni_stream.server.fake_backend import FakeBackend, expected_frames, fake_audio
from omni_stream.server.testing import serving_in_thread


def test_playback_on_time_has_no_underrun():
    r = simulate_playback([0.0, 0.05, 0.1, 0.2], [0.08, 0.16, 0.32, 0.64])
    assert r.underruns == 0 and r.underrun_s == 0.0
    assert r.max_gap_s == pytest.approx(0.1) and r.played_s == pytest.approx(1.2)


def test_playback_late_chunk_counts_once_and_stalls():
    # second chunk needed at 0.08, arrives at 0.3: one stall of 0.22 s; the third is then on time
    r = simulate_playback([0.0, 0.3, 0.35], [0.08, 0.08, 0.08])
    assert r.underruns == 1 and r.underrun_s == pytest.approx(0.22)
    # a start-up buffer absorbs the same lateness
    assert simulate_playback([0.0, 0.3, 0.35], [0.08, 0.08, 0.08], prebuffer_s=0.25).underruns == 0
    with pytest.raises(ValueError):
        simulate_playback([0.0], [])


def serving(backend: FakeBackend):
    """Serve ``backend`` on a background loop thread (the CLI runs its own event loop)."""
    from omni_stream.server.app import start_server

    return serving_in_thread(lambda: start_server(backend, "127.0.0.1", 0))


@pytest.fixture()
def fake_server():
    """A FakeBackend 16x faster than real time (5 ms per 80 ms frame)."""
    with serving(FakeBackend(frame_delay=0.005)) as url:
        yield url


class ServerTime(FakeBackend):
    """A FakeBackend that takes no real time: it moves ``clock`` (the client's injected
    ``time.monotonic``) on by ``frame_s`` per frame it makes, before handing the frame out. So
    the client sees the timeline of a server that needs ``frame_s`` per frame on any machine
    under any load: a chunk arrives no earlier than it was made, and at the latest when the
    whole stream was (a client that lags reads later, never sooner)."""

    def __init__(self, frame_s: float) -> None:
        super().__init__()
        self.frame_s = frame_s
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def stream(self, job):
        async for chunk in super().stream(job):
            self.now += chunk.frames * self.frame_s
            yield chunk


@pytest.fixture()
def server_time(monkeypatch):
    """A server making a frame in 5 ms of the client's (injected) clock; its URL and backend."""
    from clients import stream_client

    backend = ServerTime(frame_s=0.005)
    monkeypatch.setattr(stream_client, "time", SimpleNamespace(monotonic=backend.clock))
    with serving(backend) as url:
        yield url, backend


def _client_figures(url: str, out, capsys) -> dict:
    rc = client_main(["--url", url, "--text", "Hello there, general.", "--seed", "3",
                      "--out", str(out), "--json"])
    assert rc == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_client_writes_wav_and_reports(server_time, tmp_path, capsys):
    url, backend = server_time
    out = tmp_path / "a.wav"
    fig = _client_figures(url, out, capsys)
    data, sr = sf.read(out, dtype="int16")
    # "Hello there, general." is 6 frames, sent as chunks of 1, 2, 3
    frames = expected_frames("Hello there, general.")
    assert sr == 24000 and len(data) == frames * 1920
    np.testing.assert_array_equal(data, np.frombuffer(to_s16le(fake_audio(3, 0, len(data))), "<i2"))
    assert fig["audio_s"] == pytest.approx(len(data) / 24000, abs=1e-3)
    # on the injected clock: the first audio once its 1 frame was made (or later, if the client
    # read it late), and the stream over once its 6 frames were: RTF 5 ms / 80 ms per frame
    assert 5.0 <= fig["ttfa_ms"] <= frames * 5.0 and 1 <= fig["chunks"] <= 3
    assert fig["rtf"] == pytest.approx(0.005 / 0.08, abs=1e-3)  # faster than real time...
    # ...with >= 70 ms to spare on every chunk (a chunk takes 5 ms per frame to make while the
    # one before it, no smaller, plays 80 ms per frame): a player never starves
    assert fig["underruns"] == 0 and fig["underrun_s"] == 0.0


def test_client_counts_underruns_when_the_server_is_slower_than_real_time(tmp_path, capsys):
    # 150 ms per 80 ms frame: a chunk takes 150 ms per frame to make while the one before it,
    # no larger, plays 80 ms per frame, so every chunk after the first arrives late
    with serving(FakeBackend(frame_delay=0.15)) as url:
        fig = _client_figures(url, tmp_path / "slow.wav", capsys)
    assert fig["rtf"] > 1.0
    assert fig["chunks"] >= 2 and fig["underruns"] == fig["chunks"] - 1
    assert fig["underrun_s"] >= 0.2


def test_client_errors_are_clear(fake_server, tmp_path, capsys):
    assert client_main(["--url", "http://127.0.0.1:9", "--text", "hi", "--out", str(tmp_path / "x.wav")]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert client_main(["--url", fake_server, "--text", "hi", "--voice", "nobody",
                        "--out", str(tmp_path / "x.wav")]) == 2
    assert "400" in capsys.readouterr().err
    # a local decoder backend needs its model: refused before any request
    assert client_main(["--url", fake_server, "--text", "hi", "--decoder-backend", "torch",
                        "--out", str(tmp_path / "x.wav")]) == 2
    assert "--decoder-backend torch needs --codec-model DIR" in capsys.readouterr().err
    assert client_main(["--url", fake_server, "--text", "hi", "--decoder-backend", "executorch",
                        "--out", str(tmp_path / "x.wav")]) == 2
    assert "needs --pte-manifest PATH" in capsys.readouterr().err

"""The continuous-text client (``clients/continuous.py``, ``omni-stream-client --text-stdin
--continuous``) against the real server on the tiny model: text fed piece by piece, with
pauses, speaks what the same text sent whole does (within 2 LSB); the pauses are reported as
waits; a pipe on stdin is read piece by piece as it is written, UTF-8 split anywhere."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import numpy as np
import pytest
import soundfile as sf

from clients.continuous import ContinuousResult, fd_pieces, speak_continuous
from clients.result import ClientError
from clients.stream_client import main as client_main
from omni_stream.orchestrator import PipelineBackend
from omni_stream.server.testing import run_async, serving_in_thread
from tests.servers import tiny_settings
from speech_checks import llm_pieces, same_speech

pytestmark = pytest.mark.timeout(180)

FRAMES = 60
TEXT = "Hello world, this is a stream of words from a language model. Café, 中文！ done."
OPTS = dict(voice="ryan", language="english", greedy=True, max_new_tokens=FRAMES)


@pytest.fixture(scope="module")
def url(tiny_ckpt):
    """One server for the module, on a background loop (the CLI runs its own loop)."""
    from omni_stream.server.app import start_server

    settings = tiny_settings(tiny_ckpt, max_queue=8)
    with serving_in_thread(lambda: start_server(PipelineBackend(settings), "127.0.0.1", 0),
                           timeout=120) as u:
        yield u


@pytest.fixture(scope="module")
def whole(url) -> ContinuousResult:
    """The reference: the whole text as one piece."""
    return run_async(speak_continuous(url, [TEXT], **OPTS), timeout=120)


def test_pieces_with_pauses_speak_the_whole_text_and_report_the_waits(url, whole):
    pieces = llm_pieces(TEXT)
    assert "".join(pieces) == TEXT
    got: list[np.ndarray] = []
    first_audio = asyncio.Event()

    def on_chunk(block: np.ndarray) -> None:
        got.append(block)
        first_audio.set()

    async def llm():
        for i, p in enumerate(pieces):
            if i == len(pieces) - 1:  # the last piece only once audio came: ordering
                try:
                    await asyncio.wait_for(first_audio.wait(), 60)  # a liveness bound
                except asyncio.TimeoutError:
                    raise AssertionError("no audio while the text was still being written "
                                         f"({i} of {len(pieces)} pieces sent)") from None
            # a writer that stalls twice for longer than the spoken backlog lasts
            await asyncio.sleep(1.0 if i in (3, 9) else 0.02)
            yield p

    res = run_async(speak_continuous(url, llm(), on_chunk=on_chunk, **OPTS), timeout=120)
    same_speech(res.pcm, whole.pcm)
    assert np.array_equal(np.concatenate(got), res.pcm)
    assert res.pieces == len(pieces) and len(res.utterances) == 1
    # the audio began while the text was still being written
    assert res.first_audio_at < res.last_text_at
    assert 0 < res.first_audio_after_text_s == pytest.approx(res.ttfa_s)
    kinds = [w["type"] for w in res.waits]
    assert "text.waiting" in kinds and kinds.count("text.waiting") == kinds.count("text.resumed")
    assert res.text_waited_ms == res.utterances[0]["text_waited_ms"] > 300
    assert res.playback(0.0).underruns >= 1  # a player starves while the writer stalls
    assert whole.text_waited_ms >= 0 and whole.finish_reason in ("stop", "length")


def test_a_server_error_is_raised_with_its_message(url):
    with pytest.raises(ClientError, match=r"text_mode.*unknown text_mode 'words'"):
        run_async(speak_continuous(url, ["Hi."], extra={"text_mode": "words"}), timeout=30)
    with pytest.raises(ClientError, match="cannot reach"):
        run_async(speak_continuous("http://127.0.0.1:9", ["Hi."]), timeout=30)

    async def broken_llm():
        yield "Hello "
        raise ValueError("the LLM failed")

    with pytest.raises(ValueError, match="the LLM failed"):  # the text source's own error
        run_async(speak_continuous(url, broken_llm(), **OPTS), timeout=30)


def _feed_stdin(monkeypatch, chunks: list[tuple[float, bytes]]) -> threading.Thread:
    """Replace stdin with a pipe written by a thread: (pause, bytes) per write."""
    r, w = os.pipe()
    monkeypatch.setattr("sys.stdin", open(r, "r", closefd=True))

    def write():
        with open(w, "wb", buffering=0) as f:
            for pause, data in chunks:
                time.sleep(pause)
                f.write(data)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def _split_bytes(text: str) -> list[bytes]:
    """The text's UTF-8 in pieces of 5 bytes: multibyte characters are cut across writes."""
    b = text.encode()
    return [b[i:i + 5] for i in range(0, len(b), 5)]


def test_cli_text_stdin_continuous_writes_the_wav(url, whole, tmp_path, capsys, monkeypatch):
    parts = _split_bytes(TEXT)
    assert any(len(p.decode("utf-8", "replace")) != len(p.decode("utf-8", "ignore"))
               for p in parts)  # some write ends mid-character
    t = _feed_stdin(monkeypatch, [(0.6 if i == 4 else 0.01, p) for i, p in enumerate(parts)])
    out = tmp_path / "c.wav"
    rc = client_main(["--url", url, "--text-stdin", "--continuous", "--voice", "ryan",
                      "--language", "english", "--greedy", "--max-new-tokens", str(FRAMES),
                      "--out", str(out), "--json"])
    t.join(5)
    assert rc == 0, capsys.readouterr().err
    fig = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    data, sr = sf.read(out, dtype="int16")
    assert sr == 24000
    same_speech(data, whole.pcm)
    assert fig["text_waited_ms"] >= 0 and fig["utterances"] == 1 and fig["ttfa_ms"] > 0


def test_cli_text_stdin_without_continuous_reads_it_all(url, tmp_path, capsys, monkeypatch):
    _feed_stdin(monkeypatch, [(0.0, b"Hello "), (0.2, "there, café.".encode())])
    out = tmp_path / "s.wav"
    rc = client_main(["--url", url, "--text-stdin", "--voice", "ryan", "--greedy",
                      "--max-new-tokens", "8", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    line = capsys.readouterr().out
    assert "TTFA" in line and "waited" not in line
    n = len(sf.read(out, dtype="int16")[0])
    assert 0 < n <= 8 * 1920 and n % 1920 == 0
    with pytest.raises(SystemExit):  # exactly one source of text
        client_main(["--url", url, "--text", "hi", "--text-stdin"])
    capsys.readouterr()


def test_fd_pieces_come_as_written_and_decode_split_utf8():
    text = "añb 中文 👩🏽‍💻 ok"
    raw = text.encode()

    async def main():
        r, w = os.pipe()
        it = fd_pieces(r, read_size=3)
        got = []
        try:
            # one byte at a time, each read before the next is written: nothing waits for EOF,
            # and a character comes out whole once its last byte is in
            for i in range(len(raw)):
                os.write(w, raw[i:i + 1])
                if i + 1 == len(raw) or (raw[i + 1] & 0xC0) != 0x80:  # a character's last byte
                    got.append(await asyncio.wait_for(it.__anext__(), 5))
            os.close(w)
            w = -1
            rest = [p async for p in it]
        finally:
            if w >= 0:
                os.close(w)
            os.close(r)
        return got, rest

    got, rest = run_async(main(), timeout=30)
    assert "".join(got) == text and rest == []
    assert all("\ufffd" not in p for p in got)
    assert len(got) == len(text)  # one piece per character: emitted as soon as it is complete


def test_fd_pieces_refuses_bad_utf8():
    async def main():
        r, w = os.pipe()
        os.write(w, b"ok \xff\xfe")
        os.close(w)
        try:
            return [p async for p in fd_pieces(r)]
        finally:
            os.close(r)

    with pytest.raises(ClientError, match="not UTF-8"):
        run_async(main(), timeout=10)

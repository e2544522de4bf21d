"""The playground at ``/`` in a real browser (headless Chromium, tests/browser_harness.py)
against real servers: the tiny custom-voice pipeline (``ui_server``), the tiny Base model for
cloning (``ui_base_server``) and a fake backend behind an API key.

One page serves the custom-voice tests, in order (load, keyboard, seeded playback, typing and
stop), to keep the browser work small. The page's test hooks are ``window.omniPlayground``:
the server's events, the player's stats, and (``?tap``) the PCM its AudioWorklet received."""

from __future__ import annotations

import json
import re
import time
import urllib.request
import wave

import numpy as np
import pytest

from browser_harness import open_page

pytestmark = pytest.mark.timeout(300)

RATE = 24000
WAIT_MS = 90_000  # a loaded 2-core machine runs the tiny model near real time


def _events(page, kind: str) -> list[dict]:
    return page.evaluate("(k) => omniPlayground.events.filter(e => e.type === k)", kind)


def _wait_event(page, kind: str, after: int = 0) -> None:
    """Until the page has more than ``after`` events of ``kind``."""
    page.wait_for_function("([k, n]) => omniPlayground.events.filter(e => e.type === k)"
                           ".length > n", arg=[kind, after], timeout=WAIT_MS)


_JOIN_B64 = """(chunks) => {
    const n = chunks.reduce((a, c) => a + c.byteLength, 0);
    const all = new Uint8Array(n);
    let at = 0;
    for (const c of chunks) {
        all.set(new Uint8Array(c.buffer || c, c.byteOffset || 0, c.byteLength), at);
        at += c.byteLength;
    }
    let s = "";
    for (let i = 0; i < n; i += 8192) s += String.fromCharCode.apply(null, all.subarray(i, i + 8192));
    return btoa(s);
}"""


def _pcm(page, chunks: str) -> bytes:
    """The chunks (Int16Arrays or ArrayBuffers) that the page expression ``chunks`` names,
    joined, as bytes."""
    import base64

    return base64.b64decode(page.evaluate(f"() => ({_JOIN_B64})({chunks})"))


def _played(page) -> bytes:
    """What the page's AudioWorklet received (the tap), and check it is exactly what came over
    the WebSocket for the last request."""
    played = _pcm(page, "omniPlayground.received")
    assert played == _pcm(page, "omniPlayground.request.pcm")
    return played


def _server_pcm(url: str, body: dict, key: str | None = None) -> bytes:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + "/v1/audio/speech", method="POST",
                                 data=json.dumps({**body, "response_format": "pcm"}).encode(),
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def _active_streams(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in
               re.findall(r"^omni_stream_active_streams(?:\{[^}]*\})? (\S+)$", text, re.M))


def _arrival_margin_ms(page) -> float:
    """How early the latest-arriving audio came, in ms, for a player that starts with the
    first chunk and then plays in real time: below 0, some audio came after it was due."""
    arrivals = page.evaluate("omniPlayground.arrivals")
    due, margin = arrivals[0][0], float("inf")
    for (_, played), (at, _) in zip(arrivals, arrivals[1:]):
        due += played / RATE * 1000
        margin = min(margin, due - at)
    return margin


def _speak_and_wait(page) -> None:
    done = len(_events(page, "context.done"))
    page.click("#speak")
    _wait_event(page, "context.done", done)


@pytest.fixture(scope="module")
def page(browser, ui_server):
    p = open_page(browser, ui_server + "/?tap")
    p.wait_for_function("document.getElementById('voice').options.length > 0")
    yield p
    p.close()


# ------------------------------------------------------------------------ the custom-voice page
def test_page_loads_without_console_errors(page):
    voices = page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)")
    assert "ryan" in voices and len(voices) == 9
    assert "english" in page.eval_on_selector_all("#language option",
                                                  "os => os.map(o => o.value)")
    assert page.is_hidden("#clone")  # a custom-voice model cannot clone
    assert page.is_hidden("#key-panel")
    assert page.errors == []


def test_keyboard_only_use(page):
    page.evaluate("document.activeElement && document.activeElement.blur()")
    for _ in range(6):  # the header's link, then the text box
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "text":
            break
    assert page.evaluate("document.activeElement.id") == "text"
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none"
    page.keyboard.press("Control+A")
    page.keyboard.type("Hi there.")
    for _ in range(4):  # voice, language, seed, max frames
        page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "max-frames"
    page.keyboard.type("6")
    done = len(_events(page, "context.done"))
    page.keyboard.press("Control+Enter")
    _wait_event(page, "context.done", done)
    start = _events(page, "audio.start")[-1]
    assert start["text"] == "Hi there." and start["sample_rate"] == RATE
    assert page.evaluate("omniPlayground.arrivals.length") > 0
    assert page.text_content("#error") == ""
    assert page.errors == []


def test_seeded_playback_is_the_servers_pcm_without_underruns(page, ui_server):
    body = {"input": "Hello there.", "voice": "ryan", "language": "english", "seed": 7,
            "max_new_tokens": 25}
    page.fill("#text", body["input"])
    page.select_option("#voice", body["voice"])
    page.select_option("#language", body["language"])
    page.fill("#seed", str(body["seed"]))
    page.fill("#max-frames", str(body["max_new_tokens"]))
    page.wait_for_function("omniPlayground.stats.state === 'idle'", timeout=WAIT_MS)
    underruns = page.evaluate("omniPlayground.stats.underruns")
    page.evaluate("omniPlayground.clearReceived()")
    _speak_and_wait(page)
    page.wait_for_function("omniPlayground.stats.state === 'idle'", timeout=WAIT_MS)

    played = np.frombuffer(_played(page), "<i2").astype(np.int32)
    server = np.frombuffer(_server_pcm(ui_server, body), "<i2").astype(np.int32)
    assert played.size == server.size == 25 * 1920
    # bit for bit: the server's decode does not depend on how its chunks fell
    # (tests/test_repeatable_audio.py), and the page plays exactly what it received
    assert np.array_equal(played, server), int((played != server).sum())

    # the counter: 0 when the audio came in time, and it counts when it did not (this machine
    # may be loaded by other work; the margin says which case this run was)
    new = page.evaluate("omniPlayground.stats.underruns") - underruns
    margin = _arrival_margin_ms(page)
    print(f"underruns {new}, latest chunk {margin:.0f} ms before it was due")
    if margin > 15:
        assert new == 0, f"{new} underruns with every chunk {margin:.0f} ms early"
    elif margin < -30:
        assert new >= 1, f"audio came {-margin:.0f} ms late, but no underrun was counted"
    assert page.text_content("#ttfa").endswith("ms") and page.text_content("#rtf") != "–"

    page.select_option("#format", "wav")
    with page.expect_download() as got:  # the WAV of what was played, as played
        page.click("#download")
    with wave.open(str(got.value.path()), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        assert w.readframes(w.getnframes()) == played.astype("<i2").tobytes()
    page.select_option("#format", "pcm")
    with page.expect_download(timeout=WAIT_MS) as got:  # other formats: the server encodes
        page.click("#download")
    again = np.frombuffer(got.value.path().read_bytes(), "<i2").astype(np.int32)
    assert np.array_equal(again, played)  # the same request again: the same bytes
    assert page.errors == []


def test_speak_as_you_type_and_stop_frees_the_slot(page, ui_server):
    page.check("#typing")
    page.fill("#max-frames", "")
    page.fill("#seed", "")
    page.fill("#text", "")
    starts = len(_events(page, "audio.start"))
    page.focus("#text")
    text = "Hello there, how are you today"
    page.keyboard.type(text[:-1], delay=60)
    _wait_event(page, "text.waiting")  # speech caught up with the writer ...
    page.wait_for_function("document.getElementById('status').textContent.includes('waiting')",
                           timeout=WAIT_MS)
    assert len(_events(page, "audio.start")) > starts  # ... and so began before the last key
    page.keyboard.type(text[-1])
    assert _active_streams(ui_server) >= 1  # the utterance stays open: no input.done yet

    page.keyboard.press("Escape")  # barge-in
    _wait_event(page, "audio.cancelled")
    page.wait_for_function("omniPlayground.stats.state === 'idle' && "
                           "omniPlayground.stats.buffered_s === 0", timeout=5000)
    deadline = time.monotonic() + 10
    while _active_streams(ui_server) != 0:
        assert time.monotonic() < deadline, "the stopped stream still holds its slot"
        time.sleep(0.05)
    page.uncheck("#typing")
    assert page.errors == []


# ------------------------------------------------------------------------ cloning (Base model)
def _clip(path, seconds: float = 3.0) -> None:
    t = np.arange(int(seconds * RATE)) / RATE
    rng = np.random.default_rng(0)
    x = 0.3 * np.sin(2 * np.pi * 170 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)) \
        + 0.02 * rng.standard_normal(t.size)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


def test_a_voice_uploaded_from_the_page_lists_and_speaks(browser, ui_base_server, tmp_path):
    clip = tmp_path / "me.wav"
    _clip(clip)
    p = open_page(browser, ui_base_server + "/")
    try:
        p.wait_for_selector("#clone", state="visible")
        p.fill("#clone-name", "pgvoice")
        p.set_input_files("#clone-file", str(clip))
        p.click("#upload")
        p.wait_for_function("document.getElementById('clone-status').textContent"
                            ".includes('added')", timeout=WAIT_MS)
        assert p.eval_on_selector("#voice", "s => s.value") == "pgvoice"
        assert p.eval_on_selector("optgroup[label='Uploaded']",
                                  "g => [...g.children].map(o => o.value)") == ["pgvoice"]
        p.fill("#text", "Hi.")
        p.fill("#max-frames", "4")
        _speak_and_wait(p)
        assert _events(p, "audio.start")[-1]["text"] == "Hi."
        assert p.evaluate("omniPlayground.arrivals.length") > 0
        assert p.text_content("#error") == ""

        p.click("#record")  # Chromium's fake microphone (a beep), recorded and sent as WAV
        time.sleep(1.5)
        p.click("#record")
        p.wait_for_function("document.getElementById('clip-info').textContent"
                            ".startsWith('recording: ')", timeout=WAIT_MS)
        p.fill("#clone-name", "pgmic")
        p.click("#upload")
        p.wait_for_function("document.getElementById('clone-status').textContent"
                            ".includes(\"'pgmic' added\")", timeout=WAIT_MS)

        p.fill("#clone-name", "pgvoice")
        p.click("#upload")  # the same name again: the server's words
        p.wait_for_function("document.getElementById('clone-status').textContent"
                            ".includes(\"a voice named 'pgvoice' exists\")", timeout=WAIT_MS)
        assert [e for e in p.errors if "status of 409" not in e] == []  # the browser logs it
    finally:
        p.close()


# ------------------------------------------------------------------------ the fake backend
def _fake_server(**settings):
    from omni_stream.server.app import start_server
    from omni_stream.server.fake_backend import FakeBackend
    from omni_stream.server.settings import ServerSettings
    from omni_stream.server.testing import serving_in_thread

    return serving_in_thread(lambda: start_server(FakeBackend(), "127.0.0.1", 0,
                                                  ServerSettings(**settings)))


@pytest.fixture(scope="module")
def keyed_server():
    with _fake_server(api_key="k1") as url:
        yield url


def test_a_context_at_another_rate_resamples(browser):
    with _fake_server() as url:
        p = open_page(browser, url + "/?tap&rate=48000")
        try:
            p.wait_for_function("document.getElementById('voice').options.length > 0")
            text = "Resampled in the page."  # the fake speaks 1 + 22 // 4 = 6 frames
            p.fill("#text", text)
            _speak_and_wait(p)
            p.wait_for_function("omniPlayground.stats.state === 'idle'", timeout=WAIT_MS)
            assert p.evaluate("omniPlayground.contextRate") == 48000
            assert len(_played(p)) == 6 * 1920 * 2  # the tap: the stream's own samples
            # 24 kHz in, 48 kHz out: the same duration (the interpolation ends half a sample early)
            assert abs(p.evaluate("omniPlayground.stats.played_s") - 6 * 0.08) < 0.001
            assert p.errors == []
        finally:
            p.close()


# ------------------------------------------------------------------------ an API key


def test_the_api_key_is_asked_once_and_a_wrong_one_shows_the_401(browser, keyed_server):
    """... and, on a deterministic backend, the page plays exactly the server's PCM."""
    p = open_page(browser, keyed_server + "/?tap")
    try:
        p.wait_for_selector("#key-panel", state="visible")  # the voices answered 401
        assert "missing or incorrect API key" in p.text_content("#key-message")
        p.fill("#key", "wrong")
        p.click("#key-panel button[type=submit]")
        p.wait_for_function("document.getElementById('key-message').textContent"
                            ".includes('incorrect API key')")
        assert p.is_visible("#key-panel")
        p.evaluate("document.getElementById('key-message').textContent = ''")
        p.fill("#key", "wrong again")
        p.keyboard.press("Enter")
        p.wait_for_function("document.getElementById('key-message').textContent"
                            ".includes('incorrect API key')")

        p.fill("#key", "k1")
        p.click("#key-panel button[type=submit]")
        p.wait_for_selector("#key-panel", state="hidden")
        assert p.evaluate("sessionStorage.getItem('omni-stream.api-key')") == "k1"
        assert "k1" not in p.url
        p.wait_for_function("document.getElementById('voice').options.length > 0")
        body = {"input": "A keyed request, played in the page.", "voice": "serena",
                "language": "english", "seed": 5}
        p.fill("#text", body["input"])
        p.select_option("#voice", body["voice"])
        p.select_option("#language", body["language"])
        p.fill("#seed", str(body["seed"]))
        _speak_and_wait(p)  # the WebSocket carries the key as its subprotocol
        assert p.text_content("#error") == ""
        played = _played(p)  # chunks of 1, 2, 4, 8 frames, joined in the worklet's buffer
        assert len(played) > 4 * 1920 * 2
        assert played == _server_pcm(keyed_server, body, key="k1")
    finally:
        p.close()

"""The live dashboard at /dashboard in headless Chromium: it loads without a console error,
shows the capacity /health reports, and its chart of time per frame step moves while speech
is made on the tiny pipeline; against a keyed server a wrong key shows the server's 401
message, and the key prompt is filled and submitted with the keyboard alone."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from browser_harness import open_page

pytestmark = pytest.mark.timeout(300)

KEY = "dashboard-key"
TEXT = ("The dashboard draws where each frame step's time goes while this sentence is spoken, "
        "and then it goes on speaking a little longer so that the chart has a few seconds.")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _speak_until(url: str, stop: threading.Event) -> None:
    """Speech requests one after another until ``stop``: load for the chart."""
    body = json.dumps({"input": TEXT, "voice": "vivian", "response_format": "pcm",
                       "max_new_tokens": 60}).encode()
    while not stop.is_set():
        req = urllib.request.Request(url + "/v1/audio/speech", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()


@pytest.fixture(scope="module")
def keyed_server():
    """The fake backend behind an API key (the page's key prompt needs no model)."""
    from omni_stream.server.app import start_server
    from omni_stream.server.fake_backend import FakeBackend
    from omni_stream.server.settings import ServerSettings
    from omni_stream.server.testing import serving_in_thread

    with serving_in_thread(lambda: start_server(FakeBackend(max_streams=2), "127.0.0.1", 0,
                                                ServerSettings(api_key=KEY))) as url:
        yield url


def test_dashboard_shows_capacity_and_its_chart_moves_under_load(browser, ui_server):
    health = _get_json(ui_server + "/health")
    page = open_page(browser, ui_server + "/dashboard")
    try:
        page.wait_for_function("window.omniDashboard && window.omniDashboard.polls >= 2",
                               timeout=20_000)
        assert page.text_content("#capacity") == str(health["capacity_streams"])
        assert page.text_content("#rtf") == f"{health['rtf_estimate']:.2f}"
        assert page.text_content("#bandwidth").endswith("GB/s")  # the talker measured it
        before = page.evaluate("document.getElementById('chart').toDataURL()")
        points = page.evaluate("window.omniDashboard.points.length")
        stop = threading.Event()
        load = threading.Thread(target=_speak_until, args=(ui_server, stop), daemon=True)
        load.start()
        try:
            page.wait_for_function(
                "window.omniDashboard.points.some(p => p.talker_lm > 0 && p.code_predictor > 0)",
                timeout=60_000)
            page.wait_for_function("window.omniDashboard.points.some(p => p.codec > 0)",
                                   timeout=20_000)
        finally:
            stop.set()
            load.join(90)
        assert page.evaluate("window.omniDashboard.points.length") > points
        assert page.evaluate("document.getElementById('chart').toDataURL()") != before
        cell = page.text_content("#parts td[data-part='talker_lm']")
        assert cell != "–" and float(cell) > 0
        assert page.errors == []
    finally:
        page.close()


def test_wrong_key_shows_the_401_message_and_the_prompt_works_by_keyboard(browser,
                                                                         keyed_server):
    page = open_page(browser, keyed_server + "/dashboard")
    try:
        page.wait_for_selector("#key-form:not([hidden])", timeout=10_000)
        assert page.evaluate("document.activeElement.id") == "key-input"  # focused: type
        page.keyboard.type("wrong")
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.textContent") == "Use key"
        page.keyboard.press("Enter")
        page.wait_for_function(
            "document.getElementById('key-error').textContent.includes('incorrect API key')",
            timeout=10_000)
        assert page.evaluate("document.activeElement.id") == "key-input"
        page.keyboard.press("Control+A")
        page.keyboard.type(KEY)
        page.keyboard.press("Enter")
        page.wait_for_function("window.omniDashboard.polls >= 1", timeout=10_000)
        assert page.is_hidden("#key-form")
        assert page.text_content("#capacity") == "2"
        assert page.evaluate("sessionStorage.getItem('omni-stream-api-key')") == KEY
        assert KEY not in page.url
        # the only console errors: the browser's own notes of the two refused fetches
        assert all("401" in e for e in page.errors), page.errors
    finally:
        page.close()

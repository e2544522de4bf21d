"""Headless Chromium for the browser tests: Debian's system browser driven by Playwright (no
browser download), with a fake microphone and audio allowed to start without a gesture."""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator

CHROMIUM_ARGS = ["--autoplay-policy=no-user-gesture-required",
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 "--no-sandbox", "--disable-gpu"]


def chromium_path() -> str:
    path = os.environ.get("OMNI_STREAM_CHROMIUM") or shutil.which("chromium") \
        or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("no Chromium: install Debian's 'chromium' package "
                           "(bash scripts/setup.sh does) or set OMNI_STREAM_CHROMIUM")
    return path


@contextlib.contextmanager
def launch(**kw) -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, **kw)
        try:
            yield b
        finally:
            b.close()


def open_page(browser, url: str):
    """A new page at ``url`` that records console errors and page errors in ``page.errors``."""
    page = browser.new_page()
    page.errors = []
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.goto(url)
    return page

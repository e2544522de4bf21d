"""The pages' routes and the key rules around them (in-process, fake backend): the pages and
their files are public, the API keeps its key, a browser's WebSocket may carry the key as a
subprotocol, and ``--no-ui`` serves the API alone."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import yarl

from omni_stream.server.fake_backend import FakeBackend
from omni_stream.server.settings import ServerSettings
from omni_stream.server.testing import running_server
from omni_stream.server import ui


def _run(coro):
    return asyncio.run(coro)


async def _get(url: str, **kw) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as r:
        return r.status, await r.text()


@pytest.mark.parametrize("path", ["/", "/dashboard"])
def test_pages_are_public_and_the_api_keeps_its_key(path):
    async def go():
        async with running_server(FakeBackend(), ServerSettings(api_key="k1")) as url:
            status, body = await _get(url + path)
            assert status == 200 and "<html" in body
            assert (await _get(url + "/v1/audio/voices"))[0] == 401
            assert (await _get(url + "/v1/audio/voices",
                               headers={"Authorization": "Bearer k1"}))[0] == 200
            for escape in ("/ui/../settings.py", "/ui/%2e%2e/settings.py"):  # none leaves ui/
                status, body = await _get(yarl.URL(url + escape, encoded=True))
                assert status in (401, 403, 404) and "ServerSettings" not in body
    _run(go())


def test_no_ui_serves_the_api_alone():
    async def go():
        async with running_server(FakeBackend(), ServerSettings(ui=False)) as url:
            assert (await _get(url + "/"))[0] == 404
            assert (await _get(url + "/dashboard"))[0] == 404
            assert (await _get(url + "/v1/models"))[0] == 200
    _run(go())


@pytest.mark.parametrize("key,ok", [("k1", True), ("wrong", False), ("", False)])
def test_websocket_key_as_a_subprotocol(key, ok):
    async def go():
        async with running_server(FakeBackend(), ServerSettings(api_key="k1")) as url:
            ws_url = url.replace("http", "ws") + "/v1/audio/speech/stream"
            async with aiohttp.ClientSession() as s:
                protos = (ui.WS_PROTOCOL, ui.WS_BEARER_PREFIX + key)
                if ok:
                    async with s.ws_connect(ws_url, protocols=protos) as ws:
                        assert ws.protocol == ui.WS_PROTOCOL
                        assert (await ws.receive_json())["type"] == "session.created"
                else:
                    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                        await s.ws_connect(ws_url, protocols=protos)
                    assert e.value.status == 401
    _run(go())


def test_ws_bearer_parsing():
    assert ui.ws_bearer("omni-stream, omni-stream.bearer.abc-1") == "abc-1"
    assert ui.ws_bearer("omni-stream") is None
    assert ui.ws_bearer("") is None
    assert ui.public_path("/") and ui.public_path("/ui/player.js")
    assert not ui.public_path("/v1/audio/voices") and not ui.public_path("/metrics")

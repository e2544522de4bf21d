"""The browser pages served beside the API: the playground at ``/`` and the live dashboard at
``/dashboard`` (static files in ``server/ui/``, no build step). ``--no-ui`` leaves them out.

The pages are public (they hold no data; everything they show comes from the API, which keeps
its key). A browser cannot set ``Authorization`` on a WebSocket, so the WebSocket also accepts
the key as a subprotocol, ``omni-stream.bearer.<key>`` beside ``omni-stream`` (the page asks
for the key once and keeps it in ``sessionStorage``, never in a URL).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

UI_DIR = Path(__file__).with_name("ui")
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
PUBLIC_PREFIX = "/ui/"
WS_PROTOCOL = "omni-stream"
WS_BEARER_PREFIX = "omni-stream.bearer."


def public_path(path: str) -> bool:
    """A page or one of its static files: served without the API key."""
    return path in PAGES or path.startswith(PUBLIC_PREFIX)


def ws_bearer(protocols: str) -> str | None:
    """The key a browser sent as a WebSocket subprotocol, or None."""
    for p in protocols.split(","):
        p = p.strip()
        if p.startswith(WS_BEARER_PREFIX):
            return p[len(WS_BEARER_PREFIX):]
    return None


def _page(name: str):
    async def handler(_: web.Request) -> web.FileResponse:
        return web.FileResponse(UI_DIR / name, headers={"Cache-Control": "no-cache"})
    return handler


def add_routes(app: web.Application) -> None:
    for path, name in PAGES.items():
        app.router.add_get(path, _page(name))
    app.router.add_static(PUBLIC_PREFIX, UI_DIR, append_version=False)

"""The aiohttp application: routes, auth and error middleware, lifecycle, and the runner.

Routes (all but /health need ``Authorization: Bearer <key>`` when an API key is set):
  POST /v1/audio/speech          OpenAI speech: chunked pcm/wav, SSE, or a whole file
  GET  /v1/audio/speech/stream   WebSocket text-in / speech-out sessions (see ws.py)
  GET  /v1/audio/voices          built-in and uploaded voices, and the OpenAI alias map
  POST /v1/audio/voices          upload a voice to clone (Base models; multipart, see voices.py)
  DELETE /v1/audio/voices/{name} remove an uploaded voice
  GET  /v1/models[/{model}]      OpenAI model list / retrieve
  GET  /health                   200 {"status": "ok"} when serving, 503 while starting/draining
  GET  /metrics                  Prometheus text
  GET  /v1/stats                 the dashboard's figures: capacity, streams, step parts
  GET  /, /dashboard, /ui/*      the playground and the live dashboard (ui.py; --no-ui: none)
Handlers never touch the model: they build a SpeechJob and iterate ``backend.stream``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from typing import Awaitable, Callable

import msgspec
from aiohttp import WSCloseCode, web

from omni_stream.server import dashboard, ui
from omni_stream.server.audio import supported_formats
from omni_stream.contract import Backend
from omni_stream.errors import RequestError
from omni_stream.server.errors import from_http_exception, http_response, internal_error
from omni_stream.server.metrics import CONTENT_TYPE, ServerMetrics
from omni_stream.server.schema import OPENAI_VOICES, voice_aliases
from omni_stream.server.settings import ServerSettings
from omni_stream.server.speech import speech
from omni_stream.server.state import STATE, ServerState
from omni_stream.server.voices import VoiceService, create_voice, delete_voice
from omni_stream.server.ws import speech_stream

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PUBLIC_PATHS = frozenset({"/health"})


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(data),
                        content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as OpenAI's error shape; counts requests by route and status."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    try:
        resp = await handler(request)
    except RequestError as e:
        resp = http_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = http_response(from_http_exception(e))
    except ConnectionError:
        raise  # the client went away: nothing to answer
    except Exception:
        if request.writer is not None and request.writer.output_size > 0:
            raise  # the response has started: aiohttp drops the connection
        log.exception("unhandled error on %s %s", request.method, request.path)
        resp = http_response(internal_error(f"{request.method} {request.path}"))
    request.app[STATE].metrics.requests.labels(route, str(resp.status)).inc()
    return resp


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    settings = request.app[STATE].settings
    key = settings.api_key
    if key is not None and request.path not in PUBLIC_PATHS \
            and not (settings.ui and ui.public_path(request.path)):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # a browser's WebSocket carries it as a subprotocol
            token = ui.ws_bearer(request.headers.get("Sec-WebSocket-Protocol", "")) or ""
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise RequestError(401, "invalid_api_key",
                               "missing or incorrect API key: send 'Authorization: Bearer "
                               "<key>' (a browser WebSocket: the subprotocol "
                               f"'{ui.WS_BEARER_PREFIX}<key>')")
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if not st.ready:
        return _json({"status": "unavailable"}, status=503)
    body = {"status": "ok", "model": st.backend.model_name}
    info = getattr(st.backend, "capacity_info", None)
    cap = info() if info is not None else None
    if cap:  # the measured real-time capacity (scheduling.capacity)
        body.update(cap)
    return _json(body)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _model_card(st: ServerState) -> dict:
    return {"id": st.backend.model_name, "object": "model", "created": st.created,
            "owned_by": "omni-stream", "aliases": list(st.settings.model_aliases)}


async def list_models(request: web.Request) -> web.Response:
    return _json({"object": "list", "data": [_model_card(request.app[STATE])]})


async def get_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = request.match_info["model"]
    if name not in (st.backend.model_name, *st.settings.model_aliases):
        raise RequestError(404, "model_not_found",
                           f"model '{name}' not found: this server serves "
                           f"'{st.backend.model_name}'", param="model")
    return _json(_model_card(st))


async def list_voices(request: web.Request) -> web.Response:
    st = request.app[STATE]
    backend = st.backend
    voices = backend.voices()
    aliases = voice_aliases(voices)
    uploaded = st.voices.store.list() if st.voices.store is not None else []
    return _json({"object": "list", "voices": voices + [r.name for r in uploaded],
                  "data": [{"id": v, "object": "voice", "kind": "builtin",
                            "aliases": [a for a in OPENAI_VOICES if aliases[a] == v]}
                           for v in voices]
                  + [{"id": r.name, "kind": "uploaded", **r.as_json()} for r in uploaded],
                  "uploaded_voices": [r.as_json() for r in uploaded],
                  "voice_clone": st.voices.supported,
                  "openai_aliases": aliases, "languages": ["auto", *backend.languages()]})


def create_app(backend: Backend, settings: ServerSettings | None = None,
               voice_store=None) -> web.Application:
    """The application; starting it (runner setup) starts the backend, cleanup closes it.
    ``voice_store``: uploaded voices kept elsewhere than ``settings.voice_dir`` (a cluster's)."""
    from omni_stream.observability import stepstats
    from omni_stream.server.metrics import observe_step

    stepstats.remove_listener(observe_step)
    stepstats.add_listener(observe_step)  # every phase timed in this process feeds /metrics
    settings = settings or ServerSettings()
    if settings.default_response_format not in (None, *supported_formats()):
        raise ValueError(f"default_response_format '{settings.default_response_format}' is not "
                         f"available here: use one of {', '.join(supported_formats())}")
    voices = VoiceService(getattr(backend, "clone_model_dir", None),
                          getattr(backend, "variant", "custom_voice"), backend.voices(),
                          settings.voice_dir, store=voice_store)
    # voice uploads and requests carrying ref_audio may be larger than other bodies (the speech
    # handler holds the others to max_body_bytes)
    app = web.Application(client_max_size=settings.max_request_bytes(voices.supported),
                          middlewares=[error_middleware, auth_middleware])
    st = ServerState(backend=backend, settings=settings,
                     metrics=ServerMetrics(backend.stats, getattr(backend, "capacity_info", None)),
                     voices=voices)
    app[STATE] = st

    async def on_startup(_: web.Application) -> None:
        await backend.start()
        st.ready = True

    async def on_shutdown(_: web.Application) -> None:
        st.ready = False  # new requests get 503 while in-flight streams finish
        for ws in list(st.websockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")

    async def on_cleanup(_: web.Application) -> None:
        await backend.close()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/audio/speech", speech)
    app.router.add_get("/v1/audio/speech/stream", speech_stream)
    app.router.add_get("/v1/audio/voices", list_voices)
    app.router.add_post("/v1/audio/voices", create_voice)
    app.router.add_delete("/v1/audio/voices/{name}", delete_voice)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    dashboard.add_routes(app)
    if settings.ui:
        ui.add_routes(app)
    return app


def make_runner(app: web.Application) -> web.AppRunner:
    """A runner with handler cancellation on: a client that disconnects cancels its handler at
    once, which closes its backend stream (without it, only the next write would notice)."""
    settings = app[STATE].settings
    return web.AppRunner(app, handler_cancellation=True,
                         shutdown_timeout=settings.shutdown_timeout_s)


async def start_server(backend: Backend, host: str = "127.0.0.1", port: int = 8000,
                       settings: ServerSettings | None = None,
                       voice_store=None) -> tuple[web.AppRunner, str]:
    """Start serving (port 0: any free port); returns the runner (``await runner.cleanup()``
    stops it gracefully) and the base URL."""
    runner = make_runner(create_app(backend, settings, voice_store))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = runner.addresses[0][1]
    return runner, f"http://{host if ':' not in host else f'[{host}]'}:{bound_port}"


async def serve(backend: Backend, host: str, port: int,
                settings: ServerSettings | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then drain in-flight streams and close the backend."""
    runner, url = await start_server(backend, host, port, settings)
    log.info("omni-stream serving '%s' on %s (OpenAI base_url %s/v1)", backend.model_name, url,
             url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    def on_signal() -> None:
        # tell the backend first: a Ctrl-C or a group SIGTERM reaches its worker processes
        # too, and their exit must not be taken for a crash to recover from
        begin = getattr(backend, "begin_shutdown", None)
        if begin is not None:
            begin()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # not the main thread / not POSIX
            pass
    try:
        await stop.wait()
    finally:
        log.info("shutting down: draining streams, closing the backend")
        await runner.cleanup()


def run_server(backend: Backend, host: str = "127.0.0.1", port: int = 8000,
               settings: ServerSettings | None = None) -> None:
    """Blocking entry point: uvloop where installed, graceful shutdown on SIGINT/SIGTERM."""
    coro = serve(backend, host, port, settings)
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)

"""One omni-stream replica of a Ray Serve deployment: a whole single-machine server.

A replica builds its profile on its own node exactly as ``omni-stream serve`` does (the serve
flags it was given, the node's hardware probe and cost cache), starts the pipeline's stage
processes and the aiohttp app in a thread of its own (its own event loop, as on one machine),
listening on the node's address at a free port, and serves Serve's ASGI ingress by forwarding
to it (``forward.Forwarder``). Why forward rather than re-implement the routes on ASGI: the API
(parsing, validation, error mapping, admission, stream encoding, the WebSocket protocol) then
has one implementation, tested once and run by both deployments, and the price is a same-node
hop measured by ``benchmarks/tts/cluster_bench.py``.

Three requests are answered for the whole cluster: ``GET /health`` (every replica's state and
capacity, 200 while one serves), ``GET /metrics`` (every replica's metrics with a ``replica``
label, and cluster gauges) and ``GET /v1/stats`` (the dashboard's figures, merged); the
replicas are found in the registry. Everything else, the pages at ``/`` and ``/dashboard``
included, is the replica's own aiohttp app, forwarded.

To Serve a replica reports:
- ``record_routing_stats``: real-time capacity and streams held (``router.CapacityRouter``);
- ``record_autoscaling_stats``: the same, for ``autoscale.CapacityPolicy``;
- ``check_health``: fails while its pipeline is down (a stage died): Serve stops routing to it
  and replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import ray
from ray import serve

from omni_stream.cluster.aggregate import PEER_TIMEOUT_S
from omni_stream.cluster.forward import Forwarder
from omni_stream.cluster.reap import pipeline_record, this_process
from omni_stream.cluster.registry import HEARTBEAT_S, RemoteVoiceStore, registry_handle

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-omni-stream-replica"  # names the replica that served a response


class ServerThread:
    """The aiohttp app and its backend on an event loop in a thread of their own."""

    def __init__(self, backend, settings, voice_store, host: str) -> None:
        self.backend = backend
        self.settings = settings
        self.voice_store = voice_store
        self.host = host
        self.loop: asyncio.AbstractEventLoop | None = None
        self.runner = None
        self.url: str | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="omni-stream-server", daemon=True)

    def start(self, timeout: float) -> str:
        self.thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the replica's server did not start within {timeout:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"the replica's server failed to start: {self._error}") \
                from self._error
        return self.url

    def _run(self) -> None:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        from omni_stream.server.app import start_server

        try:
            self.runner, self.url = loop.run_until_complete(
                start_server(self.backend, self.host, 0, self.settings, self.voice_store))
        except BaseException as e:
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()
            self._stopped.set()

    def call(self, fn, timeout: float = 5.0):
        """``fn()`` run on the server's loop (its state is only touched there)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the replica's server is not running")

        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)

    def stop(self) -> None:
        loop = self.loop
        if loop is None or loop.is_closed() or self.runner is None:
            return
        begin = getattr(self.backend, "begin_shutdown", None)
        if begin is not None:
            begin()

        async def down():
            await self.runner.cleanup()
            loop.stop()

        asyncio.run_coroutine_threadsafe(down(), loop)
        self._stopped.wait(self.settings.shutdown_timeout_s + 30)


def _pipeline_up(backend) -> bool:
    """False once a stage process of the backend's pipeline has died (a backend without stage
    processes is always up)."""
    if not hasattr(backend, "sup"):
        return True
    sup = getattr(backend, "sup", None)
    pipe = getattr(sup, "pipe", None)
    return pipe is not None and pipe.alive()


class _Asgi:
    """The replica's ASGI app (an object with an async ``__call__``, which servers take for
    ASGI 3)."""

    def __init__(self, replica: "OmniStreamReplica") -> None:
        self.replica = replica

    async def __call__(self, scope, receive, send) -> None:
        await self.replica._asgi(scope, receive, send)


@serve.ingress()
class OmniStreamReplica:
    """The deployment's class (``launch.deploy`` configures and binds it)."""

    def __init__(self, args=None, backend=None, settings=None) -> None:
        """``args``: the ``omni-stream serve`` flags (an argparse Namespace) the launcher got,
        with the model path resolved and the API key filled in: the replica builds its
        profile and pipeline from them on its node. Or ``backend`` (any ``contract.Backend``,
        e.g. the test suite's fake) and ``settings`` (``ServerSettings``) to serve as given."""
        from omni_stream.server.settings import ServerSettings, from_args

        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self._closing = threading.Event()
        start_timeout = 120.0
        if backend is None:
            from omni_stream.orchestrator.flags import pipeline_settings
            from omni_stream.orchestrator import PipelineBackend

            pipe_settings, self.profile, _ = pipeline_settings(args, build_native=True)
            backend = PipelineBackend(pipe_settings)
            settings = from_args(args)
            start_timeout += pipe_settings.start_timeout_s
        self.backend = backend
        self.registry = registry_handle()
        # before the pipeline exists: should this process be killed while it starts, the
        # registry still knows whose segments and stages to remove (reap.py)
        try:
            ray.get(self.registry.record_pipeline.remote(
                self.replica_id, this_process(self.replica_id, self.node_id)), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            log.warning("could not record this replica in the registry (%s): the first "
                        "heartbeat will", type(e).__name__)
        self.server = ServerThread(self.backend, settings or ServerSettings(),
                                   RemoteVoiceStore(self.registry), self.node_ip)
        t0 = time.perf_counter()
        self.url = self.server.start(timeout=start_timeout)
        log.info("replica %s serving on %s (node %s) after %.1f s", self.replica_id, self.url,
                 self.node_ip, time.perf_counter() - t0)
        self.forward = Forwarder(self.url, {REPLICA_HEADER: self.replica_id})
        self._register()
        self._beat = threading.Thread(target=self._heartbeat, name="omni-stream-heartbeat",
                                      daemon=True)
        self._beat.start()

    def __serve_build_asgi_app__(self):
        return _Asgi(self)

    # ------------------------------------------------------------------ Serve hooks
    def _held(self) -> dict[str, Any]:
        """Capacity and load, read on the server's loop."""
        def read():
            s = self.backend.stats()
            cap = getattr(self.backend, "capacity_info", None)
            info = (cap() if cap is not None else None) or {}
            return dict(capacity_streams=info.get("capacity_streams"),
                        streams_held=int(s.get("active_streams", 0)) + int(s.get("queue_depth", 0)),
                        slots=int(s.get("slots_total", 0)),
                        rtf_estimate=info.get("rtf_estimate"))
        return self.server.call(read)

    def record_routing_stats(self) -> dict[str, Any]:
        try:
            return {**self._held(), "healthy": _pipeline_up(self.backend)}
        except Exception:
            return {"healthy": False}

    def record_autoscaling_stats(self) -> dict[str, float]:
        got = self._held()
        return {"streams_held": float(got["streams_held"]),
                "capacity_streams": float(got["capacity_streams"] or 1)}

    def check_health(self) -> None:
        if not self.server.thread.is_alive():
            raise RuntimeError("the replica's server thread has stopped")
        if not _pipeline_up(self.backend):
            raise RuntimeError("the replica's pipeline is down (a stage process died)")

    def __del__(self) -> None:
        closing = getattr(self, "_closing", None)
        if closing is None:  # the constructor failed early
            return
        closing.set()
        try:
            ray.get(self.registry.unregister.remote(self.replica_id), timeout=5)
        except Exception:
            pass
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()

    # ------------------------------------------------------------------ directory
    def _info(self) -> dict[str, Any]:
        return {"url": self.url, "node_id": self.node_id, "node_ip": self.node_ip,
                "pid": os.getpid()}

    def _register(self) -> None:
        """Heartbeat: the directory entry and the pipeline's current record (its stages change
        when the supervisor restarts it)."""
        pipeline = pipeline_record(self.backend, self.replica_id, self.node_id)
        ray.get(self.registry.register.remote(self.replica_id, self._info(), pipeline),
                timeout=30)

    def _heartbeat(self) -> None:
        while not self._closing.wait(HEARTBEAT_S):
            try:
                self._register()
            except Exception as e:  # the registry restarting: the next beat re-registers
                log.warning("registry heartbeat failed: %s", e)

    # ------------------------------------------------------------------ ASGI
    async def _asgi(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["method"] == "GET"
                and scope["path"] in ("/health", "/metrics", "/v1/stats")):
            from omni_stream.cluster.aggregate import cluster_health, cluster_metrics, cluster_stats

            handler = {"/health": cluster_health, "/metrics": cluster_metrics,
                       "/v1/stats": cluster_stats}[scope["path"]]
            await handler(self, scope, receive, send)
            return
        await self.forward(scope, receive, send)

    async def peers(self) -> list[dict[str, Any]]:
        """The registered replicas (this one included, even if the registry is unreachable)."""
        try:
            got = await asyncio.wait_for(self.registry.replicas.remote(), PEER_TIMEOUT_S)
        except Exception as e:
            log.warning("registry unreachable (%s): /health and /metrics show this replica only",
                        e)
            got = []
        if not any(p["replica"] == self.replica_id for p in got):
            got.append({**self._info(), "replica": self.replica_id})
        return got

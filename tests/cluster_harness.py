"""A local multi-node Ray cluster serving omni-stream, for tests: the cluster entry in place of
a single server.

``LocalCluster`` starts a head and worker nodes on this machine (``ray.cluster_utils.Cluster``,
fractional CPUs), the registry (voices in a temporary folder), Serve's proxy on the head with
omni-stream's entry middleware, and deploys the ``OmniStreamReplica`` deployment on demand:
from ``omni-stream serve`` flags (a real pipeline per replica) or from a ready backend (the
API tests' fake). ``running_server`` has ``server.testing.running_server``'s signature, so the
server's API test cases run unchanged against the entry, each on a fresh deployment.
``deploy`` keeps a running deployment when asked for the same one again (the slow part of a
pipeline test is starting its replicas).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import pickle
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from typing import AsyncIterator

REPLICA_CPUS = 0.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}


class LocalCluster:
    def __init__(self, nodes: int = 2, cpus_per_node: int = 2) -> None:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        from omni_stream.cluster.entry import CALLBACK_ENV, CALLBACK_PATH
        from omni_stream.cluster.registry import NAMESPACE, start_registry

        # the raylets (and so the proxy) inherit this environment: the entry middleware
        os.environ[CALLBACK_ENV] = CALLBACK_PATH
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": cpus_per_node, "include_dashboard": False})
        for _ in range(nodes - 1):
            self.cluster.add_node(num_cpus=cpus_per_node)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace=NAMESPACE,
                 logging_level=logging.WARNING, log_to_driver=False)
        self.voice_dir = tempfile.mkdtemp(prefix="omni-stream-cluster-voices-")
        self.registry = start_registry(self.voice_dir, ray.get_runtime_context().get_node_id())
        self.port = free_port()
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": self.port})
        self.url = f"http://127.0.0.1:{self.port}"
        self._key: bytes | None = None

    # ------------------------------------------------------------------ deployments
    def deploy(self, *, replicas: int = 1, args: argparse.Namespace | None = None,
               backend=None, settings=None, streams: int = 8, queue: int = 16,
               autoscaling=None, timeout: float = 180.0, force: bool = False) -> None:
        """Run the application with this replica configuration (kept if it already runs).
        ``autoscaling``: a Serve AutoscalingConfig (``replicas`` is then the count to wait for
        at first)."""
        from ray import serve

        from omni_stream.cluster.launch import APP_NAME, DEPLOYMENT, base_options
        from omni_stream.cluster.replica import OmniStreamReplica

        key = pickle.dumps((replicas, args, backend, settings, streams, queue,
                            autoscaling is None))
        if key == self._key and not force:
            return
        self._key = None
        opts = base_options(REPLICA_CPUS, 0.0, streams, queue, 2.0)
        opts["graceful_shutdown_timeout_s"] = 5.0
        if autoscaling is not None:
            opts["autoscaling_config"] = autoscaling
            key = None
        else:
            opts["num_replicas"] = replicas
        app = serve.deployment(OmniStreamReplica).options(
            name=DEPLOYMENT, **opts).bind(args, backend, settings)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        self.wait_replicas(replicas, timeout)
        self._key = key

    def wait_replicas(self, n: int, timeout: float = 180.0) -> dict:
        """The entry's /health once ``n`` replicas of the current deployment serve."""
        deadline = time.monotonic() + timeout
        body: dict = {}
        while time.monotonic() < deadline:
            try:
                status, body = get_json(self.url + "/health", 5)
            except OSError:
                status = 0
            if status == 200 and body.get("replicas_up") == n and len(body["replicas"]) == n:
                return body
            time.sleep(0.5)
        raise TimeoutError(f"{n} replicas did not come up within {timeout:.0f} s: {body}")

    @contextlib.asynccontextmanager
    async def running_server(self, backend, settings=None,
                             host: str = "127.0.0.1") -> AsyncIterator[str]:
        """``server.testing.running_server`` through the cluster entry."""
        # a fresh deployment per call, as a single server is fresh per test
        await asyncio.to_thread(self.deploy, backend=backend, settings=settings, force=True)
        backend.served_remotely = True  # a copy serves: server.testing.served_here
        yield self.url

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self.cluster.shutdown()
            shutil.rmtree(self.voice_dir, ignore_errors=True)

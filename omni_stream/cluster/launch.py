"""``omni-stream serve --ray ADDRESS``: the server as a Ray Serve application.

``ADDRESS``: ``local`` starts a Ray cluster on this machine (it ends with the command), ``auto``
joins the cluster this machine belongs to (``ray start``), anything else is given to
``ray.init(address=...)`` (``HOST:6379``, ``ray://HOST:10001``). The command deploys the
application ``omni-stream`` (``--replicas N``, or ``--min-replicas``/``--max-replicas`` to
autoscale), serves the API on ``--host``/``--port`` through Serve's proxy on the head node,
and on Ctrl-C / SIGTERM deletes the application (each replica drains its streams and stops
its stage processes), reaps what replicas that were killed left on their nodes (stage
processes, shared-memory segments: ``reap``) and deletes the registry actor.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading
from pathlib import Path

log = logging.getLogger(__name__)

APP_NAME = "omni-stream"
DEPLOYMENT = "OmniStreamReplica"
TEARDOWN_WAIT_S = 2.0  # for a deleted replica's process to end before its pipeline is reaped
CONTROL_HEADROOM = 32  # requests beyond streams and queue a replica takes (voices, metrics...)
PROXY_QUEUE = 64  # requests the proxy holds while no replica can take them; more: 429


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (Ray Serve; needs the cluster extra)")
    g.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="serve on a Ray cluster: 'local' (start one here), 'auto' (the cluster "
                        "this machine joined with `ray start`), or HOST:PORT / ray://HOST:PORT")
    g.add_argument("--replicas", type=int, default=None,
                   help="replicas (pipelines), each placed by Ray on a node with the resources "
                        "(default 1 unless autoscaling)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale from this many")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many")
    g.add_argument("--target-utilisation", type=float, default=0.8,
                   help="autoscaling: streams held / real-time capacity to aim for")
    g.add_argument("--upscale-delay", type=float, default=10.0,
                   help="autoscaling: seconds the need for more replicas must last")
    g.add_argument("--downscale-delay", type=float, default=120.0,
                   help="autoscaling: seconds the need for fewer replicas must last")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs Ray reserves per replica (default: 1; with --ray local, this "
                        "machine's CPUs shared among the replicas)")
    g.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 with --device cuda, else 0)")


def cluster_flags_valid(a: argparse.Namespace) -> None:
    """ValueError naming the fix for cluster flags that do not fit together."""
    scaling = a.min_replicas is not None or a.max_replicas is not None
    if a.ray is None:
        used = [f for f, v in (("--replicas", a.replicas), ("--min-replicas", a.min_replicas),
                               ("--max-replicas", a.max_replicas),
                               ("--replica-cpus", a.replica_cpus),
                               ("--replica-gpus", a.replica_gpus)) if v is not None]
        if used:
            raise ValueError(f"{', '.join(used)} need --ray ADDRESS (serve on a Ray cluster)")
        return
    if scaling and a.replicas is not None:
        raise ValueError("give either --replicas N (fixed) or --min-replicas/--max-replicas "
                         "(autoscaling), not both")
    if scaling and (a.min_replicas is None or a.max_replicas is None):
        raise ValueError("autoscaling needs both --min-replicas and --max-replicas")
    if a.replicas is not None and a.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    if scaling and not 0 <= a.min_replicas <= a.max_replicas or (scaling and a.max_replicas < 1):
        raise ValueError("need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1")
    if not 0 < a.target_utilisation <= 1:
        raise ValueError("--target-utilisation must be in (0, 1]")
    if a.upscale_delay < 0 or a.downscale_delay < 0:
        raise ValueError("--upscale-delay and --downscale-delay must be >= 0")
    if a.replica_cpus is not None and a.replica_cpus <= 0:
        raise ValueError("--replica-cpus must be > 0")


def _replica_cpus(a: argparse.Namespace, most: int) -> float:
    if a.replica_cpus is not None:
        return a.replica_cpus
    if a.ray == "local":
        return max(0.1, math.floor(10 * (os.cpu_count() or 1) / max(1, most)) / 10)
    return 1.0


def base_options(num_cpus: float, num_gpus: float, streams: int, queue: int,
                 shutdown_timeout_s: float) -> dict:
    """Serve options every omni-stream deployment uses: capacity routing, the proxy's
    bounded queue with 429 past it, health checks, a drain on shutdown. ``streams`` and
    ``queue``: what one replica admits and queues (its own admission answers past that, so
    the proxy queues only while no replica can take a request)."""
    from ray.serve.config import BackpressureConfig, RequestRouterConfig

    from omni_stream.cluster.router import CapacityRouter

    return dict(
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=streams + queue + CONTROL_HEADROOM,
        max_queued_requests=PROXY_QUEUE,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=2),
        request_router_config=RequestRouterConfig(
            request_router_class=CapacityRouter, request_routing_stats_period_s=0.5,
            request_routing_stats_timeout_s=5),
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=float(shutdown_timeout_s) + 20,
        graceful_shutdown_wait_loop_s=1.0)


def autoscaling_config(least: int, most: int, target_utilisation: float, upscale_delay_s: float,
                       downscale_delay_s: float, look_back_s: float = 5.0):
    """Serve's autoscaling on capacity in use (``autoscale.CapacityPolicy``)."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    from omni_stream.cluster.autoscale import CapacityPolicy

    return AutoscalingConfig(
        min_replicas=least, max_replicas=most, initial_replicas=max(1, least),
        upscale_delay_s=upscale_delay_s, downscale_delay_s=downscale_delay_s,
        metrics_interval_s=1.0, look_back_period_s=look_back_s,
        policy=AutoscalingPolicy(policy_function=CapacityPolicy,
                                 policy_kwargs={"target_utilisation": target_utilisation}))


def deployment_options(a: argparse.Namespace) -> dict:
    """Serve options of the replica deployment for these flags."""
    scaling = a.min_replicas is not None
    most = a.max_replicas if scaling else (a.replicas or 1)
    gpus = a.replica_gpus
    if gpus is None:
        gpus = 1.0 if (a.device or "").startswith("cuda") else 0.0
    opts = dict(name=DEPLOYMENT, **base_options(
        _replica_cpus(a, most), gpus, a.max_streams or 64, a.max_queue,
        getattr(a, "shutdown_timeout", 10.0)))
    if scaling:
        opts["autoscaling_config"] = autoscaling_config(
            a.min_replicas, a.max_replicas, a.target_utilisation, a.upscale_delay,
            a.downscale_delay)
    else:
        opts["num_replicas"] = a.replicas or 1
    return opts


def connect(address: str) -> None:
    import ray

    from omni_stream.cluster.entry import CALLBACK_ENV, CALLBACK_PATH
    from omni_stream.cluster.registry import NAMESPACE

    env = {"env_vars": {k: v for k, v in os.environ.items()
                        if k.startswith("OMNI_STREAM_")}}
    if address == "local":
        # the proxy (started by this cluster's raylet, which inherits this environment) runs
        # the entry middleware (entry.py)
        os.environ.setdefault(CALLBACK_ENV, CALLBACK_PATH)
        # "local": a new cluster even where one runs (ray start, another serve --ray local)
        ray.init(address="local", namespace=NAMESPACE, include_dashboard=False,
                 runtime_env=env,
                 logging_level=logging.WARNING)
    else:
        ray.init(address=address, namespace=NAMESPACE, runtime_env=env,
                 logging_level=logging.WARNING)


def deploy(a: argparse.Namespace) -> str:
    """Start the registry and the application on the connected cluster; the entry's URL."""
    import ray
    from ray import serve

    from omni_stream.checkpoints.default import DEFAULT_MODEL_NAME, resolve_model_path
    from omni_stream.cluster.registry import start_registry
    from omni_stream.cluster.replica import OmniStreamReplica
    from omni_stream.server.settings import API_KEY_ENV
    from omni_stream.voices.store import default_voice_dir

    path = resolve_model_path(a.model)
    voice_dir = a.voice_dir or str(default_voice_dir(path))
    start_registry(voice_dir, ray.get_runtime_context().get_node_id())
    serve.start(proxy_location="HeadOnly", http_options={"host": a.host, "port": a.port})
    replica_args = argparse.Namespace(**vars(a))
    # a folder: absolute, as every node must have it at the same path; the embedded default
    # model: by name, each node writes its own (the same bytes)
    replica_args.model = (DEFAULT_MODEL_NAME if str(a.model) == DEFAULT_MODEL_NAME
                          else str(Path(path).resolve()))
    replica_args.api_key = a.api_key or os.environ.get(API_KEY_ENV) or None
    app = serve.deployment(OmniStreamReplica).options(**deployment_options(a)).bind(replica_args)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    host = a.host if a.host not in ("0.0.0.0", "::") else "127.0.0.1"
    return f"http://{host if ':' not in host else f'[{host}]'}:{a.port}"


def entry_has_middleware(url: str, timeout: float = 30.0) -> bool:
    """Whether the entry at ``url`` runs omni-stream's proxy middleware (``entry.py``)."""
    import time
    import urllib.error
    import urllib.request

    from omni_stream.cluster.entry import ENTRY_HEADER

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                return r.headers.get(ENTRY_HEADER[0].decode()) is not None
        except urllib.error.HTTPError as e:
            return e.headers.get(ENTRY_HEADER[0].decode()) is not None
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def teardown(address: str) -> None:
    """Delete the application, reap the pipelines of replicas that died without cleaning up
    (killed; a replica deleted in order has cleaned up itself), delete the registry; with
    ``local``, stop the cluster and reap what its end left."""
    import ray
    from ray import serve

    from omni_stream.cluster.reap import reap_all
    from omni_stream.cluster.registry import CALL_TIMEOUT_S, registry_handle

    try:
        serve.delete(APP_NAME)
    except Exception as e:
        log.warning("could not delete the application: %s", e)
    here = ray.get_runtime_context().get_node_id()
    records = []
    try:
        registry = registry_handle()
        records = ray.get(registry.pipelines.remote(), timeout=CALL_TIMEOUT_S)
    except Exception as e:
        log.warning("could not read the replicas' pipelines from the registry (%s): what "
                    "killed replicas left stays until their stages or the next server on "
                    "their node remove it", e)
    got = reap_all(records, here=here, wait_s=TEARDOWN_WAIT_S)
    left = [r for r in records if got.get(r.replica) is None or got[r.replica].owner_alive]
    try:
        ray.kill(registry_handle())
    except Exception:
        pass
    if address == "local":
        serve.shutdown()
    ray.shutdown()
    if address == "local" and left:
        # every node was this machine, and its replicas end with the cluster
        reap_all(left, here=here, wait_s=TEARDOWN_WAIT_S * 2)


def run(a: argparse.Namespace) -> int:
    """Blocking: deploy, serve until SIGINT/SIGTERM, tear down."""
    cluster_flags_valid(a)
    stop = threading.Event()

    def on_signal(*_) -> None:
        stop.set()

    def install() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    install()
    connect(a.ray)
    # ray.init puts its own failure handler on SIGTERM, which ends the process at once (no
    # teardown: a local cluster's processes and the replicas' segments would be left): ours
    # goes back on top
    install()
    try:
        url = deploy(a)
        log.info("omni-stream serving on %s through Ray Serve (OpenAI base_url %s/v1); "
                 "replica logs: the Ray session's logs/serve folder", url, url)
        if not entry_has_middleware(url):
            from omni_stream.cluster.entry import CALLBACK_ENV, CALLBACK_PATH

            log.warning("the entry's proxy does not run omni-stream's middleware: errors the "
                        "proxy makes itself (backpressure, no replica, a replica that died "
                        "before answering) reach clients in Ray's words, not the single "
                        "server's. Start the head with %s=%s in its environment "
                        "(docs/scaling.md)", CALLBACK_ENV, CALLBACK_PATH)
        print(f"omni-stream cluster entry: {url}", flush=True)
        stop.wait()
    finally:
        log.info("shutting down: deleting the application (replicas drain their streams)")
        teardown(a.ray)
    return 0

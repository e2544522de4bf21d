"""The cluster's registry: one Ray actor, pinned to the head node, that holds

- the **voice store** every replica reads: a :class:`~omni_stream.voices.store.VoiceStore` in a
  folder on the head's disk, so an uploaded voice is usable on every replica the moment its
  upload returns, survives the restart of any replica, of the registry and of the whole
  cluster, and a delete removes it everywhere. The actor runs one call at a time, so two
  uploads of one name race exactly as on one server: the first is stored (201), the second
  gets 409 ``voice_exists``;
- the **replica directory**: each replica's address, node and last report, which /metrics and
  /health aggregate over (routing itself is Serve's, ``router``). Replicas re-register every
  ``HEARTBEAT_S``; one silent for ``REPLICA_TTL_S`` is dropped;
- the **pipeline records** (``reap.PipelineRecord``): each replica's process, stage processes
  and shared-memory prefix, recorded from the start of its life and with each heartbeat. A
  watch thread looks at every replica silent for ``STALE_S`` and, once its process is dead
  (killed: a replica that stops in order cleans up itself), kills what runs of its pipeline
  and unlinks its segments on its node (``reap.reap_all``); the entry's teardown does the same
  for what is left when the cluster stops (``pipelines``).

Replicas reach it through :class:`RemoteVoiceStore` (VoiceStore's methods over actor calls) and
:func:`registry_handle`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from omni_stream.errors import RequestError

log = logging.getLogger(__name__)

NAMESPACE = "omni-stream"
REGISTRY_NAME = "omni-stream-registry"
HEARTBEAT_S = 3.0  # how often a replica re-registers
REPLICA_TTL_S = 15.0
STALE_S = 2 * HEARTBEAT_S  # a replica silent this long: reaped if its process is dead
WATCH_S = 1.0
REAP_TRIES = 3  # reaps that failed (its node gone) before a record is dropped
CALL_TIMEOUT_S = 10.0


@dataclass
class _Watched:
    """A replica's pipeline record as the watch holds it."""

    record: Any  # reap.PipelineRecord
    heard: float  # time.monotonic() of the last heartbeat (or of the last look at it)
    failed: int = 0  # reaps in a row that could not run (its node gone, say)


class Registry:
    """The actor's class (``start_registry`` creates it)."""

    def __init__(self, voice_dir: str | None) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.store = None
        if voice_dir is not None:
            from omni_stream.voices.store import VoiceStore

            self.store = VoiceStore(Path(voice_dir))
        self._replicas: dict[str, dict[str, Any]] = {}
        self._pipelines: dict[str, _Watched] = {}
        self._lock = threading.Lock()  # _pipelines: actor calls and the watch thread
        self._node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self._watch = threading.Thread(target=self._watch_loop, name="omni-stream-reaper",
                                       daemon=True)
        self._watch.start()

    # ------------------------------------------------------------------ replicas
    def register(self, replica_id: str, info: dict[str, Any], pipeline=None) -> None:
        """A replica's heartbeat: its directory entry and, where given, its pipeline record."""
        self._replicas[replica_id] = {**info, "replica": replica_id, "seen": time.time()}
        self.record_pipeline(replica_id, pipeline)

    def record_pipeline(self, replica_id: str, record) -> None:
        """What to reap should ``replica_id`` die (``reap.PipelineRecord``); None: keep the
        last record (and count the replica as heard of)."""
        with self._lock:
            had = self._pipelines.get(replica_id)
            if record is None and had is None:
                return
            self._pipelines[replica_id] = _Watched(record if record is not None else had.record,
                                                   time.monotonic())

    def pipelines(self) -> list:
        """Every pipeline record not reaped yet (the entry's teardown reaps them)."""
        with self._lock:
            return [w.record for w in self._pipelines.values()]

    def unregister(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def replicas(self) -> list[dict[str, Any]]:
        now = time.time()
        for rid in [r for r, v in self._replicas.items() if now - v["seen"] > REPLICA_TTL_S]:
            del self._replicas[rid]
        return sorted(self._replicas.values(), key=lambda v: v["replica"])

    def _watch_loop(self) -> None:
        while True:
            time.sleep(WATCH_S)
            try:
                self.reap_silent()
            except Exception as e:  # the watch outlives any one failure
                log.warning("reaping silent replicas failed: %s", e)

    def reap_silent(self, stale_s: float = STALE_S) -> dict:
        """Reap the pipeline of every replica silent for ``stale_s`` whose process is dead;
        one whose process runs (a late heartbeat) is looked at again ``stale_s`` later."""
        from omni_stream.cluster.reap import reap_all

        now = time.monotonic()
        with self._lock:
            due = [w.record for w in self._pipelines.values() if now - w.heard > stale_s]
        if not due:
            return {}
        got = reap_all(due, here=self._node_id)
        with self._lock:
            for rid, done in got.items():
                w = self._pipelines.get(rid)
                if w is None or w.heard > now:  # heard of meanwhile
                    continue
                if done is not None and not done.owner_alive:
                    del self._pipelines[rid]
                elif done is None and w.failed + 1 >= REAP_TRIES:
                    log.warning("replica %s: giving up reaping its pipeline", rid)
                    del self._pipelines[rid]
                else:
                    w.heard, w.failed = time.monotonic(), w.failed + (done is None)
        return got

    # ------------------------------------------------------------------ voices
    def voice_dir(self) -> str | None:
        return str(self.store.root) if self.store is not None else None

    def voice_add(self, name, clone, duration_s, sample_rate):
        try:
            return ("ok", self.store.add(name, clone, duration_s=duration_s,
                                         sample_rate=sample_rate))
        except RequestError as e:
            return ("error", e.status, e.message, e.code, e.param)

    def voice_get(self, name):
        return self.store.get(name)

    def voice_list(self):
        return self.store.list()

    def voice_delete(self, name) -> bool:
        return self.store.delete(name)

    def voice_count(self) -> int:
        return len(self.store)


def start_registry(voice_dir: str | None, node_id: str):
    """The registry actor on ``node_id`` (the head), created or, when one is running (a
    relaunch against a running cluster), reused. Detached, so it outlives the launching
    process; restarted by Ray if it dies (it reloads the voices from disk)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(Registry).options(
        name=REGISTRY_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    handle = actor.remote(voice_dir)
    have = ray.get(handle.voice_dir.remote(), timeout=60)
    if voice_dir is not None and have is not None and Path(have) != Path(voice_dir):
        log.warning("the running registry keeps voices in %s, not %s: using it", have, voice_dir)
    return handle


def registry_handle():
    return ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)


class RemoteVoiceStore:
    """VoiceStore's interface over the registry actor (blocking calls: the server calls add,
    list and delete from worker threads, and ``get`` once per request naming a voice)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.root = "registry"

    def _call(self, method: str, *args):
        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise RequestError(503, "voice_store_unavailable",
                               f"the cluster's voice store is unavailable ({type(e).__name__}): "
                               "retry shortly", retry_after=2) from None

    def add(self, name: str, clone, duration_s: float, sample_rate: int):
        got = self._call("voice_add", name, clone, duration_s, sample_rate)
        if got[0] == "error":
            _, status, message, code, param = got
            raise RequestError(status, code, message, param=param)
        return got[1]

    def get(self, name: str):
        return self._call("voice_get", name) if isinstance(name, str) else None

    def list(self):
        return self._call("voice_list")

    def delete(self, name: str) -> bool:
        return bool(self._call("voice_delete", name)) if isinstance(name, str) else False

    def __len__(self) -> int:
        return int(self._call("voice_count"))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

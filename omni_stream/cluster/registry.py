"""The cluster's registry: one Ray actor, pinned to the head node, that holds

- the **voice store** every replica reads: a :class:`~omni_stream.voices.store.VoiceStore` in a
  folder on the head's disk, so an uploaded voice is usable on every replica the moment its
  upload returns, survives the restart of any replica, of the registry and of the whole
  cluster, and a delete removes it everywhere. The actor runs one call at a time, so two
  uploads of one name race exactly as on one server: the first is stored (201), the second
  gets 409 ``voice_exists``;
- the **replica directory**: each replica's address, node and last report, which /metrics and
  /health aggregate over (routing itself is Serve's, ``router``). Replicas re-register every
  few seconds; one silent for ``REPLICA_TTL_S`` is dropped.

Replicas reach it through :class:`RemoteVoiceStore` (VoiceStore's methods over actor calls) and
:func:`registry_handle`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import ray

from omni_stream.voices.audio import VoiceError

log = logging.getLogger(__name__)

NAMESPACE = "omni-stream"
REGISTRY_NAME = "omni-stream-registry"
REPLICA_TTL_S = 15.0
CALL_TIMEOUT_S = 10.0


class Registry:
    """The actor's class (``start_registry`` creates it)."""

    def __init__(self, voice_dir: str | None) -> None:
        self.store = None
        if voice_dir is not None:
            from omni_stream.voices.store import VoiceStore

            self.store = VoiceStore(Path(voice_dir))
        self._replicas: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ replicas
    def register(self, replica_id: str, info: dict[str, Any]) -> None:
        self._replicas[replica_id] = {**info, "replica": replica_id, "seen": time.time()}

    def unregister(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def replicas(self) -> list[dict[str, Any]]:
        now = time.time()
        for rid in [r for r, v in self._replicas.items() if now - v["seen"] > REPLICA_TTL_S]:
            del self._replicas[rid]
        return sorted(self._replicas.values(), key=lambda v: v["replica"])

    # ------------------------------------------------------------------ voices
    def voice_dir(self) -> str | None:
        return str(self.store.root) if self.store is not None else None

    def voice_add(self, name, clone, duration_s, sample_rate):
        try:
            return ("ok", self.store.add(name, clone, duration_s=duration_s,
                                         sample_rate=sample_rate))
        except VoiceError as e:
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
        from omni_stream.server.errors import ApiError

        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise ApiError(503, f"the cluster's voice store is unavailable ({type(e).__name__}): "
                           "retry shortly", code="voice_store_unavailable",
                           retry_after=2) from None

    def add(self, name: str, clone, duration_s: float, sample_rate: int):
        got = self._call("voice_add", name, clone, duration_s, sample_rate)
        if got[0] == "error":
            _, status, message, code, param = got
            raise VoiceError(status, message, code=code, param=param)
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

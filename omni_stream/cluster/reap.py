"""What a dead replica leaves on its node, and how the cluster removes it.

A replica that stops in order takes its pipeline with it: its server stops the stage processes
and unlinks the rings' shared-memory segments. One that is killed (SIGKILL, the OOM killer, a
node agent) leaves them: the stages run on until they notice their parent is gone, or, where
Ray kills the dead worker's process group, die without unlinking anything, and the segments
stay in /dev/shm until the next omni-stream server on that node starts. The cluster does not
wait for either: every replica records its pipeline (:class:`PipelineRecord`) in the registry
from the start of its life and with each heartbeat, and once the replica is gone the registry's
watch (while the cluster runs) or the entry's teardown (when it stops) runs :func:`reap` on the
replica's node.

:func:`reap` touches a record only once its owner, the replica's process, is dead (pid and
start time, so a recycled pid is not taken for it). It kills the recorded stage processes that
still run as what they were (pid and start time, signalled through a pidfd so a pid reused in
between is never hit) and any other process still mapping the owner's segments (a stage started
after the last heartbeat), then unlinks this user's files in the shared-memory folder that are
named ``<prefix>-...`` AND whose preamble names the dead owner: the prefix is
``omni-stream-<owner pid>-<token>`` once the replica's pipeline is up (that replica's segments
and no other's), ``omni-stream-<owner pid>`` before.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from dataclasses import dataclass, field
from functools import cache
from typing import Iterable

from omni_stream.transport.shm import (SEGMENT_PREFIX, default_shm_dir, pid_alive,
                                       process_start_time, segment_owner)

log = logging.getLogger(__name__)

REAP_TIMEOUT_S = 20.0  # a reap task on another node: past this it is reported as failed
_SEGMENT_RE = re.compile(re.escape(SEGMENT_PREFIX) + r"(\d+)-([A-Za-z0-9_.]+)-")
_PREFIX_RE = re.compile(re.escape(SEGMENT_PREFIX) + r"(\d+)(-[A-Za-z0-9_.]+)?")

Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)
Owner = tuple[int, int | None]  # the same, start time None where /proc could not tell


@dataclass(frozen=True)
class PipelineRecord:
    """One replica's pipeline as its node sees it: enough to remove it once the replica died."""

    replica: str
    node_id: str
    owner: Owner  # the replica's process
    stages: tuple[Proc, ...] = ()  # the stage processes of its pipeline's last incarnation
    shm_prefix: str = ""  # "omni-stream-<owner pid>[-<token>]"; "" = from the owner's pid
    shm_dir: str = field(default_factory=default_shm_dir)

    def __post_init__(self) -> None:
        if not self.shm_prefix:
            object.__setattr__(self, "shm_prefix", f"{SEGMENT_PREFIX}{self.owner[0]}")
        m = _PREFIX_RE.fullmatch(self.shm_prefix)
        if m is None or int(m.group(1)) != self.owner[0]:
            raise ValueError(f"shm_prefix {self.shm_prefix!r} must be "
                             f"'{SEGMENT_PREFIX}{self.owner[0]}[-<token>]' (the owner's pid)")

    @property
    def has_token(self) -> bool:
        """Whether the prefix names this replica's segments alone (not every segment of a
        process with the owner's pid)."""
        m = _PREFIX_RE.fullmatch(self.shm_prefix)
        return m is not None and m.group(2) is not None


@dataclass(frozen=True)
class Reaped:
    """What :func:`reap` did. ``owner_alive``: nothing, the replica still runs."""

    owner_alive: bool
    killed: tuple[int, ...] = ()
    unlinked: tuple[str, ...] = ()


def this_process(replica: str, node_id: str) -> PipelineRecord:
    """A record of the calling replica before its pipeline exists (no stages, no token yet)."""
    pid = os.getpid()
    return PipelineRecord(replica, node_id, (pid, process_start_time(pid)))


def pipeline_record(backend, replica: str, node_id: str) -> PipelineRecord | None:
    """The record of ``backend``'s running pipeline in this process (its stage processes and
    its rings' names), None while it has none (starting, restarting, a backend without stage
    processes)."""
    pipe = getattr(getattr(backend, "sup", None), "pipe", None)
    if pipe is None:
        return None
    pid = os.getpid()
    stages = tuple((p.pid, start) for p in pipe.procs
                   if p.pid is not None and (start := process_start_time(p.pid)) is not None)
    prefix, shm_dir = "", default_shm_dir()
    for ring in pipe.rings:
        m = _SEGMENT_RE.match(os.path.basename(ring.path))
        if m is not None and int(m.group(1)) == pid:
            prefix = f"{SEGMENT_PREFIX}{pid}-{m.group(2)}"
            shm_dir = os.path.dirname(ring.path)
            break
    return PipelineRecord(replica, node_id, (pid, process_start_time(pid)), stages, prefix,
                          shm_dir)


# ------------------------------------------------------------------ on the replica's node
def reap(record: PipelineRecord, wait_s: float = 0.0) -> Reaped:
    """Kill what runs of a dead replica's pipeline and unlink its segments (on its node).
    ``wait_s``: how long to wait for the owner to die (a replica being stopped); a live owner
    is left alone."""
    deadline = time.monotonic() + wait_s
    while pid_alive(*record.owner):
        if time.monotonic() >= deadline:
            return Reaped(owner_alive=True)
        time.sleep(0.05)
    targets = {pid: start for pid, start in record.stages if pid_alive(pid, start)}
    if record.has_token:
        targets.update(holders(os.path.join(record.shm_dir, record.shm_prefix + "-")))
    killed = tuple(pid for pid, start in sorted(targets.items()) if kill_if_same(pid, start))
    gone_by = time.monotonic() + 2.0
    while any(pid_alive(p, targets[p]) for p in killed) and time.monotonic() < gone_by:
        time.sleep(0.02)
    unlinked = tuple(unlink_segments(record))
    if killed or unlinked:
        log.info("replica %s (pid %d) gone: killed %d stage process(es) %s, removed %d "
                 "shared-memory segment(s)", record.replica, record.owner[0], len(killed),
                 list(killed), len(unlinked))
    return Reaped(owner_alive=False, killed=killed, unlinked=unlinked)


def holders(path_prefix: str) -> dict[int, int]:
    """This user's processes (other than this one) that map a file whose path starts with
    ``path_prefix``: pid -> start time."""
    me, uid, out = os.getpid(), os.getuid(), {}
    needle = path_prefix.encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/maps", "rb") as f:
                if needle not in f.read():
                    continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        start = process_start_time(int(entry.name))
        if start is not None:
            out[int(entry.name)] = start
    return out


def kill_if_same(pid: int, start: int) -> bool:
    """SIGKILL ``pid`` if it is still the process that started at ``start``. Through a pidfd
    (taken before the check, so the signal reaches the process checked); plain kill(2) right
    after the check where the kernel has no pidfds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        fd = None
    try:
        if process_start_time(pid) != start:
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def unlink_segments(record: PipelineRecord) -> list[str]:
    """Unlink this user's regular files ``<shm_dir>/<prefix>-*`` whose preamble names the
    record's owner; the paths removed."""
    removed = []
    try:
        names = os.listdir(record.shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(record.shm_prefix + "-"):
            continue
        path = os.path.join(record.shm_dir, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != os.getuid() or st.st_mode & 0o170000 != 0o100000:
            continue
        owner = segment_owner(path)
        if owner is None or not same_process(owner, record.owner):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def same_process(a: Owner, b: Owner) -> bool:
    """Whether two (pid, start time) name one process (a start time None: the pid decides)."""
    return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])


# ------------------------------------------------------------------ from anywhere in the cluster
@cache
def _remote_reap():
    import ray

    return ray.remote(num_cpus=0, max_retries=0)(reap)


def reap_all(records: Iterable[PipelineRecord], *, here: str | None, wait_s: float = 0.0,
             timeout_s: float = REAP_TIMEOUT_S) -> dict[str, Reaped | None]:
    """:func:`reap` each record on its node: in this process where ``here`` is the record's
    node id, elsewhere as a Ray task pinned to the record's node (the tasks run together).
    replica -> what was done, None where the reap failed (its node gone, say)."""
    records = list(records)
    out: dict[str, Reaped | None] = {}
    pending = {}
    for rec in records:
        if rec.node_id != here:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            pending[rec.replica] = _remote_reap().options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(rec.node_id, soft=False)
            ).remote(rec, wait_s)
    deadline = time.monotonic() + wait_s  # the owners end together: one wait for all
    for rec in records:  # this node's meanwhile
        if rec.node_id == here:
            try:
                out[rec.replica] = reap(rec, max(0.0, deadline - time.monotonic()))
            except OSError as e:
                log.warning("could not reap replica %s: %s", rec.replica, e)
                out[rec.replica] = None
    if pending:
        import ray

        deadline = time.monotonic() + wait_s + timeout_s
        for replica, ref in pending.items():
            try:
                out[replica] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # node gone, task failed or timed out: reported, not raised
                log.warning("could not reap replica %s on its node: %s", replica, e)
                out[replica] = None
    return out

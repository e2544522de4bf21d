"""Single-producer single-consumer shared-memory ring: typed header + raw tensor payload.

Segment layout (one file in /dev/shm, see :mod:`.shm`)::

    [0, 64)        shm preamble (magic, owner pid, owner start time)
    [64, 4096)     ring control block: geometry, endpoint pids, counters (informational),
                   and a core lease (two int32 at LEASE_OFF; see engine.cpu.pool.CoreLease)
    [4096, +cap)   records, 64-byte aligned, wrapping; a record never straddles the end:
                   [128-byte header | payload | pad to 64]   or a PAD marker (skip to offset 0)

Synchronisation is by two counting eventfds (:mod:`.notify`), never by shared indices:
``data`` (producer -> consumer, +1 per message) and ``space`` (consumer -> producer, +1 per
message consumed). Each side keeps its own position; the producer remembers the size of every
record in flight, so a count of consumed messages tells it exactly how many bytes came free.
Per message this costs one ``write`` on each side and at most one ``read`` (coalesced when the
reader is behind), and it is correct on weakly ordered CPUs (see notify.py).

Payloads (see :mod:`.record`): numpy arrays or torch tensors of up to 3 dims. ``get()`` returns a copy by default; ``get(copy=False)`` returns a view into the ring that stays
valid until ``msg.release()`` or the next ``get()``, whichever comes first (the next ``get()``
releases it). Don't write to a view and don't keep it past that point.

A dead peer never hangs the other side: waits are cut into 50 ms slices and, between slices, the
peer's pid (recorded in the control block at attach, with its start time) is checked; a closed or
dead producer makes ``get`` return None once the ring is drained, a dead consumer makes ``put``
return False when it would have to wait for space. Timeouts are in seconds, None = no limit
(still cut short by a dead or closed peer; a peer that never attaches is waited for). The owner
(the server) is not watched here: stages notice its death through the control pipe's EOF.

Usage: the server creates every ring (``Ring.create``; the segment belongs to its
``SegmentRegistry``) and hands ``ring.handle('producer'|'consumer')`` to the stage processes in
``Process(args=...)``; each stage calls ``handle.open()``. One thread per endpoint: a Ring object
is not thread-safe, and each ring has exactly one producer and one consumer process.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import struct
import time
from typing import Any

import numpy as np

from .notify import Notifier
from .record import _HDR, _NP_OF_CODE, _PAD, HEADER_SIZE, MAX_DIMS, PAD_KIND, Message, MsgKind, \
    as_array
from .shm import PREAMBLE_SIZE, Segment, SegmentRegistry, default_registry, open_segment, \
    pid_alive, process_start_time

ALIGN = 64
DATA_OFFSET = 4096
LIVENESS_S = 0.05
_GEOM = struct.Struct("<8sIIQQ")  # ring magic, version, header size, capacity, data offset
_RING_MAGIC = b"OMNIRNG1"
_GEOM_OFF = PREAMBLE_SIZE
_PID_OFF = {"producer": 128, "consumer": 192}  # (pid, start time); pid -1 = closed
_PID = struct.Struct("<qQ")
_CNT_OFF = {"producer": 256, "consumer": 320}  # (bytes, messages) put / got
_CNT = struct.Struct("<QQ")
# two int32 words that the consumer may lend its cores through (engine.cpu.pool.CoreLease):
# a producer that computes on the consumer's cores while the consumer is idle
LEASE_OFF = 384
assert LEASE_OFF + 8 <= DATA_OFFSET


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


@dataclasses.dataclass(frozen=True)
class RingHandle:
    """What a peer needs to attach: segment path + the two eventfds, for one role.

    Picklable for ``multiprocessing`` only (Process args under spawn/forkserver, or a
    Connection/Queue to a running process): the fds travel via ``reduction.DupFd``.
    """

    name: str
    path: str
    capacity: int
    role: str
    data_ev: Notifier
    space_ev: Notifier

    def open(self, *, spin_us: float = 0.0) -> "Ring":
        return Ring.attach(self, spin_us=spin_us)


class Ring:
    """One SPSC ring. Build with :meth:`create` (owner) or :meth:`attach` (endpoint)."""

    def __init__(self, seg: Segment, role: str | None, data_ev: Notifier, space_ev: Notifier,
                 registry: SegmentRegistry | None, spin_us: float) -> None:
        self._seg, self._mm, self.role, self._registry = seg, seg.mm, role, registry
        magic, version, hsize, cap, off = _GEOM.unpack_from(self._mm, _GEOM_OFF)
        if magic != _RING_MAGIC or version != 1 or hsize != HEADER_SIZE or off != DATA_OFFSET:
            raise ValueError(f"{seg.path}: not a version-1 omni-stream ring")
        self.capacity = cap
        # a record is at most half the ring, so it fits after wrapping past any tail gap
        self.max_payload_bytes = (cap // 2) // ALIGN * ALIGN - HEADER_SIZE - ALIGN
        if role is not None:
            self._claim(role)
        self._u8 = np.frombuffer(self._mm, np.uint8, count=cap, offset=DATA_OFFSET)
        self._mv = memoryview(self._mm)[DATA_OFFSET:DATA_OFFSET + cap]
        self._data_ev, self._space_ev = data_ev, space_ev
        self._spin_ns = int(spin_us * 1000)
        self._pos = 0
        self._credit = 0          # consumer: messages known committed, not yet read
        self._free = cap          # producer: bytes known free
        self._inflight: collections.deque[int] = collections.deque()  # producer: record sizes
        self._borrow = 0          # consumer: id of the unreleased view (0 = none)
        self._borrow_n = 0
        self._counts = [0, 0]     # bytes, messages moved by this endpoint
        self._closed = False

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def create(cls, label: str = "ring", capacity_bytes: int = 4 << 20, *,
               role: str | None = None, registry: SegmentRegistry | None = None,
               spin_us: float = 0.0) -> "Ring":
        """Create a ring segment owned by this process (``role`` if it is also an endpoint).

        The segment is named ``omni-stream-<pid>-<token>-<label>-<n>`` by ``registry``
        (default: the per-process one) and unlinked by it on exit; the largest payload is
        ``capacity/2 - 192`` bytes so that a record always fits after a wrap.
        """
        cap = _align(max(int(capacity_bytes), 4 * HEADER_SIZE))
        if cap >= 1 << 32:
            raise ValueError(f"capacity_bytes {capacity_bytes} must be < 4 GiB")
        registry = registry or default_registry()
        seg = registry.create(label, DATA_OFFSET + cap)
        try:
            _GEOM.pack_into(seg.mm, _GEOM_OFF, _RING_MAGIC, 1, HEADER_SIZE, cap, DATA_OFFSET)
            return cls(seg, role, Notifier(), Notifier(), registry, spin_us)
        except BaseException:
            seg.close()
            registry.unlink(seg.path)
            raise

    @classmethod
    def attach(cls, handle: RingHandle, *, spin_us: float = 0.0) -> "Ring":
        """Open the ring behind ``handle`` as its role (producer or consumer)."""
        seg = open_segment(handle.path)
        try:
            return cls(seg, handle.role, handle.data_ev.dup(), handle.space_ev.dup(), None, spin_us)
        except BaseException:
            seg.close()
            raise

    def handle(self, role: str) -> RingHandle:
        """A handle for the peer that will be ``role`` ('producer' or 'consumer')."""
        if role not in _PID_OFF:
            raise ValueError(f"role must be 'producer' or 'consumer', not {role!r}")
        return RingHandle(self._seg.name, self._seg.path, self.capacity, role,
                          self._data_ev, self._space_ev)

    def _claim(self, role: str) -> None:
        if role not in _PID_OFF:
            raise ValueError(f"role must be 'producer' or 'consumer', not {role!r}")
        pid, start = _PID.unpack_from(self._mm, _PID_OFF[role])
        if pid > 0 and pid != os.getpid() and pid_alive(pid, start or None):
            raise RuntimeError(f"ring {self.name} already has a live {role} (pid {pid}); "
                               "it is single-producer single-consumer")
        _PID.pack_into(self._mm, _PID_OFF[role], os.getpid(), process_start_time(os.getpid()) or 0)

    # -- properties -----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._seg.name

    @property
    def path(self) -> str:
        return self._seg.path

    def endpoint_pid(self, role: str) -> int:
        """Pid of the endpoint in ``role``: 0 = not attached yet, -1 = closed cleanly."""
        return _PID.unpack_from(self._mm, _PID_OFF[role])[0]

    def alive(self, role: str) -> bool:
        """Whether the ``role`` endpoint may still act: attached and running, or not yet attached."""
        pid, start = _PID.unpack_from(self._mm, _PID_OFF[role])
        return pid == 0 or (pid > 0 and pid_alive(pid, start or None))

    def peer_alive(self) -> bool:
        """Liveness of the other endpoint (for an endpoint ring)."""
        if self.role is None:
            raise ValueError("the owner is not an endpoint: use alive('producer'|'consumer')")
        return self.alive("consumer" if self.role == "producer" else "producer")

    def stats(self) -> dict[str, int]:
        """Racy snapshot of the shared counters (for metrics, not for synchronisation)."""
        pb, pm = _CNT.unpack_from(self._mm, _CNT_OFF["producer"])
        cb, cm = _CNT.unpack_from(self._mm, _CNT_OFF["consumer"])
        return {"capacity": self.capacity, "bytes_put": pb, "msgs_put": pm, "bytes_got": cb,
                "msgs_got": cm, "bytes_queued": pb - cb, "msgs_queued": pm - cm}

    # -- waiting --------------------------------------------------------------------------
    def _wait(self, ev: Notifier, deadline: float | None) -> int:
        """Count from ``ev`` before ``deadline``; 0 on timeout or once the peer is gone."""
        if self._spin_ns:
            n = self._spin_on_hint() if ev is self._data_ev else ev.spin(self._spin_ns)
            if n:
                return n
        while True:
            remaining = math.inf if deadline is None else deadline - time.monotonic()
            n = ev.wait(max(0.0, min(remaining, LIVENESS_S)))
            if n or remaining <= 0:
                return n
            if not self.peer_alive():
                return ev.take()

    def _spin_on_hint(self) -> int:
        """Consumer spin: watch the producer's published count (a plain load, ~0.1 us) and read
        the eventfd, the actual synchronisation point, only once it moves."""
        mm, off, seen = self._mm, _CNT_OFF["producer"], self._counts[1]
        now, end = time.monotonic_ns, time.monotonic_ns() + self._spin_ns
        while now() < end:
            if _CNT.unpack_from(mm, off)[1] != seen:
                n = self._data_ev.take()
                if n:
                    return n
        return 0

    # -- producer -------------------------------------------------------------------------
    def put(self, payload: Any = None, *, kind: int = MsgKind.DATA, stream_id: int = 0,
            seq: int = 0, flags: int = 0, aux: int = 0, enqueue_ns: int | None = None,
            timeout: float | None = None) -> bool:
        """Copy one message into the ring; False if no space came free within ``timeout``.

        ``enqueue_ns`` (time.monotonic_ns) is when the item was produced, for attribution;
        ``put_ns`` is stamped on entry here, so put->get covers waiting for space + both copies
        + the wake-up. Raises ValueError for payloads over ``max_payload_bytes``.
        """
        put_ns = time.monotonic_ns()
        if self.role != "producer":
            raise RuntimeError(f"put() on a {self.role} ring; attach a producer handle")
        if not 0 <= kind < PAD_KIND:
            raise ValueError(f"kind {kind} must be in [0, {PAD_KIND - 1}]")
        arr, code = as_array(payload)
        shape = (0, 0, 0)
        ndim = nbytes = 0
        if arr is not None:
            ndim, nbytes = arr.ndim, arr.nbytes
            if ndim > MAX_DIMS:
                raise ValueError(f"payload has {ndim} dims; the ring carries at most {MAX_DIMS}")
            shape = tuple(arr.shape) + (0,) * (MAX_DIMS - ndim)
        rec = _align(HEADER_SIZE + nbytes)
        if nbytes > self.max_payload_bytes:
            raise ValueError(f"payload of {nbytes} bytes exceeds max_payload_bytes="
                             f"{self.max_payload_bytes}; create the ring with capacity_bytes >= "
                             f"{2 * (rec + ALIGN)}")
        pos = self._pos
        room = self.capacity - pos
        need = rec + (room if room < rec else 0)
        if self._free < need:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._free < need:
                n = self._space_ev.take() or self._wait(self._space_ev, deadline)
                if not n:
                    return False
                for _ in range(n):
                    self._free += self._inflight.popleft()
        if room < rec:
            _PAD.pack_into(self._mm, DATA_OFFSET + pos, room, PAD_KIND)
            pos = 0
        _HDR.pack_into(self._mm, DATA_OFFSET + pos, rec, int(kind), int(flags), code, ndim, 0, 0,
                       stream_id, seq, *shape, nbytes,
                       put_ns if enqueue_ns is None else enqueue_ns, put_ns, aux)
        if nbytes:
            start = pos + HEADER_SIZE
            self._mv[start:start + nbytes] = arr.data.cast("B")  # memcpy, ~2x cheaper than numpy
        self._inflight.append(need)
        self._free -= need
        self._pos = (pos + rec) % self.capacity
        self._counts[0] += need
        self._counts[1] += 1
        _CNT.pack_into(self._mm, _CNT_OFF["producer"], *self._counts)
        self._data_ev.signal(1)
        return True

    # -- consumer -------------------------------------------------------------------------
    def get(self, timeout: float | None = None, *, copy: bool = True) -> Message | None:
        """Next message, or None if none arrived within ``timeout`` (or the producer is gone).

        ``copy=False`` returns a view into the ring, valid until ``msg.release()`` or the next
        ``get()``; ``get_ns`` is stamped just before returning.
        """
        if self.role != "consumer":
            raise RuntimeError(f"get() on a {self.role} ring; attach a consumer handle")
        if self._borrow:
            self._release(self._borrow)
        if not self._credit:
            # The producer's published message count is only a hint (no ordering guarantee):
            # read the eventfd at once when it says something is there, else poll first,
            # because a read of an empty eventfd raises, which costs ~1 us in Python.
            n = 0
            if _CNT.unpack_from(self._mm, _CNT_OFF["producer"])[1] != self._counts[1]:
                n = self._data_ev.take()
            if not n:
                n = self._wait(self._data_ev, None if timeout is None else
                               time.monotonic() + timeout)
            if not n:
                return None
            self._credit += n
        mm, pos = self._mm, self._pos
        used, kind = _PAD.unpack_from(mm, DATA_OFFSET + pos)
        if kind != PAD_KIND:
            used = 0
        else:
            pos = 0
        (rec, kind, flags, code, ndim, _, _, stream_id, seq, s0, s1, s2, nbytes, enq_ns, put_ns,
         aux) = _HDR.unpack_from(mm, DATA_OFFSET + pos)
        used += rec
        payload = None
        borrow = not copy and code
        if code:
            start = pos + HEADER_SIZE
            if borrow:
                payload = self._u8[start:start + nbytes].view(_NP_OF_CODE[code])
                payload = payload.reshape((s0, s1, s2)[:ndim])
            else:
                payload = np.empty((s0, s1, s2)[:ndim], _NP_OF_CODE[code])
                if nbytes:
                    payload.data.cast("B")[:] = self._mv[start:start + nbytes]
        self._credit -= 1
        self._pos = (pos + rec) % self.capacity
        self._counts[0] += used
        self._counts[1] += 1
        if not borrow:
            self._space_ev.signal(1)
            _CNT.pack_into(mm, _CNT_OFF["consumer"], *self._counts)
            release = None
        else:
            self._borrow_n += 1
            self._borrow = self._borrow_n
            release = (self, self._borrow_n)
        return Message(kind, flags, stream_id, seq, aux, payload, code, enq_ns, put_ns,
                       time.monotonic_ns(), release)

    def _release(self, bid: int) -> None:
        if self._borrow == bid and not self._closed:
            self._borrow = 0
            self._space_ev.signal(1)
            _CNT.pack_into(self._mm, _CNT_OFF["consumer"], *self._counts)

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Mark this endpoint closed (the peer stops waiting for it), unmap, close the fds.

        The owner's segment stays until :meth:`unlink` (or the registry's cleanup)."""
        if self._closed:
            return
        if self._borrow:
            self._release(self._borrow)
        self._closed = True
        if self.role is not None:
            _PID.pack_into(self._mm, _PID_OFF[self.role], -1, 0)
        self._data_ev.close()
        self._space_ev.close()
        del self._u8
        self._mv.release()
        try:
            self._seg.close()
        except BufferError:  # views from get(copy=False) still alive: the GC unmaps later
            pass

    def unlink(self) -> None:
        """Remove the segment name (owner only); mapped peers keep working until they close."""
        if self._registry is None:
            raise RuntimeError("only the ring's owner (Ring.create) unlinks it")
        self._registry.unlink(self._seg.path)

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._registry is not None:
            self.unlink()

    def __repr__(self) -> str:
        return f"Ring({self.name!r}, capacity={self.capacity}, role={self.role})"

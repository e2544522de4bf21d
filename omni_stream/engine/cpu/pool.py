"""The runtime's worker threads (``Pool``) and the lease by which another process lends its
cores to them while it is idle (``CoreLease``, two int32 words in shared memory; ``oc_pool.h``)."""

from __future__ import annotations

import contextlib
import ctypes as C

from omni_stream.engine.cpu.abi import library


class Pool:
    """The runtime's worker threads (the caller plus ``threads - 1`` spinning workers).

    ``lent_cpus``: extra workers, one pinned to each of these CPUs, that belong to another
    process (the codec stage) and join a job only while that process does not hold the
    ``lease`` (a :class:`CoreLease`; see ``oc_pool.h``). Results do not depend on which
    threads ran a job."""

    def __init__(self, threads: int, lib: C.CDLL | None = None, *,
                 lent_cpus: tuple[int, ...] = (), lease: "CoreLease | None" = None) -> None:
        self.lib = lib or library()
        own = max(1, int(threads))
        self.threads = own + len(lent_cpus)
        if self.threads > 255:
            raise ValueError(f"the CPU runtime runs at most 255 threads, got {self.threads}")
        if lent_cpus:
            cpus = (C.c_int32 * self.threads)(*([-1] * own + [int(c) for c in lent_cpus]))
            self.handle = self.lib.oc_pool_create_lent(self.threads, len(lent_cpus), cpus)
        else:
            self.handle = self.lib.oc_pool_create(self.threads)
        self.lease = lease  # kept alive as long as the pool reads it
        if lease is not None:
            self.lib.oc_pool_set_lease(self.handle, lease.address)

    def jobs(self) -> tuple[int, int]:
        """(jobs run on the pool's own threads only, jobs run with the lent ones) so far."""
        own, lent = C.c_uint64(), C.c_uint64()
        self.lib.oc_pool_jobs(self.handle, C.byref(own), C.byref(lent))
        return own.value, lent.value

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self.lib.oc_pool_destroy(self.handle)
            self.handle = None

class CoreLease:
    """Two int32 words in shared memory by which a process lends its cores to a native pool
    while it is idle: ``with lease.held():`` around the owner's own work takes them back (waits
    for the pool's job in flight, at most ``timeout_s``).

    ``CoreLease.open(path, offset)`` maps the words from a file both processes can open (a
    ring's segment: ``transport.ring.LEASE_OFF``) with a mapping of its own, so the lease
    outlives and never pins the ring's mapping; ``CoreLease()`` keeps them in private memory
    (one process, tests)."""

    def __init__(self, buffer=None, lib: C.CDLL | None = None, timeout_s: float = 0.005) -> None:
        self._map = None
        self._words = (C.c_int32 * 2)() if buffer is None else (C.c_int32 * 2).from_buffer(buffer)
        self.address = C.addressof(self._words)
        self.lib = lib or library()
        self.timeout_us = int(timeout_s * 1e6)
        self.late = 0  # acquisitions that went ahead after the timeout

    @classmethod
    def open(cls, path: str, offset: int, **kw) -> "CoreLease":
        import mmap
        import os

        page = offset - offset % mmap.ALLOCATIONGRANULARITY
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            mm = mmap.mmap(fd, offset - page + 8, offset=page)
        finally:
            os.close(fd)
        lease = cls(memoryview(mm)[offset - page:offset - page + 8], **kw)
        lease._map = mm  # the words point into it: keep it mapped for the lease's lifetime
        return lease

    def acquire(self) -> None:
        if not self.lib.oc_lease_acquire(self.address, self.timeout_us):
            self.late += 1

    def release(self) -> None:
        self.lib.oc_lease_release(self.address)

    @property
    def wanted(self) -> bool:
        return bool(self._words[0])

    @property
    def busy(self) -> bool:
        return bool(self._words[1])

    @contextlib.contextmanager
    def held(self):
        self.acquire()
        try:
            yield self
        finally:
            self.release()

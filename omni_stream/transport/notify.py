"""Counting wake-ups between processes: one eventfd per direction of a ring.

Why an eventfd and not a flag in shared memory: the eventfd counter is also the ring's
synchronisation point. The writer signals *after* it has written the message; the kernel takes
a lock on both ``write`` and ``read``, so a reader that has read a count of k is guaranteed to
see the k messages behind it, on x86 and on weakly ordered arm64 alike (plain stores to the
mapping from Python carry no such guarantee). Counts add up instead of being lost, so there is
no missed-wake-up race and the reader never needs to re-check shared state after sleeping.

Travel to other processes: a :class:`Notifier` pickles through
``multiprocessing.reduction.DupFd``; handed to ``Process(args=...)`` under 'spawn' or
'forkserver' the fd is passed to the child at launch (the child sees the same number), sent over
a multiprocessing ``Connection`` to a running process it goes through the resource sharer
(SCM_RIGHTS). Plain ``pickle.dumps`` outside those two paths fails by design.
"""

from __future__ import annotations

import os
import select
import time
from multiprocessing import reduction

_FLAGS = os.EFD_NONBLOCK | os.EFD_CLOEXEC if hasattr(os, "eventfd") else 0


class Notifier:
    """A non-blocking eventfd used as a counting semaphore; owns (and closes) its fd."""

    __slots__ = ("_fd", "_poll")

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            if not hasattr(os, "eventfd"):
                raise OSError("omni_stream.transport needs os.eventfd (Linux, Python >= 3.10)")
            fd = os.eventfd(0, _FLAGS)
        self._fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def fileno(self) -> int:
        return self._fd

    def signal(self, n: int = 1) -> None:
        """Add ``n`` to the count, waking a waiter."""
        os.eventfd_write(self._fd, n)

    def take(self) -> int:
        """Take the whole count (0 if none) without blocking."""
        try:
            return os.eventfd_read(self._fd)
        except BlockingIOError:
            return 0

    def wait(self, timeout_s: float) -> int:
        """Block up to ``timeout_s`` (>= 0, ms resolution) for a count, then take it; 0 on timeout.

        Polls before reading: a read of an empty eventfd raises, which costs ~1 us in Python."""
        ms = int(timeout_s * 1000.0 + 0.999) if timeout_s > 0 else 0
        return self.take() if self._poll.poll(ms) else 0

    def spin(self, spin_ns: int) -> int:
        """Busy-poll (one syscall per try) for up to ``spin_ns``; trades a core for wake-up latency."""
        end = time.monotonic_ns() + spin_ns
        poll = self._poll.poll
        while True:
            if poll(0):
                return self.take()
            if time.monotonic_ns() >= end:
                return 0

    def dup(self) -> "Notifier":
        return Notifier(os.dup(self._fd))

    def close(self) -> None:
        if self._fd >= 0:
            self._poll.unregister(self._fd)
            os.close(self._fd)
            self._fd = -1

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError, KeyError):
            pass

    def __reduce__(self):
        if self._fd < 0:
            raise ValueError("cannot send a closed Notifier")
        return _rebuild, (reduction.DupFd(self._fd),)


def _rebuild(dupfd) -> Notifier:
    fd = dupfd.detach()
    os.set_blocking(fd, False)  # a DupFd'd fd shares the file description: already non-blocking
    return Notifier(fd)

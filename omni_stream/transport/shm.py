"""Named shared-memory segments that never outlive the server that made them.

Every segment is a file in /dev/shm named ``omni-stream-<owner pid>-<token>-<label>-<n>``:
the pid lets :func:`cleanup_stale` find segments whose owner died without cleaning up (SIGKILL,
OOM kill, power loss of a container), the random token keeps two servers started by the same
pid namespace apart. Files are created with O_EXCL and mode 0600 (owner-only) and the first 64
bytes hold a preamble (magic, owner pid, owner start time) so a recycled pid is not mistaken for
the owner.

:class:`SegmentRegistry` is the owner's list of what it created; it unlinks everything on
``cleanup()``, on context-manager exit, at interpreter exit (atexit) and on SIGTERM/SIGINT (the
handlers chain to whatever was installed before). A signal this process was told to ignore
(SIG_IGN at install time, e.g. SIGINT in a job started in the background by a non-interactive
shell) is left ignored: it does not stop the process, so it must not take its segments away
either. Handlers installed *later* (asyncio's ``loop.add_signal_handler``) replace ours: the
server's own shutdown path then reaches ``cleanup()`` or atexit. SIGKILL is covered by
:func:`cleanup_stale` at the next start.

Peers (stage processes) never create segments; they open them by path with
:func:`open_segment`, which refuses files not owned by this uid or readable by others.
Linux only (as the eventfd wake-ups in :mod:`.notify`).
"""

from __future__ import annotations

import atexit
import logging
import mmap
import multiprocessing.util
import os
import re
import secrets
import signal
import struct
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "omni-stream-"
PREAMBLE_SIZE = 64
_MAGIC = b"OMNISHM1"
_PREAMBLE = struct.Struct("<8sqQ")  # magic, owner pid, owner start time (clock ticks)
_LABEL_RE = re.compile(r"^[A-Za-z0-9_.]+$")


def default_shm_dir() -> str:
    """/dev/shm (tmpfs, never touches disk); override with OMNI_STREAM_SHM_DIR (tests, odd hosts)."""
    return os.environ.get("OMNI_STREAM_SHM_DIR", "/dev/shm")


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[19])


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True while ``pid`` runs (zombies count as dead); with ``start_time``, also the same process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return not os.path.isdir("/proc/self")  # no procfs: trust kill(0)
    rest = stat[stat.rfind(b")") + 2:].split()
    if rest[0] in (b"Z", b"X"):
        return False
    return start_time is None or int(rest[19]) == start_time


@dataclass
class Segment:
    """One mapped segment. ``mm`` covers the whole file, preamble included."""

    name: str
    path: str
    size: int
    mm: mmap.mmap

    def close(self) -> None:
        """Unmap; fails with BufferError while numpy views of ``mm`` are alive (caller's job)."""
        if not self.mm.closed:
            self.mm.close()


class SegmentRegistry:
    """The owner's record of its segments; unlinks them all on every exit path it can see.

    One per server instance (``default_registry()`` gives a per-process one). Only the process
    that built the registry unlinks: a forked child that inherits it (and its atexit hook) does
    nothing on exit.
    """

    def __init__(self, token: str | None = None, *, shm_dir: str | None = None,
                 handle_signals: bool = True) -> None:
        self.owner_pid = os.getpid()
        self.token = token or secrets.token_hex(4)
        if not _LABEL_RE.match(self.token):
            raise ValueError(f"token {self.token!r} must match {_LABEL_RE.pattern}")
        self.prefix = f"{SEGMENT_PREFIX}{self.owner_pid}-{self.token}"
        self.shm_dir = shm_dir or default_shm_dir()
        self._paths: dict[str, None] = {}  # insertion-ordered set
        self._n = 0
        self._lock = threading.Lock()
        _register_live(self, handle_signals)

    # -- naming / bookkeeping -------------------------------------------------------------
    def new_name(self, label: str) -> str:
        if not _LABEL_RE.match(label):
            raise ValueError(f"segment label {label!r} must match {_LABEL_RE.pattern}")
        with self._lock:
            self._n += 1
            return f"{self.prefix}-{label}-{self._n}"

    def register(self, path: str) -> None:
        with self._lock:
            self._paths[path] = None

    def forget(self, path: str) -> None:
        with self._lock:
            self._paths.pop(path, None)

    @property
    def paths(self) -> list[str]:
        with self._lock:
            return list(self._paths)

    def unlink(self, path: str) -> None:
        """Unlink one segment (idempotent) and stop tracking it."""
        self.forget(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def cleanup(self) -> list[str]:
        """Unlink every tracked segment; returns the paths removed. No-op outside the owner."""
        if os.getpid() != self.owner_pid:
            return []
        removed = []
        for path in self.paths:
            self.unlink(path)
            removed.append(path)
        return removed

    def close(self) -> None:
        self.cleanup()
        _unregister_live(self)

    def __enter__(self) -> "SegmentRegistry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- segments ------------------------------------------------------------------------
    def create(self, label: str, size: int) -> Segment:
        """Create, reserve (posix_fallocate: ENOSPC now, not SIGBUS mid-stream) and map a segment."""
        if size <= PREAMBLE_SIZE:
            raise ValueError(f"segment size {size} must exceed the {PREAMBLE_SIZE}-byte preamble")
        name = self.new_name(label)
        path = os.path.join(self.shm_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.register(path)
        try:
            os.fchmod(fd, 0o600)  # umask can only remove bits, but be explicit
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise OSError(e.errno, f"cannot reserve {size} bytes in {self.shm_dir} "
                              f"({e.strerror}); free space there or lower the ring capacity") from e
            mm = _map(fd, size)
        except BaseException:
            os.close(fd)
            self.unlink(path)
            raise
        os.close(fd)
        _PREAMBLE.pack_into(mm, 0, _MAGIC, self.owner_pid, process_start_time(self.owner_pid) or 0)
        return Segment(name, path, size, mm)


def _map(fd: int, size: int) -> mmap.mmap:
    """Shared read-write mapping, pre-faulted (MAP_POPULATE) so that the first frames of the
    first stream do not pay one page fault per 4 KiB."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def open_segment(path: str) -> Segment:
    """Map an existing segment made by a registry of this user (peer side)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path}: owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}; "
                                  "segments must be owned by this user with mode 600")
        mm = _map(fd, st.st_size)
    finally:
        os.close(fd)
    if mm[:8] != _MAGIC:
        mm.close()
        raise ValueError(f"{path} is not an omni-stream segment (bad magic)")
    return Segment(os.path.basename(path), path, st.st_size, mm)


def segment_owner(path: str) -> tuple[int, int | None] | None:
    """(owner pid, start time or None) from a segment's preamble, None if unreadable/foreign:
    whose segment a file is, whatever its name says (cleanup_stale, cluster.reap)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.pread(fd, _PREAMBLE.size, 0)
    finally:
        os.close(fd)
    if len(raw) < _PREAMBLE.size:
        return None
    magic, pid, start = _PREAMBLE.unpack(raw)
    if magic != _MAGIC:
        return None
    return pid, (start or None)


def cleanup_stale(prefix: str = SEGMENT_PREFIX, shm_dir: str | None = None) -> list[str]:
    """Unlink this user's segments whose owner process is gone; returns the paths removed.

    Run at server start. The owner is the pid in the preamble (checked together with its start
    time, so a recycled pid does not keep a dead server's segments alive) or, for files without a
    readable preamble, the pid in the name. Segments of live owners and of other users are left.
    Caveat: owners in another pid namespace sharing this /dev/shm look dead.
    """
    shm_dir = shm_dir or default_shm_dir()
    name_re = re.compile(re.escape(prefix) + r"(\d+)-")
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    me = os.getpid()
    for name in names:
        m = name_re.match(name)
        if not m:
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != os.getuid() or not (st.st_mode & 0o170000 == 0o100000):
            continue
        owner = segment_owner(path) or (int(m.group(1)), None)
        if owner[0] == me or pid_alive(*owner):
            continue
        try:
            os.unlink(path)
            removed.append(path)
            log.info("removed stale shared-memory segment %s (owner pid %d gone)", path, owner[0])
        except FileNotFoundError:
            pass
    return removed


# -- process-wide exit hooks ---------------------------------------------------------------
_LIVE: list[SegmentRegistry] = []
_LIVE_LOCK = threading.Lock()
_HOOKS = {"atexit": False, "signals": False}
_PREV_HANDLERS: dict[int, object] = {}
_DEFAULT: list[SegmentRegistry] = []


def default_registry() -> SegmentRegistry:
    """The process-wide registry (created on first use, with atexit and signal hooks)."""
    with _LIVE_LOCK:
        if _DEFAULT and _DEFAULT[0].owner_pid == os.getpid():
            return _DEFAULT[0]
    reg = SegmentRegistry()
    with _LIVE_LOCK:
        _DEFAULT[:] = [reg]
    return reg


def cleanup_all() -> None:
    """Unlink the segments of every live registry of this process (atexit / signal path)."""
    with _LIVE_LOCK:
        regs = list(_LIVE)
    for reg in regs:
        try:
            reg.cleanup()
        except OSError as e:  # keep going: the other segments still need unlinking
            log.warning("segment cleanup failed: %s", e)


def _register_live(reg: SegmentRegistry, handle_signals: bool) -> None:
    with _LIVE_LOCK:
        _LIVE.append(reg)
        if not _HOOKS["atexit"]:
            atexit.register(cleanup_all)
            # children of the 'fork' method leave via os._exit (no atexit) but run these:
            multiprocessing.util.Finalize(None, cleanup_all, exitpriority=100)
            _HOOKS["atexit"] = True
    if handle_signals:
        install_signal_handlers()


def _unregister_live(reg: SegmentRegistry) -> None:
    with _LIVE_LOCK:
        if reg in _LIVE:
            _LIVE.remove(reg)


def _on_signal(signum: int, frame: object) -> None:
    """Unlink, then do what the signal would have done without us. Only installed over a
    handler or SIG_DFL: unlinking on a signal the process then survives would leave it running
    with its segments gone (peers could not attach, a restarted stage could not map its ring)."""
    cleanup_all()
    prev = _PREV_HANDLERS.get(signum)
    if callable(prev):
        prev(signum, frame)
    else:  # SIG_DFL or installed from C: die of the signal as we would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install_signal_handlers(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> bool:
    """Unlink segments on SIGTERM/SIGINT, then chain to the previous handler. A signal whose
    disposition is SIG_IGN now is left alone (the process survives it, so its segments must too;
    atexit and the other signal still clean up). Main thread only; returns False (and relies on
    atexit) elsewhere."""
    if _HOOKS["signals"]:
        return True
    if threading.current_thread() is not threading.main_thread():
        log.debug("not in the main thread: segment cleanup relies on atexit, not signal handlers")
        return False
    for sig in signals:
        prev = signal.getsignal(sig)
        if prev == signal.SIG_IGN:
            log.debug("%s is ignored in this process: left ignored, segments survive it",
                      signal.Signals(sig).name)
            continue
        _PREV_HANDLERS[sig] = prev
        signal.signal(sig, _on_signal)
    _HOOKS["signals"] = True
    return True

"""What every stage process does the same way at start-up."""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


def ignore_interrupts() -> None:
    """A terminal's Ctrl-C reaches the whole process group. The server shuts the stages down in
    order (a Shutdown message, or they notice the parent is gone), so stages ignore SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def pin_cpus(cpus: tuple[int, ...]) -> None:
    """Keep this stage on its own CPUs (the profile gives the stages disjoint sets, big cores
    first), so stages do not migrate onto each other's cores. Empty: leave it to the OS."""
    if not cpus:
        return
    allowed = os.sched_getaffinity(0)
    want = set(cpus) & allowed
    if not want:
        log.warning("CPU set %s is outside this process's CPUs %s: not pinning", cpus, sorted(allowed))
        return
    os.sched_setaffinity(0, want)

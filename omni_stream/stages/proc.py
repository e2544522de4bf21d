"""What every stage process does the same way at start-up."""

from __future__ import annotations

import signal


def ignore_interrupts() -> None:
    """A terminal's Ctrl-C reaches the whole process group. The server shuts the stages down in
    order (a Shutdown message, or they notice the parent is gone), so stages ignore SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

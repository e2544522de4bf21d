"""Observability: per-step attribution (:mod:`.stepstats`) and its merged report (:mod:`.report`).

Only the recording side is imported here (the report pulls in ``rich``)::

    from omni_stream.observability import stepstats
"""

from __future__ import annotations

from . import stepstats
from .stepstats import (add_listener, configure, dump, merge_snapshots, phase, record, record_ns,
                        remove_listener, snapshot)

__all__ = ["stepstats", "add_listener", "configure", "dump", "merge_snapshots", "phase", "record",
           "record_ns", "remove_listener", "snapshot"]

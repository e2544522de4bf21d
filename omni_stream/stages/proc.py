"""What every stage process is given (``StageSpec``) and does the same way at start-up."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PARENT_PID: int | None = None  # the server process that started this stage (start_stage)


@dataclass(frozen=True)
class StageSpec:
    """Picklable description of how a stage process loads and runs its model."""

    model_path: str
    dtype: str = "float32"
    max_slots: int = 4
    max_seq_len: int = 2048
    threads: int = 1
    device: str = "cpu"
    throttle: bool = True
    cpus: tuple[int, ...] = ()  # pin the stage to these CPUs (empty: no pinning)
    weight_path: str | None = None  # None: weights in dtype; int8/int4: engine.quant
    compile: bool = False  # torch.compile the decoder steps (engine.compiled)
    cuda_graphs: bool = False  # talker: capture the frame step as CUDA graphs (engine.graphs)
    engine: str = "torch"  # "native": the CPU runtime runs the decode step (engine/cpu)
    # Core lending (the lease in the frames ring, engine.cpu.pool.CoreLease): the talker runs
    # extra runtime threads pinned to ``lent_cpus`` (the codec's CPUs) while the codec stage,
    # which ``lends_cores``, is not decoding.
    lent_cpus: tuple[int, ...] = ()
    lends_cores: bool = False
    # talker: (draft layers, lookahead) of speculative code prediction (engine.speculative)
    speculative_cp: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, not {self.device!r}: set "
                             "cuda_graphs False (or --device cuda)")


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


def start_stage(name: str, spec) -> None:
    """The common start of a stage process: its log format, Ctrl-C handling, CPU pinning,
    intra-op threads and step-timing identity (``spec``: a StageSpec)."""
    import torch

    from omni_stream.observability import stepstats

    global _PARENT_PID
    _PARENT_PID = os.getppid()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {name}: %(message)s")
    ignore_interrupts()
    pin_cpus(spec.cpus)
    torch.set_num_threads(spec.threads)
    stepstats.configure(name)


def parent_alive() -> bool:
    """Whether the server process that started this stage still runs. A dead parent's orphans
    are re-parented to init or to a subreaper (a Ray worker is one), so the test is "the parent
    pid changed", not "the parent is pid 1"."""
    ppid = os.getppid()
    return ppid != 1 and (_PARENT_PID is None or ppid == _PARENT_PID)


def orphan_cleanup() -> None:
    """A stage leaving because its server died (SIGKILL, OOM, a killed Ray replica) unlinks the
    dead server's shared-memory segments, so /dev/shm is clean without waiting for the next
    server start on this machine. A no-op while the parent lives."""
    if parent_alive():
        return
    try:
        from omni_stream.transport.shm import cleanup_stale

        removed = cleanup_stale()
        if removed:
            log.info("server process gone: removed %d shared-memory segment(s)", len(removed))
    except OSError as e:
        log.warning("could not remove the dead server's segments: %s", e)

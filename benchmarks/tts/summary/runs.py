"""What a result file says about its run: when it happened (its own timestamp, else git, else
mtime), the machine it ran on, how it was served (server args, default profile, CUDA, low-bit
weight path) and, for a stream-latency run, its highest real-time concurrency."""

from __future__ import annotations

import datetime as dt
import fnmatch
import shlex
import subprocess
from pathlib import Path
from typing import Any

LOW_BIT = ("int8", "mixed", "int6", "int5", "int4")
# serve flags that change the decode path or the chunk schedule: a run with none of them ran the
# default profile (what `omni-stream serve --model DIR` does on that machine)
PATH_FLAGS = ("--profile", "--dtype", "--device", "--weight-path", "--engine", "--compile",
              "--no-compile", "--fidelity-first", "--no-fidelity-first", "--placement",
              "--talker-threads", "--codec-threads", "--cp-threads", "--no-lend-cores",
              "--first-chunk", "--steady-chunk", "--no-throttle")
NOT_RECORDED = "machine not recorded"


def own_timestamp(doc: Any) -> float | None:
    """The run's own time, from the JSON: machine.measured_at, else a top-level timestamp."""
    if not isinstance(doc, dict):
        return None
    m = doc.get("machine")
    stamps = [m.get("measured_at")] if isinstance(m, dict) else []
    stamps += [doc.get(k) for k in ("measured_at", "generated_at", "timestamp", "started_at")]
    for v in stamps:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1e9:
            return float(v)
        if isinstance(v, str):
            try:
                t = dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
            except ValueError:
                continue
            return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()
    return None


def git_content_times(folder: Path, names: list[str]) -> dict[str, float]:
    """Commit time of the last change to each file's content (renames followed), for the files
    git tracks unmodified; {} where git is not there."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(folder), *a], capture_output=True, text=True,
                              timeout=30, check=True).stdout
    try:
        changed = {Path(line[3:].split(" -> ")[-1].strip().strip('"')).name
                   for line in git("status", "--porcelain", "--untracked-files=all", "--", ".")
                   .splitlines() if line.strip()}
        out = {}
        for n in names:
            if n in changed:
                continue
            t = git("log", "-1", "--follow", "--diff-filter=AM", "--format=%ct", "--", n).strip()
            if t:
                out[n] = float(t)
        return out
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


def run_times(folder: Path, docs: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """name -> (when the run happened, how that is known: json / git / mtime)."""
    git_t = git_content_times(folder, [n for n, d in docs.items() if own_timestamp(d) is None])
    out = {}
    for n, d in docs.items():
        t = own_timestamp(d)
        if t is not None:
            out[n] = (t, "json")
        elif n in git_t:
            out[n] = (git_t[n], "git")
        else:
            out[n] = ((folder / n).stat().st_mtime, "mtime")
    return out


def iso(t: float | None) -> str | None:
    return None if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC")


def machine_of(doc: Any) -> str:
    """The ``machine`` label a benchmark recorded (benchmarks/tts/machine.py), else
    'machine not recorded' (with the file's own cpu field where it has one)."""
    m = doc.get("machine") if isinstance(doc, dict) else None
    if isinstance(m, dict) and m.get("label"):
        return str(m["label"])
    cpu = doc.get("cpu") if isinstance(doc, dict) else None
    if isinstance(cpu, dict):
        cpu = cpu.get("cpu_model")
    return f"{NOT_RECORDED} (cpu field: {cpu})" if isinstance(cpu, str) and cpu else NOT_RECORDED


def server_args_of(doc: dict) -> list[str] | None:
    """The serve flags of a run: its ``server_args``, else the --server-args of its command;
    None when neither says."""
    if isinstance(doc.get("server_args"), str):
        return shlex.split(doc["server_args"])
    try:
        cmd = shlex.split(str(doc.get("command") or ""))
    except ValueError:
        return None
    for i, tok in enumerate(cmd):
        if tok.startswith("--server-args="):
            return shlex.split(tok.split("=", 1)[1])
        if tok == "--server-args" and i + 1 < len(cmd):
            return shlex.split(cmd[i + 1])
    return [] if doc.get("command") else None


def default_path(doc: dict) -> bool:
    """Served with the default profile: no flag that changes the decode path or the chunks."""
    args = server_args_of(doc)
    return args is not None and not any(a.split("=", 1)[0] in PATH_FLAGS for a in args)


def norm_text(s: Any) -> str:
    """Lower-case letters and digits only: "0.6B-cpu" and "06bcpu" compare equal."""
    return "".join(ch for ch in str(s or "").lower() if ch.isalnum())


def is_cuda(doc: dict) -> bool:
    text = f"{doc.get('command', '')} {doc.get('label', '')}".lower()
    label = norm_text(doc.get("label"))
    return "--device cuda" in text or "cuda" in label or "gpu" in label


def latency_runs(files: dict[str, tuple[float, Any]]) -> list[tuple[str, dict]]:
    """stream_latency*.json documents of this machine as it is, newest first (a run with the
    ``emulation`` variables of harness.ISA_ENV set measured another kind of machine: its own
    section of SUMMARY.md has it, the headlines do not)."""
    runs = [(n, d) for n, (_, d) in files.items()
            if fnmatch.fnmatch(n, "stream_latency*.json") and isinstance(d, dict) and d.get("summaries")
            and not d.get("emulation")]
    return sorted(runs, key=lambda nd: -files[nd[0]][0])


def weight_path_of(doc: dict) -> str | None:
    """The low-bit weight path a latency run served with (from its server args, label or
    command), None for exact weights."""
    served = (doc.get("profile") or {}).get("weight_path")
    if served:
        return served if served in LOW_BIT else None
    text = " ".join(str(doc.get(k, "")) for k in ("server_args", "label", "command")).lower()
    for wp in LOW_BIT:
        if f"--weight-path {wp}" in text or f"--weight-path={wp}" in text or f"-{wp}" in text:
            return wp
    return None


def max_realtime(d: dict) -> tuple[int, list[int], str]:
    """A stream_latency run's highest concurrency with zero underruns in every stream, the
    levels it tested, and a note when every level passed (the figure is then a lower bound)."""
    ok = [s["concurrency"] for s in d["summaries"]
          if s.get("underruns") == 0 and s.get("realtime_streams") == s.get("streams")]
    levels = sorted(s["concurrency"] for s in d["summaries"])
    n = max(ok, default=0)
    return n, levels, " (every level tested passed: a lower bound)" if n == levels[-1] else ""

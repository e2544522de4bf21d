"""Which thread split serves best on this CPU: a grid of (placement, talker, codec, cp threads).

For every setting of ``--grid`` and every concurrency of ``--concurrency`` it starts a fresh
``omni-stream serve`` (so each cell's per-step statistics are its own), plays one untimed
4-frame warm-up request, then the streaming-latency benchmark's level (the functions of
``stream_latency_bench.py``: same texts, same client, same simulated real-time player) with
OMNI_STREAM_STEP_STATS_DIR set, stops the server and merges the per-process step statistics
with ``omni_stream.observability.report.build_report`` (as ``attribution_run.py`` does).

A grid entry is ``placement:talker:codec[:cp]``, e.g. ``together:1:1`` or ``split:1:1:1``
(talker LM, code predictor and codec in three processes). The naive setting "every stage gets
every core" (``together:N:N`` with N = os.cpu_count()) is always added and flagged ``naive``.
The best setting is the one with the most concurrency levels free of underruns, then the least
underrun time, then the lowest mean TTFA p50; it is flagged ``best``.

    python benchmarks/tts/cpu_thread_sweep.py --model /tmp/ck-small --concurrency 1,2

Prints a table and writes benchmarks/tts/results/cpu_thread_sweep.json. The default grid
(6 settings x 2 levels, 4 requests of <= 60 frames each) takes a few minutes on tiny or small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import level_summary, server, stream_level  # noqa: E402
from clients.stream_client import ClientError, stream_speech  # noqa: E402

RESULTS = ROOT / "benchmarks" / "tts" / "results"
DEFAULT_GRID = "together:1:1,together:2:1,together:1:2,split:1:1:1,split:1:1:2"
# phases whose figures go into the table / JSON (see omni_stream.observability.stepstats)
PHASES = ("talker.step", "talker.code_predictor", "cp.predict", "codec.decode", "frame.total",
          "talker.prefill")


@dataclass(frozen=True)
class Setting:
    placement: str
    talker: int
    codec: int
    cp: int = 1

    def __post_init__(self) -> None:
        if self.placement not in ("together", "split"):
            raise ValueError(f"placement must be together or split, not {self.placement!r}")
        if min(self.talker, self.codec, self.cp) < 1:
            raise ValueError(f"thread counts must be >= 1: {self}")

    @classmethod
    def parse(cls, spec: str) -> "Setting":
        parts = spec.strip().split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"grid entry {spec!r}: expected placement:talker:codec[:cp]")
        try:
            nums = [int(x) for x in parts[1:]]
        except ValueError:
            raise ValueError(f"grid entry {spec!r}: thread counts must be integers") from None
        return cls(parts[0], *nums)

    @property
    def name(self) -> str:
        base = f"{self.placement}:{self.talker}:{self.codec}"
        return base + f":{self.cp}" if self.placement == "split" else base

    def server_args(self) -> list[str]:
        a = ["--placement", self.placement, "--talker-threads", str(self.talker),
             "--codec-threads", str(self.codec)]
        return a + (["--cp-threads", str(self.cp)] if self.placement == "split" else [])

    def is_naive(self, cores: int) -> bool:
        used = (self.talker, self.codec) + ((self.cp,) if self.placement == "split" else ())
        return all(n == cores for n in used)


def parse_grid(spec: str, cores: int) -> list[Setting]:
    grid: list[Setting] = []
    for part in (p for p in spec.split(",") if p.strip()):
        s = Setting.parse(part)
        if s.placement == "together":
            s = Setting("together", s.talker, s.codec)  # cp threads unused: keep names unique
        if s not in grid:
            grid.append(s)
    naive = Setting("together", cores, cores)
    if naive not in grid:
        grid.append(naive)
    return grid


def _voice(url: str) -> str | None:
    with urllib.request.urlopen(url + "/v1/audio/voices", timeout=10) as r:
        voices = [v["name"] if isinstance(v, dict) else v for v in json.load(r).get("voices", [])]
    return voices[0] if voices else None


def _phases(rep: dict) -> dict[str, dict]:
    out = {}
    for row in rep.get("phases", []):
        if row["phase"] in PHASES:
            out[row["phase"]] = {k: row.get(k) for k in ("count", "mean_ms", "p50_ms", "p99_ms",
                                                         "per_frame_ms")}
    return out


def run_cell(model: str, setting: Setting, c: int, args: argparse.Namespace,
             extra: list[str]) -> dict:
    """One server, one concurrency level: latency summary + per-step attribution."""
    from omni_stream.observability.report import build_report, load_dumps

    with tempfile.TemporaryDirectory(prefix="thread-sweep-") as d:
        env_before = {k: os.environ.get(k) for k in ("OMNI_STREAM_STEP_STATS_DIR",
                                                     "OMNI_STREAM_STEP_STATS_INTERVAL")}
        os.environ["OMNI_STREAM_STEP_STATS_DIR"] = d
        os.environ["OMNI_STREAM_STEP_STATS_INTERVAL"] = "1"
        log_path = Path(d) / "server.log"
        try:
            max_streams = max(c, 4)
            with server(model, setting.server_args() + ["--max-streams", str(max_streams)] + extra,
                        log_path) as url:
                voice = _voice(url)
                if args.warmup:
                    asyncio.run(stream_speech(url, "Warm up.", voice, args.language, seed=0,
                                              extra={"max_new_tokens": 4}, timeout=args.timeout))
                t0 = time.monotonic()
                rows = asyncio.run(stream_level(url, c, args, voice))
                wall = time.monotonic() - t0
        except (ClientError, OSError) as e:
            tail = log_path.read_text()[-2000:] if log_path.exists() else ""
            raise SystemExit(f"{setting.name} at concurrency {c}: {e}\nserver log tail:\n{tail}")
        finally:
            for k, v in env_before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        rep = build_report(load_dumps(d))
    summ = level_summary(c, rows)
    return dict(summ, wall_s=round(wall, 2), phases=_phases(rep),
                critical_ratio=rep.get("critical", {}).get("ratio"), frames=rep.get("frames"))


def _ms(cell: dict, phase: str, key: str = "mean_ms") -> float | None:
    return cell["phases"].get(phase, {}).get(key)


def rank_key(entry: dict) -> tuple:
    """Lower is better: (-levels without underruns, underrun seconds, mean TTFA p50)."""
    levels = entry["levels"]
    clean = sum(1 for lv in levels if lv["underruns"] == 0)
    return (-clean, sum(lv["underrun_s"] for lv in levels),
            statistics.fmean(lv["ttfa_ms_p50"] for lv in levels))


def _f(x: float | None, fmt: str) -> str:
    return format(x, fmt) if x is not None else "-"


def table(entries: list[dict]) -> str:
    head = (f"{'setting':16} {'flag':>6} {'conc':>4} | {'TTFA p50':>8} {'p95':>6} ms | {'RTF':>5} | "
            f"{'underruns':>9} {'(s)':>5} | {'talker.step':>11} {'p50':>6} {'cp':>6} | "
            f"{'codec.decode':>12} {'/frame':>6} ms")
    lines = [head, "-" * len(head)]
    for e in entries:
        flag = "best" if e["best"] else ("naive" if e["naive"] else "")
        for lv in e["levels"]:
            cp = _ms(lv, "cp.predict") if e["placement"] == "split" else _ms(lv, "talker.code_predictor")
            lines.append(
                f"{e['setting']:16} {flag:>6} {lv['concurrency']:>4} | {lv['ttfa_ms_p50']:8.0f} "
                f"{lv['ttfa_ms_p95']:6.0f}    | {lv['rtf_mean']:5.2f} | {lv['underruns']:>9} "
                f"{lv['underrun_s']:5.2f} | {_f(_ms(lv, 'talker.step'), '11.1f')} "
                f"{_f(_ms(lv, 'talker.step', 'p50_ms'), '6.1f')} {_f(cp, '6.1f')} | "
                f"{_f(_ms(lv, 'codec.decode'), '12.1f')} "
                f"{_f(_ms(lv, 'codec.decode', 'per_frame_ms'), '6.1f')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="checkpoint folder, or 'default' (tiny)")
    ap.add_argument("--concurrency", default="1,2")
    ap.add_argument("--grid", default=DEFAULT_GRID,
                    help="comma-separated placement:talker:codec[:cp]; together:N:N (N = cores) "
                         "is always added")
    ap.add_argument("--server-args", default="", help="extra args for every omni-stream serve")
    ap.add_argument("--requests-per-level", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=60,
                    help="frames per request (random checkpoints rarely stop on their own)")
    ap.add_argument("--language", default="english")
    ap.add_argument("--prebuffer", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the untimed 4-frame request after each server start")
    ap.add_argument("--out", default=str(RESULTS / "cpu_thread_sweep.json"))
    args = ap.parse_args(argv)
    args.greedy, args.served_model = False, None  # what harness.stream_level reads
    cores = os.cpu_count() or 1
    try:
        grid = parse_grid(args.grid, cores)
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError as e:
        ap.error(str(e))
    if not levels or min(levels) < 1:
        ap.error("--concurrency: positive integers, e.g. 1,2")
    extra = args.server_args.split()
    machine = machine_info()
    t0 = time.monotonic()
    entries = []
    for s in grid:
        cells = []
        for c in levels:
            print(f"[{time.monotonic() - t0:6.0f} s] {s.name} concurrency {c}", flush=True)
            cells.append(run_cell(args.model, s, c, args, extra))
        entries.append(dict(setting=s.name, placement=s.placement, talker_threads=s.talker,
                            codec_threads=s.codec,
                            cp_threads=s.cp if s.placement == "split" else None,
                            naive=s.is_naive(cores), best=False, levels=cells))
    best = min(entries, key=rank_key)
    best["best"] = True
    print_machine(machine)
    print(table(entries))
    print(f"best: {best['setting']} (most levels without underruns, then least underrun time, "
          f"then lowest mean TTFA p50)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(benchmark="cpu_thread_sweep", model=args.model, cpu_count=cores,
               concurrency=levels, requests_per_level=args.requests_per_level,
               max_new_tokens=args.max_new_tokens, server_args=args.server_args,
               warmup=args.warmup, best=best["setting"],
               ranking="most levels with zero underruns, then least underrun_s, then lowest mean TTFA p50",
               settings=entries, load_avg_at_end=list(os.getloadavg()), machine=machine,
               wall_s=round(time.monotonic() - t0, 1),
               command=shlex.join(["python", "benchmarks/tts/cpu_thread_sweep.py",
                                  *(sys.argv[1:] if argv is None else argv)]))
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Render the benchmark results: SUMMARY.md, summary.json and PNG plots, from the JSON files.

Reads every ``*.json`` under ``--results`` (default benchmarks/tts/results/) and writes there:

  SUMMARY.md    one section per file: known files (frame_bench, code2wav_bench, transport_bench,
                fidelity_bench, attribution*, stream_latency*, official_compare,
                cpu_thread_sweep, gpu_frame_bench, continuous_text*, voice_clone*,
                capacity_bench*) as purpose-made tables, anything else flattened generically,
                each under the machine it ran on and when; the headline numbers of
                summary.json on top (with machine, run time and staleness per row).
  summary.json  headline numbers, each taken from the latest run that holds it, with the
                ``command`` that produced it (``commands``), where it came from (``sources``),
                the machine it ran on (``machines``: the file's ``machine`` label, else
                "machine not recorded"), when it ran (``run_at``), ``stale`` (a newer run of the
                same benchmark exists that does not give the number) and, for a number that
                cannot be computed, null plus the reason (``missing``). Nothing is estimated or
                carried over from an earlier summary.
  plots/        benchmarks/tts/plots.py's (the one plotting script; it also runs alone).

The page to read first is results/README.md (one page, hand-written from the latest JSONs);
SUMMARY.md is its appendix: every table of every JSON.

    python benchmarks/tts/summarize.py [--results DIR] [--no-plots]

When a run happened: the JSON's own timestamp (``machine.measured_at``, written by
benchmarks/tts/machine.py, or a top-level ``measured_at`` / ``generated_at`` / ``timestamp``);
else, for a file git tracks unmodified, the commit that last wrote its content (a checkout
gives every file the same mtime); else the file's mtime.

Plots need matplotlib (``pip install matplotlib``); without it the tables and summary.json are
still written and the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "tts" / "results"
OWN_OUTPUTS = ("summary.json",)
HEADLINE = ("speedup_vs_official_per_frame", "ttfa_ms_p50_c1_0_6b", "rtf_c1_0_6b",
            "stateful_vs_window_decode_ratio", "max_realtime_streams_cpu_tiny",
            "ttfa_ms_p50_c1_0_6b_cuda", "rtf_c1_0_6b_cuda", "rtf_c1_0_6b_quantized",
            "ttfa_ms_p50_c1_0_6b_quantized", "quantized_path", "engine_0_6b_quantized",
            "max_realtime_streams_cpu_0_6b", "logits_snr_db_quantized",
            "code0_agreement_quantized", "cp_agreement_quantized", "cold_start_s",
            "warm_start_s", "soak_frames", "soak_invalid_codes", "soak_gap_ms_p99", "soak_pass")
# continuous_text*.json (benchmarks/tts/continuous_bench.py): text written at these LLM rates
CONTINUOUS_RATES = (15, 30)
CONTINUOUS_KEYS = tuple(f"{mode}_{what}_{rate}tps" for rate in CONTINUOUS_RATES
                        for what in ("first_audio_ms_p50", "underruns")
                        for mode in ("continuous", "sentences"))
HEADLINE += CONTINUOUS_KEYS
# voice_clone*.json (benchmarks/tts/voice_clone_bench.py): registering a voice, first audio with it
CLONE_KEYS = ("voice_register_s_10s_0_6b", "ttfa_ms_p50_default_voice_0_6b_base",
              "ttfa_ms_p50_clone_x_vector_0_6b", "ttfa_ms_p50_clone_icl_0_6b")
HEADLINE += CLONE_KEYS
# capacity_bench*.json (benchmarks/tts/capacity_bench.py): the capacity /health advertises, kept?
CAPACITY_KEYS = ("capacity_streams_0_6b", "rtf_estimate_0_6b", "capacity_realtime_0_6b",
                 "capacity_bandwidth_gbs_0_6b", "capacity_underruns_admitted",
                 "capacity_underruns_within_capacity", "capacity_refused_within_capacity",
                 "capacity_refusals_without_retry_after", "capacity_failures",
                 "capacity_bench_machine")
HEADLINE += CAPACITY_KEYS
# the default profile's weight path and its fidelity (cpu_engine_bench*.json: the frontier) beside
# its speed (the latest default-profile 0.6B stream_latency run) and the bandwidth it had
DEFAULT_PATH_KEYS = ("default_weight_path", "rtf_c1_0_6b_default", "bandwidth_gbs",
                     "default_talker_logits_snr_db", "default_cp_logits_snr_db",
                     "default_talker_logits_snr_db_outliers", "default_cp_logits_snr_db_outliers")
HEADLINE += DEFAULT_PATH_KEYS
LOW_BIT = ("int8", "mixed", "int6", "int5", "int4")
# serve flags that change the decode path or the chunk schedule: a run with none of them ran the
# default profile (what `omni-stream serve --model DIR` does on that machine)
PATH_FLAGS = ("--profile", "--dtype", "--device", "--weight-path", "--engine", "--compile",
              "--no-compile", "--fidelity-first", "--no-fidelity-first", "--placement",
              "--talker-threads", "--codec-threads", "--cp-threads", "--no-lend-cores",
              "--first-chunk", "--steady-chunk", "--no-throttle")
NOT_RECORDED = "machine not recorded"


# ----------------------------------------------------------------------------- markdown helpers
def cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        a = abs(v)
        return f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 1 else f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(cell(x) for x in v) if len(v) <= 8 else f"[{len(v)} items]"
    if isinstance(v, dict):
        return f"{{{len(v)} keys}}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return "_(no rows)_\n"
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def dict_table(rows: list[dict], keys: list[str] | None = None) -> str:
    rows = [flatten(r) for r in rows]
    if keys is None:
        keys = list(dict.fromkeys(k for r in rows for k in r))
    return table(keys, [[r.get(k) for k in keys] for r in rows])


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> dotted keys; lists of scalars stay (rendered inline), others by length."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict):
                out.update(flatten(v, key))
            elif isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
                out[key] = f"[{len(v)} items]"
            else:
                out[key] = v
    else:
        out[prefix or "value"] = obj
    return out


def meta_line(doc: dict, keys: tuple[str, ...]) -> str:
    parts = [f"{k}: `{cell(doc[k])}`" for k in keys if k in doc and doc[k] not in (None, "")]
    cmd = f"\n\nCommand: `{doc['command']}`" if doc.get("command") else ""
    return ("; ".join(parts) + cmd + "\n\n") if parts or cmd else ""


# ----------------------------------------------------------------------------- renderers
def _collect(obj: Any, path: str, scalars: list, tables: list) -> None:
    """Scalar leaves -> (dotted path, value); every list of dicts -> (path, rows)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _collect(v, f"{path}.{k}" if path else str(k), scalars, tables)
    elif isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        tables.append((path, obj))
    elif isinstance(obj, list) and any(isinstance(x, (dict, list)) for x in obj):
        for i, x in enumerate(obj):
            _collect(x, f"{path}[{i}]", scalars, tables)
    else:
        scalars.append((path or "value", obj))


def r_generic(doc: Any) -> str:
    """Any JSON: one key/value table of the scalar leaves, one table per list of objects."""
    scalars: list[tuple[str, Any]] = []
    tables: list[tuple[str, list]] = []
    _collect(doc, "", scalars, tables)
    cmd = doc.get("command") if isinstance(doc, dict) else None
    md = table(["key", "value"], [[k, v] for k, v in scalars if k != "command"])
    if cmd:
        md += f"\nCommand: `{cmd}`\n"
    for path, rows in tables:
        md += f"\n**{path or 'rows'}**\n\n" + dict_table(rows)
    return md


def r_frame_bench(d: dict) -> str:
    md = meta_line(d, ("model", "frames"))
    md += "omni-stream per frame (ms):\n\n" + dict_table(d["ours"], [
        "dtype", "threads", "talker_ms", "cp_ms", "frame_ms", "code2wav_stream_ms", "floor_ms",
        "x_floor", "speedup_vs_official"])
    if d.get("official"):
        md += "\nofficial qwen-tts per frame (ms):\n\n" + dict_table(
            d["official"], ["dtype", "threads", "frame_ms", "code2wav_onepass_ms", "frames"])
    md += "\nbest per dtype (each side at its best thread count):\n\n"
    return md + table(["dtype", *next(iter(d["best"].values())).keys()],
                      [[k, *v.values()] for k, v in d["best"].items()])


def r_code2wav(d: dict) -> str:
    md = meta_line(d, ("config", "threads", "repeats", "context_frames", "cpu", "torch", "wall_s"))
    rows = {(r["dtype"], r["batch"], r["chunk"], r["mode"].startswith("window")): r for r in d["rows"]}
    keys = sorted({k[:3] for k in rows}, key=lambda k: (k[0], k[1], k[2]))
    out = []
    for dt_, b, c in keys:
        s, w = rows.get((dt_, b, c, False)), rows.get((dt_, b, c, True))
        out.append([dt_, b, c, s and s["ms_per_stream_frame"], s and s["rtf"],
                    w and w["ms_per_stream_frame"],
                    w["ms_per_stream_frame"] / s["ms_per_stream_frame"] if s and w else None])
    return md + table(["dtype", "batch", "chunk", "stream ms/frame", "stream RTF",
                       f"window{d.get('context_frames', '')} ms/frame", "window / stream"], out)


def r_transport(d: dict) -> str:
    return meta_line(d, ("hop", "n", "interval_us", "start_method", "cpu")) + dict_table(
        d["rows"], ["payload", "transport", "median_us", "p99_us", "mean_us", "max_us", "put_median_us"])


def r_fidelity(d: dict) -> str:
    return meta_line(d, ("model", "seconds")) + dict_table(
        d["rows"], ["path", "prompt", "frames", "first_diff_frame", "agreement_codebook0", "agreement_all"])


def r_attribution(d: dict) -> str:
    md = meta_line(d, ("frames", "frames_source", "frame_ms"))
    md += dict_table(d["phases"], ["phase", "role", "parent", "count", "mean_ms", "p50_ms",
                                   "p99_ms", "per_frame_ms", "share"])
    c = d.get("critical") or {}
    if c:
        md += (f"\nCritical path: {cell(c.get('sum_ms'))} ms of a measured "
               f"{cell(c.get('frame_total_ms'))} ms frame (ratio {cell(c.get('ratio'))}, "
               f"within tolerance: {cell(c.get('within_tolerance'))}).\n")
    return md


def r_stream_latency(d: dict) -> str:
    return meta_line(d, ("label", "model", "prebuffer_s")) + dict_table(d["summaries"], [
        "concurrency", "streams", "ttfa_ms_p50", "ttfa_ms_p95", "ttfa_ms_p99", "rtf_mean",
        "max_gap_ms", "underruns", "underrun_s", "realtime_streams"])


def r_official(d: dict) -> str:
    md = meta_line(d, ("model", "dtype", "threads", "max_new_tokens", "chunk", "cpu"))
    md += table(["median over texts (official / ours)", "value"],
                [[k, d.get(k)] for k in ("speedup_vs_official_per_frame", "generate_s_ratio_median",
                                         "total_s_ratio_median", "decode_ratio_vs_stream_median",
                                         "decode_ratio_vs_onepass_median")])
    rows = [[i, r["official"]["frames"], r["ours"]["frames"], r["official"]["generate_s"],
             r["ours"]["generate_s"], r["official"]["ms_per_frame"], r["ours"]["ms_per_frame"],
             r["ratio_ms_per_frame"], r["official"]["decode_ms_per_frame"],
             r["ours"]["decode_stream_ms_per_frame"], r["ours"]["decode_onepass_ms_per_frame"]]
            for i, r in enumerate(d["rows"])]
    return md + "\n" + table(["text", "frames off", "frames ours", "gen s off", "gen s ours",
                              "ms/frame off", "ms/frame ours", "ratio", "codec ms/fr off",
                              f"codec ms/fr ours c{d.get('chunk')}", "codec ms/fr ours 1-pass"], rows)


def r_thread_sweep(d: dict) -> str:
    md = meta_line(d, ("model", "cpu_count", "requests_per_level", "max_new_tokens", "best", "ranking"))
    rows = []
    for e in d["settings"]:
        for lv in e["levels"]:
            ph = lv.get("phases", {})
            cp = ph.get("cp.predict" if e["placement"] == "split" else "talker.code_predictor", {})
            rows.append([e["setting"], "best" if e.get("best") else "naive" if e.get("naive") else "",
                         lv["concurrency"], lv["ttfa_ms_p50"], lv["ttfa_ms_p95"], lv["rtf_mean"],
                         lv["underruns"], ph.get("talker.step", {}).get("mean_ms"), cp.get("mean_ms"),
                         ph.get("codec.decode", {}).get("mean_ms"),
                         ph.get("codec.decode", {}).get("per_frame_ms")])
    return md + table(["setting", "flag", "conc", "TTFA p50 ms", "p95", "RTF", "underruns",
                       "talker.step ms", "code predictor ms", "codec.decode ms/call",
                       "codec.decode ms/frame"], rows)


def r_gpu_frame(d: dict) -> str:
    md = meta_line(d, ("model", "device_name", "dtype", "torch", "max_seq_len", "frames", "sampling"))
    md += dict_table(d["rows"], ["mode", "streams", "bucket", "ms_per_step_p50", "ms_per_step_p90",
                                 "ms_per_stream_frame", "x_realtime", "frames_per_s"])
    if d.get("graphs_speedup"):
        md += "\nCUDA graphs speed-up (eager / graphs): " + ", ".join(
            f"{k} streams {cell(v)}x" for k, v in d["graphs_speedup"].items()) + "\n"
    return md


def r_voice_clone(d: dict) -> str:
    md = meta_line(d, ("model", "ref_seconds", "ref_frames", "max_new_tokens", "serve_args"))
    r = d["register_s"]
    md += (f"Registering a {d['ref_seconds']:g} s voice (ICL): first {r['first']:.2f} s (loads "
           f"the encoders), then median {r['warm_median']:.2f} s (n = {r['warm_n']}); x-vector "
           f"only {r['x_vector_only']:.2f} s.\n\n")
    rows = [dict(voice=k, **v) for k, v in d["kinds"].items()]
    return md + dict_table(rows, ["voice", "n", "ttfa_ms_p50", "ttfa_ms_p95", "rtf_p50"])


def r_continuous_text(d: dict) -> str:
    md = meta_line(d, ("label", "model", "server_args", "max_new_tokens", "prebuffer_s", "wall_s"))
    md += ("An LLM writing at each rate (tokens/s); first audio is counted from the first text "
           "piece sent; underruns are those of a real-time player started at the first audio; "
           "waited is the time the continuous speech spent waiting for text.\n\n")
    return md + dict_table(d["summaries"], [
        "rate_tps", "mode", "n", "first_audio_ms_p50", "first_audio_ms_p95", "underruns",
        "streams_with_underruns", "underrun_s", "text_waited_ms_p50", "rtf_mean", "audio_s_mean",
        "utterances_mean"])


def r_capacity(d: dict) -> str:
    md = meta_line(d, ("label", "model", "server_args", "frames", "samples", "max_rounds",
                       "prebuffer_s", "wall_s"))
    h = d.get("health") or {}
    md += ("/health at start: " + ", ".join(f"{k} `{cell(h.get(k))}`" for k in (
        "capacity_streams", "rtf_estimate", "realtime", "contention", "bandwidth_gbs", "margin",
        "slots")) + ". Each level sends rounds of N requests at once (a player starts at the "
        "first byte) until the admitted streams measured reach `samples`; refusals are counted "
        "by status and by whether they carried Retry-After.\n\n")
    rows = []
    for s in d["summaries"]:
        rows.append([s["concurrency"], "yes" if s.get("within_capacity") else "no", s["rounds"],
                     s["offered"], s["admitted"], s["refused_429"], s["refused_503"],
                     f"{s['refused_with_retry_after']}/{s['refused']}",
                     ", ".join(f"{k}: {v}" for k, v in s["other_status"].items()) or "–",
                     s["errors"], s["underruns"], s["underrun_s"], s["ttfa_ms_p50"],
                     s["ttfa_ms_p95"], s["ttfa_n"], s["rtf_p50"], s["rtf_max"],
                     s["capacity_after"], s["rtf_estimate_after"]])
    md += table(["conc", "<= capacity", "rounds", "offered", "admitted", "429", "503",
                 "with Retry-After", "other status", "errors", "underruns", "underrun s",
                 "TTFA p50 ms", "p95", "n", "RTF p50", "RTF max", "capacity after",
                 "RTF est. after"], rows)
    for title, key in (("Failures", "failures"), ("Notes", "notes")):
        if d.get(key):
            md += f"\n{title}:\n\n" + "".join(f"- {x}\n" for x in d[key])
    return md


RENDERERS: list[tuple[str, Callable[[dict], str]]] = [
    ("frame_bench*.json", r_frame_bench), ("code2wav_bench*.json", r_code2wav),
    ("transport_bench*.json", r_transport), ("fidelity_bench*.json", r_fidelity),
    ("attribution*.json", r_attribution), ("stream_latency*.json", r_stream_latency),
    ("official_compare*.json", r_official), ("cpu_thread_sweep*.json", r_thread_sweep),
    ("gpu_frame_bench*.json", r_gpu_frame), ("continuous_text*.json", r_continuous_text),
    ("voice_clone*.json", r_voice_clone), ("capacity_bench*.json", r_capacity)]


def render(name: str, doc: Any) -> str:
    for pattern, fn in RENDERERS:
        if fnmatch.fnmatch(name, pattern) and isinstance(doc, dict):
            try:
                return fn(doc)
            except (KeyError, TypeError, ValueError, StopIteration, AttributeError) as e:
                return f"_(layout not recognised by {fn.__name__}: {e!r}; generic view)_\n\n" + r_generic(doc)
    return r_generic(doc)


# ----------------------------------------------------------------------------- runs: when, where
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


# ----------------------------------------------------------------------------- summary.json
def _norm(s: Any) -> str:
    return "".join(ch for ch in str(s or "").lower() if ch.isalnum())


def is_cuda(doc: dict) -> bool:
    text = f"{doc.get('command', '')} {doc.get('label', '')}".lower()
    return "--device cuda" in text or "cuda" in _norm(doc.get("label")) or "gpu" in _norm(doc.get("label"))


def latency_runs(files: dict[str, tuple[float, Any]]) -> list[tuple[str, dict]]:
    """stream_latency*.json documents, newest first."""
    runs = [(n, d) for n, (_, d) in files.items()
            if fnmatch.fnmatch(n, "stream_latency*.json") and isinstance(d, dict) and d.get("summaries")]
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


def _max_realtime(d: dict) -> tuple[int, list[int], str]:
    """A stream_latency run's highest concurrency with zero underruns in every stream, the
    levels it tested, and a note when every level passed (the figure is then a lower bound)."""
    ok = [s["concurrency"] for s in d["summaries"]
          if s.get("underruns") == 0 and s.get("realtime_streams") == s.get("streams")]
    levels = sorted(s["concurrency"] for s in d["summaries"])
    n = max(ok, default=0)
    return n, levels, " (every level tested passed: a lower bound)" if n == levels[-1] else ""


def build_summary(files: dict[str, tuple[float, Any]], decode_chunk: int,
                  time_source: dict[str, str] | None = None) -> dict:
    """``files``: name -> (when the run happened, document); ``time_source``: name -> how that
    time is known (json / git / mtime)."""
    values: dict[str, Any] = {k: None for k in HEADLINE}
    commands: dict[str, str | None] = {k: None for k in HEADLINE}
    sources: dict[str, dict] = {}
    missing: dict[str, str] = {}
    missing_cmd: dict[str, str] = {}
    machines: dict[str, str] = {}
    run_at: dict[str, str | None] = {}
    stale: dict[str, str] = {}
    time_source = time_source or {}

    def newest(pattern: str) -> tuple[str, dict] | None:
        hits = [(n, d) for n, (_, d) in files.items() if fnmatch.fnmatch(n, pattern) and isinstance(d, dict)]
        return max(hits, key=lambda nd: files[nd[0]][0]) if hits else None

    def put(key: str, value: Any, name: str, doc: dict, detail: str,
            family: str | list[str] | None = None) -> None:
        """``family``: the runs of the same benchmark (a pattern or names); a newer one than
        ``name`` marks the value stale (that run does not give it)."""
        values[key] = value
        commands[key] = doc.get("command")
        when = files[name][0]
        machines[key] = machine_of(doc)
        run_at[key] = iso(when)
        sources[key] = {"file": name, "detail": detail, "machine": machines[key],
                        "run_at": run_at[key], "run_at_from": time_source.get(name, "mtime")}
        if not doc.get("command"):
            missing_cmd[key] = f"{name} has no 'command' field"
        names = ([n for n in files if fnmatch.fnmatch(n, family)] if isinstance(family, str)
                 else family or [])
        newer = sorted((n for n in names if n != name and files[n][0] > when),
                       key=lambda n: -files[n][0])
        if newer:
            stale[key] = (f"{', '.join(f'{n} ({iso(files[n][0])})' for n in newer[:3])} ran after "
                          f"{name} ({run_at[key]}) and does not give this number")
        else:
            stale.pop(key, None)

    # speedup vs official
    oc, fb = newest("official_compare*.json"), newest("frame_bench*.json")
    if oc and isinstance(oc[1].get("speedup_vs_official_per_frame"), (int, float)):
        put("speedup_vs_official_per_frame", oc[1]["speedup_vs_official_per_frame"], oc[0], oc[1],
            f"median over texts of official / ours ms per frame (decode steps, no codec; "
            f"official {oc[1].get('dtype')}, ours engine {oc[1].get('engine', 'torch')} weight "
            f"path {oc[1].get('weight_path') or oc[1].get('dtype')}; {oc[1].get('threads')} threads)")
    elif fb and isinstance(fb[1].get("best", {}).get("bf16", {}).get("speedup"), (int, float)):
        put("speedup_vs_official_per_frame", fb[1]["best"]["bf16"]["speedup"], fb[0], fb[1],
            "fallback: frame_bench best bf16 speedup (each side at its best thread count)",
            family="official_compare*.json")
    else:
        missing["speedup_vs_official_per_frame"] = (
            "no official_compare.json with speedup_vs_official_per_frame and no frame_bench.json "
            "with an official bf16 run")

    # streaming latency of the 0.6B shape at concurrency 1 (CPU: the latest run of the default
    # profile, whatever path it picked; CUDA: the latest run on exact weights)
    runs = latency_runs(files)

    def is_06b(d: dict) -> bool:
        return "06b" in _norm(d.get("label")) + " " + _norm(d.get("model"))

    def c1_of(d: dict) -> dict | None:
        return next((s for s in d["summaries"] if s.get("concurrency") == 1), None)

    def path_of(d: dict) -> str:
        prof = d.get("profile") or {}
        return (f"weight path {prof.get('weight_path') or weight_path_of(d) or 'exact'}, engine "
                f"{prof.get('engine') or 'torch'}")

    cpu_default = [(n, d) for n, d in runs if is_06b(d) and not is_cuda(d) and default_path(d)]
    default_c1 = next(((n, d, c1_of(d)) for n, d in cpu_default if c1_of(d)), None)
    if default_c1:
        name, d, s = default_c1
        where = (f"latest 0.6B CPU run of the default profile ({path_of(d)}), label "
                 f"{d.get('label')!r}, concurrency 1, n = {s.get('streams')} streams")
        put("ttfa_ms_p50_c1_0_6b", s["ttfa_ms_p50"], name, d, where, family=[n for n, _ in cpu_default])
        put("rtf_c1_0_6b", s["rtf_mean"], name, d, where + ", mean RTF over streams",
            family=[n for n, _ in cpu_default])
    else:
        missing["ttfa_ms_p50_c1_0_6b"] = missing["rtf_c1_0_6b"] = (
            "no CPU stream_latency*.json whose label or model names 0.6b, served with the default "
            f"profile (none of {', '.join(PATH_FLAGS)} in its server args), with a concurrency-1 "
            "level")
    cuda_runs = [(n, d) for n, d in runs if is_06b(d) and is_cuda(d) and weight_path_of(d) is None]
    found = next(((n, d, c1_of(d)) for n, d in cuda_runs if c1_of(d)), None)
    if found:
        name, d, s = found
        where = (f"latest 0.6B CUDA run on exact weights, label {d.get('label')!r}, model "
                 f"{d.get('model')!r}, concurrency 1, n = {s.get('streams')} streams")
        put("ttfa_ms_p50_c1_0_6b_cuda", s["ttfa_ms_p50"], name, d, where)
        put("rtf_c1_0_6b_cuda", s["rtf_mean"], name, d, where + ", mean RTF over streams")
    else:
        missing["ttfa_ms_p50_c1_0_6b_cuda"] = missing["rtf_c1_0_6b_cuda"] = (
            "no stream_latency*.json on CUDA whose label or model names 0.6b with a concurrency-1 "
            "level")

    # the same on a low-bit weight path (CPU): the latest such run, with its path and engine
    low_bit = [(n, d) for n, d in runs if weight_path_of(d) and is_06b(d) and not is_cuda(d)]
    best_q = next(((n, d, weight_path_of(d), c1_of(d)) for n, d in low_bit if c1_of(d)), None)
    if best_q:
        name, d, wp, s = best_q
        engine = (d.get("profile") or {}).get("engine") or (
            "native" if "--engine native" in str(d.get("server_args")) else "torch")
        where = (f"latest low-bit 0.6B CPU run, label {d.get('label')!r}, weight path {wp}, engine "
                 f"{engine}, concurrency 1, n = {s.get('streams')} streams, mean RTF over streams")
        # stale when a newer default-profile run exists on exact weights
        fam = sorted({n for n, _ in low_bit} | {n for n, _ in cpu_default})
        put("rtf_c1_0_6b_quantized", s["rtf_mean"], name, d, where, family=fam)
        put("ttfa_ms_p50_c1_0_6b_quantized", s["ttfa_ms_p50"], name, d, where, family=fam)
        put("quantized_path", wp, name, d, where, family=fam)
        put("engine_0_6b_quantized", engine, name, d, where, family=fam)
        ce = newest("cpu_engine_bench*.json")
        kind = f"{engine}-{wp}"
        rows = [r for r in (ce[1].get("fidelity", []) if ce else []) if r.get("path") == kind]
        if rows:
            f = rows[0]
            how = (f"{kind}, teacher-forced over {ce[1].get('fidelity_frames')} frames against "
                   "fp32 torch")
            put("logits_snr_db_quantized", f["logits_snr_db"], ce[0], ce[1], how)
            put("code0_agreement_quantized", f["code0_agreement"], ce[0], ce[1], how)
            put("cp_agreement_quantized", f["residual_agreement"], ce[0], ce[1], how)
        else:
            for k in ("logits_snr_db_quantized", "code0_agreement_quantized", "cp_agreement_quantized"):
                missing[k] = f"no cpu_engine_bench*.json with a fidelity row for {kind}"
    else:
        for k in ("rtf_c1_0_6b_quantized", "quantized_path", "ttfa_ms_p50_c1_0_6b_quantized",
                  "engine_0_6b_quantized", "logits_snr_db_quantized", "code0_agreement_quantized",
                  "cp_agreement_quantized"):
            missing[k] = "no CPU stream_latency*.json for 0.6b served with --weight-path int8/int4"

    # the default profile's weight path: its speed here and its fidelity on the frontier
    if default_c1:
        name, d, s = default_c1
        wp = (d.get("profile") or {}).get("weight_path") or weight_path_of(d)
        engine = (d.get("profile") or {}).get("engine") or "torch"
        where = (f"latest 0.6B CPU run of the default profile ({path_of(d)}), label "
                 f"{d.get('label')!r}, concurrency 1, n = {s.get('streams')} streams")
        fam = [n for n, _ in cpu_default]
        put("default_weight_path", wp, name, d, where, family=fam)
        put("rtf_c1_0_6b_default", s["rtf_mean"], name, d, where + ", mean RTF over streams",
            family=fam)
        bw = (d.get("machine") or {}).get("bandwidth_gbs")
        if bw is not None:
            put("bandwidth_gbs", bw, name, d, "read bandwidth measured on that run's machine "
                f"({(d.get('machine') or {}).get('bandwidth_threads')} threads)", family=fam)
        else:
            missing["bandwidth_gbs"] = f"{name} has no machine bandwidth"
        ce = newest("cpu_engine_bench*.json")
        row = next((r for r in (ce[1].get("frontier") or []) if r.get("path") == f"{engine}-{wp}"),
                   None) if ce else None
        for key, field in (("default_talker_logits_snr_db", "talker_logits_snr_db"),
                           ("default_cp_logits_snr_db", "cp_logits_snr_db")):
            for tag in ("", "_outliers"):
                if row is not None and field + tag in row:
                    put(key + tag, row[field + tag], ce[0], ce[1],
                        f"{engine}-{wp}, teacher-forced over 2 prompts x "
                        f"{ce[1].get('fidelity_frames')} frames against fp32 torch, "
                        + ("outliers checkpoint " + str(ce[1].get("outliers_model")) if tag
                           else "checkpoint " + str(ce[1].get("model"))))
                else:
                    missing[key + tag] = (f"no cpu_engine_bench*.json frontier row for {engine}-{wp}"
                                          + (" with an outliers model" if tag else ""))
    else:
        for k in DEFAULT_PATH_KEYS:
            missing[k] = "no CPU stream_latency*.json for 0.6b served with the default profile"

    # real-time streams of the 0.6B shape on CPU: the latest default-profile run
    key = "max_realtime_streams_cpu_0_6b"
    if cpu_default:
        name, d = cpu_default[0]
        n, levels, note = _max_realtime(d)
        put(key, n, name, d, f"highest concurrency with zero underruns in every stream, latest "
            f"0.6B CPU run of the default profile ({path_of(d)}), label {d.get('label')!r}; "
            f"levels tested {levels}{note}", family=[n_ for n_, _ in cpu_default])
    else:
        missing[key] = "no CPU stream_latency*.json for 0.6b served with the default profile"

    so = newest("soak*.json")
    if so and "frames" in so[1]:
        d = so[1]
        how = (f"{d.get('streams')} sampled streams at concurrency {d.get('concurrency')} on "
               f"model {d.get('model')!r}, {d.get('disconnected')} cut by their clients, "
               f"{d.get('injected_kills')} stage killed")
        put("soak_frames", d["frames"], so[0], d, how)
        put("soak_invalid_codes", d["invalid_codes_client"] + d.get("streams_failed_invalid_code_server", 0),
            so[0], d, how + "; codes checked by clients plus streams the server failed for one")
        put("soak_gap_ms_p99", d["gap_ms_p99"], so[0], d, how + f"; n = {d.get('gap_n')} gaps")
        put("soak_pass", d["pass"], so[0], d, how)
    else:
        for k in ("soak_frames", "soak_invalid_codes", "soak_gap_ms_p99", "soak_pass"):
            missing[k] = "no soak.json"

    ws = newest("warm_start_bench*.json")
    if ws and isinstance(ws[1].get("cold_start_s"), (int, float)):
        rows = {r.get("start"): r for r in ws[1].get("rows", [])}
        warm = rows.get("warm", {})
        if ws[1].get("compile", True):
            detail = (f"model {ws[1].get('model')!r} {ws[1].get('server_args', '')}: launch to "
                      f"/health; warm start compiled {warm.get('graphs_compiled')} graphs, loaded "
                      f"{warm.get('graphs_from_cache')} from the cache; eager start "
                      f"{ws[1].get('eager_start_s') or float('nan'):.1f} s")
        else:
            detail = (f"model {ws[1].get('model')!r} {ws[1].get('server_args', '')}, the profile's "
                      f"own engine (no --compile): launch to /health; cold = empty cache, warm = "
                      f"the cache the cold start left (packed weights, CPU runtime build)")
        put("cold_start_s", ws[1]["cold_start_s"], ws[0], ws[1], detail)
        put("warm_start_s", ws[1]["warm_start_s"], ws[0], ws[1], detail)
    else:
        missing["cold_start_s"] = missing["warm_start_s"] = "no warm_start_bench.json"

    # stateful (exact streaming) vs 25-frame window decode
    cw = newest("code2wav_bench*.json")
    key = "stateful_vs_window_decode_ratio"
    if cw and isinstance(cw[1].get("rows"), list):
        rows = [r for r in cw[1]["rows"] if r.get("dtype") in ("bfloat16", "bf16") and r.get("batch") == 1]
        st = {r["chunk"]: r["ms_per_stream_frame"] for r in rows if r.get("mode") == "stream"}
        wi = {r["chunk"]: r["ms_per_stream_frame"] for r in rows if str(r.get("mode")).startswith("window")}
        by_chunk = {c: wi[c] / st[c] for c in sorted(set(st) & set(wi)) if st[c] > 0}
        if decode_chunk in by_chunk:
            put(key, by_chunk[decode_chunk], cw[0], cw[1],
                f"window ms/frame / stateful ms/frame, bf16, batch 1, chunk {decode_chunk}; "
                "by chunk: " + ", ".join(f"{c}: {v:.2f}" for c, v in by_chunk.items()))
        else:
            missing[key] = (f"{cw[0]} has no bf16 batch-1 stream and window rows at chunk "
                            f"{decode_chunk} (chunks with both: {sorted(by_chunk)})")
    else:
        missing[key] = "no code2wav_bench.json"

    # continuous text vs sentence mode while an LLM writes (continuous_bench.py)
    ct = newest("continuous_text*.json")
    if ct and isinstance(ct[1].get("summaries"), list):
        for s in ct[1]["summaries"]:
            rate, mode = f"{s['rate_tps']:g}", s["mode"]
            how = (f"label {ct[1].get('label')!r}, model {ct[1].get('model')!r}, {mode} mode, "
                   f"LLM at {rate} tokens/s, n = {s['n']}")
            put(f"{mode}_first_audio_ms_p50_{rate}tps", s["first_audio_ms_p50"], ct[0], ct[1],
                how + "; first text piece sent -> first audio")
            put(f"{mode}_underruns_{rate}tps", s["underruns"], ct[0], ct[1],
                how + f"; summed over streams, player prebuffer {ct[1].get('prebuffer_s')} s")
    for k in CONTINUOUS_KEYS:
        if values.get(k) is None and k not in sources:
            missing[k] = (f"{ct[0]} has no row for this rate and mode" if ct else
                          "no continuous_text*.json (benchmarks/tts/continuous_bench.py)")

    # voice cloning on a Base checkpoint (voice_clone_bench.py)
    vc = newest("voice_clone*.json")
    if vc and isinstance(vc[1].get("kinds"), dict):
        d = vc[1]
        reg = d.get("register_s", {})
        put("voice_register_s_10s_0_6b", reg.get("warm_median"), vc[0], d,
            f"POST /v1/audio/voices of a {d.get('ref_seconds')} s clip in ICL mode, median of "
            f"n = {reg.get('warm_n')} after the first (which also loads the encoders: "
            f"{reg.get('first', 0):.2f} s); x-vector only {reg.get('x_vector_only', 0):.2f} s")
        for kind, key in (("default", "ttfa_ms_p50_default_voice_0_6b_base"),
                          ("x_vector", "ttfa_ms_p50_clone_x_vector_0_6b"),
                          ("icl", "ttfa_ms_p50_clone_icl_0_6b")):
            k = d["kinds"].get(kind)
            if k:
                put(key, k["ttfa_ms_p50"], vc[0], d,
                    f"{kind} voice, n = {k['n']}, interleaved with the other kinds, "
                    f"max_new_tokens {d.get('max_new_tokens')}; p95 {k['ttfa_ms_p95']:.0f} ms")
    for k in CLONE_KEYS:
        if values.get(k) is None and k not in sources:
            missing[k] = "no voice_clone*.json (benchmarks/tts/voice_clone_bench.py)"

    # real-time streams of the tiny model on CPU
    key = "max_realtime_streams_cpu_tiny"
    for name, d in runs:
        tagged = "tiny" in f"{d.get('label')} {d.get('model')}".lower() or d.get("model") == "default"
        if tagged and not is_cuda(d):
            best, levels, note = _max_realtime(d)
            put(key, best, name, d, f"highest concurrency with zero underruns in every stream; "
                f"levels tested {levels}{note}")
            break
    else:
        missing[key] = "no CPU stream_latency*.json labelled tiny (or model 'default')"

    # the capacity /health advertises, and whether the server kept it (capacity_bench.py)
    caps = sorted(((n, d) for n, (_, d) in files.items() if fnmatch.fnmatch(n, "capacity_bench*.json")
                   and isinstance(d, dict) and isinstance(d.get("summaries"), list)),
                  key=lambda nd: -files[nd[0]][0])
    cap06 = [(n, d) for n, d in caps
             if "06b" in _norm(d.get("label")) + " " + _norm(d.get("model")) + " "
             + _norm((d.get("health") or {}).get("model"))]
    if cap06:
        name, d = cap06[0]
        h, sums = d.get("health") or {}, d["summaries"]
        fam = [n for n, _ in cap06]
        how = (f"latest 0.6B capacity_bench run, label {d.get('label')!r}, server "
               f"{d.get('server_args')!r}, {d.get('frames')} frames a request, levels "
               f"{[x['concurrency'] for x in sums]}, >= {d.get('samples')} admitted streams a "
               "level (at most max_rounds rounds)")
        put("capacity_streams_0_6b", h.get("capacity_streams"), name, d,
            "/health capacity_streams at start; " + how, family=fam)
        put("rtf_estimate_0_6b", h.get("rtf_estimate"), name, d,
            "/health rtf_estimate (one stream) at start; " + how, family=fam)
        put("capacity_realtime_0_6b", h.get("realtime"), name, d, "/health realtime at start; " + how,
            family=fam)
        put("capacity_bandwidth_gbs_0_6b", h.get("bandwidth_gbs"), name, d,
            "/health bandwidth_gbs (the server's own measurement) at start; " + how, family=fam)
        n_ok = sum(x["admitted"] for x in sums)
        put("capacity_underruns_admitted", sum(x["underruns"] for x in sums), name, d,
            f"underruns summed over the {n_ok} admitted streams of every level (player from the "
            f"first byte, prebuffer {d.get('prebuffer_s')} s); " + how, family=fam)
        within = [x for x in sums if x.get("within_capacity")]
        put("capacity_underruns_within_capacity", sum(x["underruns"] for x in within), name, d,
            f"underruns of the {sum(x['admitted'] for x in within)} admitted streams at levels <= "
            "capacity; " + how, family=fam)
        put("capacity_refused_within_capacity", sum(x["refused"] for x in within), name, d,
            "requests refused at levels <= capacity (should be 0); " + how, family=fam)
        put("capacity_refusals_without_retry_after",
            sum(x["refused_without_retry_after"] for x in sums), name, d,
            f"of {sum(x['refused'] for x in sums)} refusals (429 / 503); " + how, family=fam)
        put("capacity_failures", len(d.get("failures") or []), name, d,
            "5xx other than a 503 refusal, other statuses, transport errors, broken streams, "
            "refusals without Retry-After (lines in the file's failures); " + how, family=fam)
        put("capacity_bench_machine", machine_of(d), name, d, how, family=fam)
    else:
        why = ("no capacity_bench*.json (benchmarks/tts/capacity_bench.py)" if not caps else
               f"capacity_bench runs found ({', '.join(n for n, _ in caps)}) but none whose label, "
               "model or /health model names 0.6b")
        for k in CAPACITY_KEYS:
            missing[k] = why
    return dict(**values, commands=commands, sources=sources, machines=machines, run_at=run_at,
                stale=stale, missing=missing, missing_commands=missing_cmd)


# ----------------------------------------------------------------------------- plots
# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of result JSON files")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--decode-chunk", type=int, default=4,
                    help="chunk size for stateful_vs_window_decode_ratio (code2wav_bench rows)")
    args = ap.parse_args(argv)
    res: Path = args.results
    if not res.is_dir():
        raise SystemExit(f"{res} is not a folder of results: run the benchmarks first")
    docs: dict[str, Any] = {}
    bad: list[str] = []
    for p in sorted(res.glob("*.json")):
        if p.name in OWN_OUTPUTS:
            continue
        try:
            docs[p.name] = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            bad.append(f"{p.name}: {e}")
    times = run_times(res, docs)
    files: dict[str, tuple[float, Any]] = {n: (times[n][0], d) for n, d in docs.items()}
    summary = build_summary(files, args.decode_chunk, {n: t[1] for n, t in times.items()})
    summary = dict(generated_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   generated_by="python benchmarks/tts/summarize.py " + " ".join(
                       argv if argv is not None else sys.argv[1:]),
                   **summary, unreadable=bad)
    (res / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    plots, plot_msg = [], ""
    if not args.no_plots:
        try:
            if str(ROOT) not in sys.path:
                sys.path.insert(0, str(ROOT))
            from benchmarks.tts.plots import make_all

            plots = make_all(res)
        except ImportError:
            plot_msg = ("matplotlib is not installed: plots skipped. Install it with "
                        "`pip install matplotlib` (or pass --no-plots).")
    md = ["# omni-stream TTS benchmark results", "",
          "The one-page summary is [README.md](README.md); this is its appendix, every table of "
          "every result JSON.", "",
          f"Generated by `benchmarks/tts/summarize.py` at {summary['generated_at']} from the JSON "
          "files in this folder; do not edit, re-run the script.", "", "## Headline numbers", "",
          "Each number comes from the latest run that gives it (when a run happened: its "
          "JSON's own timestamp, else the commit that last wrote the file, else the file's "
          "mtime); **stale** marks one a newer run of the same benchmark does not give. The "
          "machine is the label the benchmark recorded (benchmarks/tts/machine.py).", "",
          table(["key", "value", "machine", "run", "source", "how", "command"],
                [[k, summary[k], summary["machines"].get(k, "–"), summary["run_at"].get(k),
                  (summary["sources"].get(k) or {}).get("file") or "missing",
                  (f"**stale**: {summary['stale'][k]}. " if k in summary["stale"] else "")
                  + str((summary["sources"].get(k) or {}).get("detail") or summary["missing"].get(k)),
                  f"`{summary['commands'][k]}`" if summary["commands"].get(k)
                  else summary["missing_commands"].get(k)]
                 for k in HEADLINE])]
    if plots:
        md += ["## Plots", ""] + [f"### {t}\n\n![{t}]({p})\n" for t, p in plots]
    for name, (when, doc) in files.items():
        md += [f"## {name}", "", f"Machine: {machine_of(doc)}; run {iso(when)} (from "
               f"{times[name][1]}).", "", render(name, doc)]
    if bad:
        md += ["## Unreadable files", ""] + [f"- {b}" for b in bad] + [""]
    (res / "SUMMARY.md").write_text("\n".join(md))
    print(f"wrote {res / 'SUMMARY.md'} and {res / 'summary.json'}"
          + (f" and {len(plots)} plots in {res / 'plots'}" if plots else ""))
    for k in HEADLINE:
        print(f"  {k:38} {cell(summary[k]):>10}  {'STALE ' if k in summary['stale'] else ''}"
              f"{summary['missing'].get(k, '') or summary['machines'].get(k, '')}")
    if plot_msg:
        print(plot_msg, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

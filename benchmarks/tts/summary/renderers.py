"""SUMMARY.md's section per result file: a purpose-made table for each known benchmark
(``RENDERERS``, by file-name pattern), a generic one (every scalar leaf, every list of objects)
for anything else or for a known file whose layout changed."""

from __future__ import annotations

import fnmatch
from typing import Any, Callable

from benchmarks.tts.summary.markdown import cell, dict_table, meta_line, table


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

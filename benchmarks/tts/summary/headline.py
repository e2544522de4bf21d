"""summary.json: each headline number from the latest run that gives it, with its command,
source file and detail, machine, run time, staleness, and a reason where it is missing."""

from __future__ import annotations

import fnmatch
from typing import Any

from benchmarks.tts.summary.runs import (PATH_FLAGS, default_path, is_cuda, iso, latency_runs,
                                         machine_of, max_realtime, norm_text, weight_path_of)

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
        return "06b" in norm_text(d.get("label")) + " " + norm_text(d.get("model"))

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
        n, levels, note = max_realtime(d)
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
            best, levels, note = max_realtime(d)
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
             if "06b" in norm_text(d.get("label")) + " " + norm_text(d.get("model")) + " "
             + norm_text((d.get("health") or {}).get("model"))]
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

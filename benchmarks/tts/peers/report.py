"""peer_bench's report: the runs aggregated per (implementation, precision, threads), bits per
weight, the bandwidth floor, and the table and Markdown page (peer_bench.md); plots.py draws
from the same rows. The constants here are what the table is laid out by."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.tts.harness import markdown_table
from benchmarks.tts.machine import print_machine

TEXT = "Hello world, this is a streaming speech benchmark sentence with a few more words in it."
PRECISIONS = ("8-bit", "4-bit", "bf16", "fp32")
# bits per weight of the talker/code-predictor linears as stored (block scales included)
BITS = {
    "vox": {"8-bit": 9.0, "4-bit": 5.0, "bf16": 16.0, "fp32": 32.0},  # int8/int4 + f32 scale per 32
    "qwentts": {"8-bit": 8.5, "4-bit": 4.5, "bf16": 16.0, "fp32": 32.0},  # Q8_0, Q4_K, BF16, F32
}
MATCH_DB = 40.0


def aggregate(runs: list[dict]) -> list[dict]:
    """Medians per (impl, precision, threads), with n and the errors of failed runs."""
    out = []
    keys = dict.fromkeys((r["impl"], r["precision"], r["threads"]) for r in runs)
    for impl, prec, th in keys:
        rs = [r for r in runs if (r["impl"], r["precision"], r["threads"]) == (impl, prec, th)]
        ok = [r for r in rs if "error" not in r]
        row: dict[str, Any] = dict(impl=impl, precision=prec, threads=th, n=len(ok), runs=len(rs))
        if ok:
            for k in ("talker_ms", "cp_ms", "codec_ms"):
                vals = [r[k] for r in ok if r.get(k) is not None]
                row[k] = round(statistics.median(vals), 2) if vals else None
            row["frame_ms"] = round(statistics.median(r["talker_ms"] + r["cp_ms"] for r in ok), 2)
            row["frame_ms_min_max"] = [round(min(r["talker_ms"] + r["cp_ms"] for r in ok), 1),
                                       round(max(r["talker_ms"] + r["cp_ms"] for r in ok), 1)]
            row["codec_mode"] = ok[0].get("codec_mode")
            if ok[0].get("weight_bytes_per_frame"):
                row["weight_bytes_per_frame"] = ok[0]["weight_bytes_per_frame"]
        errs = [r["error"] for r in rs if "error" in r]
        if errs:
            row["error"] = errs[0]
        out.append(row)
    return out


def bits_per_weight(rows: list[dict]) -> None:
    """bits/weight and weight bytes per frame for every row: omni-stream's from its own packed
    plans (bytes per frame / the weights one frame reads), the peers' from their formats."""
    omni = {r["precision"]: r for r in rows if r["impl"] == "omni-stream" and r.get("weight_bytes_per_frame")}
    if "fp32" not in omni:
        return
    weights = omni["fp32"]["weight_bytes_per_frame"] / 4  # fp32: 4 bytes per weight
    for r in rows:
        if r["impl"] == "omni-stream" and r["precision"] in omni:
            r["bits_per_weight"] = round(8 * omni[r["precision"]]["weight_bytes_per_frame"] / weights, 2)
        elif r["impl"] in BITS:
            r["bits_per_weight"] = BITS[r["impl"]][r["precision"]]
            r["weight_bytes_per_frame"] = int(weights * r["bits_per_weight"] / 8)
        r["weights_per_frame"] = int(weights)


def floor_bandwidth(doc: dict) -> dict[str, float]:
    """GB/s per thread count for the floor: the higher of the readings before and after the
    runs (a shared machine reads low while others load it; the floor is what it can do)."""
    out = {}
    for th, v in doc["bandwidth_gbs_by_threads"].items():
        end = doc.get("machine_end") or {}
        e = end.get("bandwidth_gbs_1_thread") if th == "1" else end.get("bandwidth_gbs")
        out[th] = max(x for x in (v, e) if x is not None) if (v or e) else None
    return out


def fmt_ms(v: Any, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def table(doc: dict) -> str:
    bw = floor_bandwidth(doc)
    fid = {(r["impl"], r["precision"]): r for r in doc["fidelity"]}
    head = ["precision", "threads", "impl", "talker", "code pred.", "frame (min-max)", "n", "floor",
            "codec/frame", "fidelity vs fp32"]
    rows = []
    for r in sorted(doc["rows"], key=lambda r: (PRECISIONS.index(r["precision"]), r["threads"],
                                                 ["omni-stream", "vox", "qwentts"].index(r["impl"]))):
        f = fid.get((r["impl"], r["precision"]), {})
        if "error" in f:
            fs = "n/a: " + f["error"][:60]
        elif f.get("compared") == "codes":
            fs = (f"codes {100 * f['code_match']:.0f}% (cb0 {100 * f['code0_match']:.0f}%), "
                  f"{f['frames_before_first_difference']}/{f['frames']} frames exact")
        elif f:
            fs = f"audio frames {f['frames_before_first_difference']}/{f['frames']} exact (>= {MATCH_DB:.0f} dB)"
        else:
            fs = "-"
        floor = (r["weight_bytes_per_frame"] / (bw[str(r["threads"])] * 1e9) * 1e3
                 if r.get("weight_bytes_per_frame") and bw.get(str(r["threads"])) else None)
        if r["n"] == 0:
            cells = [r["precision"], str(r["threads"]), r["impl"], "failed: " + r.get("error", "?")[:120].replace("\n", " ").replace("|", "/"),
                     "", "", "0", "", "", fs]
        else:
            mm = r["frame_ms_min_max"]
            cells = [r["precision"], str(r["threads"]), r["impl"], fmt_ms(r.get("talker_ms")), fmt_ms(r.get("cp_ms")),
                     f"**{fmt_ms(r['frame_ms'])}** ({mm[0]}-{mm[1]})", str(r["n"]), fmt_ms(floor),
                     fmt_ms(r.get("codec_ms")), fs]
        rows.append(cells)
    return markdown_table(head, rows)


def markdown(doc: dict) -> str:
    m, me = doc["machine"], doc.get("machine_end") or {}
    bw = doc["bandwidth_gbs_by_threads"]
    return "\n".join([
        "# omni-stream beside the CPU peers (talker + code predictor per 80 ms frame)", "",
        f"Command: `{doc['command']}`  "
        + (f"\nFidelity rows: `{doc['fidelity_command']}` (from the same runs' codes and audio)  "
           if doc.get("fidelity_command") else ""), f"Checkpoint: `{doc['model']}` (random weights, released layout); "
        f"prompt: \"{TEXT}\", speaker ryan, english, greedy.  ",
        f"Machine: {m.get('label')}"
        + (f", run as an {doc['isa'].upper()}-only machine (harness.ISA_ENV: omni-stream's native kernels "
           f"{doc.get('native_kernels')}, torch / oneDNN / MKL capped alike)" if doc.get("isa") else
           (f"; omni-stream's native kernels {doc['native_kernels']}" if doc.get("native_kernels") else ""))
        + f"; read bandwidth {bw.get('1')} GB/s on 1 thread, {bw.get('2')} GB/s on 2 "
        f"(measured at the start; load average {m.get('load_avg_at_start')})"
        + (f", {me.get('bandwidth_gbs_1_thread')} / {me.get('bandwidth_gbs')} GB/s after the runs "
           f"(load {me.get('load_avg_at_start')})" if me else "") + ".  ",
        "Peers: " + ", ".join(f"{p['package']}=={p['version']}" for p in doc["peers"].values()) + ".  ",
        f"Rounds: {doc['rounds']} interleaved (fresh process per run), {doc['frames']} frames per run; "
        "ms are medians over the n successful runs (min-max of the frame in brackets). The machine is "
        "shared with other work: single figures move by 10-30 %.", "",
        "floor = weight bytes one frame reads (talker once + code predictor 15 times) / the measured "
        "bandwidth at that thread count (the higher of the readings before and after the runs: "
        + ", ".join(f"{v} GB/s at {t} thr" for t, v in floor_bandwidth(doc).items())
        + "): no implementation can beat it from DRAM. codec/frame: "
        "omni-stream and vox decode streaming in 4-frame chunks, qwentts.cpp decodes the utterance "
        "in one pass; omni-stream's codec runs as its codec stage does here (bf16 where the CPU has bf16 "
        "arithmetic, else fp32; packed weights, one-pass Snake), the peers' f32/their GGUF type.",
        "", table(doc), "",
        "Fidelity: greedy decoding of the same prompt against omni-stream's exact fp32 torch path "
        f"over the first {doc['fidelity_frames']} frames. qwentts.cpp: its dumped codes. vox: no codes "
        "in its API, so its audio against the reference's audio of the same text-streaming prompt (its "
        f"prompt mode), through the exact fp32 codec, per frame: >= {MATCH_DB:.0f} dB counts as equal codes "
        "(equal codes measure ~115 dB, a changed code ~0 dB). Random weights have flat logits, so "
        "agreement under quantization reads pessimistic next to a trained model.", ""]) + "\n"


def print_table(doc: dict) -> None:
    print_machine(doc["machine"])
    try:
        from rich.console import Console
        from rich.markdown import Markdown

        Console(width=200).print(Markdown(table(doc)))
    except ImportError:
        print(table(doc))

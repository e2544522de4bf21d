"""The plots of benchmarks/tts/results/README.md, regenerated from the latest result JSONs.

    python benchmarks/tts/plots.py            # writes benchmarks/tts/results/plots/*.png

- ttfa_rtf_vs_concurrency.png: TTFA p50/p95 and RTF p50 against concurrent streams, one line per
  stream_latency_*.json that records its machine (stream_latency_bench.py);
- peers_ms_vs_bits.png: talker + code predictor ms per 80 ms frame against bits per weight, omni-stream
  and the peers at 1 and 2 threads, with the memory-bandwidth floor (weight bytes one frame reads /
  the bandwidth measured in the same run) (peer_bench.json);
- frame_attribution.png: talker, code predictor and codec ms per frame, stacked, against the
  80 ms a frame lasts, per implementation and precision at 1 thread (peer_bench.json).
A missing input skips its plot with a line saying so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = Path(__file__).resolve().parent / "results"
FRAME_MS = 80.0
IMPLS = ("omni-stream", "vox", "qwentts")
COLORS = {"omni-stream": "tab:blue", "vox": "tab:orange", "qwentts": "tab:green"}


def _load(results: Path, name: str) -> dict | None:
    p = results / name
    return json.loads(p.read_text()) if p.exists() else None


def ttfa_rtf(plt, results: Path, plots: Path) -> Path | None:
    runs = []
    for p in sorted(results.glob("stream_latency_*.json")):
        d = json.loads(p.read_text())
        if d.get("machine") and d.get("summaries"):
            runs.append((p.name, d))
    if not runs:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, d in runs:
        s = sorted(d["summaries"], key=lambda x: x["concurrency"])
        c = [x["concurrency"] for x in s]
        label = f"{d.get('label', name)}\n({d['machine'].get('label')})"
        line, = a1.plot(c, [x["ttfa_ms_p50"] for x in s], "o-", label=label)
        a1.plot(c, [x["ttfa_ms_p95"] for x in s], "x--", color=line.get_color())
        a2.plot(c, [x["rtf_p50"] for x in s], "o-", color=line.get_color())
    a1.set(xlabel="concurrent streams", ylabel="TTFA ms (p50 solid, p95 dashed)", yscale="log",
           title="time to first audio")
    a2.axhline(1.0, color="grey", lw=1, ls=":")
    a2.set(xlabel="concurrent streams", ylabel="RTF p50 (< 1 = faster than real time)", title="real-time factor")
    a1.legend(fontsize=7, loc="upper left")
    fig.suptitle("omni-stream server, 0.6B (random weights), client-side: stream_latency_bench.py", fontsize=10)
    fig.tight_layout()
    out = plots / "ttfa_rtf_vs_concurrency.png"
    fig.savefig(out, dpi=110)
    return out


def peers_ms_vs_bits(plt, doc: dict, plots: Path) -> Path | None:
    import matplotlib.ticker

    rows = [r for r in doc["rows"] if r.get("n") and r.get("bits_per_weight")]
    if not rows:
        return None
    from benchmarks.tts.peers.report import floor_bandwidth

    bw = floor_bandwidth(doc)
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in IMPLS:
        for th, marker in ((1, "o"), (2, "s")):
            rs = sorted((r for r in rows if r["impl"] == impl and r["threads"] == th), key=lambda r: r["bits_per_weight"])
            if rs:
                ax.plot([r["bits_per_weight"] for r in rs], [r["frame_ms"] for r in rs], marker=marker,
                        ls="-" if th == 1 else "--", color=COLORS[impl], label=f"{impl}, {th} thread{'s' * (th > 1)}")
    weights = next(r["weights_per_frame"] for r in rows if r.get("weights_per_frame"))
    xs = [2, 40]
    for th, ls in (("1", ":"), ("2", "-.")):
        if bw.get(th):
            ax.plot(xs, [weights * b / 8 / (bw[th] * 1e9) * 1e3 for b in xs], color="black", ls=ls, lw=1,
                    label=f"bandwidth floor, {th} thr ({bw[th]} GB/s)")
    ax.axhline(FRAME_MS, color="red", lw=1, ls=":", label="80 ms = one frame of audio")
    ax.set(xscale="log", yscale="log", xlabel="bits per weight (talker + code predictor linears)",
           ylabel="talker + code predictor ms per frame (median)", xlim=(3.5, 40))
    ax.set_xticks([4, 5, 8, 9, 16, 32])
    ax.set_xticklabels(["4", "5", "8", "9", "16", "32"])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_title(f"Qwen3-TTS 0.6B on {doc['machine'].get('label')}\n"
                 f"peer_bench.py, {doc['rounds']} interleaved rounds, medians", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = plots / "peers_ms_vs_bits.png"
    fig.savefig(out, dpi=110)
    return out


def attribution(plt, doc: dict, plots: Path) -> Path | None:
    rows = [r for r in doc["rows"] if r.get("n") and r["threads"] == 1]
    if not rows:
        return None
    order = {p: i for i, p in enumerate(("8-bit", "4-bit", "bf16", "fp32"))}
    rows.sort(key=lambda r: (order[r["precision"]], IMPLS.index(r["impl"])))
    labels = [f"{r['impl']}\n{r['precision']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(rows)), 5))
    bottom = [0.0] * len(rows)
    for key, name, color in (("talker_ms", "talker step", "tab:blue"), ("cp_ms", "code predictor (15 sub-steps)", "tab:cyan"),
                             ("codec_ms", "codec (Code2Wav)", "tab:gray")):
        vals = [r.get(key) or 0.0 for r in rows]
        ax.bar(labels, vals, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(FRAME_MS, color="red", ls="--", lw=1, label="80 ms: one frame of audio (real time)")
    ax.set(ylabel="ms per frame, 1 thread (median)")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"Where a frame's time goes, 1 thread, {doc['machine'].get('label')} (peer_bench.py)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = plots / "frame_attribution.png"
    fig.savefig(out, dpi=110)
    return out


TITLES = {"ttfa_rtf_vs_concurrency.png": "TTFA and RTF against concurrency",
          "peers_ms_vs_bits.png": "ms per frame against bits per weight, with the bandwidth floor",
          "frame_attribution.png": "Per-step attribution against the 80 ms frame"}


def make_all(results: Path = RESULTS) -> list[tuple[str, str]]:
    """Write every plot the inputs allow into ``results/plots``; returns (title, path relative
    to ``results``). Needs matplotlib (ImportError otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = results / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    made = [ttfa_rtf(plt, results, plots)]
    peers = _load(results, "peer_bench.json")
    if peers is None:
        print("peer_bench.json missing: run benchmarks/tts/peer_bench.py; peer plots skipped", file=sys.stderr)
    else:
        made += [peers_ms_vs_bits(plt, peers, plots), attribution(plt, peers, plots)]
    plt.close("all")
    return [(TITLES[p.name], str(p.relative_to(results))) for p in made if p is not None]


def main() -> int:
    for _, p in make_all():
        print(f"wrote {RESULTS / p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

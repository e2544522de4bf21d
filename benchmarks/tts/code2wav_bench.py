"""Code2Wav streaming decode cost per 80 ms frame at the released dims, on one CPU thread.

Compares, side by side on the same random weights:
  stream   exact streaming (``Code2WavStream.decode``): only the n new frames are computed;
  window   the usual approximate scheme: re-decode 25 left-context frames + n new frames in one
           pass and keep the new samples. It runs the same kernels as ``stream`` from a fresh
           state, so the gap is purely the re-decoded context.
for chunk sizes 1, 2, 4, 8 frames, batch 1 and 4 (slots decoded in one call), fp32 and bf16.
Reported: median ms per call over ``--repeats`` calls (after one warm-up), ms per frame per
stream (call / (chunk * batch)) and the real-time factor (audio produced / wall time).

Run:  PYTHONPATH=. python benchmarks/tts/code2wav_bench.py [--repeats 5] [--window-batches 1]
Writes benchmarks/tts/results/code2wav_bench.json. Takes ~2-3 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from omni_stream.config import Code2WavConfig
from omni_stream.models.code2wav import (DEFAULT_GEMM_MIN_CHANNELS, Code2Wav, Code2WavStream,
                                         random_code2wav_state_dict)
from omni_stream.scheduling.fingerprint import fingerprint_info

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.tts.machine
from benchmarks.tts.harness import median_ms  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

log = logging.getLogger("code2wav_bench")
FRAME_MS = 80.0
CONTEXT = 25




def _row(mode: str, dtype: str, batch: int, chunk: int, call_ms: float) -> dict:
    per_frame = call_ms / (chunk * batch)
    return dict(mode=mode, dtype=dtype, batch=batch, chunk=chunk, ms_per_call=round(call_ms, 2),
                ms_per_stream_frame=round(per_frame, 2), rtf=round(per_frame / FRAME_MS, 3))


def run(repeats: int, chunks: list[int], batches: list[int], window_batches: list[int],
        dtypes: list[str], gemm_min_channels: int) -> list[dict]:
    cfg = Code2WavConfig()
    base = Code2Wav(cfg, gemm_min_channels=gemm_min_channels).eval()
    base.load_state_dict(random_code2wav_state_dict(cfg, seed=0), strict=True)
    n_params = sum(p.numel() for p in base.parameters())
    log.info("Code2Wav released dims: %.1fM parameters", n_params / 1e6)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, cfg.codebook_size, (max(batches + window_batches), cfg.num_quantizers,
                                                 CONTEXT + max(chunks)), generator=g)
    rows: list[dict] = []
    for dname in dtypes:
        model = base.to(getattr(torch, dname))
        with torch.inference_mode():
            for batch in batches:
                stream = Code2WavStream(model, max_slots=batch)
                slots = list(range(batch))
                stream.decode(slots, codes[:batch, :, :CONTEXT])  # a stream already under way
                for chunk in chunks:
                    new = codes[:batch, :, :chunk]
                    ms = median_ms(lambda: stream.decode(slots, new), repeats, warmup=1)
                    rows.append(_row("stream", dname, batch, chunk, ms))
                    log.info("%s", rows[-1])
            for batch in window_batches:
                stream = Code2WavStream(model, max_slots=batch)
                slots = list(range(batch))

                def window(chunk: int) -> torch.Tensor:
                    for s in slots:
                        stream.reset(s)
                    wav = stream.decode(slots, codes[:batch, :, :CONTEXT + chunk])
                    return wav[:, CONTEXT * cfg.samples_per_frame:]

                for chunk in chunks:
                    ms = median_ms(lambda: window(chunk), repeats, warmup=1)
                    rows.append(_row(f"window{CONTEXT}", dname, batch, chunk, ms))
                    log.info("%s", rows[-1])
    return rows


def _table(rows: list[dict]) -> str:
    head = f"{'mode':9s} {'dtype':9s} {'batch':>5s} {'chunk':>5s} {'ms/call':>9s} {'ms/frame/stream':>16s} {'RTF':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['mode']:9s} {r['dtype']:9s} {r['batch']:5d} {r['chunk']:5d} "
                     f"{r['ms_per_call']:9.1f} {r['ms_per_stream_frame']:16.1f} {r['rtf']:6.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--window-batches", type=int, nargs="*", default=[1],
                    help="batches for the 25-frame-window baseline (each call decodes 25+n frames)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gemm-min-channels", type=int, default=DEFAULT_GEMM_MIN_CHANNELS,
                    help="streaming kernel choice (see Code2Wav); 1000000000 = oneDNN convs only")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent / "results" / "code2wav_bench.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    machine = machine_info()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = run(args.repeats, args.chunks, args.batches, args.window_batches, args.dtypes,
               args.gemm_min_channels)
    wall = time.perf_counter() - t0
    print_machine(machine)
    print(_table(rows))
    result = dict(
        benchmark="code2wav_stream_decode", config="Code2WavConfig() (released dims)",
        frame_ms=FRAME_MS, context_frames=CONTEXT, repeats=args.repeats, threads=args.threads,
        gemm_min_channels=args.gemm_min_channels,
        torch=torch.__version__, cpu=fingerprint_info()["cpu_model"], cpu_count=os.cpu_count(),
        load_avg_at_end=os.getloadavg(), wall_s=round(wall, 1), machine=machine, rows=rows,
        note="random weights; median of repeats after one warm-up; window baseline uses the "
             "same kernels from a fresh state (25 context + n new frames per call)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    import shlex

    result["command"] = "python benchmarks/tts/code2wav_bench.py " + shlex.join(sys.argv[1:])
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({wall:.0f} s)")


if __name__ == "__main__":
    main()

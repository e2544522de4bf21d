"""OpenAI ``speed``: what the time-stretch adds to time to first audio, and how it sounds.

Starts one real server on a random checkpoint (tiny by default) and times first audio (the
first non-empty pcm bytes of ``POST /v1/audio/speech``) at speed 1.0 and each speed asked,
interleaved in rounds so drift hits every speed alike; prints medians with n and writes JSON.
Beside it, the stretcher alone (server/speed.py) on tones chunk by chunk, as the server feeds
it: output length over round(n / speed), dominant frequency over the tone's, the largest step
over the tone's own, the input it needs before its first output, and its CPU per audio second.

    python benchmarks/tts/speed_bench.py [--preset tiny] [--rounds 7] [--out JSON]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

SR = 24000


def stretcher_figures(speed: float) -> dict:
    from omni_stream.server.speed import Stretcher

    out: dict = {"speed": speed}
    sizes = [1920, 1920, 3840] + [7680] * 6
    for hz in (220.0, 1000.0):
        x = (0.5 * np.sin(2 * np.pi * hz * np.arange(sum(sizes)) / SR)).astype(np.float32)
        st, ys, i, first_in = Stretcher(speed, SR), [], 0, None
        for n in sizes:
            ys.append(st.push(x[i:i + n]))
            i += n
            if first_in is None and len(ys[-1]):
                first_in = i
        y = np.concatenate([*ys, st.finish()])
        mid = y[len(y) // 4: 3 * len(y) // 4]
        spec = np.abs(np.fft.rfft(mid * np.hanning(len(mid)), 8 * len(mid)))
        body = y[SR // 20: len(y) - SR // 20]
        peak_hz = float(np.argmax(spec)) * SR / (8 * len(mid))
        out[f"pitch_ratio_{int(hz)}"] = round(peak_hz / hz, 4)
        out[f"max_step_over_own_{int(hz)}"] = round(
            float(np.max(np.abs(np.diff(body))) / np.max(np.abs(np.diff(x)))), 3)
        out["length_ratio"] = round(len(y) / round(len(x) / speed), 5)
        out["first_output_after_input_ms"] = round(first_in / SR * 1e3, 1)
    noise = (np.random.default_rng(0).standard_normal(SR * 10) * 0.1).astype(np.float32)
    st, t = Stretcher(speed, SR), time.perf_counter()
    for i in range(0, len(noise), 1920):
        st.push(noise[i:i + 1920])
    st.finish()
    out["cpu_ms_per_audio_s"] = round((time.perf_counter() - t) * 1e3 / 10, 2)
    return out


async def first_audio_s(session, url: str, speed: float, text: str) -> float:
    t = time.perf_counter()
    async with session.post(url + "/v1/audio/speech", json={
            "input": text, "seed": 1, "response_format": "pcm", "speed": speed,
            "max_new_tokens": 16}) as r:
        assert r.status == 200, await r.text()
        async for data in r.content.iter_any():
            if data:
                ttfa = time.perf_counter() - t
                break
        await r.read()
    return ttfa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--speeds", default="0.5,1.5,2.0")
    ap.add_argument("--out", default="benchmarks/tts/results/speed_bench.json")
    args = ap.parse_args()
    speeds = [float(s) for s in args.speeds.split(",")]

    import aiohttp

    from omni_stream.checkpoints.io import write_random_checkpoint
    from omni_stream.orchestrator import PipelineBackend, PipelineSettings
    from omni_stream.scheduling.chunking import ChunkPolicy
    from omni_stream.server.app import start_server
    from omni_stream.server.testing import serving_in_thread

    stretch = [stretcher_figures(s) for s in speeds]
    with tempfile.TemporaryDirectory() as tmp:
        ck = write_random_checkpoint(Path(tmp), args.preset, "custom_voice", seed=0)
        settings = PipelineSettings(model_path=str(ck), max_streams=2, max_seq_len=1024,
                                    max_queue=8, queue_timeout_s=60,
                                    schedule=ChunkPolicy(first=1, steady=4))
        with serving_in_thread(lambda: start_server(PipelineBackend(settings), "127.0.0.1", 0),
                               timeout=300) as url:
            async def timed() -> dict[float, list[float]]:
                res: dict[float, list[float]] = {s: [] for s in [1.0, *speeds]}
                async with aiohttp.ClientSession() as s:
                    for sp in res:  # warm-up, untimed
                        await first_audio_s(s, url, sp, "Warm up.")
                    for _ in range(args.rounds):
                        for sp in res:
                            res[sp].append(await first_audio_s(s, url, sp, "Hello there."))
                return res

            ttfa = asyncio.run(timed())
    base = statistics.median(ttfa[1.0])
    rows = [{"speed": sp, "n": len(v), "ttfa_ms_median": round(statistics.median(v) * 1e3, 1),
             "added_ms_median": round((statistics.median(v) - base) * 1e3, 1)}
            for sp, v in ttfa.items()]
    print(f"{'speed':>6} {'n':>3} {'TTFA ms':>8} {'added ms':>9}")
    for r in rows:
        print(f"{r['speed']:>6} {r['n']:>3} {r['ttfa_ms_median']:>8} {r['added_ms_median']:>9}")
    print("\nstretcher alone (Rubber Band R3, short window, via pylibrb):")
    for f in stretch:
        print(" ", f)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"preset": args.preset, "ttfa": rows,
                                          "stretcher": stretch}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Voice cloning cost on a Base checkpoint: registering a voice, and first audio with it.

Starts ``omni-stream serve`` on ``--model`` (a Base checkpoint, the profile it picks by itself),
makes a reference clip of ``--ref-seconds`` (a synthetic voiced signal: harmonics of a gliding
pitch under a syllable envelope, plus noise; written here, nothing read from disk), then:

1. registers it ``--registrations`` times through ``POST /v1/audio/voices`` in ICL mode (the
   first call also loads the encoders: reported apart as ``first``) and once x-vector only;
2. sends the same texts round-robin with no voice (the Base model's default), the x-vector voice
   and the ICL voice, one request at a time, interleaved so that each kind sees the same machine
   state; per kind TTFA p50/p95 (n stated) and RTF.

Prints a table and writes JSON (``--out``). Exit 1 on any failed request: no numbers from broken
runs.

    python benchmarks/tts/voice_clone_bench.py --model /tmp/ck-06b-base --rounds 20
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import TEXTS, pct, server  # noqa: E402
from clients.stream_client import stream_speech  # noqa: E402

REF_TEXT = ("This is the reference recording, spoken slowly and clearly, so that the model can "
            "learn what my voice sounds like.")


def reference_clip(seconds: float, sr: int = 24000, seed: int = 0) -> bytes:
    """A wav of a voiced, speech-like signal (16-bit)."""
    import soundfile as sf

    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t) + 10 * np.sin(2 * np.pi * 3.1 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    syllables = np.clip(np.sin(2 * np.pi * 4.0 * t), 0, None) ** 0.5
    wav = 0.25 * voiced * syllables + 0.01 * g.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, (wav / np.abs(wav).max() * 0.8).astype(np.float32), sr, format="WAV",
             subtype="PCM_16")
    return buf.getvalue()


async def register(url: str, name: str, clip: bytes, ref_text: str | None) -> tuple[float, dict]:
    import aiohttp

    form = aiohttp.FormData()
    form.add_field("audio", clip, filename="ref.wav", content_type="audio/wav")
    form.add_field("name", name)
    if ref_text:
        form.add_field("ref_text", ref_text)
    else:
        form.add_field("x_vector_only", "true")
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/audio/voices", data=form) as r:
        body = await r.json()
        if r.status != 201:
            raise SystemExit(f"registering {name} failed: {r.status} {body}")
    return time.perf_counter() - t0, body


async def run(url: str, a) -> dict:
    clip = reference_clip(a.ref_seconds)
    reg = []
    for i in range(a.registrations):
        dt, rec = await register(url, f"bench-icl-{i}", clip, REF_TEXT)
        reg.append(dt)
    xdt, xrec = await register(url, "bench-xvec", clip, None)
    kinds = {"default": None, "x_vector": "bench-xvec", "icl": "bench-icl-0"}
    rows: dict[str, list[dict]] = {k: [] for k in kinds}
    for i in range(a.rounds):
        for kind, voice in kinds.items():
            res = await stream_speech(url, TEXTS[i % len(TEXTS)], voice, "english", seed=i,
                                      extra={"max_new_tokens": a.max_new_tokens},
                                      timeout=300)
            if len(res.pcm) == 0 or len(res.pcm) % 1920:
                raise SystemExit(f"{kind} request {i} returned {len(res.pcm)} samples")
            rows[kind].append(dict(ttfa_ms=res.ttfa_s * 1e3, rtf=res.rtf, audio_s=res.audio_s))
    out = dict(ref_seconds=a.ref_seconds, ref_frames=rec.get("frames"),
               register_s=dict(first=reg[0], warm_median=statistics.median(reg[1:] or reg),
                               warm_n=len(reg[1:] or reg), x_vector_only=xdt),
               kinds={})
    for kind, rs in rows.items():
        t = [r["ttfa_ms"] for r in rs]
        out["kinds"][kind] = dict(n=len(rs), ttfa_ms_p50=pct(t, 0.5), ttfa_ms_p95=pct(t, 0.95),
                                  rtf_p50=pct([r["rtf"] for r in rs], 0.5))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Base checkpoint folder")
    ap.add_argument("--serve-args", default="", help="extra `omni-stream serve` flags")
    ap.add_argument("--ref-seconds", type=float, default=10.0)
    ap.add_argument("--registrations", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=20, help="requests per kind")
    ap.add_argument("--max-new-tokens", type=int, default=25)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/voice_clone_0.6b_cpu.json"))
    a = ap.parse_args(argv)
    log = Path(a.out).with_suffix(".server.log")
    machine = machine_info()
    import tempfile

    with tempfile.TemporaryDirectory() as vdir, \
            server(a.model, ["--voice-dir", vdir, *a.serve_args.split()], log) as url:
        res = asyncio.run(run(url, a))
    res.update(model=a.model, max_new_tokens=a.max_new_tokens, serve_args=a.serve_args,
               machine=machine)
    print_machine(machine)
    r = res["register_s"]
    print(f"register a {a.ref_seconds:.0f} s voice (ICL, {res['ref_frames']} frames): first "
          f"{r['first']:.2f} s (loads the encoders), then median {r['warm_median']:.2f} s "
          f"(n={r['warm_n']}); x-vector only {r['x_vector_only']:.2f} s")
    print(f"{'voice':<10} {'n':>3} {'TTFA p50 ms':>12} {'TTFA p95 ms':>12} {'RTF p50':>8}")
    for kind, k in res["kinds"].items():
        print(f"{kind:<10} {k['n']:>3} {k['ttfa_ms_p50']:>12.0f} {k['ttfa_ms_p95']:>12.0f} "
              f"{k['rtf_p50']:>8.2f}")
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

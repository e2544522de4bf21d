"""A new user's first run, measured from the client: a fresh random checkpoint, an empty cache
(no packed weights, no chunk calibration, the CPU runtime built on first use), ``omni-stream
serve`` with the profile it picks by itself, then ``omni-stream-client`` run once per request as
a separate process, each reporting its own TTFA, RTF and underruns (real-time player, no
prebuffer). Requests run one after another.

    python benchmarks/tts/fresh_client_run.py --preset 0.6b --requests 20

Prints a table, writes benchmarks/tts/results/fresh_client_0.6b.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.harness import TEXTS, first_voice, pct, server  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = Path(a.out or ROOT / f"benchmarks/tts/results/fresh_client_{a.preset}.json")
    machine = machine_info()
    print_machine(machine)
    rows = []
    with tempfile.TemporaryDirectory() as td:
        ckpt, cache = Path(td) / "ckpt", Path(td) / "cache"
        env = dict(os.environ, OMNI_STREAM_CACHE_DIR=str(cache))
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "omni_stream.cli", "make-checkpoint", "--preset", a.preset,
                        "--seed", str(a.seed), "--out", str(ckpt)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        made_s = time.monotonic() - t0
        os.environ["OMNI_STREAM_CACHE_DIR"] = str(cache)
        t0 = time.monotonic()
        with server(str(ckpt), [], Path(td) / "serve.log") as url:
            ready_s = time.monotonic() - t0
            voice = first_voice(url)
            for i in range(a.requests):
                text = TEXTS[i % len(TEXTS)]
                cmd = [sys.executable, "-m", "clients.stream_client", "--url", url, "--text", text,
                       "--seed", str(i), "--max-new-tokens", str(a.max_new_tokens),
                       "--out", str(Path(td) / "a.wav"), "--json"]
                if voice:
                    cmd += ["--voice", voice]
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
                if r.returncode != 0:
                    raise SystemExit(f"client failed: {r.stderr[-2000:]}")
                fig = json.loads(r.stdout.strip().splitlines()[-1])
                fig["words"] = len(text.split())
                rows.append(fig)
                print(f"{i:3d} | TTFA {fig['ttfa_ms']:6.0f} ms | RTF {fig['rtf']:.2f} | underruns "
                      f"{fig['underruns']} | {fig['audio_s']:.1f} s audio | {fig['words']} words")
    ttfa = [r["ttfa_ms"] for r in rows]
    rtf = [r["rtf"] for r in rows]
    doc = dict(preset=a.preset, seed=a.seed, requests=len(rows), checkpoint_made_s=round(made_s, 1),
               server_ready_s=round(ready_s, 1), ttfa_ms_p50=statistics.median(ttfa),
               ttfa_ms_p95=pct(ttfa, 0.95), rtf_p50=statistics.median(rtf), rtf_max=max(rtf),
               underruns=sum(r["underruns"] for r in rows),
               streams_with_underruns=sum(1 for r in rows if r["underruns"]), machine=machine,
               rows=rows,
               command=" ".join(["python", "benchmarks/tts/fresh_client_run.py"]
                                + [shlex.quote(x) for x in sys.argv[1:]]))
    print_machine(machine)
    print(f"n = {len(rows)}: TTFA p50 {doc['ttfa_ms_p50']:.0f} ms (p95 {doc['ttfa_ms_p95']:.0f}), "
          f"RTF p50 {doc['rtf_p50']:.2f} (max {doc['rtf_max']:.2f}), underruns {doc['underruns']} "
          f"in {doc['streams_with_underruns']} streams; server ready {ready_s:.1f} s after launch "
          f"(cold: empty cache)")
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-step attribution of a 4-stream run: where each 80 ms frame goes, per process.

Starts ``omni-stream serve`` with OMNI_STREAM_STEP_STATS_DIR set, plays N concurrent streams,
stops the server (every process dumps its phase timings), then merges the dumps with
``omni-stream stats`` into one table (printed) and JSON. The critical-path phases of the talker
loop must add up to the measured frame time (``frame.total``) within 10%.

    python benchmarks/tts/attribution_run.py --model default --streams 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import TEXTS, server  # noqa: E402
from clients.stream_client import stream_speech  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--frames", type=int, default=60, help="max_new_tokens per stream")
    ap.add_argument("--server-args", default="--max-streams 4")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/attribution_4streams.json"))
    a = ap.parse_args()
    machine = machine_info()
    with tempfile.TemporaryDirectory() as d:
        os.environ["OMNI_STREAM_STEP_STATS_DIR"] = d
        os.environ["OMNI_STREAM_STEP_STATS_INTERVAL"] = "1"
        with server(a.model, a.server_args.split(), Path(d) / "server.log") as url:

            async def run():
                return await asyncio.gather(*[
                    stream_speech(url, TEXTS[i % len(TEXTS)], None, "english", seed=i,
                                  extra={"max_new_tokens": a.frames}) for i in range(a.streams)])

            res = asyncio.run(run())
        del os.environ["OMNI_STREAM_STEP_STATS_DIR"]
        print(f"{len(res)} streams, {sum(r.audio_s for r in res):.1f} s of audio")
        from omni_stream.observability.report import build_report, load_dumps, render

        rep = build_report(load_dumps(d))
        print_machine(machine)
        render(rep)
        rep["machine"] = machine
        rep["command"] = "python benchmarks/tts/attribution_run.py " + " ".join(sys.argv[1:])
        Path(a.out).write_text(json.dumps(rep, indent=1))
        print(f"wrote {a.out}")
        return 0 if rep["critical"]["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Overload: 4x more concurrent clients than the KV budget admits, for a fixed time.

Each client loops (bounded by ``--duration``): request a stream; on 429/503 wait Retry-After
(capped) and try again. Checks: no crash (the server answers /health at the end), no 5xx other
than 503 with Retry-After, every refusal carries Retry-After, every admitted stream completes
to the sample (a whole number of 1920-sample frames, <= max_new_tokens frames, no truncation).

    python benchmarks/tts/overload_test.py --model default --max-streams 2 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import TEXTS, server  # noqa: E402

SPF = 1920


async def client(url: str, cid: int, a, deadline: float, out: dict) -> None:
    i = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        while time.monotonic() < deadline:
            i += 1
            body = dict(input=TEXTS[(cid + i) % len(TEXTS)], language="english", response_format="pcm",
                        max_new_tokens=a.frames, seed=cid * 1000 + i)
            try:
                async with s.post(url + "/v1/audio/speech", json=body) as r:
                    if r.status == 200:
                        n = 0
                        async for chunk in r.content.iter_any():
                            n += len(chunk)
                        samples = n // 2
                        ok = n % 2 == 0 and samples % SPF == 0 and 0 < samples <= a.frames * SPF
                        out["completed" if ok else "bad_length"] += 1
                        out["audio_s"] += samples / 24000
                        continue
                    data = await r.read()
                    ra = r.headers.get("Retry-After")
                    key = f"status_{r.status}" + ("" if ra else "_no_retry_after")
                    out[key] += 1
                    if r.status not in (429, 503) or not ra:
                        out["errors"].append((r.status, data[:200].decode(errors="replace")))
                    await asyncio.sleep(min(float(ra or 1), a.max_backoff))
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                out["transport_errors"] += 1
                out["errors"].append((0, repr(e)[:200]))
                await asyncio.sleep(0.5)


async def run(url: str, a) -> dict:
    out: dict = collections.defaultdict(int)
    out["errors"] = []
    out["audio_s"] = 0.0
    deadline = time.monotonic() + a.duration
    await asyncio.gather(*[client(url, c, a, deadline, out) for c in range(a.clients)])
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health") as r:
            out["health_after"] = r.status
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    out["metrics_admission"] = [line for line in text.splitlines()
                                if line.startswith("omni_stream_backend_admission_")]
    return dict(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-streams", type=int, default=2, help="streams the budget admits")
    ap.add_argument("--clients", type=int, default=None, help="default: 4 x max-streams")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--max-queue", type=int, default=2)
    ap.add_argument("--queue-timeout", type=float, default=3.0)
    ap.add_argument("--max-backoff", type=float, default=2.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/overload_test.json"))
    a = ap.parse_args()
    a.clients = a.clients or 4 * a.max_streams
    machine = machine_info()
    args = ["--max-streams", str(a.max_streams), "--max-queue", str(a.max_queue),
            "--queue-timeout", str(a.queue_timeout), "--max-seq-len", "512"]
    with server(a.model, args, Path(a.out).with_suffix(".server.log")) as url:
        res = asyncio.run(run(url, a))
    refusals = sum(v for k, v in res.items() if k.startswith("status_"))
    ok = (res.get("health_after") == 200 and not res["errors"] and res.get("bad_length", 0) == 0
          and res.get("transport_errors", 0) == 0 and res.get("completed", 0) > 0)
    print_machine(machine)
    print(f"{a.clients} clients vs {a.max_streams} admitted streams for {a.duration:.0f} s: "
          f"{res.get('completed', 0)} streams completed to the sample ({res['audio_s']:.1f} s audio), "
          f"{refusals} refusals ({', '.join(f'{k}={v}' for k, v in res.items() if k.startswith('status_'))}), "
          f"errors {len(res['errors'])}, health after {res.get('health_after')}")
    print("PASS" if ok else "FAIL")
    Path(a.out).write_text(json.dumps(dict(settings=vars(a), result=res, passed=ok, machine=machine,
                                           command="python benchmarks/tts/overload_test.py "
                                           + " ".join(sys.argv[1:])), indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

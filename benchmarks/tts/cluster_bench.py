"""The cluster entry (``omni-stream serve --ray``): what it costs and what replicas add.

Two measurements, each run side by side in one process on this machine:

1. **Entry overhead.** One replica behind the entry; the same seeded request is sent, one at a
   time and alternating, to the entry (Serve's proxy -> the replica's ASGI ingress -> its
   aiohttp server) and straight to that replica's aiohttp server (its address from the
   entry's /health). Same backend, same work: the difference is the entry's. TTFA p50/p95 of
   each (n = ``--samples`` each) and the median of the paired differences; and the floor
   under it: a request with no work through the entry and direct, and a Ray Serve app that
   answers at once, through Serve's proxy and under uvicorn alone.
2. **Aggregate real-time streams at 1 and 2 replicas.** For each replica count a fresh
   ``serve --ray local --replicas R --max-queue 0``; the capacity the replicas report
   (/health, summed) is offered as concurrent streams through the entry, in rounds until
   ``--samples`` streams were measured: admitted, refused, underruns (a player starting at the
   first byte), TTFA p50/p95, RTF p50/max. On one machine the replicas share its cores: the
   figure shows what routing and admission do, not what a second machine adds
   (docs/scaling.md has the plan for real nodes).

    python benchmarks/tts/cluster_bench.py                       # tiny random checkpoint
    python benchmarks/tts/cluster_bench.py --model DIR --frames 40

Prints tables under the machine header (bandwidth beside the figures) and writes JSON
(default benchmarks/tts/results/cluster_bench.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import free_port, pct  # noqa: E402
from clients.stream_client import ClientError, stream_speech  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest."


def health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except OSError:
        return {}


class Cluster:
    """``omni-stream serve --ray local`` in a subprocess of its own session."""

    def __init__(self, model: str, replicas: int, log: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = str(ROOT)
        self.log = log
        with open(log, "w") as f:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "omni_stream.cli", "serve", "--ray", "local",
                 "--replicas", str(replicas), "--model", model, "--port", str(self.port),
                 "--max-queue", "0", *extra],
                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 600:
            if self.p.poll() is not None:
                raise SystemExit(f"serve exited with {self.p.returncode}; see {log}")
            h = health(self.url)
            if h.get("replicas_up") == replicas:
                self.start_s = time.monotonic() - t0
                self.health = h
                return
            time.sleep(1)
        self.stop()
        raise SystemExit(f"{replicas} replicas did not come up; see {log}")

    def stop(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


async def one(url: str, seed: int, frames: int) -> dict:
    try:
        r = await stream_speech(url, TEXT, seed=seed, model="tts-1",
                                extra={"max_new_tokens": frames})
    except ClientError as e:
        status = getattr(e, "status", None)
        return {"ok": False, "error": str(e)[:200], "status": status}
    play = r.playback()
    return {"ok": True, "ttfa_s": r.ttfa_s, "rtf": r.rtf, "audio_s": r.audio_s,
            "underruns": play.underruns, "pcm_len": len(r.pcm)}


def overhead(model: str, samples: int, frames: int, workdir: Path) -> dict:
    c = Cluster(model, 1, workdir / "serve-overhead.log", [])
    try:
        direct_url = c.health["replicas"][0]["url"]

        async def plain(url: str) -> float:
            import aiohttp

            async with aiohttp.ClientSession() as s:
                t = time.perf_counter()
                async with s.get(url + "/v1/models") as r:
                    await r.read()
                    assert r.status == 200
                return (time.perf_counter() - t) * 1000

        async def run():
            rows = {"entry": [], "direct": [], "models_entry": [], "models_direct": []}
            for i in range(3):  # warm both paths
                await one(c.url, 1, frames)
                await one(direct_url, 1, frames)
            for i in range(samples):
                order = (("entry", c.url), ("direct", direct_url))
                for name, url in (order if i % 2 == 0 else order[::-1]):
                    rows[name].append(await one(url, 1, frames))
                    rows["models_" + name].append(await plain(url))
            return rows

        rows = asyncio.run(run())
    finally:
        c.stop()
    models = {k: rows.pop("models_" + k) for k in ("entry", "direct")}
    bad = [r for side in rows.values() for r in side if not r["ok"]]
    if bad:
        raise SystemExit(f"failed requests in the overhead run: {bad[:3]}")
    e = [r["ttfa_s"] * 1000 for r in rows["entry"]]
    d = [r["ttfa_s"] * 1000 for r in rows["direct"]]
    diffs = [a - b for a, b in zip(e, d)]
    same = len({r["pcm_len"] for side in rows.values() for r in side}) == 1
    return {"n": samples, "frames": frames, "entry_ttfa_ms_p50": pct(e, 0.5),
            "entry_ttfa_ms_p95": pct(e, 0.95), "direct_ttfa_ms_p50": pct(d, 0.5),
            "direct_ttfa_ms_p95": pct(d, 0.95), "added_ms_p50": pct(e, 0.5) - pct(d, 0.5),
            "paired_diff_ms_median": statistics.median(diffs), "same_length_audio": same,
            # a request with no work (GET /v1/models, new connection each): the path's own cost
            "models_ms_p50": {k: pct(v, 0.5) for k, v in models.items()},
            "start_s": round(c.start_s, 1)}


class _Trivial:
    """An ASGI app that answers at once: what Serve's proxy path costs by itself."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def serve_floor(samples: int) -> dict:
    """GET p50 through Ray Serve's proxy to a replica whose ASGI app answers at once, and the
    same app served by uvicorn alone (no Serve): Serve's own per-request cost on this
    machine, the floor under the entry's overhead."""
    import threading

    import aiohttp
    import ray
    import uvicorn
    from ray import serve

    @serve.ingress()
    class Floor:
        def __serve_build_asgi_app__(self):
            return _Trivial()

    port, bare_port = free_port(), free_port()
    ray.init(address="local", include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    server = uvicorn.Server(uvicorn.Config(_Trivial(), host="127.0.0.1", port=bare_port,
                                           log_level="error", lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(serve.deployment(Floor).options(ray_actor_options={"num_cpus": 0.5}).bind(),
                  name="floor", route_prefix="/")

        async def run():
            out = {"serve": [], "uvicorn": []}
            async with aiohttp.ClientSession() as s:
                for name, p in (("serve", port), ("uvicorn", bare_port)) * 2:
                    for i in range(samples):
                        t0 = time.perf_counter()
                        async with s.get(f"http://127.0.0.1:{p}/") as r:
                            await r.read()
                        out[name].append((time.perf_counter() - t0) * 1000)
            return out

        got = asyncio.run(run())
    finally:
        server.should_exit = True
        serve.shutdown()
        ray.shutdown()
    return {"n": 2 * samples, "serve_trivial_ms_p50": pct(got["serve"], 0.5),
            "uvicorn_trivial_ms_p50": pct(got["uvicorn"], 0.5)}


def aggregate(model: str, replicas: int, samples: int, frames: int, workdir: Path) -> dict:
    c = Cluster(model, replicas, workdir / f"serve-{replicas}.log", [])
    cap = int(c.health.get("capacity_streams") or 0)
    rows: list[dict] = []
    rounds = 0
    try:
        async def round_(k: int):
            return await asyncio.gather(*[one(c.url, 100 * k + i, frames) for i in range(cap)])

        while sum(r["ok"] for r in rows) < samples and rounds < 50 and cap > 0:
            rows += asyncio.run(round_(rounds))
            rounds += 1
        after = health(c.url)
    finally:
        c.stop()
    ok = [r for r in rows if r["ok"]]
    ttfa = [r["ttfa_s"] * 1000 for r in ok]
    rtf = [r["rtf"] for r in ok]
    return {"replicas": replicas, "capacity_streams": cap, "offered_per_round": cap,
            "rounds": rounds, "admitted": len(ok), "refused": len(rows) - len(ok),
            "statuses_refused": sorted({str(r.get("status") or r.get("error", ""))[:60]
                                        for r in rows if not r["ok"]}),
            "underrun_streams": sum(1 for r in ok if r["underruns"]),
            "ttfa_ms_p50": pct(ttfa, 0.5), "ttfa_ms_p95": pct(ttfa, 0.95),
            "rtf_p50": pct(rtf, 0.5), "rtf_max": max(rtf) if rtf else None,
            "rtf_estimate": c.health.get("rtf_estimate"),
            "per_replica": [{k: r.get(k) for k in ("replica", "capacity_streams",
                                                   "rtf_estimate", "bandwidth_gbs")}
                            for r in c.health.get("replicas", [])],
            "health_after": {k: after.get(k) for k in ("replicas_up", "capacity_streams")},
            "start_s": round(c.start_s, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: a tiny random "
                                                  "checkpoint written to a temp folder)")
    ap.add_argument("--samples", type=int, default=24, help="requests per side / streams")
    ap.add_argument("--frames", type=int, default=12, help="max_new_tokens per overhead request")
    ap.add_argument("--stream-frames", type=int, default=60,
                    help="max_new_tokens per stream in the aggregate runs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/cluster_bench.json"))
    a = ap.parse_args()
    if a.samples < 20:
        print("note: percentiles from fewer than 20 samples", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    model = a.model
    if model is None:
        from omni_stream.checkpoints.io import write_random_checkpoint

        model = str(write_random_checkpoint(work / "tiny", "tiny", "custom_voice", seed=0))
    m = machine_info()
    print_machine(m)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text)
        lines.append(text)

    ov = overhead(model, a.samples, a.frames, work)
    say(f"\nentry overhead, 1 replica, n={ov['n']} each, {ov['frames']} frames per request")
    say(f"{'path':<8}{'TTFA p50 ms':>13}{'TTFA p95 ms':>13}")
    say(f"{'direct':<8}{ov['direct_ttfa_ms_p50']:>13.1f}{ov['direct_ttfa_ms_p95']:>13.1f}")
    say(f"{'entry':<8}{ov['entry_ttfa_ms_p50']:>13.1f}{ov['entry_ttfa_ms_p95']:>13.1f}")
    say(f"added at p50: {ov['added_ms_p50']:.1f} ms; median paired difference "
          f"{ov['paired_diff_ms_median']:.1f} ms (target <= 5 ms)")
    say(f"GET /v1/models p50 (no work: the path's own cost): direct "
        f"{ov['models_ms_p50']['direct']:.2f} ms, entry {ov['models_ms_p50']['entry']:.2f} ms")
    floor = serve_floor(a.samples)
    say(f"Ray Serve alone, an app that answers at once (n={floor['n']} each): through Serve's "
        f"proxy {floor['serve_trivial_ms_p50']:.2f} ms, uvicorn alone "
        f"{floor['uvicorn_trivial_ms_p50']:.2f} ms p50")
    agg = [aggregate(model, r, a.samples, a.stream_frames, work) for r in (1, 2)]
    say(f"\naggregate at the reported capacity ({a.stream_frames} frames per stream; the "
          "replicas share this machine's cores)")
    say(f"{'replicas':>8}{'capacity':>10}{'admitted':>10}{'refused':>9}{'underrun':>10}"
          f"{'TTFA p50':>10}{'TTFA p95':>10}{'RTF p50':>9}{'RTF max':>9}")
    for r in agg:
        say(f"{r['replicas']:>8}{r['capacity_streams']:>10}{r['admitted']:>10}"
              f"{r['refused']:>9}{r['underrun_streams']:>10}{r['ttfa_ms_p50']:>10.1f}"
              f"{r['ttfa_ms_p95']:>10.1f}{r['rtf_p50']:>9.3f}{(r['rtf_max'] or 0):>9.3f}")
    out = {"machine": m, "model": model if a.model else "tiny random (custom_voice, seed 0)",
           "overhead": ov, "serve_floor": floor, "aggregate": agg,
           "target": {"entry_added_ttfa_ms_p50_at_most": 5.0,
                      "met": ov["added_ms_p50"] <= 5.0}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    md = Path(a.out).with_suffix(".md")
    md.write_text("# cluster_bench\n\n" + f"machine: {m.get('label')}; 1 thread "
                  f"{m.get('bandwidth_gbs_1_thread')} GB/s\n\n```\n" + "\n".join(lines).strip()
                  + "\n```\n")
    print(f"\nwrote {a.out} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

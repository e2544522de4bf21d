"""Soak: many sampled streams through a real server, with disconnects and one stage kill.

Starts ``omni-stream serve`` on ``--model`` and runs ``--streams`` sampled requests (default
settings: no seed, no max_new_tokens, so the frame cap follows the text) at ``--concurrency``,
mixing three client kinds: SSE pcm, WebSocket pcm, and WebSocket codec frames (whose codes are
checked here, independently of the server's own checks). A share of clients
(``--disconnect-share``) hang up mid-stream; once ``--kill-at`` of the streams have started,
one stage process is killed with SIGKILL (``--kill-stage``). Requests refused while the
pipeline restarts (503) are retried after Retry-After. At the end:

- every stream is complete to the sample (samples = output_tokens x 1920, codes = output_tokens
  rows), deliberately cut, or was in flight when the stage died; anything else is a failure;
- no code outside the codebook reached a client, and the server failed no stream for one;
- stage restarts = the injected one; slots, queue and active streams back to idle; the server
  holds as many shared-memory segments at the end as while it ran, and none outlives it;
- the p99 gap between chunks and the underruns of a real-time player, over the complete streams.

    python benchmarks/tts/soak.py --frames 100000          # the default model
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import re
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import pct, server  # noqa: E402
from clients.playback import simulate_playback  # noqa: E402

SPF = 1920
WORDS = ("the quick brown fox jumps over a lazy dog while streaming speech keeps flowing "
         "numbers like 42 and 1999 appear now and then, questions too? yes! some sentences are "
         "short; others run on for a while before they stop").split()


@dataclass
class Outcome:
    kind: str  # sse | ws_pcm | ws_codes
    t_start: float
    t_end: float = 0.0
    status: str = "pending"  # complete | incomplete | disconnected | error | rejected
    frames: int = 0  # frames received
    output_tokens: int | None = None
    finish_reason: str | None = None
    invalid_codes: int = 0
    error: str = ""
    retry_after: float = 1.0
    retries: int = 0
    arrivals: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)


def shm_segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r"^(omni_stream_backend_\w+) ([0-9.eE+-]+)$", text, re.M):
        out[m.group(1)[len("omni_stream_backend_"):]] = float(m.group(2))
    return out


def random_text(rng: random.Random) -> str:
    n = rng.choice([1, 2, 4, 8, 12, 20, 30])
    words = [rng.choice(WORDS) for _ in range(n)]
    return (" ".join(words).capitalize() + rng.choice([".", "!", "?"]))


async def sse_stream(s: aiohttp.ClientSession, url: str, text: str, o: Outcome,
                     cut_after: int | None) -> None:
    body = {"input": text, "response_format": "pcm", "stream_format": "sse"}
    async with s.post(url + "/v1/audio/speech", json=body) as r:
        if r.status != 200:
            o.status, o.error = ("rejected" if r.status in (429, 503) else "error"), await r.text()
            o.retry_after = float(r.headers.get("Retry-After", "1"))
            return
        buf = b""
        async for piece in r.content.iter_any():
            buf += piece
            while b"\n\n" in buf:
                rec, buf = buf.split(b"\n\n", 1)
                ev = json.loads(rec[len(b"data: "):])
                if ev["type"] == "speech.audio.delta":
                    n = len(base64.b64decode(ev["audio"])) // 2
                    o.frames += n // SPF
                    o.arrivals.append(time.monotonic())
                    o.durations.append(n / 24000)
                    if cut_after is not None and len(o.arrivals) >= cut_after:
                        o.status = "disconnected"
                        return
                elif ev["type"] == "speech.audio.done":
                    o.output_tokens = ev["usage"]["output_tokens"]
                    o.finish_reason = ev.get("finish_reason")
                    o.status = "complete" if o.frames == o.output_tokens else "incomplete"
                    return
                elif ev["type"] == "error":
                    o.status, o.error = "error", ev["error"]["message"]
                    return
    o.status, o.error = "error", "response ended without speech.audio.done"


async def ws_stream(s: aiohttp.ClientSession, url: str, text: str, o: Outcome,
                    cut_after: int | None, codes: bool) -> None:
    try:
        ws = await s.ws_connect(url + "/v1/audio/speech/stream")
    except aiohttp.WSServerHandshakeError as e:
        o.status = "rejected" if e.status in (429, 503) else "error"
        o.error = str(e)
        return
    async with ws:
        await ws.send_json({"type": "session.config", "codec_frames": codes,
                            "split_sentences": False})
        await ws.send_json({"type": "input.text", "text": text})
        await ws.send_json({"type": "session.close"})
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                if codes:
                    import numpy as np

                    c = np.frombuffer(msg.data, dtype="<i8").reshape(-1, 16)
                    o.invalid_codes += int(((c < 0) | (c >= 2048)).sum())
                    n = len(c)
                else:
                    n = len(msg.data) // 2 // SPF
                o.frames += n
                o.arrivals.append(time.monotonic())
                o.durations.append(n * SPF / 24000)
                if cut_after is not None and len(o.arrivals) >= cut_after:
                    o.status = "disconnected"
                    return
            elif msg.type == aiohttp.WSMsgType.TEXT:
                ev = json.loads(msg.data)
                if ev["type"] == "audio.done":
                    o.output_tokens = ev["usage"]["output_tokens"]
                    o.finish_reason = ev.get("finish_reason")
                    o.status = "complete" if o.frames == o.output_tokens else "incomplete"
                elif ev["type"] == "error":
                    err = ev["error"]
                    o.status = "rejected" if err.get("code") in ("unavailable", "server_busy",
                                                                 "queue_timeout") else "error"
                    o.error = err["message"]
                elif ev["type"] == "session.done":
                    break
    if o.status == "pending":
        o.status, o.error = "error", "socket closed before audio.done"


async def run(url: str, a, kill) -> list[Outcome]:
    rng = random.Random(a.seed)
    sem = asyncio.Semaphore(a.concurrency)
    outcomes: list[Outcome] = []
    started = 0
    kinds = ("sse", "ws_pcm", "ws_codes")

    async def one(i: int) -> None:
        nonlocal started
        text = random_text(rng)
        kind = kinds[i % 3]
        cut = rng.randint(1, 6) if rng.random() < a.disconnect_share else None
        async with sem:
            started += 1
            if started == int(a.kill_at * a.streams):
                kill()
            for attempt in range(30):
                o = Outcome(kind, time.monotonic())
                try:
                    async with aiohttp.ClientSession(
                            timeout=aiohttp.ClientTimeout(total=a.timeout)) as s:
                        if kind == "sse":
                            await sse_stream(s, url, text, o, cut)
                        else:
                            await ws_stream(s, url, text, o, cut, codes=kind == "ws_codes")
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    o.status, o.error = "error", f"{type(e).__name__}: {e}"
                o.t_end = time.monotonic()
                if o.status != "rejected":
                    break
                await asyncio.sleep(min(5.0, max(1.0, o.retry_after)))
            o.retries = attempt
            outcomes.append(o)

    await asyncio.gather(*[one(i) for i in range(a.streams)])
    return outcomes


def server_pid(stage_pid: int) -> int:
    """The parent of a stage process: the server, which owns the shared-memory segments."""
    stat = Path(f"/proc/{stage_pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def owned(names: set[str], pid: int) -> set[str]:
    """This server's segments (named omni-stream-<owner pid>-...), whatever else runs."""
    return {n for n in names if n.startswith(f"omni-stream-{pid}-")}


def stage_pids(log: Path) -> dict[str, int]:
    m = re.findall(r"pipeline ready \(talker pid (\d+), codec pid (\d+)\)", log.read_text())
    if not m:
        raise SystemExit(f"no 'pipeline ready' line in {log}")
    talker, codec = m[-1]
    return {"talker": int(talker), "codec": int(codec)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--frames", type=int, default=100_000, help="stop once this many frames have "
                    "been received (estimated up front from a first batch)")
    ap.add_argument("--streams", type=int, default=0, help="number of streams (0: from --frames)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--kill-at", type=float, default=0.4, help="kill a stage once this share of "
                    "the streams have started")
    ap.add_argument("--kill-stage", choices=("talker", "codec"), default="codec")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/soak.json"))
    a = ap.parse_args()
    if not a.streams:  # ~ 40 + 12 x tokens frames per stream, ~1.4 tokens a word
        rng = random.Random(a.seed)
        mean = sum(40 + 12 * 1.4 * len(random_text(rng).split()) for _ in range(2000)) / 2000
        a.streams = int(a.frames / mean / (1 - a.disconnect_share) * 1.05) + 1
    log = Path(a.out).with_suffix(".server.log")
    machine = machine_info()
    t0 = time.monotonic()
    kill_info: dict = {}
    with server(a.model, a.server_args.split(), log) as url:
        spid = server_pid(stage_pids(log)["talker"])
        shm_running = owned(shm_segments(), spid)
        before = metrics(url)

        def kill() -> None:
            pid = stage_pids(log)[a.kill_stage]
            os.kill(pid, signal.SIGKILL)
            kill_info.update(stage=a.kill_stage, pid=pid, t=time.monotonic())
            print(f"killed the {a.kill_stage} stage (pid {pid})", flush=True)

        outcomes = asyncio.run(run(url, a, kill))
        for _ in range(100):  # cancellations settle within a few frames
            after = metrics(url)
            if after.get("active_streams") == 0 and after.get("slots_free") == after.get("slots_total"):
                break
            time.sleep(0.1)
        shm_idle = owned(shm_segments(), spid)
    time.sleep(1.0)
    shm_after = owned(shm_segments(), spid)
    wall = time.monotonic() - t0

    kt = kill_info.get("t", float("inf"))
    restart_s = 30.0  # streams refused or aborted within this window of the kill are its doing
    killed = [o for o in outcomes if o.status == "error" and o.t_start <= kt + restart_s
              and o.t_end >= kt]
    failed = [o for o in outcomes if o.status in ("error", "incomplete", "rejected")
              and o not in killed]
    complete = [o for o in outcomes if o.status == "complete"]
    gaps = [b - x for o in complete for x, b in zip(o.arrivals, o.arrivals[1:])]
    underruns = sum(simulate_playback(o.arrivals, o.durations, 0.0).underruns for o in complete)
    frames = sum(o.frames for o in outcomes)
    res = dict(
        model=a.model, streams=len(outcomes), concurrency=a.concurrency, frames=frames,
        audio_hours=frames * 0.08 / 3600, wall_s=wall,
        complete=len(complete), disconnected=sum(o.status == "disconnected" for o in outcomes),
        failed_by_kill=len(killed), failed_other=len(failed),
        finish_length=sum(o.finish_reason == "length" for o in complete),
        finish_stop=sum(o.finish_reason == "stop" for o in complete),
        retried_after_503=sum(o.retries > 0 for o in outcomes),
        invalid_codes_client=sum(o.invalid_codes for o in outcomes),
        codes_frames_checked=sum(o.frames for o in outcomes if o.kind == "ws_codes"),
        streams_failed_invalid_code_server=after.get("streams_failed_invalid_code", 0.0)
        - before.get("streams_failed_invalid_code", 0.0),
        stage_restarts=after.get("stage_restarts", 0.0), injected_kills=1 if kill_info else 0,
        stage_deaths_not_injected=after.get("stage_restarts", 0.0) - (1 if kill_info else 0),
        slots_free_end=after.get("slots_free"), slots_total=after.get("slots_total"),
        active_streams_end=after.get("active_streams"), queue_depth_end=after.get("queue_depth"),
        # a restart replaces the rings (new names): compare how many the server holds
        shm_segments_running=len(shm_running), shm_segments_idle_end=len(shm_idle),
        shm_while_idle_equals_running=len(shm_idle) == len(shm_running),
        shm_leaked_after_exit=sorted(shm_after),
        gap_ms_p50=pct(gaps, 0.5) * 1e3, gap_ms_p99=pct(gaps, 0.99) * 1e3, gap_n=len(gaps),
        underruns_complete=underruns, kill=kill_info and {k: v for k, v in kill_info.items() if k != "t"},
        failures=[{"kind": o.kind, "status": o.status, "error": o.error[:300]} for o in failed][:20],
        settings=vars(a), machine=machine, command="python benchmarks/tts/soak.py " + " ".join(sys.argv[1:]))
    ok = (res["failed_other"] == 0 and res["invalid_codes_client"] == 0
          and res["streams_failed_invalid_code_server"] == 0
          and res["stage_deaths_not_injected"] == 0 and res["slots_free_end"] == res["slots_total"]
          and res["active_streams_end"] == 0 and not res["shm_leaked_after_exit"]
          and res["shm_while_idle_equals_running"] and frames >= a.frames)
    res["pass"] = ok
    print()
    print_machine(machine)
    print(f"{'streams':>8} {'frames':>8} {'complete':>8} {'cut':>5} {'killed':>6} {'failed':>6} "
          f"{'invalid':>7} {'deaths':>6} {'slots':>7} {'shm leak':>8} {'gap p99 ms':>10}")
    print(f"{res['streams']:8d} {frames:8d} {res['complete']:8d} {res['disconnected']:5d} "
          f"{res['failed_by_kill']:6d} {res['failed_other']:6d} {res['invalid_codes_client']:7d} "
          f"{res['stage_deaths_not_injected']:6.0f} {res['slots_free_end']:.0f}/{res['slots_total']:.0f}"
          f" {len(res['shm_leaked_after_exit']):8d} {res['gap_ms_p99']:10.0f} (n={len(gaps)})")
    print(f"{'pass' if ok else 'FAIL'}; {res['audio_hours']:.2f} h of audio in {wall / 60:.1f} min")
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

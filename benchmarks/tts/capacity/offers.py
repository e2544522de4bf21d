"""The capacity benchmark's requests: one streaming request's outcome (admitted, refused with
its status and Retry-After, another status, a transport error or a broken stream), rounds of
them, /health, and waiting for the server to be idle between rounds.

stream_speech opens its own aiohttp session and reports a non-200 answer only as
ClientError("server answered N: <message>"): the headers are gone. Inside ``response_headers()``
every aiohttp session gets one trace hook that copies the status and Retry-After of each
response into the record of the asyncio task that sent it (a context variable).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import re
import time
import urllib.request

from benchmarks.tts.harness import SAMPLES_PER_FRAME, TEXTS
from clients.stream_client import ClientError, stream_speech

REFUSAL = (429, 503)
HEALTH_KEYS = ("capacity_streams", "rtf_estimate", "realtime", "contention", "bandwidth_gbs",
               "margin", "slots")
_ANSWERED = re.compile(r"server answered (\d{3}): ?(.*)", re.S)

_RECORD: contextvars.ContextVar[dict | None] = contextvars.ContextVar("capacity_bench_record",
                                                                      default=None)


async def _on_response(session, ctx, params) -> None:
    rec = _RECORD.get()
    if rec is not None:
        rec["status"] = params.response.status
        rec["retry_after"] = params.response.headers.get("Retry-After")


@contextlib.contextmanager
def response_headers():
    import aiohttp

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(_on_response)
    plain = aiohttp.ClientSession

    def session(*a, **kw):
        kw["trace_configs"] = [*(kw.get("trace_configs") or []), trace]
        return plain(*a, **kw)

    aiohttp.ClientSession = session
    try:
        yield
    finally:
        aiohttp.ClientSession = plain



async def offer(url: str, i: int, voice: str | None, args) -> dict:
    """One request: its outcome (admitted / refused / other_status / error) and figures."""
    rec: dict = dict(i=i, status=None, retry_after=None)
    _RECORD.set(rec)
    t0 = time.monotonic()
    try:
        res = await stream_speech(url, TEXTS[i % len(TEXTS)], voice, args.language, seed=i,
                                  extra={"max_new_tokens": args.frames}, timeout=args.timeout)
    except ClientError as e:
        msg = str(e)
        m = _ANSWERED.match(msg)
        if m and rec["status"] is None:
            rec["status"] = int(m.group(1))
        status = rec["status"]
        kind = ("error" if status in (None, 200) else "refused" if status in REFUSAL
                else "other_status")
        rec.update(outcome=kind, error=(m.group(2) if m else msg)[:300],
                   answered_ms=round((time.monotonic() - t0) * 1e3, 1))
        return rec
    pb = res.playback(args.prebuffer)
    whole = len(res.pcm) > 0 and len(res.pcm) % SAMPLES_PER_FRAME == 0
    rec.update(outcome="admitted" if whole else "error", ttfa_ms=round(res.ttfa_s * 1e3, 1),
               rtf=round(res.rtf, 4), audio_s=round(res.audio_s, 3), underruns=pb.underruns,
               underrun_s=round(pb.underrun_s, 3), max_gap_ms=round(pb.max_gap_s * 1e3, 1))
    if not whole:
        rec["error"] = (f"{len(res.pcm)} samples: not a whole number of {SAMPLES_PER_FRAME}-"
                        "sample frames")
    return rec


async def round_of(url: str, n: int, first: int, voice: str | None, args) -> list[dict]:
    return await asyncio.gather(*[offer(url, first + k, voice, args) for k in range(n)])


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def idle(url: str, wait_s: float = 10.0) -> bool:
    """Wait until the server runs no stream (its slots are back) before the next round."""
    from benchmarks.tts.soak import metrics

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        m = metrics(url)
        if m.get("active_streams", 0) == 0 and m.get("slots_free") == m.get("slots_total"):
            return True
        time.sleep(0.05)
    return False


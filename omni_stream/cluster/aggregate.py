"""/health, /metrics and /v1/stats for a whole cluster, gathered from every registered replica.

``GET /health``: 200 ``{"status": "ok", "replicas": [...], "capacity_streams": N, ...}`` while
at least one replica serves, else 503; per replica its id, node, pid, the address of its
server (reachable on the cluster's network: a direct line for debugging and benchmarks) and its
own /health body, or ``"status": "unreachable"``. Public, like a single server's.

``GET /metrics``: every replica's Prometheus text merged into one exposition, each sample
labelled ``replica="<id>"`` (one HELP/TYPE per family), plus ``omni_stream_cluster_replicas``
by state and ``omni_stream_cluster_capacity_streams``. The API key is checked as a single
server checks it: the request is first put to this replica's own /metrics, and a refusal is
returned as it is.

``GET /v1/stats`` (the dashboard's figures, ``server.dashboard``): every replica's own answer
merged by ``server.dashboard.merge_stats`` (capacity and streams add up, the parts are averaged
over the replicas' frame steps), each replica's kept under ``replicas``. The key is checked as
for /metrics.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp

from omni_stream.server.dashboard import STATS_PATH, merge_stats
from omni_stream.server.metrics import CONTENT_TYPE

PEER_TIMEOUT_S = 3.0  # how long a replica waits for a peer's /health, /metrics or stats

# name, labels, " value [timestamp]" (a value: a float, NaN or +/-Inf)
_LABELS = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?"
                     r"(\s+(?:[-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|Inf)|NaN)(?:\s+-?[0-9]+)?\s*)$")


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def label_sample(line: str, name: str, value: str) -> str:
    """A Prometheus sample line with ``name="value"`` added to its labels."""
    m = _LABELS.match(line)
    if m is None:
        return line
    metric, labels, rest = m.group(1), m.group(2), m.group(3)
    extra = f'{name}="{_escape(value)}"'
    if labels and labels != "{}":
        return f"{metric}{{{extra},{labels[1:]}{rest}"
    return f"{metric}{{{extra}}}{rest}"


def merge_expositions(texts: list[tuple[str, str]], label: str = "replica") -> str:
    """Prometheus text expositions -> one, every sample labelled with its source. Families keep
    the order they are first seen in; each has one HELP and one TYPE line."""
    order: list[str] = []
    meta: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for source, text in texts:
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                fam = line.split(" ", 3)[2]
                if fam not in meta:
                    meta[fam] = []
                    samples[fam] = []
                    order.append(fam)
                kinds = {m.split(" ", 2)[1] for m in meta[fam]}
                if line.split(" ", 2)[1] not in kinds:
                    meta[fam].append(line)
                family = fam
                continue
            if line.startswith("#"):
                continue
            if family is None:  # samples with no TYPE line: their own family
                family = line.split("{", 1)[0].split(" ", 1)[0]
                if family not in samples:
                    meta[family], samples[family] = [], []
                    order.append(family)
            samples[family].append(label_sample(line, label, source))
    out: list[str] = []
    for fam in order:
        out.extend(meta[fam])
        out.extend(samples[fam])
    return "\n".join(out) + "\n"


async def _fetch(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                 timeout: float) -> tuple[int, bytes] | None:
    try:
        async with session.get(url, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


def _auth(scope: dict[str, Any]) -> dict[str, str]:
    for k, v in scope.get("headers", ()):
        if k.lower() == b"authorization":
            return {"Authorization": v.decode("latin-1")}
    return {}


async def _respond(send, status: int, body: bytes, content_type: str,
                   extra: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The cluster's /health fields from its replicas' rows: the single server's capacity
    fields over the replicas that serve (streams and slots add up; the RTF is the slowest
    replica's; real time when every one is)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    out: dict[str, Any] = {"status": "ok" if ok else "unavailable", "replicas_up": len(ok),
                           "capacity_streams": sum(int(r.get("capacity_streams") or 0)
                                                   for r in ok),
                           "slots": sum(int(r.get("slots") or 0) for r in ok)}
    rtfs = [float(r["rtf_estimate"]) for r in ok if r.get("rtf_estimate") is not None]
    if rtfs:
        out["rtf_estimate"] = max(rtfs)
    if any("realtime" in r for r in ok):
        out["realtime"] = all(bool(r.get("realtime")) for r in ok)
    return out


async def cluster_health(replica, scope, receive, send) -> None:

    peers = await replica.peers()
    session = replica.forward.session()
    got = await asyncio.gather(*[_fetch(session, p["url"] + "/health", {}, PEER_TIMEOUT_S)
                                 for p in peers])
    rows, model = [], None
    for p, r in zip(peers, got):
        row: dict[str, Any] = {"replica": p["replica"], "node_ip": p.get("node_ip"),
                               "pid": p.get("pid"), "url": p.get("url")}
        if r is None:
            row["status"] = "unreachable"
        else:
            try:
                body = json.loads(r[1])
            except ValueError:
                body = {"status": "unavailable"}
            row.update(body)
            if r[0] != 200:
                row["status"] = body.get("status") or "unavailable"
            elif row.get("status") == "ok":
                model = model or body.get("model")
        rows.append(row)
    body = {**summarise(rows), "model": model, "replicas": rows}
    up = body["replicas_up"]
    await _respond(send, 200 if up else 503, json.dumps(body).encode(), "application/json",
                   replica.forward.extra)


async def cluster_metrics(replica, scope, receive, send) -> None:

    headers = _auth(scope)
    session = replica.forward.session()
    own = await _fetch(session, replica.url + "/metrics", headers, PEER_TIMEOUT_S)
    if own is None or own[0] != 200:  # a refused key (401) or a broken replica: as it is
        status, body = own if own is not None else (503, b'{"error": {"message": '
                                                          b'"metrics unavailable"}}')
        await _respond(send, status, body, "application/json", replica.forward.extra)
        return
    peers = await replica.peers()
    others = [p for p in peers if p["replica"] != replica.replica_id]
    got = await asyncio.gather(*[_fetch(session, p["url"] + "/metrics", headers, PEER_TIMEOUT_S)
                                 for p in others])
    texts = [(replica.replica_id, own[1].decode())]
    down = 0
    for p, r in zip(others, got):
        if r is None or r[0] != 200:
            down += 1
        else:
            texts.append((p["replica"], r[1].decode()))
    cap = 0
    for _, text in texts:
        m = re.search(r"^omni_stream_backend_capacity_streams(?:\{[^}]*\})? (\S+)$", text, re.M)
        if m:
            cap += int(float(m.group(1)))
    head = ("# HELP omni_stream_cluster_replicas Replicas registered, by whether their /metrics "
            "answered\n# TYPE omni_stream_cluster_replicas gauge\n"
            f'omni_stream_cluster_replicas{{state="up"}} {len(texts)}\n'
            f'omni_stream_cluster_replicas{{state="unreachable"}} {down}\n'
            "# HELP omni_stream_cluster_capacity_streams Real-time streams the answering "
            "replicas can run at once\n# TYPE omni_stream_cluster_capacity_streams gauge\n"
            f"omni_stream_cluster_capacity_streams {cap}\n")
    await _respond(send, 200, (head + merge_expositions(texts)).encode(), CONTENT_TYPE,
                   replica.forward.extra)


async def cluster_stats(replica, scope, receive, send) -> None:

    headers = _auth(scope)
    session = replica.forward.session()
    own = await _fetch(session, replica.url + STATS_PATH, headers, PEER_TIMEOUT_S)
    if own is None or own[0] != 200:  # a refused key (401) or a broken replica: as it is
        status, body = own if own is not None else (503, b'{"error": {"message": '
                                                          b'"stats unavailable"}}')
        await _respond(send, status, body, "application/json", replica.forward.extra)
        return
    others = [p for p in await replica.peers() if p["replica"] != replica.replica_id]
    got = await asyncio.gather(*[_fetch(session, p["url"] + STATS_PATH, headers, PEER_TIMEOUT_S)
                                 for p in others])
    rows: list[tuple[str, dict[str, Any] | None]] = [(replica.replica_id, json.loads(own[1]))]
    for p, r in zip(others, got):
        body = None
        if r is not None and r[0] == 200:
            try:
                body = json.loads(r[1])
            except ValueError:
                pass
        rows.append((p["replica"], body))
    await _respond(send, 200, json.dumps(merge_stats(rows)).encode(), "application/json",
                   replica.forward.extra)

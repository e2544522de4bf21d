"""omni-stream on a Ray Serve cluster (omni_stream/cluster): the router, autoscaling policy,
metrics merge and entry middleware as units; then real pipelines on the tiny model behind the
entry of a local two-node Ray cluster: the CLI's whole life, a seeded request equal to a single
server's, a voice uploaded through the entry on every replica, overload across replicas, and a
replica killed mid-stream. The server's API cases run against the entry in test_server*.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("ray.serve")

from omni_stream.cluster.aggregate import label_sample, merge_expositions, summarise  # noqa: E402
from omni_stream.cluster.autoscale import CapacityPolicy, desired_replicas  # noqa: E402
from omni_stream.cluster.entry import EntryMiddleware  # noqa: E402
from omni_stream.cluster.launch import cluster_flags_valid  # noqa: E402
from omni_stream.cluster.router import PROVISIONAL_S, InFlight, free_capacity, rank  # noqa: E402
from omni_stream.server.testing import run_async  # noqa: E402
from cluster_harness import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(900)

REPLICA = "x-omni-stream-replica"
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away."
REF_TEXT = "A short reference sentence for the cloned voice."
QUEUE = 8  # requests a replica of the tiny Base deployment queues


# ------------------------------------------------------------------ router and autoscaling
def test_free_capacity_edges():
    assert free_capacity({"capacity_streams": 4, "streams_held": 1}, 0) == (3.0, 1)
    assert free_capacity({"capacity_streams": 4, "streams_held": 1}, 3) == (1.0, 3)  # own count
    assert free_capacity({"capacity_streams": 4, "streams_held": 6}, None) == (-2.0, 6)
    assert free_capacity({}, None) == (1.0, 0)  # not reporting yet: one stream
    assert free_capacity(None, 2) == (-1.0, 2)
    assert free_capacity({"capacity_streams": 0}, 0) == (0.0, 0)
    assert free_capacity({"capacity_streams": 8, "healthy": False}, 0)[0] == float("-inf")


def test_rank_most_free_first_then_fewest_held_then_given_order():
    stats = {"a": {"capacity_streams": 4, "streams_held": 3},
             "b": {"capacity_streams": 8, "streams_held": 2},
             "c": {"capacity_streams": 4, "streams_held": 0, "healthy": False},
             "d": {"capacity_streams": 2, "streams_held": 1},
             "e": {"capacity_streams": 3, "streams_held": 2}}
    order = [r[0] for r in rank(list(stats), stats.get, lambda r: 0)]
    assert order == ["b", "d", "e", "a", "c"]  # d, e, a: 1 free each, fewest held first
    assert all(len(r) == 1 for r in rank(list(stats), stats.get, lambda r: 0))
    # requests in flight that the stats do not show yet count
    order = [r[0] for r in rank(["a", "b"], stats.get, {"b": 7, "a": 0}.get)]
    assert order == ["a", "b"]
    assert rank([], stats.get, lambda r: 0) == []


def test_in_flight_counts_ranked_routed_completed_and_forgets_unsent():
    now = [0.0]
    f = InFlight(clock=lambda: now[0])
    f.ranked("r1", "A")
    f.ranked("r2", "A")
    assert f.counts() == {"A": 2}
    f.routed("r2", "B")  # Serve sent it elsewhere after all
    assert f.counts() == {"A": 1, "B": 1}
    now[0] = PROVISIONAL_S + 1  # r1 never sent: forgotten; r2 was sent: kept
    assert f.counts() == {"B": 1}
    f.completed("r2")
    f.completed("r2")  # twice is harmless
    assert f.counts() == {}
    f.routed("r3", "C")
    f.drop_replica("C")
    assert f.counts() == {}


def test_desired_replicas_from_capacity_in_use():
    assert desired_replicas({"a": 4, "b": 4}, {"a": 4, "b": 4}, 2, 8, 0.8) == pytest.approx(2.5)
    assert desired_replicas({"a": 1}, {"a": 4}, 1, 1, 1.0) == pytest.approx(0.25)
    assert desired_replicas({}, {}, 0, 0, 0.8) == 0.0  # nothing held, nothing running
    assert desired_replicas({}, {}, 1, 3, 0.5) == pytest.approx(6.0)  # before reports: ongoing
    assert desired_replicas({"a": 2}, {"a": 0}, 1, 2, 1.0) == pytest.approx(2.0)  # cap 0: 1

    class Ctx:
        aggregated_metrics = {"streams_held": {"a": 6}, "capacity_streams": {"a": 4}}
        current_num_replicas = 1
        total_num_requests = 6

    want, state = CapacityPolicy(target_utilisation=0.75)(Ctx())
    assert want == pytest.approx(2.0) and state == {}
    for bad in (0, -1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            CapacityPolicy(target_utilisation=bad)


# ------------------------------------------------------------------ /health and /metrics
def test_metrics_merge_labels_every_sample_once_per_family():
    a = ("# HELP m_total Things\n# TYPE m_total counter\nm_total{k=\"x\"} 1.0\nm_total 2.0\n"
         "# HELP g A gauge\n# TYPE g gauge\ng 3.0\n")
    b = "# HELP m_total Things\n# TYPE m_total counter\nm_total{k=\"y\"} 5.0\nbare 1\n"
    out = merge_expositions([("r1", a), ("r\"2", b)])
    lines = out.splitlines()
    assert lines.count("# HELP m_total Things") == 1 and lines.count("# TYPE m_total counter") == 1
    assert 'm_total{replica="r1",k="x"} 1.0' in lines
    assert 'm_total{replica="r1"} 2.0' in lines
    assert 'm_total{replica="r\\"2",k="y"} 5.0' in lines  # label values escaped
    assert 'g{replica="r1"} 3.0' in lines and 'bare{replica="r\\"2"} 1' in lines
    # one family's samples stay together under its HELP/TYPE
    assert lines.index('m_total{replica="r\\"2",k="y"} 5.0') < lines.index("# HELP g A gauge")
    assert label_sample("x{} 1", "replica", "a") == 'x{replica="a"} 1'
    assert label_sample("not a sample line", "replica", "a") == "not a sample line"
    assert merge_expositions([]) == "\n"


def test_cluster_health_summary():
    rows = [{"status": "ok", "capacity_streams": 4, "slots": 4, "rtf_estimate": 0.2,
             "realtime": True},
            {"status": "ok", "capacity_streams": 2, "slots": 4, "rtf_estimate": 0.7,
             "realtime": True},
            {"status": "unreachable"}]
    s = summarise(rows)
    assert s == {"status": "ok", "replicas_up": 2, "capacity_streams": 6, "slots": 8,
                 "rtf_estimate": 0.7, "realtime": True}
    assert summarise(rows[2:]) == {"status": "unavailable", "replicas_up": 0,
                                   "capacity_streams": 0, "slots": 0}
    rows[1]["realtime"] = False
    assert summarise(rows)["realtime"] is False


# ------------------------------------------------------------------ flags
def _serve_args(*argv: str) -> argparse.Namespace:
    from omni_stream.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, fix", [
    (["--replicas", "2"], "need --ray"),
    (["--replica-gpus", "1"], "need --ray"),
    (["--ray", "local", "--replicas", "2", "--min-replicas", "1", "--max-replicas", "3"],
     "not both"),
    (["--ray", "local", "--min-replicas", "1"], "both --min-replicas and --max-replicas"),
    (["--ray", "local", "--replicas", "0"], ">= 1"),
    (["--ray", "local", "--min-replicas", "3", "--max-replicas", "2"], "<= --max-replicas"),
    (["--ray", "local", "--min-replicas", "0", "--max-replicas", "0"], ">= 1"),
    (["--ray", "local", "--target-utilisation", "0"], "(0, 1]"),
    (["--ray", "local", "--target-utilisation", "1.5"], "(0, 1]"),
    (["--ray", "local", "--upscale-delay", "-1"], ">= 0"),
    (["--ray", "local", "--replica-cpus", "0"], "> 0"),
])
def test_cluster_flags_that_do_not_fit_are_refused_naming_the_fix(argv, fix):
    with pytest.raises(ValueError) as e:
        cluster_flags_valid(_serve_args(*argv))
    assert fix in str(e.value), str(e.value)


def test_cluster_flags_that_fit():
    for argv in ([], ["--ray", "local"], ["--ray", "auto", "--replicas", "3"],
                 ["--ray", "h:6379", "--min-replicas", "0", "--max-replicas", "4",
                  "--target-utilisation", "1"]):
        cluster_flags_valid(_serve_args(*argv))


# ------------------------------------------------------------------ reaping a killed replica
_OWNER = """
import sys, time
from omni_stream.transport.shm import SegmentRegistry
reg = SegmentRegistry(shm_dir=sys.argv[1], handle_signals=False)
made = [reg.create("frames", 8192), reg.create("audio", 8192)]
print(reg.prefix, *[s.path for s in made], flush=True)
time.sleep(600)
"""
_STAGE = """
import mmap, sys, time
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 0)
print("mapped", flush=True)
time.sleep(600)
"""


def test_reap_kills_a_dead_replicas_stages_and_unlinks_only_its_segments(tmp_path):
    """``reap``: nothing while the owner lives; once it is dead (SIGKILL: no clean-up of its
    own), its recorded stage and any process still mapping its segments are killed and its
    segments unlinked, while another owner's segment, and a file named like the dead owner's
    but whose preamble names someone else, stay."""
    from omni_stream.cluster.reap import PipelineRecord, reap
    from omni_stream.transport.shm import SegmentRegistry, process_start_time

    shm = str(tmp_path)
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, shm], stdout=subprocess.PIPE,
                             text=True)
    procs = [owner]
    mine = SegmentRegistry(shm_dir=shm, handle_signals=False)
    try:
        prefix, *paths = owner.stdout.readline().split()
        stages = [subprocess.Popen([sys.executable, "-c", _STAGE, p], stdout=subprocess.PIPE,
                                   text=True) for p in paths]
        procs += stages
        assert [s.stdout.readline().strip() for s in stages] == ["mapped", "mapped"]
        kept = mine.create("audio", 8192).path  # a live owner's segment in the same folder
        forged = f"{shm}/{prefix}-audio-9"  # the dead owner's name, another owner's preamble
        Path(forged).write_bytes(Path(kept).read_bytes())
        os.chmod(forged, 0o600)
        rec = PipelineRecord("r1", "node", (owner.pid, process_start_time(owner.pid)),
                             ((stages[0].pid, process_start_time(stages[0].pid)),), prefix, shm)
        assert rec.has_token
        assert reap(rec).owner_alive  # the replica runs: nothing touched
        assert all(s.poll() is None for s in stages) and all(map(os.path.exists, paths))

        owner.kill()
        owner.wait()
        got = reap(rec, wait_s=5)
        assert not got.owner_alive
        # the recorded stage and the one found through its mapping
        assert sorted(got.killed) == sorted(s.pid for s in stages)
        assert [s.wait(10) for s in stages] == [-signal.SIGKILL] * 2
        assert sorted(got.unlinked) == sorted(paths)
        assert sorted(os.listdir(shm)) == sorted(os.path.basename(p) for p in (kept, forged))
        again = reap(rec)  # a second reap (the registry's and the entry's) finds nothing
        assert again.killed == () and again.unlinked == ()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        mine.close()
    with pytest.raises(ValueError, match="owner's pid"):
        PipelineRecord("r1", "node", (owner.pid + 1, None), (), prefix, shm)
    assert PipelineRecord("r1", "node", (7, None)).shm_prefix == "omni-stream-7"


# ------------------------------------------------------------------ entry middleware
def _asgi_call(app, scope, body: bytes = b"") -> tuple[dict, bytes]:
    sent: list[dict] = []

    async def receive():
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(msg):
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


SPEECH = {"type": "http", "method": "POST", "path": "/v1/audio/speech", "headers": []}


def test_entry_rewrites_the_proxys_own_errors_into_the_api_shape():
    async def busy(scope, receive, send):  # Serve's proxy past its queue (backpressure)
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"text/plain"), (b"retry-after", b"3")]})
        await send({"type": "http.response.body", "body": b"Request dropped", "more_body": False})

    start, body = _asgi_call(EntryMiddleware(busy), SPEECH, b"{}")
    err = json.loads(body)["error"]
    headers = dict(start["headers"])
    assert start["status"] == 429 and err["code"] == "server_busy"
    assert err["type"] == "rate_limit_error" and headers[b"retry-after"] == b"3"
    assert headers[b"content-type"] == b"application/json"

    async def nothing(scope, receive, send):  # the proxy has no application yet
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"not found"})

    start, body = _asgi_call(EntryMiddleware(nothing), SPEECH, b"{}")
    assert start["status"] == 503 and json.loads(body)["error"]["code"] == "no_replica_available"
    assert dict(start["headers"])[b"retry-after"] == b"5"


def test_entry_passes_a_replicas_response_through_even_an_error():
    async def replica(scope, receive, send):
        assert (await receive())["body"] == b'{"input": 1}'
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(REPLICA.encode(), b"r1")]})
        await send({"type": "http.response.body", "body": b'{"error": {}}', "more_body": False})

    start, body = _asgi_call(EntryMiddleware(replica), SPEECH, b'{"input": 1}')
    assert start["status"] == 400 and body == b'{"error": {}}'
    assert (b"x-omni-stream-entry", b"1") in start["headers"]


def test_entry_resends_a_request_whose_replica_died_before_answering():
    calls = []

    async def flaky(scope, receive, send):
        calls.append((await receive())["body"])
        if len(calls) == 1:
            return  # the replica died: the proxy sends nothing
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(REPLICA.encode(), b"r2")]})
        await send({"type": "http.response.body", "body": b"audio", "more_body": False})

    start, body = _asgi_call(EntryMiddleware(flaky), SPEECH, b'{"seed": 1}')
    assert calls == [b'{"seed": 1}', b'{"seed": 1}']  # the same body, twice
    assert start["status"] == 200 and body == b"audio"

    calls.clear()

    async def dead(scope, receive, send):
        calls.append(1)
        raise RuntimeError("actor died")

    start, body = _asgi_call(EntryMiddleware(dead), SPEECH, b"{}")
    assert len(calls) == 2 and start["status"] == 503
    assert json.loads(body)["error"]["code"] == "replica_unavailable"
    assert dict(start["headers"])[b"retry-after"] == b"1"

    calls.clear()  # an upload is not sent twice: it may have been stored
    upload = {"type": "http", "method": "POST", "path": "/v1/audio/voices", "headers": []}
    start, _ = _asgi_call(EntryMiddleware(dead), upload, b"x")
    assert len(calls) == 1 and start["status"] == 503


def test_entry_does_not_resend_a_stream_that_started():
    calls = []

    async def cut(scope, receive, send):
        calls.append(1)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(REPLICA.encode(), b"r1")]})
        await send({"type": "http.response.body", "body": b"half", "more_body": True})
        raise RuntimeError("actor died mid-stream")

    with pytest.raises(RuntimeError):
        _asgi_call(EntryMiddleware(cut), SPEECH, b"{}")
    assert calls == [1]


# ------------------------------------------------------------------ real pipelines
def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def _segments(pids: set[int], shm_dir: str = "/dev/shm") -> list[str]:
    return [n for n in os.listdir(shm_dir)
            if n.startswith("omni-stream-") and n.split("-")[2].isdigit()
            and int(n.split("-")[2]) in pids]


async def _speech(s, url, body, read_delay: float = 0.0) -> dict:
    out: dict = {}
    data = bytearray()
    try:
        async with s.post(url + "/v1/audio/speech", json=body) as r:
            out.update(status=r.status, replica=r.headers.get(REPLICA),
                       retry_after=r.headers.get("Retry-After"))
            async for chunk in r.content.iter_any():
                data += chunk
                if read_delay:
                    await asyncio.sleep(read_delay)
        out["result"] = "complete"
    except aiohttp.ClientPayloadError as e:
        out["result"] = f"aborted: {e}"
    out["body"] = bytes(data)
    return out


def _serve_cli(ck: Path, voice_dir: Path, **env_vars: str) -> tuple[subprocess.Popen, str]:
    """``omni-stream serve --ray local --replicas 2`` in a session of its own: the process and
    the entry's URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | env_vars
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_stream.cli", "serve", "--ray", "local", "--replicas", "2",
         "--model", str(ck), "--port", str(port), "--voice-dir", str(voice_dir),
         "--max-queue", "8", "--queue-timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait_cli_replicas(proc: subprocess.Popen, url: str, seen: set[int]) -> dict:
    """The entry's /health once both replicas serve and the CLI waits for a signal (``seen``
    collects the processes under the CLI meanwhile)."""
    import urllib.request

    for line in proc.stdout:  # printed once the application runs, before the wait
        seen |= _descendants(proc.pid)
        if line.startswith("omni-stream cluster entry:"):
            break
    else:
        raise AssertionError(f"serve ended before serving (exit status {proc.wait()})")
    deadline = time.monotonic() + 300
    health: dict = {}
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        seen |= _descendants(proc.pid)
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                health = json.loads(r.read())
            if health.get("replicas_up") == 2:
                break
        except OSError:
            pass
        time.sleep(1)
    assert health.get("replicas_up") == 2, health
    assert len({r["pid"] for r in health["replicas"]}) == 2
    return health


def _stop_cli(proc: subprocess.Popen, sig: int) -> str:
    """Send ``sig`` to the CLI and wait for its exit (its output)."""
    proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"serve did not stop on {signal.Signals(sig).name}:\n{out[-3000:]}")
    return out


def test_cli_serves_on_a_local_cluster_and_leaves_nothing_behind(ckpt_factory, tmp_path):
    """`omni-stream serve --ray local --replicas 2`: both replicas answer through one entry;
    SIGTERM ends it with no process and no shared-memory segment left."""
    ck = ckpt_factory("tiny", "custom_voice", 0)
    proc, url = _serve_cli(ck, tmp_path / "voices")
    seen: set[int] = set()
    try:
        health = _wait_cli_replicas(proc, url, seen)

        async def drive():
            # bursts until both replicas have served (a replica /health lists may join the
            # router's set a moment later, and one measured slower gets less at first)
            got: list[dict] = []
            async with aiohttp.ClientSession() as s:
                t0 = time.monotonic()
                while len({g["replica"] for g in got}) < 2 and time.monotonic() - t0 < 90:
                    got += await asyncio.gather(*[_speech(s, url, {
                        "input": TEXT, "voice": "ryan", "response_format": "pcm", "seed": 3,
                        "max_new_tokens": 24, "model": "tts-1"}) for _ in range(6)])
                async with s.get(url + "/metrics") as r:
                    metrics = await r.text()
                return got, metrics

        got, metrics = run_async(drive(), 300)
        assert all(g["status"] == 200 and g["result"] == "complete" for g in got), got
        assert len({g["replica"] for g in got}) == 2  # spread over both replicas
        assert len({g["body"] for g in got}) == 1  # seeded: the same audio on either
        assert 'omni_stream_cluster_replicas{state="up"} 2' in metrics
        for rid in {g["replica"] for g in got}:
            assert f'replica="{rid}"' in metrics
        seen |= _descendants(proc.pid)
        stage_pids = {p for p in seen if _segments({p})} | {r["pid"] for r in health["replicas"]}
        assert _segments(seen | stage_pids), "the replicas' pipelines own shared memory"
    finally:
        seen |= _descendants(proc.pid)
        out = _stop_cli(proc, signal.SIGTERM)
    assert proc.returncode == 0, out[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and [p for p in seen if _alive(p)]:
        time.sleep(0.5)
    assert not [p for p in seen if _alive(p)], "processes left behind"
    assert _segments(seen | {proc.pid}) == []


def test_cli_reaps_a_replica_killed_mid_stream_when_it_stops(ckpt_factory, tmp_path):
    """Issue 37's case: `serve --ray local --replicas 2`, one replica's process SIGKILLed while
    it streams, then the entry stopped with SIGINT: within 5 s of the entry's exit no stage
    process of the killed replica runs and no segment of the cluster is left. The entry (or
    the registry, if the replica's silence is noticed first) reaps what the killed replica left (its stages would notice their parent is gone
    only later). The checkpoint is moved away before the kill, so no replacement replica
    starts: one that did would sweep the dead replica's segments at its start, and the test
    would pass or fail with the race. The segments live in a folder of the test's own
    (OMNI_STREAM_SHM_DIR, which the replicas get): any omni-stream server started on this
    machine meanwhile sweeps dead owners' segments from /dev/shm at its start."""
    import shutil

    ck = Path(shutil.copytree(ckpt_factory("tiny", "custom_voice", 0), tmp_path / "model"))
    shm = tmp_path / "shm"
    shm.mkdir()
    proc, url = _serve_cli(ck, tmp_path / "voices", OMNI_STREAM_SHM_DIR=str(shm))
    seen: set[int] = set()
    try:
        health = _wait_cli_replicas(proc, url, seen)
        pids = {r["replica"]: r["pid"] for r in health["replicas"]}
        stages = {rid: _stage_pids(pid) for rid, pid in pids.items()}
        assert all(len(s) >= 2 for s in stages.values()), stages
        assert {int(n.split("-")[2]) for n in _segments(set(pids.values()), str(shm))} == \
            set(pids.values()), "each replica's rings are in the test's folder"

        def body(seed):  # long enough to be streaming when the replica is killed
            return {"input": TEXT * 4, "voice": "ryan", "response_format": "pcm",
                    "seed": seed, "max_new_tokens": 400, "model": "tts-1"}

        async def stream_and_kill():
            # streams until both replicas hold one; the first one's replica is killed once
            # its audio flows
            async with aiohttp.ClientSession() as s:
                responses = []
                try:
                    for seed in range(8):
                        r = await s.post(url + "/v1/audio/speech", json=body(seed))
                        assert r.status == 200, await r.text()
                        responses.append(r)
                        if len({r.headers[REPLICA] for r in responses}) == 2:
                            break
                    victim = responses[0].headers[REPLICA]
                    assert await responses[0].content.readany()
                    ck.rename(tmp_path / "model-gone")  # the replacement cannot start
                    os.kill(pids[victim], signal.SIGKILL)
                    return victim
                finally:
                    for r in responses:
                        r.close()

        victim = run_async(stream_and_kill(), 300)
        seen |= _descendants(proc.pid)
    finally:
        seen |= _descendants(proc.pid)
        out = _stop_cli(proc, signal.SIGINT)
    exited = time.monotonic()
    assert proc.returncode == 0, out[-3000:]
    owners = seen | set(pids.values()) | {proc.pid}
    left: tuple = ()
    while time.monotonic() - exited < 5.0:
        left = ([p for p in stages[victim] if _alive(p)], _segments({pids[victim]}, str(shm)),
                _segments(owners, str(shm)) + _segments(owners))
        if not any(left):
            break
        time.sleep(0.1)
    assert not any(left), (f"{time.monotonic() - exited:.1f} s after the entry's exit: "
                           f"stages {left[0]}, the killed replica's segments {left[1]}, the "
                           f"cluster's {left[2]}\n{out[-3000:]}")


def _upload(url: str, name: str, wav: bytes):
    async def go():
        form = aiohttp.FormData()
        form.add_field("audio", wav, filename="ref.wav", content_type="audio/wav")
        form.add_field("name", name)
        form.add_field("ref_text", REF_TEXT)
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/audio/voices",
                                                        data=form) as r:
            return r.status, await r.json()
    return go()


def _ref_wav(seconds: float = 2.5, sr: int = 24000) -> bytes:
    import io

    import numpy as np
    import soundfile as sf

    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sin(2 * np.pi * 140 * t) * np.clip(np.sin(2 * np.pi * 3 * t), 0, None)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def base_cluster(ray_cluster, ckpt_factory):
    """Two replicas of a tiny Base model (voice cloning) behind the entry."""
    ck = ckpt_factory("tiny", "base", 0)
    # a queue deep enough that the tests' bursts wait rather than being refused, whatever
    # capacity the replicas measure on a busy machine (the overload test goes past it)
    args = _serve_args("--model", str(ck), "--max-queue", str(QUEUE), "--queue-timeout", "600")
    args.model = str(ck)
    ray_cluster.deploy(replicas=2, args=args, streams=4, queue=QUEUE, force=True)
    return ray_cluster, args


def _spread(url: str, body: dict, n: int) -> list[dict]:
    """``n`` copies of one request at once (the router spreads them over the replicas)."""
    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*[_speech(s, url, body) for _ in range(n)])
    return run_async(go(), 600)


def test_voice_uploaded_through_the_entry_speaks_on_every_replica_and_equals_a_single_server(
        base_cluster):
    cluster, args = base_cluster
    url = cluster.url
    wav = _ref_wav()

    async def race():
        return await asyncio.gather(_upload(url, "Racer", wav), _upload(url, "racer", wav))

    got = run_async(race(), 120)
    assert sorted(g[0] for g in got) == [201, 409], got
    assert [g[1]["error"]["code"] for g in got if g[0] == 409] == ["voice_exists"]
    body = {"input": TEXT, "voice": "racer", "response_format": "pcm", "seed": 11,
            "max_new_tokens": 20, "model": "tts-1"}
    spoken = _spread(url, body, 6)
    assert all(g["status"] == 200 and g["result"] == "complete" for g in spoken), spoken
    assert len({g["replica"] for g in spoken}) == 2  # both replicas used the voice
    assert len({g["body"] for g in spoken}) == 1 and len(spoken[0]["body"]) > 0

    # a single server on the same checkpoint, flags and voice folder speaks the same audio
    from omni_stream.orchestrator.flags import pipeline_settings
    from omni_stream.orchestrator import PipelineBackend
    from omni_stream.server.settings import from_args
    from omni_stream.voices.store import VoiceStore

    settings, _, _ = pipeline_settings(args)

    from omni_stream.server.app import start_server

    async def single_speech():
        runner, u = await start_server(PipelineBackend(settings), "127.0.0.1", 0,
                                       from_args(args), VoiceStore(Path(cluster.voice_dir)))
        try:
            async with aiohttp.ClientSession() as s:
                return await _speech(s, u, body)
        finally:
            await runner.cleanup()

    direct = run_async(single_speech(), 300)
    assert direct["status"] == 200 and direct["body"] == spoken[0]["body"]

    # a delete through the entry removes it everywhere
    async def delete():
        async with aiohttp.ClientSession() as s, s.delete(url + "/v1/audio/voices/racer") as r:
            return r.status
    assert run_async(delete(), 60) in (200, 204)
    gone = _spread(url, body, 4)
    assert {g["status"] for g in gone} == {400}, [(g["status"], g["body"][:200]) for g in gone]
    assert len({g["replica"] for g in gone}) == 2


def test_overload_across_replicas_gets_429s_and_every_admitted_stream_completes(base_cluster):
    cluster, _ = base_cluster
    health = cluster.wait_replicas(2)
    slots = sum(r["slots"] for r in health["replicas"])
    offered = slots + 2 * QUEUE + 6  # past what the two replicas run and queue
    import base64

    body = {"input": TEXT, "response_format": "pcm", "seed": 2, "max_new_tokens": 16,
            "model": "tts-1", "x_vector_only": True,
            "ref_audio": "data:audio/wav;base64," + base64.b64encode(_ref_wav(1.5)).decode()}
    got = _spread(cluster.url, body, offered)
    statuses = [g["status"] for g in got]
    assert not [s for s in statuses if s >= 500], statuses  # no 5xx
    assert statuses.count(429) >= 6 and statuses.count(200) >= slots, statuses
    for g in got:
        if g["status"] == 429:
            err = json.loads(g["body"])["error"]
            assert err["code"] == "server_busy" and int(g["retry_after"]) >= 1
        else:
            assert g["result"] == "complete" and len(g["body"]) == 16 * 1920 * 2
    assert len({g["replica"] for g in got if g["status"] == 200}) == 2
    assert len({g["body"] for g in got if g["status"] == 200}) == 1  # seeded, bit-identical


def _stage_pids(replica_pid: int) -> list[int]:
    """The pipeline's stage processes of a replica (its spawned children)."""
    out = []
    for pid in _descendants(replica_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ppid == replica_pid and b"spawn_main" in cmd:
            out.append(pid)
    return out


def test_a_replica_whose_stage_died_is_routed_around_and_recovers(base_cluster):
    cluster, _ = base_cluster
    health = cluster.wait_replicas(2)
    sick = health["replicas"][0]
    stages = _stage_pids(sick["pid"])
    assert len(stages) >= 2, stages
    import base64
    ref = "data:audio/wav;base64," + base64.b64encode(_ref_wav(1.5)).decode()
    body = {"input": TEXT, "response_format": "pcm", "seed": 5, "model": "tts-1",
            "max_new_tokens": 16, "ref_audio": ref, "x_vector_only": True}
    os.kill(stages[0], signal.SIGKILL)
    t0 = time.monotonic()
    got = []
    while time.monotonic() - t0 < 6:
        r = _spread(cluster.url, body, 1)[0]
        got.append((round(time.monotonic() - t0, 2), r))
        time.sleep(0.1)
    for t, r in got:  # answered with the single server's contract, never a bare failure
        assert r["status"] in (200, 500, 503), (t, r["status"], r["body"][:200])
        if r["status"] == 503:  # the pipeline is restarting
            assert r["retry_after"] and json.loads(r["body"])["error"]["code"], r
        elif r["status"] == 500:  # in flight on the stage that died
            assert json.loads(r["body"])["error"]["code"] == "stage_failed", r
        else:
            assert r["result"] == "complete"
    # once the router knows (its stats period is 0.5 s), requests go to the healthy replica
    late = [r for t, r in got if t > 2.0]
    assert late and all(r["status"] == 200 for r in late), [(t, r["status"]) for t, r in got]
    # the sick replica is marked unhealthy (its check_health fails while its pipeline is
    # down): it restarts its stages (the single server's supervisor) or Serve replaces it;
    # either way two replicas serve again
    deadline = time.monotonic() + 120
    while True:
        ids = {r["replica"] for r in cluster.wait_replicas(2, timeout=180)["replicas"]}
        got = _spread(cluster.url, body, 6)
        served = {r["replica"] for r in got if r["status"] == 200}
        if served == ids and all(r["status"] == 200 for r in got):
            break
        assert time.monotonic() < deadline, (served, ids, [r["status"] for r in got])
        time.sleep(1)


def test_voices_survive_a_registry_restart(base_cluster):
    import ray

    from omni_stream.cluster.registry import registry_handle

    cluster, _ = base_cluster
    status, rec = run_async(_upload(cluster.url, "Keeper", _ref_wav()), 120)
    assert status == 201, rec
    ray.kill(registry_handle(), no_restart=False)  # Ray restarts it; it reloads the folder

    async def voices():
        async with aiohttp.ClientSession() as s, s.get(cluster.url + "/v1/audio/voices") as r:
            return r.status, await r.json()

    deadline = time.monotonic() + 60
    while True:
        status, listing = run_async(voices(), 30)
        if status == 200:
            break
        assert status == 503 and time.monotonic() < deadline, (status, listing)
        time.sleep(0.5)
    assert "keeper" in [v["name"].lower() for v in listing["uploaded_voices"]]
    spoken = _spread(cluster.url, {"input": TEXT, "voice": "keeper", "response_format": "pcm",
                                   "seed": 1, "max_new_tokens": 8, "model": "tts-1"}, 2)
    assert all(g["status"] == 200 for g in spoken), spoken


def test_a_replica_killed_mid_stream_fails_only_its_streams(base_cluster):
    cluster, _ = base_cluster
    health = cluster.wait_replicas(2)
    pids = {r["replica"]: r["pid"] for r in health["replicas"]}
    import base64
    ref = "data:audio/wav;base64," + base64.b64encode(_ref_wav(1.5)).decode()

    def body(seed):
        # long enough (48 s of audio) to be running when the replica is killed
        return {"input": TEXT * 8, "response_format": "pcm", "seed": seed, "model": "tts-1",
                "max_new_tokens": 600, "ref_audio": ref, "x_vector_only": True}

    # start streams one after another until both replicas hold some (the router fills the
    # one with more free real-time capacity first), take each one's first chunk, kill the
    # replica serving the first
    async def run_and_kill():
        async with aiohttp.ClientSession() as s:
            responses = {}
            for seed in range(21, 31):
                r = await s.post(cluster.url + "/v1/audio/speech", json=body(seed))
                assert r.status == 200
                responses[seed] = r
                if len({r.headers[REPLICA] for r in responses.values()}) == 2:
                    break
            replicas = {seed: r.headers[REPLICA] for seed, r in responses.items()}
            assert len(set(replicas.values())) == 2, replicas
            victim = replicas[21]
            first = {seed: await r.content.readany() for seed, r in responses.items()}
            os.kill(pids[victim], signal.SIGKILL)
            out = {}
            for seed, r in responses.items():
                data = bytearray(first[seed])
                try:
                    async for chunk in r.content.iter_any():
                        data += chunk
                    out[seed] = ("complete", bytes(data))
                except aiohttp.ClientPayloadError:
                    out[seed] = ("aborted", bytes(data))
                r.release()
            return victim, replicas, out

    stages = {rid: _stage_pids(pid) for rid, pid in pids.items()}
    victim, replicas, out = run_async(run_and_kill(), 600)
    survivors = [seed for seed in replicas if replicas[seed] != victim]
    assert survivors and len(survivors) < len(replicas)
    for seed in replicas:
        if replicas[seed] == victim:
            assert out[seed][0] == "aborted", seed  # the single server's contract
    # what the killed replica left (stage processes, shared memory) is reaped by the registry
    # once the replica misses its heartbeats, whatever its stages do
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
            _segments({pids[victim]}) or any(_alive(p) for p in stages[victim])):
        time.sleep(0.5)
    assert _segments({pids[victim]}) == []
    assert [p for p in stages[victim] if _alive(p)] == []
    # new requests keep succeeding while it restarts; the surviving streams were bit-identical
    # to the same seeded requests made undisturbed
    for seed in survivors:
        again = _spread(cluster.url, body(seed), 1)[0]
        assert again["status"] == 200 and again["result"] == "complete"
        assert out[seed] == ("complete", again["body"]), seed
    back = cluster.wait_replicas(2, timeout=240)
    assert victim not in {r["replica"] for r in back["replicas"]}
    assert {r["pid"] for r in back["replicas"]} & {pids[victim]} == set()


def test_autoscaling_follows_the_capacity_in_use(ray_cluster):
    """1..2 replicas at target utilisation 0.5: streams filling one replica's capacity add the
    second; when they end it goes again."""
    from omni_stream.cluster.launch import autoscaling_config
    from omni_stream.server.fake_backend import FakeBackend

    backend = FakeBackend(max_streams=2, max_queue=4, frame_delay=0.02)
    ray_cluster.deploy(replicas=1, backend=backend, autoscaling=autoscaling_config(
        1, 2, 0.5, upscale_delay_s=0.0, downscale_delay_s=2.0, look_back_s=2.0))
    url = ray_cluster.url

    async def load():
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(_speech(s, url, {"input": "word " * 400,
                                                          "response_format": "pcm"}))
                     for _ in range(2)]
            peak, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < 40 and peak < 2:
                async with s.get(url + "/health") as r:
                    peak = max(peak, (await r.json()).get("replicas_up", 0))
                await asyncio.sleep(0.5)
            done = await asyncio.gather(*tasks)
            return peak, done

    peak, done = run_async(load(), 120)
    assert all(d["status"] == 200 and d["result"] == "complete" for d in done)
    assert peak == 2, "no second replica while one replica's capacity was in use"
    ray_cluster.wait_replicas(1, timeout=90)  # and back down once idle


def test_the_pages_and_the_dashboards_stats_through_the_entry(ray_cluster):
    """The playground and the dashboard are the replicas' own pages, forwarded; /v1/stats
    answers for every replica, merged, and keeps the API key."""
    from omni_stream.server.fake_backend import FakeBackend
    from omni_stream.server.settings import ServerSettings

    ray_cluster.deploy(replicas=2, backend=FakeBackend(max_streams=3),
                       settings=ServerSettings(api_key="k1"), force=True)
    url = ray_cluster.url

    async def go():
        async with aiohttp.ClientSession() as s:
            pages = {}
            for path in ("/", "/dashboard", "/ui/dashboard.js"):
                async with s.get(url + path) as r:
                    pages[path] = (r.status, await r.text())
            async with s.get(url + "/v1/stats") as r:
                refused = r.status
            async with s.get(url + "/v1/stats", headers={"Authorization": "Bearer k1"}) as r:
                return pages, refused, r.status, await r.json()

    pages, refused, status, stats = run_async(go(), 60)
    assert all(p[0] == 200 for p in pages.values()), {k: v[0] for k, v in pages.items()}
    assert "<html" in pages["/"][1] and "/ui/dashboard.js" in pages["/dashboard"][1]
    assert refused == 401 and status == 200
    assert [r["status"] for r in stats["replicas"]] == ["ok", "ok"]
    assert stats["capacity"]["capacity_streams"] == 6  # both replicas' capacity
    assert stats["streams"] == {"running": 0, "queued": 0, "refused": 0}

"""GET /v1/stats, the dashboard's figures (server/dashboard.py): the sampler's parts per frame
step from a pipeline's part counters or from the step histogram (injected clock), the endpoint
over a real socket on the fake backend (keeps the key; streams running and refused), and a
cluster's merge of its replicas' answers."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest

from omni_stream.scheduling.attribution import PartCounters
from omni_stream.server import dashboard
from omni_stream.server.fake_backend import FakeBackend
from omni_stream.server.metrics import observe_step
from omni_stream.server.settings import ServerSettings
from omni_stream.server.testing import post_speech, run_async, running_server


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Pipeline:
    """A backend with the pipeline's part counters: each reading as the test sets it."""

    def __init__(self) -> None:
        self.next: PartCounters | None = None
        self.reads = 0

    async def part_counters(self, timeout_s: float = 2.0) -> PartCounters | None:
        self.reads += 1
        return self.next


def test_sampler_parts_per_step_from_the_pipelines_counters():
    clock, backend = _Clock(), _Pipeline()
    s = dashboard.StatsSampler(backend, clock=clock, window_s=3.0, every_s=0.5)

    async def go():
        backend.next = PartCounters(t=10.0, steps=100, step_s=3.0, cp_s=1.0, loop_s=3.5,
                                    codec_cpu_s=2.0, server_cpu_s=0.5, other_cpu_s=0.1)
        await s.refresh()
        assert s.parts() == (None, 0.0)  # one reading: no rate yet
        await s.refresh()  # within every_s: no second reading
        assert backend.reads == 1
        clock.t += 1.0
        backend.next = PartCounters(t=11.0, steps=150, step_s=4.5, cp_s=1.5, loop_s=5.25,
                                    codec_cpu_s=3.0, server_cpu_s=0.75, other_cpu_s=0.1)
        await s.refresh()
        parts, span = s.parts()
        assert span == pytest.approx(1.0) and parts["steps"] == 50
        assert parts["talker_lm"] == pytest.approx(0.02)  # (1.5 - 0.5) s / 50 steps
        assert parts["code_predictor"] == pytest.approx(0.01)
        assert parts["scheduling"] == pytest.approx(0.005)
        assert parts["codec"] == pytest.approx(0.02)
        assert parts["transport"] == pytest.approx(0.005)
        assert parts["others"] == 0.0 and parts["wall"] == pytest.approx(0.02)
        clock.t += 1.0  # idle: the talker stepped no more
        backend.next = PartCounters(t=12.0, steps=150, step_s=4.5, cp_s=1.5, loop_s=5.25)
        await s.refresh()
        clock.t += 5.0
        backend.next = PartCounters(t=17.0, steps=152, step_s=4.6, cp_s=1.5, loop_s=5.3)
        await s.refresh()
        assert s.parts()[0] is None  # fewer than MIN_STEPS in the window: nothing to chart
    run_async(go(), 10)


def test_sampler_falls_back_to_the_step_histogram():
    """A backend without part counters: the parts come from the sums /metrics carries."""
    clock = _Clock()
    s = dashboard.StatsSampler(object(), clock=clock, window_s=3.0, every_s=0.5)

    def steps(n: int) -> None:
        for _ in range(n):
            observe_step("talker.step", 0.03)
            observe_step("talker.code_predictor", 0.01)
            observe_step("frame.total", 0.032)
            observe_step("codec.decode", 0.015)
            observe_step("server.encode_write", 0.002)

    async def go():
        await s.refresh()
        steps(20)
        clock.t += 1.0
        await s.refresh()
        parts, span = s.parts()
        assert span == 1.0 and parts["steps"] == 20
        assert parts["talker_lm"] == pytest.approx(0.02)
        assert parts["code_predictor"] == pytest.approx(0.01)
        assert parts["scheduling"] == pytest.approx(0.002)
        assert parts["codec"] == pytest.approx(0.015)
        assert parts["transport"] == pytest.approx(0.002)
        assert "others" not in parts  # the histogram has no other processes' CPU time
    run_async(go(), 10)


def test_stats_endpoint_keeps_the_key_and_counts_streams():
    async def go():
        backend = FakeBackend(max_streams=1, max_queue=0, frame_delay=0.02)
        async with running_server(backend, ServerSettings(api_key="k1")) as url, \
                aiohttp.ClientSession() as s:
            async with s.get(url + dashboard.STATS_PATH) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "invalid_api_key"
            auth = {"Authorization": "Bearer k1"}

            async def stats() -> dict:
                async with s.get(url + dashboard.STATS_PATH, headers=auth) as r:
                    assert r.status == 200
                    return await r.json()

            body = await stats()
            assert body["model"] == backend.model_name and body["frame_ms"] == 80.0
            assert body["capacity"]["capacity_streams"] == 1
            assert body["bandwidth_gbs"] is None  # the fake measures none
            assert body["streams"] == {"running": 0, "queued": 0, "refused": 0}
            assert set(body["labels"]) >= {"talker_lm", "code_predictor", "codec", "transport"}
            long = asyncio.create_task(post_speech(
                s, url, {"input": "x" * 400, "response_format": "pcm"}, headers=auth))
            for _ in range(200):
                if (await stats())["streams"]["running"] == 1:
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("the running stream never showed")
            refused = await post_speech(s, url, {"input": "hi"}, headers=auth)
            assert refused[0] == 429
            assert (await stats())["streams"]["refused"] == 1
            long.cancel()
    run_async(go(), 30)


def test_cluster_merge_adds_capacity_and_streams_and_weights_parts_by_steps():
    a = {"model": "m", "ready": True, "capacity": {"capacity_streams": 2, "slots": 4,
                                                   "rtf_estimate": 0.4, "realtime": True},
         "bandwidth_gbs": 20.0, "streams": {"running": 2, "queued": 1, "refused": 3},
         "step_ms": {"talker_lm": 30.0, "codec": 10.0}, "steps": 30, "window_s": 3.0}
    b = {"model": "m", "ready": True, "capacity": {"capacity_streams": 1, "slots": 4,
                                                   "rtf_estimate": 0.7, "realtime": True},
         "bandwidth_gbs": 12.5, "streams": {"running": 1, "queued": 0, "refused": 0},
         "step_ms": {"talker_lm": 60.0, "codec": 20.0}, "steps": 10, "window_s": 2.5}
    idle = {**b, "step_ms": None, "steps": 0, "bandwidth_gbs": None}
    m = dashboard.merge_stats([("r1", a), ("r2", b), ("r3", None), ("r4", idle)])
    assert m["capacity"] == {"capacity_streams": 4, "slots": 12, "rtf_estimate": 0.7,
                             "realtime": True}
    assert m["bandwidth_gbs"] == 12.5 and m["model"] == "m"
    assert m["streams"] == {"running": 4, "queued": 1, "refused": 3}
    assert m["steps"] == 40
    assert m["step_ms"] == {"talker_lm": 37.5, "codec": 12.5}  # (30*30 + 60*10) / 40
    assert [r["status"] for r in m["replicas"]] == ["ok", "ok", "unreachable", "ok"]
    nothing = dashboard.merge_stats([("r1", None)])
    assert nothing["capacity"] is None and nothing["step_ms"] is None
    assert not math.isnan(nothing["window_s"])

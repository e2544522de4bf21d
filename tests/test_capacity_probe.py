"""The start-up probes cost what serving costs, and the capacity they announce is the one the
tracker then keeps (orchestrator.costs, scheduling.tracker, scheduling.attribution).

No stage processes and no wall clock: chunk arrivals carry injected times, the pipeline is a
fake that answers AddStream with a chunk plan shaped like the codec stage's on a 2-core CPU
(the first chunk, 1-frame chunks while the listener's buffer is short, the ramp, steady
chunks, a tail), each chunk arriving ``frames x step + call`` after the previous one.
"""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from omni_stream.config import SamplingParams
from omni_stream.contract import SpeechJob
from omni_stream.orchestrator import costs as oc
from omni_stream.orchestrator import meter
from omni_stream.scheduling import AdmissionController
from omni_stream.scheduling.attribution import (PartCounters, describe_growth, parts_per_step,
                                                talker_phase_sums, what_grew)
from omni_stream.scheduling.capacity import CostCache, MachineCosts, capacity
from omni_stream.scheduling.chunking import ChunkPolicy
from omni_stream.scheduling.tracker import (RAMP_DONE_FRAMES, RAMP_MAX_FRAMES, CapacityTracker,
                                            StreamPace, tracker_window_s, weighted_median)
from omni_stream.transport import (AddStream, Flags, MeasureCosts, MsgKind, StatsReply,
                                   StatsRequest)
from omni_stream.transport.record import Message

SPF = 1920  # samples per frame of the tiny and released codecs
RAMP = [1] * 6 + [2, 2, 4, 4]  # chunks while the listener's buffer refills (seen on 2 cores)


def served_plan(frames: int, first: int, steady: int) -> list[int]:
    """Chunk sizes of one stream of ``frames`` frames as the codec stage sends them (a first
    chunk of the steady size leaves the buffer long enough: no ramp)."""
    plan, left = [], frames
    for n in [first] + (RAMP if first < steady else []) + [steady] * frames:
        n = min(n, left)
        if n <= 0:
            break
        plan.append(n)
        left -= n
    return plan


def arrivals(plan: list[int], step_s: float, call_s: float, t0: float = 0.0):
    """(frames, arrival time) of each chunk: its frames' steps, then its Code2Wav call."""
    t, out = t0, []
    for n in plan:
        t += n * step_s + call_s
        out.append((n, t))
    return out


# ------------------------------------------------------------------ the pace both measure
def test_ramp_chunks_are_not_samples_and_steady_chunks_are():
    pace = StreamPace(steady=8)
    got = [pace.arrived(n, t, final=(i == 4)) for i, (n, t) in
           enumerate([(2, 1.0), (1, 1.2), (8, 1.7), (8, 2.1), (3, 2.4)])]
    # the ramp's gaps and the tail are left out; the gap after the first steady chunk counts
    assert got == [None, None, None, pytest.approx(0.4 / 8), None]
    pace.skip_next()  # a wait for text: the next gap is not the pipeline's pace
    assert pace.arrived(8, 9.0) is None and pace.arrived(8, 9.4) == pytest.approx(0.05)
    assert pace.arrived(0, 10.0) is None  # an event, not a chunk
    # a large steady size: the ramp ends at RAMP_DONE_FRAMES (a typical request may never
    # send a 32-frame chunk)
    big = StreamPace(steady=32)
    assert big.reach == RAMP_DONE_FRAMES
    assert [big.arrived(n, t) for n, t in [(4, 1.0), (8, 1.5), (12, 2.1)]] == \
        [None, None, pytest.approx(0.05)]
    assert StreamPace(steady=4).reach == 4
    # a buffer that never grows (1-frame chunks all along): the ramp ends after
    # RAMP_MAX_FRAMES frames all the same, and what follows is that stream's pace
    stuck = StreamPace(steady=8)
    got = [stuck.arrived(1, 0.1 * k) for k in range(1, RAMP_MAX_FRAMES + 3)]
    assert got[:RAMP_MAX_FRAMES] == [None] * RAMP_MAX_FRAMES
    assert got[RAMP_MAX_FRAMES:] == pytest.approx([0.1, 0.1])
    with pytest.raises(ValueError):
        StreamPace(steady=0)
    assert tracker_window_s(8) == 4.0 and tracker_window_s(32) > 4.0


def test_weighted_median_weighs_by_frames():
    assert weighted_median([(1.0, 1), (2.0, 1), (3.0, 1)]) == 2.0
    assert weighted_median([(1.0, 1), (3.0, 1)]) == 2.0  # an exact tie: the middle
    assert weighted_median([(0.06, 1), (0.06, 1), (0.06, 1), (0.042, 8)]) == 0.042
    with pytest.raises(ValueError):
        weighted_median([])


def test_first_request_keeps_the_capacity_the_probes_announced():
    """The issue: probes timed 42.5 / 60.5 ms per frame at 1 / 2 streams (capacity 2 within
    68 ms), then the first request's ramp (1-frame chunks, each a whole Code2Wav call) counted
    as 1.5x and capacity fell to 1. The ramp is no sample now; the steady chunks are."""
    step_s, call_s = 0.040, 0.020  # steady 8-frame chunks: 40 + 20 / 8 = 42.5 ms per frame
    costs = MachineCosts(frame_s=(0.04, 0.058), codec_call_s=call_s,
                         observed_s=(0.0425, 0.0605))
    assert capacity(costs, slots=4).streams == 2
    plan = arrivals(served_plan(100, 2, 8), step_s, call_s)

    def serve(rule, weighted: bool = True) -> CapacityTracker:
        tr = CapacityTracker(costs, slots=4, steady=8)
        for i, (n, t) in enumerate(plan):
            spf = rule(i, n, t)
            if spf is not None:
                tr.observe(1, spf, t, n if weighted else 1)
            tr.update(t)
        return tr

    pace = StreamPace(8)
    new = serve(lambda i, n, t: pace.arrived(n, t, final=i == len(plan) - 1))
    assert new.current.streams == 2 and new.contention == pytest.approx(1.0)
    assert new.changes == 0

    # the rule it replaces (every chunk from the third on, one vote each) lowers it: the test
    # is meaningful
    def old_rule(i, n, t):
        return (t - plan[i - 1][1]) / n if i >= 2 else None

    assert serve(old_rule, weighted=False).current.streams == 1


def test_capacity_holds_under_steady_load_at_capacity_with_streams_ramping():
    """Two streams at a time, back to back, staggered: the steady samples at 2 streams are what
    the probes saw at 2 streams, whatever the other stream's ramp is doing."""
    call_s = 0.020
    costs = MachineCosts(frame_s=(0.04, 0.058), codec_call_s=call_s,
                         observed_s=(0.0425, 0.0605))
    tr = CapacityTracker(costs, slots=4, steady=8)
    step2 = 0.0605 - call_s / 8
    events = []
    for client, offset in enumerate((0.0, 2.7)):
        t = offset
        for _ in range(6):  # six requests each, one after the other
            plan = arrivals(served_plan(100, 3, 8), step2, call_s, t)
            pace = StreamPace(8)
            for i, (n, at) in enumerate(plan):
                events.append((at, n, pace.arrived(n, at, final=i == len(plan) - 1)))
            t = plan[-1][1]
    for at, n, spf in sorted(events, key=lambda e: e[0]):
        if spf is not None:
            tr.observe(2, spf, at, n)
        assert not tr.update(at)
    assert tr.current.streams == 2


def test_a_stream_stuck_in_small_chunks_still_lowers_capacity():
    """The machine slows mid-ramp (a neighbour): the listener's buffer never grows, chunks stay
    at 1 frame, and the tracker sees it after RAMP_MAX_FRAMES frames, within seconds."""
    costs = MachineCosts(frame_s=(0.04, 0.058), codec_call_s=0.02, observed_s=(0.0425, 0.0605))
    tr = CapacityTracker(costs, slots=4, steady=8)
    plan = arrivals([2] + [1] * 78, 0.090, 0.020)  # 110 ms per frame at 2 streams
    lowered = None
    for k in range(2):
        pace = StreamPace(8)
        for i, (n, t) in enumerate(plan):
            spf = pace.arrived(n, t, final=i == len(plan) - 1)
            if spf is not None:
                tr.observe(2, spf, t, n)
            if tr.update(t) and lowered is None:
                lowered = t
    assert tr.current.streams == 1 and tr.contention == pytest.approx(0.110 / 0.0605)
    # the ramp's frames, then 4 samples and the tracker's down_s (1 s)
    assert lowered is not None and lowered <= plan[RAMP_MAX_FRAMES][1] + 4 * 0.110 + 1.0 + 0.2


# ------------------------------------------------------------------ probe length
@pytest.mark.parametrize("first,steady", [(1, 8), (2, 8), (2, 16), (2, 32), (4, 4)])
def test_probe_streams_are_a_typical_request_long_and_reach_steady_state(first, steady):
    policy = ChunkPolicy(first=first, steady=steady)
    frames = oc.probe_frames(policy)
    assert oc.PROBE_FRAMES <= frames <= oc.MAX_PROBE_FRAMES
    pace = StreamPace(policy.steady)
    plan = served_plan(frames, policy.first, policy.steady)
    got = [pace.arrived(n, t, final=i == len(plan) - 1)
           for i, (n, t) in enumerate(arrivals(plan, 0.05, 0.02))]
    steady = [v for v in got if v is not None]
    # past the buffer-limited ramp, a probe still gives several steady samples, and only them
    assert len(steady) >= oc.PROBE_STEADY_CHUNKS
    assert all(v == pytest.approx(0.05 + 0.02 / policy.steady) for v in steady)


def test_width_pace_uses_the_samples_at_its_width_else_the_whole_streams():
    samples = [(2, 0.06, 8), (2, 0.062, 8), (1, 0.04, 8), (2, 0.061, 8), (2, 0.09, 1)]
    assert oc.width_pace(samples, 2, [0.09])[0] == pytest.approx(0.061)
    v, how = oc.width_pace([(1, 0.04, 8)], 2, [0.09, 0.07])
    assert v == pytest.approx(0.08) and "ramp included" in how
    assert oc.width_pace([], 1, []) == (None, "no samples")


# ------------------------------------------------------------------ the probe's path
class FakePipe:
    """The stage processes as the backend sees them: each AddStream is answered with the PCM
    chunks of ``served_plan`` on a clock of its own; a frame step with ``w`` streams takes
    ``base + per x w`` (code predictor ``cp_share`` of it); StatsRequests get the talker's
    step-timing sums."""

    def __init__(self, backend, base_s: float, per_s: float, call_s: float,
                 cp_share: float = 0.5, parts_share: float = 0.5) -> None:
        self.backend, self.base_s, self.per_s, self.call_s = backend, base_s, per_s, call_s
        self.cp_share, self.parts_share = cp_share, parts_share
        self.sent: list = []
        self.codec = SimpleNamespace(pid=None)
        self.procs: list = []
        self.steps, self.step_s = 0, 0.0

    def step(self, width: int) -> float:
        return self.base_s + self.per_s * width

    def send(self, msg, stage: str = "talker") -> None:
        self.sent.append(msg)
        loop = asyncio.get_running_loop()
        if isinstance(msg, AddStream):
            loop.call_soon(self._play, msg)
        elif isinstance(msg, MeasureCosts) and stage == "codec":
            loop.call_soon(self.backend._on_reply, StatsReply(
                stage="codec", pid=0, request_id=msg.request_id,
                stats={"codec_call_s": self.call_s, "codec_frame_s": 0.0}))
        elif isinstance(msg, MeasureCosts):  # the parts alone: a faster step than serving's
            talker = {"bandwidth_gbs": 20.0, "bandwidth_1t_gbs": 15.0}
            if msg.parts:
                talker.update({f"frame_s_{w}": self.parts_share * self.step(w) for w in (1, 2, 3)},
                              prefill_fixed_s=0.01, prefill_token_s=0.001)
            loop.call_soon(self.backend._on_reply, StatsReply(stage="talker", pid=0,
                                                              request_id=msg.request_id,
                                                              stats=talker))
        elif isinstance(msg, StatsRequest):
            stats = {"talker.step|count": self.steps, "talker.step|sum_s": self.step_s,
                     "talker.code_predictor|sum_s": self.cp_share * self.step_s,
                     "frame.total|sum_s": self.step_s}
            loop.call_soon(self.backend._on_reply, StatsReply(stage="talker", pid=0,
                                                              request_id=msg.request_id,
                                                              stats=stats))

    def _play(self, msg: AddStream) -> None:
        width = len(self.backend._streams)
        plan = served_plan(msg.max_frames, msg.chunk.first, msg.chunk.steady)
        for i, (n, t) in enumerate(arrivals(plan, self.step(width), self.call_s)):
            self.steps += n
            self.step_s += n * self.step(width)
            ns = int(t * 1e9)
            self.backend._on_audio(Message(MsgKind.PCM, Flags.END if i == len(plan) - 1 else 0,
                                           msg.stream_id, i, 0,
                                           np.zeros(n * SPF, np.float32), 0, ns, ns, ns))


def _backend(tiny_ckpt, base_s=0.030, per_s=0.0125, call_s=0.020):
    from omni_stream.orchestrator import PipelineBackend, PipelineSettings

    b = PipelineBackend(PipelineSettings(model_path=str(tiny_ckpt), max_streams=3,
                                         max_seq_len=512, max_queue=0, queue_timeout_s=1))
    b.adm = AdmissionController(b.kv.usable_bytes, b.s.max_streams, b.s.max_queue)
    b.sup.pipe = pipe = FakePipe(b, base_s, per_s, call_s)
    return b, pipe


def test_probe_streams_run_the_serving_path_and_are_measured_like_served_streams(tiny_ckpt):
    b, pipe = _backend(tiny_ckpt)
    parts = MachineCosts(frame_s=(0.0425, 0.055, 0.0675), codec_call_s=0.020)
    observed: list[tuple[int, float]] = []

    async def main():
        b._apply_costs(parts)  # the chunk schedule the requests get
        got, where = await oc.probe_widths(b, parts, b.schedule, b.margin)
        probes = [m for m in pipe.sent if isinstance(m, AddStream)]
        b._apply_costs(parts.with_observed(got, where))
        b.tracker.observe = lambda n, spf, now, frames: observed.append((n, spf))
        job = SpeechJob(text="A client's sentence, as it arrives.", request_id="client")
        async for _ in b.stream(job):
            pass
        await asyncio.sleep(0)  # the tracker's samples are scheduled on the loop
        client = [m for m in pipe.sent if isinstance(m, AddStream)][-1]
        return got, where, probes, client

    got, where, probes, client = asyncio.run(main())
    sched = b.schedule
    warm, timed = probes[0], probes[1:]
    assert warm.max_frames == oc.WARMUP_FRAMES
    for m in timed:  # a request as a client sends it: the serving schedule, sampled, typical
        assert m.chunk == sched == client.chunk and not m.chunk.first_requested
        assert m.sampling == SamplingParams() == client.sampling
        assert m.max_frames == oc.probe_frames(sched) and m.prompt.text == oc.PROBE_TEXT
    # every width of the probes: its steady pace, the ramp's 1-frame chunks left out
    assert len(got) == 3 and len(timed) == 1 + 2 + 3
    for w, v in enumerate(got, start=1):
        assert v == pytest.approx(pipe.step(w) + 0.020 / sched.steady)
    # where each width's frame steps went (the talker's parts; CPU parts as /proc reads them)
    for w, p in enumerate(where, start=1):
        assert p["code_predictor"] == pytest.approx(0.5 * pipe.step(w), rel=0.05)
        assert p["talker_lm"] == pytest.approx(0.5 * pipe.step(w), rel=0.05)
    # a client's stream at 1 stream is measured the same way: what the probe saw, so capacity
    # stays where it was announced
    assert observed and all(n == 1 for n, _ in observed)
    assert [v for _, v in observed] == pytest.approx([got[0]] * len(observed))
    cap = b.tracker.current.streams
    for _ in range(3):
        b.tracker.update(1e9)
    assert b.tracker.current.streams == cap and b.tracker.contention == pytest.approx(1.0)


def test_the_probes_run_the_schedule_the_server_then_serves_with(tiny_ckpt, tmp_path,
                                                                 monkeypatch, caplog):
    """The parts alone (a step 0.4x serving's) give a chunk schedule with a 1-frame first
    chunk; what the probes see moves it to 2 frames: the probes run again with it, so the
    figures capacity is decided from were measured on the schedule the requests get."""
    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OMNI_STREAM_EMULATE_COSTS", raising=False)
    b, pipe = _backend(tiny_ckpt, base_s=0.040, per_s=0.010)
    pipe.parts_share = 0.4
    caplog.set_level("INFO", logger="omni_stream.orchestrator.backend")
    asyncio.run(b._init_costs())
    probes = [m for m in pipe.sent if isinstance(m, AddStream)]
    assert probes[0].chunk.first == 1 and b.schedule.first == 2  # moved by the probes
    assert b.schedule.steady == 8
    # the second pass (warm-up, then one stream per width) ran the schedule that serves
    second = probes[-(1 + sum(range(1, len(b.costs.observed_s) + 1))):]
    assert all(m.chunk == b.schedule for m in second)
    assert "probing again with it" in caplog.text and "margin's edge" not in caplog.text
    assert b.costs.observed_s[0] == pytest.approx(pipe.step(1) + 0.020 / 8)
    assert b.costs.probe_schedule == b.schedule
    # a restart from the cache serves the same schedule
    assert b._cost_cache.load().probe_schedule == b.schedule


def test_a_schedule_the_probes_keep_moving_is_served_as_they_measured_it(tiny_ckpt, tmp_path,
                                                                        monkeypatch, caplog):
    """At the margin's edge the steady size the probes' figures give flips back and forth (8
    -> 10 -> 8 frames here): the server serves with the schedule the last probes measured."""
    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OMNI_STREAM_EMULATE_COSTS", raising=False)
    b, pipe = _backend(tiny_ckpt, base_s=0.050, per_s=0.016)
    caplog.set_level("INFO", logger="omni_stream.orchestrator.backend")
    asyncio.run(b._init_costs())
    assert "serving with the one they measured" in caplog.text
    last = [m for m in pipe.sent if isinstance(m, AddStream)][-1]
    assert last.chunk == b.schedule == b.costs.probe_schedule
    assert b.costs.observed_s[0] == pytest.approx(pipe.step(1) + 0.020 / b.schedule.steady)


# ------------------------------------------------------------------ which part grew
def test_capacity_change_log_names_the_part_that_grew():
    base = {"talker_lm": 0.020, "code_predictor": 0.025, "scheduling": 0.001, "codec": 0.006,
            "transport": 0.001, "others": 0.0, "wall": 0.0425}
    costs = MachineCosts(frame_s=(0.04, 0.058), codec_call_s=0.02, observed_s=(0.0425, 0.0605),
                         probe_parts=(base, dict(base, wall=0.0605)))
    tr = CapacityTracker(costs, slots=4, steady=8, down_s=1.0)
    before = tr.current
    assert before.streams == 2
    t = 0.0
    while tr.current.streams == 2:
        t += 0.25
        tr.observe(2, 1.4 * 0.0605, t, 8)
        tr.update(t)
        assert t < 10
    live = dict(base, code_predictor=0.043, others=0.004, wall=0.0847)
    line = tr.explain(before, live)
    assert line.startswith("capacity 2 -> 1 stream(s): ")
    assert "wall time per frame at 2 streams is 84.7 ms, 1.40x the 60.5 ms measured at " \
        "start-up" in line
    assert "code predictor grew most: 25.0 -> 43.0 ms per frame step (+18.0)" in line
    assert "other processes on the pipeline's cores +4.0" in line
    # capacity rises again: the part that shrank most is named
    assert describe_growth(live, base, 2, fell=False).startswith("code predictor shrank most")
    # one stream turning slower than real time is said too
    one = CapacityTracker(MachineCosts(frame_s=(0.04,), observed_s=(0.0425,),
                                       probe_parts=(base,)), slots=1)
    was = one.current
    for k in range(8):
        one.observe(1, 0.09, 0.25 * k, 8)
    one.update(2.0)
    assert was.realtime and not one.current.realtime and one.current.streams == 1
    slow = one.explain(was, dict(base, others=0.040, wall=0.09))
    assert slow.startswith("capacity 1 -> 1 stream(s), NOT real time: first audio is held back")
    assert "other processes on the pipeline's cores grew most: 0.0 -> 40.0 ms" in slow
    # no start-up parts to compare with (a cache of an older version): the parts now
    bare = CapacityTracker(MachineCosts(frame_s=(0.04,), observed_s=(0.0425,)), slots=1)
    assert "none measured at start-up" in bare.explain(bare.current, live)
    assert "too few frame steps" in bare.explain(bare.current, None)


def test_parts_per_step_from_counters():
    a = PartCounters(t=10.0, steps=100, step_s=4.0, cp_s=2.5, loop_s=4.2, codec_cpu_s=1.0,
                     server_cpu_s=0.2, other_cpu_s=5.0)
    b = PartCounters(t=14.0, steps=180, step_s=8.0, cp_s=5.7, loop_s=8.4, codec_cpu_s=1.8,
                     server_cpu_s=0.28, other_cpu_s=5.0)
    p = parts_per_step(a, b)
    assert p == pytest.approx(dict(talker_lm=0.8 / 80, code_predictor=3.2 / 80,
                                   scheduling=0.2 / 80, codec=0.8 / 80, transport=0.08 / 80,
                                   others=0.0, wall=4.0 / 80, steps=80.0))
    assert parts_per_step(a, PartCounters(t=11.0, steps=104, step_s=4.2, cp_s=2.6, loop_s=4.3)) \
        is None  # too few steps to say anything
    nan = PartCounters(t=14.0, steps=180, step_s=8.0, cp_s=5.7, loop_s=8.4)
    assert "codec" not in parts_per_step(a, nan)  # a counter the platform cannot read
    grew = what_grew({"codec": 0.01, "others": 0.0}, {"codec": 0.011, "others": 0.02})
    assert [g.part for g in grew] == ["others", "codec"]
    sums = talker_phase_sums({"talker.step": {"sum_s": 2.0, "count": 7}})
    assert sums["talker.step|sum_s"] == 2.0 and sums["talker.step|count"] == 7
    assert sums["talker.code_predictor|count"] == 0


def test_meter_reads_cpu_times_and_says_nan_where_it_cannot():
    import os

    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc on this system: the CPU parts are left out")
    assert meter.process_cpu_s(os.getpid()) >= 0
    assert math.isnan(meter.process_cpu_s(None)) and math.isnan(meter.process_cpu_s(2**31 - 7))
    assert meter.cores_busy_s(None) > 0 and math.isnan(meter.cores_busy_s({10**6}))
    c = meter.counters(1.0, {"talker.step|count": 3}, None, [None], None)
    assert c.steps == 3 and math.isnan(c.codec_cpu_s) and c.server_cpu_s >= 0


def test_cost_cache_keeps_the_probe_parts_and_measures_older_versions_again(tmp_path):
    parts = ({"talker_lm": 0.02, "codec": 0.005, "wall": 0.0425},)
    c = MachineCosts(frame_s=(0.04,), observed_s=(0.0425,), probe_parts=parts)
    cache = CostCache(tmp_path, "abcd")
    cache.store(c)
    assert cache.load() == c and cache.load().parts_at(3) == (1, parts[0])
    assert MachineCosts(frame_s=(0.04,)).parts_at(1) is None
    data = json.loads(cache.path.read_text())
    cache.path.write_text(json.dumps({**data, "version": 1}))  # fixed 8-frame chunk probes
    assert cache.load() is None
    with pytest.raises(ValueError):
        MachineCosts(frame_s=(0.04,), probe_parts=({"codec": -1.0},))

"""Per-step attribution: phase timing, histogram percentiles, dumps, merge and the stats report."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from omni_stream.observability import report, stepstats

ROOT = Path(__file__).resolve().parents[1]
BIN_RATIO = 10.0 ** (1.0 / stepstats.BINS_PER_DECADE)  # one bin's width as a factor


@pytest.fixture(autouse=True)
def clean_registry():
    """Every test starts with an empty, non-dumping registry and leaves one behind."""
    stepstats.configure("test", dump_dir="", dump_interval_s=0)
    stepstats.reset()
    stepstats._listeners.clear()
    yield
    stepstats.configure("test", dump_dir="", dump_interval_s=0)
    stepstats.reset()
    stepstats._listeners.clear()


class FakeClock:
    def __init__(self, start_ns: int = 1_000_000_000) -> None:
        self.now = start_ns

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(round(seconds * 1e9))


def _phase(name: str) -> dict:
    return stepstats.snapshot()["phases"][name]


def _run_py(code: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------------- recording
def test_phase_times_block_with_injected_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(stepstats, "_clock", clock)
    for dt in (0.010, 0.020, 0.030):
        with stepstats.phase("talker.step") as ph:
            clock.advance(dt)
        assert ph.seconds == pytest.approx(dt, abs=1e-9)
    p = _phase("talker.step")
    assert p["count"] == 3
    assert p["sum_s"] == pytest.approx(0.060, abs=1e-9)
    assert p["min_s"] == pytest.approx(0.010, abs=1e-9)
    assert p["max_s"] == pytest.approx(0.030, abs=1e-9)
    assert sum(c for _, c in p["bins"]) == 3


def test_phase_records_even_when_block_raises(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(stepstats, "_clock", clock)
    with pytest.raises(RuntimeError):
        with stepstats.phase("codec.decode"):
            clock.advance(0.005)
            raise RuntimeError("boom")
    assert _phase("codec.decode")["sum_s"] == pytest.approx(0.005, abs=1e-9)


def test_phase_with_real_clock_measures_a_sleep():
    t0 = time.perf_counter()
    with stepstats.phase("server.dispatch") as ph:
        time.sleep(0.02)
    outer = time.perf_counter() - t0
    # the sleep lasts at least 0.02 s, and the phase can only be shorter than the same block
    # timed around it: bounds that no load can break (seconds, not ns or ms)
    assert 0.02 <= ph.seconds <= outer, (ph.seconds, outer)


def test_record_ns_and_bad_values():
    stepstats.record_ns("hop.frames.put_get", 5_000, 2_005_000)
    assert _phase("hop.frames.put_get")["sum_s"] == pytest.approx(0.002)
    stepstats.record("x.neg", -1.0)
    stepstats.record("x.neg", math.nan)
    p = _phase("x.neg")
    assert p["count"] == 2 and p["sum_s"] == 0.0 and p["bins"] == [[0, 2]]


def test_bins_cover_their_values():
    rng = np.random.default_rng(1)
    for v in np.exp(rng.uniform(math.log(1e-7), math.log(1e3), 2000)):
        i = stepstats.bin_index(float(v))
        lo, hi = stepstats.bin_edges(i)
        assert lo * (1 - 1e-9) <= v < hi * (1 + 1e-9), (v, i, lo, hi)
    assert stepstats.bin_index(0.0) == 0
    assert stepstats.bin_index(1e9) == stepstats.NBINS - 1


@pytest.mark.parametrize("dist", ["lognormal", "uniform", "bimodal"])
def test_percentiles_match_numpy_within_a_bin(dist):
    rng = np.random.default_rng(7)
    n = 20_000
    if dist == "lognormal":
        x = rng.lognormal(math.log(0.02), 0.8, n)
    elif dist == "uniform":
        x = rng.uniform(0.001, 0.1, n)
    else:  # fast hops + slow steps, like a mixed phase
        x = np.concatenate([rng.normal(2e-4, 2e-5, n // 2), rng.normal(0.06, 0.005, n // 2)])
    for v in x:
        stepstats.record("t.x", float(v))
    p = _phase("t.x")
    assert p["count"] == n
    assert p["sum_s"] == pytest.approx(float(x.sum()), rel=1e-9)
    worst = 0.0
    for q in (0.01, 0.1, 0.5, 0.9, 0.99, 0.999):
        # the estimate lies within a bin of the order statistics around the rank (numpy's
        # linear value may sit in a gap between them, e.g. the median of a bimodal sample)
        est = stepstats.quantile(p, q)
        lower, higher = (float(np.quantile(x, q, method=m)) for m in ("lower", "higher"))
        assert lower / BIN_RATIO <= est <= higher * BIN_RATIO, (q, est, lower, higher)
        if lower / higher > 0.99:  # no gap: compare with numpy's interpolated value
            worst = max(worst, abs(est / float(np.quantile(x, q)) - 1.0))
    assert stepstats.quantile(p, 0.0) == pytest.approx(float(x.min()))
    assert stepstats.quantile(p, 1.0) == pytest.approx(float(x.max()))
    print(f"{dist}: worst percentile error {100 * worst:.2f}% "
          f"(bin width {100 * (BIN_RATIO - 1):.1f}%)")


def test_quantile_of_a_single_value_is_exact():
    stepstats.record("t.one", 0.0123)
    s = stepstats.summarize(_phase("t.one"))
    assert s["p50_s"] == s["p99_s"] == s["mean_s"] == pytest.approx(0.0123)


def test_listener_sees_every_record(monkeypatch):
    seen = []
    fn = lambda name, seconds: seen.append((name, seconds))  # noqa: E731
    stepstats.add_listener(fn)
    stepstats.add_listener(fn)  # once only
    clock = FakeClock()
    monkeypatch.setattr(stepstats, "_clock", clock)
    stepstats.record("server.encode_write", 0.001)
    with stepstats.phase("server.dispatch"):
        clock.advance(0.002)
    stepstats.record_ns("hop.audio.get", 0, 3_000_000)
    assert [n for n, _ in seen] == ["server.encode_write", "server.dispatch", "hop.audio.get"]
    assert [s for _, s in seen] == pytest.approx([0.001, 0.002, 0.003])
    stepstats.remove_listener(fn)
    stepstats.record("server.encode_write", 0.001)
    assert len(seen) == 3


def test_notify_reaches_listeners_without_recording():
    """A stage's pushed timings reach the server's listeners (its /metrics) but not the
    server's own registry, whose dumps keep only what the server timed itself."""
    seen = []
    fn = lambda name, seconds: seen.append((name, seconds))  # noqa: E731
    stepstats.add_listener(fn)
    stepstats.notify("talker.step", 0.04)
    stepstats.remove_listener(fn)
    assert seen == [("talker.step", 0.04)]
    assert "talker.step" not in stepstats.snapshot()["phases"]


def test_listener_feeds_prometheus_observe_step():
    from omni_stream.server.metrics import ServerMetrics, observe_step

    stepstats.add_listener(observe_step)
    stepstats.record("server.test_phase_for_prometheus", 0.003)
    text = ServerMetrics(lambda: {}).render().decode()
    assert 'omni_stream_step_seconds_count{phase="server.test_phase_for_prometheus"} 1.0' in text


def test_record_overhead_is_printed_not_asserted():
    n = 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        stepstats.record("t.overhead", 0.001)
    rec = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        with stepstats.phase("t.overhead_phase"):
            pass
    ph = (time.perf_counter() - t0) / n
    print(f"record(): {1e9 * rec:.0f} ns/call, with phase(): {1e9 * ph:.0f} ns/call")
    assert _phase("t.overhead")["count"] == n


# ------------------------------------------------------------------------- snapshots and dumps
def _fake_snapshot(process: str, pid: int, data: dict[str, list[float]]) -> dict:
    stepstats.reset()
    for name, values in data.items():
        for v in values:
            stepstats.record(name, v)
    snap = stepstats.snapshot()
    snap.update(process=process, pid=pid)
    stepstats.reset()
    return json.loads(json.dumps(snap))  # exactly what a dump file holds


def test_merge_two_process_dumps():
    rng = np.random.default_rng(3)
    a = rng.uniform(0.01, 0.02, 500)
    b = rng.uniform(0.02, 0.05, 300)
    s1 = _fake_snapshot("talker", 11, {"shared.x": list(a), "talker.step": [0.05] * 4})
    s2 = _fake_snapshot("codec", 22, {"shared.x": list(b), "codec.decode": [0.03]})
    m = stepstats.merge_snapshots([s1, s2])
    assert {(p["process"], p["pid"]) for p in m["processes"]} == {("talker", 11), ("codec", 22)}
    x = m["phases"]["shared.x"]
    both = np.concatenate([a, b])
    assert x["count"] == 800
    assert x["sum_s"] == pytest.approx(float(both.sum()))
    assert x["min_s"] == pytest.approx(float(a.min()))
    assert x["max_s"] == pytest.approx(float(b.max()))
    assert sum(c for _, c in x["bins"]) == 800
    for q in (0.5, 0.99):
        assert stepstats.quantile(x, q) == pytest.approx(float(np.quantile(both, q)),
                                                         rel=BIN_RATIO - 1)
    assert m["phases"]["talker.step"]["count"] == 4 and m["phases"]["codec.decode"]["count"] == 1
    # merging is associative: a merged snapshot merges again
    assert stepstats.merge_snapshots([m])["phases"] == m["phases"]


def test_merge_rejects_another_histogram_layout():
    s = _fake_snapshot("talker", 1, {"t.x": [0.01]})
    s["hist"] = dict(s["hist"], bins_per_decade=10)
    with pytest.raises(ValueError, match="histogram"):
        stepstats.merge_snapshots([s])


def test_dump_writes_named_file(tmp_path):
    stepstats.configure("talker", dump_dir=tmp_path, dump_interval_s=0)
    stepstats.record("talker.step", 0.05)
    path = stepstats.dump()
    assert path == tmp_path / f"talker-{os.getpid()}.json"
    snap = stepstats.load_snapshot(path)
    assert snap["process"] == "talker" and snap["pid"] == os.getpid()
    assert snap["phases"]["talker.step"]["count"] == 1
    assert not list(tmp_path.glob(".*"))  # the temporary file was renamed away


def test_dump_is_off_without_a_dir():
    stepstats.record("t.x", 0.01)
    assert stepstats.dump() is None and stepstats.dump_path() is None


def test_periodic_dump_after_interval_of_activity(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(stepstats, "_clock", clock)
    stepstats.configure("codec", dump_dir=tmp_path, dump_interval_s=5.0)
    path = tmp_path / f"codec-{os.getpid()}.json"
    for _ in range(100):
        stepstats.record("codec.decode", 0.03)
    assert not path.exists()  # activity, but the interval is not up
    clock.advance(5.0)
    for _ in range(stepstats._TICK_EVERY):
        stepstats.record("codec.decode", 0.03)
    assert stepstats.load_snapshot(path)["phases"]["codec.decode"]["count"] >= 100


def test_configure_rejects_bad_input(monkeypatch):
    with pytest.raises(ValueError, match="process name"):
        stepstats.configure("a/b", dump_dir="")
    monkeypatch.setenv(stepstats.ENV_INTERVAL, "soon")
    with pytest.raises(ValueError, match=stepstats.ENV_INTERVAL):
        stepstats.configure("x", dump_dir="")


def test_env_dir_dumps_at_exit_in_a_subprocess(tmp_path):
    r = _run_py("""
        import os
        from omni_stream.observability import stepstats
        stepstats.configure("server")
        for _ in range(3):
            stepstats.record("server.admission_wait", 0.004)
        print(os.getpid())
    """, {stepstats.ENV_DIR: str(tmp_path), stepstats.ENV_INTERVAL: "0"})
    assert r.returncode == 0, r.stderr
    path = tmp_path / f"server-{int(r.stdout.strip())}.json"
    snap = stepstats.load_snapshot(path)
    assert snap["process"] == "server"
    assert snap["phases"]["server.admission_wait"]["count"] == 3


def test_killed_process_keeps_its_periodic_dump(tmp_path):
    """SIGKILL skips atexit: the periodic dump is what survives."""
    code = """
        import sys, time
        from omni_stream.observability import stepstats
        stepstats.configure("talker")
        while True:
            stepstats.record("talker.step", 0.001)
            time.sleep(0.001)
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{stepstats.ENV_DIR: str(tmp_path),
                                                     stepstats.ENV_INTERVAL: "0.2"})
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env)
    try:
        path = tmp_path / f"talker-{proc.pid}.json"
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert stepstats.load_snapshot(path)["phases"]["talker.step"]["count"] > 0


def test_forked_child_starts_empty(tmp_path):
    r = _run_py("""
        import os, json
        from omni_stream.observability import stepstats
        stepstats.configure("server")
        stepstats.record("server.dispatch", 0.001)
        pid = os.fork()
        if pid == 0:
            ok = stepstats.snapshot()["phases"] == {} and stepstats.dump_path() is None
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), len(stepstats.snapshot()["phases"]))
    """, {stepstats.ENV_DIR: str(tmp_path), stepstats.ENV_INTERVAL: "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "1"]
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob("server-*.json")]


def test_flat_snapshot_fits_a_stats_reply():
    import msgspec

    from omni_stream.transport.messages import StatsReply

    snap = _fake_snapshot("talker", 5, {"talker.step": [0.05, 0.06], "hop.frames.get": [2e-5]})
    flat = stepstats.flatten_snapshot(snap)
    msg = StatsReply(stage="talker", pid=5, stats={"ready": 1, **flat})
    back = msgspec.json.decode(msgspec.json.encode(msg), type=StatsReply)
    again = stepstats.unflatten_snapshot(back.stats, back.stage, back.pid)
    assert again["phases"] == snap["phases"]
    assert stepstats.merge_snapshots([again])["phases"]["talker.step"]["count"] == 2


def test_diff_and_prometheus_buckets():
    old = _fake_snapshot("talker", 1, {"t.x": [0.001, 0.002]})
    new = _fake_snapshot("talker", 1, {"t.x": [0.001, 0.002, 0.05, 0.3]})
    d = stepstats.diff_snapshots(new, old)["phases"]["t.x"]
    assert d["count"] == 2 and d["sum_s"] == pytest.approx(0.35)
    assert sum(c for _, c in d["bins"]) == 2
    assert stepstats.cumulative_buckets(new["phases"]["t.x"], [0.0025, 0.1, 1.0]) == [2, 3, 4, 4]


# ---------------------------------------------------------------------------------- the report
def _pipeline_snaps(frames: int = 200, unattributed: float = 0.002) -> list[dict]:
    """A 4-stream run as the stages would dump it: talker (with nested sub-phases), codec and
    server processes; frame.total is the talker-loop iteration."""
    rng = np.random.default_rng(11)
    lm = rng.uniform(0.020, 0.030, frames)
    cp = rng.uniform(0.025, 0.035, frames)
    step = lm + cp + 0.001
    emit = np.full(frames, 0.0008)
    prefill = [0.120] * 4
    total = step + emit + unattributed
    total[:4] += 0.120  # the iterations that admitted a stream ran its prefill too
    talker = _fake_snapshot("talker", 100, {
        "talker.talker_lm": list(lm), "talker.code_predictor": list(cp),
        "talker.step": list(step), "talker.emit": list(emit), "talker.prefill": prefill,
        "talker.step.sample": [0.0005] * frames, "frame.total": list(total)})
    codec = _fake_snapshot("codec", 101, {
        "codec.decode": [0.012] * (frames // 2), "hop.frames.put_get": [1e-4] * frames * 4,
        "hop.frames.get": [2e-5] * frames * 4})
    server = _fake_snapshot("server", 99, {
        "server.admission_wait": [0.001] * 4, "server.encode_write": [3e-4] * (frames // 2),
        "hop.audio.put_get": [2e-4] * (frames // 2)})
    return [talker, codec, server]


def test_report_rows_roles_and_shares():
    snaps = _pipeline_snaps()
    rep = report.build_report(snaps)
    rows = {r["phase"]: r for r in rep["phases"]}
    assert rep["frames"] == 200 and rep["frames_source"] == "talker.step"
    assert rows["talker.step"]["role"] == "critical"
    assert rows["talker.prefill"]["role"] == "critical"
    assert (rows["talker.code_predictor"]["role"], rows["talker.code_predictor"]["parent"]) == \
        ("nested", "talker.step")
    assert rows["talker.step.sample"]["parent"] == "talker.step"  # nested by its name
    assert rows["codec.decode"]["role"] == "other"
    assert rows["codec.decode"]["processes"] == ["codec"]
    assert rows["hop.audio.put_get"]["role"] == "other"
    assert rows["frame.total"]["role"] == "total"
    # share = sum / frames / 80 ms
    merged = stepstats.merge_snapshots(snaps)["phases"]
    step = merged["talker.step"]
    assert rows["talker.step"]["per_frame_ms"] == pytest.approx(1e3 * step["sum_s"] / 200)
    assert rows["talker.step"]["share"] == pytest.approx(step["sum_s"] / 200 / 0.080)
    assert rows["codec.decode"]["share"] == pytest.approx(100 * 0.012 / 200 / 0.080)
    assert rows["talker.step"]["mean_ms"] == pytest.approx(1e3 * step["sum_s"] / step["count"])
    assert rows["talker.step"]["p50_ms"] == pytest.approx(1e3 * stepstats.quantile(step, 0.5))
    # display order: critical biggest first, each followed by its nested rows; total last
    names = [r["phase"] for r in rep["phases"]]
    assert names[0] == "talker.step"
    assert set(names[1:4]) == {"talker.code_predictor", "talker.talker_lm", "talker.step.sample"}
    assert names[-1] == "frame.total"
    assert names.index("talker.emit") < names.index("codec.decode")


def test_report_critical_path_adds_up_to_frame_total():
    rep = report.build_report(_pipeline_snaps(unattributed=0.002))
    c = rep["critical"]
    merged = stepstats.merge_snapshots(_pipeline_snaps(unattributed=0.002))["phases"]
    crit = sum(merged[n]["sum_s"] for n in ("talker.step", "talker.emit", "talker.prefill"))
    assert c["sum_ms"] == pytest.approx(1e3 * crit / 200)  # nested and other rows not added
    assert c["frame_total_ms"] == pytest.approx(1e3 * merged["frame.total"]["sum_s"] / 200)
    assert c["unattributed_ms"] == pytest.approx(2.0, abs=1e-6)
    assert c["ratio"] == pytest.approx(c["sum_ms"] / c["frame_total_ms"])
    assert c["within_tolerance"] is True
    bad = report.build_report(_pipeline_snaps(unattributed=0.030))["critical"]
    assert bad["within_tolerance"] is False and bad["ratio"] < 0.9


def test_report_frames_override_and_missing_frames():
    snaps = _pipeline_snaps()
    rep = report.build_report(snaps, frames=400)
    assert rep["frames_source"] == "--frames"
    rows = {r["phase"]: r for r in rep["phases"]}
    assert rows["codec.decode"]["per_frame_ms"] == pytest.approx(100 * 12.0 / 400)
    codec_only = [s for s in snaps if s["process"] == "codec"]
    rep = report.build_report(codec_only)
    assert rep["frames"] is None and all(r["share"] is None for r in rep["phases"])
    assert rep["critical"]["sum_ms"] is None and rep["critical"]["ratio"] is None


def test_classify_custom_critical_prefixes():
    roles = report.classify(["talker.step", "codec.decode", "codec.decode.conv", "frame.total"],
                            critical_prefixes=("talker.", "codec."))
    assert roles == {"talker.step": ("critical", None), "codec.decode": ("critical", None),
                     "codec.decode.conv": ("nested", "codec.decode"),
                     "frame.total": ("total", None)}


def test_render_prints_the_table_and_the_check():
    from rich.console import Console

    buf = io.StringIO()
    report.render(report.build_report(_pipeline_snaps()), Console(file=buf, width=160))
    out = buf.getvalue()
    for text in ("talker.step", "└ talker.code_predictor", "codec.decode", "frame.total",
                 "share", "critical-path sum", "OK"):
        assert text in out, text


def test_stats_main_writes_json(tmp_path, capsys):
    d = tmp_path / "dumps"
    d.mkdir()
    for s in _pipeline_snaps():
        (d / f"{s['process']}-{s['pid']}.json").write_text(json.dumps(s))
    (d / ".codec-101.json.tmp").write_text("{partial")  # an interrupted dump is ignored
    out = tmp_path / "report.json"
    assert report.stats_main([str(d), "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["frames"] == 200
    assert {p["process"] for p in rep["processes"]} == {"talker", "codec", "server"}
    assert rep["critical"]["within_tolerance"] is True
    assert "talker.step" in capsys.readouterr().out
    assert report.stats_main([str(d), "--frames", "100", "--nested", "talker.emit=talker.step",
                              "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["frames"] == 100
    assert {r["phase"]: r["role"] for r in rep["phases"]}["talker.emit"] == "nested"


def test_stats_main_errors(tmp_path, capsys):
    assert report.stats_main([str(tmp_path)]) == 2
    assert stepstats.ENV_DIR in capsys.readouterr().err
    assert report.stats_main([str(tmp_path / "missing")]) == 2
    assert report.stats_main([str(tmp_path), "--nested", "nope"]) == 2


def test_stats_subcommand_hooks_into_a_parser(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    report.add_stats_parser(sub)
    a = p.parse_args(["stats", str(tmp_path), "--frames", "7"])
    assert a.func is report.cmd_stats and a.frames == 7 and a.frame_ms == 80.0

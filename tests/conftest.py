"""Shared fixtures (tiny random checkpoints written once per test session, the servers and the
cluster some modules share) and the lanes: every test is marked by what it starts
(tests/lanes.py), and a test of the unit lane that starts a process fails."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

from omni_stream.models.onednn import pin_decode_isa
from lanes import LANES, STARTS, Guard, Reader, StartsAProcess, item_lanes

# The client decoders run inside this process in the tests; a client process pins oneDNN's
# level before its bf16 decode (``TorchDecoder``), which only takes before the process's first
# oneDNN call: pin it here, first, as the codec stage does (models/onednn.py).
pin_decode_isa()


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """Write (once per session) a random checkpoint: factory(preset, variant, seed, **kw)."""
    from omni_stream.checkpoints.io import write_random_checkpoint

    made: dict[tuple, Path] = {}

    def make(preset: str = "tiny", variant: str = "custom_voice", seed: int = 0, **kw) -> Path:
        key = (preset, variant, seed, tuple(sorted(kw.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"ck-{preset}-{variant}-{seed}")
            made[key] = write_random_checkpoint(out, preset, variant, seed=seed, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_ckpt(ckpt_factory) -> Path:
    return ckpt_factory("tiny", "custom_voice", 0)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    from omni_stream.checkpoints.io import load_model

    return load_model(tiny_ckpt, dtype=torch.float32)


# ---------------------------------------------------------------- voice agents (integrations)
def _agents_serve(ckpt: Path, voice_dir: Path):
    from omni_stream.orchestrator import PipelineBackend
    from omni_stream.server.app import start_server
    from omni_stream.server.settings import ServerSettings
    from omni_stream.server.testing import serving_in_thread
    from tests.servers import tiny_settings

    settings = tiny_settings(ckpt, max_seq_len=1024, max_queue=8)
    return serving_in_thread(lambda: start_server(PipelineBackend(settings), "127.0.0.1", 0,
                                                  ServerSettings(voice_dir=str(voice_dir))),
                             timeout=120)


@pytest.fixture(scope="session")
def agents_server(tiny_ckpt, tmp_path_factory):
    """One real server on the tiny custom-voice model for the agent-framework tests (Pipecat,
    LiveKit): its URL."""
    with _agents_serve(tiny_ckpt, tmp_path_factory.mktemp("agent-voices")) as url:
        yield url


@pytest.fixture(scope="session")
def agents_base_server(ckpt_factory, tmp_path_factory):
    """A real server on the tiny Base model (voice cloning) for the agent-framework tests."""
    with _agents_serve(ckpt_factory("tiny", "base", 0),
                       tmp_path_factory.mktemp("agent-base-voices")) as url:
        yield url


# ---------------------------------------------------------------- the pages, in a real browser
@pytest.fixture(scope="session")
def ui_server(tiny_ckpt, tmp_path_factory):
    """A real server on the tiny custom-voice model for the browser tests: its URL."""
    with _agents_serve(tiny_ckpt, tmp_path_factory.mktemp("ui-voices")) as url:
        yield url


@pytest.fixture(scope="session")
def ui_base_server(ckpt_factory, tmp_path_factory):
    """A real server on the tiny Base model (voice cloning from the page)."""
    with _agents_serve(ckpt_factory("tiny", "base", 0),
                       tmp_path_factory.mktemp("ui-base-voices")) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's, installed by scripts/setup.sh), driven by Playwright; a
    fake microphone, and audio that plays without a user gesture. One per test module: while
    Playwright's sync API runs, its event loop is the thread's running loop, and every later
    ``asyncio.run`` in the session (the API tests' ``run_async``) would fail."""
    from browser_harness import launch

    with launch() as b:
        yield b


# ---------------------------------------------------------------- the cluster entry (Ray Serve)
@pytest.fixture(scope="session")
def ray_cluster():
    """A local two-node Ray cluster serving omni-stream through its entry (cluster_harness)."""
    pytest.importorskip("ray.serve")
    from cluster_harness import LocalCluster

    c = LocalCluster(nodes=2, cpus_per_node=2)
    yield c
    c.shutdown()


@pytest.fixture(params=["direct", pytest.param("cluster", marks=pytest.mark.ray)])
def api_entry(request, monkeypatch):
    """Run a server API test against the single server and against the cluster entry: in the
    cluster case the test module's ``running_server`` deploys the test's backend as a replica
    and yields the entry's URL. Tests marked ``direct_only`` look inside the backend object in
    the test process, which a replica does not share."""
    if request.param == "cluster":
        marker = request.node.get_closest_marker("direct_only")
        if marker is not None:
            pytest.skip(f"single server only: {marker.args[0] if marker.args else ''}")
        cluster = request.getfixturevalue("ray_cluster")
        monkeypatch.setattr(request.module, "running_server", cluster.running_server)
    return request.param


# ---------------------------------------------------------------- lanes (tests/lanes.py)
def pytest_addoption(parser):
    parser.addoption("--torch-threads", type=int, default=None, metavar="N",
                     help="torch threads for the session (default: 2, or 1 on one CPU). "
                          "scripts/test.sh --fast uses 1: the unit lane's tiny models gain "
                          "nothing from a second thread, and on a busy 2-core machine its "
                          "barrier waits cost several times their work")


def pytest_configure(config):
    torch.set_num_threads(config.getoption("torch_threads")
                          or max(1, min(2, os.cpu_count() or 1)))
    for lane, what in LANES.items():
        config.addinivalue_line("markers", f"{lane}: {what}")
    # the OpenAI SDK sends platform.processor(), which runs `uname -p` once per interpreter
    # (cached after): asked here, so that no unit test is the one that starts it
    platform.processor()


def pytest_collection_modifyitems(session, config, items):
    """Mark each test with the lanes its code reaches (``unit`` when none and not ``slow``).
    Tests that start a Ray cluster run last, together: the cluster starts once and its
    background processes do not run beside the rest of the suite."""
    reader = Reader()
    for item in items:
        found = item_lanes(item, reader)
        found |= {lane for lane in STARTS if item.get_closest_marker(lane)}  # hand or param marks
        for lane in sorted(found - {m.name for m in item.iter_markers()}):
            item.add_marker(lane)
        if not found and item.get_closest_marker("slow") is None:
            item.add_marker("unit")
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("ray") is not None)


def _guarded(item):
    """The unit lane's guard for one phase of ``item`` (None outside the unit lane)."""
    return Guard() if item.get_closest_marker("unit") is not None else None


def _phase(item):
    guard = _guarded(item)
    if guard is None:
        return (yield)
    with guard:
        try:
            result = yield
        except Exception as e:
            if guard.seen:  # a start refused here (raised, or failing the code another way)
                raise StartsAProcess(_misread(item, guard.seen)) from e
            raise  # (a module fixture's refusal, cached from an earlier test, stays as it is)
    if guard.seen:  # the refusal was caught and swallowed by the code under test
        raise StartsAProcess(_misread(item, guard.seen))
    return result


def _misread(item, seen: list[str]) -> str:
    return (f"{item.nodeid}: this test {seen[0]}; it belongs to the full lane, but "
            "tests/lanes.py read its code as 'unit' (it starts nothing it names): add what "
            "starts the process to STARTS there, or start it from a fixture listed there")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _phase(item))

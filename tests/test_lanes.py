"""The lanes (tests/lanes.py): a test is read as what it starts, and the unit lane's guard
fails a test that starts a process the reading missed."""

from __future__ import annotations

import asyncio
import importlib
from types import SimpleNamespace

import pytest

from lanes import Guard, Reader, StartsAProcess, item_lanes

# what the unit lane's tests use to start processes, named indirectly on purpose: the reader
# must not see these starts (this module's tests are unit tests), the guard must
subprocess_ = importlib.import_module("subprocess")
mp_ = importlib.import_module("multiprocessing")


# ---------------------------------------------------------------- samples the reader reads
# (never called; the tests look them up by string so that their own reading stays 'unit')
def _sample_pure(x):
    return sorted(x)


def _sample_stages(ck):
    from omni_stream.orchestrator import PipelineBackend, PipelineSettings

    return PipelineBackend(PipelineSettings(model_path=str(ck)))


def _sample_helper_then_subprocess(argv):
    return _sample_child(argv)


def _sample_child(argv):
    import subprocess
    import sys

    return subprocess.run([sys.executable, *argv])


SAMPLE_SPAWN = importlib.import_module("multiprocessing").get_context("spawn")


def _sample_spawn():
    return SAMPLE_SPAWN.Process(target=print)


def _sample_export(cli_main, ck):
    return cli_main(["export-step", "--model", str(ck)])


@pytest.mark.parametrize("unused", [["ray"]])
def _sample_decorated(unused):
    return unused


def _item(name: str, fixtures: dict[str, str] | None = None):
    """A stand-in for a collected test of the sample ``name``, requesting ``fixtures`` (fixture
    name -> the sample that is its function)."""
    defs = {f: [SimpleNamespace(func=globals()[fn])] for f, fn in (fixtures or {}).items()}
    return SimpleNamespace(obj=globals()[name], _fixtureinfo=SimpleNamespace(name2fixturedefs=defs),
                           callspec=None, session=SimpleNamespace(_fixturemanager=None))


@pytest.mark.parametrize("sample, lanes", [
    ("_sample_pure", set()),
    ("_sample_stages", {"process"}),
    ("_sample_helper_then_subprocess", {"process"}),  # through a helper of tests/
    ("_sample_spawn", {"process"}),  # through a module-level value (a spawn context)
    ("_sample_export", {"compile"}),  # a command line whose head is an export
    ("_sample_decorated", set()),  # marks and parameters are not code it runs
])
def test_a_test_is_read_as_what_its_code_starts(sample, lanes):
    assert item_lanes(_item(sample), Reader()) == lanes


def test_fixtures_count_by_their_code_and_their_name():
    reader = Reader()
    assert item_lanes(_item("_sample_pure", {"server": "_sample_stages"}), reader) == {"process"}
    assert item_lanes(_item("_sample_pure", {"ray_cluster": "_sample_pure"}), reader) == {"ray"}
    assert item_lanes(_item("_sample_pure", {"refpy": "_sample_pure"}), reader) == {"reference"}


def test_collected_tests_are_in_the_unit_lane_or_another_never_both(request):
    starting = ("process", "compile", "ray", "reference")
    for item in request.session.items:
        others = [m for m in starting if item.get_closest_marker(m)]
        unit = item.get_closest_marker("unit") is not None
        slow = item.get_closest_marker("slow") is not None
        assert unit != bool(others or slow), (item.nodeid, others, slow)
    assert request.node.get_closest_marker("unit") is not None  # this module starts nothing


# ---------------------------------------------------------------- the guard
def test_guard_refuses_and_remembers_every_way_to_start_a_process():
    with Guard() as g:
        with pytest.raises(StartsAProcess, match=r"starts a subprocess \(true\)"):
            subprocess_.run(["true"])
        with pytest.raises(StartsAProcess, match="multiprocessing process"):
            mp_.process.BaseProcess(target=print, name="p").start()

        async def child():
            await asyncio.create_subprocess_exec("true")

        with pytest.raises(StartsAProcess, match="subprocess"):
            asyncio.run(child())
        try:  # code under test that swallows the refusal cannot hide it
            subprocess_.check_output(["uname", "-p"])
        except Exception:
            pass
    assert len(g.seen) == 4 and "uname -p" in g.seen[-1], g.seen


def test_guard_puts_back_what_it_replaced():
    before = (subprocess_.Popen._execute_child, mp_.process.BaseProcess.start)
    with Guard():
        assert subprocess_.Popen._execute_child is not before[0]
    assert (subprocess_.Popen._execute_child, mp_.process.BaseProcess.start) == before


def test_a_unit_test_whose_start_was_swallowed_fails_naming_the_fix():
    import conftest

    item = SimpleNamespace(nodeid="tests/test_x.py::test_y",
                           get_closest_marker=lambda name: name == "unit" or None)
    phase = conftest._phase(item)
    next(phase)  # the guard is on: the test runs here
    try:
        subprocess_.run(["true"])
    except Exception:
        pass
    with pytest.raises(StartsAProcess, match=r"test_y: this test starts a subprocess \(true\); "
                                             r"it belongs to the full lane"):
        phase.send(None)

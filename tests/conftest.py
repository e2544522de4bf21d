"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from omni_stream.engine.cpu.onednn import pin_decode_isa

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# The client decoders run inside this process in the tests; a client process pins oneDNN's
# level before its bf16 decode (``TorchDecoder``), which only takes before the process's first
# oneDNN call: pin it here, first, as the codec stage does (engine/cpu/onednn.py).
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
    from omni_stream.orchestrator import PipelineBackend, PipelineSettings
    from omni_stream.scheduling.chunking import ChunkPolicy
    from omni_stream.server.app import start_server
    from omni_stream.server.settings import ServerSettings
    from omni_stream.server.testing import serving_in_thread

    settings = PipelineSettings(model_path=str(ckpt), max_streams=2, max_seq_len=1024,
                                max_queue=8, queue_timeout_s=60,
                                schedule=ChunkPolicy(first=1, steady=4))
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


# ---------------------------------------------------------------- the cluster entry (Ray Serve)
@pytest.fixture(scope="session")
def ray_cluster():
    """A local two-node Ray cluster serving omni-stream through its entry (cluster_harness)."""
    pytest.importorskip("ray.serve")
    from cluster_harness import LocalCluster

    c = LocalCluster(nodes=2, cpus_per_node=2)
    yield c
    c.shutdown()


@pytest.fixture(params=["direct", "cluster"])
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


def pytest_collection_modifyitems(session, config, items):
    """Tests that use the Ray cluster run last, together: the cluster starts once and its
    background processes do not run beside the rest of the suite."""
    def uses_cluster(item) -> bool:
        names = getattr(item, "fixturenames", ())
        return "ray_cluster" in names or "api_entry" in names or "base_cluster" in names
    items[:] = sorted(items, key=uses_cluster)

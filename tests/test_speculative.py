"""Speculative code prediction in the frame engine: the codes are the plain path's (greedy and
sampled, batched slots), whatever the draft and lookahead; a draft equal to the full predictor
is always accepted and saves passes; bad settings are refused by name."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from omni_stream.engine import speculative
from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.engine.sampling import SamplingParams
from omni_stream.models.prompt import PromptBuilder, PromptRequest

REQS = [
    PromptRequest(text="Hello world, this is a test.", language="english", speaker="ryan"),
    PromptRequest(text="Good morning! How are you?", language="auto", speaker="vivian"),
]
FRAMES = 10


_PLAIN: dict = {}  # plain runs, computed once per (talker, params, runtime kind)


def _codes(model, talker, params, spec=None, native_kind=None):
    """Frames of codes [slot][frame, G] for REQS (slot 2 left idle inside the batch); on the CPU
    runtime with weight kind ``native_kind``, else on the torch engine."""
    if spec is None:
        key = (id(talker), params, native_kind)
        if key not in _PLAIN:
            _PLAIN[key] = _run(model, talker, params, None, native_kind)
        return _PLAIN[key]
    return _run(model, talker, params, spec, native_kind)


def _run(model, talker, params, spec, native_kind):
    builder = PromptBuilder(model.config, talker, model.tokenizer)
    eng = FrameEngine(talker, EngineShape(max_slots=3, max_seq_len=256))
    if native_kind:
        eng.use_native(native_kind, native_kind, threads=2)
    stats = speculative.enable(eng, *spec).stats if spec else None
    out = [[] for _ in REQS]
    with torch.inference_mode():
        for i, r in enumerate(REQS):
            p = builder.build(r)
            eng.prefill(i, p.embeds, p.trailing, params, 100 + i)
        for _ in range(FRAMES):
            codes, _ = eng.step(3)
            for i in range(len(REQS)):
                out[i].append(codes[i].clone())
    return [torch.stack(o).numpy() for o in out], stats


@pytest.mark.parametrize("params", [SamplingParams.greedy(), SamplingParams()], ids=["greedy", "sampled"])
@pytest.mark.parametrize("lookahead", [1, 3, 15])
def test_speculative_codes_are_the_plain_paths(tiny_model, params, lookahead):
    talker = tiny_model.weights.talker
    plain, _ = _codes(tiny_model, talker, params)
    spec, stats = _codes(tiny_model, talker, params, (1, lookahead))
    for a, b in zip(plain, spec):
        np.testing.assert_array_equal(a, b)
    assert stats.frames == FRAMES and stats.passes >= FRAMES
    assert 0 <= stats.accepted <= stats.drafted


@pytest.mark.parametrize("params", [SamplingParams.greedy(), SamplingParams()], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["f32", "q4"])
def test_on_the_cpu_runtime_the_codes_are_its_plain_frames(tiny_model, params, kind):
    """The runtime's speculative frame (its stack step over the first layers as the draft, one
    multi-token step per verification) gives exactly the codes of its one-call plain frame, with
    exact and with 4-bit weights (each row's products do not depend on the rows beside it)."""
    pytest.importorskip("omni_stream.engine.cpu.native")
    talker = tiny_model.weights.talker
    plain, _ = _codes(tiny_model, talker, params, native_kind=kind)
    spec, stats = _codes(tiny_model, talker, params, (1, 3), native_kind=kind)
    for a, b in zip(plain, spec):
        np.testing.assert_array_equal(a, b)
    assert stats.frames == FRAMES and stats.passes >= FRAMES


@pytest.fixture(scope="module")
def identity_tail_talker(tiny_model):
    """The tiny talker with its code predictor's last layer made the identity (its attention
    output and MLP down projections zero): a first-layer draft then IS the full predictor."""
    talker = copy.deepcopy(tiny_model.weights.talker)
    last = talker.code_predictor.model.layers[-1]
    with torch.no_grad():
        last.self_attn.o_proj.weight.zero_()
        last.mlp.down_proj.weight.zero_()
    return talker


@pytest.mark.parametrize("params", [SamplingParams.greedy(), SamplingParams()], ids=["greedy", "sampled"])
def test_a_draft_equal_to_the_predictor_is_always_accepted(tiny_model, identity_tail_talker, params):
    """Every draft accepted: with lookahead 4 a frame's 15 codes take 3 verification passes
    (codes 1-4 drafted after code 0, 6-9 after 5, 11-14 after 10) instead of 15 sub-steps, and
    the codes are still the plain path's."""
    plain, _ = _codes(tiny_model, identity_tail_talker, params)
    spec, stats = _codes(tiny_model, identity_tail_talker, params, (1, 4))
    for a, b in zip(plain, spec):
        np.testing.assert_array_equal(a, b)
    assert stats.acceptance == 1.0 and stats.passes_per_frame == 3.0
    pytest.importorskip("omni_stream.engine.cpu.native")
    native_spec, native_stats = _codes(tiny_model, identity_tail_talker, params, (1, 4), "f32")
    native_plain, _ = _codes(tiny_model, identity_tail_talker, params, native_kind="f32")
    for a, b in zip(native_plain, native_spec):
        np.testing.assert_array_equal(a, b)
    assert native_stats.acceptance == 1.0 and native_stats.passes_per_frame == 3.0


def test_bad_settings_are_refused_by_name(tiny_model):
    eng = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=1, max_seq_len=64))
    n = tiny_model.weights.talker.code_predictor.model.cfg.num_hidden_layers
    for layers in (0, n, -1, 1.5):
        with pytest.raises(ValueError, match="draft_layers"):
            speculative.enable(eng, layers)
    for look in (0, -3, 2.0):
        with pytest.raises(ValueError, match="lookahead"):
            speculative.enable(eng, 1, look)


def _serve_args(*argv):
    from omni_stream.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_flag_reaches_the_talker_stage_and_bad_values_are_refused(tiny_ckpt, monkeypatch,
                                                                        tmp_path):
    """``--speculative-cp LAYERS[:LOOKAHEAD]`` becomes the talker stage's (layers, lookahead),
    checked against the checkpoint's code predictor; it is refused by name with the split
    placement and CUDA graphs."""
    from omni_stream.cli import pipeline_settings
    from omni_stream.edge.probe import load_profile
    from omni_stream.orchestrator import PipelineSettings
    from omni_stream.orchestrator.pipeline import stage_specs

    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))
    hw = load_profile(env={"OMNI_STREAM_HW_PROFILE": '{"hardware_class": "x86_cpu"}'}, use_torch=False)
    base = ("--model", str(tiny_ckpt), "--engine", "torch")
    s, _, _ = pipeline_settings(_serve_args(*base, "--speculative-cp", "1:3"), hw)
    assert s.speculative_cp == (1, 3) and stage_specs(s)["talker"].speculative_cp == (1, 3)
    s, _, _ = pipeline_settings(_serve_args(*base, "--speculative-cp", "1"), hw)
    assert s.speculative_cp == (1, 4)  # the default lookahead
    assert pipeline_settings(_serve_args(*base), hw)[0].speculative_cp is None
    for bad in ("2", "0", "1:0", "x", "1:y", ""):  # the tiny code predictor has 2 layers
        with pytest.raises(ValueError, match="--speculative-cp"):
            pipeline_settings(_serve_args(*base, "--speculative-cp", bad), hw)
    with pytest.raises(ValueError, match="placement 'together'"):
        PipelineSettings(model_path="m", placement="split", speculative_cp=(1, 4))
    with pytest.raises(ValueError, match="CUDA graphs"):
        PipelineSettings(model_path="m", device="cuda", cuda_graphs=True, speculative_cp=(1, 4))


def test_a_speculative_server_streams_the_plain_servers_audio(tiny_ckpt):
    """End to end on a real pipeline: a seeded request to a server whose code predictor drafts
    and verifies gives the offline (plain) synthesis' audio, within 1 LSB."""
    from omni_stream.engine.synthesis import Synthesizer
    from omni_stream.orchestrator import PipelineBackend
    from omni_stream.server.testing import serving_in_thread
    from omni_stream.server.app import start_server
    import json
    import urllib.request

    from tests.servers import tiny_settings

    text, frames = "Drafted and verified, frame by frame.", 20
    ref = Synthesizer.from_path(tiny_ckpt).synthesize(
        PromptRequest(text=text, language="english", speaker="ryan"), SamplingParams(), seed=321,
        max_frames=frames)
    backend = PipelineBackend(tiny_settings(tiny_ckpt, speculative_cp=(1, 3)))
    body = {"input": text, "voice": "ryan", "language": "english", "response_format": "pcm",
            "seed": 321, "max_new_tokens": frames}
    with serving_in_thread(lambda: start_server(backend, "127.0.0.1", 0), timeout=300) as url:
        req = urllib.request.Request(f"{url}/v1/audio/speech", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            audio = np.frombuffer(r.read(), dtype="<i2")
    assert len(audio) == len(ref.codes) * 1920 > 0
    expected = np.clip(ref.audio, -1, 1) * 32767.0
    assert np.abs(audio.astype(np.float64) - expected).max() <= 1.0 + 1e-6

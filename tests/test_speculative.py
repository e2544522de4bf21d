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


def _codes(model, talker, params, spec=None):
    """Frames of codes [slot][frame, G] for REQS (slot 2 left idle inside the batch)."""
    builder = PromptBuilder(model.config, talker, model.tokenizer)
    eng = FrameEngine(talker, EngineShape(max_slots=3, max_seq_len=256))
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


def test_bad_settings_are_refused_by_name(tiny_model):
    eng = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=1, max_seq_len=64))
    n = tiny_model.weights.talker.code_predictor.model.cfg.num_hidden_layers
    for layers in (0, n, -1, 1.5):
        with pytest.raises(ValueError, match="draft_layers"):
            speculative.enable(eng, layers)
    for look in (0, -3, 2.0):
        with pytest.raises(ValueError, match="lookahead"):
            speculative.enable(eng, 1, look)
    eng.native = object()  # any native runner
    with pytest.raises(ValueError, match="torch engine"):
        speculative.enable(eng, 1)

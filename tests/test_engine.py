"""Frame engine: batching across slots, prompt modes, sampling determinism, bad requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.models.prompt import PromptBuilder, PromptError, PromptRequest
from omni_stream.engine.sampling import SamplingParams
from omni_stream.engine.synthesis import Synthesizer

REQS = [
    PromptRequest(text="Hello world, this is a test.", language="english", speaker="ryan"),
    PromptRequest(text="Good morning! How are you?", language="auto", speaker="vivian"),
    PromptRequest(text="Numbers like 42.", language="chinese", speaker="eric"),  # dialect speaker
]


@pytest.fixture(scope="module")
def synth(tiny_model):
    return Synthesizer(tiny_model, max_seq_len=512)


def _run_batched(model, reqs, params, seeds, frames):
    builder = PromptBuilder(model.config, model.weights.talker, model.tokenizer)
    eng = FrameEngine(model.weights.talker, EngineShape(max_slots=len(reqs) + 1, max_seq_len=512))
    out = [[] for _ in reqs]
    with torch.inference_mode():
        for i, r in enumerate(reqs):
            p = builder.build(r)
            eng.prefill(i, p.embeds, p.trailing, params, seeds[i])
        for _ in range(frames):
            codes, _ = eng.step(len(reqs))
            for i in range(len(reqs)):
                out[i].append(codes[i].clone())
    return [torch.stack(o).numpy() for o in out]


@pytest.mark.parametrize("params", [SamplingParams.greedy(), SamplingParams()], ids=["greedy", "sampled"])
def test_batched_equals_single(synth, tiny_model, params):
    """A stream's codes do not depend on which other streams share the batch."""
    frames = 12
    seeds = [11, 22, 33]
    batched = _run_batched(tiny_model, REQS, params, seeds, frames)
    for i, r in enumerate(REQS):
        single, _, _ = synth.generate_codes(r, params, seeds[i], frames)
        np.testing.assert_array_equal(single[:frames], batched[i][: len(single)])


def test_seeded_sampling_is_reproducible_and_seed_dependent(synth):
    p = SamplingParams()
    a, _, _ = synth.generate_codes(REQS[0], p, 7, 10)
    b, _, _ = synth.generate_codes(REQS[0], p, 7, 10)
    c, _, _ = synth.generate_codes(REQS[0], p, 8, 10)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_codes_in_range_and_no_control_ids(synth):
    codes, _, _ = synth.generate_codes(REQS[1], SamplingParams(), 3, 20)
    assert codes.shape[1] == 16 and 0 < len(codes) <= 20
    assert codes.min() >= 0 and codes[:, 1:].max() < 2048
    assert codes[:, 0].max() < 2048  # suppressed control ids never sampled


def test_text_streaming_mode_differs_and_runs(synth):
    base = REQS[0]
    streamed = PromptRequest(text=base.text, language=base.language, speaker=base.speaker, stream_text=True)
    p1 = synth.builder.build(base)
    p2 = synth.builder.build(streamed)
    n = len(p1.text_ids)
    assert p2.length == p1.length - n - 1  # text and tts_eos move out of the prefill
    assert p2.trailing.shape[0] == n  # t2..tn + tts_eos
    codes, _, _ = synth.generate_codes(streamed, SamplingParams.greedy(), 0, 5)
    assert codes.shape == (5, 16)


def test_prompt_layout_length(synth, tiny_model):
    p = synth.builder.build(REQS[0])
    # role 3 + codec prefix (think, think_bos, lang, think_eos, spk, pad) 6 + text + tts_eos + bos
    assert p.length == 3 + 6 + len(p.text_ids) + 1 + 1
    auto = synth.builder.build(PromptRequest(text=REQS[0].text, language="auto", speaker="ryan"))
    assert auto.length == p.length - 1  # nothink prefix has no language slot


@pytest.mark.parametrize("req,msg", [
    (PromptRequest(text="", speaker="ryan"), "empty"),
    (PromptRequest(text="   ", speaker="ryan"), "empty"),
    (PromptRequest(text="hi", speaker="nobody"), "unknown voice 'nobody'"),
    (PromptRequest(text="hi", speaker="ryan", language="klingon"), "unknown language 'klingon'"),
    (PromptRequest(text="hi", speaker="ryan", language="sichuan_dialect"), "unknown language"),
])
def test_bad_requests(synth, req, msg):
    with pytest.raises(PromptError, match=msg):
        synth.builder.build(req)


def test_voice_design_rejects_named_voice(ckpt_factory):
    from omni_stream.checkpoints.io import load_model

    m = load_model(ckpt_factory("tiny", "voice_design", 3))
    b = PromptBuilder(m.config, m.weights.talker, m.tokenizer)
    with pytest.raises(PromptError, match="no named voices"):
        b.build(PromptRequest(text="hi", speaker="ryan", instructions="a calm voice"))
    p = b.build(PromptRequest(text="hi there", instructions="a calm low voice"))
    assert p.instruct_ids is not None and p.instruct_ids[0] == 151644


def test_prompt_too_long_for_engine(tiny_model):
    s = Synthesizer(tiny_model, max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        s.generate_codes(REQS[0], SamplingParams.greedy(), 0, 10)


def test_static_live_mode_matches_dynamic(tiny_model):
    """The graph-capturable mode (masked full-cache attention, no host sync) gives the same codes."""
    from omni_stream.engine.graphs import GraphedStep, padded_sizes

    params = SamplingParams()
    dyn = _run_batched(tiny_model, REQS[:2], params, [5, 6], 6)
    builder = PromptBuilder(tiny_model.config, tiny_model.weights.talker, tiny_model.tokenizer)
    eng = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=3, max_seq_len=512))
    eng.static_live = True
    runner = GraphedStep(eng, enabled=False)
    out = [[], []]
    with torch.inference_mode():
        for i, r in enumerate(REQS[:2]):
            p = builder.build(r)
            eng.prefill(i, p.embeds, p.trailing, params, [5, 6][i])
        for _ in range(6):
            codes, _ = runner.step(2)
            for i in range(2):
                out[i].append(codes[i].clone())
    for i in range(2):
        np.testing.assert_array_equal(torch.stack(out[i]).numpy(), dyn[i])
    assert padded_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert runner.sizes == [1, 2, 3] and runner.bucket(3) == 3
    with pytest.raises(ValueError, match="exceeds max_slots"):
        runner.bucket(4)


def test_chunked_prefill_equals_whole(tiny_model):
    """Feeding the prompt in pieces (throttled prefill), with decode steps of another stream
    running over the half-prefilled slot in between, gives the same stream."""
    params = SamplingParams()
    builder = PromptBuilder(tiny_model.config, tiny_model.weights.talker, tiny_model.tokenizer)
    p = builder.build(REQS[0])
    other = builder.build(REQS[1])
    outs = []
    for pieces in ([p.length], [3, 5, p.length - 8], [1] * p.length):
        eng = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=2, max_seq_len=256))
        start, code0 = 0, None
        with torch.inference_mode():
            eng.prefill(0, other.embeds, other.trailing, params, 1)
            for i, n in enumerate(pieces):
                last = i == len(pieces) - 1
                code0 = eng.prefill(1, p.embeds[start:start + n], p.trailing, params, 9,
                                    start=start, final=last)
                assert (code0 is None) != last
                start += n
                if not last:
                    eng.step(2)  # the running stream in slot 0 keeps going
            frames = [eng.step(2)[0][1].clone() for _ in range(5)]
        outs.append((code0, torch.stack(frames)))
    for c, f in outs[1:]:
        assert c == outs[0][0]
        torch.testing.assert_close(f, outs[0][1], rtol=0, atol=0)
    eng = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=1, max_seq_len=256))
    with pytest.raises(ValueError, match="holds 0 prompt positions"):
        eng.prefill(0, p.embeds[:2], p.trailing, params, 0, start=4)


@pytest.mark.parametrize("where", ["talker", "code_predictor"])
def test_a_poisoned_row_is_invalid_and_leaves_the_others_and_its_slot_clean(synth, tiny_model, where):
    """NaN in one slot's talker input (or the hidden state its code predictor reads) makes that
    row INVALID at once; the other rows' codes are bit-identical to a clean run; after
    ``scrub`` the slot serves a new stream exactly as a fresh engine would (no NaN left in its
    KV rows, which masked attention would still multiply by zero)."""
    from omni_stream.engine.sampling import INVALID

    params, seeds, frames, bad_at = SamplingParams(), [11, 22, 33], 8, 3
    clean = _run_batched(tiny_model, REQS, params, seeds, frames)
    builder = PromptBuilder(tiny_model.config, tiny_model.weights.talker, tiny_model.tokenizer)
    eng = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=4, max_seq_len=512))
    with torch.inference_mode():
        for i, r in enumerate(REQS):
            p = builder.build(r)
            eng.prefill(i, p.embeds, p.trailing, params, seeds[i])
        for f in range(frames):
            if f == bad_at:
                eng.inject_fault(1, "talker" if where == "talker" else "code_predictor")
            codes, code0 = eng.step(3)
            if f == bad_at:
                assert code0[1].item() == INVALID and code0[0].item() != INVALID
                eng.scrub(1)
            for i in (0, 2):
                np.testing.assert_array_equal(codes[i].numpy(), clean[i][f])
        assert all(bool(torch.isfinite(k[1]).all()) for k, _ in eng.kv.layers)
        # the scrubbed slot takes a new stream while slot 0 and 2 keep running
        p = builder.build(REQS[1])
        eng.prefill(1, p.embeds, p.trailing, params, 99)
        again = [eng.step(3)[0][1].clone().numpy() for _ in range(5)]
    fresh, _, _ = synth.generate_codes(REQS[1], params, 99, 5)
    np.testing.assert_array_equal(np.stack(again), fresh)

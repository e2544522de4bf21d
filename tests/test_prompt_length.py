"""models.prompt.prompt_length counts what PromptBuilder.build lays out, position for position,
without building embeddings: text (every language slot, a dialect speaker), instructions,
text streaming, continuous text, x-vector and ICL clones, on tiny checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_stream.checkpoints.io import load_model
from omni_stream.models.prompt import PromptBuilder, PromptRequest, prompt_length, speech_ids
from omni_stream.models.voice_clone import VoiceClone

TEXT = "Good morning, this is a test of the prompt length."


@pytest.fixture(scope="module", params=["custom_voice", "voice_design", "base"])
def model(request, ckpt_factory):
    return load_model(ckpt_factory("tiny", request.param, 0), dtype=torch.float32)


def _requests(m) -> list[PromptRequest]:
    cfg = m.config
    speakers = sorted(cfg.talker.speakers)
    out = [PromptRequest(text=TEXT), PromptRequest(text=TEXT, language="english"),
           PromptRequest(text="Hi.", language="chinese"),
           PromptRequest(text=TEXT, stream_text=True),
           PromptRequest(text="", text_ids=(11, 12, 13), stream_text=True, text_open=True),
           PromptRequest(text="", text_ids=(11, 12, 13))]
    if cfg.variant != "base":
        out += [PromptRequest(text=TEXT, instructions="Speak slowly and warmly."),
                PromptRequest(text=TEXT, instructions="  ", language="english")]
    for spk in speakers[:2] + [s for s in ("eric", "dylan") if s in cfg.talker.speakers]:
        out += [PromptRequest(text=TEXT, speaker=spk),
                PromptRequest(text=TEXT, speaker=spk, language="chinese"),
                PromptRequest(text=TEXT, speaker=spk, language="english", stream_text=True)]
    if cfg.variant == "base":
        g = np.random.default_rng(0)
        xv = g.standard_normal(cfg.talker.lm.hidden_size).astype(np.float32)
        for frames in (None, 1, 5, 40):
            codes = None if frames is None else g.integers(0, 2048, size=(frames, 16))
            c = VoiceClone(xv, codes, None if codes is None else "The quick brown fox.")
            for stream_text in (False, True):
                out += [PromptRequest(text=TEXT, clone=c, stream_text=stream_text),
                        PromptRequest(text=TEXT, clone=c, language="english",
                                      stream_text=stream_text)]
        out.append(PromptRequest(text=TEXT, speaker_embedding=torch.from_numpy(xv)))
        c = VoiceClone(xv, g.integers(0, 2048, size=(3, 16)), "Hi.")
        out.append(PromptRequest(text="", clone=c, stream_text=True, text_open=True,
                                 text_ids=tuple(range(100, 110))))
    return out


def test_prompt_length_is_the_built_prompts_length(model):
    builder = PromptBuilder(model.config, model.weights.talker, model.tokenizer)
    reqs = _requests(model)
    assert len(reqs) >= 8
    for req in reqs:
        built = builder.build(req).length
        assert prompt_length(model.config, model.tokenizer, req) == built, req
        n = len(req.text_ids) if req.text_ids is not None else len(
            speech_ids(model.tokenizer, req.text))
        assert prompt_length(model.config, model.tokenizer, req, text_tokens=n) == built, req

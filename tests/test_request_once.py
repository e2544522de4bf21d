"""A request is validated once and tokenized once on its way to the talker (issue 40): the
server's ``resolve_options`` is the one ``Backend.validate`` of a job (``stream`` trusts jobs it
marked, checks any other), and ``models.prompt.tokenize_prompt`` makes every token id the
prompt needs, which travel to the talker stage in ``PromptSpec`` so that the stage builds the
prompt without its tokenizer."""

from __future__ import annotations

import aiohttp
import msgspec
import numpy as np
import pytest
import torch

from omni_stream.checkpoints.io import load_model
from omni_stream.contract import SpeechJob
from omni_stream.errors import RequestError
from omni_stream.models.prompt import PromptBuilder, PromptRequest, prompt_length, tokenize_prompt
from omni_stream.models.voice_clone import VoiceClone
from omni_stream.orchestrator.backend import prompt_spec
from omni_stream.server.fake_backend import FakeBackend
from omni_stream.server.testing import post_speech as post
from omni_stream.server.testing import run_async as arun
from omni_stream.server.testing import running_server
from omni_stream.stages.talker_stage import prompt_request
from omni_stream.transport import AddStream

WS_PATH = "/v1/audio/speech/stream"


class CountingBackend(FakeBackend):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.validations = 0

    def validate(self, job: SpeechJob) -> None:
        self.validations += 1
        super().validate(job)


def test_http_request_is_validated_once_and_a_bad_one_refused():
    async def main():
        b = CountingBackend()
        async with running_server(b) as url, aiohttp.ClientSession() as s:
            out = []
            for body in ({"input": "Hello there.", "voice": "alloy", "response_format": "pcm"},
                         {"input": "Hi.", "response_format": "pcm", "stream": True},
                         {"input": "Hi.", "language": "klingon"}):
                status, _, _ = await post(s, url, body)
                out.append((status, b.validations))
            return out

    assert arun(main()) == [(200, 1), (200, 2), (400, 3)]


def test_ws_session_validates_its_config_not_each_utterance():
    async def main():
        b = CountingBackend()
        async with running_server(b) as url, aiohttp.ClientSession() as s, \
                s.ws_connect(url + WS_PATH) as ws:
            assert (await ws.receive_json())["type"] == "session.created"
            await ws.send_json({"type": "session.config", "voice": "alloy",
                                "response_format": "pcm"})
            assert (await ws.receive_json())["type"] == "session.updated"
            after_config = b.validations
            await ws.send_json({"type": "input.text",
                                "text": "One sentence. Two sentences. Three sentences."})
            await ws.send_json({"type": "input.done"})
            await ws.send_json({"type": "session.close"})
            starts = 0
            while True:
                msg = await ws.receive(timeout=10)
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                ev = msg.json()
                starts += ev["type"] == "audio.start"
                if ev["type"] == "session.done":
                    break
            return after_config, starts, b.validations, len(b.jobs)

    after_config, starts, total, jobs = arun(main())
    assert starts == jobs == 3
    assert total == after_config  # three utterances, no validation past the config's


@pytest.mark.parametrize("kw", [dict(voice="nobody"), dict(language="klingon"),
                                dict(max_frames=0)])
def test_a_job_the_server_did_not_validate_is_checked_by_stream(kw):
    async def main():
        b = CountingBackend()
        await b.start()
        try:
            async for _ in b.stream(SpeechJob(text="Hi.", request_id="r", **kw)):
                pass
        finally:
            await b.close()

    with pytest.raises(RequestError) as e:
        arun(main())
    assert e.value.status == 400


# --- tokenized once --------------------------------------------------------------------------
class NoTokenizer:
    """A tokenizer that must not be used: the ids all came with the request."""

    def encode(self, text: str):
        raise AssertionError(f"tokenized again: {text!r}")


@pytest.fixture(scope="module", params=["custom_voice", "voice_design", "base"])
def model(request, ckpt_factory):
    return load_model(ckpt_factory("tiny", request.param, 0), dtype=torch.float32)


def _requests(m) -> list[PromptRequest]:
    cfg = m.config
    spk = sorted(cfg.talker.speakers)[:1]
    texts = ["Good morning, this is a test.", "\nA line break first.", "\n\n  Two, then blanks.",
             "Ünïcödé, CamelCase and 42 numbers!"]
    out = [PromptRequest(text=t, speaker=(spk or [None])[0], language=lang, stream_text=st)
           for t in texts for lang in ("auto", "english") for st in (False, True)]
    if cfg.supports_instructions:
        out += [PromptRequest(text=texts[0], instructions="Speak slowly and warmly."),
                PromptRequest(text=texts[1], instructions="\nWhisper.", stream_text=True)]
    if cfg.variant == "base":
        g = np.random.default_rng(1)
        xv = g.standard_normal(cfg.talker.lm.hidden_size).astype(np.float32)
        for frames in (None, 2, 30):
            codes = None if frames is None else g.integers(0, 2048, size=(frames, 16))
            c = VoiceClone(xv, codes, None if codes is None else "\nThe quick brown fox.")
            out += [PromptRequest(text=texts[0], clone=c, stream_text=st) for st in (False, True)]
    return out


def _same(a, b) -> bool:
    return (torch.equal(a.embeds, b.embeds) and torch.equal(a.trailing, b.trailing)
            and list(a.text_ids) == list(b.text_ids) and a.instruct_ids == b.instruct_ids)


def test_tokenized_request_builds_the_same_prompt_without_a_tokenizer(model):
    cfg = model.config
    with_tok = PromptBuilder(cfg, model.weights.talker, model.tokenizer)
    without = PromptBuilder(cfg, model.weights.talker, NoTokenizer())
    for req in _requests(model):
        ids = tokenize_prompt(cfg, model.tokenizer, req)
        assert tokenize_prompt(cfg, NoTokenizer(), ids) == ids  # nothing made twice
        built = with_tok.build(req)
        assert _same(without.build(ids), built), req
        assert prompt_length(cfg, NoTokenizer(), ids) == built.length, req


def test_the_role_keeps_a_leading_line_break_merged_as_the_template_tokenizes_it(model):
    """The text's template is tokenized whole: a text that starts with line breaks can merge
    them with the role's, and the role ids carried to the stage are the merged ones."""
    tok, cfg = model.tokenizer, model.config
    whole = tok.encode("<|im_start|>assistant\n\n\nLine breaks first.<|im_end|>\n"
                       "<|im_start|>assistant\n")
    ids = tokenize_prompt(cfg, tok, PromptRequest(text="\n\nLine breaks first."))
    assert list(ids.role_ids) == whole[:3] and list(ids.text_ids) == whole[3:-5]


def test_the_wire_carries_the_ids_to_the_stage(model):
    """The server's PromptSpec (backend.prompt_spec), through msgspec, back into the stage's
    PromptRequest (talker_stage.prompt_request): the stage builds the same prompt as from the
    text, with no tokenizer."""
    cfg = model.config
    without = PromptBuilder(cfg, model.weights.talker, NoTokenizer())
    with_tok = PromptBuilder(cfg, model.weights.talker, model.tokenizer)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(AddStream)
    for req in _requests(model):
        job = SpeechJob(text=req.text, request_id="r", voice=req.speaker, language=req.language,
                        instructions=req.instructions, clone=req.clone)
        ids = tokenize_prompt(cfg, model.tokenizer, replace_stream(req, job))
        spec = dec.decode(enc.encode(AddStream(stream_id=1, prompt=prompt_spec(
            job, ids, job.instructions, continuous=False)))).prompt
        clone = (VoiceClone(*spec.clone.arrays(), spec.clone.ref_text)
                 if spec.clone is not None else None)
        got = without.build(prompt_request(spec, clone, text_open=False))
        assert _same(got, with_tok.build(replace_stream(req, job))), req


def replace_stream(req: PromptRequest, job: SpeechJob) -> PromptRequest:
    """The request as the server lays it out: a cloned voice streams its text."""
    from dataclasses import replace
    return replace(req, stream_text=job.clone is not None)


def test_out_of_range_ids_from_the_wire_are_refused(model):
    from omni_stream.models.prompt import PromptError
    cfg = model.config
    b = PromptBuilder(cfg, model.weights.talker, NoTokenizer())
    ok = tokenize_prompt(cfg, model.tokenizer, PromptRequest(text="Hello."))
    vocab = cfg.talker.text_vocab_size
    from dataclasses import replace
    for bad in (dict(role_ids=(0, 1)), dict(role_ids=(0, 1, vocab)), dict(text_ids=()),
                dict(text_ids=(-1,)), dict(text_ids=(2**63 - 1,)),
                dict(instruct_ids=(vocab,), instructions="x"), dict(ref_ids=(-5,))):
        with pytest.raises(PromptError):
            b.build(replace(ok, **bad))

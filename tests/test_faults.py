"""A fault fails its stream only: fault injection in each stage against the real pipeline.

Four streams run together; one of them is made to fail inside the talker, the code predictor
(co-located and in its own process) or the codec stage (``stages.faults``), with the torch
engine and with the native CPU runtime (exact weights: the same codes as the torch engine).
That stream gets an ``error`` event naming the invalid code; the other three finish complete
and their codes are bit-identical to a run without the fault; the stages keep running (no
restart), and the slots come back.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from omni_stream.orchestrator import PipelineBackend
from omni_stream.server.testing import run_async, running_server
from omni_stream.stages.faults import FAULTS_ENV, FaultPlan
from tests.servers import tiny_settings

pytestmark = pytest.mark.timeout(600)

TEXTS = ["The first stream says something long enough.",
         "A second voice joins the batch right away.",
         "Stream number three keeps on talking here.",
         "And the fourth one closes the little group."]
FRAMES = 16
FAULT_FRAME = 4


async def _ws_codes(s: aiohttp.ClientSession, url: str, text: str) -> tuple[np.ndarray, dict | None]:
    """One greedy utterance over the WebSocket in codec-frames mode: (codes [n, 16], error)."""
    async with s.ws_connect(url + "/v1/audio/speech/stream") as ws:
        await ws.send_json(dict(type="session.config", voice="ryan", language="english",
                                greedy=True, codec_frames=True, max_new_tokens=FRAMES,
                                split_sentences=False))
        await ws.send_json(dict(type="input.text", text=text))
        await ws.send_json(dict(type="session.close"))
        got, err = [], None
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                got.append(np.frombuffer(msg.data, dtype="<i8").reshape(-1, 16))
            elif msg.type == aiohttp.WSMsgType.TEXT:
                ev = json.loads(msg.data)
                if ev["type"] == "error":
                    err = ev
                elif ev["type"] == "audio.done":
                    assert ev["finish_reason"] == "length"  # 16 frames < the text's frames
        codes = np.concatenate(got) if got else np.zeros((0, 16), np.int64)
        return codes, err


def _run(ck, placement: str, engine: str = "torch") -> tuple[list[tuple[np.ndarray, dict | None]], dict]:
    async def main():
        backend = PipelineBackend(tiny_settings(ck, max_streams=4, max_seq_len=256,
                                                placement=placement, engine=engine))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            out = await asyncio.gather(*[_ws_codes(s, url, t) for t in TEXTS])
            for _ in range(50):  # cancellations of failed streams settle within a frame or two
                if backend.stats()["slots_free"] == 4:
                    break
                await asyncio.sleep(0.05)
            return out, backend.stats()

    return run_async(main(), timeout=300)


@pytest.fixture(scope="module")
def baseline(tiny_ckpt):
    """The run without a fault: offline synthesis, which the server's greedy codes equal."""
    from omni_stream.models.prompt import PromptRequest
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer

    synth = Synthesizer.from_path(tiny_ckpt)
    out = [synth.generate_codes(PromptRequest(text=t, language="english", speaker="ryan"),
                                SamplingParams.greedy(), 0, FRAMES)[0] for t in TEXTS]
    assert all(len(c) == FRAMES for c in out)
    return out


def test_without_a_fault_every_stream_equals_offline_synthesis(tiny_ckpt, baseline, monkeypatch):
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    out, stats = _run(tiny_ckpt, "together")
    for (codes, err), ref in zip(out, baseline):
        assert err is None
        np.testing.assert_array_equal(codes, ref)
    assert stats["streams_failed"] == 0 and stats["slots_free"] == 4


@pytest.mark.parametrize("stage,placement,engine", [("talker", "together", "torch"),
                                                    ("code_predictor", "together", "torch"),
                                                    ("code_predictor", "split", "torch"),
                                                    ("codec", "together", "torch"),
                                                    ("talker", "together", "native"),
                                                    ("code_predictor", "split", "native")])
def test_a_fault_in_one_stage_fails_that_stream_only(tiny_ckpt, baseline, monkeypatch, stage,
                                                     placement, engine):
    # stream ids are handed out 1, 2, 3, ... per backend: the fault hits whichever text got 2
    monkeypatch.setenv(FAULTS_ENV, f"{stage}:2:{FAULT_FRAME}")
    out, stats = _run(tiny_ckpt, placement, engine)
    failed = [i for i, (_, err) in enumerate(out) if err is not None]
    assert len(failed) == 1, [err for _, err in out]
    codes, err = out[failed[0]]
    assert err["error"]["code"] == "synthesis_failed" and "invalid" in err["error"]["message"]
    assert len(codes) <= FAULT_FRAME + 1  # nothing after the fault; never an invalid code
    assert codes.size == 0 or (codes.min() >= 0 and codes.max() < 2048)
    np.testing.assert_array_equal(codes, baseline[failed[0]][:len(codes)])
    for i, (c, e) in enumerate(out):
        if i != failed[0]:
            np.testing.assert_array_equal(c, baseline[i])  # complete and bit-identical
    assert stats["stage_restarts"] == 0 and stats["streams_failed"] == 1
    assert stats["streams_failed_invalid_code"] == 1
    assert stats["slots_free"] == 4 and stats["active_streams"] == 0


def test_fault_plan_parsing():
    plan = FaultPlan.parse("talker:3:5, codec:7:0")
    assert plan.fires("talker", 3, 5) and not plan.fires("talker", 3, 4)
    assert plan.fires("codec", 7, 0) and not plan.fires("code_predictor", 3, 5)
    assert not FaultPlan.parse("")
    for bad in ("talker:3", "gpu:1:2", "talker:x:1"):
        with pytest.raises(ValueError, match=FAULTS_ENV):
            FaultPlan.parse(bad)

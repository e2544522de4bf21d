"""WebSocket /v1/audio/speech/stream over a real socket, against FakeBackend."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json

import aiohttp
import numpy as np
import pytest

from omni_stream.server.audio import to_s16le
from omni_stream.server.fake_backend import FakeBackend, expected_frames, fake_audio, fake_codes
from omni_stream.server.settings import ServerSettings
from omni_stream.server.testing import run_async as arun
from omni_stream.server.testing import backend_stats, running_server, served_here, wait_backend
from omni_stream.server.ws import split_sentences

# every test here runs against the single server and against the cluster entry (conftest)
pytestmark = pytest.mark.usefixtures("api_entry")

WS_PATH = "/v1/audio/speech/stream"


@contextlib.asynccontextmanager
async def ws_session(backend: FakeBackend | None = None, settings: ServerSettings | None = None):
    """A server and one connected session, past its session.created."""
    async with running_server(backend or FakeBackend(), settings) as url, \
            aiohttp.ClientSession() as s, s.ws_connect(url + WS_PATH) as ws:
        assert (await ws.receive_json())["type"] == "session.created"
        yield ws


async def read_until(ws, event_type: str) -> list:
    """Messages up to and including the JSON event ``event_type``: dicts and bytes."""
    out = []
    while True:
        msg = await ws.receive(timeout=10)
        if msg.type == aiohttp.WSMsgType.BINARY:
            out.append(msg.data)
        elif msg.type == aiohttp.WSMsgType.TEXT:
            out.append(json.loads(msg.data))
            if out[-1]["type"] == event_type:
                return out
        else:
            raise AssertionError(f"socket ended: {msg.type} {ws.close_code} after {out}")


def utterances(messages: list) -> list[tuple[dict, bytes, dict]]:
    """(audio.start, concatenated binary audio, audio.done) per utterance."""
    out, start, parts = [], None, []
    for m in messages:
        if isinstance(m, bytes):
            assert start is not None
            parts.append(m)
        elif m["type"] == "audio.start":
            start, parts = m, []
        elif m["type"] == "audio.done":
            assert m["request_id"] == start["request_id"]
            out.append((start, b"".join(parts), m))
            start = None
    return out


def test_session_with_two_utterances_split_at_sentences():
    async def main():
        backend = FakeBackend()
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            async with s.ws_connect(url + WS_PATH) as ws:
                created = await ws.receive_json()
                await ws.send_json({"type": "session.config", "voice": "alloy", "seed": 5,
                                    "language": "english", "response_format": "pcm"})
                updated = await ws.receive_json()
                # text arrives in pieces, as from an LLM; the first sentence completes mid-piece
                for piece in ("Hello there, my ", "friend. How are", " you today?"):
                    await ws.send_json({"type": "input.text", "text": piece})
                await ws.send_json({"type": "input.done"})
                await ws.send_json({"type": "session.close"})
                messages = await read_until(ws, "session.done")
                closing = await ws.receive()
                return created, updated, messages, closing, ws.close_code, backend

    created, updated, messages, closing, code, backend = arun(main())
    assert created["type"] == "session.created" and created["session"]["sample_rate"] == 24000
    assert updated["type"] == "session.updated" and updated["session"]["voice"] == "vivian"
    utts = utterances(messages)
    assert [u[0]["text"] for u in utts] == ["Hello there, my friend.", "How are you today?"]
    for start, audio, done in utts:
        frames = expected_frames(start["text"])
        assert start["format"] == "pcm_s16le" and start["sample_rate"] == 24000
        assert audio == to_s16le(fake_audio(5, 0, frames * 1920))
        assert done["usage"]["output_tokens"] == frames
        assert done["usage"]["total_tokens"] == frames + done["usage"]["input_tokens"]
        assert done["finish_reason"] == "stop"
    assert messages[-1] == {"type": "session.done"}
    assert closing.type == aiohttp.WSMsgType.CLOSE and code == 1000
    if served_here(backend):
        assert [j.voice for j in backend.jobs] == ["vivian", "vivian"]
        assert backend.stats()["active_streams"] == 0


def test_codec_frames_mode_sends_header_then_int64_frames():
    async def main():
        async with ws_session(FakeBackend()) as ws:
            await ws.send_json({"type": "session.config", "codec_frames": True, "seed": 9})
            assert (await ws.receive_json())["session"]["codec_frames"] is True
            await ws.send_json({"type": "input.text", "text": "Codec frames please"})
            await ws.send_json({"type": "input.done"})
            return await read_until(ws, "audio.done")

    messages = arun(main())
    start = messages[0]
    assert start["type"] == "audio.start" and start["format"] == "codec_frames"
    assert start["num_codebooks"] == 16 and start["dtype"] == "int64"
    frames, offset, i = [], 0, 1
    while messages[i]["type"] == "codec.frames":
        header, payload = messages[i], messages[i + 1]
        assert isinstance(payload, bytes) and header["offset"] == offset
        assert header["shape"] == [header["frames"], 16] and len(payload) == header["frames"] * 128
        frames.append(np.frombuffer(payload, "<i8").reshape(-1, 16))
        offset += header["frames"]
        i += 2
    assert messages[i]["type"] == "audio.done" and i == len(messages) - 1
    n = expected_frames("Codec frames please")
    assert offset == n and frames[0].shape == (1, 16)  # 1-frame first chunk
    np.testing.assert_array_equal(np.concatenate(frames), fake_codes(9, 0, n))


def test_audio_done_says_length_when_max_new_tokens_cut_the_speech_short():
    async def main():
        async with ws_session(FakeBackend()) as ws:
            await ws.send_json({"type": "session.config", "max_new_tokens": 2, "seed": 2})
            await ws.receive_json()
            # 7 frames of speech capped at 2, then a sentence of 1 frame that fits
            await ws.send_json({"type": "input.text", "text": "A longer first sentence. Hi. "})
            first = await read_until(ws, "audio.done")
            return utterances(first + await read_until(ws, "audio.done"))

    utts = arun(main())
    assert [(u[0]["text"], u[2]["finish_reason"]) for u in utts] == [
        ("A longer first sentence.", "length"), ("Hi.", "stop")]
    assert [u[2]["usage"]["output_tokens"] for u in utts] == [2, 1]
    assert utts[0][1] == to_s16le(fake_audio(2, 0, 2 * 1920))


def test_codec_frames_refused_when_backend_cannot():
    async def main():
        async with ws_session(FakeBackend(supports_codec_frames=False)) as ws:
            await ws.send_json({"type": "session.config", "codec_frames": True})
            err = await ws.receive_json()
            # the session goes on, with pcm
            await ws.send_json({"type": "input.text", "text": "Still pcm."})
            await ws.send_json({"type": "input.done"})
            return err, await read_until(ws, "audio.done")

    err, messages = arun(main())
    assert err["type"] == "error" and err["error"]["code"] == "codec_frames_unsupported"
    assert err["error"]["param"] == "codec_frames"
    assert "cannot stream codec frames" in err["error"]["message"]
    assert messages[0]["format"] == "pcm_s16le"


def test_sse_style_json_deltas():
    async def main():
        async with ws_session(FakeBackend()) as ws:
            await ws.send_json({"type": "session.config", "stream_format": "sse", "seed": 1})
            await ws.receive_json()
            await ws.send_json({"type": "input.text", "text": "JSON audio"})
            await ws.send_json({"type": "input.done"})
            return await read_until(ws, "audio.done")

    messages = arun(main())
    deltas = [m for m in messages if m["type"] == "speech.audio.delta"]
    assert not any(isinstance(m, bytes) for m in messages)
    pcm = b"".join(base64.b64decode(d["audio"]) for d in deltas)
    assert pcm == to_s16le(fake_audio(1, 0, expected_frames("JSON audio") * 1920))


def test_bad_events_get_error_events_and_the_session_survives():
    async def main():
        settings = ServerSettings(max_input_chars=50, ws_max_pending_utterances=64)
        async with ws_session(FakeBackend(), settings) as ws:
            errors = []
            for raw in ("{oops", json.dumps({"type": "input.nope"}),
                        json.dumps({"type": "input.text"}),
                        json.dumps({"type": "input.text", "text": 5}),
                        json.dumps({"type": "session.config", "voice": "bogus"}),
                        json.dumps({"type": "session.config", "response_format": "mp3"}),
                        json.dumps({"type": "session.config", "speed": 4.5}),
                        json.dumps({"type": "session.config", "model": "nope"})):
                await ws.send_str(raw)
                errors.append(await ws.receive_json())
            await ws.send_bytes(b"\x00\x01")
            errors.append(await ws.receive_json())
            await ws.send_json({"type": "input.text", "text": "   "})
            await ws.send_json({"type": "input.done"})  # blank: nothing to say, no error
            await ws.send_json({"type": "input.text", "text": "ok now."})
            await ws.send_json({"type": "input.done"})
            messages = await read_until(ws, "audio.done")
            await ws.send_json({"type": "session.close"})
            await read_until(ws, "session.done")
            await ws.send_json({"type": "input.text", "text": "too late"})
            late = await ws.receive()
            return errors, messages, late

    errors, messages, late = arun(main())
    codes = [e["error"]["code"] for e in errors]
    assert all(e["type"] == "error" for e in errors)
    assert codes == ["invalid_json", "invalid_type", "invalid_type", "invalid_type",
                     "invalid_voice", "invalid_response_format", "invalid_value",
                     "model_not_found", "invalid_event"]
    assert "session.config" in errors[1]["error"]["message"]  # names the known event types
    assert errors[3]["error"]["param"] == "text"
    assert [m["type"] for m in messages if isinstance(m, dict)][0] == "audio.start"
    assert messages[0]["text"] == "ok now."
    assert late.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)


def test_control_characters_are_refused_piece_by_piece_and_the_session_survives():
    async def main():
        backend = FakeBackend()
        async with ws_session(backend) as ws:
            errors = []
            await ws.send_json({"type": "input.text", "text": "Hello \x00there. "})
            errors.append(await ws.receive_json())
            # a lone surrogate escape, as a JSON encoder writes one
            await ws.send_str('{"type": "input.text", "text": "bad \\udc00"}')
            errors.append(await ws.receive_json())
            await ws.send_json({"type": "session.config", "instructions": "calm\x1b[0m"})
            errors.append(await ws.receive_json())
            await ws.send_json({"type": "session.config", "instructions": "calm,\nand slow"})
            updated = await ws.receive_json()
            await ws.send_json({"type": "input.text", "text": "Fine\ttext\r\n"})
            await ws.send_json({"type": "input.done"})
            return errors, updated, await read_until(ws, "audio.done"), backend

    errors, updated, messages, backend = arun(main())
    assert [(e["type"], e["error"]["code"], e["error"]["param"]) for e in errors] == [
        ("error", "invalid_characters", "text"), ("error", "invalid_characters", "text"),
        ("error", "invalid_characters", "instructions")]
    assert "U+0000 at position 6" in errors[0]["error"]["message"]
    assert "lone surrogate U+DC00 at position 4" in errors[1]["error"]["message"]
    assert "U+001B at position 4" in errors[2]["error"]["message"]
    assert updated["type"] == "session.updated"
    # the refused pieces never reached the buffer: one utterance, of the good piece only
    assert [u[0]["text"] for u in utterances(messages)] == ["Fine\ttext"]
    assert not served_here(backend) or [(j.text, j.instructions) for j in backend.jobs] == [
        ("Fine\ttext", "calm,\nand slow")]


def test_disconnect_mid_utterance_frees_the_backend_stream():
    async def main():
        backend = FakeBackend(frame_delay=0.02)
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            before = await backend_stats(s, url)
            async with s.ws_connect(url + WS_PATH) as ws:
                assert (await ws.receive_json())["type"] == "session.created"
                await ws.send_json({"type": "input.text", "text": "word " * 200})
                await ws.send_json({"type": "input.done"})
                assert (await ws.receive_json())["type"] == "audio.start"
                assert (await ws.receive()).type == aiohttp.WSMsgType.BINARY
                assert (await backend_stats(s, url))["active_streams"] == 1
                await ws.close()
            after = await wait_backend(s, url, lambda st: st["active_streams"] == 0, timeout=1)
            return before, after

    before, after = arun(main())
    assert after["streams_cancelled_total"] - before["streams_cancelled_total"] == 1


@pytest.mark.direct_only("runs and shuts down its own server")
def test_server_shutdown_closes_sessions_with_going_away():
    async def main():
        backend = FakeBackend(frame_delay=0.02)
        from omni_stream.server.app import start_server

        runner, url = await start_server(backend, "127.0.0.1", 0)
        async with aiohttp.ClientSession() as s:
            ws = await s.ws_connect(url + WS_PATH)
            await ws.receive_json()
            await ws.send_json({"type": "input.text", "text": "word " * 200})
            await ws.send_json({"type": "input.done"})
            assert (await ws.receive_json())["type"] == "audio.start"
            cleanup = asyncio.create_task(runner.cleanup())
            while True:
                msg = await ws.receive(timeout=5)
                if msg.type != aiohttp.WSMsgType.BINARY:
                    break
            await cleanup
            return msg, backend

    msg, backend = arun(main())
    assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1001
    assert backend.stats()["active_streams"] == 0 and not backend.running


def test_websocket_needs_the_api_key():
    async def main():
        settings = ServerSettings(api_key="k")
        async with running_server(FakeBackend(), settings) as url, aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await s.ws_connect(url + WS_PATH)
            async with s.ws_connect(url + WS_PATH, headers={"Authorization": "Bearer k"}) as ws:
                created = await ws.receive_json()
            return e.value.status, created

    status, created = arun(main())
    assert status == 401 and created["type"] == "session.created"


@pytest.mark.parametrize("buffer, sentences, rest", [
    ("Hello there. How are", ["Hello there."], "How are"),
    ("One! Two? Three.", ["One!", "Two?"], "Three."),
    ('He said "stop." Then left. ', ['He said "stop."', "Then left."], ""),
    ("你好。今天怎么样？还", ["你好。", "今天怎么样？"], "还"),
    ("v1.2 is out", [], "v1.2 is out"),
])
@pytest.mark.direct_only("the sentence splitter itself, no server")
def test_split_sentences(buffer, sentences, rest):
    assert split_sentences(buffer, 4096) == (sentences, rest)


@pytest.mark.direct_only("the sentence splitter itself, no server")
def test_split_sentences_caps_a_long_run_on_sentence():
    out, rest = split_sentences("aaa bbb ccc ddd eee", 8)
    assert out == ["aaa bbb", "ccc ddd"] and rest == "eee"
    assert all(len(s) <= 8 for s in out)
    assert split_sentences("One. Two. Three", 8, sentences=False) == (["One.", "Two."], "Three")
    assert split_sentences("One. Two.", 100, sentences=False) == ([], "One. Two.")


def test_without_sentence_splitting_input_done_makes_one_utterance():
    async def main():
        async with ws_session(FakeBackend()) as ws:
            await ws.send_json({"type": "session.config", "split_sentences": False})
            await ws.receive_json()
            for piece in ("First sentence. ", "Second one. ", "Third"):
                await ws.send_json({"type": "input.text", "text": piece})
            await ws.send_json({"type": "session.close"})  # flushes the buffer first
            messages = await read_until(ws, "session.done")
            await ws.send_json({"type": "input.text", "text": "late"})
            return messages

    utts = utterances(arun(main()))
    assert [u[0]["text"] for u in utts] == ["First sentence. Second one. Third"]


def test_input_after_session_close_is_refused():
    async def main():
        async with ws_session(FakeBackend(frame_delay=0.01)) as ws:
            await ws.send_json({"type": "input.text", "text": "A longer utterance here."})
            await ws.send_json({"type": "session.close"})
            await ws.send_json({"type": "input.text", "text": "more"})
            return await read_until(ws, "session.done")

    messages = arun(main())
    errors = [m for m in messages if isinstance(m, dict) and m["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["session_closing"]
    assert len(utterances(messages)) == 1


def test_oversized_message_closes_with_1009():
    async def main():
        settings = ServerSettings(max_input_chars=100, max_body_bytes=5000)
        async with ws_session(FakeBackend(), settings) as ws:
            await ws.send_json({"type": "input.text", "text": "x" * 6000})
            msg = await ws.receive()
            return msg, ws.close_code

    msg, code = arun(main())
    assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED) and code == 1009


def test_continuous_text_mode_on_the_fake_backend():
    """text_mode continuous: pieces (split mid-word) make one utterance, closed by input.done;
    the next input.text starts the next one; a bad text_mode is refused by name."""
    async def main():
        async with ws_session(FakeBackend()) as ws:
            await ws.send_json({"type": "session.config", "text_mode": "lines"})
            ev = await ws.receive_json()
            assert ev["type"] == "error" and ev["error"]["param"] == "text_mode"
            await ws.send_json({"type": "session.config", "text_mode": "continuous"})
            assert (await ws.receive_json())["session"]["text_mode"] == "continuous"
            for piece in ("Hel", "lo the", "re. And mo", "re text"):
                await ws.send_json({"type": "input.text", "text": piece})
            await ws.send_json({"type": "input.done"})
            await ws.send_json({"type": "input.text", "text": "Second one."})
            await ws.send_json({"type": "session.close"})
            starts, done = [], 0
            while True:
                msg = await ws.receive()
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                ev = json.loads(msg.data)
                if ev["type"] == "audio.start":
                    starts.append(ev)
                elif ev["type"] == "audio.done":
                    done += 1
                elif ev["type"] == "session.done":
                    break
            return starts, done

    starts, done = arun(main())
    assert done == 2 and len(starts) == 2
    assert all(s["text_mode"] == "continuous" for s in starts)


# ------------------------------------------------------------------ input.cancel, context_id
async def _events_until(ws, event_type: str) -> tuple[list, int]:
    """(messages up to and including ``event_type``, binary frames among them)."""
    out = await read_until(ws, event_type)
    return out, sum(isinstance(m, bytes) for m in out)


def test_cancel_stops_the_running_utterance_frees_its_slot_and_keeps_the_session():
    """input.cancel mid-utterance: audio.cancelled names it, nothing of it comes after, the
    backend stream is closed (counted as cancelled, not disconnected), queued utterances and
    buffered text are dropped with it, and the session speaks the next text normally."""
    async def main():
        backend = FakeBackend(frame_delay=0.02)
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            before = await backend_stats(s, url)
            async with s.ws_connect(url + WS_PATH) as ws:
                assert (await ws.receive_json())["type"] == "session.created"
                await ws.send_json({"type": "input.text", "text": "word " * 200 + ". Next one. "})
                await ws.send_json({"type": "input.text", "text": "buffered, not ended"})
                start = await ws.receive_json()
                assert start["type"] == "audio.start"
                assert (await ws.receive()).type == aiohttp.WSMsgType.BINARY
                await ws.send_json({"type": "input.cancel"})
                msgs, _ = await _events_until(ws, "audio.cancelled")
                cancelled = msgs[-1]
                assert not any(isinstance(m, dict) and m["type"] == "audio.done" for m in msgs)
                after_cancel = await wait_backend(s, url, lambda st: st["active_streams"] == 0,
                                                  timeout=5)
                await ws.send_json({"type": "input.text", "text": "After the cancel."})
                await ws.send_json({"type": "session.close"})
                rest = await read_until(ws, "session.done")
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
            return start, cancelled, rest, before, after_cancel, metrics

    start, cancelled, rest, before, after, metrics = arun(main())
    assert cancelled["context_id"] is None
    assert cancelled["request_ids"][0] == start["request_id"]
    assert len(cancelled["request_ids"]) == 2  # the running one and the queued "Next one."
    assert after["streams_cancelled_total"] - before["streams_cancelled_total"] == 1
    (u,) = utterances(rest)  # only the text sent after the cancel is spoken
    assert u[0]["text"] == "After the cancel." and u[2]["finish_reason"] == "stop"
    assert u[0]["request_id"] not in cancelled["request_ids"]
    assert 'endpoint="ws",outcome="cancelled"' in metrics
    assert "omni_stream_ws_cancels_total" in metrics


def test_cancel_with_nothing_running_is_answered_and_harmless():
    async def main():
        async with ws_session(FakeBackend()) as ws:
            await ws.send_json({"type": "input.cancel"})
            first = await ws.receive_json()
            await ws.send_json({"type": "input.cancel", "context_id": "turn-9"})
            second = await ws.receive_json()
            await ws.send_json({"type": "input.text", "text": "Still here."})
            await ws.send_json({"type": "session.close"})
            return first, second, await read_until(ws, "session.done")

    first, second, rest = arun(main())
    assert first == {"type": "audio.cancelled", "context_id": None, "request_ids": []}
    assert second == {"type": "audio.cancelled", "context_id": "turn-9", "request_ids": []}
    assert [u[0]["text"] for u in utterances(rest)] == ["Still here."]


def test_context_ids_label_utterances_and_cancel_only_their_own():
    """Sentences mode: each utterance's events carry its context_id; cancelling one label
    drops only its utterances (queued here), the other turn completes."""
    async def main():
        async with ws_session(FakeBackend(frame_delay=0.01)) as ws:
            await ws.send_json({"type": "input.text", "text": "First turn speaks. ",
                                "context_id": "a"})
            await ws.send_json({"type": "input.text", "text": "Second turn. More of it. ",
                                "context_id": "b"})
            await ws.send_json({"type": "input.cancel", "context_id": "b"})
            await ws.send_json({"type": "session.close"})
            return await read_until(ws, "session.done")

    msgs = arun(main())
    cancelled = [m for m in msgs if isinstance(m, dict) and m["type"] == "audio.cancelled"]
    assert len(cancelled) == 1 and cancelled[0]["context_id"] == "b"
    assert len(cancelled[0]["request_ids"]) == 2  # both of b's sentences, never started
    done = utterances(msgs)
    assert [(u[0]["context_id"], u[2]["context_id"]) for u in done] == [("a", "a")]
    assert done[0][0]["request_id"] not in cancelled[0]["request_ids"]


def test_continuous_context_ids_close_the_open_turn_and_stale_done_is_a_no_op():
    """Continuous mode: a piece with another context_id closes the open utterance and opens
    the next; an input.done for a label no longer open closes nothing; each utterance's
    waits, start and done carry its label."""
    async def main():
        async with ws_session(FakeBackend()) as ws:
            await ws.send_json({"type": "session.config", "text_mode": "continuous"})
            await ws.receive_json()
            for piece in ("Turn a ", "has words."):
                await ws.send_json({"type": "input.text", "text": piece, "context_id": "a"})
            await ws.send_json({"type": "input.text", "text": "Turn b ", "context_id": "b"})
            await ws.send_json({"type": "input.done", "context_id": "a"})  # stale: b stays open
            await ws.send_json({"type": "input.text", "text": "goes on.", "context_id": "b"})
            await ws.send_json({"type": "input.done", "context_id": "b"})
            await ws.send_json({"type": "session.close"})
            return await read_until(ws, "session.done")

    msgs = arun(main())
    done = utterances(msgs)
    assert [u[0]["context_id"] for u in done] == ["a", "b"]
    assert [u[2]["usage"]["input_tokens"] > 0 for u in done] == [True, True]
    labelled = [m for m in msgs if isinstance(m, dict)
                and m["type"] in ("text.waiting", "text.resumed", "audio.start", "audio.done")]
    assert all(m["context_id"] in ("a", "b") for m in labelled)
    assert not [m for m in msgs if isinstance(m, dict) and m["type"] == "error"]
    # each input.done with a label is answered once everything of it sent before was spoken
    kinds = [(m["type"], m.get("context_id")) for m in msgs if isinstance(m, dict)
             and m["type"] in ("audio.done", "context.done")]
    assert kinds == [("audio.done", "a"), ("context.done", "a"), ("audio.done", "b"),
                     ("context.done", "b")]


def test_cancel_of_an_open_continuous_utterance_waiting_for_text():
    """A continuous utterance waiting for its text (no input.done yet) is cancelled and the
    next piece opens a new utterance (the fake backend admits a continuous stream only once
    its text is closed; tests/test_agents.py shows the slot freed on the real pipeline)."""
    async def main():
        backend = FakeBackend()
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            async with s.ws_connect(url + WS_PATH) as ws:
                assert (await ws.receive_json())["type"] == "session.created"
                await ws.send_json({"type": "session.config", "text_mode": "continuous"})
                await ws.receive_json()
                await ws.send_json({"type": "input.text", "text": "Hello there, this "})
                await asyncio.sleep(0.05)
                await ws.send_json({"type": "input.cancel"})
                cancelled = (await read_until(ws, "audio.cancelled"))[-1]
                assert len(cancelled["request_ids"]) == 1
                idle = await wait_backend(s, url, lambda st: st["active_streams"] == 0,
                                          timeout=5)
                await ws.send_json({"type": "input.text", "text": "New turn."})
                await ws.send_json({"type": "input.done"})
                await ws.send_json({"type": "session.close"})
                return await read_until(ws, "session.done"), idle

    rest, idle = arun(main())
    assert idle["active_streams"] == 0
    (u,) = utterances(rest)
    assert u[2]["finish_reason"] == "stop"


def test_cancel_after_session_close_still_ends_the_session():
    async def main():
        async with ws_session(FakeBackend(frame_delay=0.02)) as ws:
            await ws.send_json({"type": "input.text", "text": "word " * 100})
            await ws.send_json({"type": "session.close"})
            await read_until(ws, "audio.start")
            await ws.send_json({"type": "input.cancel"})
            return await read_until(ws, "session.done")

    msgs = arun(main())
    kinds = [m["type"] for m in msgs if isinstance(m, dict)]
    assert kinds == ["audio.cancelled", "session.done"]


@pytest.mark.parametrize("event, param", [
    ({"type": "input.text", "text": "hi", "voice_id": "x"}, "voice_id"),
    ({"type": "input.done", "flush": True}, "flush"),
    ({"type": "input.cancel", "all": True}, "all"),
    ({"type": "input.text", "text": "hi", "context_id": "x" * 129}, "context_id"),
    ({"type": "input.text", "text": "hi", "context_id": ""}, "context_id"),
    ({"type": "input.cancel", "context_id": "a\x00b"}, "context_id"),
    ({"type": "input.text", "text": "hi", "context_id": 7}, "context_id"),
])
def test_unknown_or_bad_fields_on_input_events_are_refused_by_name(event, param):
    async def main():
        async with ws_session(FakeBackend()) as ws:
            await ws.send_json(event)
            err = await ws.receive_json()
            await ws.send_json({"type": "input.text", "text": "Fine."})
            await ws.send_json({"type": "session.close"})
            return err, await read_until(ws, "session.done")

    err, rest = arun(main())
    assert err["type"] == "error" and err["error"]["param"] == param, err
    assert [u[0]["text"] for u in utterances(rest)] == ["Fine."]

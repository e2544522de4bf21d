"""Bad input, auth and overload on POST /v1/audio/speech: status, OpenAI error body, headers."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from multidict import CIMultiDict
import pytest

from omni_stream.server.audio import to_s16le
from omni_stream.errors import RequestError
from omni_stream.server.fake_backend import FakeBackend, expected_frames, fake_audio
from omni_stream.server.settings import ServerSettings
from omni_stream.server.testing import post_speech as post
from omni_stream.server.testing import run_async as arun
from omni_stream.server.testing import running_server, served_here, wait_backend

# every test here runs against the single server and against the cluster entry (conftest)
pytestmark = pytest.mark.usefixtures("api_entry")

BYTES_PER_FRAME = 1920 * 2
TEXT = "The quick brown fox jumps over the lazy dog."


def error_of(body: bytes) -> dict:
    """The OpenAI error object, checking the shape exactly."""
    doc = json.loads(body)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
    return doc["error"]


# --- bad input ----------------------------------------------------------------------------------
BAD_REQUESTS = [
    # (body, status, code, param)
    ("{not json", 400, "invalid_json", None),
    ("[1, 2]", 400, "invalid_type", None),
    ({"model": "tts-1"}, 400, "invalid_type", "input"),
    ({"input": ""}, 400, "empty_input", "input"),
    ({"input": "   \n"}, 400, "empty_input", "input"),
    ({"input": "x" * 101}, 400, "input_too_long", "input"),
    ({"input": 3}, 400, "invalid_type", "input"),
    ({"input": "hi", "speed": "fast"}, 400, "invalid_type", "speed"),
    ({"input": "hi", "seed": "x"}, 400, "invalid_type", "seed"),
    ({"input": "hi", "voice": 5}, 400, "invalid_type", "voice"),
    ({"input": "hi", "voice": {"name": "x"}}, 400, "invalid_type", "voice"),
    ({"input": "hi", "stream": "yes"}, 400, "invalid_type", "stream"),
    ({"input": "hi", "voice": "bogus"}, 400, "invalid_voice", "voice"),
    ({"input": "hi", "response_format": "aac"}, 400, "invalid_response_format", "response_format"),
    ({"input": "hi", "model": "gpt-4"}, 400, "model_not_found", "model"),
    ({"input": "hi", "speed": 0.1}, 400, "invalid_value", "speed"),
    ({"input": "hi", "speed": 4.5}, 400, "invalid_value", "speed"),
    ({"input": "hi", "speed": 0.2}, 400, "invalid_value", "speed"),
    ({"input": "hi", "speed": 4.1}, 400, "invalid_value", "speed"),
    ('{"input": "hi", "speed": NaN}', 400, "invalid_value", "speed"),
    ('{"input": "hi", "speed": Infinity}', 400, "invalid_value", "speed"),
    ('{"input": "hi", "speed": 1e999}', 400, "invalid_value", "speed"),
    ({"input": "hi", "stream_format": "chunks"}, 400, "invalid_value", "stream_format"),
    ({"input": "hi", "stream_format": "sse", "response_format": "aac"}, 400,
     "invalid_response_format", "response_format"),
    ({"input": "hi", "stream_format": "sse", "stream": False}, 400, "invalid_value", "stream"),
    ({"input": "hi", "language": "klingon"}, 400, "invalid_language", "language"),
    ({"input": "hi", "greedy": True, "do_sample": True}, 400, "invalid_value", "do_sample"),
    ({"input": "hi", "max_new_tokens": 0}, 400, "invalid_value", "max_new_tokens"),
    ({"input": "hi", "initial_codec_chunk_frames": 0}, 400, "invalid_value",
     "initial_codec_chunk_frames"),
    ({"input": "hi", "seed": -1}, 400, "invalid_value", "seed"),
]


def test_bad_requests_get_openai_errors():
    async def main():
        backend = FakeBackend()
        settings = ServerSettings(max_input_chars=100, max_body_bytes=8192)
        out = []
        async with running_server(backend, settings) as url, aiohttp.ClientSession() as s:
            for body, *_ in BAD_REQUESTS:
                out.append(await post(s, url, body))
            out.append(await post(s, url, {"input": "x" * 9000}))  # body over the cap
            async with s.get(url + "/v1/nope") as r:
                out.append((r.status, CIMultiDict(r.headers), await r.read()))
            async with s.get(url + "/v1/audio/speech") as r:
                out.append((r.status, CIMultiDict(r.headers), await r.read()))
            ok = await post(s, url, {"input": "x" * 100, "response_format": "pcm"})
        return out, ok, backend

    out, ok, backend = arun(main())
    expected = [tuple(x[1:]) for x in BAD_REQUESTS] + [
        (413, "request_too_large", None), (404, "not_found", None),
        (405, "method_not_allowed", None)]
    for (body, *_), (status, headers, raw), (want_status, want_code, want_param) in zip(
            BAD_REQUESTS + [("big",), ("404",), ("405",)], out, expected):
        err = error_of(raw)
        assert (status, err["code"], err["param"]) == (want_status, want_code, want_param), \
            (body, status, err)
        assert headers["Content-Type"].startswith("application/json")
        assert err["type"] == "invalid_request_error"
    messages = {x[0] if isinstance(x[0], str) else json.dumps(x[0]): error_of(o[2])["message"]
                for x, o in zip(BAD_REQUESTS, out)}
    assert "vivian" in messages['{"input": "hi", "voice": "bogus"}']
    assert "alloy" in messages['{"input": "hi", "voice": "bogus"}']
    assert "pcm, wav" in messages['{"input": "hi", "response_format": "aac"}']
    assert "`$.speed`" in messages['{"input": "hi", "speed": "fast"}']
    for bad in ('{"input": "hi", "speed": 4.1}', '{"input": "hi", "speed": NaN}',
                '{"input": "hi", "speed": Infinity}', '{"input": "hi", "speed": 1e999}'):
        assert "between 0.25 and 4.0" in messages[bad], messages[bad]
    assert ok[0] == 200 and len(ok[2]) == expected_frames("x" * 100) * BYTES_PER_FRAME
    assert not served_here(backend) or len(backend.jobs) == 1  # no bad request reached it


# --- strict input: JSON only, no control characters ------------------------------------------
NOT_JSON = [None, "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", "application/jsonx",
            "application/json; charset=latin-1"]
JSON_TYPES = ["application/json", "application/json; charset=utf-8",
              'Application/JSON; Charset="UTF-8"', "application/vnd.omni+json"]


def test_a_body_not_declared_json_gets_415_before_it_is_read():
    async def main():
        backend = FakeBackend()
        body = {"input": "hi", "response_format": "pcm"}
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            refused = [await post(s, url, body, content_type=ct) for ct in NOT_JSON]
            accepted = [await post(s, url, body, content_type=ct) for ct in JSON_TYPES]
        return refused, accepted, backend

    refused, accepted, backend = arun(main())
    for ct, (status, headers, raw) in zip(NOT_JSON, refused):
        err = error_of(raw)
        assert (status, err["code"], err["param"]) == (415, "unsupported_media_type", None), ct
        assert err["type"] == "invalid_request_error"
        assert "Content-Type: application/json" in err["message"], err["message"]
    assert "no Content-Type header" in error_of(refused[0][2])["message"]
    assert "'text/plain' is not JSON" in error_of(refused[1][2])["message"]
    assert "charset 'latin-1' is not UTF-8" in error_of(refused[-1][2])["message"]
    assert [a[0] for a in accepted] == [200] * len(JSON_TYPES)
    # nothing refused reached the backend
    assert not served_here(backend) or len(backend.jobs) == len(JSON_TYPES)


BAD_CHARACTERS = [  # (character, as the message names it)
    ("\x00", "U+0000"), ("\x08", "U+0008"), ("\x0b", "U+000B"), ("\x1b", "U+001B"),
    ("\x1f", "U+001F"), ("\x7f", "U+007F"), ("\x80", "U+0080"), ("\x85", "U+0085"),
    ("\x9f", "U+009F"), ("\ud800", "U+D800"), ("\udfff", "U+DFFF"),
]


@pytest.mark.parametrize("field", ["input", "instructions"])
def test_control_characters_and_lone_surrogates_get_400_naming_them(field):
    async def main():
        backend = FakeBackend()
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            out = []
            for ch, _ in BAD_CHARACTERS:
                body = {"input": "hi", "response_format": "pcm", field: f"ab{ch}cd"}
                # json.dumps writes "\ud800" for a lone surrogate, as a JSON client would
                out.append(await post(s, url, body))
        return out, backend

    out, backend = arun(main())
    for (ch, name), (status, _, raw) in zip(BAD_CHARACTERS, out):
        err = error_of(raw)
        assert (status, err["code"], err["param"]) == (400, "invalid_characters", field), name
        assert f"'{field}' contains" in err["message"] and f"{name} at position 2" in err["message"]
    assert "tab, newline and carriage return" in error_of(out[0][2])["message"]
    assert "lone surrogate" in error_of(out[-1][2])["message"]
    assert not served_here(backend) or backend.jobs == []


@pytest.mark.parametrize("field", ["input", "instructions"])
def test_control_characters_at_the_edges_are_not_stripped_away(field):
    # str.strip() takes "\x85", "\x0b" and "\x1c".."\x1f" for whitespace
    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            return [await post(s, url, {"input": "hi", field: text})
                    for text in ("  calm\x85", "\x1f", "\x0bcalm")]

    named = ("U+0085 at position 6", "U+001F at position 0", "U+000B at position 0")
    for (status, _, raw), where in zip(arun(main()), named):
        err = error_of(raw)
        assert (status, err["code"], err["param"]) == (400, "invalid_characters", field)
        assert where in err["message"], err["message"]


def test_newline_tab_cr_and_surrogate_pairs_are_accepted_unchanged():
    text = "line1\nline2\ttab\r\n"

    async def main():
        backend = FakeBackend()
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            plain = await post(s, url, {"input": text, "response_format": "pcm"})
            # an escaped pair is one character beyond U+FFFF, not two lone surrogates
            emoji = await post(s, url, '{"input": "smile \\ud83d\\ude00", '
                                       '"response_format": "pcm"}')
            voice = await post(s, url, '{"input": "hi", "voice": "\\udc00"}')
            truncated = await post(s, url, '{"input": "ab\\ud800')
        return plain, emoji, voice, truncated, backend

    plain, emoji, voice, truncated, backend = arun(main())
    assert plain[0] == 200 and emoji[0] == 200
    assert not served_here(backend) or [j.text for j in backend.jobs] == [text,
                                                                         "smile \U0001f600"]
    err = error_of(voice[2])  # a lone surrogate in any field is named as such
    assert (voice[0], err["code"], err["param"]) == (400, "invalid_characters", "voice")
    assert "U+DC00 at position 0" in err["message"]
    assert error_of(truncated[2])["code"] == "invalid_json"  # broken JSON stays broken JSON


def test_instructions_refused_when_the_model_cannot_take_them():
    async def main():
        async with running_server(FakeBackend(supports_instructions=False)) as url, \
                aiohttp.ClientSession() as s:
            return await post(s, url, {"input": "hi", "instructions": "whisper"})

    status, _, body = arun(main())
    assert status == 400 and error_of(body)["code"] == "instructions_unsupported"


# --- auth ---------------------------------------------------------------------------------------
def test_api_key_required_everywhere_but_health():
    async def main():
        settings = ServerSettings(api_key="sekrit")
        async with running_server(FakeBackend(), settings) as url, aiohttp.ClientSession() as s:
            res = {}
            for name, headers in (("none", None), ("wrong", {"Authorization": "Bearer nope"}),
                                  ("basic", {"Authorization": "Basic sekrit"}),
                                  ("good", {"Authorization": "Bearer sekrit"})):
                res[name] = [await post(s, url, {"input": "hi", "response_format": "pcm"},
                                        headers)]
                for path in ("/v1/models", "/metrics", "/v1/audio/voices", "/health"):
                    async with s.get(url + path, headers=headers) as r:
                        res[name].append((r.status, None, await r.read()))
        return res

    res = arun(main())
    for name in ("none", "wrong", "basic"):
        statuses = [r[0] for r in res[name]]
        assert statuses == [401, 401, 401, 401, 200], (name, statuses)
        assert error_of(res[name][0][2])["code"] == "invalid_api_key"
    assert [r[0] for r in res["good"]] == [200] * 5


@pytest.mark.direct_only("reads the environment of this process")
def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("OMNI_STREAM_API_KEY", "envkey")
    assert ServerSettings.from_env().api_key == "envkey"
    assert ServerSettings.from_env(api_key="flag").api_key == "flag"
    monkeypatch.delenv("OMNI_STREAM_API_KEY")
    assert ServerSettings.from_env().api_key is None


def test_no_api_key_means_open():
    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models") as r:
                return r.status, await r.json()

    status, doc = arun(main())
    assert status == 200 and doc["object"] == "list"
    assert doc["data"][0]["id"] == "omni-stream-fake" and doc["data"][0]["object"] == "model"


# --- overload ---------------------------------------------------------------------------------
# FakeBackend admits with the real AdmissionController: these are the statuses production sends
async def _overload(backend: FakeBackend) -> tuple[tuple, tuple, float, dict]:
    """One long stream, then a second request while it runs: (first, second, second's wait,
    the backend's stats once both are over)."""
    async with running_server(backend) as url, aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, url, {"input": TEXT * 4, "response_format": "pcm",
                                                  "seed": 5}))
        await wait_backend(s, url, lambda st: st["active_streams"] >= 1)
        t = time.perf_counter()
        second = await post(s, url, {"input": "hi", "response_format": "pcm"})
        waited = time.perf_counter() - t
        first = await first
        stats = await wait_backend(s, url, lambda st: st["active_streams"] == 0
                                   and st["queue_depth"] == 0)
        return first, second, waited, stats


def _retry_after(headers: dict) -> int:
    value = int(headers["Retry-After"])  # an integer number of seconds, as HTTP wants
    assert value >= 1
    return value


def test_queue_full_gives_429_at_once_with_retry_after_and_running_stream_is_unharmed():
    backend = FakeBackend(max_streams=1, max_queue=0, queue_timeout=5.0, frame_delay=0.01)
    first, (status, headers, body), waited, stats = arun(_overload(backend))
    # refused at once: before its 5 s queue deadline could pass (ordering, not a latency
    # bound), because the queue was full (admission_rejected_queue_full below)
    assert status == 429 and waited < backend.queue_timeout, (status, waited)
    _retry_after(headers)
    err = error_of(body)
    assert err["type"] == "rate_limit_error" and err["code"] == "server_busy"
    assert first[0] == 200 and first[2] == to_s16le(
        fake_audio(5, 0, expected_frames(TEXT * 4) * 1920))
    assert stats["admission_rejected_queue_full"] == 1 and stats["admission_admitted_total"] == 1
    assert stats["slots_free"] == 1 and stats["active_streams"] == 0


def test_queued_past_the_deadline_gives_503_with_retry_after_and_running_stream_is_unharmed():
    # the first stream takes 45 frames x 20 ms = 0.9 s; the second may wait 0.1 s of it
    backend = FakeBackend(max_streams=1, max_queue=1, queue_timeout=0.1, frame_delay=0.02)
    first, (status, headers, body), waited, stats = arun(_overload(backend))
    assert status == 503 and waited >= 0.1, (status, waited)  # it waited out its deadline
    _retry_after(headers)
    err = error_of(body)
    assert err["type"] == "server_error" and err["code"] == "queue_timeout"
    assert "retry later" in err["message"]
    assert first[0] == 200 and first[2] == to_s16le(
        fake_audio(5, 0, expected_frames(TEXT * 4) * 1920))
    assert stats["admission_rejected_deadline"] == 1 and stats["queue_depth"] == 0
    assert stats["slots_free"] == 1 and stats["active_streams"] == 0


def test_queued_request_is_admitted_when_the_slot_frees_in_time():
    backend = FakeBackend(max_streams=1, max_queue=1, queue_timeout=10.0, frame_delay=0.005)
    first, (status, _, body), _, stats = arun(_overload(backend))
    assert first[0] == 200 and status == 200
    assert len(body) == expected_frames("hi") * BYTES_PER_FRAME
    assert stats["admission_admitted_total"] == 2


def test_backend_unavailable_gives_503_with_retry_after():
    async def main():
        backend = FakeBackend(reject=RequestError(503, "overloaded", "KV budget exhausted",
                                                  retry_after=0.2))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            return await post(s, url, {"input": "hi"})

    status, headers, body = arun(main())
    assert status == 503 and headers["Retry-After"] == "1"
    assert error_of(body) == {"message": "KV budget exhausted", "type": "server_error",
                              "param": None, "code": "overloaded"}


@pytest.mark.direct_only("drives the app's readiness directly")
def test_not_ready_gives_503_and_health_says_so():
    async def main():
        from omni_stream.server.app import start_server
        from omni_stream.server.state import STATE

        runner, url = await start_server(FakeBackend(), "127.0.0.1", 0)
        try:
            runner.app[STATE].ready = False  # as while starting or draining
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/health") as r:
                    health = r.status
                return health, await post(s, url, {"input": "hi"})
        finally:
            await runner.cleanup()

    health, (status, headers, body) = arun(main())
    assert health == 503 and status == 503 and headers["Retry-After"] == "1"
    assert error_of(body)["code"] == "unavailable"

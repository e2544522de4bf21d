"""The official OpenAI SDK against the local server (skipped where ``openai`` is not installed)."""

from __future__ import annotations

import pytest

from omni_stream.server.audio import to_s16le
from omni_stream.server.fake_backend import FakeBackend, expected_frames, fake_audio
from omni_stream.server.settings import ServerSettings
from omni_stream.server.testing import run_async, running_server

openai = pytest.importorskip("openai")

TEXT = "Streaming speech through the OpenAI SDK."


def test_sdk_streaming_pcm():
    async def main():
        backend = FakeBackend(frame_delay=0.002)
        async with running_server(backend, ServerSettings(api_key="sk-local")) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-local", max_retries=0)
            chunks = []
            async with client.audio.speech.with_streaming_response.create(
                    model="gpt-4o-mini-tts", voice="coral", input=TEXT, response_format="pcm",
                    extra_body={"seed": 4}) as resp:
                assert resp.headers["content-type"] == "audio/pcm"
                async for chunk in resp.iter_bytes():
                    chunks.append(chunk)
            bad = None
            try:
                await client.audio.speech.create(model="tts-1", voice="nobody", input=TEXT)
            except openai.BadRequestError as e:
                bad = e
            await client.close()
            return chunks, bad, backend

    chunks, bad, backend = run_async(main())
    assert b"".join(chunks) == to_s16le(fake_audio(4, 0, expected_frames(TEXT) * 1920))
    assert backend.jobs[0].voice == "dylan"  # coral is the 4th OpenAI name
    assert bad is not None and bad.status_code == 400 and bad.code == "invalid_voice"

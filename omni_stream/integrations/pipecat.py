"""A Pipecat TTS service that speaks the LLM's words as they are written, through omni-stream.

Pipecat's OpenAI-compatible TTS makes one HTTP request per sentence: each sentence waits for
its end, pays a whole time-to-first-audio, and starts its prosody afresh. This service keeps
one WebSocket session to ``omni-stream serve`` in continuous mode instead: every LLM text
frame goes out as it arrives (token aggregation, no sentence buffering) into the turn's one
utterance, labelled by Pipecat's context id; audio comes back as ``TTSAudioRawFrame`` at
24 kHz between ``TTSStartedFrame`` / ``TTSStoppedFrame`` per turn. An interruption (barge-in)
cancels the turn on the server (``input.cancel``): its slot is freed and no audio of it
reaches the pipeline afterwards. A dropped socket reconnects; the turn it cut is ended with an
error frame.

    tts = OmniStreamTTSService(base_url="http://127.0.0.1:8000", voice="ryan",
                               language=Language.EN, seed=7)
    pipeline = Pipeline([transport.input(), stt, user_agg, llm, tts, transport.output(),
                         assistant_agg])

``voice`` is a built-in speaker or an uploaded (cloned) voice name; ``language`` a Pipecat
``Language`` or the server's name ("english", "auto", ...); ``seed`` makes sampled speech
repeatable; ``session_options`` passes further ``session.config`` fields (``instructions``,
``greedy``, ``max_new_tokens``, ...). All of them can change at run time with
``TTSUpdateSettingsFrame`` (a turn being spoken finishes with the old ones).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator

from loguru import logger
from pipecat.frames.frames import (CancelFrame, EndFrame, ErrorFrame, Frame, StartFrame,
                                   TTSAudioRawFrame, TTSStoppedFrame)
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, TTSService
from pipecat.transcriptions.language import Language
from pipecat.utils.types import NOT_GIVEN, NotGiven, is_given

from omni_stream.integrations.session import (SAMPLE_RATE, Audio, Configured, ContextDone,
                                              SessionError, SpeechSession, TurnError,
                                              TurnStarted)

__all__ = ["OmniStreamTTSService", "OmniStreamTTSSettings"]

# Pipecat language codes (the part before "-") -> the names Qwen3-TTS models take
_LANGUAGES = {"en": "english", "zh": "chinese", "ja": "japanese", "ko": "korean",
              "de": "german", "fr": "french", "ru": "russian", "pt": "portuguese",
              "es": "spanish", "it": "italian"}


@dataclass
class OmniStreamTTSSettings(TTSSettings):
    """Runtime-updatable settings: ``voice``, ``language``, ``model`` (TTSSettings) and
    ``seed`` (sampled speech repeatable per turn; None: a fresh draw)."""

    seed: int | None | NotGiven = field(default_factory=lambda: NOT_GIVEN)


class OmniStreamTTSService(TTSService):
    """Pipecat TTS over one omni-stream WebSocket session (continuous text, barge-in cancel).

    ``base_url`` is the server's http URL ("http://host:8000", with or without "/v1")."""

    Settings = OmniStreamTTSSettings
    _settings: OmniStreamTTSSettings

    def __init__(self, *, base_url: str, voice: str | None = None,
                 language: Language | str | None = None, api_key: str | None = None,
                 seed: int | None = None, session_options: dict[str, Any] | None = None,
                 sample_rate: int | None = None, settings: OmniStreamTTSSettings | None = None,
                 text_aggregation_mode: TextAggregationMode = TextAggregationMode.TOKEN,
                 reconnect_attempts: int = 5, **kwargs: Any) -> None:
        if sample_rate not in (None, SAMPLE_RATE):
            raise ValueError(f"omni-stream speaks at {SAMPLE_RATE} Hz: leave sample_rate unset "
                             "(the output transport resamples)")
        store = self.Settings(model=None, voice=voice, language=language, seed=seed)
        if settings is not None:
            store.apply_update(settings)
        super().__init__(text_aggregation_mode=text_aggregation_mode, push_start_frame=True,
                         push_stop_frames=False, pause_frame_processing=False,
                         sample_rate=SAMPLE_RATE, settings=store, **kwargs)
        self._base_url = base_url
        self._api_key = api_key
        self._session_options = dict(session_options or {})
        self._reconnect_attempts = reconnect_attempts
        self._session: SpeechSession | None = None
        self._receive_task: asyncio.Task | None = None
        self._connect_lock = asyncio.Lock()
        self._open: set[str] = set()  # contexts sent on this session and not yet done

    def can_generate_metrics(self) -> bool:
        return True

    def language_to_service_language(self, language: Language) -> str | None:
        return _LANGUAGES.get(str(language.value).split("-")[0].lower())

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self._connect()

    async def stop(self, frame: EndFrame) -> None:
        await super().stop(frame)  # plays out every open context first
        await self._disconnect()

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        await self._disconnect()

    async def cleanup(self) -> None:
        await super().cleanup()
        await self._disconnect()

    def session_config(self) -> dict[str, Any]:
        """The ``session.config`` fields of the current settings."""
        s = self._settings
        cfg = dict(self._session_options)
        for name in ("voice", "language", "seed", "model"):
            value = getattr(s, name, None)
            if is_given(value) and value is not None:
                cfg[name] = value
        return cfg

    async def _connect(self) -> bool:
        """Open the session (if it is not open); False, with an error frame, when refused."""
        async with self._connect_lock:
            if self._session is not None and self._session.connected:
                return True
            session = SpeechSession(self._base_url, api_key=self._api_key,
                                    config=self.session_config())
            try:
                await session.connect()
            except (SessionError, OSError, asyncio.TimeoutError) as e:
                await session.close()
                await self.push_error(error_msg=f"omni-stream: cannot open a session at "
                                                f"{self._base_url}: {e}", exception=e)
                await self._call_event_handler("on_connection_error", str(e))
                return False
            self._session = session
            self._open.clear()
            self._receive_task = self.create_task(self._receive(session), "omni-stream-receive")
            await self._call_event_handler("on_connected")
            return True

    async def _disconnect(self) -> None:
        session, self._session = self._session, None
        task, self._receive_task = self._receive_task, None
        if session is not None:
            await session.close()
        if task is not None and task is not asyncio.current_task():
            await self.cancel_task(task)
        if session is not None:
            await self._end_open_contexts()
            await self._call_event_handler("on_disconnected")

    async def _end_open_contexts(self) -> None:
        """The session is gone: its turns end with what was received, and a turn still being
        written moves to a new context (its rest goes to the next session)."""
        for context_id in list(self._open):
            if self.audio_context_available(context_id):
                await self.append_to_audio_context(context_id,
                                                   TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)
        self._open.clear()
        if self._turn_context_id:
            self._turn_context_id = None
            self._turn_context_id = self.create_context_id()

    # --- the server's events -----------------------------------------------------------------
    async def _receive(self, session: SpeechSession) -> None:
        try:
            async for event in session.events():
                await self._on_event(event)
        except (ConnectionError, asyncio.TimeoutError, OSError) as e:
            if session is not self._session:
                return  # closed here on purpose
            await self.push_error(error_msg=f"omni-stream: session dropped ({e}); reconnecting",
                                  exception=e)
            self._session = None
            self._receive_task = None
            await session.close()
            await self._end_open_contexts()
            await self._call_event_handler("on_disconnected")
            await self._reconnect()

    async def _reconnect(self) -> None:
        delay = 0.25
        for attempt in range(1, self._reconnect_attempts + 1):
            if await self._connect():
                logger.info(f"{self}: reconnected to omni-stream (attempt {attempt})")
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 4.0)
        await self.push_error(error_msg=f"omni-stream: no session after "
                                        f"{self._reconnect_attempts} attempts; the next turn "
                                        "tries again")

    async def _on_event(self, event: Any) -> None:
        if isinstance(event, Audio):
            if event.context_id and self.audio_context_available(event.context_id):
                await self.append_to_audio_context(event.context_id, TTSAudioRawFrame(
                    event.pcm, SAMPLE_RATE, 1, context_id=event.context_id))
        elif isinstance(event, TurnStarted):
            await self.stop_ttfb_metrics()
        elif isinstance(event, ContextDone):
            self._open.discard(event.context_id)
            if self.audio_context_available(event.context_id):
                await self.append_to_audio_context(
                    event.context_id, TTSStoppedFrame(context_id=event.context_id))
                await self.remove_audio_context(event.context_id)
        elif isinstance(event, TurnError):
            await self.push_error(error_msg=f"omni-stream: {event.message} "
                                            f"({event.code or 'error'})")
        elif isinstance(event, Configured):
            logger.debug(f"{self}: session now {event.session}")

    # --- text in, turns ----------------------------------------------------------------------
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        if not await self._connect():
            yield ErrorFrame(error="omni-stream: no session to speak on")
            return
        try:
            self._open.add(context_id)
            await self._session.send_text(text, context_id)
        except ConnectionError as e:
            yield ErrorFrame(error=f"omni-stream: sending text failed: {e}")
            return
        yield None  # the audio comes through _receive

    async def flush_audio(self, context_id: str | None = None) -> None:
        context_id = context_id or self.get_active_audio_context_id()
        if context_id and context_id in self._open and self._session is not None:
            try:
                await self._session.end(context_id)
            except ConnectionError:
                pass  # the receive task ends the context and reconnects

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        await self.stop_all_metrics()
        if context_id in self._open and self._session is not None:
            self._open.discard(context_id)
            try:
                await self._session.cancel(context_id)
            except ConnectionError:
                pass  # a closed session frees its slots on the server by itself
        await super().on_audio_context_interrupted(context_id)

    async def _update_settings(self, delta: TTSSettings) -> dict[str, Any]:
        changed = await super()._update_settings(delta)
        if changed and self._session is not None and self._session.connected:
            # the server takes a new config between turns only: the turn being written ends
            # here and its rest continues as a new context under the new settings
            turn = self._turn_context_id
            if turn and turn in self._open:
                await self._push_sequencer_frames(
                    await self._aggregated_frame_sequencer.finalize(turn), turn)
                await self.flush_audio(turn)
                self._turn_context_id = None
                self._turn_context_id = self.create_context_id()
            await self._session.reconfigure(**self.session_config())
        return changed

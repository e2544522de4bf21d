"""Voice-agent integrations: omni-stream's continuous WebSocket mode for agent frameworks.

- ``session``: :class:`~omni_stream.integrations.session.SpeechSession`, one WebSocket session
  (turns labelled by context_id, cancel, in-flight audio dropped); aiohttp only.
- ``pipecat``: ``OmniStreamTTSService``, a Pipecat TTS service (extra ``omni-stream[agents]``).
- ``livekit``: ``TTS``, a LiveKit Agents TTS with ``streaming=True`` (extra ``omni-stream[agents]``).

The framework modules import their framework; nothing else in omni-stream imports them.
"""

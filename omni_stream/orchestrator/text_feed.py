"""A continuous utterance's text as the talker needs it (``SpeechJob.text_feed``: an LLM's tokens,
a writer's keystrokes): ids final as far as more text cannot change them (``IncrementalTokenizer``),
the first of them before the prompt is built, the rest forwarded to the talker stage as they
become final (``AppendText``). Every failure is a BackendError for that stream alone."""

from __future__ import annotations

import asyncio

from omni_stream.contract import BackendError, SpeechJob
from omni_stream.models.text_stream import IncrementalTokenizer
from omni_stream.models.text_tokenizer import TextTokenizer
from omni_stream.orchestrator.settings import PipelineSettings
from omni_stream.transport import AppendText, ChannelClosed


class ContinuousText:
    """Reads continuous utterances' text feeds for one backend (its tokenizer and settings)."""

    def __init__(self, tokenizer: TextTokenizer, settings: PipelineSettings) -> None:
        self.tokenizer = tokenizer
        self.s = settings

    async def first(self, job: SpeechJob,
                    ref_tokens: int = 0) -> tuple[IncrementalTokenizer, list[int]]:
        """Read ``job.text_feed`` until the prompt can be built: one final text id (an ICL voice:
        enough ids to outrun its reference frames; ``ref_tokens``: its transcript's ids) or the
        close. BackendError on an idle feed, an empty utterance or text past the stream's
        limit."""
        tok = IncrementalTokenizer(self.tokenizer)
        need = 1
        c = job.clone
        if c is not None and c.icl:  # ref + text (no eos yet) must be longer than bos + frames
            need = max(1, len(c.ref_codes) + 2 - ref_tokens)
        ids: list[int] = []
        while len(ids) < need and not tok.closed:
            ids += await self.next_ids(job, tok)
        if not ids:
            raise BackendError(400, "empty_input", "the utterance closed without text: send "
                               "input.text before input.done", param="text")
        return tok, ids

    async def next_ids(self, job: SpeechJob, tok: IncrementalTokenizer) -> list[int]:
        """The ids the next piece of the feed makes final (all the rest when it closes)."""
        try:
            piece = await job.text_feed.next(self.s.text_idle_timeout_s)
        except asyncio.TimeoutError:
            raise BackendError(408, "text_timeout", f"no text for {self.s.text_idle_timeout_s:g} "
                               "s: send input.done to close the utterance; the stream was "
                               "stopped") from None
        try:
            ids = tok.close() if piece is None else tok.push(piece)
        except ValueError as e:
            raise BackendError(400, "invalid_characters", str(e), param="text") from None
        if len(tok.emitted) > self.s.max_text_tokens:
            raise BackendError(400, "input_too_long", f"the utterance passed "
                               f"{self.s.max_text_tokens} text tokens, the most one stream "
                               "takes: close it (input.done) and go on in the next one",
                               param="text")
        return ids

    async def forward(self, sid: int, queue: asyncio.Queue, job: SpeechJob,
                      tok: IncrementalTokenizer, pipe) -> None:
        """Send the rest of a continuous utterance to the talker as its ids become final."""
        try:
            while not tok.closed:
                ids = await self.next_ids(job, tok)
                if ids or tok.closed:
                    pipe.send(AppendText(stream_id=sid, ids=ids, close=tok.closed))
        except BackendError as e:
            queue.put_nowait(e)
        except (ChannelClosed, OSError):
            queue.put_nowait(BackendError(503, "unavailable", "the model pipeline is "
                                             "restarting", retry_after=2))

"""The WebSocket session's text side: sentences cut off the buffer, the utterances queued to be
spoken, and the client's context_id labels on them (the protocol: ``server/ws.py``).

The queue holds :class:`Utterance` values in the order they will be spoken, the
:class:`ContextEnd` markers that ``input.done`` {context_id} leaves behind a label's last
utterance, and None (``session.close``: the worker finishes). ``input.cancel`` takes the matching
ones out (:meth:`UtteranceQueue.drop`).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any, Callable

from omni_stream.contract import SpeechJob
from omni_stream.errors import RequestError
from omni_stream.server.schema import check_characters

MAX_CONTEXT_ID_CHARS = 128

# a sentence ends at terminal punctuation (plus closing quotes/brackets) followed by whitespace,
# or right after CJK terminal punctuation
_SENTENCE_END = re.compile(r"[.!?;…]+[\"'”’)\]]*\s+|[。！？；]+[”’」』）]*\s*")


def split_sentences(buffer: str, max_chars: int, sentences: bool = True) -> tuple[list[str], str]:
    """Cut the complete sentences (if ``sentences``) off ``buffer``: (pieces, rest). A rest
    longer than ``max_chars`` is cut at its last whitespace (or hard at the cap), so no
    utterance exceeds the cap and the buffer stays bounded."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(buffer) if sentences else ():
        out.append(buffer[start:m.end()].strip())
        start = m.end()
    rest = buffer[start:]
    while len(rest) > max_chars:
        cut = rest.rfind(" ", 0, max_chars + 1)
        cut = cut if cut > 0 else max_chars
        out.append(rest[:cut].strip())
        rest = rest[cut:].lstrip()
    return [s for s in out if s], rest


@dataclass
class Utterance:
    """A queued utterance: the backend job and the client's label for it."""

    job: SpeechJob
    context_id: str | None = None
    speed: float = 1.0  # OpenAI speed: its audio is time-stretched by the server

    def tag(self, event: dict[str, Any]) -> dict[str, Any]:
        """``event`` with this utterance's request_id and (if any) context_id."""
        event["request_id"] = self.job.request_id
        if self.context_id is not None:
            event["context_id"] = self.context_id
        return event


@dataclass
class ContextEnd:
    """Queued by ``input.done`` {context_id}: answered with ``context.done`` when reached."""

    context_id: str


Item = Utterance | ContextEnd | None


def check_context_id(context_id: str | None) -> None:
    if context_id is None:
        return
    check_characters(context_id, "context_id")
    if not context_id or len(context_id) > MAX_CONTEXT_ID_CHARS:
        raise RequestError(400, "invalid_value",
                           f"context_id must be 1 to {MAX_CONTEXT_ID_CHARS} characters",
                           param="context_id")


class UtteranceQueue:
    """What the session's worker speaks next, bounded at ``max_pending`` utterances."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self._queue: asyncio.Queue[Item] = asyncio.Queue()

    def check_pending(self) -> None:
        """429 ``too_many_pending`` when another utterance would pass the cap."""
        if self._queue.qsize() >= self.max_pending:
            raise RequestError(429, "too_many_pending",
                               f"more than {self.max_pending} utterances pending: wait for "
                               "audio.done before sending more text", param="text")

    def put(self, item: Item) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> Item:
        return await self._queue.get()

    def _take(self) -> list[Item]:
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items

    def _refill(self, items: list[Item]) -> None:
        for item in items:
            self._queue.put_nowait(item)

    def end_context(self, context_id: str, running: bool) -> bool:
        """Queue ``context.done`` for ``context_id`` just behind its last queued utterance; False
        when none is queued and none ``running`` (answer at once). 429 when the queue is full."""
        items = self._take()
        last = max((i for i, u in enumerate(items)
                    if isinstance(u, Utterance) and u.context_id == context_id), default=None)
        if last is None and not running:
            self._refill(items)
            return False
        if len(items) >= self.max_pending:
            self._refill(items)
            self.check_pending()  # raises: too many pending
        items.insert(0 if last is None else last + 1, ContextEnd(context_id))
        self._refill(items)
        return True

    def drop(self, match: Callable[[str | None], bool]) -> list[str]:
        """Take out the utterances (and context.done markers) whose label ``match``es, closing
        their text feeds; the request ids of the utterances dropped."""
        dropped: list[str] = []
        kept: list[Item] = []
        for utt in self._take():
            if isinstance(utt, ContextEnd) and match(utt.context_id):
                continue  # a cancelled turn gets no context.done
            if isinstance(utt, Utterance) and match(utt.context_id):
                dropped.append(utt.job.request_id)
                if utt.job.text_feed is not None:
                    utt.job.text_feed.close()
            else:
                kept.append(utt)
        self._refill(kept)
        return dropped

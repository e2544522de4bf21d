"""Incremental text tokenization: turn text that arrives in pieces into ids that can no longer change.

Text-streaming prompts take the first text id into the prefill and one more id per decode step, so
a voice agent can start speaking while its LLM is still writing. ``IncrementalTokenizer`` emits
ids as they become final; all ids it ever emits equal ``encode(assistant_text(text))[3:-5]`` of
the whole text, exactly what ``PromptBuilder`` uses.

Why it is exact. The tokenizer maps a string in four steps, and BPE (the only vocabulary-dependent
step) works on each pre-token alone, so an id is final once its pre-token is. We re-run the steps
on the held window and keep a pre-token only when no continuation can change it:
  1. Special tokens are cut out of the raw text (leftmost-longest). A trailing piece that could
     still grow into one (``"<|im_"``) is not looked at yet; text up to a finished special token
     is final as a whole (the token ends its segment).
  2. NFC. Text is only looked at up to the last *safe point*: before a starter that nothing
     composes onto, or after an undecomposable starter that composes with nothing. NFC never
     crosses such a point, so the normalized prefix is final (``"e"`` waits for a possible
     U+0301, ``"é"`` for a possible U+0323, which NFC sorts in front of its acute).
  3. The split regex (both Qwen2 patterns, see ``text_tokenizer``) is matched left to right with
     no lookbehind, and every alternative only scans runs of one character family (letters and
     marks, punctuation and marks, whitespace, ``[\\r\\n/]``), a digit, or 3 chars (``'re``). The
     match at ``p`` therefore depends only on characters up to ``_horizon(p)``: the end of the
     longest such run starting at ``p`` (or ``p + 1`` after a one-char prefix). A pre-token whose
     horizon lies inside the known text is final; the first one that is not stops the scan.
     Unicode classes are taken as supersets (unassigned code points may be anything, spaces by
     either Python's or the regex engine's definition), which can only widen the horizon.
  4. The window restarts at the last final pre-token boundary that is also a safe point: the
     regex restarts there and NFC does not cross it, so tokenizing from there is the same as
     tokenizing the whole text. Per push the work is O(held text + piece).
Latency: a pre-token is held until the character after it arrives (NFC may hold one more), so
a word goes out when the next space or punctuation arrives, a CJK run at its next punctuation.
Tokenizers outside this shape (other normalizer, split pattern or added-token flags) are not
streamed: every id is held until ``close`` (still exact), with a warning.

Edge of the slice: the role line ends in ``"\\n"``; text that starts with whitespace holding a
newline joins that ``"\\n"`` in one pre-token, so ``ids[3:-5]`` may lose (part of) it. We
reproduce the slice as ``PromptBuilder`` takes it. The text's end cannot reach the suffix:
``<|im_end|>`` is a special token, which closes the segment.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import unicodedata

from omni_stream.models import prompt as prompt_layout
from omni_stream.models.text_tokenizer import PATCHED_SPLIT, QWEN2_SPLIT, TextTokenizer

log = logging.getLogger(__name__)

HEAD_IDS = 3  # prompt.py: text_ids = ids[3:-5]
TAIL_IDS = 5
_SENTINEL = "\x00"

# Possible regex families of one character (bit set; a character may be several when unsure).
_W, _L, _M, _N, _O = 1, 2, 4, 8, 16
# Unicode White_Space (what \s means to the regex engine); Python's isspace adds U+001C..001F.
_SPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
                   "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_KNOWN_SPLITS = (QWEN2_SPLIT, PATCHED_SPLIT)


@functools.lru_cache(maxsize=65536)
def _kinds(c: str) -> int:
    sure_space = c in _SPACE and c.isspace()
    k = _W if (c in _SPACE or c.isspace()) else 0
    cat = unicodedata.category(c)
    if cat == "Cn":  # unassigned here, maybe assigned in the regex engine's Unicode version
        return k | _L | _M | _N | _O
    if cat[0] == "L":
        return k | _L
    if cat[0] == "M":
        return k | _M
    if cat[0] == "N":
        return k | _N
    return k if sure_space else k | _O


@functools.cache
def _composition_pairs() -> tuple[frozenset[int], frozenset[int]]:
    """Code points that are the first / second half of a canonical composition (one-off ~0.1 s)."""
    first, second = set(range(0x1100, 0x1113)), set(range(0x1161, 0x1176)) | set(range(0x11A8, 0x11C3))
    first.update(range(0xAC00, 0xD7A4, 28))  # Hangul LV syllables take a trailing consonant
    for cp in range(0x110000):
        d = unicodedata.decomposition(chr(cp))
        if d and d[0] != "<":
            parts = d.split()
            if len(parts) == 2:
                first.add(int(parts[0], 16))
                second.add(int(parts[1], 16))
    return frozenset(first), frozenset(second)


def _plain_starter(c: str) -> bool:
    return (unicodedata.combining(c) == 0 and unicodedata.category(c) != "Cn"
            and unicodedata.is_normalized("NFC", c))


@functools.lru_cache(maxsize=65536)
def _opens(c: str) -> bool:
    """Nothing before ``c`` can compose or reorder with ``c`` or anything after it."""
    return _plain_starter(c) and ord(c) not in _composition_pairs()[1]


@functools.lru_cache(maxsize=65536)
def _closes(c: str) -> bool:
    """Nothing after ``c`` can compose or reorder with ``c`` or anything before it. A second
    half is excluded too: its composite may take more (Hangul L+V, then +T); and so is a
    precomposed ``c``: a later mark can sort into its decomposition ("é" + U+0323 -> "ẹ" U+0301)."""
    first, second = _composition_pairs()
    canonical = unicodedata.decomposition(c)[:1] not in ("", "<")
    return _plain_starter(c) and not canonical and ord(c) not in first and ord(c) not in second


def _run_ends(k: str, member) -> list[int]:
    """ends[i] = first index >= i whose character is not a member (len(k) if none)."""
    ends = [len(k)] * (len(k) + 1)
    for i in range(len(k) - 1, -1, -1):
        ends[i] = ends[i + 1] if member(k[i]) else i
    return ends


class IncrementalTokenizer:
    """One stream's text -> text ids, emitted as soon as more text cannot change them.

    ``push(piece)`` returns the ids that became final, ``close()`` the rest; ``emitted`` is all
    ids so far (a prefix of the whole text's ``ids[3:-5]``), ``held`` the text not yet emitted.
    """

    def __init__(self, tok: TextTokenizer) -> None:
        self._tt = tok
        self._tok = tok._tok  # the HF ``tokenizers.Tokenizer``: its normalizer/pre-tokenizer/model
        head, tail = prompt_layout.assistant_text(_SENTINEL).split(_SENTINEL)
        self._head_len = len(head)
        self._tail = tail
        self._parts: list[str] = []
        self._window = head  # raw text from the last final boundary on (head included at first)
        self._start = 0  # index of the window in head + text
        self._ids: list[int] = []  # final ids of head + text, the role ids included
        self._emitted: list[int] = []
        self._closed = False
        specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values()),
                          key=len, reverse=True)  # longest first: leftmost-longest like the library
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._special_prefixes = frozenset(s[:i] for s in specials for i in range(1, len(s)))
        self._special_max = max(map(len, specials), default=0)
        self._streamable = self._check_streamable()
        if self._streamable:
            self._ids.extend(self._advance())

    # ---- public API -------------------------------------------------------------------------

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def emitted(self) -> list[int]:
        return list(self._emitted)

    @property
    def held(self) -> str:
        return self._window[max(0, self._head_len - self._start):]

    @property
    def ready_for_prefill(self) -> bool:
        """A text-streaming prompt needs one final id (``len(emitted) >= 1``) to start."""
        return len(self._emitted) >= 1

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, piece: str) -> list[int]:
        """Append ``piece`` (any split: mid-word, mid-grapheme, empty) and return the new final ids."""
        if not isinstance(piece, str):
            raise TypeError(f"push() takes text (str), got {type(piece).__name__}: decode bytes first")
        if self._closed:
            raise RuntimeError("push() after close(): start a new IncrementalTokenizer per utterance")
        try:
            piece.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text holds a lone surrogate at {e.start}: send valid Unicode") from None
        if not piece:
            return []
        self._parts.append(piece)
        self._window += piece
        if not self._streamable:
            return []
        return self._emit(self._advance())

    def close(self) -> list[int]:
        """The text is complete: return every id not yet emitted."""
        if self._closed:
            raise RuntimeError("close() called twice")
        self._closed = True
        ids = self._ids + self._tt.encode(self._window + self._tail)
        text_ids = ids[HEAD_IDS:-TAIL_IDS]
        assert len(text_ids) >= len(self._emitted)
        new = text_ids[len(self._emitted):]
        self._emitted.extend(new)
        self._window = ""
        return new

    # ---- internals --------------------------------------------------------------------------

    def _emit(self, new: list[int]) -> list[int]:
        before = len(self._ids)
        self._ids.extend(new)
        out = self._ids[max(HEAD_IDS, before):]
        self._emitted.extend(out)
        return out

    def _check_streamable(self) -> bool:
        """Whether the tokenizer has the shape the stability rule is proven for."""
        why = None
        norm = self._tok.normalizer
        pre = self._tok.pre_tokenizer
        nstate = json.loads(norm.__getstate__()) if norm is not None else None
        pstate = json.loads(pre.__getstate__()) if pre is not None else {}
        steps = pstate.get("pretokenizers", []) if pstate.get("type") == "Sequence" else []
        if nstate is not None and nstate.get("type") != "NFC":
            why = f"normalizer {nstate.get('type')}"
        elif (len(steps) != 2 or steps[0].get("type") != "Split"
              or steps[0].get("pattern", {}).get("Regex") not in _KNOWN_SPLITS
              or steps[0].get("behavior") != "Isolated" or steps[0].get("invert")
              or steps[1].get("type") != "ByteLevel" or steps[1].get("use_regex")
              or steps[1].get("add_prefix_space")):
            why = "pre-tokenizer is not Split(Qwen2 pattern) + ByteLevel"
        elif any(t.normalized or t.lstrip or t.rstrip or t.single_word
                 for t in self._tok.get_added_tokens_decoder().values()):
            why = "added tokens are normalized or strip whitespace"
        if why:
            log.warning("text streaming: %s; ids are held until the text is complete", why)
        return why is None

    def _advance(self) -> list[int]:
        """Move the window start past every final pre-token; return their ids."""
        r = self._window
        n = len(r)
        matches = list(self._special_re.finditer(r)) if self._special_re is not None else []
        known = n
        for i in range(max(0, n - self._special_max + 1), n):
            if r[i:] in self._special_prefixes and not any(m.start() < i < m.end() for m in matches):
                known = i
                break
        closed_end = max((m.end() for m in matches if m.end() <= known), default=0)
        ids = self._tt.encode(r[:closed_end]) if closed_end else []
        cut, open_ids = self._advance_open(r[closed_end:known])
        self._start += closed_end + cut
        self._window = r[closed_end + cut:]
        return ids + open_ids

    def _safe(self, s: str, j: int) -> bool:
        """NFC does not cross index j of s (s[:j] is final whatever follows)."""
        if j == 0:
            return True
        return (j < len(s) and _opens(s[j])) or _closes(s[j - 1])

    def _advance_open(self, s: str) -> tuple[int, list[int]]:
        """(raw cut, ids) for the final pre-tokens of a segment with no special token in it."""
        if not s:
            return 0, []
        nfc = self._tok.normalizer is not None
        k = len(s)
        while nfc and k > 0 and not self._safe(s, k):
            k -= 1
        if k == 0:
            return 0, []
        raw = s[:k]
        if not nfc or raw.isascii():
            text, to_raw = raw, None  # NFC leaves ASCII alone: offsets are the identity
        else:  # normalize chunk by chunk between safe points to map offsets back
            to_raw, pos, last = {0: 0}, 0, 0
            for j in range(1, k + 1):
                if self._safe(s, j):
                    pos += len(self._tok.normalizer.normalize_str(s[last:j]))
                    to_raw[pos] = last = j
            text = self._tok.normalizer.normalize_str(raw)
            assert pos == len(text)
        pieces = self._tok.pre_tokenizer.pre_tokenize_str(text)
        final = self._final_count(text, [start for _, (start, _) in pieces])
        while final > 0:  # the cut must also be a safe point
            end = pieces[final - 1][1][1]
            rc = end if to_raw is None else to_raw.get(end)
            if rc is not None and self._safe(s, rc):
                break
            final -= 1
        if final == 0:
            return 0, []
        end = pieces[final - 1][1][1]
        rc = end if to_raw is None else to_raw[end]
        ids = [t.id for p, _ in pieces[:final] for t in self._tok.model.tokenize(p)]
        return rc, ids

    @staticmethod
    def _final_count(text: str, starts: list[int]) -> int:
        """How many leading pre-tokens (starting at ``starts``) no continuation of ``text`` moves."""
        n = len(text)
        lm = _run_ends(text, lambda c: _kinds(c) & (_L | _M))
        pm = _run_ends(text, lambda c: _kinds(c) & (_M | _O))
        ws = _run_ends(text, lambda c: _kinds(c) & _W)
        nl = _run_ends(text, lambda c: c in "\r\n/")
        for i, p in enumerate(starts):
            if _horizon(text, p, lm, pm, ws, nl) >= n:
                return i
        return len(starts)


def _horizon(text: str, p: int, lm: list[int], pm: list[int], ws: list[int], nl: list[int]) -> int:
    """Last index the split regex may read when matching at p (>= len(text): not decided yet).

    Every alternative of both patterns is covered: contractions read 3 chars; the letter
    alternatives an optional non-letter prefix, then a run of letters/marks; ``\\p{N}`` one char;
    punctuation an optional space, a run of non-space non-letter non-digit chars, then
    ``[\\r\\n/]*``; the whitespace ones the whitespace run and one char after it.
    """
    c = text[p]
    k = _kinds(c)
    h = max(p, lm[p], ws[p])
    if c == "'":
        h = max(h, p + 2)
    if c not in "\r\n" and k & (_W | _M | _O):  # may be the one-char prefix of a letter run
        h = max(h, lm[p + 1])
    q = p + 1 if c == " " else p
    if q >= len(text):
        return len(text)
    e = pm[q]
    return max(h, nl[e] if e > q else q)

"""``omni-stream voices add|list|delete``: manage a running server's uploaded (cloned) voices.

Talks HTTP to ``omni-stream serve`` (nothing is loaded here):

- ``POST /v1/audio/voices`` (multipart: ``audio`` file, ``name``, ``ref_text``,
  ``x_vector_only``) -> 201 the voice record
- ``GET /v1/audio/voices`` -> ``{"voices": [every name], "uploaded_voices": [records]}``
- ``DELETE /v1/audio/voices/{name}`` -> ``{"name", "deleted": true}``

Exit status: 0 done; 2 the server refused the request (a 4xx: its message is printed) or the
arguments are wrong; 1 the server could not be reached, failed (5xx) or answered nonsense.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mimetypes
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

DEFAULT_URL = "http://127.0.0.1:8000"
API_KEY_ENV = "OMNI_STREAM_API_KEY"  # the server's variable (server.settings.API_KEY_ENV)
VOICES_ROUTE = "/v1/audio/voices"

_AUDIO_TYPES = {".wav": "audio/wav", ".flac": "audio/flac", ".mp3": "audio/mpeg",
                ".ogg": "audio/ogg", ".opus": "audio/ogg"}


class CliFailure(Exception):
    """A failure to report on stderr with an exit status (2: refused, 1: unreachable/broken)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def add_voices_parser(subparsers) -> argparse.ArgumentParser:
    """Hook ``voices`` into the main CLI's subparsers (each leaf sets ``func``)."""
    p = subparsers.add_parser("voices", help="add, list or delete a running server's cloned voices",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="voices_cmd", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--url", default=DEFAULT_URL, help=f"server base URL (default {DEFAULT_URL})")
        q.add_argument("--api-key", default=None, help=f"bearer key (default: ${API_KEY_ENV})")
        q.add_argument("--timeout", type=float, default=300.0,
                       help="seconds to wait for the server (encoding a voice takes a while on CPU)")

    a = sub.add_parser("add", help="upload a reference clip as a new voice")
    a.add_argument("name", help="voice name: 1-64 of A-Z a-z 0-9 _ . - (case-insensitive)")
    a.add_argument("audio_file", help="reference clip: WAV, FLAC, MP3, OGG (1-30 s of speech)")
    mode = a.add_mutually_exclusive_group()
    mode.add_argument("--ref-text", default=None,
                      help="transcript of the clip (ICL mode: the closest clone)")
    mode.add_argument("--x-vector-only", action="store_true",
                      help="use only the speaker embedding (no transcript needed)")
    a.add_argument("--json", action="store_true", help="print the server's record as JSON")
    common(a)
    a.set_defaults(func=cmd_voices_add)

    ls = sub.add_parser("list", help="list the server's voices (built-in and uploaded)")
    ls.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    common(ls)
    ls.set_defaults(func=cmd_voices_list)

    d = sub.add_parser("delete", help="delete an uploaded voice")
    d.add_argument("name")
    common(d)
    d.set_defaults(func=cmd_voices_delete)
    return p


def _api_key(a: argparse.Namespace) -> str | None:
    return a.api_key or os.environ.get(API_KEY_ENV) or None


async def _call(a: argparse.Namespace, method: str, path: str, data: Any = None) -> Any:
    """One request -> the decoded JSON body; CliFailure on anything else."""
    import aiohttp

    url = a.url.rstrip("/") + path
    key = _api_key(a)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=a.timeout)) as s:
            async with s.request(method, url, data=data, headers=headers) as r:
                text = await r.text()
                status = r.status
    except asyncio.TimeoutError:
        raise CliFailure(f"no answer from the server at {a.url} within {a.timeout:g} s "
                         "(raise --timeout?)", 1) from None
    except (aiohttp.ClientError, OSError, ValueError) as e:
        raise CliFailure(f"cannot reach the server at {a.url} ({e}): is `omni-stream serve` "
                         "running there? Pass its address with --url", 1) from e
    try:
        body = json.loads(text) if text else None
    except json.JSONDecodeError:
        body = None
    if status >= 400:
        err = body.get("error") if isinstance(body, dict) else None
        msg = err.get("message") if isinstance(err, dict) else None
        msg = msg or text.strip()[:300] or "no message"
        code = f" [{err['code']}]" if isinstance(err, dict) and err.get("code") else ""
        raise CliFailure(f"server refused ({status}{code}): {msg}" if status < 500 else
                         f"server failed ({status}{code}): {msg}", 2 if status < 500 else 1)
    if not isinstance(body, dict):
        raise CliFailure(f"the server at {a.url} answered {method} {path} with something that "
                         f"is not a JSON object (HTTP {status}): {text.strip()[:200]!r}", 1)
    return body


def _run(a: argparse.Namespace, coro_fn) -> int:
    try:
        return asyncio.run(coro_fn(a))
    except CliFailure as e:
        print(f"omni-stream voices: error: {e.message}", file=sys.stderr)
        return e.exit_code


def cmd_voices_add(a: argparse.Namespace) -> int:
    return _run(a, _add)


def cmd_voices_list(a: argparse.Namespace) -> int:
    return _run(a, _list)


def cmd_voices_delete(a: argparse.Namespace) -> int:
    return _run(a, _delete)


async def _add(a: argparse.Namespace) -> int:
    import aiohttp

    from omni_stream.voices.audio import MAX_UPLOAD_BYTES

    path = Path(a.audio_file)
    if not path.is_file():
        raise CliFailure(f"{path} is not a file: pass the reference clip to upload", 2)
    size = path.stat().st_size
    if size > MAX_UPLOAD_BYTES:
        raise CliFailure(f"{path} is {size / 2**20:.1f} MiB; the server takes at most "
                         f"{MAX_UPLOAD_BYTES // 2**20} MiB: trim it to a 1-30 s clip", 2)
    ctype = _AUDIO_TYPES.get(path.suffix.lower()) or mimetypes.guess_type(path.name)[0]
    # filename sent as is (UTF-8), the way browsers send it; aiohttp's default would
    # percent-encode it, which servers do not undo
    form = aiohttp.FormData(quote_fields=False)
    filename = "".join("_" if c in '\r\n"\\' else c for c in path.name)
    form.add_field("audio", path.read_bytes(), filename=filename,
                   content_type=ctype or "application/octet-stream")
    form.add_field("name", a.name)
    if a.ref_text is not None:
        form.add_field("ref_text", a.ref_text)
    if a.x_vector_only:
        form.add_field("x_vector_only", "true")
    rec = await _call(a, "POST", VOICES_ROUTE, data=form)
    if a.json:
        print(json.dumps(rec, indent=2, ensure_ascii=False))
    else:
        print(f"added voice {rec.get('name', a.name)!r}: mode {rec.get('mode', '?')}, "
              f"{_num(rec.get('duration_s'), '.2f')} s reference, {rec.get('frames', 0)} code frames")
    return 0


async def _list(a: argparse.Namespace) -> int:
    body = await _call(a, "GET", VOICES_ROUTE)
    if a.json:
        print(json.dumps(body, indent=2, ensure_ascii=False))
        return 0
    uploaded = [r for r in body.get("uploaded_voices") or [] if isinstance(r, dict)]
    mine = {str(r.get("name", "")).lower() for r in uploaded}
    builtin = [v for v in body.get("voices") or [] if str(v).lower() not in mine]
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    console.print(f"built-in voices ({len(builtin)}): " + (", ".join(map(str, builtin)) or "none"),
                  markup=False)
    if not uploaded:
        console.print("uploaded voices: none (add one with `omni-stream voices add`)", markup=False)
        return 0
    t = Table(title=f"uploaded voices ({len(uploaded)})", title_justify="left")
    for col, just in (("name", "left"), ("mode", "left"), ("ref s", "right"),
                      ("frames", "right"), ("created (UTC)", "left"), ("ref text", "left")):
        t.add_column(col, justify=just, overflow="fold" if col == "name" else "ellipsis",
                     no_wrap=col not in ("name", "ref text"))
    for r in uploaded:
        ref = r.get("ref_text") or ""
        cells = (str(r.get("name", "?")), str(r.get("mode", "?")), _num(r.get("duration_s"), ".2f"),
                 str(r.get("frames", 0)), _when(r.get("created_at")),
                 ref if len(ref) <= 48 else ref[:47] + "…")
        t.add_row(*(Text(c) for c in cells))  # Text: a '[' in a name or transcript is not markup
    console.print(t)
    return 0


async def _delete(a: argparse.Namespace) -> int:
    body = await _call(a, "DELETE", f"{VOICES_ROUTE}/{quote(a.name, safe='')}")
    print(f"deleted voice {body.get('name', a.name)!r}")
    return 0


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "?"


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))

"""Uploaded bytes -> reference audio for voice cloning, with errors that name the fix.

Two ways in: a multipart upload (``decode_audio`` on the file's bytes) or a JSON field holding
the audio inline (``decode_ref_audio_field`` -> bytes -> ``decode_audio``). The server never
fetches URLs or reads its own paths on a client's behalf: that would let a request probe the
server's network or files.

Every failure is an ``errors.RequestError`` carrying the HTTP status, a short code and the
request field at fault, which the server sends as it is.

Limits (one place; the encoder resamples, so any sample rate is accepted):

- ``MAX_UPLOAD_BYTES`` (25 MiB) of encoded audio -> 413 ``upload_too_large``
- ``MIN_SECONDS`` (1 s) .. ``MAX_SECONDS`` (30 s) -> 400 ``audio_too_short`` / ``audio_too_long``
- peak below ``SILENCE_DBFS`` (-60 dBFS) -> 400 ``audio_silent``
- no bytes or no samples -> 400 ``audio_empty``; NaN/inf samples -> 400 ``audio_not_finite``
- bytes libsndfile cannot read -> 415 ``unsupported_audio``
- a sample rate outside ``MIN_SAMPLE_RATE`` .. ``MAX_SAMPLE_RATE`` (8-192 kHz) -> 400
  ``unsupported_sample_rate``; more than ``MAX_CHANNELS`` (8) -> 400 ``too_many_channels``.
  With the duration cap these bound what one clip can make the server allocate (a small
  compressed file can claim, and decode to, many samples).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re

import numpy as np
import soundfile as sf

from omni_stream.errors import RequestError

__all__ = ["decode_audio", "decode_ref_audio_field", "ACCEPTED_FORMATS",
           "MAX_UPLOAD_BYTES", "MIN_SECONDS", "MAX_SECONDS", "SILENCE_DBFS",
           "MIN_SAMPLE_RATE", "MAX_SAMPLE_RATE", "MAX_CHANNELS"]

MAX_UPLOAD_BYTES = 25 * 2**20  # encoded bytes of one reference clip
MIN_SECONDS = 1.0  # shorter clips give an unreliable speaker embedding
MAX_SECONDS = 30.0  # the official recipe uses a few seconds; longer only costs prompt length
SILENCE_DBFS = -60.0  # a peak below this is treated as silence
_SILENCE_PEAK = 10.0 ** (SILENCE_DBFS / 20.0)
MIN_SAMPLE_RATE = 8000  # telephone audio; below it there is no speech left to clone
MAX_SAMPLE_RATE = 192000
MAX_CHANNELS = 8

ACCEPTED_FORMATS = "WAV, FLAC, MP3, OGG/Vorbis or OGG/Opus"
_FORMS = ("a data URL ('data:audio/wav;base64,...') or plain standard base64 of the audio file "
          "(RFC 4648 alphabet with '=' padding)")


def _too_large(n: int, param: str) -> RequestError:
    return RequestError(413, "upload_too_large",
                        f"the reference audio is {n / 2**20:.1f} MiB; at most "
                        f"{MAX_UPLOAD_BYTES // 2**20} MiB is accepted: send a shorter clip "
                        f"({MIN_SECONDS:g}-{MAX_SECONDS:g} s) or a compressed format (FLAC, MP3, OGG)",
                        param=param)


def decode_audio(data: bytes, param: str = "audio") -> tuple[np.ndarray, int]:
    """Encoded audio bytes -> (float32 mono [samples], original sample rate), validated.

    Channels are mixed down by their mean (as the official ``create_voice_clone_prompt``
    does). No resampling: the encoder brings it to each model part's rate. At most
    ``MAX_SECONDS`` (+1 sample) is decoded, so a small file that claims hours cannot make the
    server allocate them.
    """
    if len(data) == 0:
        raise RequestError(400, "audio_empty", "the reference audio is empty (0 bytes): send a "
                           f"{MIN_SECONDS:g}-{MAX_SECONDS:g} s clip of speech", param=param)
    if len(data) > MAX_UPLOAD_BYTES:
        raise _too_large(len(data), param)
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            sr, channels = int(f.samplerate), int(f.channels)
            if not MIN_SAMPLE_RATE <= sr <= MAX_SAMPLE_RATE:
                raise RequestError(400, "unsupported_sample_rate",
                                   f"the reference audio's sample rate is {sr} Hz; "
                                   f"{MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz is accepted: "
                                   "re-encode it (e.g. at 24000 or 48000 Hz)", param=param)
            if channels > MAX_CHANNELS:
                raise RequestError(400, "too_many_channels",
                                   f"the reference audio has {channels} channels; at most "
                                   f"{MAX_CHANNELS} are accepted: send a mono or stereo clip",
                                   param=param)
            limit = int(math.ceil(MAX_SECONDS * sr)) + 1
            claimed = f.frames if f.seekable() else None
            x = f.read(frames=limit, dtype="float32", always_2d=True)  # [samples, channels]
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        why = (getattr(e, "error_string", "") or str(e)).strip().rstrip(".")  # not the BytesIO repr
        raise RequestError(415, "unsupported_audio",
                           f"could not read the reference audio as {ACCEPTED_FORMATS} ({why}): "
                           "send the clip in one of these formats", param=param) from e
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise RequestError(400, "audio_empty", "the reference audio holds no samples: send a "
                           f"{MIN_SECONDS:g}-{MAX_SECONDS:g} s clip of speech", param=param)
    wav = np.ascontiguousarray(x.mean(axis=1, dtype=np.float32))  # [samples]
    if not np.isfinite(wav).all():
        raise RequestError(400, "audio_not_finite",
                           "the reference audio has NaN or infinite samples: re-export it "
                           "(e.g. as 16-bit PCM WAV)", param=param)
    n = wav.shape[0]
    if n >= limit:
        total = f"{claimed / sr:.1f} s" if claimed and claimed >= limit else f"over {MAX_SECONDS:g} s"
        raise RequestError(400, "audio_too_long",
                           f"the reference audio is {total} long; at most {MAX_SECONDS:g} s is "
                           "accepted: trim it to a few seconds of clean speech", param=param)
    secs = n / sr
    if secs < MIN_SECONDS:
        raise RequestError(400, "audio_too_short",
                           f"the reference audio is {secs:.2f} s long; at least "
                           f"{MIN_SECONDS:g} s is needed: send a longer clip of speech "
                           "(3-10 s works best)", param=param)
    peak = float(np.abs(wav).max())
    if peak < _SILENCE_PEAK:
        level = "-inf" if peak == 0 else f"{20 * math.log10(peak):.0f}"
        raise RequestError(400, "audio_silent",
                           f"the reference audio is silent (peak {level} dBFS, below "
                           f"{SILENCE_DBFS:g} dBFS): check the recording and send audible speech",
                           param=param)
    return wav, sr


_DATA_URL = re.compile(r"^data:(?P<type>[^,;]*)(?P<params>(?:;[^,;]*)*),(?P<data>.*)$",
                       re.DOTALL | re.IGNORECASE)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_PATH = re.compile(r"^(?:~|\.{1,2}[\\/]|/|[A-Za-z]:[\\/]|file:)")
_B64_CHARS = re.compile(r"^[A-Za-z0-9+/]*={0,2}$")
_WS = re.compile(r"\s+")


def _refuse_url(param: str) -> RequestError:
    return RequestError(400, "ref_audio_url_refused",
                        f"'{param}' looks like a URL; the server does not fetch URLs (for "
                        f"security): send the audio inline as {_FORMS}, or upload it once "
                        "with POST /v1/audio/voices and use the voice's name", param=param)


def _refuse_path(param: str) -> RequestError:
    return RequestError(400, "ref_audio_path_refused",
                        f"'{param}' looks like a file path; the server does not read its own "
                        f"files on a client's behalf (for security): send the audio inline as "
                        f"{_FORMS}, or upload it once with POST /v1/audio/voices and use the "
                        "voice's name", param=param)


def _b64(s: str, param: str, what: str) -> bytes:
    s = _WS.sub("", s)  # line-wrapped base64 (e.g. the `base64` tool's 76 columns) is fine
    if len(s) > (MAX_UPLOAD_BYTES + 2) // 3 * 4:
        raise _too_large(len(s) * 3 // 4, param)
    try:
        out = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(400, "invalid_ref_audio",
                           f"'{param}' is not valid {what} ({e}): send {_FORMS}", param=param) from e
    if len(out) > MAX_UPLOAD_BYTES:
        raise _too_large(len(out), param)
    return out


def decode_ref_audio_field(s: str, param: str = "ref_audio") -> bytes:
    """A JSON field holding reference audio -> the encoded audio bytes (``decode_audio`` next).

    Accepts a data URL (``data:audio/wav;base64,...``; the media type is not trusted, the bytes
    are sniffed by ``decode_audio``) or plain base64. Refuses URLs and server paths.
    """
    if not isinstance(s, str):
        raise RequestError(400, "invalid_ref_audio", f"'{param}' must be a string: {_FORMS}",
                           param=param)
    s = s.strip()
    if not s:
        raise RequestError(400, "audio_empty", f"'{param}' is empty: send {_FORMS}", param=param)
    if s[:5].lower() == "data:":
        m = _DATA_URL.match(s)
        if m is None:
            raise RequestError(400, "invalid_ref_audio",
                               f"'{param}' is not a valid data URL (no ',' before the data): "
                               f"send {_FORMS}", param=param)
        if "base64" not in (p.strip().lower() for p in m["params"].split(";")):
            raise RequestError(400, "invalid_ref_audio",
                               f"'{param}' is a data URL without ';base64': send {_FORMS}",
                               param=param)
        out = _b64(m["data"], param, "base64 in a data URL")
    else:
        if _URL.match(s):
            raise _refuse_url(param)
        compact = _WS.sub("", s)
        # base64 may itself start with '/' (raw MP3 frames encode as '//s...'): a path is
        # refused only when it cannot be base64, or is too short to hold a usable clip
        if _PATH.match(s) and (not _B64_CHARS.match(compact) or len(compact) % 4
                               or len(compact) < 256):
            raise _refuse_path(param)
        out = _b64(s, param, "base64")
    if not out:
        raise RequestError(400, "audio_empty", f"'{param}' decodes to 0 bytes: send {_FORMS}",
                           param=param)
    return out

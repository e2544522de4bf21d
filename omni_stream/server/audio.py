"""Audio encoders for the HTTP responses.

``pcm`` (raw s16le mono) and ``wav`` stream chunk by chunk: a streamed wav is ONE 44-byte header
with placeholder sizes (0xFFFFFFFF, "until end of stream", as players and libsndfile accept)
followed by raw s16le; a non-streamed wav has the exact sizes. ``flac``, ``mp3`` and ``opus``
(Ogg Opus) are encoded whole by libsndfile, where this soundfile build has them.
"""

from __future__ import annotations

import functools
import io
import struct
from dataclasses import dataclass

import numpy as np

STREAM_SIZE_PLACEHOLDER = 0xFFFFFFFF


@dataclass(frozen=True)
class AudioFormat:
    name: str
    content_type: str
    streamable: bool  # can be written chunk by chunk as audio arrives
    sf_format: str | None = None  # libsndfile (format, subtype) for whole-file encoding
    sf_subtype: str | None = None


_ALL_FORMATS = (
    AudioFormat("pcm", "audio/pcm", True),
    AudioFormat("wav", "audio/wav", True),
    AudioFormat("flac", "audio/flac", False, "FLAC", "PCM_16"),
    AudioFormat("mp3", "audio/mpeg", False, "MP3", "MPEG_LAYER_III"),
    AudioFormat("opus", "audio/ogg", False, "OGG", "OPUS"),
)


@functools.cache
def supported_formats() -> dict[str, AudioFormat]:
    """Formats this process can produce: pcm and wav always, the rest as libsndfile allows."""
    import soundfile as sf

    out = {}
    for f in _ALL_FORMATS:
        if f.sf_format is None or (f.sf_format in sf.available_formats()
                                   and f.sf_subtype in sf.available_subtypes(f.sf_format)):
            out[f.name] = f
    return out


def default_format() -> str:
    """OpenAI's default (mp3) where libsndfile can write it, else wav."""
    return "mp3" if "mp3" in supported_formats() else "wav"


def to_s16le(pcm: np.ndarray) -> bytes:
    """float32 [-1, 1] mono -> signed 16-bit little-endian bytes (clipped, rounded)."""
    x = np.clip(pcm, -1.0, 1.0) * 32767.0
    return np.rint(x).astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """44-byte RIFF/WAVE header for s16le mono; ``data_bytes=None`` writes the streaming
    placeholder sizes."""
    if data_bytes is None:
        riff = data = STREAM_SIZE_PLACEHOLDER
    else:
        riff, data = 36 + data_bytes, data_bytes
    return struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", riff, b"WAVE", b"fmt ", 16, 1, 1,
                       sample_rate, sample_rate * 2, 2, 16, b"data", data)


def encode_whole(pcm: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """A complete file of ``pcm`` (float32 mono) in ``fmt``. libsndfile formats take tens of ms
    per second of audio: call those from an executor, not the event loop."""
    f = supported_formats()[fmt]
    if fmt == "pcm":
        return to_s16le(pcm)
    if fmt == "wav":
        data = to_s16le(pcm)
        return wav_header(sample_rate, len(data)) + data
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, pcm, sample_rate, format=f.sf_format, subtype=f.sf_subtype)
    return buf.getvalue()


class StreamEncoder:
    """One stream encoded chunk by chunk in ``fmt``: :meth:`encode` returns the bytes the
    encoder has produced so far (maybe none: mp3 and opus hold whole packets back),
    :meth:`finish` the rest. pcm is plain s16le, wav a streaming header then s16le; the
    libsndfile formats (mp3, opus, flac) are written into one growing buffer and sent as it
    grows. Where the encoder rewrites its header on close (flac's sample count) the client keeps
    the header sent first, which says "length unknown", as any streamed file does.
    ``slow``: the libsndfile formats take ms per chunk; call them off the event loop."""

    def __init__(self, fmt: AudioFormat, sample_rate: int) -> None:
        self.fmt = fmt
        self.slow = fmt.sf_format is not None
        self._header = wav_header(sample_rate, None) if fmt.name == "wav" else b""
        self._file = None
        if self.slow:
            import soundfile as sf

            self._buf = io.BytesIO()
            self._file = sf.SoundFile(self._buf, "w", sample_rate, 1, format=fmt.sf_format,
                                      subtype=fmt.sf_subtype)
            self._sent = 0

    def encode(self, pcm: np.ndarray) -> bytes:
        if self._file is None:
            out, self._header = self._header + to_s16le(pcm), b""
            return out
        self._file.write(np.frombuffer(to_s16le(pcm), "<i2"))  # the pcm path's samples
        return self._take()

    def finish(self) -> bytes:
        if self._file is None:
            out, self._header = self._header, b""
            return out
        self._file.close()
        return self._take()

    def _take(self) -> bytes:
        data = self._buf.getbuffer()[self._sent:].tobytes()
        self._sent += len(data)
        return data


"""Cloned voices over HTTP: ``/v1/audio/voices`` and the ``ref_audio`` request fields.

- ``POST /v1/audio/voices`` (multipart: ``audio`` file, ``name``, optional ``ref_text`` and
  ``x_vector_only``) decodes the file, computes the voice (x-vector, and in ICL mode the
  reference codes) and keeps it in the :class:`~omni_stream.voices.store.VoiceStore`, which
  persists it on disk; 201 with the voice's record.
- ``GET /v1/audio/voices`` lists built-in and uploaded voices; ``DELETE
  /v1/audio/voices/{name}`` removes an uploaded one.
- A speech request (HTTP or WebSocket ``session.config``) names an uploaded voice in ``voice``,
  or carries a one-off ``ref_audio`` (base64 or a data URL) with an optional ``ref_text``.

Only a Base checkpoint can clone (it carries the speaker encoder and the tokenizer's encoder);
any other model answers every clone request with a 400 that names the variant needed. The
encoders load on the first clone request and run in a worker thread, so the event loop and the
running streams go on while a voice is computed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from omni_stream.errors import RequestError
from omni_stream.models.voice_clone import VoiceClone

log = logging.getLogger(__name__)

CLONE_VARIANT = "base"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class ClonedAudio:
    clone: VoiceClone
    duration_s: float
    sample_rate: int


class VoiceService:
    """Uploaded voices of one served model: the store and, loaded on first use, the encoders.

    ``model_dir`` None or a non-Base ``variant``: cloning is refused (400 naming the fix)."""

    def __init__(self, model_dir: str | Path | None, variant: str, builtin: list[str],
                 voice_dir: str | Path | None = None, store=None) -> None:
        """``store``: where uploaded voices live when not in ``voice_dir`` on this machine (a
        cluster's shared store, ``omni_stream.cluster.registry``); it has VoiceStore's methods."""
        self.variant = variant
        self.builtin = list(builtin)
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.store = None
        self._encoder = None
        self._lock = threading.Lock()
        if self.supported and store is not None:
            self.store = store
        elif self.supported:
            from omni_stream.voices.store import VoiceStore, default_voice_dir

            root = Path(voice_dir) if voice_dir else default_voice_dir(self.model_dir)
            self.store = VoiceStore(root)
            log.info("voice store: %s (%d voices)", root, len(self.store.list()))

    @property
    def supported(self) -> bool:
        return self.model_dir is not None and self.variant == CLONE_VARIANT

    def require(self, param: str | None) -> None:
        if not self.supported:
            raise RequestError(400, "voice_clone_unsupported",
                               f"this server's model is a {self.variant} checkpoint, which cannot "
                               "clone voices: serve a Base checkpoint (Qwen3-TTS-12Hz-0.6B-Base or "
                               "-1.7B-Base) to use uploaded voices or ref_audio", param=param)

    def encoder(self):
        with self._lock:
            if self._encoder is None:
                from omni_stream.voices.encode import VoiceEncoder

                t0 = time.perf_counter()
                self._encoder = VoiceEncoder(self.model_dir)
                log.info("voice encoders loaded in %.1f s", time.perf_counter() - t0)
            return self._encoder

    def _clone_sync(self, data: bytes, ref_text: str | None, x_vector_only: bool,
                    param: str) -> ClonedAudio:
        from omni_stream.voices.audio import decode_audio

        wav, sr = decode_audio(data, param=param)
        clone = self.encoder().encode(wav, sr, ref_text=ref_text, x_vector_only=x_vector_only)
        return ClonedAudio(clone, len(wav) / sr, sr)

    async def clone(self, data: bytes, ref_text: str | None, x_vector_only: bool,
                    param: str = "audio") -> ClonedAudio:
        """Reference audio bytes -> a voice, computed in a worker thread. RequestError on bad input."""
        self.require(param)
        ref_text = (ref_text or "").strip() or None
        if not x_vector_only and ref_text is None:
            raise RequestError(400, "missing_ref_text",
                               "'ref_text' is required to clone in ICL mode (the default): send "
                               "the transcript of the reference audio, or set x_vector_only true to "
                               "clone from the speaker embedding alone", param="ref_text")
        if x_vector_only:
            ref_text = None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._clone_sync, data, ref_text, x_vector_only,
                                          param)

    def lookup(self, name: str):
        """The uploaded voice called ``name`` (any case), or None."""
        if self.store is None:
            return None
        return self.store.get(name)

    def uploaded_names(self) -> list[str]:
        return [r.name for r in self.store.list()] if self.store is not None else []

    async def attach_ref_audio(self, job, opts):
        """``job`` with the voice of ``opts.ref_audio`` (a one-off clone), or ``job`` itself
        when the request carries none. RequestError on bad input or a model that cannot clone."""
        if opts.ref_audio is None:
            return job
        from dataclasses import replace

        from omni_stream.voices.audio import decode_ref_audio_field

        self.require("ref_audio")
        data = decode_ref_audio_field(opts.ref_audio, param="ref_audio")
        got = await self.clone(data, opts.ref_text, bool(opts.x_vector_only), param="ref_audio")
        # still validated: require() checked the model clones, and its own encoder made the clone
        return replace(job, clone=got.clone, voice=None, voice_label="ref_audio")


def parse_bool(value: str | None, param: str) -> bool:
    v = (value or "").strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise RequestError(400, "invalid_value", f"'{param}' must be true or false, got '{value}'",
                       param=param)


# ------------------------------------------------------------------------------- handlers
async def _read_form(request: web.Request,
                     max_bytes: int) -> tuple[dict[str, str], bytes | None]:
    """The multipart fields (text) and the ``audio`` file's bytes (None: no file)."""
    ctype = request.headers.get("Content-Type", "")
    if ctype.lower().startswith("application/x-www-form-urlencoded"):  # a form with no file
        raise RequestError(400, "missing_audio",
                           "no 'audio' file in the form: attach the reference clip as "
                           "multipart/form-data (curl -F audio=@voice.wav -F name=myvoice)",
                           param="audio")
    if not ctype.lower().startswith("multipart/form-data"):
        raise RequestError(415, "unsupported_media_type",
                           "upload a voice as multipart/form-data with fields 'audio' (the "
                           "file), 'name', and optionally 'ref_text' and 'x_vector_only' (curl -F "
                           "audio=@voice.wav -F name=myvoice -F ref_text='...')")
    reader = await request.multipart()
    fields: dict[str, str] = {}
    audio: bytes | None = None
    known = {"audio", "name", "ref_text", "x_vector_only", "model"}
    while True:
        part = await reader.next()
        if part is None:
            break
        name = part.name or ""
        if name not in known:
            raise RequestError(400, "unknown_field",
                               f"unknown form field '{name}': the fields are audio, name, "
                               "ref_text, x_vector_only", param=name)
        if name == "audio":
            buf = bytearray()
            while True:
                chunk = await part.read_chunk(1 << 16)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > max_bytes:
                    raise RequestError(413, "upload_too_large",
                                       f"the audio file is over {max_bytes >> 20} MiB: send a "
                                       "shorter clip (10-20 s of speech is plenty)", param="audio")
            audio = bytes(buf)
        else:
            fields[name] = (await part.text())
    return fields, audio


async def create_voice(request: web.Request) -> web.Response:
    from omni_stream.server.state import STATE
    from omni_stream.voices.audio import MAX_UPLOAD_BYTES
    from omni_stream.voices.store import validate_name

    st = request.app[STATE]
    svc: VoiceService = st.voices
    svc.require("audio")
    fields, audio = await _read_form(request, MAX_UPLOAD_BYTES)
    name = validate_name(fields.get("name", ""))
    if audio is None:
        raise RequestError(400, "missing_audio",
                           "no 'audio' file in the form: attach the reference clip "
                           "(curl -F audio=@voice.wav)", param="audio")
    if name.lower() in {v.lower() for v in svc.builtin}:
        raise RequestError(409, "voice_exists",
                           f"'{name}' is a built-in voice: choose another name", param="name")
    if svc.lookup(name) is not None:  # before the encoders run; the store checks again
        raise RequestError(409, "voice_exists",
                           f"a voice named '{name}' exists: delete it first or choose another "
                           "name", param="name")
    x_only = parse_bool(fields.get("x_vector_only"), "x_vector_only")
    t0 = time.perf_counter()
    got = await svc.clone(audio, fields.get("ref_text"), x_only)
    rec = await asyncio.get_running_loop().run_in_executor(
        None, lambda: svc.store.add(name, got.clone, duration_s=got.duration_s,
                                    sample_rate=got.sample_rate))
    log.info("voice '%s' registered (%s, %.1f s of audio) in %.2f s", name, got.clone.mode,
             got.duration_s, time.perf_counter() - t0)
    return web.json_response(rec.as_json(), status=201)


async def delete_voice(request: web.Request) -> web.Response:
    from omni_stream.server.state import STATE

    svc: VoiceService = request.app[STATE].voices
    name = request.match_info["name"]
    if name.lower() in {v.lower() for v in svc.builtin}:
        raise RequestError(400, "builtin_voice",
                           f"'{name}' is a built-in voice and cannot be deleted", param="name")
    svc.require("name")
    if not await asyncio.get_running_loop().run_in_executor(None, svc.store.delete, name):
        raise RequestError(404, "voice_not_found",
                           f"no uploaded voice named '{name}' (GET /v1/audio/voices lists them)",
                           param="name")
    return web.json_response({"name": name, "deleted": True, "object": "voice"})

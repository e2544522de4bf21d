"""Wire schema (msgspec structs) and its resolution into a :class:`SpeechJob`.

The HTTP body must be declared JSON (:func:`check_content_type`: 415 otherwise). Types are
checked by msgspec on decode (the error names the field); values, the model name, voice
aliases, formats, the text cap and the characters of the text (:func:`check_characters`) are
checked here; voice/language against the model are checked by ``backend.validate``. HTTP and
WebSocket share :class:`SynthesisOptions` and these checks.

Voice aliases: the OpenAI voice names, in the order of :data:`OPENAI_VOICES`, map onto
``backend.voices()`` in its order, wrapping around: with the 9 Qwen3-TTS CustomVoice speakers
alloy -> voices[0], ash -> voices[1], ..., fable -> voices[5], ..., marin -> voices[2],
cedar -> voices[3]. A backend voice name (any case) is always accepted as itself.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Union

import msgspec

from omni_stream.server.audio import AudioFormat, default_format, supported_formats
from omni_stream.contract import Backend, SpeechJob
from omni_stream.errors import RequestError
from omni_stream.server.errors import from_validation
from omni_stream.server.settings import ServerSettings
from omni_stream.server.speed import check_speed, require_speed

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage",
                 "shimmer", "verse", "marin", "cedar")
MAX_SEED = 2**63 - 1
MAX_INITIAL_CHUNK_FRAMES = 64


class VoiceRef(msgspec.Struct):
    id: str


class SynthesisOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by ``POST /v1/audio/speech`` and WebSocket ``session.config``. A field
    the server does not implement is refused by name (400), never ignored."""

    model: str | None = None  # None: the served model
    voice: Union[str, VoiceRef, None] = None  # None: the model's default speaker
    instructions: str | None = None
    response_format: str | None = None
    speed: float | None = None
    # extensions (vLLM-Omni compatible)
    language: str | None = None  # None / "auto": detect
    seed: int | None = None
    max_new_tokens: int | None = None  # codec frames (80 ms each)
    initial_codec_chunk_frames: int | None = None
    greedy: bool | None = None
    do_sample: bool | None = None  # do_sample=false is greedy=true
    task_type: str | None = None  # vLLM-Omni: CustomVoice | VoiceDesign | Base (must match)
    # voice cloning (Base models): a one-off reference clip, base64 or a data URL
    ref_audio: str | None = None
    ref_text: str | None = None  # its transcript (ICL mode, the default)
    x_vector_only: bool | None = None  # clone from the speaker embedding alone


class SpeechRequest(SynthesisOptions, kw_only=True):
    """Body of ``POST /v1/audio/speech``."""

    input: str
    stream_format: str | None = None  # "audio" (default) | "sse"
    stream: bool = True  # extension: false returns the whole file with Content-Length


# --- WebSocket client events (tagged by "type") ---------------------------------------------
class SessionConfig(SynthesisOptions, kw_only=True, tag="session.config", tag_field="type"):
    stream_format: str | None = None  # "audio": binary frames (default); "sse": JSON events
    codec_frames: bool = False  # send codec frames instead of PCM (client-side Code2Wav)
    split_sentences: bool = True  # synthesize each complete sentence as soon as it arrives
    text_mode: str | None = None  # "sentences" (default) | "continuous": one utterance fed live


class InputText(msgspec.Struct, forbid_unknown_fields=True, tag="input.text", tag_field="type"):
    text: str
    context_id: str | None = None  # the client's label for the utterance this text goes to
    speed: float | None = None  # that utterance's speed; None: the session's


class InputDone(msgspec.Struct, forbid_unknown_fields=True, tag="input.done", tag_field="type"):
    context_id: str | None = None  # continuous: close only the utterance with this label


class InputCancel(msgspec.Struct, forbid_unknown_fields=True, tag="input.cancel",
                  tag_field="type"):
    context_id: str | None = None  # None: every utterance of the session


class SessionClose(msgspec.Struct, forbid_unknown_fields=True, tag="session.close",
                   tag_field="type"):
    pass


ClientEvent = Union[SessionConfig, InputText, InputDone, InputCancel, SessionClose]


def new_request_id(prefix: str = "speech") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def voice_aliases(backend_voices: list[str]) -> dict[str, str | None]:
    """OpenAI voice name -> backend voice (None where the model has no speakers)."""
    n = len(backend_voices)
    return {a: (backend_voices[i % n] if n else None) for i, a in enumerate(OPENAI_VOICES)}


def voice_name(voice: Union[str, VoiceRef, None]) -> str | None:
    return None if voice is None else (voice.id if isinstance(voice, VoiceRef) else voice).strip()


def resolve_voice(voice: Union[str, VoiceRef, None], backend_voices: list[str],
                  uploaded: Callable[[], list[str]] = list) -> str | None:
    """The backend voice ``voice`` names (any case; OpenAI names as aliases), or None for the
    default. ``uploaded()`` (the uploaded voices' names) is only read to word the error."""
    if voice is None:
        return None
    name = voice_name(voice)
    key = name.lower()
    for v in backend_voices:
        if v.lower() == key:
            return v
    if key in OPENAI_VOICES:
        return voice_aliases(backend_voices)[key]
    own = ", ".join([*backend_voices, *uploaded()]) or "(none: the model has no preset speakers)"
    raise RequestError(400, "invalid_voice",
                       f"unknown voice '{name}': use one of {own}, or an OpenAI voice name "
                       f"({', '.join(OPENAI_VOICES)})", param="voice")


TASK_TYPES = {"customvoice": "custom_voice", "voicedesign": "voice_design", "base": "base"}


def check_task_type(task_type: str | None, variant: str | None) -> None:
    """vLLM-Omni's ``task_type`` must name the served variant (each server runs one model)."""
    if task_type is None:
        return
    want = TASK_TYPES.get(task_type.replace("_", "").replace("-", "").strip().lower())
    if want is None:
        raise RequestError(400, "invalid_value",
                           f"unknown task_type '{task_type}': use CustomVoice, VoiceDesign or "
                           "Base", param="task_type")
    if variant is not None and want != variant:
        raise RequestError(400, "task_type_mismatch",
                           f"task_type '{task_type}' needs a {want} checkpoint; this server "
                           f"serves a {variant} model: drop task_type or serve that variant",
                           param="task_type")


# C0 controls except tab, newline and carriage return; DEL; C1 controls; lone surrogates
_FORBIDDEN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def check_characters(text: str, param: str | None) -> None:
    """Refuse text a tokenizer would turn into garbage or choke on: control characters (C0 but
    tab, newline and carriage return; DEL; C1) and lone surrogates (a JSON "\\ud800" escape
    without its pair, which no UTF-8 encoder accepts). The 400 names the character as U+XXXX
    and its position (a 0-based character index), so the client can find it."""
    m = _FORBIDDEN.search(text)
    if m is None:
        return
    cp, where = ord(m.group()), f"'{param}'" if param else "the JSON body"
    if 0xD800 <= cp <= 0xDFFF:
        what, fix = "a lone surrogate", ("send text as UTF-8, or escape a character beyond "
                                         "U+FFFF as a complete surrogate pair")
    else:
        what, fix = "the control character", ("remove it; tab, newline and carriage return "
                                              "are the only control characters allowed")
    raise RequestError(400, "invalid_characters",
                       f"{where} contains {what} U+{cp:04X} at position {m.start()}: {fix}",
                       param=param)


def check_text(text: str, settings: ServerSettings, param: str = "input") -> str:
    if len(text) > settings.max_input_chars:
        raise RequestError(400, "input_too_long",
                           f"'{param}' has {len(text)} characters; the maximum is "
                           f"{settings.max_input_chars}: split the text into several requests",
                           param=param)
    check_characters(text, param)  # before the blank check: "\x1c".."\x1f" count as blank
    if not text.strip():
        raise RequestError(400, "empty_input", f"'{param}' is empty: send the text to speak",
                           param=param)
    return text


_JSON_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii"})


def check_content_type(header: str | None) -> None:
    """415 unless the body is declared JSON: ``application/json`` or a ``+json`` type, with at
    most a UTF-8 charset. Checked before the body is read: a form-encoded body (what ``curl -d``
    sends without ``-H``) would otherwise surface as a confusing "invalid JSON"."""
    fix = "send Content-Type: application/json with a JSON body"
    if not header or not header.strip():
        raise RequestError(415, "unsupported_media_type",
                           f"no Content-Type header: {fix} (curl -d sends form encoding "
                           "unless given -H 'Content-Type: application/json')")
    mime, _, params = header.partition(";")
    mime = mime.strip().lower()
    kind, _, sub = mime.partition("/")
    if kind != "application" or not (sub == "json" or sub.endswith("+json")):
        raise RequestError(415, "unsupported_media_type",
                           f"Content-Type '{mime}' is not JSON: {fix}")
    for p in params.split(";"):
        key, _, value = p.partition("=")
        charset = value.strip().strip('"').lower()
        if key.strip().lower() == "charset" and charset not in _JSON_CHARSETS:
            raise RequestError(415, "unsupported_media_type",
                               f"charset '{charset}' is not UTF-8, and JSON bodies are: "
                               "send Content-Type: application/json (or charset=utf-8)")


def decode_json(data: bytes | str, schema: Any) -> Any:
    """``msgspec.json.decode`` with failures as RequestError naming the field. msgspec refuses a lone
    surrogate escape ("\\ud800") as "Input data was truncated"; such a body is valid JSON to the
    stdlib parser, so on a decode error it is re-read with that to name the character and the
    field as :func:`check_characters` does for any other control character. The same re-read
    names a field sent as NaN or Infinity (Python's json.dumps writes them; JSON has neither);
    a number too large for a float (1e999) is an invalid value of its field too."""
    try:
        return msgspec.json.decode(data, type=schema)
    except msgspec.ValidationError as e:
        err = from_validation(e)
        if str(e).startswith("Number out of range"):
            err.code = "invalid_value"
            if err.param == "speed":
                err.message = f"'speed' must be between 0.25 and 4.0: {e}"
        raise err from None
    except msgspec.DecodeError as e:
        _check_json_strings(data)
        raise from_validation(e) from None


def _check_json_strings(data: bytes | str) -> None:
    """check_characters on every string of ``data`` (param: the top-level field it is under);
    nothing if the stdlib cannot parse it either (then msgspec's message stands)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return

    def walk(value: Any, param: str | None) -> None:
        if isinstance(value, str):
            check_characters(value, param)
        elif isinstance(value, float) and not math.isfinite(value):
            if param == "speed":
                check_speed(value)  # raises, naming the range
            raise RequestError(400, "invalid_value",
                               f"'{param}' is {value}: JSON has no NaN or Infinity, send a "
                               "finite number", param=param)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v, param)
        elif isinstance(value, list):
            for v in value:
                walk(v, param)

    if isinstance(doc, dict):
        for key, value in doc.items():
            walk(value, key)
    else:
        walk(doc, None)


def check_stream_speed(speed: float, stream_codes: bool, param: str = "speed") -> None:
    """A speed this stream can take: the stretcher installed, and PCM decoded here. Codec
    frames are decoded by the client, after the server: the server has no audio to stretch, so
    speed != 1.0 with codec_frames is refused by name (a client stretches what it decodes)."""
    if speed != 1.0 and stream_codes:
        raise RequestError(400, "speed_with_codec_frames",
                           f"'{param}' {speed} applies to the PCM this server decodes; with "
                           "codec_frames the client decodes, so time-stretch there (or ask for pcm)",
                           param=param)
    require_speed(speed, param)


def _positive(value: int | None, name: str, upper: int | None = None) -> None:
    if value is not None and (value < 1 or (upper is not None and value > upper)):
        rng = f"[1, {upper}]" if upper else ">= 1"
        raise RequestError(400, "invalid_value", f"'{name}' must be {rng}, got {value}",
                           param=name)


def resolve_options(opts: SynthesisOptions, backend: Backend, settings: ServerSettings, *,
                    stream_codes: bool = False, voices: Any = None) -> SpeechJob:
    """Check ``opts`` and return a job template (empty text and request id), validated by the
    backend. Raises RequestError naming the field. ``voices`` (``server.voices.VoiceService``)
    resolves uploaded voice names; a ``ref_audio`` is left to ``voices.attach_ref_audio``
    (the job comes back without a clone), which must run before the job is spoken."""
    served = backend.model_name
    if opts.model is not None and opts.model not in (served, *settings.model_aliases):
        raise RequestError(400, "model_not_found",
                           f"unknown model '{opts.model}': this server serves '{served}' "
                           f"(aliases: {', '.join(settings.model_aliases)})", param="model")
    check_stream_speed(check_speed(opts.speed), stream_codes)
    if opts.seed is not None and not 0 <= opts.seed <= MAX_SEED:
        raise RequestError(400, "invalid_value",
                           f"'seed' must be in [0, 2**63 - 1], got {opts.seed}", param="seed")
    _positive(opts.max_new_tokens, "max_new_tokens")
    _positive(opts.initial_codec_chunk_frames, "initial_codec_chunk_frames",
              MAX_INITIAL_CHUNK_FRAMES)
    if opts.greedy is not None and opts.do_sample is not None and opts.greedy == opts.do_sample:
        raise RequestError(400, "invalid_value",
                           "'greedy' and 'do_sample' contradict each other: send one of them",
                           param="do_sample")
    greedy = opts.greedy if opts.greedy is not None else opts.do_sample is False
    # characters first, on the text as sent: strip() would drop an edge "\x85" or "\x1f"
    # silently, and positions would not match the client's string
    check_characters(opts.instructions or "", "instructions")
    instructions = (opts.instructions or "").strip() or None
    if instructions is not None:
        check_text(instructions, settings, "instructions")
    check_task_type(opts.task_type, getattr(backend, "variant", None))
    # an uploaded voice (names never collide with built-in ones) before the OpenAI aliases
    rec = voices.lookup(voice_name(opts.voice)) if voices is not None and opts.voice else None
    voice = None if rec is not None else resolve_voice(
        opts.voice, backend.voices(), voices.uploaded_names if voices is not None else list)
    clone, label = (rec.clone, rec.name) if rec is not None else (None, None)
    if opts.ref_audio is None:
        for name, param in (("ref_text", opts.ref_text), ("x_vector_only", opts.x_vector_only)):
            if param is not None:
                raise RequestError(400, "invalid_value",
                                   f"'{name}' only applies with 'ref_audio' (a one-off clone); "
                                   "an uploaded voice keeps the transcript it was uploaded with",
                                   param=name)
    elif opts.voice is not None:
        raise RequestError(400, "invalid_value",
                           "send either 'voice' or 'ref_audio', not both: 'ref_audio' clones "
                           "the voice of the clip it carries", param="voice")
    job = SpeechJob(text="", request_id="", voice=voice, clone=clone, voice_label=label,
                    language=(opts.language or "auto").strip().lower() or "auto",
                    instructions=instructions, seed=opts.seed, max_frames=opts.max_new_tokens,
                    greedy=greedy, stream_codes=stream_codes,
                    initial_chunk_frames=opts.initial_codec_chunk_frames)
    backend.validate(job)
    return replace(job, validated=True)  # the one validation: backend.stream trusts it


@dataclass(frozen=True)
class SpeechPlan:
    """How to answer one HTTP speech request."""

    job: SpeechJob
    fmt: AudioFormat
    mode: str  # "audio": chunked audio; "sse": SSE events; "file": whole file
    speed: float = 1.0  # OpenAI speed: the server time-stretches the stream (server/speed.py)


def decode_speech_request(body: bytes) -> SpeechRequest:
    return decode_json(body, SpeechRequest)


def plan_speech(req: SpeechRequest, backend: Backend, settings: ServerSettings,
                voices: Any = None) -> SpeechPlan:
    stream_format = req.stream_format or "audio"
    if stream_format not in ("audio", "sse"):
        raise RequestError(400, "invalid_value",
                           f"unknown stream_format '{stream_format}': use 'audio' or 'sse'",
                           param="stream_format")
    sse = stream_format == "sse"
    formats = supported_formats()
    name = (req.response_format or "").strip().lower() or (
        "pcm" if sse else settings.default_response_format or default_format())
    if name not in formats:
        raise RequestError(400, "invalid_response_format",
                           f"unsupported response_format '{name}': use one of "
                           f"{', '.join(formats)}", param="response_format")
    if sse and not req.stream:
        raise RequestError(400, "invalid_value", "stream_format 'sse' needs stream true",
                           param="stream")
    fmt = formats[name]
    mode = "sse" if sse else ("audio" if req.stream and fmt.streamable else "file")
    text = check_text(req.input, settings)
    job = resolve_options(req, backend, settings, voices=voices)
    return SpeechPlan(replace(job, text=text, request_id=new_request_id()), fmt, mode,
                      check_speed(req.speed))

"""``omni-stream-client``: stream speech from an omni-stream (or any OpenAI-compatible) server.

Writes a wav (``--out``) or plays through sounddevice, and prints time to first audio, real-time
factor and the underruns a real-time player would have had.

    omni-stream-client --url http://127.0.0.1:8000 --text "Hello there." --voice ryan --out a.wav

With ``--decoder-backend torch`` or ``executorch`` the server streams codec frames over its
WebSocket (16 codes per 80 ms frame) and Code2Wav runs here:

    omni-stream export-decoder --model CHECKPOINT --format pte --out dec/
    omni-stream-client --text "Hello there." --decoder-backend executorch --pte-manifest dec/manifest.json --out a.wav
    omni-stream-client --text "Hello there." --decoder-backend torch --codec-model CHECKPOINT --out a.wav

``--text-stdin`` reads the text from standard input; with ``--continuous`` it is spoken while it
is written, as one utterance (the WebSocket's continuous text mode), e.g. an LLM's answer:

    llm "Tell me a story" | omni-stream-client --text-stdin --continuous --voice ryan
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from clients.result import SAMPLE_RATE, ClientError, StreamResult

__all__ = ["BACKENDS", "SAMPLE_RATE", "ClientError", "StreamResult", "stream_speech", "main"]

BACKENDS = ("server", "torch", "executorch")


async def stream_speech(url: str, text: str, voice: str | None = None, language: str = "auto",
                        seed: int | None = None, model: str | None = None,
                        api_key: str | None = None, timeout: float = 120.0,
                        extra: dict | None = None, on_chunk=None) -> StreamResult:
    """POST /v1/audio/speech with response_format=pcm and collect the stream with timings."""
    import aiohttp

    body = {"input": text, "response_format": "pcm"}
    if model:
        body["model"] = model
    if voice:
        body["voice"] = voice
    if language:
        body["language"] = language
    if seed is not None:
        body["seed"] = seed
    body.update(extra or {})
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    chunks: list[bytes] = []
    arrivals: list[float] = []
    durations: list[float] = []
    pending = b""
    t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async with s.post(url.rstrip("/") + "/v1/audio/speech", json=body, headers=headers) as r:
                if r.status != 200:
                    try:
                        msg = (await r.json())["error"]["message"]
                    except (ValueError, KeyError, aiohttp.ContentTypeError):
                        msg = (await r.text())[:300]
                    raise ClientError(f"server answered {r.status}: {msg}")
                async for data in r.content.iter_any():
                    now = time.monotonic()
                    data = pending + data
                    cut = len(data) - len(data) % 2
                    data, pending = data[:cut], data[cut:]
                    if not data:
                        continue
                    chunks.append(data)
                    arrivals.append(now)
                    durations.append(len(data) / 2 / SAMPLE_RATE)
                    if on_chunk is not None:
                        on_chunk(np.frombuffer(data, dtype="<i2"))
    except aiohttp.ClientConnectorError as e:
        raise ClientError(f"cannot reach {url}: {e}; is `omni-stream serve` running?") from e
    except aiohttp.ClientPayloadError as e:
        raise ClientError(f"the stream broke off after {sum(map(len, chunks)) // 2} samples: {e}") from e
    if not chunks:
        raise ClientError("the server sent no audio")
    t_end = time.monotonic()
    pcm = np.frombuffer(b"".join(chunks), dtype="<i2")
    return StreamResult(pcm, arrivals[0] - t0, t_end - t0, arrivals, durations,
                        wire_bytes=len(pcm) * 2)


def _player():
    try:
        import sounddevice as sd
    except (ImportError, OSError) as e:
        raise ClientError(f"playback needs sounddevice and PortAudio ({e}): "
                          "`pip install sounddevice` and `apt-get install libportaudio2`, "
                          "or pass --out FILE.wav") from e
    stream = sd.OutputStream(samplerate=SAMPLE_RATE, channels=1, dtype="int16")
    stream.start()
    return stream


_AUDIO_MIME = {".wav": "audio/wav", ".flac": "audio/flac", ".mp3": "audio/mpeg",
               ".ogg": "audio/ogg", ".oga": "audio/ogg", ".opus": "audio/ogg"}


def ref_audio_fields(path: str | None, ref_text: str | None = None,
                     x_vector_only: bool = False) -> dict[str, Any]:
    """The request fields of a one-off clone of the clip at ``path`` (a data URL), or {}."""
    if path is None:
        if ref_text is not None or x_vector_only:
            raise ClientError("--ref-text and --x-vector-only go with --ref-audio FILE")
        return {}
    if not x_vector_only and not (ref_text or "").strip():
        raise ClientError("--ref-audio needs --ref-text (the clip's transcript) for ICL "
                          "cloning, or --x-vector-only")
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ClientError(f"cannot read --ref-audio {path}: {e.strerror or e}") from e
    mime = _AUDIO_MIME.get(Path(path).suffix.lower(), "application/octet-stream")
    out: dict[str, Any] = {"ref_audio": f"data:{mime};base64,{base64.b64encode(data).decode()}"}
    if x_vector_only:
        out["x_vector_only"] = True
    else:
        out["ref_text"] = ref_text
    return out


def _read_stdin() -> str:
    """All of standard input as UTF-8 text (for one request)."""
    try:
        text = sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ClientError(f"standard input is not UTF-8 (byte {e.start}): convert it, e.g. "
                          "`iconv -t UTF-8`") from e
    if not text.strip():
        raise ClientError("--text-stdin: standard input held no text")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni-stream-client", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    text = ap.add_mutually_exclusive_group(required=True)
    text.add_argument("--text")
    text.add_argument("--text-stdin", action="store_true",
                      help="read the text from standard input (all of it, unless --continuous)")
    ap.add_argument("--continuous", action="store_true",
                    help="speak the text as it is written, as one utterance (WebSocket text_mode "
                         "continuous): with --text-stdin, a pipe from an LLM plays while the "
                         "LLM writes")
    ap.add_argument("--voice", default=None)
    ap.add_argument("--language", default="auto")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--out", default=None, help="write a wav instead of playing")
    ap.add_argument("--prebuffer", type=float, default=0.0, help="player start-up buffer (s)")
    ap.add_argument("--decoder-backend", choices=BACKENDS, default="server",
                    help="where Code2Wav runs: on the server (PCM over the wire) or here "
                         "(codec frames over the wire)")
    ap.add_argument("--pte-manifest", default=None,
                    help="executorch backend: manifest.json from `omni-stream export-decoder`")
    ap.add_argument("--codec-model", default=None,
                    help="torch backend: the checkpoint folder the server runs")
    ap.add_argument("--decoder-dtype", choices=("auto", "fp32", "bf16"), default="auto",
                    help="torch backend: auto decodes in the dtype the server announces (bf16 "
                         "with the server's CPU kernels: its samples on the same kind of CPU); "
                         "fp32 is the exact decode")
    ap.add_argument("--decoder-threads", type=int, default=1,
                    help="threads of the local decoder (torch / executorch backends)")
    ap.add_argument("--greedy", action="store_true", help="greedy decoding (no sampling)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="cap on codec frames")
    ap.add_argument("--ref-audio", default=None, metavar="FILE",
                    help="clone the voice of this clip (Base models; wav, flac, mp3 or ogg); "
                    "to reuse a voice, upload it once with `omni-stream voices add`")
    ap.add_argument("--ref-text", default=None,
                    help="the transcript of --ref-audio (ICL cloning, the default mode)")
    ap.add_argument("--x-vector-only", action="store_true",
                    help="clone from the speaker embedding alone (no --ref-text needed)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    try:
        extra = {k: v for k, v in (("greedy", a.greedy or None),
                                   ("max_new_tokens", a.max_new_tokens)) if v is not None}
        extra.update(ref_audio_fields(a.ref_audio, a.ref_text, a.x_vector_only))
        decoder = None
        if a.decoder_backend != "server":
            from clients.decoders import DecoderError, make_decoder

            try:  # before connecting: a missing or corrupt program fails without a request
                decoder = make_decoder(a.decoder_backend, a.pte_manifest, a.codec_model,
                                       a.decoder_threads,
                                       {"fp32": "float32", "bf16": "bfloat16"}.get(a.decoder_dtype, "auto"))
            except DecoderError as e:
                raise ClientError(str(e)) from e
        if a.continuous and decoder is not None:
            raise ClientError("--continuous streams pcm: use --decoder-backend server")
        text = a.text
        if a.text_stdin and not a.continuous:
            text = _read_stdin()
        player = None if a.out else _player()
        cb = (lambda x: player.write(x.reshape(-1, 1))) if player is not None else None
        if a.continuous:
            from clients.continuous import speak_continuous, stdin_pieces

            async def go():
                pieces = stdin_pieces() if a.text_stdin else [text]
                return await speak_continuous(
                    a.url, pieces, voice=a.voice, language=a.language, model=a.model,
                    api_key=a.api_key, seed=a.seed, on_chunk=cb, extra=extra)

            res = asyncio.run(go())
        elif decoder is None:
            res = asyncio.run(stream_speech(a.url, text, a.voice, a.language, a.seed, a.model,
                                            a.api_key, extra=extra, on_chunk=cb))
        else:
            from clients.codec_stream import stream_codes

            res = asyncio.run(stream_codes(a.url, text, decoder, a.voice, a.language, a.seed,
                                           a.model, a.api_key, extra=extra, on_chunk=cb))
        for note in res.notes:
            print(f"omni-stream-client: note: {note}", file=sys.stderr)
        if a.out:
            import soundfile as sf

            sf.write(a.out, res.pcm, SAMPLE_RATE, subtype="PCM_16")
        pb = res.playback(a.prebuffer)
        fig = dict(ttfa_ms=round(res.ttfa_s * 1e3, 1), audio_s=round(res.audio_s, 3),
                   rtf=round(res.rtf, 3), underruns=pb.underruns,
                   underrun_s=round(pb.underrun_s, 3), max_gap_ms=round(pb.max_gap_s * 1e3, 1),
                   chunks=len(res.arrivals), decoder_backend=a.decoder_backend,
                   wire_bytes=res.wire_bytes)
        waited = ""
        if a.continuous:  # TTFA counts from the first text piece sent
            fig.update(text_waited_ms=res.text_waited_ms, text_waits=len(
                [w for w in res.waits if w.get("type") == "text.waiting"]),
                utterances=len(res.utterances))
            waited = f" | waited for text {fig['text_waited_ms']} ms"
        print(json.dumps(fig) if a.json else
              f"TTFA {fig['ttfa_ms']} ms | {fig['audio_s']} s audio | RTF {fig['rtf']} | "
              f"underruns {fig['underruns']} ({fig['underrun_s']} s) | max gap {fig['max_gap_ms']} ms"
              + waited + (f" -> {a.out}" if a.out else ""))
        return 0
    except ClientError as e:
        print(f"omni-stream-client: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Prompt building for the three variants, position for position as the reference lays it out.

Layout (CustomVoice, explicit language, text given all at once):
  [instruction turn, text track only]                       (VoiceDesign / 1.7B CustomVoice)
  text:  <|im_start|> assistant \\n | tts_pad ... tts_pad tts_bos | t1 ... tn tts_eos | tts_pad
  codec:          (none)            | think think_bos lang think_eos spk pad | pad ... pad | bos
Every position is the sum of its text-track and codec-track embeddings. In text-streaming mode
only t1 (+ codec bos) is in the prompt; t2..tn, tts_eos are added to the first decode steps.

Cloned voices (Base, ``omni_stream.models.voice_clone.VoiceClone``): the x-vector takes the speaker
slot of the codec prefix. In ICL mode the reference follows the head instead of the first text
token: text track ``r1 .. rm t1 .. tn tts_eos`` (the reference transcript, then the text),
codec track ``bos f1 .. fk`` (fi = the sum of the 16 codebook embeddings of reference frame i).
Text-streaming mode adds the two tracks position by position (the longer text runs on into the
decode steps, a shorter one is padded with tts_pad); otherwise the text track goes first over
codec pad, then the codec track over tts_pad.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from omni_stream.config import ModelConfig
from omni_stream.models.talker import Talker
from omni_stream.models.text_tokenizer import TextTokenizer
from omni_stream.models.voice_clone import VoiceClone


class PromptError(ValueError):
    """Bad request content (unknown voice or language, empty text); the message names the fix."""


@dataclass(frozen=True)
class PromptRequest:
    text: str
    language: str = "auto"
    speaker: str | None = None
    instructions: str | None = None
    speaker_embedding: torch.Tensor | None = None  # Base: x-vector [C]
    stream_text: bool = False  # feed text tokens one per decode step
    clone: VoiceClone | None = None  # Base: a cloned voice (x-vector, and ICL reference)
    # the text as token ids, already tokenized (continuous text: the part that has arrived);
    # ``text`` is then not tokenized
    text_ids: tuple[int, ...] | None = None
    # continuous text still arriving: the trailing rows stop at the last id given (no tts_eos;
    # the stream appends the rest and tts_eos when the text closes). Needs stream_text.
    text_open: bool = False
    # the rest of the prompt's token ids where the caller tokenized them (``tokenize_prompt``:
    # the server does it once per request and the talker stage builds from the ids): the role
    # ``<|im_start|> assistant \n`` as the text's template tokenized it (a text that starts
    # with a line break merges with the role's), the instruction turn, the ICL transcript
    role_ids: tuple[int, ...] | None = None
    instruct_ids: tuple[int, ...] | None = None
    ref_ids: tuple[int, ...] | None = None

    @property
    def x_vector(self) -> torch.Tensor | None:
        if self.clone is not None:
            return torch.tensor(self.clone.x_vector)  # a copy: wire arrays are read-only
        return self.speaker_embedding


@dataclass
class Prompt:
    embeds: torch.Tensor  # [T, C] prefill
    trailing: torch.Tensor  # [N, C] text-track rows for the first decode steps
    text_ids: list[int]
    instruct_ids: list[int] | None

    @property
    def length(self) -> int:
        return int(self.embeds.shape[0])


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def ref_text(text: str) -> str:
    """The ICL reference transcript as the official code tokenizes it (its ids [3:-2] are used)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def ref_ids(tok: TextTokenizer, text: str) -> list[int]:
    """The text-track ids of an ICL reference transcript (without the role and <|im_end|>)."""
    return tok.encode(ref_text(text))[3:-2]


def speech_ids(tok: TextTokenizer, text: str) -> list[int]:
    """The text-track ids of the text to speak (without the role, <|im_end|> and the next turn),
    as :meth:`PromptBuilder.build` lays them out."""
    return tok.encode(assistant_text(text))[3:-5]


def uses_instructions(cfg: ModelConfig, req: PromptRequest) -> bool:
    """The prompt has an instruction turn (a model that takes instructions was given some)."""
    return bool(req.instructions and req.instructions.strip() and cfg.supports_instructions)


def tokenize_prompt(cfg: ModelConfig, tok: TextTokenizer, req: PromptRequest) -> PromptRequest:
    """``req`` with every token id its prompt needs (``text_ids``, ``role_ids``, and
    ``instruct_ids`` / ``ref_ids`` where the prompt has them); ids the caller already gave are
    kept, so nothing is tokenized twice. The one place a request's text is tokenized."""
    text_ids, role = req.text_ids, req.role_ids
    if text_ids is None:
        ids = tok.encode(assistant_text(req.text))
        text_ids, role = tuple(ids[3:-5]), (tuple(ids[:3]) if role is None else role)
    elif role is None:  # ids made elsewhere (continuous text): the role of the bare template
        role = tuple(tok.encode(assistant_text(""))[:3])
    instruct = req.instruct_ids
    if instruct is None and uses_instructions(cfg, req):
        instruct = tuple(tok.encode(instruct_text(req.instructions)))
    ref = req.ref_ids
    if ref is None and req.clone is not None and req.clone.icl:
        ref = tuple(ref_ids(tok, req.clone.ref_text))
    return replace(req, text_ids=tuple(text_ids), role_ids=role, instruct_ids=instruct,
                   ref_ids=ref)


def language_id(cfg: ModelConfig, req: PromptRequest) -> int | None:
    """The codec prefix's language token (None: auto, no language slot). A speaker with a
    dialect speaks it when the language is Chinese or auto. PromptError on an unknown one."""
    lang = (req.language or "auto").lower()
    lang_id = None
    if lang != "auto":
        if lang not in cfg.talker.languages or "dialect" in lang:
            supported = ["auto"] + sorted(k for k in cfg.talker.languages if "dialect" not in k)
            raise PromptError(f"unknown language '{req.language}': supported are "
                              f"{', '.join(supported)}")
        lang_id = cfg.talker.languages[lang]
    if req.speaker and lang in ("chinese", "auto"):
        dialect = cfg.talker.speaker_dialect.get(req.speaker.lower())
        if dialect:
            lang_id = cfg.talker.languages[dialect]
    return lang_id


def prompt_length(cfg: ModelConfig, tok: TextTokenizer, req: PromptRequest,
                  text_tokens: int | None = None) -> int:
    """Positions :meth:`PromptBuilder.build` gives ``req``'s prompt (``Prompt.length``), counted
    from the layout above without building embeddings: what a stream's KV and frame room are
    priced by before it is sent to the talker. ``text_tokens``: the count of the text's ids
    where the caller has it (it is then not tokenized again). Ids ``req`` carries
    (``tokenize_prompt``) are counted, not made again."""
    def text() -> int:
        if text_tokens is not None:
            return text_tokens
        return len(req.text_ids) if req.text_ids is not None else len(speech_ids(tok, req.text))

    speaker = req.speaker is not None or req.x_vector is not None
    codec = (3 if language_id(cfg, req) is None else 4) + speaker + 2  # prefix, speaker, pad bos
    n = 3 + codec - 1  # role, then the head (the codec track but its bos)
    if uses_instructions(cfg, req):
        n += len(req.instruct_ids if req.instruct_ids is not None
                 else tok.encode(instruct_text(req.instructions)))
    c = req.clone
    if c is not None and c.icl:
        frames = 1 + len(c.ref_codes)  # codec bos + the reference frames
        if req.stream_text:  # the text track runs alongside (its rest trails into the decode)
            return n + frames
        eos = 0 if req.text_open else 1
        ref = req.ref_ids if req.ref_ids is not None else ref_ids(tok, c.ref_text)
        return n + len(ref) + text() + eos + frames
    if req.stream_text:
        return n + 1  # the first text token over codec bos
    return n + text() + 2  # the text, tts_eos, then tts_pad over codec bos


class PromptBuilder:
    def __init__(self, cfg: ModelConfig, talker: Talker, tokenizer: TextTokenizer) -> None:
        self.cfg = cfg
        self.talker = talker
        self.tok = tokenizer
        self.speakers = sorted(cfg.talker.speakers)

    def validate(self, req: PromptRequest) -> None:
        vocab = self.cfg.talker.text_vocab_size
        if req.text_ids is not None and not req.text_ids:
            raise PromptError("no text tokens: send at least one word")
        for name, ids in (("text", req.text_ids), ("role", req.role_ids),
                          ("instruction", req.instruct_ids), ("reference text", req.ref_ids)):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise PromptError(f"{name} token ids must lie in [0, {vocab})")
        if req.role_ids is not None and len(req.role_ids) != 3:
            raise PromptError(f"the role takes 3 token ids, got {len(req.role_ids)}")
        if req.text_ids is None and (not req.text or not req.text.strip()):
            raise PromptError("input text is empty: send at least one word")
        language_id(self.cfg, req)
        v = self.cfg.variant
        if req.speaker is not None and req.speaker.lower() not in self.cfg.talker.speakers:
            if not self.speakers:
                raise PromptError(
                    f"a {v} model has no named voices (got voice '{req.speaker}'): "
                    + ("describe the voice in 'instructions'" if v == "voice_design"
                       else "clone a voice from a reference speaker embedding"))
            raise PromptError(f"unknown voice '{req.speaker}': this model's voices are "
                              f"{', '.join(self.speakers)}")
        if req.text_open and not req.stream_text:
            raise PromptError("continuous text needs the text-streaming layout (stream_text)")
        xv = req.x_vector
        if xv is not None:
            if v != "base":
                raise PromptError(f"a {v} model cannot clone voices: serve a Base checkpoint "
                                  "(Qwen3-TTS-12Hz-*-Base)")
            if req.speaker is not None:
                raise PromptError("a request names either a built-in voice or a cloned one, "
                                  "not both")
            if xv.numel() != self.cfg.talker.lm.hidden_size:
                raise PromptError(f"speaker embedding has {xv.numel()} values, "
                                  f"the model expects {self.cfg.talker.lm.hidden_size}")
            if not bool(torch.isfinite(xv).all()):
                raise PromptError("the speaker embedding holds NaN or inf values")
        c = req.clone
        if c is not None and c.icl:
            g, size = self.cfg.talker.num_code_groups, self.cfg.code2wav.codebook_size
            codes = c.ref_codes
            if codes.shape[1] != g:
                raise PromptError(f"reference codes have {codes.shape[1]} codebooks, the model "
                                  f"uses {g}")
            if int(codes.min()) < 0 or int(codes.max()) >= size:
                raise PromptError(f"reference codes must lie in [0, {size})")

    @torch.no_grad()
    def text_rows(self, ids: list[int], eos: bool = False) -> torch.Tensor:
        """Text-track rows [n (+1), C] of more continuous text (and tts_eos when it closes)."""
        vocab = self.cfg.talker.text_vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise PromptError(f"text token ids must lie in [0, {vocab})")
        ids = list(ids) + ([self.cfg.talker.special.tts_eos] if eos else [])
        dev = self.talker.model.codec_embedding.weight.device
        return self.talker.text_embed(torch.tensor(ids, dtype=torch.long, device=dev))

    @torch.no_grad()
    def build(self, req: PromptRequest) -> Prompt:
        self.validate(req)
        t = self.talker
        sp = self.cfg.talker.special
        dev = t.model.codec_embedding.weight.device
        lang_id = language_id(self.cfg, req)
        speaker = req.speaker.lower() if req.speaker else None

        req = tokenize_prompt(self.cfg, self.tok, req)  # ids the request does not carry yet
        text_ids = list(req.text_ids)
        if not text_ids:
            raise PromptError("input text tokenizes to nothing: send at least one word")

        def temb(tok_ids: list[int]) -> torch.Tensor:
            return t.text_embed(torch.tensor(tok_ids, dtype=torch.long, device=dev))

        def cemb(tok_ids: list[int]) -> torch.Tensor:
            return t.codec_embed(torch.tensor(tok_ids, dtype=torch.long, device=dev))

        tts_bos, tts_eos, tts_pad = temb([sp.tts_bos, sp.tts_eos, sp.tts_pad]).split(1)
        if lang_id is None:
            prefix = [sp.codec_nothink, sp.codec_think_bos, sp.codec_think_eos]
        else:
            prefix = [sp.codec_think, sp.codec_think_bos, lang_id, sp.codec_think_eos]
        codec_parts = [cemb(prefix)]
        if speaker is not None:
            codec_parts.append(cemb([self.cfg.talker.speakers[speaker]]))
        elif req.x_vector is not None:
            codec_parts.append(req.x_vector.to(dev, t.model.codec_embedding.weight.dtype).view(1, -1))
        codec_parts.append(cemb([sp.codec_pad, sp.codec_bos]))
        codec = torch.cat(codec_parts)  # [n, C]
        n = codec.shape[0]
        role = temb(list(req.role_ids))
        head = torch.cat((tts_pad.expand(n - 2, -1), tts_bos)) + codec[:-1]
        parts = []
        instruct_ids = None
        if uses_instructions(self.cfg, req):
            instruct_ids = list(req.instruct_ids)
            parts.append(temb(instruct_ids))
        parts += [role, head]
        if req.clone is not None and req.clone.icl:
            icl, trailing = self._icl(req, text_ids, temb, cemb, tts_eos, tts_pad)
            parts.append(icl)
        elif req.stream_text:
            parts.append(temb(text_ids[:1]) + codec[-1:])
            end = tts_eos[:0] if req.text_open else tts_eos
            trailing = torch.cat((temb(text_ids[1:]), end))
        else:
            body = torch.cat((temb(text_ids), tts_eos)) + cemb([sp.codec_pad]).expand(len(text_ids) + 1, -1)
            parts += [body, tts_pad + cemb([sp.codec_bos])]
            trailing = tts_pad[:0]
        return Prompt(embeds=torch.cat(parts), trailing=trailing, text_ids=text_ids,
                      instruct_ids=instruct_ids)

    def _icl(self, req: PromptRequest, text_ids: list[int], temb, cemb, tts_eos: torch.Tensor,
             tts_pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ICL block after the head and the trailing text rows (see the module doc)."""
        clone = req.clone
        assert clone is not None and clone.ref_codes is not None and clone.ref_text
        sp = self.cfg.talker.special
        end = tts_eos[:0] if req.text_open else tts_eos
        text = torch.cat((temb(list(req.ref_ids) + text_ids), end))  # [Lt, C]
        dev = text.device
        codes = torch.tensor(clone.ref_codes, dtype=torch.long, device=dev)  # [F, G] (a copy)
        t = self.talker
        tables = [t.model.codec_embedding, *t.code_predictor.model.codec_embedding]
        frames = torch.stack([tab(codes[:, i]) for i, tab in enumerate(tables)], dim=1).sum(1)
        codec = torch.cat((cemb([sp.codec_bos]), frames))  # [Lc, C]
        nt, nc = text.shape[0], codec.shape[0]
        if not req.stream_text:
            body = text + cemb([sp.codec_pad]).expand(nt, -1)
            return torch.cat((body, codec + tts_pad)), tts_pad[:0]
        if nt > nc:
            return text[:nc] + codec, text[nc:]
        if req.text_open:  # the text must outrun the reference frames before the stream starts
            raise PromptError(f"an ICL voice needs {nc - nt + 1} more text tokens before a "
                              "continuous utterance can start")
        return torch.cat((text, tts_pad.expand(nc - nt, -1))) + codec, tts_pad[:0]

"""Prompt building for the three variants, position for position as the reference lays it out.

Layout (CustomVoice, explicit language, text given all at once):
  [instruction turn, text track only]                       (VoiceDesign / 1.7B CustomVoice)
  text:  <|im_start|> assistant \\n | tts_pad ... tts_pad tts_bos | t1 ... tn tts_eos | tts_pad
  codec:          (none)            | think think_bos lang think_eos spk pad | pad ... pad | bos
Every position is the sum of its text-track and codec-track embeddings. In text-streaming mode
only t1 (+ codec bos) is in the prompt; t2..tn, tts_eos are added to the first decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_stream.config import ModelConfig
from omni_stream.models.talker import Talker
from omni_stream.models.text_tokenizer import TextTokenizer


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


class PromptBuilder:
    def __init__(self, cfg: ModelConfig, talker: Talker, tokenizer: TextTokenizer) -> None:
        self.cfg = cfg
        self.talker = talker
        self.tok = tokenizer
        self.languages = ["auto"] + sorted(k for k in cfg.talker.languages if "dialect" not in k)
        self.speakers = sorted(cfg.talker.speakers)

    def resolve_language(self, language: str | None) -> int | None:
        lang = (language or "auto").lower()
        if lang == "auto":
            return None
        if lang not in self.cfg.talker.languages or "dialect" in lang:
            raise PromptError(f"unknown language '{language}': supported are {', '.join(self.languages)}")
        return self.cfg.talker.languages[lang]

    def validate(self, req: PromptRequest) -> None:
        if not req.text or not req.text.strip():
            raise PromptError("input text is empty: send at least one word")
        self.resolve_language(req.language)
        v = self.cfg.variant
        if req.speaker is not None and req.speaker.lower() not in self.cfg.talker.speakers:
            if not self.speakers:
                raise PromptError(
                    f"a {v} model has no named voices (got voice '{req.speaker}'): "
                    + ("describe the voice in 'instructions'" if v == "voice_design"
                       else "clone a voice from a reference speaker embedding"))
            raise PromptError(f"unknown voice '{req.speaker}': this model's voices are "
                              f"{', '.join(self.speakers)}")
        if req.speaker_embedding is not None:
            if v != "base":
                raise PromptError(f"a {v} model cannot clone voices: use a base checkpoint")
            if req.speaker_embedding.numel() != self.cfg.talker.lm.hidden_size:
                raise PromptError(f"speaker embedding has {req.speaker_embedding.numel()} values, "
                                  f"the model expects {self.cfg.talker.lm.hidden_size}")

    @torch.no_grad()
    def build(self, req: PromptRequest) -> Prompt:
        self.validate(req)
        t = self.talker
        sp = self.cfg.talker.special
        dev = t.model.codec_embedding.weight.device
        lang_id = self.resolve_language(req.language)
        speaker = req.speaker.lower() if req.speaker else None
        if speaker is not None and (req.language or "auto").lower() in ("chinese", "auto"):
            dialect = self.cfg.talker.speaker_dialect.get(speaker)
            if dialect:
                lang_id = self.cfg.talker.languages[dialect]

        ids = self.tok.encode(assistant_text(req.text))
        text_ids = ids[3:-5]
        if not text_ids:
            raise PromptError("input text tokenizes to nothing: send at least one word")

        def temb(tok_ids: list[int]) -> torch.Tensor:
            return t.text_embed(torch.tensor(tok_ids, device=dev))

        def cemb(tok_ids: list[int]) -> torch.Tensor:
            return t.codec_embed(torch.tensor(tok_ids, device=dev))

        tts_bos, tts_eos, tts_pad = temb([sp.tts_bos, sp.tts_eos, sp.tts_pad]).split(1)
        if lang_id is None:
            prefix = [sp.codec_nothink, sp.codec_think_bos, sp.codec_think_eos]
        else:
            prefix = [sp.codec_think, sp.codec_think_bos, lang_id, sp.codec_think_eos]
        codec_parts = [cemb(prefix)]
        if speaker is not None:
            codec_parts.append(cemb([self.cfg.talker.speakers[speaker]]))
        elif req.speaker_embedding is not None:
            codec_parts.append(req.speaker_embedding.to(dev, t.model.codec_embedding.weight.dtype).view(1, -1))
        codec_parts.append(cemb([sp.codec_pad, sp.codec_bos]))
        codec = torch.cat(codec_parts)  # [n, C]
        n = codec.shape[0]
        role = temb(ids[:3])
        head = torch.cat((tts_pad.expand(n - 2, -1), tts_bos)) + codec[:-1]
        parts = []
        instruct_ids = None
        if req.instructions and req.instructions.strip() and self.cfg.supports_instructions:
            instruct_ids = self.tok.encode(instruct_text(req.instructions))
            parts.append(temb(instruct_ids))
        parts += [role, head]
        if req.stream_text:
            parts.append(temb(text_ids[:1]) + codec[-1:])
            trailing = torch.cat((temb(text_ids[1:]), tts_eos)) if len(text_ids) > 1 else tts_eos
        else:
            body = torch.cat((temb(text_ids), tts_eos)) + cemb([sp.codec_pad]).expand(len(text_ids) + 1, -1)
            parts += [body, tts_pad + cemb([sp.codec_bos])]
            trailing = tts_pad[:0]
        return Prompt(embeds=torch.cat(parts), trailing=trailing, text_ids=text_ids,
                      instruct_ids=instruct_ids)

"""Frozen configuration dataclasses for the model family.

The field names follow the released Qwen3-TTS ``config.json`` files so a checkpoint folder maps
onto these classes without renaming; ``from_dict`` keeps only what the runtime needs and
validates it. Nothing here is chosen from a folder name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgspec

VARIANTS = ("custom_voice", "voice_design", "base")
FRAME_S = 0.08  # seconds of audio per codec frame: the 12.5 Hz codec of every variant


class ConfigError(ValueError):
    """A checkpoint config that cannot be served; the message names the field."""


def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}: missing field '{key}'")
    return d[key]


def _check_positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{type(obj).__name__}.{n} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class DecoderLMConfig:
    """Geometry of a Qwen3-style decoder stack (talker or code predictor)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        _check_positive(self, "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ConfigError("head_dim must be even for rotary embeddings")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act '{self.hidden_act}' is not supported (only 'silu')")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "DecoderLMConfig":
        hidden = int(_require(d, "hidden_size", where))
        heads = int(_require(d, "num_attention_heads", where))
        rope_theta = d.get("rope_theta")
        if rope_theta is None and isinstance(d.get("rope_scaling"), dict):
            rope_theta = d["rope_scaling"].get("rope_theta")
        if d.get("use_sliding_window"):
            raise ConfigError(f"{where}: sliding-window talker layers are not supported")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(_require(d, "intermediate_size", where)),
            num_hidden_layers=int(_require(d, "num_hidden_layers", where)),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim", hidden // heads)),
            vocab_size=int(_require(d, "vocab_size", where)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            hidden_act=str(d.get("hidden_act", "silu")),
        )


@dataclass(frozen=True)
class SpecialIds:
    """Codec-track and text-track special token ids."""

    codec_pad: int = 2148
    codec_bos: int = 2149
    codec_eos: int = 2150
    codec_think: int = 2154
    codec_nothink: int = 2155
    codec_think_bos: int = 2156
    codec_think_eos: int = 2157
    im_start: int = 151644
    im_end: int = 151645
    tts_pad: int = 151671
    tts_bos: int = 151672
    tts_eos: int = 151673


@dataclass(frozen=True)
class TalkerConfig:
    """Talker LM plus its code predictor, text path and codec vocabulary."""

    lm: DecoderLMConfig
    code_predictor: DecoderLMConfig
    num_code_groups: int
    text_vocab_size: int
    text_hidden_size: int
    special: SpecialIds
    languages: Mapping[str, int]
    speakers: Mapping[str, int]
    speaker_dialect: Mapping[str, str | None]
    rope_mrope_section: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_positive(self, "num_code_groups", "text_vocab_size", "text_hidden_size")
        if self.code_predictor.vocab_size > self.lm.vocab_size:
            raise ConfigError("code predictor vocab cannot exceed the talker codec vocab")
        for name, sid in self.speakers.items():
            if not 0 <= sid < self.lm.vocab_size:
                raise ConfigError(f"speaker '{name}' id {sid} outside codec vocab {self.lm.vocab_size}")
        for name, lid in self.languages.items():
            if not 0 <= lid < self.lm.vocab_size:
                raise ConfigError(f"language '{name}' id {lid} outside codec vocab {self.lm.vocab_size}")
        for name, dialect in self.speaker_dialect.items():
            if dialect and dialect not in self.languages:
                raise ConfigError(f"speaker '{name}' dialect '{dialect}' is not a known language")
        sp = self.special
        for f in dataclasses.fields(sp):
            v = getattr(sp, f.name)
            limit = self.lm.vocab_size if f.name.startswith("codec") else self.text_vocab_size
            if not 0 <= v < limit:
                raise ConfigError(f"special id {f.name}={v} outside its vocab ({limit})")

    @property
    def suppressed_ids(self) -> tuple[int, ...]:
        """Codec ids the talker may never sample: the top 1024 control ids except eos."""
        v = self.lm.vocab_size
        return tuple(i for i in range(v - 1024, v) if i != self.special.codec_eos)


@dataclass(frozen=True)
class Code2WavConfig:
    """The 12 Hz speech-tokenizer decoder (``speech_tokenizer/config.json`` decoder_config)."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    num_quantizers: int = 16
    latent_dim: int = 1024
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    sliding_window: int = 72
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8000
    decoder_dim: int = 1536
    upsampling_ratios: tuple[int, ...] = (2, 2)
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    sample_rate: int = 24000

    def __post_init__(self) -> None:
        _check_positive(self, "codebook_size", "codebook_dim", "num_quantizers", "latent_dim",
                        "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim",
                        "sliding_window", "decoder_dim")
        if self.codebook_dim % 2:
            raise ConfigError("codebook_dim must be even (split RVQ uses codebook_dim // 2)")
        if self.decoder_dim % (2 ** len(self.upsample_rates)):
            raise ConfigError("decoder_dim must halve cleanly once per upsample rate")

    @property
    def samples_per_frame(self) -> int:
        n = 1
        for r in (*self.upsampling_ratios, *self.upsample_rates):
            n *= r
        return n

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], sample_rate: int = 24000) -> "Code2WavConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in names}
        for k in ("upsampling_ratios", "upsample_rates"):
            if k in kw:
                kw[k] = tuple(int(x) for x in kw[k])
        if "head_dim" not in d and "hidden_size" in d and "num_attention_heads" in d:
            kw["head_dim"] = int(d["hidden_size"]) // int(d["num_attention_heads"])
        kw["sample_rate"] = sample_rate
        return cls(**kw)


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """ECAPA-TDNN x-vector encoder (Base variant only)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SpeakerEncoderConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
        return cls(**kw)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about one checkpoint."""

    variant: str
    model_size: str
    talker: TalkerConfig
    code2wav: Code2WavConfig
    speaker_encoder: SpeakerEncoderConfig | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(
                f"unknown tts_model_type '{self.variant}': expected one of {', '.join(VARIANTS)}")
        if self.talker.num_code_groups != self.code2wav.num_quantizers:
            raise ConfigError(
                f"talker num_code_groups {self.talker.num_code_groups} != codec num_quantizers "
                f"{self.code2wav.num_quantizers}")
        if self.variant == "base" and self.speaker_encoder is None:
            raise ConfigError("a 'base' checkpoint needs speaker_encoder_config")

    @property
    def frame_rate_hz(self) -> float:
        return self.code2wav.sample_rate / self.code2wav.samples_per_frame

    @property
    def supports_instructions(self) -> bool:
        """The 0.6B CustomVoice model ignores instructions; VoiceDesign requires them."""
        if self.variant == "voice_design":
            return True
        return self.variant == "custom_voice" and self.model_size not in ("0b6",)

    @classmethod
    def from_dicts(cls, main: Mapping[str, Any], codec: Mapping[str, Any]) -> "ModelConfig":
        variant = main.get("tts_model_type")
        if variant not in VARIANTS:
            raise ConfigError(
                f"config.json: unknown tts_model_type {variant!r}: expected one of {', '.join(VARIANTS)}")
        t = _require(main, "talker_config", "config.json")
        cp = _require(t, "code_predictor_config", "config.json talker_config")
        lm = DecoderLMConfig.from_dict(t, "talker_config")
        cpl = DecoderLMConfig.from_dict(cp, "code_predictor_config")
        special = SpecialIds(
            codec_pad=int(t.get("codec_pad_id", 2148)),
            codec_bos=int(t.get("codec_bos_id", 2149)),
            codec_eos=int(t.get("codec_eos_token_id", 2150)),
            codec_think=int(t.get("codec_think_id", 2154)),
            codec_nothink=int(t.get("codec_nothink_id", 2155)),
            codec_think_bos=int(t.get("codec_think_bos_id", 2156)),
            codec_think_eos=int(t.get("codec_think_eos_id", 2157)),
            im_start=int(main.get("im_start_token_id", 151644)),
            im_end=int(main.get("im_end_token_id", 151645)),
            tts_pad=int(main.get("tts_pad_token_id", 151671)),
            tts_bos=int(main.get("tts_bos_token_id", 151672)),
            tts_eos=int(main.get("tts_eos_token_id", 151673)),
        )
        rs = t.get("rope_scaling") or {}
        dialects = {str(k).lower(): (v if v else None) for k, v in (t.get("spk_is_dialect") or {}).items()}
        talker = TalkerConfig(
            lm=lm,
            code_predictor=cpl,
            num_code_groups=int(_require(t, "num_code_groups", "talker_config")),
            text_vocab_size=int(_require(t, "text_vocab_size", "talker_config")),
            text_hidden_size=int(_require(t, "text_hidden_size", "talker_config")),
            special=special,
            languages={str(k).lower(): int(v) for k, v in (t.get("codec_language_id") or {}).items()},
            speakers={str(k).lower(): int(v) for k, v in (t.get("spk_id") or {}).items()},
            speaker_dialect=dialects,
            rope_mrope_section=tuple(rs["mrope_section"]) if "mrope_section" in rs else None,
        )
        dec = _require(codec, "decoder_config", "speech_tokenizer/config.json")
        c2w = Code2WavConfig.from_dict(dec, sample_rate=int(codec.get("output_sample_rate", 24000)))
        if int(codec.get("decode_upsample_rate", c2w.samples_per_frame)) != c2w.samples_per_frame:
            raise ConfigError("speech_tokenizer decode_upsample_rate disagrees with the decoder's upsampling")
        spk = main.get("speaker_encoder_config") if variant == "base" else None
        return cls(
            variant=variant,
            model_size=str(main.get("tts_model_size", "")),
            talker=talker,
            code2wav=c2w,
            speaker_encoder=SpeakerEncoderConfig.from_dict(spk) if spk else None,
            raw=dict(main),
        )


# Talker/code-predictor weight storage (engine.quant for the torch engine, engine/cpu for the
# native one), most faithful first. The low-bit ones compute in bf16 on CPU; int6, int5 and
# mixed (a kind per tensor class: engine.loading.NATIVE_PLANS) exist on the native runtime only.
WEIGHT_PATHS = ("bf16", "fp32", "int8", "mixed", "int6", "int5", "int4")
NATIVE_ONLY_WEIGHT_PATHS = ("mixed", "int6", "int5")
# what runs the decode step: torch ops, or the CPU runtime (omni_stream/engine/cpu)
ENGINES = ("torch", "native", "vllm")


def check_engine(engine: str, device: str, compile: bool = False) -> None:
    """Refuse combinations that cannot run, naming the fix."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "native" and not str(device).startswith("cpu"):
        raise ValueError(f"engine 'native' is the CPU runtime; on {device} use engine 'torch'")
    if engine == "native" and compile:
        raise ValueError("compile (torch.compile) applies to engine 'torch'; the native engine "
                         "is compiled C++ already: drop --compile or use --engine torch")
    if engine == "vllm" and compile:
        raise ValueError("compile (torch.compile) applies to engine 'torch'; the vllm engine "
                         "runs vLLM's own kernels: drop --compile or use --engine torch")
LOW_BIT_WEIGHT_PATHS = ("int8", "mixed", "int6", "int5", "int4")


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request sampling settings (defaults are the official ones). A frozen msgspec struct,
    torch-free, so the engine and the control messages between processes (``AddStream``) use
    this one type: decoding a message runs the same ``__post_init__`` checks."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    min_new_tokens: int = 2
    sub_do_sample: bool = True
    sub_temperature: float = 0.9
    sub_top_k: int = 50
    sub_top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "sub_temperature"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        for name in ("top_p", "sub_top_p"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        for name in ("top_k", "sub_top_k", "min_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got "
                             f"{self.repetition_penalty}")

    @classmethod
    def greedy(cls) -> "SamplingParams":
        return cls(do_sample=False, sub_do_sample=False)

"""Checkpoint I/O in the released Qwen3-TTS-12Hz folder layout.

    DIR/config.json                  main config (talker, code predictor, special ids, variant)
    DIR/generation_config.json       sampling defaults
    DIR/model.safetensors            talker.* (+ speaker_encoder.* for Base), or shards + index
    DIR/vocab.json, merges.txt, tokenizer_config.json     Qwen2 BPE text tokenizer
    DIR/preprocessor_config.json     processor stub the reference loader expects
    DIR/speech_tokenizer/config.json, model.safetensors   codec: decoder.* (Code2Wav) and, for
                                     Base, encoder.* (reference audio -> ICL codes)
    DIR/omni_stream_outliers.json    only in ``--outliers`` random checkpoints: what was planted
                                     (config.json stays the released one; loaders never read it)

Loading is strict: the key map is the module tree (whose names are the released keys); any
missing, unexpected or mis-shaped tensor fails with its name. Weights are built on the meta
device and assigned from the memory-mapped file, so nothing is initialised twice.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from omni_stream.config import ConfigError, ModelConfig
from omni_stream.checkpoints import presets
from omni_stream.models.code2wav import Code2Wav, random_code2wav_state_dict
from omni_stream.models.talker import Qwen3TTSWeights
from omni_stream.models.text_tokenizer import TextTokenizer, write_random_tokenizer

if TYPE_CHECKING:
    from omni_stream.models.speaker_encoder import SpeakerEncoder
    from omni_stream.models.speech_encoder import SpeechEncoder

log = logging.getLogger(__name__)

CODEC_UNUSED_PREFIXES = ("encoder.",)  # the codec's audio encoder: load_speech_encoder, not Code2Wav


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file or tensor."""


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Qwen3TTSWeights
    code2wav: Code2Wav
    tokenizer: TextTokenizer
    path: Path
    generation_defaults: Mapping[str, object]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"missing file {path}: not a Qwen3-TTS checkpoint folder")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist")
    main = _read_json(path / "config.json")
    codec = _read_json(path / "speech_tokenizer" / "config.json")
    try:
        return ModelConfig.from_dicts(main, codec)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from e


def _weight_files(folder: Path, stem: str = "model") -> list[Path]:
    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return [single]
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        files = [folder / s for s in shards]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"missing weight shard {f} listed in {index.name}")
        return files
    raise CheckpointError(f"missing weights in {folder}: expected {stem}.safetensors "
                          f"or {stem}.safetensors.index.json")


def _read_tensors(files: Iterable[Path], keep: callable) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if keep(k):
                    out[k] = h.get_tensor(k)
    return out


def assign_strict(module: nn.Module, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                  where: str) -> None:
    """Assign tensors to a meta-built module; fail naming any missing/unexpected/mis-shaped key."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
        raise CheckpointError(f"{where}: " + "; ".join(parts))
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != shape:
            raise CheckpointError(f"{where}: tensor '{k}' has shape {tuple(tensors[k].shape)}, "
                                  f"the config implies {shape}")
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    module.load_state_dict(state, strict=True, assign=True)


def build_main_module(cfg: ModelConfig) -> Qwen3TTSWeights:
    spk = None
    if cfg.speaker_encoder is not None:
        from omni_stream.models.speaker_encoder import SpeakerEncoder
        spk = SpeakerEncoder(cfg.speaker_encoder)
    return Qwen3TTSWeights(cfg.talker, spk)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LoadedModel:
    """Load a checkpoint folder (released layout) strictly, every weight in ``dtype``. (The
    engine's low-bit weight paths are applied on top by ``engine.loading.load_on_weight_path``.)"""
    path = Path(path)
    cfg = read_config(path)
    tokenizer = TextTokenizer.from_dir(path)
    gen = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").is_file() else {}
    with torch.device("meta"):
        weights = build_main_module(cfg)
    main = _read_tensors(_weight_files(path), lambda k: True)
    assign_strict(weights, main, dtype, f"{path}/model.safetensors")
    weights.eval().to(device)
    c2w = load_codec(path, dtype, device, cfg)
    return LoadedModel(cfg, weights, c2w, tokenizer, path, gen)


def load_codec(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", cfg: ModelConfig | None = None) -> Code2Wav:
    """Load only the codec decoder (``speech_tokenizer/``), strictly."""
    path = Path(path)
    cfg = cfg or read_config(path)
    with torch.device("meta"):
        c2w = Code2Wav(cfg.code2wav)
    codec_dir = path / "speech_tokenizer"
    codec = _read_tensors(_weight_files(codec_dir), lambda k: not k.startswith(CODEC_UNUSED_PREFIXES))
    if any(not k.startswith("decoder.") for k in codec):
        bad = sorted(k for k in codec if not k.startswith("decoder."))
        raise CheckpointError(f"{codec_dir}/model.safetensors: unexpected tensors: {', '.join(bad[:8])}")
    assign_strict(c2w, {k[len("decoder."):]: v for k, v in codec.items()}, dtype,
                  f"{codec_dir}/model.safetensors")
    return c2w.eval().to(device)


def _require_base(path: Path, cfg: ModelConfig, what: str) -> None:
    if cfg.variant != "base":
        raise CheckpointError(f"{path} is a '{cfg.variant}' checkpoint: {what} needs a Base "
                              f"checkpoint (Qwen3-TTS-12Hz-*-Base, tts_model_type 'base')")


def load_speech_encoder(path: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "SpeechEncoder":
    """Load the speech tokenizer's encoder (``speech_tokenizer/`` ``encoder.*``) of a Base
    checkpoint, strictly; it turns reference audio into ICL voice-clone codes."""
    from omni_stream.models.speech_encoder import SpeechEncoder, SpeechEncoderConfig

    path = Path(path)
    cfg = read_config(path)
    _require_base(path, cfg, "reference-audio encoding (voice cloning)")
    codec_dir = path / "speech_tokenizer"
    try:
        enc_cfg = SpeechEncoderConfig.from_codec_dict(_read_json(codec_dir / "config.json"))
    except ConfigError as e:
        raise CheckpointError(f"{codec_dir}: {e}") from e
    tensors = _read_tensors(_weight_files(codec_dir), lambda k: k.startswith("encoder."))
    if not tensors:
        raise CheckpointError(
            f"{codec_dir}/model.safetensors has no encoder.* tensors: voice cloning needs the "
            f"speech tokenizer's encoder; use the complete released speech_tokenizer folder of a "
            f"Base model (or write_random_checkpoint(..., variant='base'))")
    return _load_part(lambda: SpeechEncoder(enc_cfg), tensors, "encoder.", dtype, device,
                      f"{codec_dir}/model.safetensors")


def _load_part(build, tensors: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
               device: torch.device | str, where: str) -> nn.Module:
    """Build a part on the meta device and strictly assign its ``prefix``-ed tensors (floats in
    ``dtype``); a missing, unexpected or mis-shaped tensor is a CheckpointError naming ``where``."""
    with torch.device("meta"):
        part = build()
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    try:
        part.load_weights(tensors, prefix=prefix, assign=True)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e
    return part.eval().to(device)


def load_speaker_encoder(path: str | Path, dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu") -> "SpeakerEncoder":
    """Load only the ``speaker_encoder.*`` tensors of a Base checkpoint, strictly."""
    from omni_stream.models.speaker_encoder import SpeakerEncoder

    path = Path(path)
    cfg = read_config(path)
    _require_base(path, cfg, "the x-vector speaker encoder")
    assert cfg.speaker_encoder is not None  # ModelConfig guarantees it for 'base'
    tensors = _read_tensors(_weight_files(path), lambda k: k.startswith("speaker_encoder."))
    return _load_part(lambda: SpeakerEncoder(cfg.speaker_encoder), tensors, "speaker_encoder.",
                      dtype, device, f"{path}/model.safetensors")


# ---------------------------------------------------------------------------- random writer
OUTLIERS_FILE = "omni_stream_outliers.json"
STUDENT_T_DF = 4
OUTLIER_ALPHA = (30.0, 100.0)
OUTLIER_GAINS = ("input_layernorm", "post_attention_layernorm")
# the linears reading those norms: q/k/v read input_layernorm, gate/up post_attention_layernorm
OUTLIER_READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                   "mlp.gate_proj", "mlp.up_proj")
_DECODER_TENSOR = re.compile(
    r"(?P<layer>talker\.(?:code_predictor\.)?model\.layers\.\d+)\.(?P<part>self_attn\.[qkvo]_proj"
    r"|mlp\.(?:gate|up|down)_proj|input_layernorm|post_attention_layernorm)\.weight")


def _outlier_channels(hidden: int, dtype: torch.dtype,
                      g: torch.Generator) -> list[tuple[int, float]]:
    """One layer's massive-activation channels: about hidden/256 (at least one), each with a
    factor in OUTLIER_ALPHA rounded to the stored dtype, so the stored gain is exactly alpha."""
    idx = torch.randperm(hidden, generator=g)[:max(1, hidden // 256)].sort().values
    lo, hi = OUTLIER_ALPHA
    alpha = (lo + (hi - lo) * torch.rand(len(idx), generator=g)).to(dtype).float()
    return [(int(c), float(a)) for c, a in zip(idx, alpha)]


def _plant_outliers(v: torch.Tensor, part: str, channels: list[tuple[int, float]],
                    g: torch.Generator) -> torch.Tensor:
    """One decoder tensor (fp32) of an outlier checkpoint. Linear weights: the plain normal draw
    times sqrt((df-2)/chi2_df), i.e. Student-t(df) with the plain std. Norm gains times alpha
    and the input columns of the linears reading them over alpha: the same function, with
    activations 30-100x larger in those channels."""
    idx = torch.tensor([c for c, _ in channels])
    alpha = torch.tensor([a for _, a in channels])
    if part in OUTLIER_GAINS:
        v[idx] *= alpha
        return v
    chi2 = sum(torch.empty(v.shape).normal_(generator=g).square() for _ in range(STUDENT_T_DF))
    v = v * ((STUDENT_T_DF - 2) / chi2).sqrt()
    if part in OUTLIER_READERS:
        v[:, idx] /= alpha
    return v


def _random_main_state(module: nn.Module, seed: int, dtype: torch.dtype, outliers: bool = False
                       ) -> tuple[dict[str, torch.Tensor], dict[str, list[tuple[int, float]]]]:
    """The main tensors, and with ``outliers`` the planted channels per decoder layer. Outliers
    draw from their own generator, so every other tensor equals the plain checkpoint's."""
    g = torch.Generator().manual_seed(seed)
    go = torch.Generator().manual_seed(seed + 4)
    out, planted = {}, {}
    for name, t in module.state_dict().items():
        shape = tuple(t.shape)
        if name.endswith("norm.weight"):
            v = torch.ones(shape)
        elif name.endswith(".bias"):
            v = torch.zeros(shape)
        else:
            v = torch.empty(shape).normal_(0.0, 0.02, generator=g)
        m = _DECODER_TENSOR.fullmatch(name) if outliers else None
        if m:
            layer = m["layer"]
            if layer not in planted:
                hidden = module.get_submodule(layer).input_layernorm.weight.shape[0]
                planted[layer] = _outlier_channels(hidden, dtype, go)
            v = _plant_outliers(v, m["part"], planted[layer], go)
        out[name] = v.to(dtype).contiguous()
    return out, planted


def write_random_checkpoint(out: str | Path, preset: str, variant: str, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16, talker_layers: int | None = None,
                            cp_layers: int | None = None, outliers: bool = False) -> Path:
    """Write a random checkpoint of a preset in the released layout; returns the folder.

    ``outliers``: give the talker's and code predictor's decoder layers what trained LLMs have
    and plain random weights lack, so quantizers are tested where it matters: Student-t
    (STUDENT_T_DF) linear weights with the plain std 0.02, and in every layer a few hidden
    channels with massive activations (norm gains x alpha, the reading linears' input columns
    / alpha: a re-parameterization of the same function, exact up to the stored dtype's
    rounding, so bf16 loses a little). What was planted goes to OUTLIERS_FILE, not config.json,
    which stays loadable by the official code."""
    out = Path(out)
    main_cfg = presets.model_config_dict(preset, variant, talker_layers=talker_layers, cp_layers=cp_layers)
    codec_cfg = presets.codec_config_dict(preset)
    cfg = ModelConfig.from_dicts(main_cfg, codec_cfg)
    (out / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        weights = Qwen3TTSWeights(cfg.talker)
    state, planted = _random_main_state(weights, seed, dtype, outliers)
    if cfg.speaker_encoder is not None:
        from omni_stream.models.speaker_encoder import random_state_dict as spk_random
        state.update({f"speaker_encoder.{k}": v.to(dtype).contiguous()
                      for k, v in spk_random(cfg.speaker_encoder, seed + 2).items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    codec_state = {f"decoder.{k}": v.to(dtype).contiguous()
                   for k, v in random_code2wav_state_dict(cfg.code2wav, seed + 1).items()}
    if variant == "base":  # the speech tokenizer's encoder: ICL voice cloning encodes the reference
        from omni_stream.models.speech_encoder import SpeechEncoderConfig
        from omni_stream.models.speech_encoder import random_state_dict as enc_random
        enc_cfg = SpeechEncoderConfig.from_codec_dict(codec_cfg)
        codec_state.update({f"encoder.{k}": v.to(dtype).contiguous()
                            for k, v in enc_random(enc_cfg, seed + 3).items()})
    save_file(codec_state, str(out / "speech_tokenizer" / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(main_cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(presets.GENERATION_CONFIG, indent=2))
    (out / "speech_tokenizer" / "config.json").write_text(json.dumps(codec_cfg, indent=2))
    write_random_tokenizer(out)
    for name, body in presets.auxiliary_files().items():
        (out / name).write_text(json.dumps(body, indent=2))
    if outliers:
        (out / OUTLIERS_FILE).write_text(json.dumps(
            {"outliers": True, "student_t_df": STUDENT_T_DF, "channels": planted}, indent=2))
    else:  # rewriting a folder: a stale record would describe weights that are no longer there
        (out / OUTLIERS_FILE).unlink(missing_ok=True)
    return out

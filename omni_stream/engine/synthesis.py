"""Offline synthesis: one request, text -> codec frames -> waveform.

This is the reference path of omni-stream itself: the streaming server must produce exactly
these codes and samples for the same seeded request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omni_stream.checkpoints.default import resolve_model_path
from omni_stream.checkpoints.io import LoadedModel
from omni_stream.engine.loading import attach_engine, load_for_engine
from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.models.prompt import PromptBuilder, PromptRequest
from omni_stream.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

@dataclass
class SynthesisResult:
    codes: np.ndarray  # int64 [frames, 16]
    audio: np.ndarray | None  # float32 [frames * 1920]
    prompt_len: int
    stopped_on_eos: bool


class Synthesizer:
    """Single-stream generation over a FrameEngine with one slot."""

    def __init__(self, model: LoadedModel, max_seq_len: int = 4096) -> None:
        self.model = model
        self.builder = PromptBuilder(model.config, model.weights.talker, model.tokenizer)
        self.engine = FrameEngine(model.weights.talker, EngineShape(max_slots=1, max_seq_len=max_seq_len))

    @classmethod
    def from_path(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                  weight_path: str | None = None, engine: str = "torch",
                  threads: int | None = None) -> "Synthesizer":
        """Load a checkpoint (``default``: the embedded model) for ``engine`` ("torch" or the
        "native" CPU runtime) with ``weight_path``."""
        path = resolve_model_path(path)
        synth = cls(load_for_engine(path, dtype, "cpu", weight_path, engine))
        attach_engine(synth.engine, engine, weight_path, threads or torch.get_num_threads(),
                      model_path=path)
        return synth

    @torch.inference_mode()
    def generate_codes(self, req: PromptRequest, params: SamplingParams, seed: int,
                       max_frames: int) -> tuple[np.ndarray, int, bool]:
        prompt = self.builder.build(req)
        if prompt.length + max_frames + 1 > self.engine.shape.max_seq_len:
            raise ValueError(f"prompt ({prompt.length}) + max_frames ({max_frames}) exceeds the "
                             f"engine's max_seq_len {self.engine.shape.max_seq_len}")
        eos = self.model.config.talker.special.codec_eos
        code0 = self.engine.prefill(0, prompt.embeds, prompt.trailing, params, seed)
        frames: list[torch.Tensor] = []
        stopped = code0 == eos
        while not stopped and len(frames) < max_frames:
            codes, nxt = self.engine.step(1)
            frames.append(codes[0].clone())
            stopped = int(nxt[0]) == eos
        arr = torch.stack(frames).cpu().numpy() if frames else np.zeros((0, 16), dtype=np.int64)
        return arr.astype(np.int64), prompt.length, stopped

    @torch.inference_mode()
    def decode_audio(self, codes: np.ndarray, prime: np.ndarray | None = None) -> np.ndarray:
        """Waveform of ``codes`` [F, 16]; ``prime`` (an ICL voice's last reference frames) is
        decoded before them as left context and its audio cut, as the streaming decoder does."""
        if len(codes) == 0:
            return np.zeros(0, dtype=np.float32)
        skip = 0 if prime is None else len(prime)
        if skip:
            codes = np.concatenate([prime, codes])
        c = torch.as_tensor(codes, dtype=torch.long).T.unsqueeze(0)  # [1, 16, F]
        wav = self.model.code2wav(c.to(next(self.model.code2wav.parameters()).device))
        return wav.reshape(-1)[skip * self.model.code2wav.samples_per_frame:].float().cpu().numpy()

    def synthesize(self, req: PromptRequest, params: SamplingParams, seed: int = 0,
                   max_frames: int = 2047, with_audio: bool = True) -> SynthesisResult:
        codes, plen, eos = self.generate_codes(req, params, seed, max_frames)
        prime = req.clone.prime_codes() if req.clone is not None else None
        audio = self.decode_audio(codes, prime) if with_audio else None
        return SynthesisResult(codes, audio, plen, eos)

"""Talker LM and code predictor, with parameter names equal to the released checkpoint keys.

``Qwen3TTSTalkerModel`` holds exactly the ``talker.*`` tensors of a checkpoint. The per-frame
work (code predictor sub-steps, talker step) lives in ``omni_stream.engine.frame``; this file is
only the weights and the small pure functions over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_stream.config import TalkerConfig
from omni_stream.models.layers import DecoderStack


class TextProjection(nn.Module):
    """2-layer MLP with bias: text_hidden -> text_hidden -> talker hidden (SiLU)."""

    def __init__(self, text_hidden: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerLM(DecoderStack):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__(cfg.lm)
        self.codec_embedding = nn.Embedding(cfg.lm.vocab_size, cfg.lm.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class CodePredictorLM(DecoderStack):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__(cfg.code_predictor)
        # one table per residual codebook 1..G-1, in the TALKER's width (summed into its input)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.code_predictor.vocab_size, cfg.lm.hidden_size)
            for _ in range(cfg.num_code_groups - 1))


class CodePredictor(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.model = CodePredictorLM(cfg)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.code_predictor.hidden_size, cfg.code_predictor.vocab_size, bias=False)
            for _ in range(cfg.num_code_groups - 1))
        if cfg.code_predictor.hidden_size != cfg.lm.hidden_size:
            self.small_to_mtp_projection: nn.Module = nn.Linear(
                cfg.lm.hidden_size, cfg.code_predictor.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = TalkerLM(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.lm.hidden_size)
        self.codec_head = nn.Linear(cfg.lm.hidden_size, cfg.lm.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg)

    def text_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Text-track embedding of token ids [..., T] -> [..., T, hidden]."""
        return self.text_projection(self.model.text_embedding(ids))

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the G codebook embeddings of frames codes [..., G] -> [..., hidden]."""
        out = self.model.codec_embedding(codes[..., 0])
        for i, table in enumerate(self.code_predictor.model.codec_embedding):
            out = out + table(codes[..., i + 1])
        return out


class Qwen3TTSWeights(nn.Module):
    """Root holding the checkpoint's main tensors: ``talker.*`` and, for Base, ``speaker_encoder.*``."""

    def __init__(self, talker_cfg: TalkerConfig, speaker_encoder: nn.Module | None = None) -> None:
        super().__init__()
        self.talker = Talker(talker_cfg)
        if speaker_encoder is not None:
            self.speaker_encoder = speaker_encoder

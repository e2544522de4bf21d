"""CPU low-bit weight paths (models.quant): exactness of the packing, fidelity, wiring."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from omni_stream.engine.loading import load_on_weight_path
from omni_stream.evaluation.fidelity import teacher_forced
from omni_stream.evaluation.metrics import snr_db
from omni_stream.models.prompt import PromptRequest
from omni_stream.engine.quant import QuantizedLinear, quantize_codec, quantize_talker
from omni_stream.engine.synthesis import Synthesizer


def _linear(n_out: int, n_in: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.2, 3.0, n_out)[:, None])  # rows of different ranges
    return lin


@pytest.mark.parametrize("n_out,n_in", [(96, 64), (64, 256), (3, 128)])
def test_int8_rows_round_to_within_half_a_step(n_out, n_in):
    lin = _linear(n_out, n_in)
    q = QuantizedLinear(lin, "int8")
    w = lin.weight.detach()
    step = w.abs().amax(1, keepdim=True) / 127
    err = (q.dequantized() - w).abs()
    # half a quantisation step, plus the bf16 rounding of the scale and the product
    assert bool((err <= 0.5 * step + 0.01 * w.abs() + 1e-6).all()), float((err / step).max())
    x = torch.randn(5, 7, n_in)
    y = q(x)
    assert y.shape == (5, 7, n_out) and y.dtype == torch.bfloat16
    ref = x @ q.dequantized().t()
    assert snr_db(ref, y.float()) > 40


@pytest.mark.parametrize("group", [32, 64])
def test_int4_groups_round_to_within_half_a_step_with_bias(group):
    lin = _linear(48, 128, bias=True, seed=1)
    q = QuantizedLinear(lin, "int4", group_size=group)
    assert q.group_size == group
    w = lin.weight.detach().view(48, 128 // group, group)
    step = ((w.amax(-1) - w.amin(-1)) / 15)[..., None]
    err = (q.dequantized().view_as(w) - w).abs()
    assert bool((err <= 0.5 * step + 0.02 * w.abs() + 1e-3).all())
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    ref = x.float() @ q.dequantized().t() + lin.bias.detach()
    assert snr_db(ref, q(x).float()) > 40
    # 4-bit really is coarser than 8-bit on the same weights
    e8 = (QuantizedLinear(lin, "int8").dequantized() - lin.weight.detach()).abs().mean()
    assert float(err.mean()) > 2 * float(e8)


def test_fused_projections_equal_separate_ones(tiny_ckpt):
    """Packing q|k|v (gate|up) into one matrix changes no output row."""
    from omni_stream.engine.quant import _fuse

    lins = [_linear(64, 128, seed=s) for s in range(3)]
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    for mode in ("int8", "int4"):
        fused = QuantizedLinear(_fuse(lins), mode)(x)
        parts = torch.cat([QuantizedLinear(lin, mode)(x) for lin in lins], dim=-1)
        assert torch.equal(fused, parts), mode


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="int8, int4"):
        QuantizedLinear(_linear(8, 64), "int3")
    with pytest.raises(ValueError, match="divisible by 32.*int8"):
        QuantizedLinear(_linear(8, 40), "int4")


def test_load_model_int8_needs_bf16_and_cpu(tiny_ckpt):
    with pytest.raises(ValueError, match="dtype bfloat16"):
        load_on_weight_path(tiny_ckpt, dtype=torch.float32, weight_path="int8")
    with pytest.raises(ValueError, match="unknown weight path"):
        load_on_weight_path(tiny_ckpt, dtype=torch.bfloat16, weight_path="int2")


@pytest.fixture(scope="module")
def tiny_paths(tiny_ckpt):
    ref = Synthesizer(load_on_weight_path(tiny_ckpt, dtype=torch.bfloat16), max_seq_len=256)
    out = {"bf16": ref, "bf16_again": Synthesizer(load_on_weight_path(tiny_ckpt, dtype=torch.bfloat16),
                                                  max_seq_len=256)}
    for wp in ("int8", "int4"):
        out[wp] = Synthesizer(load_on_weight_path(tiny_ckpt, dtype=torch.bfloat16, weight_path=wp),
                              max_seq_len=256)
    return out


def test_quantized_model_swaps_every_decoder_linear_and_keeps_the_codec(tiny_paths):
    m = tiny_paths["int8"].model
    talker = m.weights.talker
    plain = [n for n, mod in talker.named_modules() if isinstance(mod, nn.Linear)
             and not n.startswith("text_projection")]
    assert plain == []
    layers = list(talker.model.layers) + list(talker.code_predictor.model.layers)
    packed = [mod for mod in talker.modules() if isinstance(mod, QuantizedLinear)]
    # q|k|v and gate|up are fused: 4 matrices per layer, plus the codec head and the CP heads
    assert len(packed) == 4 * len(layers) + 1 + len(talker.code_predictor.lm_head)
    for layer in layers:
        a = layer.self_attn
        assert isinstance(a.qkv_proj, QuantizedLinear) and not hasattr(a, "q_proj")
        assert a.qkv_proj.out_features == (a.n_heads + 2 * a.n_kv) * a.head_dim
        assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
    assert not any(isinstance(mod, QuantizedLinear) for mod in m.code2wav.modules())
    assert isinstance(talker.text_projection.linear_fc1, nn.Linear)


def test_fidelity_int8_close_int4_coarser(tiny_paths, tiny_model):
    voice = sorted(tiny_model.config.talker.speakers)[0]
    req = PromptRequest(text="Teacher forced fidelity of the weight paths.", language="english",
                        speaker=voice)
    f8 = teacher_forced(tiny_paths["bf16"], tiny_paths["int8"], req, 16)
    f4 = teacher_forced(tiny_paths["bf16"], tiny_paths["int4"], req, 16, codec=False)
    same = teacher_forced(tiny_paths["bf16"], tiny_paths["bf16_again"], req, 8, codec=False)
    assert same.code0_agreement == 1.0 and same.residual_agreement == 1.0
    assert same.logits_snr_db == float("inf")
    assert f8.frames >= 8
    assert f8.code0_agreement >= 0.9 and f8.logits_snr_db > 30
    assert f4.logits_snr_db > 10 and f4.logits_snr_db < f8.logits_snr_db
    assert f8.audio_snr_db is not None
    with pytest.raises(ValueError, match="two synthesizers"):
        teacher_forced(tiny_paths["bf16"], tiny_paths["bf16"], req, 2)


def test_quantized_synthesis_runs_end_to_end(tiny_paths):
    s = tiny_paths["int4"]
    voice = sorted(s.model.config.talker.speakers)[0]
    from omni_stream.config import SamplingParams

    res = s.synthesize(PromptRequest(text="Hello there.", language="english", speaker=voice),
                       SamplingParams(), seed=3, max_frames=12)
    assert res.codes.shape[1] == 16 and len(res.codes) >= 1
    assert res.audio.shape == (len(res.codes) * 1920,) and np.isfinite(res.audio).all()


def test_codec_quantization_is_measurable_not_served(tiny_ckpt):
    m = load_on_weight_path(tiny_ckpt, dtype=torch.bfloat16)
    m.code2wav.requires_grad_(False)
    codes = torch.randint(0, 64, (1, 16, 6))
    ref = m.code2wav(codes).float()
    assert quantize_codec(m.code2wav, "int8") > 0
    snr = snr_db(ref, m.code2wav(codes).float())
    assert 5 < snr < 80
    assert quantize_talker(m.weights.talker, "bf16") == 0  # exact paths change nothing

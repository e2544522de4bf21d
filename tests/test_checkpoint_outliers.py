"""``make-checkpoint --outliers``: heavy-tailed weights and massive-activation channels planted
as a re-parameterization, so the checkpoint computes the function of one without them."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from omni_stream.checkpoints.io import (OUTLIER_GAINS, OUTLIER_READERS, OUTLIERS_FILE,
                                        STUDENT_T_DF, load_model, read_config)
from omni_stream.cli import main as cli_main
from omni_stream.models.layers import rope_angles

LAYER = r"talker\.(?:code_predictor\.)?model\.layers\.\d+\."
LINEAR = re.compile(LAYER + r"(?:self_attn|mlp)\.\w+_proj\.weight")
GAIN = re.compile(LAYER + r"(?:input|post_attention)_layernorm\.weight")


@pytest.fixture(scope="module")
def outlier_ckpt(ckpt_factory):
    return ckpt_factory("tiny", "custom_voice", 0, outliers=True, dtype=torch.float32)


def _record(path) -> dict:
    return json.loads((path / OUTLIERS_FILE).read_text())


def _undo(weights, record):
    """The same model without the outlier channels: gains back to 1, reading columns x alpha."""
    plain = copy.deepcopy(weights)
    with torch.no_grad():
        for layer, chans in record["channels"].items():
            mod = plain.get_submodule(layer)
            idx = torch.tensor([c for c, _ in chans])
            alpha = torch.tensor([a for _, a in chans])
            for name in OUTLIER_GAINS:
                mod.get_submodule(name).weight[idx] /= alpha
            for name in OUTLIER_READERS:
                mod.get_submodule(name).weight[:, idx] *= alpha
    return plain


def _stack_inputs(stack, t=256, b=4):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(b, t, stack.cfg.hidden_size, generator=g)
    cos, sin = rope_angles(torch.arange(t).expand(b, t), stack.cfg.head_dim, stack.cfg.rope_theta)
    return x, cos, sin


def test_loads_with_the_normal_loader(ckpt_factory, tiny_ckpt):
    ck = ckpt_factory("tiny", "custom_voice", 0, outliers=True)  # the released bf16
    assert (ck / "config.json").read_text() == (tiny_ckpt / "config.json").read_text()
    assert read_config(ck).talker.lm.num_hidden_layers == 2
    m = load_model(ck)
    assert not any(p.is_meta for p in m.weights.parameters())
    rec = _record(ck)
    assert rec["outliers"] is True and rec["student_t_df"] == STUDENT_T_DF
    assert sorted(rec["channels"]) == [f"talker.{p}model.layers.{i}"
                                       for p in ("code_predictor.", "") for i in range(2)]
    # everything but the decoder layers is the plain checkpoint's, bit for bit
    a, b = load_file(str(ck / "model.safetensors")), load_file(str(tiny_ckpt / "model.safetensors"))
    rest = [k for k in a if not (LINEAR.fullmatch(k) or GAIN.fullmatch(k))]
    assert "talker.codec_head.weight" in rest
    assert all(torch.equal(a[k], b[k]) for k in rest)


def test_norm_gains(outlier_ckpt):
    state = load_file(str(outlier_ckpt / "model.safetensors"))
    for layer, chans in _record(outlier_ckpt)["channels"].items():
        hidden = state[f"{layer}.input_layernorm.weight"].shape[0]
        assert len(chans) == max(1, hidden // 256)
        want = torch.ones(hidden)
        for c, alpha in chans:
            assert 30.0 <= alpha <= 100.0
            want[c] = alpha
        for name in OUTLIER_GAINS:
            assert torch.equal(state[f"{layer}.{name}.weight"], want), (layer, name)


def test_function_preserved_with_massive_activations(outlier_ckpt):
    m = load_model(outlier_ckpt, dtype=torch.float32)
    record = _record(outlier_ckpt)
    plain = _undo(m.weights, record)
    gains = [v for k, v in plain.state_dict().items() if GAIN.fullmatch(k)]
    assert len(gains) == 8 and all(torch.equal(v, torch.ones_like(v)) for v in gains)
    for stack_name, head in (("talker.model", "talker.codec_head"),
                             ("talker.code_predictor.model", "talker.code_predictor.lm_head.0")):
        stack, ref = m.weights.get_submodule(stack_name), plain.get_submodule(stack_name)
        x, cos, sin = _stack_inputs(stack)
        seen: list[torch.Tensor] = []
        hooks = [layer.input_layernorm.register_forward_hook(lambda _m, _i, o: seen.append(o))
                 for layer in stack.layers]
        with torch.inference_mode():
            h, _ = stack(x, cos, sin, None, None)
            for hk in hooks:
                hk.remove()
            h_ref, _ = ref(x, cos, sin, None, None)
            logits = m.weights.get_submodule(head)(h)
            logits_ref = plain.get_submodule(head)(h_ref)
        for got, want in ((h, h_ref), (logits, logits_ref)):
            assert float((got - want).abs().max() / want.abs().max()) < 1e-4, stack_name
        # what q/k/v_proj read: the outlier channels >= 30x the median channel
        for i, act in enumerate(seen):
            mag = act.abs().mean(dim=(0, 1))
            for c, _ in record["channels"][f"{stack_name}.layers.{i}"]:
                assert float(mag[c] / mag.median()) >= 30.0, (stack_name, i, c)


def _decoder_linears(path) -> torch.Tensor:
    state = load_file(str(path / "model.safetensors"))
    return torch.cat([v.float().flatten() for k, v in state.items() if LINEAR.fullmatch(k)])


def _excess_kurtosis(w: torch.Tensor) -> float:
    z = (w - w.mean()) / w.std()
    return float(z.pow(4).mean() - 3.0)


def test_weight_tails(outlier_ckpt, tiny_ckpt):
    heavy, plain = _decoder_linears(outlier_ckpt), _decoder_linears(tiny_ckpt)
    assert _excess_kurtosis(heavy) > 0.5
    assert abs(float(heavy.std()) - 0.02) < 0.002
    assert abs(_excess_kurtosis(plain)) < 0.1
    assert abs(float(plain.std()) - 0.02) < 0.002


def test_cli_flag(tmp_path, capsys):
    out = tmp_path / "ck"
    assert cli_main(["make-checkpoint", "--preset", "tiny", "--dtype", "fp32", "--outliers",
                     "--seed", "0", "--out", str(out)]) == 0
    assert "outliers" in capsys.readouterr().out
    assert _record(out)["outliers"] is True
    assert cli_main(["make-checkpoint", "--preset", "tiny", "--out", str(out)]) == 0
    assert not (out / OUTLIERS_FILE).exists()  # a plain rewrite drops the stale record

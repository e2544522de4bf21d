"""KV pricing and budget: exact bytes from the released geometries, layer types, fallbacks."""

from __future__ import annotations

import numpy as np
import pytest

from omni_stream.config import ConfigError, ModelConfig
from omni_stream.checkpoints.presets import codec_config_dict, model_config_dict
from omni_stream.scheduling.kv_budget import (FULL, SLIDING, KVBudget, KVGeometry,
                                              code_predictor_scratch_bytes, dtype_nbytes,
                                              kv_budget_for, kv_bytes_per_token, kv_geometry,
                                              plan_slots, static_cache_bytes)

MiB = 1 << 20


def released(preset: str) -> ModelConfig:
    return ModelConfig.from_dicts(model_config_dict(preset, "custom_voice"), codec_config_dict(preset))


@pytest.mark.parametrize("preset", ["0.6b", "1.7b"])
def test_released_talker_geometry_prices_exactly(preset):
    cfg = released(preset)
    bf16 = kv_bytes_per_token(cfg, 2)
    assert bf16.flat_per_token == 28 * 8 * 128 * 2 * 2 == 114688
    assert bf16.full_per_token == 114688 and bf16.sliding_per_token == 0
    assert (bf16.num_full, bf16.num_sliding) == (28, 0)
    assert bf16.bytes_for(512) == 512 * 114688 == 56 * MiB  # the reference doc's 56 MiB at 512
    assert kv_bytes_per_token(cfg, "float32").flat_per_token == 229376
    # the raw config.json (main or talker block) prices the same, without warnings
    raw = model_config_dict(preset, "custom_voice")
    geo, warnings = kv_geometry(raw)
    assert warnings == []
    assert kv_bytes_per_token(raw, "bf16") == bf16
    assert kv_bytes_per_token(raw["talker_config"], 2) == bf16


def test_price_matches_the_engine_allocation():
    torch = pytest.importorskip("torch")
    from omni_stream.engine.step import KVCache

    cfg = ModelConfig.from_dicts(model_config_dict("tiny", "custom_voice"), codec_config_dict("tiny"))
    caches = KVCache(cfg.talker.lm, 3, 40, torch.bfloat16).layers
    allocated = sum(k.nbytes + v.nbytes for k, v in caches)
    cost = kv_bytes_per_token(cfg, torch.bfloat16)
    assert allocated == 3 * 40 * cost.flat_per_token
    cp = KVCache(cfg.talker.code_predictor, 3, cfg.talker.num_code_groups, torch.bfloat16).layers
    assert sum(k.nbytes + v.nbytes for k, v in cp) == code_predictor_scratch_bytes(
        cfg, 3, dtype_bytes=torch.bfloat16)


def test_code_predictor_scratch_released():
    cfg = released("0.6b")
    per_slot = 5 * 8 * 128 * 2 * 2 * 16
    assert per_slot == 327680
    assert code_predictor_scratch_bytes(cfg, 1, dtype_bytes=2) == per_slot
    assert code_predictor_scratch_bytes(cfg, 64, dtype_bytes="bf16") == 64 * per_slot
    raw = model_config_dict("0.6b", "base")
    assert code_predictor_scratch_bytes(raw, 2, dtype_bytes=2) == 2 * per_slot
    assert code_predictor_scratch_bytes(cfg.talker.code_predictor, 1, dtype_bytes=4) == 2 * per_slot


def test_sliding_layers_cost_at_most_their_window():
    geo = KVGeometry(2, 4, (FULL, SLIDING, FULL, SLIDING), sliding_window=8)
    c = kv_bytes_per_token(geo, 2)
    per_layer = 2 * 4 * 2 * 2
    assert (c.full_per_token, c.sliding_per_token) == (2 * per_layer, 2 * per_layer)
    assert c.flat_per_token == 4 * per_layer
    assert c.bytes_for(5) == 5 * c.flat_per_token  # under the window: same as flat
    assert c.bytes_for(20) == 20 * 2 * per_layer + 8 * 2 * per_layer
    assert c.bytes_for(20) < 20 * c.flat_per_token


def test_raw_sliding_descriptions():
    base = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                hidden_size=32)
    geo, w = kv_geometry({**base, "layer_types": [FULL, SLIDING, SLIDING, FULL], "sliding_window": 16})
    assert w == [] and geo.layer_types == (FULL, SLIDING, SLIDING, FULL) and geo.sliding_window == 16
    # Qwen2/3 convention: layers at index >= max_window_layers slide
    geo, w = kv_geometry({**base, "use_sliding_window": True, "sliding_window": 16,
                          "max_window_layers": 3})
    assert w == [] and geo.layer_types == (FULL, FULL, FULL, SLIDING)
    # a window that is declared but not switched on (the released Qwen configs) is ignored
    geo, w = kv_geometry({**base, "use_sliding_window": False, "sliding_window": 16})
    assert w == [] and geo.num_sliding == 0 and geo.sliding_window is None


def test_ambiguous_configs_fall_back_conservatively_with_warnings():
    geo, w = kv_geometry(dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64))
    assert (geo.num_key_value_heads, geo.head_dim) == (4, 16)  # MHA, hidden / heads
    assert len(w) == 2 and any("num_key_value_heads" in m for m in w) and any("head_dim" in m for m in w)

    geo, w = kv_geometry(dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=8, layer_types=[FULL, "linear_attention", SLIDING],
                              sliding_window=4))
    assert geo.layer_types == (FULL, FULL, SLIDING)
    assert len(w) == 1 and "linear_attention" in w[0]

    geo, w = kv_geometry(dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=8,
                              layer_types=[FULL, SLIDING]))
    assert geo.layer_types == (FULL,) * 3 and "3 layers" in w[0]

    geo, w = kv_geometry(dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=8,
                              layer_types=[SLIDING, SLIDING]))
    assert geo.layer_types == (FULL, FULL) and "sliding_window" in w[0]

    geo, w = kv_geometry(dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=8,
                              use_sliding_window=True, sliding_window=4))
    assert geo.layer_types == (FULL, FULL) and "max_window_layers" in w[0]

    b = kv_budget_for(dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64),
                      dtype_bytes=2, setting_bytes=1 << 20)
    assert len(b.warnings) == 2 and "2 warning(s)" in b.describe()

    with pytest.raises(ConfigError, match="num_hidden_layers"):
        kv_geometry(dict(num_attention_heads=4, hidden_size=64))
    with pytest.raises(ConfigError, match="head_dim"):
        kv_geometry(dict(num_hidden_layers=2, num_key_value_heads=2))


def test_need_is_block_rounded_and_fits():
    b = KVBudget(total_bytes=10_000, bytes_per_token=10, block_tokens=16, headroom=0.9)
    assert b.usable_bytes == 9000
    assert b.need_bytes(10, 20) == 32 * 10  # 10 + 20 + 1 = 31 -> 2 blocks
    assert b.need_bytes(0, 15) == 16 * 10  # exactly one block
    assert b.fits(9000 - 320, 320) and not b.fits(9000 - 319, 320)
    sl = KVBudget(total_bytes=10**6, bytes_per_token=10, sliding_bytes_per_token=5,
                  sliding_window=20, block_tokens=16, headroom=1.0)
    assert sl.need_bytes(100, 0) == 112 * 10 + 32 * 5  # window rounded to whole blocks too
    with pytest.raises(ValueError):
        KVBudget(total_bytes=1, bytes_per_token=1, headroom=1.5)


def test_budget_sources_and_precedence():
    cfg = released("0.6b")
    s = kv_budget_for(cfg, dtype_bytes=2, setting_bytes=8 << 30, free_memory_bytes=100 << 30)
    assert (s.total_bytes, s.headroom, s.source, s.usable_bytes) == (8 << 30, 1.0, "setting", 8 << 30)
    f = kv_budget_for(cfg, dtype_bytes=2, free_memory_bytes=20 << 30, weights_bytes=4 << 30,
                      memory_bytes=80 << 30)
    assert f.total_bytes == 16 << 30 and f.usable_bytes == int((16 << 30) * 0.9)
    assert f.source == "free memory - weights" and f.warnings == ()
    assert f.bytes_per_token == 114688
    m = kv_budget_for(cfg, dtype_bytes=2, memory_bytes=16 << 30)
    assert m.total_bytes == 16 << 30 and any("weights_bytes" in w for w in m.warnings)
    z = kv_budget_for(cfg, dtype_bytes=2, memory_bytes=1 << 30, weights_bytes=2 << 30)
    assert z.total_bytes == 0 and plan_slots(z, 16) == 0 and any("no memory" in w for w in z.warnings)
    with pytest.raises(ValueError, match="setting_bytes"):
        kv_budget_for(cfg, dtype_bytes=2)
    line = f.describe()
    assert "\n" not in line and "112.0 KiB/token" in line and "14.4 GiB usable" in line


def test_plan_slots_matches_the_static_cache():
    cfg = released("0.6b")
    per_stream = 512 * 114688
    scratch = code_predictor_scratch_bytes(cfg, 1, dtype_bytes=2)
    b = kv_budget_for(cfg, dtype_bytes=2, setting_bytes=10 * per_stream)
    assert plan_slots(b, 512) == 10
    assert plan_slots(b, 512, scratch_bytes_per_slot=scratch) == 9
    assert plan_slots(b, 512, max_slots=4) == 4
    assert static_cache_bytes(b, 10, 512) == 10 * per_stream <= b.usable_bytes
    # a headroom budget: 0.9 x 10 streams' worth -> 9 slots
    h = kv_budget_for(cfg, dtype_bytes=2, free_memory_bytes=10 * per_stream)
    assert plan_slots(h, 512) == 9


def test_dtype_sizes():
    assert dtype_nbytes("torch.bfloat16") == 2 and dtype_nbytes("fp32") == 4 and dtype_nbytes(1) == 1
    assert dtype_nbytes(np.dtype(np.float16)) == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_nbytes("float12")

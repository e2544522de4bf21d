"""Weight plans (a kind per product of the CPU runtime) and the profile's pricing of weight paths
by the machine's read bandwidth.

- plans: rules resolve in order (override, early layers, attention, the stack's default),
  refuse unknown kinds, product names and keys by name, and round-trip through JSON;
- the bytes a plan says a frame reads equal the bytes the runner packed (every product, every
  kind), so the profile prices what will run;
- a mixed plan runs end to end through the engine's API and its pack cache;
- pricing: the most faithful path that fits the budget, monotone in the bandwidth, int4 when
  nothing fits; native-only paths are refused where the torch engine would run them.
"""

from __future__ import annotations

import json

import pytest
import torch

from omni_stream.config import ModelConfig
from omni_stream.edge import derive
from omni_stream.edge.adapt import DeployProfile, build_profile
from omni_stream.edge.derive import priced_weight_path
from omni_stream.engine import quant
from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.engine.loading import NATIVE_PLANS
from omni_stream.engine.sampling import SamplingParams
from omni_stream.models.prompt import PromptBuilder, PromptRequest

pytest.importorskip("omni_stream.engine.cpu.native")
from omni_stream.engine.cpu import packing, plans  # noqa: E402
WeightPlan = plans.WeightPlan


def test_plan_rules_resolve_in_order():
    p = WeightPlan("q5", "q4", talker_attention="q8", cp_attention="q6", early=(0.25, "q8"),
                   talker_head="f32", overrides=(("talker.7.down", "q6"), ("cp.0.qkv", "q4")))
    assert p.kind("talker", 0, 8, "down") == "q8"  # early: the first quarter of 8 layers
    assert p.kind("talker", 1, 8, "gate_up") == "q8"
    assert p.kind("talker", 2, 8, "qkv") == "q8" and p.kind("talker", 2, 8, "o") == "q8"
    assert p.kind("talker", 2, 8, "gate_up") == "q5" and p.kind("talker", 7, 8, "down") == "q6"
    assert p.kind("cp", 0, 5, "qkv") == "q4"  # an override wins over early
    assert p.kind("cp", 0, 5, "o") == "q8"  # round(0.25 * 5) = 1 early layer
    assert p.kind("cp", 1, 5, "o") == "q6" and p.kind("cp", 1, 5, "down") == "q4"
    assert p.head("talker") == "f32" and p.head("cp") == "q4"
    assert WeightPlan("q4", "q4", early=(0.0, "q8")).kind("talker", 0, 28, "qkv") == "q4"
    assert WeightPlan("q4", "q4", early=(1.0, "q8")).kind("talker", 27, 28, "down") == "q8"


def test_plans_refuse_what_they_cannot_hold_by_name():
    with pytest.raises(ValueError, match="unknown weight kind 'q3'"):
        WeightPlan("q3", "q4")
    with pytest.raises(ValueError, match="unknown weight kind 'int8'"):
        WeightPlan("q4", "q4", cp_head="int8")
    for bad in ("talker.x.qkv", "codec.1.qkv", "talker.1.mlp", "talker.1"):
        with pytest.raises(ValueError, match="override"):
            WeightPlan("q4", "q4", overrides=((bad, "q8"),))
    with pytest.raises(ValueError, match="early fraction"):
        WeightPlan("q4", "q4", early=(1.5, "q8"))
    with pytest.raises(ValueError, match="unknown weight plan keys: bits"):
        WeightPlan.from_dict({"talker": "q4", "bits": 3})
    for plan in NATIVE_PLANS.values():
        again = WeightPlan.from_dict(json.loads(json.dumps(plan.as_dict())))
        assert again == plan


def _cfg(preset: str) -> ModelConfig:
    from omni_stream.checkpoints import presets

    return ModelConfig.from_dicts(presets.model_config_dict(preset, "custom_voice"),
                                  presets.codec_config_dict(preset))


@pytest.mark.parametrize("path", ["int4", "int5", "int6", "mixed", "int8", "fp32"])
def test_the_priced_bytes_are_the_bytes_the_runner_packs(tiny_model, path):
    eng = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=1, max_seq_len=64))
    eng.use_native(plan=NATIVE_PLANS[path], threads=1)
    n = eng.runtime
    size = lambda pk: sum(t.numel() * t.element_size() for t in pk.tensors)  # noqa: E731
    talker = sum(size(x) for layer in n.talker.layers for x in layer) + size(n.head)
    sub = sum(size(x) for layer in n.cp.layers for x in layer) + size(n.cp_heads[0])
    sub += size(n.proj) if n.proj is not None else 0
    groups = tiny_model.config.talker.num_code_groups
    assert plans.frame_weight_bytes(tiny_model.config.talker, NATIVE_PLANS[path]) == \
        talker + (groups - 1) * sub


def test_the_released_shapes_read_fewer_bytes_per_frame_on_fewer_bits():
    for preset in ("0.6b", "1.7b"):
        t = _cfg(preset).talker
        b = {wp: plans.frame_weight_bytes(t, NATIVE_PLANS[wp])
             for wp in ("int4", "int5", "int6", "mixed", "int8", "fp32")}
        assert b["int4"] < b["int5"] < b["int6"] < b["mixed"] < b["int8"] < b["fp32"], b


def test_a_mixed_plan_runs_end_to_end_and_reloads_from_the_pack_cache(tiny_model, tmp_path):
    builder = PromptBuilder(tiny_model.config, tiny_model.weights.talker, tiny_model.tokenizer)
    p = builder.build(PromptRequest(text="Mixed precision per tensor.", language="english",
                                    speaker="ryan"))
    plan = WeightPlan("q5", "q6", talker_attention="q8", early=(0.5, "q8"), cp_head="q4",
                      overrides=(("talker.0.down", "q6"),))
    runs = []
    for _ in range(2):  # packs and writes the cache, then reads it
        eng = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=1, max_seq_len=128))
        eng.use_native(plan=plan, threads=1, pack_cache=tmp_path / "packed.safetensors")
        kinds = [pk.struct.kind for pk in eng.runtime.talker.layers[0]]
        assert kinds == [packing.KINDS[k] for k in ("q8", "q8", "q8", "q6")]
        with torch.inference_mode():
            eng.prefill(0, p.embeds, p.trailing, SamplingParams.greedy(), 0)
            codes = torch.stack([eng.step(1)[0][0].clone() for _ in range(6)])
        assert bool(((codes >= 0) & (codes < tiny_model.config.code2wav.codebook_size)).all())
        runs.append(codes)
    assert torch.equal(runs[0], runs[1])


def test_pricing_picks_the_most_faithful_path_that_is_real_time():
    t = _cfg("0.6b").talker
    fb = {wp: plans.frame_weight_bytes(t, NATIVE_PLANS[wp]) for wp in derive.NATIVE_PATHS_BY_FIDELITY}
    budget = derive.REALTIME_MODEL_SHARE * derive.FRAME_S * derive.NATIVE_READ_EFFICIENCY * 1e9
    order = derive.NATIVE_PATHS_BY_FIDELITY
    assert priced_weight_path(fb, 1e6) == order[0]
    assert priced_weight_path(fb, 0.01) == "int4"  # nothing fits: the fastest
    for wp in order:  # at the bandwidth where a path just fits, it (or a more faithful one) wins
        assert order.index(priced_weight_path(fb, fb[wp] / budget * 1.0001)) <= order.index(wp)
        if wp != "int4":
            assert order.index(priced_weight_path(fb, fb[wp] / budget * 0.9999)) > order.index(wp) \
                or fb[wp] > fb[priced_weight_path(fb, fb[wp] / budget * 0.9999)]
    ranks = [order.index(priced_weight_path(fb, bw)) for bw in torch.linspace(1, 100, 200).tolist()]
    assert ranks == sorted(ranks, reverse=True)  # more bandwidth never buys a less faithful path


def test_frame_reads_split_the_frame_bytes_by_stack_and_kind():
    t = _cfg("0.6b").talker
    for wp in derive.NATIVE_PATHS_BY_FIDELITY:
        r = plans.frame_reads(t, NATIVE_PLANS[wp])
        assert r.total == plans.frame_weight_bytes(t, NATIVE_PLANS[wp])
        assert r.sub_steps == t.num_code_groups - 1 == 15
        assert all(b > 0 for b in (*r.talker.values(), *r.cp.values()))
    mixed = plans.frame_reads(t, NATIVE_PLANS["mixed"])
    assert set(mixed.talker) == {"q8g", "q5"} and set(mixed.cp) == {"q8g", "q6", "q5"}


def test_cache_resident_code_predictor_reads_are_priced_at_their_kernels_rate():
    """A frame's price: each product at the lower of where its weights come from and its
    kernel's own rate; the code predictor's 14 re-reads at the bandwidth measured over a buffer
    of its size (a large cache's, or memory's). Without rates it is bytes over bandwidth."""
    t = _cfg("0.6b").talker
    r = plans.frame_reads(t, NATIVE_PLANS["mixed"])
    mem = 30.0 * derive.NATIVE_READ_EFFICIENCY * 1e9
    bytes_only = derive.priced_frame_s(r, 30.0)
    assert bytes_only == pytest.approx(r.total / mem)
    fast = {k: 1e6 for k in ("q5", "q6", "q8g")}
    assert derive.priced_frame_s(r, 30.0, fast, 30.0) == pytest.approx(bytes_only)
    # a re-read below memory's bandwidth is noise: never priced slower than memory
    assert derive.priced_frame_s(r, 30.0, fast, 3.0) == pytest.approx(bytes_only)
    cached = derive.priced_frame_s(r, 30.0, fast, 300.0)  # a big L3 holds the code predictor
    first = (sum(r.talker.values()) + r.cp_bytes) / mem
    assert cached == pytest.approx(first + 14 * r.cp_bytes / 300e9)
    # kernels slower than the cache bound the re-reads; slower than memory, every read
    slow = {"q5": 40.0, "q6": 40.0, "q8g": 20.0}
    bound = derive.priced_frame_s(r, 30.0, slow, 300.0)
    want = (r.talker["q5"] / 30e9 + r.talker["q8g"] / 20e9
            + r.cp["q5"] / 30e9 + r.cp["q6"] / 30e9 + r.cp["q8g"] / 20e9
            + 14 * (r.cp["q5"] / 40e9 + r.cp["q6"] / 40e9 + r.cp["q8g"] / 20e9))
    assert bound == pytest.approx(want)
    assert cached < bound and bytes_only < derive.priced_frame_s(r, 30.0, slow, None)
    # an unmeasured kind is unbounded
    assert derive.priced_frame_s(r, 30.0, {}, None) == pytest.approx(bytes_only)


def test_a_measured_machine_prices_each_path_from_its_kernels_and_its_cache(monkeypatch):
    """The serve path's pricing on a probed machine: the bandwidth, every kind's kernel rate
    (one thread's, times the threads) and each path's re-read bandwidth are measured; a
    machine whose cache holds the code predictor gets the faithful path at a bandwidth where
    bytes alone would not allow it. The measurements are stubbed: what is checked is how the
    figures are combined and passed on."""
    from pathlib import Path

    from omni_stream.edge import measure
    from omni_stream.edge.probe import probe
    from omni_stream.orchestrator import flags

    hw = probe(str(Path(__file__).parent / "data" / "hw" / "local_xeon_2c"), None)
    assert hw.source == "probe" and derive.native_engine_runs(hw)
    cfg = _cfg("0.6b")
    monkeypatch.delenv(flags.BANDWIDTH_ENV, raising=False)
    threads = []
    monkeypatch.setattr(plans, "kernel_read_gbs", lambda kind, t: threads.append(t) or 40.0)

    def bandwidth(t, mib=256):  # 25 GB/s from memory, 400 from a cache of <= 128 MiB
        return 400.0 if mib <= 128 else 25.0

    monkeypatch.setattr(measure, "memory_bandwidth_gbs", bandwidth)
    monkeypatch.setattr(flags, "_BANDWIDTH", {})
    bw, priced = flags._weight_path_pricing(hw, cfg)
    assert bw == 25.0 and set(threads) == {1}
    reads = plans.frame_reads(cfg.talker, NATIVE_PLANS["mixed"])
    mem = 25.0 * 1e9 * derive.NATIVE_READ_EFFICIENCY
    want = derive.priced_frame_s(reads, 25.0, {k: 40.0 * hw.physical_cores for k in packing.KINDS}, 400.0)
    assert priced["mixed"] == round(want * mem) < reads.total
    kw = dict(model_bytes=1_800_000_000, kv_bytes_per_token=28 * 8 * 128 * 4)
    by_bytes, _ = build_profile(hw, bandwidth_gbs=25.0, frame_bytes={
        wp: plans.frame_weight_bytes(cfg.talker, NATIVE_PLANS[wp]) for wp in priced}, **kw)
    cached, _ = build_profile(hw, bandwidth_gbs=25.0, frame_bytes=priced, **kw)
    assert by_bytes.weight_path != "mixed" and cached.weight_path == "mixed"


def test_the_runtime_kernels_rate_is_measured_for_every_kind():
    for kind in ("q4", "q5", "q6", "q8", "q8g"):
        rate = plans.kernel_read_gbs(kind, 1, n=64, k=128, seconds=0.005)
        assert 0 < rate < float("inf")


def test_the_profile_prices_by_bandwidth_only_where_the_native_runtime_runs():
    from pathlib import Path

    from omni_stream.edge.probe import probe

    hw = probe(str(Path(__file__).parent / "data" / "hw" / "local_xeon_2c"), None)  # 2 cores, VNNI
    cfg = _cfg("0.6b")
    fb = {wp: plans.frame_weight_bytes(cfg.talker, NATIVE_PLANS[wp]) for wp in derive.NATIVE_PATHS_BY_FIDELITY}
    kw = dict(model_bytes=1_800_000_000, kv_bytes_per_token=28 * 8 * 128 * 4, frame_bytes=fb)
    slow, _ = build_profile(hw, bandwidth_gbs=10.0, **kw)
    fast, src = build_profile(hw, bandwidth_gbs=60.0, **kw)
    assert slow.weight_path == "int4" and fast.weight_path == "mixed"
    assert src["weight_path"] == "derived" and fast.engine == "native"
    unmeasured, _ = build_profile(hw, bandwidth_gbs=None, **kw)
    assert unmeasured.weight_path == "int4"  # the small-CPU rule without a measurement
    torch_engine, _ = build_profile(hw, bandwidth_gbs=60.0, user={"engine": "torch"}, **kw)
    assert torch_engine.weight_path == "int4"  # native-only paths are not priced for torch
    user, src = build_profile(hw, bandwidth_gbs=10.0, user={"weight_path": "int6"}, **kw)
    assert user.weight_path == "int6" and src["weight_path"] == "user"


def test_native_only_paths_are_refused_on_the_torch_engine_with_the_fix():
    for wp in ("mixed", "int6", "int5"):
        with pytest.raises(ValueError, match="native CPU runtime only"):
            quant.check_supported(wp, "cpu")
        with pytest.raises(ValueError, match="engine 'native'"):
            DeployProfile(dtype="bfloat16", weight_path=wp, engine="torch")
        quant.check_supported(wp, "cpu", engine="native")
        DeployProfile(dtype="bfloat16", weight_path=wp, engine="native")


@pytest.mark.parametrize("value", ["fast", "0", "-3", "nan", "inf"])
def test_a_bad_bandwidth_setting_is_refused_naming_the_variable(monkeypatch, value):
    from omni_stream import cli

    monkeypatch.setenv(cli.BANDWIDTH_ENV, value)
    with pytest.raises(SystemExit, match="OMNI_STREAM_BANDWIDTH_GBS"):
        cli._weight_path_pricing(None, _cfg("tiny"))
    monkeypatch.setenv(cli.BANDWIDTH_ENV, "17.5")
    bw, fb = cli._weight_path_pricing(None, _cfg("tiny"))
    assert bw == 17.5 and set(fb) == {"int8", "mixed", "int6", "int5", "int4"}

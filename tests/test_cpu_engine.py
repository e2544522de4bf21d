"""The CPU runtime (engine/cpu): its products, its decode step and its sampler against torch.

- products: q4 / q8 / f32 against the weights they effectively hold (``dequantized()``), at odd
  row counts and with a bias; the only difference is the per-row int8 rounding of the input;
- the decode step: with exact (f32) weights the runtime's talker step, prefill and code
  predictor frame give the codes of the torch step (the one formulation) on the tiny model,
  greedy and seeded-sampled, batched, through the engine's own API;
- sampling: the runtime's draws equal the torch sampler's on the same scores, seeds and
  counters (same noise, same filtering), and a row with nothing to draw is -1;
- validation: a NaN hidden state makes that row's code-predictor codes INVALID, others intact.
"""

from __future__ import annotations

import ctypes as C

import numpy as np
import pytest
import torch

from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.engine.sampling import INVALID, SamplingParams, SlotSampling, sample
from omni_stream.engine.synthesis import Synthesizer
from omni_stream.models.prompt import PromptBuilder, PromptRequest

pytest.importorskip("omni_stream.engine.cpu.native")
from omni_stream.engine.cpu import abi, packing  # noqa: E402
from omni_stream.engine.cpu.pool import CoreLease, Pool  # noqa: E402

REQS = [PromptRequest(text="Hello world, this is the CPU runtime.", language="english", speaker="ryan"),
        PromptRequest(text="Another stream joins the batch.", language="auto", speaker="vivian")]


@pytest.fixture(scope="module")
def pool():
    return Pool(2)


def _product(pool, pk, x: torch.Tensor) -> torch.Tensor:
    """``x [m, k] @ W.T`` through the runtime's ``oc_linear`` on ``pool`` (its library)."""
    y = torch.empty(x.shape[0], pk.n)
    pool.lib.oc_linear(pool.handle, C.byref(pk.struct), x.data_ptr(), x.shape[0], y.data_ptr())
    return y


@pytest.mark.parametrize("kind", ["q4", "q5", "q6", "q8", "q8g", "f32"])
@pytest.mark.parametrize("m", [1, 3, 5, 17])
def test_products_match_the_weights_they_hold(pool, kind, m):
    gen = torch.Generator().manual_seed(m)
    n, k = 48, 192
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen)
    pk = packing.pack_weight(w, b, kind)
    x = torch.randn(m, k, generator=gen)
    y = _product(pool, pk, x)
    ref = x @ pk.dequantized().T + b
    err = float((y - ref).norm() / ref.norm())
    if kind == "f32":
        assert err < 1e-5
        assert torch.equal(pk.dequantized(), w)
    else:  # only the input's per-row int8 rounding (~1/127 of its largest value) differs
        assert err < 3e-2, err
        bound = {"q4": 0.5, "q5": 0.25, "q6": 0.12, "q8": 0.05, "q8g": 0.03}[kind]
        assert float((pk.dequantized() - w).abs().max()) <= bound * float(w.abs().max())


def test_shapes_the_layouts_cannot_hold_fall_back_to_exact(pool):
    assert packing.kind_for(40, 64, "q4") == "f32"  # rows not a multiple of 16
    assert packing.kind_for(32, 96, "q4") == "f32"  # inputs not a multiple of the group
    assert packing.kind_for(32, 96, "q6") == "f32" and packing.kind_for(17, 64, "q5") == "f32"
    assert packing.kind_for(32, 96, "q8") == "q8" and packing.kind_for(32, 100, "q8") == "f32"
    with pytest.raises(ValueError, match="unknown weight kind 'q3'"):
        packing.kind_for(32, 64, "q3")
    gen = torch.Generator().manual_seed(3)
    for n, k in ((1, 64), (17, 65), (33, 129)):  # one row, 2^j + 1 shapes: exact fp32 products
        w = torch.randn(n, k, generator=gen)
        for kind in ("q4", "q5", "q6", "q8", "q8g"):
            pk = packing.pack_weight(w, None, kind)
            assert pk.struct.kind == packing.KINDS["f32"]
            x = torch.randn(2, k, generator=gen)
            y = _product(pool, pk, x)
            torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["q4", "q5", "q6", "q8", "q8g", "f32"])
def test_packing_edges(pool, kind):
    """All-zero groups come back exactly zero, one huge weight costs only its own group (q4,
    q6) or row (q8), and a weight with a NaN or an infinity is refused, naming the damage."""
    gen = torch.Generator().manual_seed(11)
    n, k = 32, 256
    w = torch.randn(n, k, generator=gen) * 0.02
    w[3, 64:128] = 0.0  # one all-zero group
    w[5] = 0.0  # one all-zero row
    w[7, 200] = 1e4  # one huge weight
    pk = packing.pack_weight(w, None, kind)
    d = pk.dequantized()
    assert torch.isfinite(d).all()
    assert torch.equal(d[3, 64:128], torch.zeros(64)) and torch.equal(d[5], torch.zeros(k))
    assert abs(float(d[7, 200]) - 1e4) <= 1e4 * 2e-3
    others = torch.ones(n, dtype=torch.bool)
    others[7] = False
    err = float((d[others] - w[others]).abs().max())
    assert err <= {"q4": 0.2, "q5": 0.1, "q6": 0.05, "q8": 0.01, "q8g": 0.01, "f32": 0.0}[kind] * float(w[others].abs().max())
    x = torch.randn(3, k, generator=gen)
    y = _product(pool, pk, x)
    assert torch.isfinite(y).all() and torch.equal(y[:, 5], torch.zeros(3))
    for bad in (float("nan"), float("inf"), -float("inf")):
        wb = w.clone()
        wb[1, 2] = bad
        with pytest.raises(ValueError, match="1 NaN/inf"):
            packing.pack_weight(wb, None, kind)
    with pytest.raises(ValueError, match="non-empty"):
        packing.pack_weight(torch.empty(0, 64), None, kind)


def test_clipped_ranges_lower_the_error_of_heavy_tails():
    """A group with one far weight gives up that weight's exactness for finer steps over the
    rest: over Student-t weights the chosen 4-bit ranges beat the full range; the full range is
    one of the candidates, so no group ever loses (at 6 bits the steps are fine enough that the
    full range mostly wins)."""
    gen = torch.Generator().manual_seed(2)
    gauss = torch.randn(64, 1024, generator=gen)
    heavy = torch.distributions.StudentT(3.0).sample((64, 1024))
    for levels in (15, 31, 63):
        for w, gain in ((heavy, 1.03 if levels == 15 else 1.0), (gauss, 1.0)):
            errs = []
            for clips in (packing.CLIPS["q4"], (1.0,)):
                q, s, m = packing.affine_codes(w, levels, clips=clips)
                d = q.view(64, 16, 64).float() * s[..., None] + m[..., None]
                errs.append(float(((d.view(64, 1024) - w) ** 2).sum()))
            assert errs[0] * gain <= errs[1], (levels, errs)


def test_smoothing_moves_norm_outliers_into_the_weights():
    """Gains 30-100x on a few channels with their columns divided to match: the factors find
    exactly those channels (s = alpha there, ~1 elsewhere), the fold keeps the function, and
    a q8 product of the folded pair is as close as on the plain weights; zero gains and
    all-zero columns keep s = 1."""
    gen = torch.Generator().manual_seed(4)
    k = 256
    w = torch.randn(96, k, generator=gen) * 0.02
    x = torch.randn(8, k, generator=gen)
    alpha = torch.ones(k)
    chans = torch.tensor([3, 100, 201])
    alpha[chans] = torch.tensor([30.0, 64.0, 100.0])
    gain, wo = alpha.clone(), w / alpha  # the outlier pair: same product as (ones, w)
    s = packing.smoothing(gain, (wo[:48], wo[48:]))
    ratio = s / packing.smoothing(torch.ones(k), (w[:48], w[48:]))
    torch.testing.assert_close(ratio[chans], alpha[chans], rtol=1e-2, atol=0)  # (the median moves a little)
    torch.testing.assert_close((x * gain / s) @ (wo * s).T, (x * gain) @ wo.T, rtol=1e-5, atol=1e-6)
    ref = x @ w.T

    def q8_err(g, ww):
        xa = x * g
        sc = xa.abs().amax(1, keepdim=True) / 127  # the runtime's per-row int8 activations
        xq = torch.round(xa / sc) * sc
        y = xq @ packing.pack_weight(ww, None, "q8").dequantized().T
        return float((y - ref).norm() / ref.norm())

    plain, raw = q8_err(torch.ones(k), w), q8_err(gain, wo)
    smoothed = q8_err(gain / s, wo * s)
    assert raw > 3 * plain and smoothed < 1.5 * plain, (plain, raw, smoothed)
    g0 = gain.clone()
    g0[7] = 0.0
    wz = wo.clone()
    wz[:, 9] = 0.0
    s0 = packing.smoothing(g0, (wz,))
    assert float(s0[7]) == 1.0 and float(s0[9]) == 1.0 and torch.isfinite(s0).all()
    assert torch.equal(packing.smoothing(torch.zeros(k), (w,)), torch.ones(k))


def _engine(model, kind: str | None) -> FrameEngine:
    eng = FrameEngine(model.weights.talker, EngineShape(max_slots=3, max_seq_len=256))
    if kind:
        eng.use_native(kind, kind, threads=2)
    return eng


def _run(model, eng, params, seeds, frames):
    builder = PromptBuilder(model.config, model.weights.talker, model.tokenizer)
    out = [[] for _ in REQS]
    with torch.inference_mode():
        for i, r in enumerate(REQS):
            p = builder.build(r)
            # the first prompt in two pieces: chunked prefill goes through the runtime too
            if i == 0:
                eng.prefill(i, p.embeds[:5], p.trailing, params, seeds[i], start=0, final=False)
                eng.prefill(i, p.embeds[5:], p.trailing, params, seeds[i], start=5)
            else:
                eng.prefill(i, p.embeds, p.trailing, params, seeds[i])
        for _ in range(frames):
            codes, _ = eng.step(len(REQS))
            for i in range(len(REQS)):
                out[i].append(codes[i].clone())
    return [torch.stack(o).numpy() for o in out]


@pytest.mark.parametrize("params", [SamplingParams.greedy(), SamplingParams()], ids=["greedy", "sampled"])
def test_exact_weights_give_the_torch_steps_codes(tiny_model, params):
    ref = _run(tiny_model, _engine(tiny_model, None), params, [5, 6], 12)
    got = _run(tiny_model, _engine(tiny_model, "f32"), params, [5, 6], 12)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)


def test_low_bit_weights_run_and_stay_in_the_codebook(tiny_model):
    for kind in ("q4", "q8"):
        codes = _run(tiny_model, _engine(tiny_model, kind), SamplingParams(), [1, 2], 8)
        for c in codes:
            assert c.shape == (8, 16) and c.min() >= 0 and c[:, 1:].max() < 2048


def test_packed_weights_kept_on_disk_give_the_same_codes(tiny_model, tmp_path, caplog):
    """The pack cache: the first start packs and writes the file, the next loads every product
    from it (nothing repacked) and samples the same codes; a file that does not fit the model
    (another weight path) or does not read is ignored with a warning and rewritten."""
    path = tmp_path / "packed.safetensors"

    def engine(kind):
        eng = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=3, max_seq_len=256))
        eng.use_native(kind, kind, threads=2, pack_cache=path)
        return eng

    first = engine("q4")
    assert path.is_file()
    ref = _run(tiny_model, first, SamplingParams(), [3, 4], 8)
    again = engine("q4")
    with pytest.raises(ValueError, match="pack cache"):
        again.runtime.head.dequantized()  # loaded, not packed
    for a, b in zip(ref, _run(tiny_model, again, SamplingParams(), [3, 4], 8)):
        np.testing.assert_array_equal(a, b)
    before = path.stat().st_mtime_ns
    q8 = engine("q8")  # the file holds q4 products: repacked as q8 and rewritten
    assert "does not fit" in caplog.text and path.stat().st_mtime_ns != before
    q8.runtime.head.dequantized()
    path.write_bytes(b"not a safetensors file")
    engine("q4")
    assert "ignoring the pack cache" in caplog.text
    assert packing.PackCache._read(path)  # rewritten whole
    # the folder keeps the most recently used files only
    import os
    for i in range(6):
        old = tmp_path / f"old{i}.safetensors"
        old.write_bytes(b"x")
        os.utime(old, ns=(i, i))
    packing.PackCache.prune(tmp_path, 4)
    left = sorted(f.name for f in tmp_path.glob("*.safetensors"))
    assert left == ["old3.safetensors", "old4.safetensors", "old5.safetensors", "packed.safetensors"]


def test_offline_synthesis_runs_on_the_runtime(tiny_ckpt):
    s = Synthesizer.from_path(tiny_ckpt)
    ref, _, _ = s.generate_codes(REQS[0], SamplingParams.greedy(), 0, 10)
    s.engine.use_native("f32", "f32")
    got, _, _ = s.generate_codes(REQS[0], SamplingParams.greedy(), 0, 10)
    np.testing.assert_array_equal(ref, got)


def test_runtime_draws_equal_the_torch_samplers(pool):
    gen = torch.Generator().manual_seed(0)
    b, v = 400, 512
    scores = torch.randn(b, v, generator=gen) * 3
    scores[0] = float("nan")
    scores[1, 7:] = float("-inf")
    greedy = torch.rand(b, generator=gen) < 0.2
    top_k = torch.tensor([0, 1, 5, 50, 600])[torch.randint(0, 5, (b,), generator=gen)]
    top_p = torch.tensor([1.0, 0.9, 0.5])[torch.randint(0, 3, (b,), generator=gen)]
    temp = torch.empty(b).uniform_(0.3, 1.5, generator=gen)
    seed = torch.randint(0, 2**62, (b,), generator=gen)
    ctr = torch.randint(0, 2**40, (b,), generator=gen)
    ref = sample(scores, SlotSampling(greedy, temp, top_k, top_p), seed, ctr, v)
    g32, k32 = greedy.to(torch.int32), top_k.to(torch.int32)
    ctr_n = ctr.clone()
    sp = abi.OcSampling(greedy=g32.data_ptr(), top_k=k32.data_ptr(), temperature=temp.data_ptr(),
                           top_p=top_p.data_ptr(), seed=seed.data_ptr(), counter=ctr_n.data_ptr())
    got = torch.empty(b, dtype=torch.int64)
    s = scores.contiguous()
    pool.lib.oc_sample(s.data_ptr(), b, v, C.byref(sp), got.data_ptr())
    assert torch.equal(ctr_n, ctr + 1)
    assert got[0].item() == INVALID == ref[0].item()
    assert 0 <= got[1].item() < 7
    same = (got == ref).float().mean().item()
    assert same >= 0.99, same  # the rare difference: a last-bit tie between two logf versions


def test_nan_hidden_state_fails_only_its_row(tiny_model):
    eng = _engine(tiny_model, "q8")
    builder = PromptBuilder(tiny_model.config, tiny_model.weights.talker, tiny_model.tokenizer)
    with torch.inference_mode():
        for i, r in enumerate(REQS):
            p = builder.build(r)
            eng.prefill(i, p.embeds, p.trailing, SamplingParams(), i)
        eng.inject_fault(1, "code_predictor")
        codes = eng.predict_residual(2)
    assert bool((codes[1] == INVALID).all()) and bool((codes[0] >= 0).all())


def test_the_portable_scalar_path_computes_the_same_products(tmp_path):
    """A CPU without AVX-512 VNNI builds the same file without it (scalar loops): its products
    equal the vector kernels' (integer sums, same scales)."""
    from omni_stream.engine.cpu.build import FLAGS, build

    flags = tuple(f for f in FLAGS if f != "-march=native") + ("-march=x86-64",)
    scalar = abi.library(str(build(tmp_path / "libscalar.so", flags)))
    assert scalar.oc_has_vnni() == 0
    fast, slow = Pool(1), Pool(1, lib=scalar)
    gen = torch.Generator().manual_seed(9)
    for kind in ("q4", "q5", "q6", "q8", "q8g"):
        for n, k, m in ((16, 64, 1), (32, 128, 3), (48, 192, 9), (16, 320, 17)):
            pk = packing.pack_weight(torch.randn(n, k, generator=gen), None, kind)
            x = torch.randn(m, k, generator=gen)
            ys = [_product(p, pk, x) for p in (fast, slow)]
            torch.testing.assert_close(ys[0], ys[1], rtol=1e-5, atol=1e-5)


def test_the_gfni_unpacking_gives_the_same_products_bit_for_bit(tmp_path):
    """Where the CPU has GFNI, q5 and q6 move their top bits with one affine byte map each
    (fewer ops on the ports VPDPBUSD uses); the weights they unpack, hence the products, are
    those of the shift-and-mask build, bit for bit."""
    from omni_stream.engine.cpu.build import FLAGS, _cpu_flags, build

    if "gfni" not in _cpu_flags().split() or abi.library().oc_has_vnni() == 0:
        pytest.skip("no GFNI (or no VNNI kernels) on this CPU")
    plain = abi.library(str(build(tmp_path / "libnogfni.so", FLAGS + ("-mno-gfni",))))
    fast, slow = Pool(1), Pool(1, lib=plain)
    gen = torch.Generator().manual_seed(11)
    for kind in ("q5", "q6"):
        for n, k, m in ((16, 64, 1), (48, 192, 5), (64, 1024, 9)):
            w = torch.randn(n, k, generator=gen)
            w[0, :7] = torch.tensor([1e3, -1e3, 0.0, 1e-30, -1e-30, 3.0, -3.0])  # range edges
            pk = packing.pack_weight(w, None, kind)
            x = torch.randn(m, k, generator=gen)
            ys = [_product(p, pk, x) for p in (fast, slow)]
            assert torch.equal(ys[0].view(torch.int32), ys[1].view(torch.int32)), (kind, n, k, m)


def test_amx_tiles_give_the_vnni_kernels_products_bit_for_bit(tmp_path):
    """Where the CPU has AMX, q4 products of >= 16 rows run on int8 tiles: the same integer sums
    and the same float epilogue as the VNNI kernel, so the same bits, at any row count (whole
    tiles, a partial last tile) and with a bias. Elsewhere both builds are the VNNI kernel."""
    from omni_stream.engine.cpu.build import FLAGS, build

    flags = FLAGS + ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
    vnni = abi.library(str(build(tmp_path / "libvnni.so", flags)))
    assert vnni.oc_has_amx() == 0
    fast, ref = Pool(2), Pool(2, lib=vnni)
    gen = torch.Generator().manual_seed(5)
    b = torch.randn(80, generator=gen)
    pk = packing.pack_weight(torch.randn(80, 320, generator=gen) * 0.05, b, "q4")
    for m in (15, 16, 17, 40, 64):
        x = torch.randn(m, 320, generator=gen) * 3
        x[m // 2] = 0.0  # an all-zero row (scale 1, sums 0)
        ys = [_product(p, pk, x) for p in (fast, ref)]
        assert torch.equal(ys[0], ys[1]), (m, float((ys[0] - ys[1]).abs().max()))
        ref_y = x @ pk.dequantized().T + b
        assert float((ys[0] - ref_y).norm() / ref_y.norm()) < 3e-2


def test_snake_kernel_rounds_like_float64_over_a_million_values_and_edges():
    """Code2Wav's one-pass SnakeBeta (bf16 in and out, float math): every output within one bf16
    step of x + sin(alpha x)^2 / beta computed in float64 and rounded once, over 2 million values
    spanning 1e-3..1e3, odd row lengths (vector tails), and the edges: +-0, +-inf and NaN (NaN
    out, as torch's sin), |alpha x| past the reduction's range (the exact fallback), 1e+-30."""
    snake = abi.snake_kernel()
    g = torch.Generator().manual_seed(0)
    c, t = 7, 142863
    x = (torch.randn(2, c, t, generator=g) * torch.logspace(-3, 3, t)[None, None]).bfloat16()
    edges = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 4096.0, 4095.0,
             1e-30, 3.14159, -3.14159, 1e5, -7e4]
    x[0, 0, :len(edges)] = torch.tensor(edges).bfloat16()
    alpha, inv_beta = torch.linspace(0.1, 20, c), torch.linspace(0.05, 3, c)
    y = snake(x, alpha, inv_beta).float()
    xd = x.double()
    ref = (xd + inv_beta.double()[None, :, None] * torch.sin(xd * alpha.double()[None, :, None]) ** 2)
    ref = ref.float().bfloat16().float()
    both_nan = torch.isnan(y) & torch.isnan(ref)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    step = ref.abs().clamp_min(1e-30) * 2.0 ** -7
    assert bool((((y - ref).abs() <= step) | both_nan).all())
    assert float(((y == ref) | both_nan).float().mean()) > 0.999
    short = snake(x[:, :, :5], alpha, inv_beta).float()  # rows shorter than a vector: scalar
    assert bool((((short - ref[:, :, :5]).abs() <= step[:, :, :5]) | torch.isnan(ref[:, :, :5])).all())
    with pytest.raises(ValueError, match="bf16 or fp32"):
        snake(x.half(), alpha, inv_beta)  # fp16: no kernel
    with pytest.raises(ValueError, match="bf16 or fp32"):
        snake(x[0], alpha, inv_beta)  # [C, T]: not a batch


def test_snake_kernel_value_depends_on_the_input_alone_not_its_place_in_the_row():
    """Each output is the same bits wherever its input sits: in a row of any length (full
    vectors and the masked last one alike), at any offset, and beside lanes that take the exact
    fallback (huge, inf, NaN): the same stream decoded in other chunks gives the same audio."""
    snake = abi.snake_kernel()
    g = torch.Generator().manual_seed(3)
    c, t = 3, 97
    x = (torch.randn(1, c, t, generator=g) * 4).bfloat16()
    x[0, 1, 10], x[0, 1, 40], x[0, 2, 33] = float("nan"), 1e6, float("-inf")  # fallback lanes
    alpha, inv_beta = torch.tensor([0.5, 3.0, 17.0]), torch.tensor([1.0, 0.3, 2.5])
    whole = snake(x, alpha, inv_beta)
    for lo, hi in ((0, 1), (0, 5), (3, 19), (16, 32), (15, 48), (31, 97), (90, 97), (41, 42)):
        part = snake(x[:, :, lo:hi].contiguous(), alpha, inv_beta)
        assert torch.equal(part.view(torch.int16), whole[:, :, lo:hi].view(torch.int16)), (lo, hi)
    # 64 channels x 11,270 values as Code2Wav feeds them (alpha ~ 1): long rows against the same
    # values cut into rows of 7 (all in a last, partial vector) and of 23 (one full and one
    # partial); an std::sin tail differs from the vector polynomial on ~4 in 100,000 of these
    c, n = 64, 7 * 23 * 70
    g = torch.Generator().manual_seed(3)  # the old kernel (an std::sin tail) failed these
    many = torch.randn(1, c, n, generator=g).bfloat16()
    al = torch.exp(0.1 * torch.randn(c, generator=g))
    ib = 1 / (torch.exp(0.1 * torch.randn(c, generator=g)) + 1e-9)
    ref = snake(many, al, ib).view(torch.int16)
    for k in (7, 23):
        cut = snake(many.reshape(1, -1, k).contiguous(), al.repeat_interleave(n // k).contiguous(),
                    ib.repeat_interleave(n // k).contiguous())
        assert torch.equal(cut.view(torch.int16).reshape(ref.shape), ref), k


# ------------------------------------------------------------------------------ lent cores
def test_lent_threads_never_change_the_codes(tiny_model):
    """A pool with a thread on a lent core gives the codes of one thread, whether the owner
    holds the lease all along, never, or takes it back and gives it again while frames run
    (another thread flips it every ~0.5 ms, as the codec stage does around each decode)."""
    import os
    import threading
    import time

    lent_cpu = max(os.sched_getaffinity(0))
    one = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=3, max_seq_len=256))
    one.use_native("q4", "q4", threads=1)
    ref = _run(tiny_model, one, SamplingParams(), [3, 4], 10)
    for mode in ("free", "held", "flipping"):
        lease = CoreLease()
        eng = FrameEngine(tiny_model.weights.talker, EngineShape(max_slots=3, max_seq_len=256))
        eng.use_native("q4", "q4", threads=1, lent_cpus=(lent_cpu,), lease=lease)
        stop = threading.Event()

        def flip():
            while not stop.is_set():
                with lease.held():
                    time.sleep(0.0005)
                time.sleep(0.0005)

        if mode == "held":
            lease.acquire()
        flipper = threading.Thread(target=flip) if mode == "flipping" else None
        if flipper:
            flipper.start()
        try:
            got = _run(tiny_model, eng, SamplingParams(), [3, 4], 10)
        finally:
            stop.set()
            if flipper:
                flipper.join()
        own, lent = eng.runtime.pool.jobs()
        for a, b in zip(ref, got):
            np.testing.assert_array_equal(a, b, err_msg=mode)
        if mode == "free":
            assert own == 0 and lent > 0
        elif mode == "held":
            assert own > 0 and lent == 0 and not lease.busy
        else:
            assert own > 0 and lent > 0, (own, lent)


def test_the_lease_waits_for_the_borrowers_job_then_goes_ahead(tmp_path):
    """acquire() waits while the borrower's job runs on the lent core (busy), at most its
    timeout; two mappings of one file (two processes in the server) see each other's words."""
    path = tmp_path / "lease"
    path.write_bytes(bytes(4096))
    owner = CoreLease.open(str(path), 384, timeout_s=0.002)
    borrower = CoreLease.open(str(path), 384)
    assert not owner.wanted and not borrower.busy
    owner.acquire()
    assert borrower.wanted and owner.late == 0
    owner.release()
    assert not borrower.wanted
    borrower._words[1] = 1  # a job in flight on the lent core
    owner.acquire()  # waits 2 ms, then goes ahead and counts it
    assert owner.late == 1 and borrower.wanted
    owner.release()
    borrower._words[1] = 0
    with owner.held():
        assert borrower.wanted
    assert not borrower.wanted and owner.late == 1

"""The CPU runtime's kernel sets (engine/cpu/kernels/) against the scalar reference, bit for bit.

Every x86-64 set this machine can run is built here from the one source: the scalar reference
(``-DOC_FORCE_SCALAR``), AVX2 (``-mno-avx512f``: no AVX-512 anywhere in the build, the code of
a laptop or a Zen 3 server), AVX2 with AVX-VNNI's VPDPBUSD (run through the same instruction's
EVEX form where the CPU has AVX512-VNNI: neither this CPU nor qemu has AVX-VNNI itself) and
AVX-512 (where the CPU has it). Each build's products (``oc_linear``: every weight kind, odd
row counts, a row of zeros, huge and non-finite inputs, fp32 tails), attention primitives
(``oc_kv_products``: bf16 and fp32 caches, a width with a tail) and SnakeBeta
(``oc_snake_bf16``) equal its own scalar reference (``oc_linear_ref`` etc.) bit for bit, and
so every set equals every other: integer sums are exact and the float steps are the
reference's, in its order (kernels/scalar.h). The decode step built on them then gives the
same codes on every set (tiny model, greedy and sampled, 40 frames). ARM64's NEON set is
tested the same way under qemu (tests/test_cpu_arm64.py).
"""

from __future__ import annotations

import ctypes as C

import numpy as np
import pytest
import torch

from omni_stream.engine.cpu import abi, packing
from omni_stream.engine.cpu.build import FLAGS, _cpu_flags, kernels
from omni_stream.engine.cpu.pool import Pool
from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.engine.sampling import SamplingParams
from tests.test_cpu_engine import REQS, _run

CPU = set(_cpu_flags().split())
BASE = tuple(f for f in FLAGS if f != "-march=native")
# name -> (extra flags, CPU flags it needs, the oc_isa() it must report)
SETS = {
    "scalar": (("-march=native", "-DOC_FORCE_SCALAR"), set(), "scalar"),
    "avx2": (("-march=native", "-mno-avx512f"), {"avx2", "fma", "f16c"}, "avx2+fma+f16c"),
    "avx2_vnni": (("-march=native", "-DOC_FORCE_AVX2", "-DOC_AVX2_VNNI_EVEX"),
                  {"avx2", "fma", "f16c", "avx512_vnni", "avx512vl"}, "avx2+fma+f16c+avxvnni"),
    "avx512": (("-march=native",), {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"}, "avx512+vnni"),
}
KINDS = ("q4", "q5", "q6", "q8", "q8g", "f32")


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """The sets this CPU runs, each built once: name -> library."""
    from omni_stream.engine.cpu.build import build

    out = {}
    for name, (flags, needs, _) in SETS.items():
        if needs <= CPU:
            out[name] = abi.library(str(build(tmp_path_factory.mktemp(name) / "lib.so", BASE + flags)))
    assert "scalar" in out
    return out


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy() if t.dtype == torch.float32 else t.view(torch.int16).numpy()


def _cases():
    """(kind, n, k, m, x) products at the layouts' shapes and the inputs' edges."""
    gen = torch.Generator().manual_seed(45)
    for kind in KINDS:
        for n, k, m in ((16, 64, 1), (32, 128, 2), (48, 192, 3), (16, 320, 5), (64, 1024, 8), (32, 256, 17)):
            w = torch.randn(n, k, generator=gen) * 0.05
            w[0, :5] = torch.tensor([3.0, -3.0, 0.0, 1e-30, 0.2])  # a row's range and its edges
            x = torch.randn(m, k, generator=gen) * 4
            if m >= 3:
                x[1] = 0.0                       # scale 1, every sum 0
                x[2, :3] = torch.tensor([1e30, -1e30, 1e-30])
            if m >= 5:
                x[3, k // 2] = float("nan")      # the whole row NaN, the others intact
                x[4, 0] = float("inf")
            bias = torch.randn(n, generator=gen) if m % 2 else None
            yield kind, packing.pack_weight(w, bias, kind), m, x
    for n, k in ((16, 100), (32, 17), (16, 1)):  # fp32 products with a tail past 16 lanes
        w, x = torch.randn(n, k, generator=gen), torch.randn(3, k, generator=gen)
        yield "f32", packing.pack_weight(w, None, "f32"), 3, x


def test_each_set_reports_what_it_runs(libs):
    for name, lib in libs.items():
        want = SETS[name][2]
        assert kernels(lib).startswith(want), (name, kernels(lib))
        assert lib.oc_isa_level() == {"scalar": 0, "avx2": 1, "avx2_vnni": 1, "avx512": 2}[name]
    if "avx512" in libs and "gfni" in CPU:
        assert "+gfni" in kernels(libs["avx512"])


def test_every_set_gives_the_references_products_bit_for_bit(libs):
    pools = {name: Pool(2, lib=lib) for name, lib in libs.items()}
    checked = cases = 0
    for kind, pk, m, x in _cases():
        cases += 1
        got = {}
        for name, lib in libs.items():
            y, r = torch.empty(m, pk.n), torch.empty(m, pk.n)
            lib.oc_linear(pools[name].handle, C.byref(pk.struct), x.data_ptr(), m, y.data_ptr())
            lib.oc_linear_ref(C.byref(pk.struct), x.data_ptr(), m, r.data_ptr())
            assert np.array_equal(_bits(y), _bits(r)), (name, kind, pk.n, pk.k, m)
            got[name] = _bits(y)
            checked += 1
        first = next(iter(got.values()))
        for name, bits in got.items():  # one result whatever the set
            assert np.array_equal(bits, first), (name, kind, pk.n, pk.k, m)
        if kind != "f32" and m >= 5:  # a non-finite input row is NaN throughout, the rest finite
            y = torch.from_numpy(first).view(torch.float32)
            assert bool(torch.isnan(y[3]).all() & torch.isnan(y[4]).all())
            assert bool(torch.isfinite(y[[0, 1, 2]]).all())
    assert cases == len(KINDS) * 6 + 3 and checked == len(libs) * cases


@pytest.mark.parametrize("bf16", [0, 1])
def test_attention_primitives_are_the_references_on_every_set(libs, bf16):
    gen = torch.Generator().manual_seed(7 + bf16)
    for d, n in ((128, 37), (72, 5), (16, 1), (3, 2)):
        q = torch.randn(d, generator=gen)
        kv = torch.randn(n, d, generator=gen) * 3
        kv[0, 0] = float("inf") if d > 16 else 1e30
        kv = kv.bfloat16() if bf16 else kv
        a = torch.softmax(torch.randn(n, generator=gen), 0)
        results = []
        for name, lib in libs.items():
            for use_ref in (0, 1):
                dots, out = torch.empty(n), torch.full((d,), 0.25)
                lib.oc_kv_products(use_ref, q.data_ptr(), kv.data_ptr(), bf16, d, n, a.data_ptr(),
                                   dots.data_ptr(), out.data_ptr())
                results.append((name, use_ref, _bits(dots), _bits(out)))
        for name, use_ref, dots, out in results:
            assert np.array_equal(dots, results[0][2]) and np.array_equal(out, results[0][3]), (name, use_ref, d)
        ref_dots = kv.float()[1:] @ q  # and it is the dot product (to float rounding)
        torch.testing.assert_close(torch.from_numpy(results[0][2]).view(torch.float32)[1:], ref_dots,
                                   rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_snake_is_the_references_on_every_set(libs, dtype):
    """Every set's SnakeBeta (bf16 and fp32) equals the scalar reference's bit for bit, at every
    row length (the vector sets' partial last vectors) and on the edges: +-0, +-inf, NaN, the
    reduction's limit (4095, 4096: past it std::sin), 1e30, tiny values; the fp32 one is
    within 4 float32 steps of float64's x + sin(alpha x)^2 / beta where the polynomial runs
    (steps of the larger of the result and of alpha x / beta: alpha x itself is rounded to
    float32 first, as in torch's fp32 ops)."""
    g = torch.Generator().manual_seed(3)
    c = 3
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 4096.0,
                          4095.0, 1e-30, 3.14159, -3.14159, 1e5, -7e4, 2.0 ** -126, 65504.0])
    alpha, inv_beta = torch.linspace(0.1, 20, c), torch.linspace(0.05, 3, c)
    for t in (1, 7, 8, 15, 16, 17, 33, 4099):
        x = (torch.randn(1, c, t, generator=g) * torch.logspace(-3, 3, t)[None, None])
        x[0, 0, :min(t, len(edges))] = edges[:t]
        x = x.to(dtype)
        outs = []
        for name, lib in libs.items():
            fns = ((lib.oc_snake_bf16, lib.oc_snake_bf16_ref) if dtype == torch.bfloat16
                   else (lib.oc_snake_f32, lib.oc_snake_f32_ref))
            for fn in fns:
                y = torch.empty_like(x)
                fn(x.data_ptr(), y.data_ptr(), alpha.data_ptr(), inv_beta.data_ptr(), c, c, t)
                outs.append((name, _bits(y)))
        for name, bits in outs:
            assert np.array_equal(bits, outs[0][1]), (name, t)
        if dtype == torch.float32:
            y = torch.from_numpy(outs[0][1]).view(torch.float32).double()
            xd = x.double()
            ref = xd + inv_beta.double()[None, :, None] * torch.sin(xd * alpha.double()[None, :, None]) ** 2
            v = (xd * alpha.double()[None, :, None]).abs()
            poly = v < 4096
            scale = torch.maximum(ref.abs(), v * inv_beta.double()[None, :, None]).clamp_min(2.0 ** -20)
            assert bool(((y - ref).abs() <= 4 * 2.0 ** -24 * scale)[poly].all())


def _codes(model, lib, monkeypatch, kinds, params, frames) -> np.ndarray:
    """[streams, frames, 16] codes of test_cpu_engine's two streams (one prefilled in two
    pieces) decoded on ``lib``'s kernels."""
    monkeypatch.setattr(abi, "ensure_library", lambda: lib)
    eng = FrameEngine(model.weights.talker, EngineShape(max_slots=len(REQS), max_seq_len=256))
    eng.use_native(*kinds, threads=2)
    return np.stack(_run(model, eng, params, [11, 12], frames))


@pytest.mark.parametrize("params", [SamplingParams.greedy(), SamplingParams()], ids=["greedy", "sampled"])
def test_the_decode_gives_the_same_codes_on_every_set(tiny_model, libs, monkeypatch, params):
    """The talker step and the code predictor's frame (norms, rotary, attention over the KV
    cache, products, sampling) on each set: the same codes over 40 frames of two streams, at
    int8 (q8) talker with a q8g code predictor, and at q4 / q6."""
    for kinds in (("q8", "q8g"), ("q4", "q6")):
        ref = None
        for name, lib in libs.items():
            if name == "scalar" and kinds != ("q8", "q8g"):
                continue  # the reference is slow; one plan of it is enough
            got = _codes(tiny_model, lib, monkeypatch, kinds, params, 40)
            assert got.shape == (len(REQS), 40, 16) and got.min() >= 0
            if ref is None:
                ref = got
            np.testing.assert_array_equal(got, ref, err_msg=f"{name} {kinds}")

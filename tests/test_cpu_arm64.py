"""The CPU runtime's ARM64 NEON kernel set (engine/cpu/kernels/neon.h) against the host's scalar
reference, bit for bit, under qemu.

tests/native/kernel_check.cpp (which includes omni_cpu.cpp whole) is cross-compiled with
``aarch64-linux-gnu-g++`` for three targets: plain ARMv8 NEON (widening multiplies), ARMv8.2
with the dot-product extension (SDOT) and ARMv8.6 with int8 matrix multiply (SMMLA for tiles of
4 rows), and run by ``qemu-aarch64`` as CPU models that have and lack those features. It reads
one file of cases written here: products of every weight kind as the real packer packs them on
this machine (q4 at the packer's group and at 32 / 128, q5, q6, q8, q8g, f32 with tails), at
several shapes and 1, 2, 3, 5, 8, 17 rows with a row of zeros, huge values, a NaN and an inf
row (the runtime makes a non-finite row NaN), tiny and integer rows; the attention's
primitives over a bf16 and an fp32 cache (widths 128, 37, 20); SnakeBeta at its edges (+-0,
+-inf, NaN, 1e30, 4096, 4080, tiny, a bf16 tie, row tails) over bf16 and over fp32. It writes
each through the ARM build's kernel set (``oc_linear`` on a pool of 1 or 2 threads,
``oc_kv_products``, ``oc_snake_bf16`` / ``oc_snake_f32``, also in place) and through its own
scalar reference. Both must equal the host's reference (this
machine's build of the same source, ``oc_linear_ref`` etc.) bit for bit: float32 compared as
int32 bits, NaN at the same places.

One exception: SnakeBeta's elements with ``!(|alpha x| < 4096)`` take ``std::sin``, whose last
bit may differ between glibc's aarch64 and x86-64 ``sinf``; those elements are compared to
within one bf16 step (fp32: 4 ulps), NaN where the host has NaN, every other element bit for
bit.

Needs ``aarch64-linux-gnu-g++`` and ``qemu-aarch64`` (Debian: g++-aarch64-linux-gnu,
qemu-user; ``bash scripts/setup.sh`` installs them). Without them the tests skip, except in CI
(``CI=true``), where they fail.
"""

from __future__ import annotations

import ctypes as C
import os
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_stream.engine.cpu import abi, packing

pytestmark = pytest.mark.arm64

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "native" / "kernel_check.cpp"
CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
FLAGS = ("-static", "-std=c++17", "-ffp-contract=off", "-fno-math-errno")
# build -> (its -march and optimization, the oc_isa() it reports); the SDOT build at the
# runtime's own -O3 (engine/cpu/build.py)
BUILDS = {
    "neon": (("-march=armv8-a", "-O2"), "neon"),
    "dotprod": (("-march=armv8.2-a+dotprod", "-O3"), "neon+dotprod"),
    "i8mm": (("-march=armv8.6-a+i8mm+dotprod", "-O2"), "neon+dotprod+i8mm"),
}
# (build, qemu CPU model): cortex-a53 (Raspberry Pi 3: ARMv8.0, no SDOT), cortex-a76
# (Raspberry Pi 5 / Graviton 2's core: SDOT, no I8MM), max (every feature qemu has, I8MM too)
RUNS = [("neon", "cortex-a53"), ("neon", "max"), ("dotprod", "cortex-a76"), ("dotprod", "max"),
        ("i8mm", "max")]
# builds that must not run on a model without their feature (qemu enforces the model's
# features, and the build runs the instruction: SDOT for any product, SMMLA for 4-row tiles)
REFUSED = [("dotprod", "cortex-a72"), ("i8mm", "cortex-a76")]

KINDS = packing.KINDS
ROWS = (1, 2, 3, 5, 8, 17)


# ---------------------------------------------------------------- tools and builds
@pytest.fixture(scope="session")
def arm_tools() -> tuple[str, str]:
    cxx, qemu = shutil.which(CXX), shutil.which(QEMU)
    if not (cxx and qemu):
        missing = " and ".join(t for t, p in ((CXX, cxx), (QEMU, qemu)) if not p)
        msg = f"{missing} not installed (Debian: g++-aarch64-linux-gnu, qemu-user): run bash scripts/setup.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return cxx, qemu


@pytest.fixture(scope="session")
def arm_drivers(arm_tools, tmp_path_factory) -> dict[str, Path]:
    """kernel_check cross-compiled once per session for each build (in parallel)."""
    cxx, _ = arm_tools
    out = tmp_path_factory.mktemp("arm64")
    procs = {}
    for name, (flags, _) in BUILDS.items():
        exe = out / f"kernel_check-{name}"
        cmd = [cxx, *FLAGS, *flags, "-o", str(exe), str(DRIVER)]
        procs[name] = (exe, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                  text=True))
    built = {}
    for name, (exe, cmd, p) in procs.items():
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{log[-4000:]}"
        assert "warning" not in log, log[-4000:]
        built[name] = exe
    return built


# ---------------------------------------------------------------- cases (file format: kernel_check.cpp)
def _raw(a) -> bytes:
    if a is None:
        return b""
    if isinstance(a, torch.Tensor):
        a = a.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(a).tobytes()


def _record(kind: int, arrays) -> bytes:
    out = [struct.pack("<II", kind, len(arrays))]
    for a in arrays:
        b = _raw(a)
        out += [struct.pack("<Q", len(b)), b]
    return b"".join(out)


def _read_records(data: bytes) -> list[tuple[int, list[bytes]]]:
    magic, n = struct.unpack_from("<II", data, 0)
    assert magic == 0x3152434F, "not a kernel_check result (OCR1)"
    pos, recs = 8, []
    for _ in range(n):
        kind, narr = struct.unpack_from("<II", data, pos)
        pos += 8
        arrays = []
        for _ in range(narr):
            (length,) = struct.unpack_from("<Q", data, pos)
            arrays.append(data[pos + 8: pos + 8 + length])
            pos += 8 + length
        recs.append((kind, arrays))
    assert pos == len(data)
    return recs


def _product_arrays(pk: packing.PackedLinear, group: int | None = None, gen=None):
    """The struct's arrays in kernel_check's order (w, scales, row_scale, row_sum, wf, bias);
    ``group``: q4 codes as packed, with random scales and offsets per group of that size."""
    s, ts = pk.struct, list(pk.tensors)
    bias = ts.pop(0) if s.bias else None
    w = scales = rscale = rsum = wf = None
    if s.kind == KINDS["f32"]:
        (wf,) = ts
    elif s.kind == KINDS["q8"]:
        w, rscale, rsum = ts
    else:
        w, scales = ts
        if group is not None and group != s.group:
            ng = s.k // group
            sc = torch.rand(s.n // 16, ng, 1, 16, generator=gen) * 0.02 + 1e-3
            mn = -torch.rand(s.n // 16, ng, 1, 16, generator=gen) * 0.2
            scales = torch.cat((sc, mn), dim=2).half().contiguous()
    return [w, scales, rscale, rsum, wf, bias]


def _rows(m: int, k: int, gen) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen) * 4
    extremes = [
        lambda r: r.zero_(),                                            # scale 1, sums 0
        lambda r: r.__setitem__(slice(0, 3), torch.tensor([1e30, -3e38, 1e-30])[: r.numel()]),
        lambda r: r.__setitem__(r.numel() // 2, float("nan")),          # the row NaN
        lambda r: r.__setitem__(0, float("inf")),
        lambda r: r.mul_(1e-39),                                        # subnormal inputs
        lambda r: r.__setitem__(-1, 1e4),                               # one outlier
        lambda r: r.round_(),                                           # integers
    ]
    for i, f in enumerate(extremes[: max(0, m - 1)]):
        f(x[i + 1])
    return x


def _products(gen):
    """(label, kind, n, k, group, m, threads, arrays-without-x, x) per product case."""
    shapes = {
        "q4": ((16, 64), (32, 256), (48, 320)), "q5": ((16, 64), (32, 192), (48, 320)),
        "q6": ((16, 64), (32, 192), (48, 320)), "q8g": ((16, 64), (32, 192), (48, 320)),
        "q8": ((16, 16), (32, 80), (48, 336)), "f32": ((19, 100), (16, 7), (32, 256), (16, 33)),
    }
    i = 0
    for kind, sh in shapes.items():
        for n, k in sh:
            w = torch.randn(n, k, generator=gen) * 0.05
            w[0, :5] = torch.tensor([3.0, -3.0, 0.0, 1e-30, 0.2])     # a row's range and its edges
            w[1, : min(k, 64)] = 0.0                                  # an all-zero group
            w[2] = torch.randn(k, generator=gen) * torch.randn(k, generator=gen).exp() * 0.05  # heavy tails
            bias = torch.randn(n, generator=gen) if (n + k) % 2 else None
            pk = packing.pack_weight(w, bias, kind)
            assert pk.struct.kind == KINDS[kind], (kind, n, k)
            groups = [None]
            if kind == "q4" and k % 128 == 0:
                groups = [None, 32, 128]
            for group in groups:
                arrays = _product_arrays(pk, group, gen)
                for m in ROWS:
                    i += 1
                    g = group or pk.struct.group
                    yield (f"{kind} n={n} k={k} group={g} m={m}", KINDS[kind], n, k, g, m, 1 + i % 2,
                           arrays, _rows(m, k, gen))


def _kv_cases(gen):
    for bf16 in (0, 1):
        for d, n in ((128, 7), (37, 5), (20, 3)):
            q = torch.randn(d, generator=gen)
            kv = torch.randn(n, d, generator=gen) * 3
            kv[0, 0] = float("inf")
            kv[1, :4] = torch.tensor([1e30, -1e30, 1e-40, -0.0])
            kv = kv.bfloat16() if bf16 else kv
            a = torch.softmax(torch.randn(n, generator=gen), 0)
            a[-1] = -2.5
            out0 = torch.randn(d, generator=gen)
            yield f"kv bf16={bf16} d={d} n={n}", bf16, d, n, q, kv, a, out0


SNAKE_EDGES = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 4096.0, -4096.0,
               4080.0, -4080.0, 1e-30, 1e-40, 2.0 ** -126, 3.14159, -3.14159, 1e5, 65504.0]


def _snake_cases(gen):
    c = 4
    # channel 3: x = 256 gives v = pi / 2, sin^2 = 1 and y = 257, halfway between two bf16
    # values (rounded to the even one, 256)
    alpha = torch.tensor([1.0, 0.37, 17.0, float(np.float32(np.pi / 512))])
    inv_beta = torch.tensor([0.8, 2.5, 0.05, 1.0])
    for rows, t in ((4, 45), (8, 8), (4, 3), (4, 261)):
        x = torch.randn(rows, t, generator=gen) * torch.logspace(-3, 3, t)[None]
        for r in range(rows):
            e = SNAKE_EDGES[r % 2:][:t]
            x[r, : len(e)] = torch.tensor(e)
        x[3::c, -1] = 256.0
        yield f"snake rows={rows} t={t}", rows, c, t, x.bfloat16(), alpha, inv_beta
        x = x + torch.randn(rows, t, generator=gen) * 1e-3 * x.abs()  # fp32: bits past bf16's
        if t > 200:  # channel 0 (alpha 1): v / pi halfway between integers, k to the even one
            ties = _halfway()
            x[0, 20: 20 + len(ties)] = ties
        yield f"snake fp32 rows={rows} t={t}", rows, c, t, x, alpha, inv_beta


def _halfway() -> torch.Tensor:
    """fp32 values v (+-) with v * (1 / pi) exactly k + 1/2 in float32 (k < 40): the reduction
    rounds k to even (nearbyint, vrndnq_f32), not away from zero."""
    inv, out = np.float32(0.318309886183790671), []  # kernels/scalar.h kInvPi
    for k in range(40):
        u = np.float32((k + 0.5) * np.pi).view(np.int32)
        for d in range(-64, 65):
            v = np.int32(u + d).view(np.float32)
            if np.float32(v * inv) == np.float32(k + 0.5):
                out += [v, -v]
                break
    return torch.from_numpy(np.array(out, dtype=np.float32))


# ---------------------------------------------------------------- the host's expectations
def _declare(lib) -> None:
    lib.oc_isa.restype = C.c_char_p
    lib.oc_linear_ref.argtypes = [C.POINTER(abi.OcLinear), C.c_void_p, C.c_int32, C.c_void_p]
    lib.oc_kv_products.argtypes = [C.c_int32, C.c_void_p, C.c_void_p, C.c_int32, C.c_int32, C.c_int32,
                                   C.c_void_p, C.c_void_p, C.c_void_p]
    lib.oc_snake_bf16_ref.argtypes = lib.oc_snake_f32_ref.argtypes = [
        C.c_void_p, C.c_void_p, C.c_void_p, C.c_void_p, C.c_int64, C.c_int32, C.c_int64]


def _struct(kind, n, k, group, arrays) -> tuple[abi.OcLinear, list[np.ndarray]]:
    keep = [None if a is None else np.frombuffer(_raw(a), dtype=np.uint8).copy() for a in arrays]
    p = [None if a is None else a.ctypes.data for a in keep]
    s = abi.OcLinear(kind=kind, n=n, k=k, group=group, w=p[0], scales=p[1], row_scale=p[2],
                     row_sum=p[3], wf=p[4], bias=p[5])
    return s, keep


@pytest.fixture(scope="session")
def arm_cases(tmp_path_factory):
    """The case file for kernel_check and, per case, (label, what it must give: arrays as the
    host's reference computes them, a mask of SnakeBeta's std::sin elements or None)."""
    lib = abi.library()
    _declare(lib)
    gen = torch.Generator().manual_seed(45)
    records, expect = [], []
    for label, kind, n, k, group, m, threads, arrays, x in _products(gen):
        s, _keep = _struct(kind, n, k, group, arrays)
        y = torch.empty(m, n)
        lib.oc_linear_ref(C.byref(s), x.data_ptr(), m, y.data_ptr())
        params = np.array([kind, n, k, group, m, threads], dtype=np.int64)
        records.append(_record(1, [params, *arrays, x]))
        expect.append((label, "product", [y.numpy().copy()], None))
    for label, bf16, d, n, q, kv, a, out0 in _kv_cases(gen):
        dots, out = torch.empty(n), out0.clone()
        lib.oc_kv_products(1, q.data_ptr(), kv.data_ptr(), bf16, d, n, a.data_ptr(), dots.data_ptr(),
                           out.data_ptr())
        records.append(_record(2, [np.array([bf16, d, n], dtype=np.int64), q, kv, a, out0]))
        expect.append((label, "kv", [dots.numpy().copy(), out.numpy().copy()], None))
    for label, rows, c, t, x, alpha, inv_beta in _snake_cases(gen):
        bf16 = x.dtype == torch.bfloat16
        y = torch.empty_like(x)
        fn = lib.oc_snake_bf16_ref if bf16 else lib.oc_snake_f32_ref
        fn(x.data_ptr(), y.data_ptr(), alpha.data_ptr(), inv_beta.data_ptr(), rows, c, t)
        ch = torch.arange(rows) % c
        v = (x.float() * alpha[ch][:, None]).numpy()  # float32 products, as the kernel's
        with np.errstate(invalid="ignore"):
            libm = ~(np.abs(v) < 4096.0)
        records.append(_record(3 if bf16 else 4, [np.array([rows, c, t], dtype=np.int64), x, alpha, inv_beta]))
        want = y.view(torch.int16) if bf16 else y
        expect.append((label, "snake" if bf16 else "snake_f32", [want.numpy().copy()], libm.reshape(-1)))
    path = tmp_path_factory.mktemp("arm64-cases") / "cases.bin"
    path.write_bytes(struct.pack("<II", 0x314B434F, len(records)) + b"".join(records))
    return path, expect


# ---------------------------------------------------------------- comparing
def _same_f32(got: bytes, want: np.ndarray, what: str, libm: np.ndarray | None = None) -> None:
    """Bit for bit (NaN as NaN), except elements of ``libm`` (std::sin): within 4 ulps."""
    g = np.frombuffer(got, dtype=np.float32)
    assert g.shape == want.reshape(-1).shape, what
    w = want.reshape(-1)
    gn, wn = np.isnan(g), np.isnan(w)
    bad = (gn != wn) | (~gn & (g.view(np.int32) != w.view(np.int32)))
    if libm is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            near = np.abs(g.astype(np.float64) - w) <= 4 * np.spacing(np.abs(w))
        bad &= ~(libm & ~gn & ~wn & np.isfinite(w) & near)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {g.size} differ; first at {i}: "
                             f"got {g[i]!r} ({g.view(np.int32)[i]:#x}), want {w[i]!r} ({w.view(np.int32)[i]:#x})")


def _bf16_float(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _same_bf16(got: bytes, want: np.ndarray, libm: np.ndarray, what: str) -> None:
    """Bit for bit, except elements of ``libm`` (std::sin): within one bf16 step, NaN as NaN."""
    g, w = np.frombuffer(got, dtype=np.int16), want.reshape(-1)
    assert g.shape == w.shape, what
    gf, wf = _bf16_float(g), _bf16_float(w)
    gn, wn = np.isnan(gf), np.isnan(wf)
    exact = ~libm & (g != w) & ~(gn & wn)
    step = (g.astype(np.int32) - w.astype(np.int32))
    near = libm & ((gn != wn) | (~wn & ((np.abs(step) > 1) | (np.sign(gf) != np.sign(wf)))))
    bad = exact | near
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {g.size} differ (std::sin element: {bool(libm[i])}); "
                             f"first at {i}: got {gf[i]!r} ({int(g[i]) & 0xffff:#06x}), want {wf[i]!r} ({int(w[i]) & 0xffff:#06x})")


def _run(qemu: str, cpu: str, exe: Path, cases: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([qemu, "-cpu", cpu, str(exe), str(cases), str(out)], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="session")
def arm_results(arm_tools, arm_drivers, arm_cases, tmp_path_factory):
    """Every run of RUNS and REFUSED (two at a time): (build, cpu) -> (process, output path)."""
    _, qemu = arm_tools
    cases, _ = arm_cases
    out = tmp_path_factory.mktemp("arm64-out")

    def one(run):
        build, cpu = run
        path = out / f"{build}-{cpu}.bin"
        return run, (_run(qemu, cpu, arm_drivers[build], cases, path), path)

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as ex:
        return dict(ex.map(one, RUNS + REFUSED))


# ---------------------------------------------------------------- tests
def _check(path: Path, expect, tag: str, isa: str) -> None:
    """kernel_check's results in ``path`` against the host's reference: its oc_isa() and every
    case through its kernel set and its scalar reference."""
    recs = _read_records(path.read_bytes())
    assert recs[0][0] == 0 and recs[0][1][0].decode() == isa, (tag, recs[0][1][0])
    assert len(recs) == len(expect) + 1
    counts = {"product": 0, "kv": 0, "snake": 0, "snake_f32": 0}
    for (kind, arrays), (label, what, want, libm) in zip(recs[1:], expect):
        counts[what] += 1
        where = f"{tag}, {label}"
        if what == "product":
            assert kind == 1
            y, y_ref = arrays
            _same_f32(y_ref, want[0], f"{where}: the reference")
            _same_f32(y, want[0], f"{where}: the kernels")
        elif what == "kv":
            assert kind == 2
            dots, out, dots_ref, out_ref = arrays
            _same_f32(dots_ref, want[0], f"{where}: reference dots")
            _same_f32(out_ref, want[1], f"{where}: reference axpy")
            _same_f32(dots, want[0], f"{where}: dots")
            _same_f32(out, want[1], f"{where}: axpy")
        elif what == "snake":
            assert kind == 3
            y, y_in_place, y_ref = arrays
            _same_bf16(y_ref, want[0], libm, f"{where}: the reference")
            _same_bf16(y, want[0], libm, f"{where}: the kernel")
            assert y_in_place == y, f"{where}: in place"
        else:
            assert kind == 4
            y, y_in_place, y_ref = arrays
            _same_f32(y_ref, want[0], f"{where}: the reference", libm)
            _same_f32(y, want[0], f"{where}: the kernel", libm)
            assert y_in_place == y, f"{where}: in place"
    assert counts == {"product": counts["product"], "kv": 6, "snake": 4, "snake_f32": 4} and counts["product"] > 100


@pytest.mark.parametrize("build,cpu", RUNS, ids=[f"{b}-{c}" for b, c in RUNS])
def test_arm64_kernels_are_the_host_reference_bit_for_bit(build, cpu, arm_results, arm_cases):
    """One run of kernel_check under qemu: the build's oc_isa(), then every case through its
    kernel set and its scalar reference, each equal to the host's reference."""
    proc, path = arm_results[(build, cpu)]
    assert proc.returncode == 0, f"{build} on {cpu}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    _check(path, arm_cases[1], f"{build} on {cpu}", BUILDS[build][1])


def test_arm64_builds_need_their_features(arm_results):
    """The qemu models lack what they should (cortex-a72: no SDOT, cortex-a76: no SMMLA), and
    the builds run those instructions: each stops on an illegal instruction."""
    for run in REFUSED:
        proc, _ = arm_results[run]
        assert proc.returncode != 0, f"{run} ran to the end: the model has the feature or the build does not use it"
        assert proc.returncode in (-4, 132) or "Illegal instruction" in proc.stderr, (run, proc.returncode,
                                                                                     proc.stderr[-2000:])


def test_the_driver_runs_on_the_host(arm_cases, tmp_path):
    """kernel_check builds and runs natively too (to debug a case without qemu): this machine's
    kernel set and reference give the same results."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    exe, out = tmp_path / "kernel_check", tmp_path / "out.bin"
    r = subprocess.run([cxx, "-O1", "-march=native", "-std=c++17", "-ffp-contract=off", "-fno-math-errno",
                        "-o", str(exe), str(DRIVER), "-lpthread"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(exe), str(arm_cases[0]), str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lib = abi.library()
    _declare(lib)
    _check(out, arm_cases[1], "host", lib.oc_isa().decode())

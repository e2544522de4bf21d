"""Python side of the CPU runtime: weight packing, ctypes mirrors of its structs, and the runner
the frame engine calls instead of torch ops.

``NativeRunner`` runs the same decode step as ``DecoderStack.forward`` (the one formulation:
``models/layers.py``) inside ``omni_cpu.cpp``: the talker's step for every row in one call, the
code predictor's whole frame (2-token prefill, 14 single-token steps, 15 heads and draws) in
another, prefill pieces in a third. It reads and writes the engine's own tensors (KV caches,
seeds, counters, sampling settings) through their data pointers, so the engine's bookkeeping,
the stages and the tests see one engine whichever runtime computes it.

Weight kinds (``kind``), one per product: ``q4`` / ``q5`` / ``q6`` / ``q8g`` unsigned 4- to 8-bit codes with a
per-(row, group of 64 inputs) fp16 scale and offset, the range of each group clipped where that
lowers its squared error; ``q8`` signed bytes with a per-row scale; ``f32`` the exact weights.
Each product quantizes its input rows to int8 (per row); see the C file for the layouts. A
weight that is not finite is refused at packing (it would poison every row that reads it).
"""

from __future__ import annotations

import contextlib
import ctypes as C
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from omni_stream.engine.cpu.build import ensure_library

log = logging.getLogger(__name__)

KINDS = {"q4": 0, "q8": 1, "f32": 2, "q6": 3, "q5": 4, "q8g": 5}
Q4_GROUP = 64  # inputs per scale of q4 and q6
LEVELS = {"q4": 15, "q5": 31, "q6": 63, "q8g": 255}  # largest code of the affine kinds
# range fractions tried per group (least error wins): at 4 bits clipping a far weight often
# pays (~4 % less squared error on Student-t weights); at 6 bits the full range nearly always
# wins, so the search (~10x the packing time) is kept where it pays
CLIPS = {"q4": (1.0, 0.95, 0.9, 0.85, 0.8, 0.75), "q5": (1.0, 0.95, 0.9), "q6": (1.0,), "q8g": (1.0,)}


# ------------------------------------------------------------------------------ C mirrors
class OcLinear(C.Structure):
    _fields_ = [("kind", C.c_int32), ("n", C.c_int32), ("k", C.c_int32), ("group", C.c_int32),
                ("w", C.c_void_p), ("scales", C.c_void_p), ("row_scale", C.c_void_p),
                ("row_sum", C.c_void_p), ("wf", C.c_void_p), ("bias", C.c_void_p)]


class OcLayer(C.Structure):
    _fields_ = [("qkv", OcLinear), ("o", OcLinear), ("gate_up", OcLinear), ("down", OcLinear),
                ("ln1", C.c_void_p), ("ln2", C.c_void_p), ("q_norm", C.c_void_p),
                ("k_norm", C.c_void_p)]


class OcStack(C.Structure):
    _fields_ = [("layers", C.c_int32), ("hidden", C.c_int32), ("heads", C.c_int32),
                ("kv_heads", C.c_int32), ("head_dim", C.c_int32), ("ffn", C.c_int32),
                ("eps", C.c_float), ("layer", C.POINTER(OcLayer)), ("norm", C.c_void_p)]


class OcCache(C.Structure):
    _fields_ = [("k", C.POINTER(C.c_void_p)), ("v", C.POINTER(C.c_void_p)), ("length", C.c_int32),
                ("bf16", C.c_int32)]


class OcSampling(C.Structure):
    _fields_ = [("greedy", C.c_void_p), ("top_k", C.c_void_p), ("temperature", C.c_void_p),
                ("top_p", C.c_void_p), ("seed", C.c_void_p), ("counter", C.c_void_p)]


class OcCodePredictor(C.Structure):
    _fields_ = [("stack", OcStack), ("cache", OcCache), ("heads", C.POINTER(OcLinear)),
                ("proj", C.POINTER(OcLinear)), ("talker_codec_emb", C.c_void_p),
                ("cp_emb", C.POINTER(C.c_void_p)), ("emb_bf16", C.c_int32),
                ("talker_hidden", C.c_int32), ("talker_vocab", C.c_int32),
                ("cp_vocab", C.c_int32), ("groups", C.c_int32), ("cos_tab", C.c_void_p),
                ("sin_tab", C.c_void_p)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _lib(path: str | None = None) -> C.CDLL:
    """The runtime library with its argument types declared (``path``: another build)."""
    lib = C.CDLL(path) if path else ensure_library()
    if not getattr(lib, "_omni_typed", False):
        lib.oc_pool_create.restype = C.c_void_p
        lib.oc_pool_create.argtypes = [C.c_int32]
        lib.oc_pool_destroy.argtypes = [C.c_void_p]
        lib.oc_linear.argtypes = [C.c_void_p, C.POINTER(OcLinear), C.c_void_p, C.c_int32, C.c_void_p]
        lib.oc_stack_step.argtypes = [C.c_void_p, C.POINTER(OcStack), C.POINTER(OcCache), C.c_int32,
                                      C.c_void_p, C.c_void_p, C.c_void_p, C.c_void_p, C.c_void_p]
        lib.oc_sample.argtypes = [C.c_void_p, C.c_int32, C.c_int32, C.POINTER(OcSampling), C.c_void_p]
        lib.oc_code_predictor_frame.argtypes = [C.c_void_p, C.POINTER(OcCodePredictor), C.c_int32,
                                                C.c_void_p, C.c_void_p, C.POINTER(OcSampling),
                                                C.c_void_p]
        lib.oc_pool_create_lent.restype = C.c_void_p
        lib.oc_pool_create_lent.argtypes = [C.c_int32, C.c_int32, C.c_void_p]
        lib.oc_pool_set_lease.argtypes = [C.c_void_p, C.c_void_p]
        lib.oc_pool_jobs.argtypes = [C.c_void_p, C.POINTER(C.c_uint64), C.POINTER(C.c_uint64)]
        lib.oc_lease_acquire.restype = C.c_int32
        lib.oc_lease_acquire.argtypes = [C.c_void_p, C.c_int64]
        lib.oc_lease_release.argtypes = [C.c_void_p]
        lib.oc_has_amx.restype = C.c_int32
        lib.oc_snake_bf16.argtypes = [C.c_void_p, C.c_void_p, C.c_void_p, C.c_void_p, C.c_int64,
                                      C.c_int32, C.c_int64]
        lib._omni_typed = True
    return lib


def snake_kernel(lib: C.CDLL | None = None):
    """Code2Wav's SnakeBeta in one pass (``oc_snake_bf16``) as ``fn(x, alpha, inv_beta) -> y``
    for bf16 x [B, C, T] and fp32 per-channel alpha = exp(log alpha) and inv_beta = 1 / (exp(log
    beta) + 1e-9); for ``Code2Wav.pack(snake=...)``."""
    lib = lib or _lib()

    def snake(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 3:
            raise ValueError(f"the snake kernel takes bf16 [batch, channels, time], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        y = torch.empty_like(x)
        lib.oc_snake_bf16(x.data_ptr(), y.data_ptr(), alpha.data_ptr(), inv_beta.data_ptr(),
                          x.shape[0] * x.shape[1], x.shape[1], x.shape[2])
        return y

    return snake


class Pool:
    """The runtime's worker threads (the caller plus ``threads - 1`` spinning workers).

    ``lent_cpus``: extra workers, one pinned to each of these CPUs, that belong to another
    process (the codec stage) and join a job only while that process does not hold the
    ``lease`` (a :class:`CoreLease`; see ``oc_pool.h``). Results do not depend on which
    threads ran a job."""

    def __init__(self, threads: int, lib: C.CDLL | None = None, *,
                 lent_cpus: tuple[int, ...] = (), lease: "CoreLease | None" = None) -> None:
        self.lib = lib or _lib()
        own = max(1, int(threads))
        self.threads = own + len(lent_cpus)
        if self.threads > 255:
            raise ValueError(f"the CPU runtime runs at most 255 threads, got {self.threads}")
        if lent_cpus:
            cpus = (C.c_int32 * self.threads)(*([-1] * own + [int(c) for c in lent_cpus]))
            self.handle = self.lib.oc_pool_create_lent(self.threads, len(lent_cpus), cpus)
        else:
            self.handle = self.lib.oc_pool_create(self.threads)
        self.lease = lease  # kept alive as long as the pool reads it
        if lease is not None:
            self.lib.oc_pool_set_lease(self.handle, lease.address)

    def jobs(self) -> tuple[int, int]:
        """(jobs run on the pool's own threads only, jobs run with the lent ones) so far."""
        own, lent = C.c_uint64(), C.c_uint64()
        self.lib.oc_pool_jobs(self.handle, C.byref(own), C.byref(lent))
        return own.value, lent.value

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self.lib.oc_pool_destroy(self.handle)
            self.handle = None


class CoreLease:
    """Two int32 words in shared memory by which a process lends its cores to a native pool
    while it is idle: ``with lease.held():`` around the owner's own work takes them back (waits
    for the pool's job in flight, at most ``timeout_s``).

    ``CoreLease.open(path, offset)`` maps the words from a file both processes can open (a
    ring's segment: ``transport.ring.LEASE_OFF``) with a mapping of its own, so the lease
    outlives and never pins the ring's mapping; ``CoreLease()`` keeps them in private memory
    (one process, tests)."""

    def __init__(self, buffer=None, lib: C.CDLL | None = None, timeout_s: float = 0.005) -> None:
        self._map = None
        self._words = (C.c_int32 * 2)() if buffer is None else (C.c_int32 * 2).from_buffer(buffer)
        self.address = C.addressof(self._words)
        self.lib = lib or _lib()
        self.timeout_us = int(timeout_s * 1e6)
        self.late = 0  # acquisitions that went ahead after the timeout

    @classmethod
    def open(cls, path: str, offset: int, **kw) -> "CoreLease":
        import mmap
        import os

        page = offset - offset % mmap.ALLOCATIONGRANULARITY
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            mm = mmap.mmap(fd, offset - page + 8, offset=page)
        finally:
            os.close(fd)
        lease = cls(memoryview(mm)[offset - page:offset - page + 8], **kw)
        lease._map = mm  # the words point into it: keep it mapped for the lease's lifetime
        return lease

    def acquire(self) -> None:
        if not self.lib.oc_lease_acquire(self.address, self.timeout_us):
            self.late += 1

    def release(self) -> None:
        self.lib.oc_lease_release(self.address)

    @property
    def wanted(self) -> bool:
        return bool(self._words[0])

    @property
    def busy(self) -> bool:
        return bool(self._words[1])

    @contextlib.contextmanager
    def held(self):
        self.acquire()
        try:
            yield self
        finally:
            self.release()


# ------------------------------------------------------------------------------ packing
@dataclass
class PackedLinear:
    """One product's packed weights; ``struct`` points into ``tensors`` (kept alive here)."""

    struct: OcLinear
    tensors: list[torch.Tensor] = field(default_factory=list)

    def dequantized(self) -> torch.Tensor:
        """The weights the kernel effectively multiplies by, fp32 [n, k] (for tests)."""
        if self._deq is None:
            raise ValueError("this product was loaded from the pack cache: repack to dequantize")
        return self._deq

    @property
    def meta(self) -> dict:
        s = self.struct
        return dict(kind=s.kind, n=s.n, k=s.k, group=s.group, bias=bool(s.bias))

    @classmethod
    def from_tensors(cls, meta: dict, tensors: list[torch.Tensor]) -> "PackedLinear":
        """A product rebuilt from what ``pack_weight`` kept (``tensors``, in its order)."""
        s = OcLinear(kind=meta["kind"], n=meta["n"], k=meta["k"], group=meta["group"])
        ts = list(tensors)
        if meta["bias"]:
            s.bias = ts.pop(0).data_ptr()
        if meta["kind"] == KINDS["f32"]:
            (w,) = ts
            s.wf = w.data_ptr()
        elif meta["kind"] in (KINDS[k] for k in LEVELS):
            w, sm = ts
            s.w, s.scales = w.data_ptr(), sm.data_ptr()
        else:
            w, scale, rsum = ts
            s.w, s.row_scale, s.row_sum = w.data_ptr(), scale.data_ptr(), rsum.data_ptr()
        out = cls(s, list(tensors))
        out._deq = None
        return out

    @property
    def n(self) -> int:
        return self.struct.n


def kind_for(n: int, k: int, kind: str) -> str:
    """The layouts need n % 16 == 0 and k % 64 == 0 (q4, q5, q6) or k % 16 == 0 (q8); else exact fp32."""
    if kind not in KINDS:
        raise ValueError(f"unknown weight kind {kind!r}: one of {', '.join(KINDS)}")
    if kind in LEVELS and (n % 16 or k % Q4_GROUP):
        return "f32"
    if kind == "q8" and (n % 16 or k % 16):
        return "f32"
    return kind


def affine_codes(w: torch.Tensor, levels: int, group: int = Q4_GROUP,
                 clips: tuple[float, ...] = CLIPS["q4"]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes q in [0, levels] and fp16-exact scale s and offset m per (row, group) of w [n, k],
    w ~ q s + m. Each group's [min, max] range is shrunk toward zero by each fraction of
    ``clips`` in turn and keeps the one of least squared error (a heavy-tailed group gives up
    its one far weight for finer steps over the rest; a Gaussian one mostly keeps the full
    range). An all-zero group gets scale 1e-8 and codes that reproduce zeros exactly."""
    n, k = w.shape
    wg = w.view(n, k // group, group)
    lo0, hi0 = wg.amin(-1), wg.amax(-1)

    def params(c) -> tuple[torch.Tensor, torch.Tensor]:  # c: a fraction, or one per group
        lo = (lo0 * c).half().float()
        return ((hi0 - lo0) * c / levels).clamp(min=1e-8).half().float(), lo

    def codes(scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        return torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, levels)

    scale, lo = params(clips[0])
    if len(clips) > 1:  # each group keeps the fraction of least squared error
        errs = []
        for c in clips:
            sc, mn = params(c)
            errs.append(((codes(sc, mn) * sc[..., None] + mn[..., None] - wg) ** 2).sum(-1))
        scale, lo = params(torch.tensor(clips, dtype=w.dtype)[torch.stack(errs).argmin(0)])
    return codes(scale, lo).to(torch.uint8).view(n, k), scale, lo


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """The low nibbles of codes [n, k] in the q4 layout [n / 16, k / 8, 64]."""
    n, k = q.shape
    qb = (q & 15).view(n // 16, 16, k // 8, 2, 4)  # [block, row, k-quad pair, quad of the pair, i]
    packed = (qb[:, :, :, 0] | (qb[:, :, :, 1] << 4)).permute(0, 2, 1, 3)  # [b, pair, row, i]
    return packed.reshape(n // 16, k // 8, 64)


def _top_bits(q: torch.Tensor, width: int) -> torch.Tensor:
    """Codes [n, k] above their nibble, per 16 inputs of a group and lane 4 r + i: the
    ``width``-bit tops of its 4 k-quads u at bits width u.. [n / 16, k / 64, 4, 64]."""
    n, k = q.shape
    top = (q >> 4).view(n // 16, 16, k // Q4_GROUP, 4, 4, 4)  # [b, row, group, t, u, i]
    lane = sum(top[:, :, :, :, u] << (width * u) for u in range(4))
    return lane.permute(0, 2, 3, 1, 4).reshape(n // 16, k // Q4_GROUP, 4, 64)


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> PackedLinear:
    """Pack a [n, k] weight (any float dtype) for the runtime; ValueError for a weight with a
    NaN or an infinity."""
    w = weight.detach().float().contiguous()
    if w.dim() != 2 or w.numel() == 0:
        raise ValueError(f"a product packs a non-empty [n, k] weight, got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise ValueError(f"cannot pack a [{w.shape[0]}, {w.shape[1]}] weight with {bad} NaN/inf "
                         "values: the checkpoint is damaged")
    n, k = w.shape
    kind = kind_for(n, k, kind)
    b = None if bias is None else bias.detach().float().contiguous()
    s = OcLinear(kind=KINDS[kind], n=n, k=k, group=0, bias=_ptr(b))
    keep = [t for t in (b,) if t is not None]
    if kind == "f32":
        s.wf = w.data_ptr()
        keep.append(w)
        deq = w
    elif kind in LEVELS:
        g = Q4_GROUP
        q, scale, lo = affine_codes(w, LEVELS[kind], g, CLIPS[kind])  # what the kernel reads
        deq = (q.view(n, k // g, g).float() * scale[..., None] + lo[..., None]).view(n, k)
        if kind == "q8g":  # the q8 layout of unsigned codes (one vector per k-quad)
            packed = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).reshape(n // 16, k // 4, 64)
        elif kind == "q6":  # per 16 inputs of a group: 2 nibble vectors, 1 of the top two bits
            nib = _nibbles(q).view(n // 16, k // g, 4, 128)
            packed = torch.cat((nib, _top_bits(q, 2)), dim=3)
        elif kind == "q5":  # per 16 inputs of a group: 2 nibble vectors, 32 bytes of top bits
            nib, lane = _nibbles(q).view(n // 16, k // g, 4, 128), _top_bits(q, 1)
            packed = torch.cat((nib, lane[..., :32] | (lane[..., 32:] << 4)), dim=3)
        else:
            packed = _nibbles(q)
        packed = packed.contiguous()
        sm = torch.stack((scale, lo), dim=-1).view(n // 16, 16, k // g, 2).permute(0, 2, 3, 1)
        sm = sm.contiguous().half()
        s.group, s.w, s.scales = g, packed.data_ptr(), sm.data_ptr()
        keep += [packed, sm]
    else:  # q8
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        deq = q.float() * scale[:, None]
        packed = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).reshape(n // 16, k // 4, 64)
        packed = packed.contiguous()
        rsum = q.sum(dim=1, dtype=torch.int32).contiguous()
        scale = scale.contiguous()
        s.w, s.row_scale, s.row_sum = packed.data_ptr(), scale.data_ptr(), rsum.data_ptr()
        keep += [packed, scale, rsum]
    out = PackedLinear(s, keep)
    out._deq = deq
    return out


def pack_linear(lin: nn.Linear, kind: str, cache: "PackCache | None" = None) -> PackedLinear:
    if cache is not None:
        return cache.pack(lambda: lin.weight, lin.bias, kind, tuple(lin.weight.shape))
    return pack_weight(lin.weight, lin.bias, kind)


class PackCache:
    """The packed products of one runner, kept on disk (safetensors) so a restart loads them
    instead of packing again (packing the 0.6B model takes ~9 s on one core). Products are
    taken in the runner's order; each is checked against the kind and shape it must have, and
    a file that does not fit (or does not read) is ignored with a warning and rewritten."""

    VERSION = 1
    KEEP = 4  # files kept in the folder: the most recently used (a new one prunes the oldest)

    def __init__(self, path: Path | None, read: bool = True) -> None:
        """``read`` False: pack afresh and (over)write ``path``."""
        self.path = path
        self.loaded: list[tuple[dict, list[torch.Tensor]]] | None = None
        self.made: list[PackedLinear] = []
        self.i = 0
        if read and path is not None and path.is_file():
            try:
                self.loaded = self._read(path)
                os.utime(path)  # recently used: kept when the folder is pruned
            except Exception as e:  # unreadable or of another layout: pack afresh
                log.warning("ignoring the pack cache %s: %s", path, e)

    @staticmethod
    def _read(path: Path) -> list[tuple[dict, list[torch.Tensor]]]:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["products"])
            if f.metadata().get("version") != str(PackCache.VERSION):
                raise ValueError("another pack-cache version")
            return [(m, [f.get_tensor(f"{i}.{j}") for j in range(m["tensors"])])
                    for i, m in enumerate(meta)]

    def pack(self, weight, bias: torch.Tensor | None, kind: str, shape: tuple[int, int]) -> PackedLinear:
        """The product of ``weight()`` [n, k] (called only when it must be packed)."""
        n, k = shape
        if self.loaded is not None:
            want = dict(kind=KINDS[kind_for(n, k, kind)], n=n, k=k, bias=bias is not None)
            got = self.loaded[self.i][0] if self.i < len(self.loaded) else None
            if got is not None and all(got[key] == v for key, v in want.items()):
                tensors = self.loaded[self.i][1]
                self.i += 1
                return PackedLinear.from_tensors(got, tensors)
            log.warning("the pack cache %s does not fit this model (product %d): packing afresh",
                        self.path, self.i)
            self.loaded = None
            raise _Repack
        p = pack_weight(weight(), bias, kind)
        self.made.append(p)
        return p

    def finish(self) -> None:
        """Write what was packed (nothing when everything came from the file)."""
        if self.path is None or self.loaded is not None or not self.made:
            return
        from safetensors.torch import save_file

        tensors, meta = {}, []
        for i, p in enumerate(self.made):
            meta.append(dict(p.meta, tensors=len(p.tensors)))
            for j, t in enumerate(p.tensors):
                tensors[f"{i}.{j}"] = t.contiguous()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            save_file(tensors, str(tmp), metadata={"products": json.dumps(meta),
                                                   "version": str(self.VERSION)})
            tmp.replace(self.path)
        except OSError as e:  # a full or read-only disk: the next start packs again
            log.warning("could not write the pack cache %s: %s", self.path, e)
            tmp.unlink(missing_ok=True)
            return
        self.prune(self.path.parent, self.KEEP)

    @staticmethod
    def prune(folder: Path, keep: int) -> None:
        """Delete all but the ``keep`` most recently used pack files of ``folder`` (each is the
        size of the packed model: other checkpoints, old versions of one, other weight paths)."""
        files = sorted(folder.glob("*.safetensors"), key=lambda f: f.stat().st_mtime_ns, reverse=True)
        for f in files[keep:]:
            try:
                f.unlink()
            except OSError:
                pass


class _Repack(Exception):
    """The pack cache stopped fitting part-way: the runner packs everything afresh."""


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def _scaled(w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    return w if s is None else w.float() * s


def smoothing(gain: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Per-input-channel factors s [k] that move an RMSNorm's outlier channels into the weights
    reading it: the norm's gain is divided by s and the weights' columns multiplied by s, the
    same function in exact arithmetic. A channel whose gain is 30x the rest (massive
    activations, as trained LLMs have) makes every int8 activation step 30x coarser and, with
    its column scaled down to match, rounds to nothing in a per-group weight scale; after the
    move both sides of the product are ordinary (SmoothQuant's migration with strength 1/2,
    the activation's range read off the gain: s = sqrt(|gain| / max |column|), normalized to a
    median of 1). Channels with a zero gain or an all-zero column keep s = 1."""
    col = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    g = gain.detach().float().abs()
    s = torch.sqrt(g / col)
    ok = torch.isfinite(s) & (s > 0)
    if not bool(ok.any()):
        return torch.ones_like(g)
    s = s / s[ok].median()
    return torch.where(ok, s, torch.ones_like(s)).clamp(1 / 1024, 1024)


PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's products, in packing order
ATTENTION = ("qkv", "o")


@dataclass(frozen=True)
class WeightPlan:
    """The weight kind of every product the runner packs (mixed precision per tensor).

    ``talker`` / ``cp``: the kind of each stack's products, ``talker_attention`` /
    ``cp_attention``: of its q|k|v and o instead (None: the stack's kind), ``early`` (fraction,
    kind): the first fraction of each stack's layers in that kind (their errors pass through
    every later layer),
    ``talker_head`` / ``cp_head``: the codec head and the code predictor's heads and projection
    (None: as the layers' default), ``overrides``: ("talker.3.qkv", kind) pairs that win over the
    rules (a measured allocation); ``smooth``: fold norm outliers into low-bit weights."""

    talker: str = "q4"
    cp: str = "q4"
    talker_attention: str | None = None
    cp_attention: str | None = None
    early: tuple[float, str] | None = None
    talker_head: str | None = None
    cp_head: str | None = None
    overrides: tuple[tuple[str, str], ...] = ()
    smooth: bool = True

    def __post_init__(self) -> None:
        kinds = [self.talker, self.cp, self.talker_attention, self.cp_attention, self.talker_head,
                 self.cp_head] + [k for _, k in self.overrides] + ([self.early[1]] if self.early else [])
        for k in kinds:
            if k is not None and k not in KINDS:
                raise ValueError(f"unknown weight kind {k!r}: one of {', '.join(KINDS)}")
        for name, _ in self.overrides:
            parts = name.split(".")
            if len(parts) != 3 or parts[0] not in ("talker", "cp") or not parts[1].isdigit() \
                    or parts[2] not in PRODUCTS:
                raise ValueError(f"weight plan override {name!r}: name a product as "
                                 f"'talker|cp.LAYER.{'|'.join(PRODUCTS)}'")
        if self.early is not None and not 0.0 <= self.early[0] <= 1.0:
            raise ValueError(f"weight plan early fraction must be in [0, 1], got {self.early[0]}")

    def kind(self, stack: str, layer: int, layers: int, product: str) -> str:
        """The kind of ``product`` of layer ``layer`` (of ``layers``) of ``stack`` (talker/cp)."""
        over = dict(self.overrides).get(f"{stack}.{layer}.{product}")
        if over is not None:
            return over
        if self.early is not None and layer < round(self.early[0] * layers):
            return self.early[1]
        attn = self.talker_attention if stack == "talker" else self.cp_attention
        if attn is not None and product in ATTENTION:
            return attn
        return self.talker if stack == "talker" else self.cp

    def head(self, stack: str) -> str:
        return (self.talker_head or self.talker) if stack == "talker" else (self.cp_head or self.cp)

    def as_dict(self) -> dict:
        return dict(talker=self.talker, cp=self.cp, talker_attention=self.talker_attention,
                    cp_attention=self.cp_attention, early=list(self.early) if self.early else None,
                    talker_head=self.talker_head, cp_head=self.cp_head,
                    overrides=[list(o) for o in self.overrides], smooth=self.smooth)

    @classmethod
    def from_dict(cls, d: dict) -> "WeightPlan":
        known = set(cls.__dataclass_fields__)
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown weight plan keys: {', '.join(sorted(extra))} "
                             f"(known: {', '.join(sorted(known))})")
        d = dict(d)
        if d.get("early") is not None:
            d["early"] = (float(d["early"][0]), str(d["early"][1]))
        d["overrides"] = tuple((str(a), str(b)) for a, b in d.get("overrides", ()))
        return cls(**d)


def product_bytes(n: int, k: int, kind: str) -> int:
    """Bytes a product of [n, k] weights of ``kind`` reads per call (its layout's real size)."""
    kind = kind_for(n, k, kind)
    if kind == "f32":
        return 4 * n * k
    if kind == "q8":
        return n * k + 8 * n  # bytes, then a scale and a row sum per row
    bits = {"q4": 4, "q5": 5, "q6": 6, "q8g": 8}[kind]
    return n * k * bits // 8 + n * (k // Q4_GROUP) * 4  # codes, then fp16 scale + offset


def frame_weight_bytes(talker_cfg, plan: WeightPlan) -> int:
    """Weight bytes one decode frame reads under ``plan`` (``config.TalkerConfig``): the
    talker's layers and head once, the code predictor's layers, one head and the projection
    once per sub-step (num_code_groups - 1). A frame is bound by these bytes, so this over the
    machine's read bandwidth is the floor of its time (how the profile prices a weight path)."""
    def layer_bytes(c, stack: str, i: int) -> int:
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        shapes = {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
                  "gate_up": (2 * c.intermediate_size, c.hidden_size),
                  "down": (c.hidden_size, c.intermediate_size)}
        return sum(product_bytes(*shapes[p], plan.kind(stack, i, c.num_hidden_layers, p))
                   for p in PRODUCTS)

    return frame_reads(talker_cfg, plan).total


@dataclass(frozen=True)
class FrameReads:
    """The weight bytes one decode frame reads, by weight kind: the talker's (once) and one
    code-predictor sub-step's (``sub_steps`` times a frame: the same weights again, which a
    large enough cache keeps between sub-steps)."""

    talker: dict[str, int]
    cp: dict[str, int]
    sub_steps: int

    @property
    def total(self) -> int:
        return sum(self.talker.values()) + self.sub_steps * sum(self.cp.values())

    @property
    def cp_bytes(self) -> int:
        return sum(self.cp.values())


def frame_reads(talker_cfg, plan: WeightPlan) -> FrameReads:
    """``FrameReads`` of one decode frame under ``plan`` (``config.TalkerConfig``)."""
    def add(into: dict[str, int], n: int, k: int, kind: str) -> None:
        kk = kind_for(n, k, kind)
        into[kk] = into.get(kk, 0) + product_bytes(n, k, kk)

    def layers(c, stack: str, into: dict[str, int]) -> None:
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        shapes = {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
                  "gate_up": (2 * c.intermediate_size, c.hidden_size),
                  "down": (c.hidden_size, c.intermediate_size)}
        for i in range(c.num_hidden_layers):
            for p in PRODUCTS:
                add(into, *shapes[p], plan.kind(stack, i, c.num_hidden_layers, p))

    lm, cp = talker_cfg.lm, talker_cfg.code_predictor
    talker: dict[str, int] = {}
    layers(lm, "talker", talker)
    add(talker, lm.vocab_size, lm.hidden_size, plan.head("talker"))
    sub: dict[str, int] = {}
    layers(cp, "cp", sub)
    add(sub, cp.vocab_size, cp.hidden_size, plan.head("cp"))
    if cp.hidden_size != lm.hidden_size:  # the talker-to-code-predictor projection
        add(sub, cp.hidden_size, lm.hidden_size, plan.head("cp"))
    return FrameReads(talker, sub, talker_cfg.num_code_groups - 1)


def kernel_read_gbs(kind: str, threads: int, n: int = 3072, k: int = 1024, rows: int = 1,
                    seconds: float = 0.05, lib: C.CDLL | None = None) -> float:
    """How fast the runtime's ``kind`` product goes through its weights (GB/s of packed weight
    bytes) when they sit in the cache: a random [n, k] weight (a 0.6B MLP product: ~1.5-3 MB,
    cache-resident) times ``rows`` activation rows, called for ``seconds`` after a warm-up,
    median over five such runs. This is the kernel's own ceiling; a product whose weights come
    from memory runs at the lower of this and the read bandwidth."""
    lib = lib or _lib()
    packed = pack_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02,
                         None, kind)
    pool = Pool(threads, lib)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    y = torch.empty(rows, packed.n, dtype=torch.float32)
    nbytes = product_bytes(n, k, kind)

    def call() -> None:
        lib.oc_linear(pool.handle, C.byref(packed.struct), x.data_ptr(), rows, y.data_ptr())

    for _ in range(3):
        call()
    rates = []
    for _ in range(5):
        calls, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < seconds / 5 or calls < 3:
            call()
            calls += 1
        rates.append(calls * nbytes / dt / 1e9)
    return statistics.median(rates)


class NativeStack:
    """A decoder stack (``DecoderStack``) packed for the runtime, over the engine's KV cache.
    Low-bit kinds take each layer's norm outliers into their weights (``smoothing``)."""

    def __init__(self, stack: nn.Module, cache_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 kind, packs: PackCache | None = None, smooth: bool = True) -> None:
        """``kind``: one kind for every product, or ``fn(layer, product) -> kind``."""
        kind_of = kind if callable(kind) else (lambda _i, _p, k=kind: k)
        cfg = stack.cfg
        if cfg.head_dim % 16:
            raise ValueError(f"the CPU runtime needs head_dim % 16 == 0, got {cfg.head_dim}")
        self.layers: list[tuple[PackedLinear, ...]] = []
        self.keep: list[torch.Tensor] = []
        arr = (OcLayer * cfg.num_hidden_layers)()
        packs = packs or PackCache(None)
        for i, layer in enumerate(stack.layers):
            a, m = layer.self_attn, layer.mlp
            qkv_w = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
            gu_w = (m.gate_proj.weight, m.up_proj.weight)
            ln1, ln2 = _f32(layer.input_layernorm.weight), _f32(layer.post_attention_layernorm.weight)
            kq, ko, kg, kd = (kind_of(i, p) for p in PRODUCTS)
            s1 = s2 = None
            if smooth and kq != "f32":  # cheap: gains and column maxima only
                s1 = smoothing(ln1, qkv_w)
                ln1 = ln1 / s1
            if smooth and kg != "f32":
                s2 = smoothing(ln2, gu_w)
                ln2 = ln2 / s2
            qkv = packs.pack(lambda: _scaled(torch.cat(qkv_w), s1), None, kq,
                             (sum(w.shape[0] for w in qkv_w), qkv_w[0].shape[1]))
            o = pack_linear(a.o_proj, ko, packs)
            gu = packs.pack(lambda: _scaled(torch.cat(gu_w), s2), None, kg,
                            (sum(w.shape[0] for w in gu_w), gu_w[0].shape[1]))
            down = pack_linear(m.down_proj, kd, packs)
            norms = [ln1, ln2, _f32(a.q_norm.weight), _f32(a.k_norm.weight)]
            self.layers.append((qkv, o, gu, down))
            self.keep += norms
            arr[i] = OcLayer(qkv=qkv.struct, o=o.struct, gate_up=gu.struct, down=down.struct,
                             ln1=norms[0].data_ptr(), ln2=norms[1].data_ptr(),
                             q_norm=norms[2].data_ptr(), k_norm=norms[3].data_ptr())
        norm = _f32(stack.norm.weight)
        self.keep.append(norm)
        self._arr = arr
        self.struct = OcStack(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                              heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                              head_dim=cfg.head_dim, ffn=cfg.intermediate_size,
                              eps=cfg.rms_norm_eps, layer=arr, norm=norm.data_ptr())
        dt = cache_layers[0][0].dtype
        if dt not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the CPU runtime keeps KV caches in bf16 or fp32, not {dt}")
        ks = (C.c_void_p * len(cache_layers))(*[k.data_ptr() for k, _ in cache_layers])
        vs = (C.c_void_p * len(cache_layers))(*[v.data_ptr() for _, v in cache_layers])
        self._kv = (ks, vs)
        self.cache = OcCache(k=ks, v=vs, length=cache_layers[0][0].shape[2],
                             bf16=int(dt == torch.bfloat16))


class NativeRunner:
    """The frame engine's talker step, talker head, prefill and code-predictor frame on the CPU
    runtime (``FrameEngine.use_native``). ``talker_kind`` / ``cp_kind``: weight kind of the
    talker's and the code predictor's products (``KINDS``); ``plan``: a ``WeightPlan`` instead
    (mixed precision per product); ``threads``: the runtime's threads (the caller included);
    ``lent_cpus`` / ``lease``: more threads on another process's cores (``Pool``)."""

    def __init__(self, engine, talker_kind: str = "q4", cp_kind: str = "q4",
                 threads: int | None = None, *, lent_cpus: tuple[int, ...] = (),
                 lease: CoreLease | None = None, pack_cache: Path | None = None,
                 plan: WeightPlan | None = None) -> None:
        self.plan = plan or WeightPlan(talker_kind, cp_kind)
        self.lib = _lib()
        self.pool = Pool(threads or torch.get_num_threads(), self.lib, lent_cpus=lent_cpus,
                         lease=lease)
        t, cp = engine.talker, engine.talker.code_predictor
        try:
            self._pack(engine, PackCache(pack_cache))
        except _Repack:  # the cache file did not fit: pack everything and rewrite it
            self._pack(engine, PackCache(pack_cache, read=False))
        heads = (OcLinear * len(self.cp_heads))(*[h.struct for h in self.cp_heads])
        emb_dtype = t.model.codec_embedding.weight.dtype
        tables = [t.model.codec_embedding.weight] + [e.weight for e in cp.model.codec_embedding]
        if emb_dtype not in (torch.bfloat16, torch.float32) or any(x.dtype != emb_dtype for x in tables):
            raise ValueError(f"the CPU runtime reads bf16 or fp32 embedding tables, not {emb_dtype}")
        self.tables = [x.detach().contiguous() for x in tables]
        cp_emb = (C.c_void_p * (len(self.tables) - 1))(*[x.data_ptr() for x in self.tables[1:]])
        self.talker_rope = (engine.rope.cos.contiguous(), engine.rope.sin.contiguous())
        self.cp_rope = (engine.cp_rope.cos.contiguous(), engine.cp_rope.sin.contiguous())
        g = engine.cfg.num_code_groups
        self._keep = (heads, cp_emb)
        self.cp_struct = OcCodePredictor(
            stack=self.cp.struct, cache=self.cp.cache, heads=heads,
            proj=C.pointer(self.proj.struct) if self.proj is not None else None,
            talker_codec_emb=self.tables[0].data_ptr(), cp_emb=cp_emb,
            emb_bf16=int(emb_dtype == torch.bfloat16), talker_hidden=engine.cfg.lm.hidden_size,
            talker_vocab=engine.cfg.lm.vocab_size, cp_vocab=engine.codebook_size, groups=g,
            cos_tab=self.cp_rope[0].data_ptr(), sin_tab=self.cp_rope[1].data_ptr())
        self.engine = engine

    def _pack(self, engine, packs: PackCache) -> None:
        t, cp = engine.talker, engine.talker.code_predictor
        plan = self.plan
        nt, nc = len(t.model.layers), len(cp.model.layers)
        self.talker = NativeStack(t.model, engine.kv.layers,
                                  lambda i, p: plan.kind("talker", i, nt, p), packs, plan.smooth)
        self.head = pack_linear(t.codec_head, plan.head("talker"), packs)
        self.cp = NativeStack(cp.model, engine.cp_kv.layers,
                              lambda i, p: plan.kind("cp", i, nc, p), packs, plan.smooth)
        self.cp_heads = [pack_linear(h, plan.head("cp"), packs) for h in cp.lm_head]
        proj = cp.small_to_mtp_projection
        self.proj = None if isinstance(proj, nn.Identity) else pack_linear(proj, plan.head("cp"), packs)
        if packs.loaded is not None and packs.i != len(packs.loaded):
            log.warning("the pack cache %s holds more products than this model: packing afresh",
                        packs.path)
            raise _Repack
        packs.finish()

    def talker_step(self, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rows x [m, C] (token of slot slots[r] at position pos[r], attending the slot's cache
        [0, pos[r]]) -> normed hidden [m, C] fp32; writes their K/V into the engine's cache."""
        return self.stack_step(self.talker.struct, self.talker.cache, self.talker_rope, x, slots, pos)

    def cp_project(self, x: torch.Tensor) -> torch.Tensor:
        """Code-predictor inputs [m, talker C] -> [m, C] fp32 (its projection, if it has one)."""
        return self.linear(self.proj, x) if self.proj is not None else x.float()

    def cp_step(self, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                stack: OcStack | None = None) -> torch.Tensor:
        """``talker_step`` for the code predictor's stack (its inputs already projected), or
        for ``stack``, a struct over its first layers (``engine.speculative``), on its cache."""
        return self.stack_step(stack or self.cp.struct, self.cp.cache, self.cp_rope, x, slots, pos)

    def stack_step(self, stack: OcStack, cache: OcCache, rope: tuple[torch.Tensor, torch.Tensor],
                   x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = x.detach().float().contiguous().clone()  # the runtime updates it in place
        slots = slots.to(torch.int64).contiguous()
        pos = pos.to(torch.int64).contiguous()
        self.lib.oc_stack_step(self.pool.handle, C.byref(stack), C.byref(cache), h.shape[0],
                               slots.data_ptr(), pos.data_ptr(), rope[0].data_ptr(),
                               rope[1].data_ptr(), h.data_ptr())
        return h

    def linear(self, packed: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().contiguous()
        y = torch.empty(x.shape[0], packed.n, dtype=torch.float32)
        self.lib.oc_linear(self.pool.handle, C.byref(packed.struct), x.data_ptr(), x.shape[0],
                           y.data_ptr())
        return y

    def talker_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(self.head, hidden)

    def cp_frame(self, p: int) -> torch.Tensor:
        """The code predictor's frame for slots [0, p): codes 1..G-1 [p, G-1] (INVALID rows)."""
        e = self.engine
        sp = e.cp_sp
        greedy = sp.greedy[:p].to(torch.int32).contiguous()
        top_k = sp.top_k[:p].clamp(max=2**31 - 1).to(torch.int32).contiguous()
        temp, top_p = sp.temperature[:p].contiguous(), sp.top_p[:p].contiguous()
        seed = e.seed[:p].contiguous()
        counter = e.counter[:p]  # a view of the engine's counters: advanced in place
        assert counter.is_contiguous()
        samp = OcSampling(greedy=greedy.data_ptr(), top_k=top_k.data_ptr(),
                          temperature=temp.data_ptr(), top_p=top_p.data_ptr(),
                          seed=seed.data_ptr(), counter=counter.data_ptr())
        hidden = e.last_hidden[:p].float().contiguous()
        code0 = e.last_code0[:p].contiguous()
        codes = torch.empty(p, e.cfg.num_code_groups - 1, dtype=torch.int64)
        self.lib.oc_code_predictor_frame(self.pool.handle, C.byref(self.cp_struct), p,
                                         hidden.data_ptr(), code0.data_ptr(), C.byref(samp),
                                         codes.data_ptr())
        return codes

"""Weight packing for the CPU runtime: a product's weights in the layout its kernel reads, and the
disk cache that keeps the packed products between starts.

Weight kinds (``kind``), one per product: ``q4`` / ``q5`` / ``q6`` / ``q8g`` unsigned 4- to 8-bit
codes with a per-(row, group of 64 inputs) fp16 scale and offset, the range of each group clipped
where that lowers its squared error; ``q8`` signed bytes with a per-row scale; ``f32`` the exact
weights. Each product quantizes its input rows to int8 (per row); see the C file for the
layouts. A weight that is not finite is refused at packing (it would poison every row that reads
it). ``smoothing`` moves a norm's outlier channels into the low-bit weights that read it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from omni_stream.engine.cpu.abi import OcLinear, ptr

log = logging.getLogger(__name__)

KINDS = {"q4": 0, "q8": 1, "f32": 2, "q6": 3, "q5": 4, "q8g": 5}

Q4_GROUP = 64  # inputs per scale of q4 and q6

LEVELS = {"q4": 15, "q5": 31, "q6": 63, "q8g": 255}  # largest code of the affine kinds

# range fractions tried per group (least error wins): at 4 bits clipping a far weight often
# pays (~4 % less squared error on Student-t weights); at 6 bits the full range nearly always
# wins, so the search (~10x the packing time) is kept where it pays
CLIPS = {"q4": (1.0, 0.95, 0.9, 0.85, 0.8, 0.75), "q5": (1.0, 0.95, 0.9), "q6": (1.0,), "q8g": (1.0,)}


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
    s = OcLinear(kind=KINDS[kind], n=n, k=k, group=0, bias=ptr(b))
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
            raise Repack
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


class Repack(Exception):
    """The pack cache stopped fitting part-way: the runner packs everything afresh."""


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

"""A measuring device: the codec stage's bf16 decode recomputed by an fp32 program that rounds
to bf16 exactly where the stage rounds, so that the two differ only in the order of their fp32
accumulations (``decoder_export_bench.py --sensitivity`` uses it).

The idea it tests (issue 37, item 4): an ExecuTorch client runs fp32 (XNNPACK), the default CPU
server decodes in bf16 (``codec_kernels.stage_kernels``: oneDNN GEMMs and convs that accumulate in
fp32 and round once with their bias; a transposed conv as a GEMM, then its overlap-add, then its
bias, each rounded; every elementwise op, norm and softmax rounding its output; the runtime's
one-pass Snake, fp32 inside, rounded once). bf16 values and their products are exact in fp32,
so a program rounding at the same points should land within a few accumulation-order flips of
the server. Measured on the 0.6B codec it does not: 31.5 dB, where a plain fp32 program is
29.9 dB away. The bf16 decode amplifies a single difference (one bf16 step at one element of
the first conv's state: 31.6 dB over the next frames; oneDNN itself at a lower ISA level:
29.9-32.8 dB), so only the stage's own kernels reproduce its samples
(results/decoder_export_bench.md).

How: the bf16 model is traced as the stage runs it (``server_structure``); ``emulate_bf16``
rewrites the traced graph to fp32: bf16 weights become fp32 tensors of the same values, casts
to bf16 become roundings, casts from bf16 disappear, and every op that produces a bf16 tensor
and is not pure data movement is followed by a rounding. Rounding ``veltkamp``
(``s = x * 65537; x' = s - (s - x)``: round-to-nearest-even to 8 significant bits, the same bits
as a cast for normal |x| < 2^112, ties included: checked on 2^16 mantissas and their ties in
every binade; three fp32 ops an XNNPACK delegate keeps; the attention mask's -inf becomes
-2^100, which the softmax turns into the same zeros) or ``cast`` (``x.to(bfloat16).to(float32)``).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch import Tensor, fx

__all__ = ["ROUNDINGS", "emulate_bf16", "emulated_snake", "emulated_step", "server_structure"]

ROUNDINGS = ("veltkamp", "cast")
_SPLIT = 65537.0  # 2^16 + 1: Veltkamp's split keeps 24 - 16 = 8 significant bits (bf16's)
MASK_FILL = -(2.0 ** 100)  # stands for -inf in additive masks: exact in bf16, safe in the split

# ops whose bf16 output holds only values of their bf16 inputs (nothing to round)
_MOVES = frozenset({
    "alias", "cat", "chunk", "clone", "contiguous", "detach", "diagonal", "embedding", "expand",
    "flatten", "index_select", "narrow", "neg", "permute", "reshape", "select", "slice", "split",
    "squeeze", "t", "transpose", "unfold", "unsqueeze", "view", "_unsafe_view", "unbind"})
_CASTS = frozenset({"to", "_to_copy", "type_as"})
_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like",
                        "full_like", "new_zeros", "new_ones", "new_empty", "new_full", "arange",
                        "scalar_tensor"})


# ---------------------------------------------------------------- the server's Snake, in torch


def emulated_snake(x: Tensor, alpha: Tensor, inv_beta: Tensor) -> Tensor:
    """The CPU runtime's one-pass SnakeBeta (``engine/cpu/oc_snake.h``) in torch ops, for
    ``SnakeBeta.pack``: ``x + inv_beta * sin(alpha x)^2`` in fp32 from bf16 ``x [B, C, T]``,
    ``alpha``, ``inv_beta`` fp32 [C], rounded once to bf16. The same reduction by the nearest
    multiple of pi (pi in three parts; the first two products exact for |k| < 2^11) and the
    same degree-11 polynomial; the kernel's fused multiply-adds round once where these round
    twice, an fp32-level difference. Lanes with |alpha x| >= 4096 (the kernel's std::sin
    fallback) are not special-cased: a codec's activations stay far below."""
    xf = x.float()
    v = xf * alpha[:, None]
    t = v * 0.318309886183790671
    k = (t + 12582912.0) - 12582912.0  # nearest integer, ties to even (1.5 * 2^23 trick)
    r = v - k * 3.140625
    r = r - k * 9.675025939941406e-4
    r = r - k * 1.5099580252808664e-7
    r2 = r * r
    poly = r2 * 2.5052108385441720e-8 + -2.7557319223985893e-6
    poly = poly * r2 + 1.9841269841269841e-4
    poly = poly * r2 + -8.3333333333333333e-3
    poly = poly * r2 + 1.6666666666666667e-1
    s = r - (r * r2) * poly
    return (xf + inv_beta[:, None] * (s * s)).to(torch.bfloat16)


def server_structure(model) -> None:
    """Set up the bf16 ``model`` (in place) so that its streaming trace has the codec stage's
    rounding points: every transposed conv as the stage runs it packed (a GEMM, its overlap-add,
    its bias: ``_conv_transpose1d_gemm``), a Snake that the stage runs through the runtime's
    one-pass kernel (those called with the step: 5 of the 29 at the released widths; a residual
    unit calls its two without it, so there as here they are torch's five bf16 ops) as that
    kernel. The causal convs stay conv ops (the stage's im2col GEMM, its oneDNN conv and its
    per-row 1x1 product all accumulate in fp32 and round once, with the bias), which export
    backends delegate."""
    from omni_stream.models.code2wav_blocks import CausalConv1d, CausalTransConv1d, SnakeBeta

    for m in model.modules():
        if isinstance(m, CausalTransConv1d):
            m.gemm = True
        elif isinstance(m, CausalConv1d):
            m.gemm = False
        elif isinstance(m, SnakeBeta):
            m.pack(emulated_snake)


# ---------------------------------------------------------------- the graph rewrite


def _name(target) -> str:
    """``aten.add.Tensor`` -> ``add``; Python operators by their name."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_bf16(node) -> bool:
    v = _val(node)
    return isinstance(v, Tensor) and v.dtype == torch.bfloat16


def _bf16_exact(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).float())


def _rounder(graph: fx.Graph, rounding: str) -> Callable[[fx.Node], fx.Node]:
    aten = torch.ops.aten

    def veltkamp(x: fx.Node) -> fx.Node:
        s = graph.call_function(aten.mul.Tensor, (x, _SPLIT))
        d = graph.call_function(aten.sub.Tensor, (s, x))
        return graph.call_function(aten.sub.Tensor, (s, d))

    def cast(x: fx.Node) -> fx.Node:
        b = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
        return graph.call_function(aten._to_copy.default, (b,), {"dtype": torch.float32})

    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}: use one of {', '.join(ROUNDINGS)}")
    return veltkamp if rounding == "veltkamp" else cast


def emulate_bf16(gm: fx.GraphModule, rounding: str = "veltkamp") -> dict[str, int]:
    """Rewrite ``gm`` (a traced bf16 program, e.g. ``ExportedProgram.module()``) in place into
    an fp32 program that rounds to bf16 after every op whose output the traced program holds
    in bf16 (see the module docstring). Returns counts of what it did (roundings, casts
    dropped, weights converted, constants folded)."""
    aten = torch.ops.aten
    graph = gm.graph
    rnd = _rounder(graph, rounding)
    stats = dict(roundings=0, casts_dropped=0, weights=0, folded=0)
    for node in list(graph.nodes):
        if node.op == "get_attr":
            obj = _attr(gm, node.target)
            if isinstance(obj, Tensor) and obj.dtype == torch.bfloat16:
                _set_attr(gm, node.target, obj.float())
                stats["weights"] += 1
            continue
        if node.op != "call_function":
            continue
        name = _name(node.target)
        if name == "_assert_tensor_metadata":  # checks the bf16 dtypes this rewrite removes
            graph.erase_node(node)
            continue
        kw = dict(node.kwargs)
        if name in _CASTS and isinstance(_val(node.args[0]), Tensor):
            src, out = node.args[0], _val(node).dtype
            if out == torch.bfloat16 and not _is_bf16(src):  # fp32 -> bf16: the rounding
                with graph.inserting_before(node.next):
                    r = rnd(src)
                node.replace_all_uses_with(r)
                stats["roundings"] += 1
            elif _is_bf16(src) and out in (torch.bfloat16, torch.float32):
                node.replace_all_uses_with(src)  # the values already are bf16's, in fp32
                stats["casts_dropped"] += 1
            else:
                continue
            graph.erase_node(node)
            continue
        if kw.get("dtype") == torch.bfloat16:  # factories: zeros, full, ...
            kw["dtype"] = torch.float32
            node.kwargs = kw
        if name in ("masked_fill", "fill", "full", "full_like", "new_full") and _is_bf16(node):
            args = list(node.args)
            i = {"masked_fill": 2, "fill": 1, "full": 1, "full_like": 1, "new_full": 2}[name]
            if i < len(args) and isinstance(args[i], (int, float)):
                v = float(args[i])
                args[i] = MASK_FILL if v == float("-inf") else _bf16_exact(v)
                node.args = tuple(args)
            continue  # the fill value is bf16-exact, the rest is its input's
        if not _is_bf16(node) or name in _MOVES or name in _FACTORIES \
                or node.target is operator.getitem:
            continue
        users = list(node.users)
        with graph.inserting_before(node.next):
            r = rnd(node)
        for u in users:
            u.replace_input_with(node, r)
        stats["roundings"] += 1
    stats["folded"] = _fold_constants(gm)
    _mm_to_linear(gm)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return stats


def _attr(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _set_attr(gm: torch.nn.Module, target: str, value: Tensor) -> None:
    *path, leaf = target.split(".")
    mod = gm
    for part in path:
        mod = getattr(mod, part)
    if isinstance(getattr(mod, leaf, None), torch.nn.Parameter):  # a new one: never the traced
        setattr(mod, leaf, torch.nn.Parameter(value, requires_grad=False))  # program's own
    elif leaf in getattr(mod, "_buffers", {}):
        mod._buffers[leaf] = value
    else:
        setattr(mod, leaf, value)


def _fold_constants(gm: fx.GraphModule) -> int:
    """Replace every op computed from weights alone (a reshaped transposed-conv weight, a
    column-shaped bias, the clamped codebook usage) by its value: export backends then see a
    constant weight (XNNPACK delegates a GEMM only with one), and nothing is recomputed per
    call."""
    graph, n = gm.graph, 0
    const: dict[fx.Node, Tensor] = {}
    for node in list(graph.nodes):
        if node.op == "get_attr":
            v = _attr(gm, node.target)
            if isinstance(v, Tensor):
                const[node] = v
            continue
        if node.op != "call_function" or not node.all_input_nodes:
            continue
        if not all(a in const for a in node.all_input_nodes) or not node.users:
            continue
        if _name(node.target) in ("_assert_tensor_metadata", "sym_size"):
            continue
        args = fx.node.map_arg(node.args, lambda a: const[a])
        kwargs = fx.node.map_arg(node.kwargs, lambda a: const[a])
        with torch.no_grad():
            v = node.target(*args, **kwargs)
        if not isinstance(v, Tensor):
            continue
        v = v.detach().clone().contiguous()
        attr = f"_bf16_emul_const{n}"
        gm.register_buffer(attr, v)
        with graph.inserting_before(node):
            g = graph.get_attr(attr)
        node.replace_all_uses_with(g)
        graph.erase_node(node)
        const[g] = v
        n += 1
    graph.eliminate_dead_code()
    return n


def _mm_to_linear(gm: fx.GraphModule) -> None:
    """``mm(x, W)`` with a constant ``W [in, out]`` as ``linear(x, W^T)``: the same product,
    in the form export backends delegate as a fully connected layer."""
    aten, graph = torch.ops.aten, gm.graph
    for i, node in enumerate(list(graph.nodes)):
        if node.op != "call_function" or node.target is not aten.mm.default:
            continue
        x, w = node.args
        if not (isinstance(w, fx.Node) and w.op == "get_attr"):
            continue
        attr = f"_bf16_emul_linear{i}"
        gm.register_buffer(attr, _attr(gm, w.target).t().contiguous())
        with graph.inserting_before(node):
            wt = graph.get_attr(attr)
            lin = graph.call_function(aten.linear.default, (x, wt))
        lin.meta = dict(node.meta)
        node.replace_all_uses_with(lin)
        graph.erase_node(node)


def emulated_step(model, max_chunk: int, rounding: str = "veltkamp"):
    """The streaming step of the bf16 ``model`` (modified in place: ``server_structure``) as
    an fp32 program rounding where the stage rounds: ``run(codes [1, Q, n], state) ->
    (wav, state)`` with the state as fp32 tensors (bf16 values), like ``load_program``'s."""
    from torch.export import Dim

    from omni_stream.export.code2wav_step import Code2WavStep, initial_state

    server_structure(model)
    step = Code2WavStep(model).eval()
    state = initial_state(model)
    codes = torch.zeros(1, model.cfg.num_quantizers, max_chunk, dtype=torch.long)
    with torch.no_grad():
        ep = torch.export.export(step, (codes, *state), strict=False, dynamic_shapes=(
            {2: Dim("frames", min=1, max=max_chunk)}, tuple(None for _ in state)))
    gm = ep.module()
    emulate_bf16(gm, rounding)

    def run(codes: Tensor, state: list[Tensor]):
        state = [s.float() if s.dtype == torch.bfloat16 else s for s in state]
        with torch.no_grad():
            wav, *new = gm(codes.contiguous(), *state)
        return wav, new

    return run

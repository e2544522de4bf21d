"""NPU-friendly op allowlist and the sanitizer that makes exported graphs converter-ready.

Allowlist (ONNX default domain). Every op here has a direct lowering in the Qualcomm QNN HTP
op set and in TFLite builtins, so a graph made of them converts without fallbacks:

    linear algebra   MatMul, Gemm
    elementwise      Add, Sub, Mul, Div, Neg, Sqrt, Reciprocal, Exp, Sin, Sigmoid, Tanh, Erf, Gelu,
                     Clip, Max, Min
    reductions       ReduceMean, Softmax (the fused op only)
    layout           Reshape, Transpose, Concat, Slice, Split, Squeeze, Unsqueeze, Gather
    convolution      Conv, ConvTranspose (Code2Wav)
    normalisation    LayerNormalization (Code2Wav ConvNeXt)
    constants        Constant, Identity, Cast
    quantization     QuantizeLinear, DequantizeLinear (QDQ variants)

Absent on purpose: IsNaN / IsInf / Where (guards the exporter adds for masked softmax; the
runtime's finite additive mask makes them dead code and NPU converters reject or fall back on
them), Expand (GQA here reshapes the query instead), ScatterND / ScatterElements (cache writes
happen in the runtime: ring slots), Range, Shape, ConstantOfShape and Equal (dynamic-shape
plumbing: every shape here is static), If / Loop.

The sanitizer rewrites what ``torch.onnx`` emits into that form:
  * ``Where(IsNaN(x), c, x)`` and ``Where(IsInf(x), c, x)`` guards collapse to ``x``;
  * Reshape gets ``allowzero=0`` (converters reject 1; safe when the shape holds no 0);
  * rank-0 ``axes`` initializers of Unsqueeze/Squeeze become rank-1 (converters expect 1-D);
  * ``Pow(x, 2)`` becomes ``Mul(x, x)`` (Code2Wav's Snake activation squares a sine);
  * nodes left without consumers are dropped; ``onnx.checker`` then runs on the result.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

log = logging.getLogger(__name__)

NPU_OPS: frozenset[str] = frozenset({
    "MatMul", "Gemm",
    "Add", "Sub", "Mul", "Div", "Neg", "Sqrt", "Reciprocal", "Exp", "Sin", "Sigmoid", "Tanh",
    "Erf", "Gelu", "Clip", "Max", "Min",
    "ReduceMean", "Softmax",
    "Reshape", "Transpose", "Concat", "Slice", "Split", "Squeeze", "Unsqueeze", "Gather",
    "Conv", "ConvTranspose", "LayerNormalization",
    "Constant", "Identity", "Cast",
    "QuantizeLinear", "DequantizeLinear",
})

_GUARDS = ("IsNaN", "IsInf")


class OpCheckError(ValueError):
    """A graph with ops outside the NPU allowlist, or one the checker rejects."""


def op_histogram(model) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def check_ops(model, allow: frozenset[str] = NPU_OPS) -> None:
    """Raise naming every op (and its count) that is not on the allowlist."""
    bad = {op: c for op, c in op_histogram(model).items() if op not in allow}
    if bad:
        listing = ", ".join(f"{op} x{c}" for op, c in sorted(bad.items()))
        raise OpCheckError(f"ops outside the NPU allowlist: {listing} (see omni_stream/export/onnx_ops.py)")


def _consumers(graph) -> Counter:
    used = Counter()
    for n in graph.node:
        used.update(i for i in n.input if i)
    used.update(o.name for o in graph.output)
    return used


def _remove_guards(graph) -> int:
    """Collapse ``Where(IsNaN(x) | IsInf(x), c, x)`` to ``x`` (rename the Where's output)."""
    produced_by = {o: n for n in graph.node for o in n.output}
    rename: dict[str, str] = {}
    drop = set()
    for n in graph.node:
        if n.op_type != "Where" or len(n.input) != 3:
            continue
        cond = produced_by.get(n.input[0])
        if cond is None or cond.op_type not in _GUARDS:
            continue
        guarded = cond.input[0]
        if n.input[2] != guarded:
            continue  # not "x unless NaN/Inf": a real select, leave it (the allowlist rejects it)
        rename[n.output[0]] = guarded
        drop.add(id(n))
    if not rename:
        return 0
    kept = [n for n in graph.node if id(n) not in drop]
    for n in kept:
        for i, name in enumerate(n.input):
            while name in rename:
                name = rename[name]
            n.input[i] = name
    for o in graph.output:  # a guarded graph output: keep the name with an Identity
        if o.name in rename:
            import onnx

            kept.append(onnx.helper.make_node("Identity", [rename[o.name]], [o.name]))
    del graph.node[:]
    graph.node.extend(kept)
    return len(rename)


def _drop_dead(graph) -> int:
    removed = 0
    while True:
        used = _consumers(graph)
        keep = [n for n in graph.node if any(used[o] for o in n.output)]
        if len(keep) == len(graph.node):
            break
        removed += len(graph.node) - len(keep)
        del graph.node[:]
        graph.node.extend(keep)
    used = _consumers(graph)
    inits = [t for t in graph.initializer if used[t.name]]
    if len(inits) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(inits)
    return removed


def _constants(graph) -> dict:
    """name -> TensorProto of every initializer and Constant node output."""
    consts = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    consts[n.output[0]] = a.t
    return consts


def _square_pow(graph) -> int:
    """``Pow(x, 2)`` (a constant exponent of 2, e.g. Code2Wav's Snake ``sin(.)**2``) becomes
    ``Mul(x, x)``: the same correctly rounded square, with an op every NPU converter lowers."""
    from onnx import numpy_helper

    consts = _constants(graph)
    fixed = 0
    for n in graph.node:
        if n.op_type != "Pow" or n.input[1] not in consts:
            continue
        e = numpy_helper.to_array(consts[n.input[1]])
        if e.size != 1 or float(e.reshape(-1)[0]) != 2.0:
            continue  # another exponent: left for the allowlist to reject
        n.op_type = "Mul"
        n.input[1] = n.input[0]
        del n.attribute[:]
        fixed += 1
    return fixed


def _fix_reshape(graph) -> int:
    from onnx import numpy_helper

    consts = _constants(graph)
    fixed = 0
    for n in graph.node:
        if n.op_type != "Reshape":
            continue
        for a in n.attribute:
            if a.name == "allowzero" and a.i != 0:
                shape = consts.get(n.input[1])
                if shape is None or 0 in numpy_helper.to_array(shape).tolist():
                    raise OpCheckError(f"Reshape '{n.name}' needs allowzero=1 (its shape may hold 0); "
                                       "cannot sanitize for NPU converters")
                a.i = 0
                fixed += 1
    return fixed


def _fix_axes(graph) -> int:
    from onnx import numpy_helper

    fixed = 0
    axes_names = {n.input[1] for n in graph.node
                  if n.op_type in ("Unsqueeze", "Squeeze") and len(n.input) > 1 and n.input[1]}
    for t in graph.initializer:
        if t.name in axes_names and len(t.dims) == 0:
            arr = numpy_helper.to_array(t).reshape(1)
            t.CopyFrom(numpy_helper.from_array(arr.astype(np.int64), t.name))
            fixed += 1
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] in axes_names:
            for a in n.attribute:
                if a.name == "value" and len(a.t.dims) == 0:
                    arr = numpy_helper.to_array(a.t).reshape(1)
                    a.t.CopyFrom(numpy_helper.from_array(arr.astype(np.int64)))
                    fixed += 1
    return fixed


def sanitize(model, allow: frozenset[str] = NPU_OPS, check: bool = True) -> dict[str, int]:
    """Rewrite ``model`` in place for NPU converters, check it, and return what changed.
    ``check=False`` skips ``onnx.checker`` (run it on the saved file: protos over 2 GB cannot
    be checked in memory); the op allowlist is always enforced."""
    import onnx

    g = model.graph
    report = {"guards_removed": _remove_guards(g), "reshape_allowzero_fixed": _fix_reshape(g),
              "axes_made_1d": _fix_axes(g), "pow2_to_mul": _square_pow(g)}
    report["dead_nodes_removed"] = _drop_dead(g)
    if check:
        onnx.checker.check_model(model, full_check=False)
    check_ops(model, allow)
    log.debug("sanitized: %s", report)
    return report


def lint(model) -> list[str]:
    """Everything the sanitizer forbids that is still in ``model`` (empty = clean)."""
    from onnx import numpy_helper

    problems = []
    inits = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type in _GUARDS or n.op_type == "Where":
            problems.append(f"{n.op_type} '{n.name}'")
        if n.op_type == "Reshape" and any(a.name == "allowzero" and a.i for a in n.attribute):
            problems.append(f"Reshape '{n.name}' allowzero=1")
        if n.op_type in ("Unsqueeze", "Squeeze") and len(n.input) > 1 and n.input[1] in inits:
            if numpy_helper.to_array(inits[n.input[1]]).ndim == 0:
                problems.append(f"{n.op_type} '{n.name}' rank-0 axes")
        if n.op_type not in NPU_OPS:
            problems.append(f"op {n.op_type} not in the allowlist")
    return problems

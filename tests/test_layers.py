"""Imports point down the stack only (docs/architecture.md, "Which way imports point")."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "omni_stream"

# top to bottom; a module may import its own package and anything in a lower layer
LAYERS = [
    {"cli", "integrations"},
    {"cluster"},
    {"server"},
    {"orchestrator"},
    {"stages"},
    {"export", "edge", "voices"},
    {"evaluation"},
    {"engine"},
    {"checkpoints"},
    {"models"},
    {"contract", "transport"},
    {"scheduling", "observability"},
    {"config"},
    {"errors"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "omni_stream" and len(parts) > 1 else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every omni_stream import in ``path``, lazy ones included."""
    package = path.relative_to(PKG.parent).with_suffix("").parts[:-1]  # the module's package
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
    return [(line, m) for line, m in out if m.startswith("omni_stream.")]


def test_every_package_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
            if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
            and p.name != "__init__.py"}
    assert tops <= set(RANK), f"add {sorted(tops - set(RANK))} to LAYERS and docs/architecture.md"


def test_no_module_imports_a_layer_above_it():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        here = _top(".".join(path.relative_to(PKG.parent).with_suffix("").parts))
        if here is None:
            continue
        for line, mod in _imports(path):
            there = _top(mod)
            if there is None or there == here:
                continue
            if RANK[there] <= RANK[here]:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} ({here}) imports {mod} "
                           f"({there})")
    assert not bad, "imports that point up (or sideways) the stack:\n" + "\n".join(bad)


def _module_of(name: str) -> str | None:
    """The module file an imported name lives in (a submodule, or the package's __init__)."""
    rel = Path(*name.split("."))
    if (PKG.parent / rel).with_suffix(".py").is_file():
        return name
    if (PKG.parent / rel / "__init__.py").is_file():
        return name
    return None


def _import_graph() -> dict[str, set[str]]:
    """module -> the omni_stream modules it imports (lazy imports included; ``from P import M``
    of a submodule M counts as importing M)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        me = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out = graph.setdefault(me, set())
        tree = ast.parse(path.read_text())
        package = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = list(package[:len(package) - node.level + 1])
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if not mod.startswith("omni_stream"):
                    continue
                for a in node.names:
                    target = _module_of(f"{mod}.{a.name}") or _module_of(mod)
                    if target and target != me:
                        out.add(target)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    target = _module_of(a.name) if a.name.startswith("omni_stream") else None
                    if target and target != me:
                        out.add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    """No two modules import each other, directly or around a loop, lazily or not (a package's
    __init__ re-exporting its modules is an import of them): each module of a package can be
    read, and moved, after the ones it uses."""
    found = _cycles(_import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)

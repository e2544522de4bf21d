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

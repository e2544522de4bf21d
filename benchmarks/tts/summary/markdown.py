"""Markdown cells and tables for SUMMARY.md: how a value reads in a cell, a table of rows, a
table of dicts (nested keys flattened), and a run's metadata line."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.tts.harness import markdown_table


def cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        a = abs(v)
        return f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 1 else f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(cell(x) for x in v) if len(v) <= 8 else f"[{len(v)} items]"
    if isinstance(v, dict):
        return f"{{{len(v)} keys}}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return "_(no rows)_\n"
    return markdown_table(headers, [[cell(v) for v in r] for r in rows]) + "\n"


def dict_table(rows: list[dict], keys: list[str] | None = None) -> str:
    rows = [flatten(r) for r in rows]
    if keys is None:
        keys = list(dict.fromkeys(k for r in rows for k in r))
    return table(keys, [[r.get(k) for k in keys] for r in rows])


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> dotted keys; lists of scalars stay (rendered inline), others by length."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict):
                out.update(flatten(v, key))
            elif isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
                out[key] = f"[{len(v)} items]"
            else:
                out[key] = v
    else:
        out[prefix or "value"] = obj
    return out


def meta_line(doc: dict, keys: tuple[str, ...]) -> str:
    parts = [f"{k}: `{cell(doc[k])}`" for k in keys if k in doc and doc[k] not in (None, "")]
    cmd = f"\n\nCommand: `{doc['command']}`" if doc.get("command") else ""
    return ("; ".join(parts) + cmd + "\n\n") if parts or cmd else ""

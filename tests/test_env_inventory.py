"""Every OMNI_STREAM_* variable the code reads is documented in docs/configuration.md, and
every documented one is read somewhere.

Reads are found in the syntax tree, not by grepping text, so docstrings and comments that
mention a variable do not count: ``os.environ.get/pop/setdefault(NAME)``, ``os.getenv(NAME)``,
``<anything>env<anything>.get(NAME)`` (an ``env`` mapping passed in), ``os.environ[NAME]`` in a
load, ``NAME in os.environ``, and module constants ``X = "OMNI_STREAM_..."`` (how
``ENV_VAR``/``API_KEY_ENV`` are declared and then read). Shell scripts: ``$NAME`` / ``${NAME``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCAN = ("omni_stream", "clients", "benchmarks", "tests", "scripts")
DOC = ROOT / "docs" / "configuration.md"
NAME = re.compile(r"OMNI_STREAM_[A-Z0-9_]+")
SHELL_READ = re.compile(r"\$\{?(OMNI_STREAM_[A-Z0-9_]+)")
DOC_ROW = re.compile(r"^\|\s*`(OMNI_STREAM_[A-Z0-9_]+)`\s*\|", re.M)
GETTERS = {"get", "pop", "setdefault", "getenv"}


def _const(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) \
            and NAME.fullmatch(node.value):
        return node.value
    return None


def _is_env(node: ast.AST) -> bool:
    """os.environ, environ, env, self.env, os (for os.getenv) ..."""
    text = ast.unparse(node)
    return "env" in text.lower() or text == "os"


def reads_in_python(source: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in GETTERS and _is_env(node.func.value) and node.args:
            if (name := _const(node.args[0])):
                found.add(name)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and _is_env(node.value):
            if (name := _const(node.slice)):
                found.add(name)
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn))
                                                  for o in node.ops):
            if (name := _const(node.left)) and any(_is_env(c) for c in node.comparators):
                found.add(name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            if (name := _const(node.value)):
                found.add(name)
    return found


def code_reads() -> dict[str, list[str]]:
    """variable -> files reading it."""
    where: dict[str, list[str]] = {}
    for top in SCAN:
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or path == Path(__file__).resolve():
                continue
            if path.suffix == ".py":
                names = reads_in_python(path.read_text(errors="replace"))
            elif path.suffix == ".sh":
                names = set(SHELL_READ.findall(path.read_text(errors="replace")))
            else:
                continue
            for n in names:
                where.setdefault(n, []).append(str(path.relative_to(ROOT)))
    return where


def documented() -> set[str]:
    return set(DOC_ROW.findall(DOC.read_text()))


def test_every_variable_code_reads_is_documented():
    missing = {n: files for n, files in code_reads().items() if n not in documented()}
    assert not missing, ("add these to the table in docs/configuration.md (default and why): "
                         + "; ".join(f"{n} (read in {', '.join(f)})"
                                     for n, f in sorted(missing.items())))


def test_every_documented_variable_is_read_by_code():
    stale = sorted(documented() - set(code_reads()))
    assert not stale, f"docs/configuration.md lists variables no code reads: {', '.join(stale)}"


def test_inventory_finds_the_known_variables():
    # a guard against the scanner silently finding nothing
    known = {"OMNI_STREAM_CACHE_DIR", "OMNI_STREAM_API_KEY", "OMNI_STREAM_STEP_STATS_DIR",
             "OMNI_STREAM_STEP_STATS_INTERVAL", "OMNI_STREAM_HW_PROFILE", "OMNI_STREAM_REFENV_DIR",
             "OMNI_STREAM_REFENV_TORCH", "OMNI_STREAM_REFENV_VERBOSE",
             "OMNI_STREAM_SKIP_REFERENCE", "OMNI_STREAM_SHM_DIR", "OMNI_STREAM_REFENV_PYTHON"}
    assert known <= set(code_reads())


def test_scanner_counts_reads_not_mentions():
    src = '''
"""Docstring naming OMNI_STREAM_DOCSTRING."""
import os
# comment naming OMNI_STREAM_COMMENT
ENV_X = "OMNI_STREAM_CONST"
a = os.environ.get("OMNI_STREAM_GET", "1")
b = os.getenv("OMNI_STREAM_GETENV")
c = os.environ["OMNI_STREAM_SUBSCRIPT"]
d = "OMNI_STREAM_IN" in os.environ
e = env.get("OMNI_STREAM_ENV_ARG")
os.environ["OMNI_STREAM_WRITE_ONLY"] = "x"
del os.environ["OMNI_STREAM_DEL_ONLY"]
msg = f"set OMNI_STREAM_IN_MESSAGE to fix"
other.get("OMNI_STREAM_NOT_ENV")
'''
    assert reads_in_python(src) == {
        "OMNI_STREAM_CONST", "OMNI_STREAM_GET", "OMNI_STREAM_GETENV", "OMNI_STREAM_SUBSCRIPT",
        "OMNI_STREAM_IN", "OMNI_STREAM_ENV_ARG"}
    assert SHELL_READ.findall('x="${OMNI_STREAM_A:-1}" $OMNI_STREAM_B # OMNI_STREAM_C') == [
        "OMNI_STREAM_A", "OMNI_STREAM_B"]

"""The suite's lanes, read from what each test starts (``conftest.py`` applies them).

- ``ray``: a local Ray cluster (the cluster entry's tests).
- ``reference``: the official qwen-tts package or vLLM, each in an environment of its own.
- ``process``: any other process: a real pipeline's stage processes (``PipelineBackend``), the
  CLI or a child interpreter (``subprocess``), a ``multiprocessing`` child, a browser
  (Chromium, for the playground and dashboard tests).
- ``compile``: a program built from the model or the sources: ``torch.compile``,
  ``torch.export``, the ONNX / ExecuTorch exports (``export-step``, ``export-decoder``), a C++
  build of the CPU runtime (a compiler runs, in this process or as a child).
- ``unit``: none of these and not hand-marked ``slow``: pure functions and tiny models in this
  process. ``bash scripts/test.sh --fast`` runs this lane alone (``-m unit``).

Nobody labels a test by hand. Its lane comes from its code: the names the test function uses,
together with the fixtures it requests and the helpers of tests/ it calls (each followed
through, transitively), are matched against ``STARTS``. The reading is static, so a start
hidden behind a call into the package can be missed: ``Guard`` then turns it into a failure
that names the test and what it started, rather than a unit lane that is slow or hangs.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterable

TESTS_DIR = Path(__file__).resolve().parent

# What starts each kind of process, as the reader sees code: an identifier, an attribute,
# ``name.attribute``, an imported module (and its root), ``module.name`` of a ``from`` import,
# or ``argv:WORD`` for a list whose first item is the string WORD (a command line).
STARTS: dict[str, frozenset[str]] = {
    "ray": frozenset({"ray", "LocalCluster", "ray_cluster", "base_cluster"}),
    "reference": frozenset({"ensure_reference_env", "refenv", "official_runner", "refpy",
                            "vllm_py", "vllm_checks", "omni_stream.engine.vllm.env"}),
    "process": frozenset({"PipelineBackend", "Supervisor", "subprocess", "multiprocessing",
                          "get_context", "ProcessPoolExecutor",
                          "sys.executable", "os.fork", "os.system",
                          "agents_server", "agents_base_server",
                          "browser", "ui_server", "ui_base_server"}),
    "compile": frozenset({"torch.compile", "compile_engine", "torch.export",
                          "omni_stream.engine.cpu.build.build",
                          "argv:export-decoder", "argv:export-step"}),
}
LANES = {
    "ray": "starts a local Ray cluster (tests/lanes.py)",
    "reference": "runs the official qwen-tts package or vLLM in its own environment "
                 "(tests/lanes.py)",
    "process": "starts a process: stage processes, a subprocess or a multiprocessing child "
               "(tests/lanes.py)",
    "compile": "builds a program: torch.compile, torch.export, an ONNX or ExecuTorch export, "
               "a C++ build (tests/lanes.py)",
    "unit": "starts nothing of the above and is not slow: the fast lane "
            "(bash scripts/test.sh --fast; tests/lanes.py)",
}


# ---------------------------------------------------------------- reading the code
def _names(tree: ast.AST) -> set[str]:
    """Every identifier, attribute, ``name.attribute``, imported module (with its root) and
    command line head (``argv:WORD``) in ``tree``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
            if isinstance(node.value, ast.Name):
                out.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                out.update((a.name, a.name.split(".")[0], a.asname or a.name))
        elif (isinstance(node, (ast.List, ast.Tuple)) and node.elts
              and isinstance(node.elts[0], ast.Constant) and isinstance(node.elts[0].value, str)):
            out.add(f"argv:{node.elts[0].value}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.update((node.module, node.module.split(".")[0]))
            out.update(a.asname or a.name for a in node.names)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _defined_in_tests(obj: Any) -> bool:
    """Whether ``obj`` is code of tests/ (other than this file: the guard starts nothing)."""
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        return False
    if path is None:
        return False
    path = Path(path).resolve()
    return path.is_relative_to(TESTS_DIR) and path != Path(__file__).resolve()


class Reader:
    """The names a function uses, with those of the tests/ helpers it refers to (cached)."""

    def __init__(self) -> None:
        self._own: dict[Any, tuple[set[str], dict[str, Any]]] = {}
        self._assigns: dict[str, dict[str, ast.AST]] = {}

    def _read(self, obj: Any) -> tuple[set[str], dict[str, Any]]:
        """(names in ``obj``'s source, the module globals they resolve in)."""
        if obj not in self._own:
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
            except (OSError, TypeError, SyntaxError):
                tree = ast.Module(body=[], type_ignores=[])
            for node in ast.walk(tree):  # marks and fixture params are not what it runs
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    node.decorator_list = []
            names = _names(tree)
            module = inspect.getmodule(obj)
            self._own[obj] = (names, vars(module) if module is not None else {})
        return self._own[obj]

    def _module_value(self, scope: dict[str, Any], name: str) -> set[str]:
        """Names in the value of a top-level ``name = ...`` of a tests/ module (``SPAWN =
        mp.get_context("spawn")``), else none."""
        path = scope.get("__file__")
        if not path or not Path(path).resolve().is_relative_to(TESTS_DIR):
            return set()
        if path not in self._assigns:
            found: dict[str, ast.AST] = {}
            try:
                tree = ast.parse(Path(path).read_text())
            except (OSError, SyntaxError):
                tree = ast.Module(body=[], type_ignores=[])
            for node in tree.body:
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [node.target] if isinstance(node, ast.AnnAssign) and node.value
                           else [])
                for t in targets:
                    if isinstance(t, ast.Name):
                        found[t.id] = node.value
            self._assigns[path] = found
        value = self._assigns[path].get(name)
        return _names(value) if value is not None else set()

    def names(self, roots: Iterable[Any]) -> set[str]:
        """Names used by ``roots`` and, transitively, by the functions, classes and top-level
        values of tests/ (test modules, conftest, helper modules) that they name."""
        seen: set[int] = set()
        out: set[str] = set()
        todo = list(roots)
        while todo:
            obj = inspect.unwrap(todo.pop())
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            names, scope = self._read(obj)
            values = set().union(*(self._module_value(scope, n) for n in names))
            out |= names | values
            for n in names | values:
                ref = scope.get(n)
                if ((inspect.isfunction(ref) or inspect.isclass(ref) or inspect.ismodule(ref))
                        and _defined_in_tests(ref)):
                    todo.append(ref)
        return out


def lanes_of(names: set[str], fixtures: Iterable[str]) -> set[str]:
    """The starting lanes (``STARTS`` keys) that ``names`` and ``fixtures`` reach."""
    used = names | set(fixtures)
    return {lane for lane, starters in STARTS.items() if used & starters}


def item_fixtures(item: Any) -> dict[str, list[Any]]:
    """Fixture name -> its functions (those of tests/), for every fixture ``item`` requests
    (transitively) and every one a string parameter of it names (a test that calls
    ``request.getfixturevalue(param)``)."""
    info = getattr(item, "_fixtureinfo", None)
    found = dict(info.name2fixturedefs) if info is not None else {}
    callspec = getattr(item, "callspec", None)
    manager = getattr(item.session, "_fixturemanager", None)
    for value in (callspec.params.values() if callspec is not None else ()):
        if isinstance(value, str) and value not in found and manager is not None:
            defs = manager.getfixturedefs(value, item)
            if defs:
                found[value] = defs
    return {name: [d.func for d in defs if _defined_in_tests(inspect.unwrap(d.func))]
            for name, defs in found.items()}


def item_lanes(item: Any, reader: Reader) -> set[str]:
    """The starting lanes the code of ``item`` (and of its fixtures) reaches."""
    fixtures = item_fixtures(item)
    roots = [item.obj] + [f for funcs in fixtures.values() for f in funcs]
    return lanes_of(reader.names(roots), fixtures)


# ---------------------------------------------------------------- the runtime guard
class StartsAProcess(AssertionError):
    """A test of the unit lane started (or tried to start) a process."""


class Guard:
    """While active, every way this interpreter starts a process raises ``StartsAProcess``
    (and is remembered, so an ``except Exception`` in the code under test cannot hide it):
    ``subprocess`` (and so ``asyncio``'s subprocesses), ``multiprocessing`` children and its
    helpers, ``os.fork``/``posix_spawn``/``system``, and ``ray.init``."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def _refuse(self, what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            self.seen.append(what(*args) if callable(what) else what)
            raise StartsAProcess(f"this test {self.seen[-1]}")
        return refuse

    def _patch(self, owner: Any, attr: str, what: Any) -> None:
        if hasattr(owner, attr):
            self._undo.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, self._refuse(what))

    def __enter__(self) -> "Guard":
        import _posixsubprocess
        import multiprocessing.process
        import subprocess
        import sys

        self.seen.clear()
        self._patch(subprocess.Popen, "_execute_child",
                    lambda popen, args, *rest: f"starts a subprocess ({_cmd(args)})")
        self._patch(multiprocessing.process.BaseProcess, "start",
                    lambda p: f"starts a multiprocessing process ({p.name})")
        self._patch(_posixsubprocess, "fork_exec",
                    lambda args, *rest: f"starts a process ({_cmd(args)})")
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            self._patch(os, name, f"starts a process (os.{name})")
        if "ray" in sys.modules:
            self._patch(sys.modules["ray"], "init", "starts or joins a Ray cluster (ray.init)")
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._undo:
            owner, attr, old = self._undo.pop()
            setattr(owner, attr, old)


def _cmd(args: Any) -> str:
    if isinstance(args, (list, tuple)):
        args = " ".join(os.fsdecode(a) if isinstance(a, (bytes, str)) else str(a)
                        for a in args)
    return str(args)[:200]

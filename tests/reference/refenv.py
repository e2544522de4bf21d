"""Isolated virtual environment that runs the official ``qwen-tts`` package as a reference.

The official package pins ``transformers==4.57.3`` and imports librosa, soundfile, sox,
onnxruntime and torchaudio at module level (torchaudio would pull a different torch build), so
it cannot live in omni-stream's own environment. ``ensure_reference_env()`` builds a separate
venv once (about a minute on a 2-core machine, ~1.6 GB, mostly the CPU torch wheel) and returns
its python executable. Only the standard library is used here.

- Location: ``$OMNI_STREAM_REFENV_DIR``, default ``~/.cache/omni-stream/refenv-v1``.
- Concurrency: an ``fcntl.flock`` on ``<dir>.lock`` serialises builders; the marker file
  ``<dir>/.refenv-ok`` is written last, so a half-built env is wiped and rebuilt.
- sox, onnxruntime and torchaudio are replaced by stub modules (``<dir>/refstubs``, appended to
  ``sys.path`` by a ``.pth`` file). They are only used by the 25 Hz tokenizer, which the 12 Hz
  models never touch; every attribute of a stub raises, so a code path that needs one fails
  loudly instead of computing something wrong.

CLI: ``python -m tests.reference.refenv`` prints the python path (building if needed);
``--rebuild`` forces a fresh build, ``--quiet`` hides pip's output.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# torch MUST stay at exactly this version: this machine image ships the CPU wheel
# (``2.13.0+cpu``, found through pip's find-links); any other version makes pip download a
# multi-GB CUDA build from the index.
TORCH_REQ = os.environ.get("OMNI_STREAM_REFENV_TORCH", "torch==2.13.0")
# Installed with their dependencies. accelerate is the version qwen-tts pins (transformers
# uses it for loading when present); librosa is real (speaker-encoder mel filterbank, audio
# loading and resampling), einops is imported by the 25 Hz tokenizer.
REQUIREMENTS = [
    "transformers==4.57.3",
    "accelerate==1.12.0",
    "librosa==0.11.0",
    "soundfile>=0.12",
    "einops>=0.8",
    "numpy>=1.26",
    "safetensors>=0.4",
]
QWEN_TTS_REQ = "qwen-tts==0.1.1"  # installed with --no-deps

# module name -> submodules to create; each becomes a package whose attributes all raise.
STUBS = {
    "sox": [],
    "onnxruntime": [],
    "torchaudio": ["compliance", "compliance.kaldi"],
}
STUB_VERSION = 1

_STUB_SOURCE = '''"""omni-stream reference-env stub for {name!r}: the real package is not installed.

qwen-tts imports it at module level for its 25 Hz tokenizer only; nothing the 12 Hz models run
uses it. Any attribute access raises so an accidental use fails loudly.
"""


def __getattr__(attr):
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    raise RuntimeError(
        "{name}.%s: {name!r} is a stub in the omni-stream reference environment "
        "(see tests/reference/README.md)" % attr
    )
'''

MARKER_NAME = ".refenv-ok"


def _spec() -> dict:
    return {
        "torch": TORCH_REQ,
        "requirements": REQUIREMENTS,
        "qwen_tts": QWEN_TTS_REQ,
        "stubs": sorted(STUBS),
        "stub_version": STUB_VERSION,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def refenv_dir() -> Path:
    env = os.environ.get("OMNI_STREAM_REFENV_DIR")
    if env:
        return Path(env).expanduser().resolve()
    return Path.home() / ".cache" / "omni-stream" / "refenv-v1"


def _python_of(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def _is_ready(env_dir: Path) -> bool:
    marker = env_dir / MARKER_NAME
    if not marker.is_file() or not _python_of(env_dir).exists():
        return False
    try:
        return json.loads(marker.read_text()).get("spec") == _spec()
    except (OSError, ValueError):
        return False


def _base_python() -> str:
    """The interpreter the venv is made from (the CPU torch wheel here is cp311)."""
    override = os.environ.get("OMNI_STREAM_REFENV_PYTHON")
    if override:
        return override
    return getattr(sys, "_base_executable", None) or sys.executable


def _run(cmd: list[str], quiet: bool) -> None:
    out = subprocess.DEVNULL if quiet else sys.stderr
    # pip's index/find-links/constraints settings come from the machine's pip config; make sure
    # the child does not inherit a PYTHONPATH pointing into omni-stream's environment.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, env=env, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"reference env build step failed ({proc.returncode}): {' '.join(cmd)}\n"
            + proc.stderr[-4000:]
        )


def _write_stubs(env_dir: Path, py: Path) -> None:
    stub_root = env_dir / "refstubs"
    if stub_root.exists():
        shutil.rmtree(stub_root)
    for name, subs in STUBS.items():
        for mod in [name] + [f"{name}.{s}" for s in subs]:
            pkg_dir = stub_root.joinpath(*mod.split("."))
            pkg_dir.mkdir(parents=True, exist_ok=True)
            (pkg_dir / "__init__.py").write_text(_STUB_SOURCE.format(name=mod))
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    # A .pth line APPENDS to sys.path, so a real package (if someone installs it) still wins.
    Path(site, "zz_omni_stream_refstubs.pth").write_text(str(stub_root) + "\n")


_SMOKE = (
    "import warnings; warnings.simplefilter('ignore');"
    "import torch, transformers, qwen_tts, librosa;"
    "from qwen_tts.core import Qwen3TTSTokenizerV2Model;"
    "from qwen_tts.core.models import Qwen3TTSForConditionalGeneration;"
    "import json; print(json.dumps({'torch': torch.__version__,"
    " 'transformers': transformers.__version__}))"
)


def _build(env_dir: Path, quiet: bool) -> dict:
    t0 = time.monotonic()
    if env_dir.exists():
        shutil.rmtree(env_dir)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    _run([_base_python(), "-m", "venv", str(env_dir)], quiet)
    py = _python_of(env_dir)
    pip = [str(py), "-m", "pip", "install", "--no-input", "--prefer-binary"]
    if quiet:
        pip.append("-q")
    _run(pip + [TORCH_REQ] + REQUIREMENTS, quiet)
    _run(pip + ["--no-deps", QWEN_TTS_REQ], quiet)
    _write_stubs(env_dir, py)
    versions = subprocess.run([str(py), "-c", _SMOKE], capture_output=True, text=True)
    if versions.returncode != 0:
        raise RuntimeError("reference env smoke import failed:\n" + versions.stderr[-4000:])
    info = json.loads(versions.stdout.strip().splitlines()[-1])
    if "+cpu" not in info["torch"] and "OMNI_STREAM_REFENV_TORCH" not in os.environ:
        print(f"refenv: warning: torch {info['torch']} is not the local CPU wheel", file=sys.stderr)
    info["build_seconds"] = round(time.monotonic() - t0, 1)
    (env_dir / MARKER_NAME).write_text(json.dumps({"spec": _spec(), "info": info}, indent=1))
    return info


def ensure_reference_env(rebuild: bool = False, quiet: bool = False) -> Path:
    """Return the reference venv's python, building the venv first if it is missing or stale."""
    env_dir = refenv_dir()
    if not rebuild and _is_ready(env_dir):
        return _python_of(env_dir)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = env_dir.parent / (env_dir.name + ".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building: wait for it
        try:
            if rebuild or not _is_ready(env_dir):
                print(f"refenv: building the reference environment in {env_dir} ...",
                      file=sys.stderr)
                info = _build(env_dir, quiet)
                print(f"refenv: built in {info['build_seconds']} s ({info})", file=sys.stderr)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return _python_of(env_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.reference.refenv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rebuild", action="store_true", help="wipe and rebuild the environment")
    ap.add_argument("--quiet", action="store_true", help="hide pip's output")
    args = ap.parse_args(argv)
    print(ensure_reference_env(rebuild=args.rebuild, quiet=args.quiet))
    return 0


if __name__ == "__main__":
    sys.exit(main())

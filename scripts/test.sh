#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, including the parity tests against the
# official qwen-tts package (built once in an isolated env under ~/.cache/omni-stream).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"

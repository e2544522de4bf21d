#!/usr/bin/env bash
# Set up (if needed) and start the server on the embedded default model (no download).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/omni-stream serve "$@"

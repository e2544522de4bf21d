#!/usr/bin/env bash
# Set up (if needed) and run the test suite.
#   bash scripts/test.sh [PYTEST ARGS]         the whole suite, including the parity tests against
#                                              the official qwen-tts package (built once in an
#                                              isolated env under ~/.cache/omni-stream); CI runs it
#   bash scripts/test.sh --fast [PYTEST ARGS]  the unit lane (-m unit): the tests that start no
#                                              process, compiler, Ray cluster or reference
#                                              environment (tests/lanes.py), on one torch
#                                              thread; a few minutes
# A -m EXPR given with --fast narrows the unit lane (-m "unit and (EXPR)").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
fast=0
marker=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --fast) fast=1 ;;
    -m) [ $# -ge 2 ] || { echo "scripts/test.sh: -m needs an expression" >&2; exit 2; }
        marker="$2"; shift ;;
    -m?*) marker="${1#-m}" ;;
    *) args+=("$1") ;;
  esac
  shift
done
if [ "$fast" = 1 ]; then
  marker="unit${marker:+ and ($marker)}"
  args=(--torch-threads 1 ${args[@]+"${args[@]}"})  # tiny models: a 2nd thread only waits
fi
exec .venv/bin/python -m pytest -q ${marker:+-m "$marker"} ${args[@]+"${args[@]}"}

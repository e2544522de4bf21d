#!/usr/bin/env bash
# GPU benchmarks in one go (under 5 minutes on one recent NVIDIA GPU):
#   1. a random 0.6B-shaped bf16 checkpoint (reused if already there),
#   2. benchmarks/tts/gpu_frame_bench.py: engine step vs streams, CUDA graphs on and off,
#   3. benchmarks/tts/stream_latency_bench.py against `omni-stream serve --device cuda --dtype bf16`
#      at concurrency 1, 8, 32 (the server runs the eager step: it does not use CUDA graphs),
#   4. benchmarks/tts/vllm_bench.py --device cuda (the talker on vLLM vs torch), where $PY or
#      VLLM_PY has a CUDA build of vLLM,
#   5. benchmarks/tts/summarize.py over everything in benchmarks/tts/results/.
# A step that fails or runs out of time is reported and the next one still runs (exit 1 at the
# end); each is stopped with SIGINT first, so the latency benchmark shuts its server down.
#
# Usage, from anywhere, on a CUDA machine with the repo and its Python deps (torch with CUDA,
# aiohttp, rich, safetensors, numpy; matplotlib for the plots):
#   bash benchmarks/tts/gpu_run.sh                 # checkpoint in /tmp/ck-06b-gpu
#   CK=/path/to/checkpoint PY=.venv/bin/python bash benchmarks/tts/gpu_run.sh
# Knobs (environment): PY, CK, STREAMS (1,8,32,128), CONC (1,8,32), FRAMES (60 per request).
set -uo pipefail

cd "$(dirname "$0")/../.."
PY=${PY:-python}
CK=${CK:-/tmp/ck-06b-gpu}
STREAMS=${STREAMS:-1,8,32,128}
CONC=${CONC:-1,8,32}
FRAMES=${FRAMES:-60}
RES=benchmarks/tts/results
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS
FAILED=()

step() { echo; echo "=== [$((SECONDS - START)) s] $*"; }
# run NAME SECONDS CMD...: SIGINT at the limit, SIGKILL 20 s later
run() {
    local name=$1 limit=$2
    shift 2
    step "$name"
    if ! timeout -s INT -k 20 "$limit" "$@"; then
        echo "!!! $name failed or ran past ${limit} s"
        FAILED+=("$name")
    fi
}

step "checking the environment"
"$PY" - <<'EOF' || exit 1
import importlib.util, sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_run.sh: torch sees no CUDA device (torch %s): run this on a GPU machine "
             "with a CUDA build of torch" % torch.__version__)
missing = [m for m in ("aiohttp", "rich", "safetensors", "numpy") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit("gpu_run.sh: missing Python packages: %s (pip install -e . or pip install %s)"
             % (", ".join(missing), " ".join(missing)))
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))
EOF

if [ -f "$CK/config.json" ] && [ -f "$CK/speech_tokenizer/model.safetensors" ]; then
    step "reusing checkpoint $CK"
else
    step "writing a random 0.6B checkpoint to $CK"
    "$PY" -m omni_stream.cli make-checkpoint --preset 0.6b --variant custom_voice --seed 0 \
        --out "$CK" || exit 1
fi

run "engine step vs streams, CUDA graphs on/off (gpu_frame_bench.py)" 120 \
    "$PY" benchmarks/tts/gpu_frame_bench.py --model "$CK" --device cuda --dtype bf16 \
    --streams "$STREAMS" --out "$RES/gpu_frame_bench.json"

MAXC=$(echo "$CONC" | tr ',' '\n' | sort -n | tail -1)
run "streaming latency against omni-stream serve --device cuda (concurrency $CONC)" 150 \
    "$PY" benchmarks/tts/stream_latency_bench.py --model "$CK" \
    --server-args "--device cuda --dtype bf16 --max-streams $MAXC --max-seq-len 512 --max-queue 64" \
    --concurrency "$CONC" --max-new-tokens "$FRAMES" --label 0.6b-cuda-bf16 \
    --out "$RES/stream_latency_0.6b_cuda.json"

# the talker on vLLM beside the torch engine (needs a CUDA build of vLLM in $PY, or VLLM_PY:
# a python that has one; the device machines here reach no package index, so it is skipped
# where none is installed)
VLLM_PY=${VLLM_PY:-$PY}
if "$VLLM_PY" -c "import vllm" 2>/dev/null; then
    run "talker engines: vllm vs torch on cuda (vllm_bench.py)" 240 \
        "$VLLM_PY" benchmarks/tts/vllm_bench.py --model "$CK" --device cuda --rounds 1 \
        --tag 0.6b_cuda
else
    step "vllm_bench.py skipped: no vLLM in $VLLM_PY (set VLLM_PY to a python with a CUDA vLLM)"
fi

run "summary (SUMMARY.md, summary.json, plots)" 60 "$PY" benchmarks/tts/summarize.py

step "done in $((SECONDS - START)) s"
if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${FAILED[@]}"
    exit 1
fi

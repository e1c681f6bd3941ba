#!/bin/bash
# Sourced by the GPU session scripts: the carried wheels installed, then `step`, which runs one
# command under its own time limit so that one running long leaves the others their time.
#
# The device returns at most 8 files from $OUT, so each step's log and whatever it writes (benches
# write their JSON and plots under $OUT) go to $RESULTS, which is packed into $OUT/results.tgz after
# every step; a call killed at its limit still returns the steps that finished. $OUT/summary.log
# holds each step's time, exit status and the lines that carry its figures.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# PYTHONFAULTHANDLER: a step stopped at its limit (SIGABRT, below) prints every thread's stack, so its
# log says where it was.
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH=/tmp/site:$PWD
DEVICE_OUT=$OUT
RESULTS=/tmp/results
mkdir -p "$RESULTS"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$DEVICE_OUT/summary.log"; }
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    el "$name (limit ${limit} s)"
    OUT=$RESULTS timeout -s ABRT -k 10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    el "$name rc=$?"
    grep -E "^(FAILED|ERROR)|Error|passed|failed|tok/s|ratio|TTFT|ttft|kv_cache|best|wrote|target|×|[0-9]x\b|p99|Jain" \
        "$RESULTS/$name.log" | tail -"${SUMMARY_LINES:-16}" | tee -a "$DEVICE_OUT/summary.log"
    tar czf "$DEVICE_OUT/results.tgz" -C "$RESULTS" .
}
gpu_memory_gib() { nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print int($1/1024)}'; }
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
    git log -1 --format=%h 2>/dev/null
} | tee -a "$DEVICE_OUT/summary.log"

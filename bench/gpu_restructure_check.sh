#!/bin/bash
# A restructuring of GPU code checked on one lent GPU, against the tree it started from, in one call
# each (the device README's limits: 10 minutes a call):
#
#   git archive <base commit> gpuworker tests bench controlplane pyproject.toml Makefile manage.py \
#       | tar x -C .baseline                     # .baseline/ and .whl/ ignored, named in `carry`
#   bash bench/gpu_restructure_check.sh suite    # the GPU suite at this tree, then the sm_90 PTX of every
#                                                # kernel variant it compiled against the base tree's
#   bash bench/gpu_restructure_check.sh bench    # batch 1 and 512 requests, base and this tree, twice
#
# Writes summary.log and the logs and PTX inventories under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
NEW=$PWD
BASE=$PWD/.baseline
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/summary.log"; }
{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} | tee "$OUT/summary.log"

suite() {
    el "GPU suite, this tree"
    (cd "$NEW" && PYTHONPATH=/tmp/site:$NEW TRITON_CACHE_DIR=/tmp/tc-new timeout "${SUITE_S:-370}" \
        python3 -m pytest -m gpu -q -p no:cacheprovider --durations=30 -n 8 tests/kernels tests/gpuworker \
        >"$OUT/gpu-suite.log" 2>&1)
    el "suite rc=$?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-suite.log" | tail -25 | tee -a "$OUT/summary.log"
    (cd "$NEW" && PYTHONPATH=$NEW python3 -m tests.kernels.ptx_inventory cache "$OUT/ptx-new.json" /tmp/tc-new) \
        | tee -a "$OUT/summary.log"
    el "the base tree's kernel tests, for its PTX"
    (cd "$BASE" && PYTHONPATH=/tmp/site:$BASE TRITON_CACHE_DIR=/tmp/tc-base timeout "${BASE_S:-150}" \
        python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels >"$OUT/base-kernels.log" 2>&1)
    el "base kernels rc=$?"
    tail -2 "$OUT/base-kernels.log" | tee -a "$OUT/summary.log"
    (cd "$NEW" && PYTHONPATH=$NEW python3 -m tests.kernels.ptx_inventory cache "$OUT/ptx-base.json" /tmp/tc-base &&
        PYTHONPATH=$NEW python3 -m tests.kernels.ptx_inventory compare "$OUT/ptx-base.json" "$OUT/ptx-new.json" |
        head -40) | tee -a "$OUT/summary.log"
}

bench() {
    hf="--hf-output-len 128"
    for tree in BASE NEW BASE NEW; do
        dir=${!tree}
        el "batch 1, $tree"
        # shellcheck disable=SC2086
        (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 90 python3 bench/latency.py --repeats 1 $hf 2>&1 | tail -6) |
            tee -a "$OUT/summary.log"
        el "512 requests, $tree"
        (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 100 python3 bench/throughput.py --num-requests 512 \
            --output-len 256 --skip-hf 2>&1 | tail -6) | tee -a "$OUT/summary.log"
        hf=--skip-hf
    done
}

"$1"
el done

#!/bin/bash
# The new model families on one lent GPU in one call (the device README's limits: 10 minutes a call):
# their GPU tests, the MLA decode tile sweep (written into gpuworker/kernels/configs/mla_decode/ and
# copied to $OUT), then batch 1 (HF transformers beside it) and 512 requests for DeepSeek-V2-Lite and a
# Gemma-3-12B shape, random weights.
#
#   bash bench/gpu_families_check.sh           # with `carry` .whl (the device README's wheel list)
#
# Writes summary.log and each step's log under $OUT; each step has its own time limit so one that
# runs long leaves the others their time.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/summary.log"; }
step() {  # step NAME SECONDS COMMAND...: run it under a limit, log to $OUT/NAME.log, tail to the summary
    local name=$1 limit=$2
    shift 2
    el "$name (limit ${limit} s)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    el "$name rc=$?"
    grep -E "^(FAILED|ERROR)|passed|failed|tok/s|ratio|TTFT|kv_cache|best|wrote" "$OUT/$name.log" | tail -12 |
        tee -a "$OUT/summary.log"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/summary.log"
git log -1 --format=%h 2>/dev/null | tee -a "$OUT/summary.log"

step gpu-tests "${TESTS_S:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 \
    tests/kernels/test_mla_decode.py tests/kernels/test_moe_routing.py tests/kernels/test_block_fp8_matmul.py \
    tests/kernels/test_moe_block_fp8.py tests/kernels/test_sliding_window_attention.py \
    tests/kernels/test_gemma3_triton.py tests/kernels/test_gemma_norm_and_activation.py \
    tests/gpuworker/engine/test_engine_mla.py tests/gpuworker/engine/test_gemma3_engine.py \
    tests/gpuworker/models/test_block_fp8.py tests/gpuworker/models/test_deepseek_parity.py \
    tests/gpuworker/models/test_quantized_models.py tests/gpuworker/engine/test_engine_quantized.py
step mla-sweep "${SWEEP_S:-40}" python3 bench/mla_decode.py --quick --write-configs
cp gpuworker/kernels/configs/mla_decode/*.json "$OUT/" 2>/dev/null
for model in deepseek-v2-lite gemma-3-12b; do
    step "$model-batch1" "${LATENCY_S:-90}" python3 bench/latency.py --config "bench/configs/$model" --repeats 1 \
        --hf-output-len 32
    mv "$OUT/latency.json" "$OUT/$model-latency.json" 2>/dev/null
    step "$model-512" "${THROUGHPUT_S:-105}" python3 bench/throughput.py --config "bench/configs/$model" \
        --num-requests 512 --output-len 256 --skip-hf
    mv "$OUT/throughput.json" "$OUT/$model-throughput.json" 2>/dev/null
done
el done

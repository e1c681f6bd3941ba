#!/bin/bash
# BENCHMARKS.md's waiting list on one lent GPU, a group or several per call (the device README's
# limits: 10 minutes a call), with `carry` .whl (the device README's wheel list):
#
#   bash bench/gpu_waiting_list.sh long long512      # 1M (FP8 KV, cache filled; a GPU over 100 GiB only),
#                                                    # 128K with HF and the prefill profile, the 64-bit
#                                                    # offsets test; then 512K with the FP8 KV cache
#   bash bench/gpu_waiting_list.sh serving           # fair share and priority classes, then shedding
#                                                    # (the groups `fairness` and `shedding` alone;
#                                                    # `fairness_classes`: interactive beside batch only)
#   bash bench/gpu_waiting_list.sh multiturn vision int8
#   bash bench/gpu_waiting_list.sh vision_profile     # the vision run by phase (torch.profiler)
#   bash bench/gpu_waiting_list.sh quant1            # batch 1, bf16 / FP8 / AWQ / INT8 (then quant512 alone)
#   bash bench/gpu_waiting_list.sh families          # the new families' GPU tests and the MLA decode sweep
#   bash bench/gpu_waiting_list.sh family_benches    # DeepSeek-V2-Lite and Gemma-3-12B, batch 1 and 512
#   bash bench/gpu_waiting_list.sh batch             # interactive TTFT beside a Batch API job, end to end
#   bash bench/gpu_waiting_list.sh suite             # the GPU tests, 8 processes
#
# bench/device_wheels.sh fetches the wheels first.
#
# Each step's limit can be set from the environment (LIMIT_<STEP>, dashes as underscores).
source "$(dirname "$0")/gpu_steps.sh"
limit() { local var="LIMIT_${1//-/_}"; echo "${!var:-$2}"; }

long() {
    if [ "$(gpu_memory_gib)" -ge 100 ]; then
        step long-1m "$(limit long-1m 150)" python3 bench/long_context.py --context 1048576 --kv-cache-dtype fp8 \
            --fill-cache
    else
        el "long-1m skipped: 1M tokens of FP8 KV (64 GiB) and the weights need more than this GPU's memory"
    fi
    step long-128k "$(limit long-128k 130)" python3 bench/long_context.py --context 131072 --hf --profile
    step offsets "$(limit offsets 50)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_large_cache_offsets.py
}
long512() {
    step long-512k "$(limit long-512k 240)" python3 bench/long_context.py --context 524288 --kv-cache-dtype fp8
}
serving() {
    fairness
    shedding
}
fairness() {
    step fairness "$(limit fairness 320)" python3 bench/fairness.py --duration "${FAIRNESS_S:-15}" \
        --plot "$RESULTS/fairness.png"
}
fairness_classes() {  # the fair policy's interactive beside batch, against A alone: a short call
    step fairness-classes "$(limit fairness-classes 150)" python3 bench/fairness.py --duration "${FAIRNESS_S:-15}" \
        --policies fair --workloads classes
}
shedding() {
    step shedding "$(limit shedding 240)" python3 bench/shedding.py --multiple 2 --duration "${SHEDDING_S:-20}" \
        --ttft-slo-ms 2000 --plot "$RESULTS/shedding.png" --logs "$RESULTS/shedding-servers"
}
multiturn() {
    step multiturn "$(limit multiturn 200)" python3 bench/multiturn.py --conversations 8 --turns 8 \
        --first-len 4096 --last-len 32768 --gpu-kv-tokens 65536 --host-kv-gib 32 --concurrency 2 --plot "$RESULTS/multiturn.png"
}
vision() {
    step vision "$(limit vision 200)" python3 bench/vision.py --hf-requests 64
}
vision_profile() {  # where the engine's time goes, by phase (the profiler slows it: read shares, not times)
    step vision-profile "$(limit vision-profile 240)" python3 bench/vision.py --skip-hf --profile --json vision_profile
}
int8() {
    step int8-tests "$(limit int8-tests 60)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_int8_matmul.py
    step int8-gemm "$(limit int8-gemm 90)" python3 bench/int8_gemm.py
}
quant1() {  # batch 1: bf16 and every quantized format, in one call
    for config in llama-3-8b llama-3-8b-fp8 llama-3-8b-awq llama-3-8b-int8; do
        step "$config-batch1" "$(limit quant-batch1 60)" python3 bench/latency.py --skip-hf --repeats 1 \
            --config "bench/configs/$config"
    done
}
quant512() {  # 512 requests: bf16 and every quantized format (FP8 with either KV cache), in one call
    for run in "llama-3-8b" "llama-3-8b-fp8" "llama-3-8b-fp8 --kv-cache-dtype fp8" "llama-3-8b-awq" "llama-3-8b-int8"; do
        set -- $run
        step "${run// /}-512" "$(limit quant-512 95)" python3 bench/throughput.py --num-requests 512 --output-len 256 \
            --skip-hf --config "bench/configs/$1" "${@:2}"
    done
}
mla() {
    step mla-prefill "$(limit mla-prefill 90)" python3 bench/mla_prefill.py --quick --write-configs
    cp gpuworker/kernels/configs/mla_prefill/*.json "$RESULTS/" 2>/dev/null
    step deepseek-512 "$(limit deepseek-512 80)" python3 bench/throughput.py --config bench/configs/deepseek-v2-lite \
        --num-requests 512 --output-len 256 --skip-hf
}
families() {  # the new families' GPU tests, the MLA decode sweep, then batch 1 (HF beside it) and 512 requests
    step families-tests "$(limit families-tests 300)" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 \
        tests/kernels/test_mla_decode.py tests/kernels/test_moe_routing.py tests/kernels/test_block_fp8_matmul.py \
        tests/kernels/test_moe_block_fp8.py tests/kernels/test_sliding_window_attention.py \
        tests/kernels/test_gemma3_triton.py tests/kernels/test_gemma_norm_and_activation.py \
        tests/gpuworker/engine/test_engine_mla.py tests/gpuworker/engine/test_gemma3_engine.py \
        tests/gpuworker/models/test_block_fp8.py tests/gpuworker/models/test_deepseek_parity.py \
        tests/gpuworker/models/test_quantized_models.py tests/gpuworker/engine/test_engine_quantized.py
    step mla-sweep "$(limit mla-sweep 240)" python3 bench/mla_decode.py --quick --write-configs
    cp gpuworker/kernels/configs/mla_decode/*.json "$RESULTS/" 2>/dev/null
}
family_benches() {
    for model in deepseek-v2-lite gemma-3-12b; do
        step "$model-batch1" "$(limit batch1 90)" python3 bench/latency.py --config "bench/configs/$model" --repeats 1 \
            --hf-output-len 32
        step "$model-512" "$(limit family-512 105)" python3 bench/throughput.py --config "bench/configs/$model" \
            --num-requests 512 --output-len 256 --skip-hf
    done
}
batch() {
    step batch-ttft "$(limit batch-ttft 240)" env BATCH_CONCURRENCY=256 python3 bench/batch_ttft.py \
        --config bench/configs/llama-3-8b --requests 200 --concurrency 4 --batch-lines 4000 --max-tokens 64
}
suite() {
    SUMMARY_LINES=40 step gpu-suite "$(limit gpu-suite 420)" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 \
        tests/kernels tests/gpuworker
}
for group in "$@"; do
    "$group"
done
el done

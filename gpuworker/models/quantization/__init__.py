"""Quantized checkpoints: FP8 (compressed-tensors, vLLM's fp8, or quantized at load), INT8 W8A8
(compressed-tensors) and INT4 weight-only (AWQ, GPTQ). gpuworker.checkpoint_quantization (pure
Python) reads the checkpoint's quantization; install.py swaps a model's projections for
fp8.Fp8Linear, int8.Int8Linear or int4.Int4Linear, whose kernels live in gpuworker.kernels.
"""

"""Quantized kernels and their host helpers: FP8 (W8A8) and INT4 (GPTQ/AWQ) matmuls, FP8 KV-cache
scales."""

"""Dense linear-layer kernels: the batch-1 GEMV (bf16 and FP8 weights, with fused input and output
work) and the MLP's SiLU-and-mul."""

"""Shared @triton.jit device functions that kernels of several families call: one module per
computation (online softmax, block-table prefetch, FP8 codec, per-head RMS norm, rotary and the cache
write of new tokens, the gated MLP's SiLU-and-mul, the output tile of the quantized GEMMs), imported
as a module and called by attribute (`prefetch.next_block(...)`). Everything here is made
interpretable for interpreted launches (launch.py)."""

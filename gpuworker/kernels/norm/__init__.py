"""Normalisation kernels: RMS norm (plain, residual-fused, FP8-output) and per-head QK norm."""

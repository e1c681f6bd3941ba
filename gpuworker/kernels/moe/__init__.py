"""Mixture-of-experts kernels: the grouped prefill path and the per-pair decode path."""

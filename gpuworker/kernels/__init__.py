"""Triton kernels of the GPU path, one module per kernel, each with its pure-torch reference beside it.

Modules import triton but decorate their kernels only on first launch (see launch.py).
"""

"""Triton kernels of the GPU path, grouped by family (attention, linear, quant, moe, norm, sampling),
one module per kernel with its pure-torch reference beside it; `device/` holds the @triton.jit helpers
that several families call, `configs/` the tuned launch configurations per device.

Naming: a kernel is `_<name>_kernel` in the module named for it, its launcher is the public `<name>()`,
its reference `<name>_reference()`; a device helper module in `device/` is named for what it
computes, is imported as a module and called by attribute.

Modules import triton but decorate their kernels only on first launch (see launch.py).
"""

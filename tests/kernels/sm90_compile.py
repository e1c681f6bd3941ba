"""Compile recorded kernel launches for an H100/H200 (sm_90) without a GPU.

The interpreter runs a kernel's Python, not its compilation: a launch whose arguments the compiler
rejects (an atomic on a bfloat16 pointer in a branch that never runs, say) passes every CPU test and
fails on the GPU. `record_launches` keeps each launch's arguments while the interpreter runs them;
`compile_sm90` then compiles one with Triton's own front end and ptxas, for compute capability 9.0,
with the launch's arguments specialised as the JIT would on a GPU (pointer dtypes, integer kinds,
divisibility by 16, ints of 1 as constants), constexprs and num_warps/num_stages/maxnreg, except
the two the interpreter sets otherwise than a GPU: USE_PDL on and DOT_FP32 off (bfloat16 dots, not the
float32 upcast the interpreter needs).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from gpuworker.kernels.launch import LazyJIT

_OPTIONS = ("num_warps", "num_stages", "maxnreg")


@dataclass
class Launch:
    kernel: LazyJIT
    arguments: dict  # parameter name -> value, in the kernel's order
    options: dict  # num_warps, num_stages


def record_launches(monkeypatch) -> dict[str, list[Launch]]:
    """From now on, every LazyJIT launch is also recorded under its kernel's name."""
    launches: dict[str, list[Launch]] = defaultdict(list)
    getitem = LazyJIT.__getitem__

    def recording(self, grid):
        launch = getitem(self, grid)

        def run(*args, **kwargs):
            signature = inspect.signature(self.fn)
            params = {k: v for k, v in kwargs.items() if k in signature.parameters}
            bound = signature.bind(*args, **params)
            options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
            launches[self.fn.__name__].append(Launch(self, dict(bound.arguments), options))
            return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(LazyJIT, "__getitem__", recording)
    return launches


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    return parameter.annotation in (tl.constexpr, "tl.constexpr")


def compile_sm90(launch: Launch, *, use_pdl: bool = True) -> str:
    """Compile the launch for sm_90 in a fresh process (the interpreter patches triton.language for
    the life of its process) and return its PTX; raises AssertionError with the compiler's message
    if it fails. use_pdl: compile the programmatic-dependent-launch variant (what an H200 runs)
    where the kernel has a USE_PDL constexpr."""
    [ptx] = compile_jobs([compile_job(launch, use_pdl=use_pdl)])
    return ptx


def compile_job(launch: Launch, *, use_pdl: bool = True) -> dict:
    """The launch as the JIT on an sm_90 GPU would compile it: a JSON-able job for compile_jobs."""
    fn = launch.kernel.fn
    parameters = inspect.signature(fn).parameters
    dont_specialize = set(launch.kernel.do_not_specialize)
    signature, constexprs, divisible = {}, {}, []
    for index, (name, value) in enumerate(launch.arguments.items()):
        if _is_constexpr(parameters[name]):
            if name == "USE_PDL":
                value = use_pdl
            elif name in ("DOT_FP32", "INTERPRETER_DOT"):
                # Set only under the interpreter (launch.dot_options, int8_matmul); a GPU runs the
                # tensor-core dots (bf16, int8).
                value = False
            signature[name] = "constexpr"
            constexprs[index] = value
        elif isinstance(value, (torch.Tensor, bool, int, float)):
            # Specialised as the JIT specialises a launch on a GPU: a 16-byte-aligned pointer and an
            # int divisible by 16 are known to be (tt.divisibility, which lets loads be vectorised and
            # pipelined), an int 1 becomes a constant; none of it for do_not_specialize's arguments.
            kind, attr = native_specialize_impl(BaseBackend, value, False, name not in dont_specialize, True)
            if kind == "constexpr":
                signature[name] = "constexpr"
                constexprs[index] = attr
            else:
                signature[name] = kind
                if attr == "D":
                    divisible.append(index)
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={value!r}")
    job = {
        "module": fn.__module__,
        "name": fn.__name__,
        "signature": signature,
        "constexprs": constexprs,
        "divisible": divisible,
        "do_not_specialize": [n for n in launch.kernel.do_not_specialize if n in parameters],
        # the launch's own register limit too (the sampling kernel's max_registers): ptxas
        # compiles another program under it
        "options": {"num_warps": 4, "num_stages": 3, **{k: v for k, v in launch.options.items() if v is not None}},
    }
    return job


def compile_jobs(jobs: list[dict]) -> list[str]:
    """Compile the jobs in one fresh process and return their PTX, in order; raises AssertionError
    with the compiler's message for the first that fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE],
        input=json.dumps(jobs),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600 + 60 * len(jobs),
    )
    names = ", ".join(sorted({job["name"] for job in jobs}))
    assert done.returncode == 0, f"{names} does not compile for sm_90:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout)


ROOT = Path(__file__).resolve().parents[2]
_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
out = []
for job in json.load(sys.stdin):
    fn = getattr(importlib.import_module(job["module"]), job["name"])
    jitted = JITFunction(fn, do_not_specialize=job["do_not_specialize"])
    constexprs = {(int(i),): v for i, v in job["constexprs"].items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in job["divisible"]}
    source = ASTSource(jitted, job["signature"], constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=job["options"])
    out.append(kernel.asm["ptx"])
json.dump(out, sys.stdout)
"""

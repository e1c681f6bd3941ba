"""No product function is longer than a reader can hold: 150 lines at most, kernels included (a long
kernel becomes @triton.jit device functions, which Triton inlines, so the GPU runs the same code)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 150
# Over the limit, each with the length it may not pass: three Triton kernels that ruff's formatter
# spread out (every argument of a call that does not fit on one line goes on a line of its own: the
# kernels' 30-55 parameters and their device-function calls), at 114 lines or fewer in the layout
# before. Splitting them further is open work; this list may only shrink.
OVER_THE_LIMIT = {
    "gpuworker/kernels/attention/paged_decode.py _paged_decode_kernel": 222,
    "gpuworker/kernels/linear/gemv.py _gemv_kernel": 151,
    "gpuworker/kernels/sampling/sample.py _sample_kernel": 243,
}


def _long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                where = f"{path.relative_to(ROOT)} {node.name}"
                if lines > OVER_THE_LIMIT.get(where, MAX_LINES):
                    found.append(f"{where} ({lines} lines)")
    return found


def test_no_product_function_is_over_150_lines():
    assert [f for package in ("gpuworker", "controlplane") for f in _long_functions(ROOT / package)] == []


def test_the_exceptions_still_need_to_be_exceptions():
    """An entry of OVER_THE_LIMIT whose function got shorter is lowered or removed."""
    lengths = {}
    for name in OVER_THE_LIMIT:
        path, function = name.split(" ")
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == function:
                lengths[name] = node.end_lineno - node.lineno + 1
    assert lengths == OVER_THE_LIMIT


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert _long_functions(tmp_path) == [f"long.py long ({MAX_LINES + 1} lines)"]
    finally:
        ROOT = saved

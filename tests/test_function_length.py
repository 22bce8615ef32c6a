"""No function body in src/ runs over 80 lines (issue 25), kernels excepted: a kernel's body is
one unrolled loop nest that a split would only scatter. Read with ast, nothing runs.

The length counts from the first statement after the docstring to the last line of the body.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parent.parent / "src" / "treeattn"
LIMIT = 80
KERNELS = {("ops/triton_decode.py", "_split_kv_kernel")}  # a @triton.jit kernel


def body_lengths(source: str) -> list[tuple[str, int]]:
    """(function name, lines of its body without the docstring) for every def in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
            out.append((node.name, body[-1].end_lineno - body[0].lineno + 1))
    return out


def test_the_count_reads_a_long_body():
    source = 'def f():\n    """Doc."""\n' + "    x = 1\n" * 81 + "\nclass A:\n    def f(self):\n        return 1\n"
    assert sorted(body_lengths(source)) == [("f", 1), ("f", 81)]


def test_no_function_body_over_80_lines_outside_kernels():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50
    long = [f"{path.relative_to(SRC)}::{name} ({n} lines)" for path in files
            for name, n in body_lengths(path.read_text())
            if n > LIMIT and (str(path.relative_to(SRC)), name) not in KERNELS]
    assert not long, f"function bodies over {LIMIT} lines; split them into named helpers: {long}"

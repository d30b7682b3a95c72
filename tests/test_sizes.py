"""No function over 80 lines in ``probing/``, no class over 300 (issue 44):
a long function is split into named steps, a long class gives a cohesive
part of itself to a collaborator. Measured with ``ast`` as the issue does:
``end_lineno - lineno + 1`` of each def and class, docstrings included."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import probing

ROOT = Path(probing.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300


def _sizes() -> Iterator[tuple[str, ast.AST, int]]:
    """(``path:name``, its node, its lines) of every def and class under probing/."""
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                assert node.end_lineno is not None
                where = f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}"
                yield where, node, node.end_lineno - node.lineno + 1


def test_no_function_in_probing_is_over_80_lines() -> None:
    long = [
        f"{where} ({n} lines)"
        for where, node, n in _sizes()
        if not isinstance(node, ast.ClassDef) and n > MAX_FUNCTION_LINES
    ]
    assert not long, f"split into named steps (at most {MAX_FUNCTION_LINES} lines): {long}"


def test_no_class_in_probing_is_over_300_lines() -> None:
    long = [
        f"{where} ({n} lines)"
        for where, node, n in _sizes()
        if isinstance(node, ast.ClassDef) and n > MAX_CLASS_LINES
    ]
    assert not long, f"give a cohesive part to a collaborator (at most {MAX_CLASS_LINES}): {long}"


def test_the_measure_counts_a_def_from_its_line_to_its_last() -> None:
    """The measure itself, on canned source: a 3-line function is 3 lines,
    its docstring included; a class counts its methods."""
    tree = ast.parse('class A:\n    def f(self):\n        """doc"""\n        return 1\n')
    sizes = {
        n.name: (n.end_lineno or 0) - n.lineno + 1
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.ClassDef))
    }
    assert sizes == {"A": 4, "f": 3}

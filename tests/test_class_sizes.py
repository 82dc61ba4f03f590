"""Every class in dmuon/ keeps under the 250-line bound (issue 39: the runtime was split along
its phases to get DedicateState and GradBucket under it; STYLE.md)."""

from __future__ import annotations

import ast
import pathlib

BOUND = 250


def test_no_class_over_250_lines():
    root = pathlib.Path(__file__).resolve().parents[1] / "dmuon"
    over = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > BOUND:
                over.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not over, over

# SPDX-License-Identifier: Apache-2.0
"""House rules the code keeps (docs/architecture.md, "Layers"): functions that fit on a screen."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_kvevict"
MAX_LINES = 60


def test_no_function_is_longer_than_a_screen():
    """No function or method in ``vllm_kvevict/`` is over 60 lines, its docstring included
    (``bench/`` and ``testing/``, the tools around the plugin, aside)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if {"bench", "testing"} & set(path.relative_to(PACKAGE).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)

"""`make lint`'s size check: modules, functions and packed assignments in src/.

Small units keep the code easy to read and change (docs/architecture.md), and the limits are a guide to
split by nouns, never a reason to pack lines:
- a module over 300 lines gets a warning unless its docstring says why it is longer ("over 300 lines:
  ..."); over 500 lines fails;
- a function over 50 lines fails, unless it is named in ALLOWED with the reason (a table of declarations);
- a parallel assignment of values (`a, b = x, y`; a swap excepted) fails: one assignment per line.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

WARN_MODULE_LINES = 300
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 50
ALLOWED = {
    "build_app": "a table of small FastAPI routes (closures over the serving layer)",
}


def packed(node: ast.AST) -> bool:
    """`a, b = x, y`: several values assigned on one line (a swap `a, b = b, a` is not packing)."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
        return False
    target, value = node.targets[0], node.value
    if not (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)):
        return False
    return sorted(map(ast.unparse, target.elts)) != sorted(map(ast.unparse, value.elts))


def check(path: Path) -> tuple[list[str], list[str]]:
    """(problems, warnings) of one module."""
    text = path.read_text()
    tree = ast.parse(text)
    problems, warnings = [], []
    lines = len(text.splitlines())
    explained = "over 300 lines" in (ast.get_docstring(tree) or "").lower()
    if lines > MAX_MODULE_LINES:
        problems.append(f"{path}: {lines} lines (at most {MAX_MODULE_LINES})")
    elif lines > WARN_MODULE_LINES and not explained:
        warnings.append(f"{path}: {lines} lines: split it by nouns, or say why in its docstring")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in ALLOWED:
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                problems.append(f"{path}:{node.lineno}: {node.name} has {length} lines (at most 50)")
        if packed(node):
            problems.append(f"{path}:{node.lineno}: several values assigned on one line: one per line")
    return problems, warnings


if __name__ == "__main__":
    problems, warnings = [], []
    for path in sorted(Path(sys.argv[1] if len(sys.argv) > 1 else "src").rglob("*.py")):
        found, warned = check(path)
        problems += found
        warnings += warned
    print("\n".join(f"warning: {w}" for w in warnings))
    print("\n".join(problems) or "sizes: every module and function is within its limit")
    sys.exit(1 if problems else 0)

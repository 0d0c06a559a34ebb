"""`make lint`'s size check: no module in src/ over 300 lines, no function over 50 lines.

Small units keep the code easy to read and change (docs/architecture.md). A function that is clearer
long (a table of declarations) is named in ALLOWED with the reason.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES, MAX_FUNCTION_LINES = 300, 50
ALLOWED = {
    "build_app": "a table of small FastAPI routes (closures over the serving layer)",
}


def problems(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{path}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in ALLOWED:
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path}:{node.lineno}: {node.name} has {length} lines (at most 50)")
    return found


if __name__ == "__main__":
    found = problems(Path(sys.argv[1] if len(sys.argv) > 1 else "src"))
    print("\n".join(found) or "sizes: every module and function is within its limit")
    sys.exit(1 if found else 0)

"""The house stays readable: no library file over 600 lines, no function over 80 (tinygrad's habit).

A file or function that must be longer is named in ALLOWED with the reason; an entry that no
longer needs its place fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "conveyor"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

# "path" (a file) or "path::function" -> why it may be longer.
ALLOWED: dict[str, str] = {}


def _sizes() -> dict[str, int]:
    sizes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE.parent))
        text = path.read_text()
        sizes[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text, filename=name)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{name}::{node.name}"
                sizes[key] = max(sizes.get(key, 0), node.end_lineno - node.lineno + 1)
    return sizes


def _limit(key: str) -> int:
    return MAX_FUNCTION_LINES if "::" in key else MAX_FILE_LINES


def test_no_library_file_or_function_outgrows_its_limit():
    over = {key: size for key, size in _sizes().items() if size > _limit(key) and key not in ALLOWED}
    assert not over, "split these (or name them in ALLOWED with the reason): " + ", ".join(
        f"{key} ({size} lines, limit {_limit(key)})" for key, size in sorted(over.items()))


def test_every_allowed_exception_is_still_needed():
    sizes = _sizes()
    stale = [key for key in ALLOWED if sizes.get(key, 0) <= _limit(key)]
    assert not stale, f"within the limits now: drop them from ALLOWED: {stale}"

"""An embedded corpus of variable-length documents: every function and class of the standard library.

``data.source=stdlib-definitions`` reads the same ``.py`` sources as ``data.source=stdlib``
(:mod:`conveyor.train.sources`: this Python's standard library, no download) and cuts each file
into its top-level definitions with :mod:`ast`: every ``def``, ``async def`` and ``class`` at
module level, decorators included, is one document, named ``path:line:name``. Lengths range
from a one-line function to classes of thousands of lines, which is what batching by length
(``data.batching=by_length``) is for. A file Python cannot parse is skipped.

Example:
    >>> docs = definition_documents(max_bytes=20_000)
    >>> docs[0].name.startswith("__future__.py:"), len({len(d.data) for d in docs}) > 5
    (True, True)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from conveyor.train import sources
from conveyor.train.sources import Document

SOURCE_NAME = sources.DEFINITIONS


def file_definitions(path_name: str, source: bytes) -> Iterator[Document]:
    """The top-level definitions of one file's ``source``, in file order (none if it does not parse).

    Example:
        >>> [d.name for d in file_definitions("m.py", b"import os\\ndef f():\\n    return 1\\nclass C:\\n    pass\\n")]
        ['m.py:2:f', 'm.py:4:C']
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
        last = node.end_lineno or node.lineno
        yield Document(f"{path_name}:{node.lineno}:{node.name}", b"".join(lines[first - 1:last]))


def definition_documents(max_bytes: int | None = None) -> list[Document]:
    """Every top-level definition of the standard library's sources, file by file in sorted order;
    ``max_bytes`` caps the total (the definition that crosses it is left out)."""
    root = sources.stdlib_root()
    kept, total = [], 0
    for name in sources.stdlib_names():
        for definition in file_definitions(name, (root / name).read_bytes()):
            if max_bytes is not None and total + len(definition.data) > max_bytes:
                return kept
            kept.append(definition)
            total += len(definition.data)
    return kept

"""Every example in the library's docstrings holds (the ones that need ranks are marked +SKIP), and in
the rigs' beside the commands of ``tools/`` (``tools/rigs/``, imported as ``rigs``)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "conveyor"
MODULES = sorted(
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for path in PACKAGE.rglob("*.py")
    if path.name != "__main__.py"
) + sorted(f"rigs.{path.stem}" for path in (PACKAGE.parent / "tools" / "rigs").glob("[!_]*.py"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    if name.startswith("rigs."):
        import tests.rigs  # noqa: F401 - puts tools/ on sys.path, as the commands have it
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (run pytest --doctest-modules)"

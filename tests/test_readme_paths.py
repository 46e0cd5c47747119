"""Every repository path README.md and benchmarks/README.md cite exists.

What counts as a cited path, read from the backticked spans and the links of each README:

- a path whose first part is an entry of the repository root or of the README's own folder
  (``conveyor/plan/predict.py``, ``conveyor/testing/rigs/``, ``results/plan-quick`` in benchmarks/README.md);
- a bare file name ending in ``.py`` or ``.sh`` (``passes.py``): the README names a file of the
  package it is describing, so some tracked file must have that name;
- the module of ``python -m pkg.mod`` and the script of ``bash path``;
- a link's target that is no URL and no anchor.

Left alone: what a run writes (``runs/train/``, ``out/compare.png``: their first part is no
repository entry), absolute paths (``/tmp/where``), and the user's own script after ``torchrun``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = ("README.md", "benchmarks/README.md")
PATH_TOKEN = re.compile(r"[\w.\-/]+")
BARE_FILE = re.compile(r"[\w.\-]+\.(?:py|sh)")


def _tracked() -> tuple[frozenset[str], frozenset[str]]:
    """The tracked files, and every folder that holds one (as paths from the repository root)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = frozenset(listed.split("\n")) - {""}
    folders = frozenset(str(parent) for name in files for parent in PurePosixPath(name).parents if str(parent) != ".")
    return files, folders


def cited_paths(text: str) -> list[str]:
    """The path-like citations of a README's text, in order (see the module docstring).

    Example:
        >>> cited_paths("see `conveyor/plan/` and `passes.py`; run `python -m benchmarks --plan`, [x](tools/a.sh)")
        ['conveyor/plan/', 'passes.py', '-m benchmarks', 'tools/a.sh']
    """
    cited = []
    for span in re.findall(r"`([^`\n]+)`|\]\(([^)\s]+)\)", text):
        code, link = span
        if link:
            if not link.startswith(("http://", "https://", "#", "mailto:")):
                cited.append(link.split("#")[0])
            continue
        if code.startswith("torchrun"):  # the user's own script
            continue
        cited.extend(f"-m {module}" for module in re.findall(r"python3? -m ([\w.]+)", code))
        cited.extend(re.findall(r"\bbash ([\w./-]+)", code))
        for token in code.split():
            token = token.strip("(),;:'\"")
            relative_path = "/" in token and not token.startswith("/") and PATH_TOKEN.fullmatch(token)
            if relative_path or BARE_FILE.fullmatch(token):
                cited.append(token)
    return list(dict.fromkeys(cited))


def missing_paths(readme: str, text: str | None = None) -> list[str]:
    """The repository paths ``readme`` (its file, or ``text`` read as if it sat there) cites that the repository
    does not hold."""
    files, folders = _tracked()
    base = PurePosixPath(readme).parent
    names = {PurePosixPath(name).name for name in files}
    top = {PurePosixPath(name).parts[0] for name in files}
    local_top = {PurePosixPath(name).relative_to(base).parts[0] for name in files
                 if str(base) != "." and name.startswith(f"{base}/")}

    def exists(path: str) -> bool:
        path = path.rstrip("/")
        candidates = [path] if str(base) == "." else [f"{base}/{path}", path]
        return any(c in files or c in folders for c in candidates)

    missing = []
    for cited in cited_paths((ROOT / readme).read_text() if text is None else text):
        if cited.startswith("-m "):
            module = cited[3:].replace(".", "/")
            if f"{module}.py" not in files and module not in folders:
                missing.append(f"python -m {cited[3:]}")
        elif "/" in cited:
            first = PurePosixPath(cited).parts[0]
            if (first in top or first in local_top) and not exists(cited):
                missing.append(cited)
        elif not exists(cited) and cited not in names:
            missing.append(cited)
    return missing


@pytest.mark.parametrize("readme", READMES)
def test_every_repository_path_the_readme_cites_exists(readme):
    missing = missing_paths(readme)
    assert not missing, (
        f"{readme} cites {len(missing)} path(s) the repository does not hold: {missing}; "
        "point the text at the file's current path (git log --follow -- <old path> finds where it went)"
    )


def test_the_check_finds_paths_that_are_gone():
    """The check can fail: a moved module, a removed script, a gone bare name and a missing -m module are named."""
    text = ("`conveyor/calibration.py`, `bash tools/gone.sh`, `transports.py`, `python -m conveyor.nowhere`, "
            "and what a run writes, `runs/x/`, which is no repository path")
    assert missing_paths("README.md", text) == ["conveyor/calibration.py", "tools/gone.sh", "transports.py",
                                                "python -m conveyor.nowhere"]
    assert missing_paths("benchmarks/README.md", "`plan.py`, `results/gone.json`") == ["results/gone.json"]

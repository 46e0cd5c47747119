"""The layers of ../shared/DESIGN.md, kept true by reading every import with ast.

One change to the sketch: ``parallel/`` (reductions across ranks: data-parallel gradients,
replicas' loss and norms) sits below ``pipe.py``, which it serves, so that ``Pipeline`` is a
thin API over the runtime and it; ``checkpoint/`` stays above ``pipe.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "conveyor"

# Layer of a module path (relative to conveyor/) -> prefixes of conveyor modules it must not import.
FORBIDDEN = {
    "schedule": ("conveyor.runtime", "conveyor.frontend", "conveyor.pipe", "conveyor.parallel",
                 "conveyor.checkpoint", "conveyor.train", "conveyor.cli", "conveyor.microbatch",
                 "conveyor.testing"),
    "frontend": ("conveyor.schedule", "conveyor.runtime", "conveyor.pipe", "conveyor.parallel",
                 "conveyor.checkpoint", "conveyor.train", "conveyor.cli"),
    "runtime": ("conveyor.frontend", "conveyor.pipe", "conveyor.parallel", "conveyor.checkpoint",
                "conveyor.train", "conveyor.cli"),
    "parallel": ("conveyor.frontend", "conveyor.pipe", "conveyor.checkpoint", "conveyor.train", "conveyor.cli"),
    # The option records sit beside the runtime, which takes the stage record whole: nothing above it.
    "options": ("conveyor.frontend", "conveyor.pipe", "conveyor.parallel", "conveyor.plan",
                "conveyor.build", "conveyor.checkpoint", "conveyor.train", "conveyor.cli"),
    # The expert-parallel option's checks: a part of the layout record, kept in its own file.
    "expert_option": ("conveyor.layout", "conveyor.frontend", "conveyor.pipe", "conveyor.parallel", "conveyor.plan",
                      "conveyor.build", "conveyor.checkpoint", "conveyor.train", "conveyor.cli"),
    # Where the ranks are: a record beside the others, read by parallel/ and pipe/ alike.
    "layout": ("conveyor.frontend", "conveyor.pipe", "conveyor.parallel", "conveyor.plan", "conveyor.build",
               "conveyor.checkpoint", "conveyor.train", "conveyor.cli"),
    "pipe": ("conveyor.build", "conveyor.checkpoint", "conveyor.train", "conveyor.cli"),
    "build": ("conveyor.checkpoint", "conveyor.train", "conveyor.cli"),
    # The planner sits at the pipe level: frontend, schedule and the runtime below it; build, train and
    # the command line above it.
    "plan": ("conveyor.pipe", "conveyor.build", "conveyor.checkpoint", "conveyor.train",
             "conveyor.cli", "conveyor.parallel"),
    "microbatch": ("conveyor.schedule", "conveyor.runtime", "conveyor.frontend", "conveyor.pipe",
                   "conveyor.train", "conveyor.cli"),
    "checkpoint": ("conveyor.train", "conveyor.cli"),
    "train": ("conveyor.cli",),
    # Local ranks that live between calls (the calibration's, the benchmarks'): errors and torch only.
    "processes": ("conveyor.schedule", "conveyor.runtime", "conveyor.frontend", "conveyor.pipe",
                  "conveyor.parallel", "conveyor.plan", "conveyor.build", "conveyor.checkpoint",
                  "conveyor.train", "conveyor.cli"),
}
# Test support is for tests and users' tests: no library module (anything outside conveyor/testing/) imports it.
TEST_SUPPORT = "conveyor.testing"
# The runtime may use these parts of the schedule layer and no other.
# posts: where a lowered program posts its transfers, which the executor reads as it runs it.
RUNTIME_SCHEDULE_ALLOWED = ("conveyor.schedule.ir", "conveyor.schedule.posts", "conveyor.schedule.timeline")
# runtime/'s three concerns (each sub-package's docstring says why): lifecycle at the bottom, the
# transports above it, a stage beside them knowing neither; only the executor sees all three.
RUNTIME_FORBIDDEN = {
    "stage": ("conveyor.runtime.transport", "conveyor.runtime.lifecycle", "conveyor.runtime.executor"),
    "transport": ("conveyor.runtime.stage", "conveyor.runtime.executor"),
    "lifecycle": ("conveyor.runtime.stage", "conveyor.runtime.transport", "conveyor.runtime.executor"),
}


def _imports(path: Path) -> list[str]:
    """Every conveyor module ``path`` imports, also through the lazy top level (``conveyor.Pipeline``
    is conveyor.pipe, ``conveyor.schedule.build`` conveyor.schedule)."""
    import conveyor

    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "conveyor":
            names.append(conveyor._LAZY.get(node.attr, f"conveyor.{node.attr}"))
    return names


def _layer(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_only(path):
    layer = _layer(path)
    for name in _imports(path):
        if layer != "testing":
            assert not (name == TEST_SUPPORT or name.startswith(TEST_SUPPORT + ".")), (
                f"conveyor/{path.relative_to(PACKAGE)} imports {name}: the library must not depend on its "
                "test support; move what it needs into the library proper"
            )
        for banned in FORBIDDEN.get(layer, ()):
            assert not (name == banned or name.startswith(banned + ".")), (
                f"conveyor/{path.relative_to(PACKAGE)} ({layer} layer) imports {name}"
            )
        if layer == "schedule":
            assert name.split(".")[0] != "torch", f"conveyor/{path.relative_to(PACKAGE)} imports torch"
        concern = path.relative_to(PACKAGE).parts[1] if layer == "runtime" else ""
        for banned in RUNTIME_FORBIDDEN.get(concern, ()):
            assert not (name == banned or name.startswith(banned + ".")), (
                f"conveyor/{path.relative_to(PACKAGE)} (runtime/{concern}) imports {name}"
            )
        if layer == "runtime" and name.startswith("conveyor.schedule"):
            assert name in RUNTIME_SCHEDULE_ALLOWED, (
                f"conveyor/{path.relative_to(PACKAGE)} imports {name}; the runtime may use only "
                f"{', '.join(RUNTIME_SCHEDULE_ALLOWED)}"
            )


def test_the_schedule_layer_never_imports_torch():
    code = (
        "import sys, conveyor, conveyor.schedule as cs\n"
        "cs.simulate(cs.build('1f1b', ranks=2, microbatches=2))\n"
        "import conveyor.cli\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_error_class_lives_in_conveyor_errors():
    """One home for errors: no library module defines its own exception class (private ones aside)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "conveyor"
    homes = {}
    for path in root.rglob("*.py"):
        if path.name == "errors.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {getattr(base, "id", getattr(base, "attr", "")) for base in node.bases}
                if any(base.endswith(("Error", "Exception", "Failure", "Timeout")) or base in {
                        "RuntimeError", "ValueError", "ConveyorError"} for base in bases):
                    homes[node.name] = str(path.relative_to(root))
    assert homes == {}, f"error classes outside conveyor/errors.py: {homes}"


def test_a_pipeline_without_replicas_does_not_load_fsdp():
    # FSDP2 and DTensor add ~45 MiB to every rank's memory: only data parallelism may load them.
    code = (
        "import sys, conveyor, conveyor.pipe, conveyor.layout, conveyor.build\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.fsdp', 'torch.distributed.tensor'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_runtime_is_its_three_concerns_and_the_executor():
    """Every runtime module lives in the concern it serves, whose docstring says what it may import."""
    runtime = PACKAGE / "runtime"
    loose = sorted(p.name for p in runtime.glob("*.py"))
    assert loose == ["executor.py"], f"runtime/ modules outside stage/, transport/, lifecycle/: {loose}"
    folders = sorted(p.name for p in runtime.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(RUNTIME_FORBIDDEN), folders
    for concern in folders:
        docstring = ast.get_docstring(ast.parse((runtime / concern / "__init__.py").read_text())) or ""
        assert "What it may import" in docstring, f"runtime/{concern}/__init__.py must say what it may import"

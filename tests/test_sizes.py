"""The house stays readable: budgets by concept, checked on every library file.

- a file: at most 600 lines; a function: at most 80 (tinygrad's habit);
- a class: at most 250 lines (a class past that holds more than one concept);
- a public callable: at most 12 parameters, and no ``**kwargs`` that forwards options
  (options arrive as typed records: :mod:`conveyor.options`);
- a line: at most 120 characters (ruff's E501, configured in pyproject.toml).

Whatever must exceed a budget is named in ALLOWED with the reason; an entry that no longer
needs its place fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "conveyor"
LIMITS = {"file": 600, "function": 80, "class": 250, "parameters": 12, "kwargs": 0}

# "kind:path[::name]" -> why it may exceed its budget.
ALLOWED: dict[str, str] = {
    # **kwargs that are not options: the model's own inputs, or another API's keywords passed unchanged.
    "kwargs:conveyor/pipe/pipeline.py::Pipeline.step": "the model's keyword inputs (pipe.step(ids, labels=y))",
    "kwargs:conveyor/pipe/pipeline.py::Pipeline.forward": "the model's keyword inputs, as step's",
    "kwargs:conveyor/pipe/pipeline.py::Pipeline.logprobs": "the model's keyword inputs, as forward's",
    "class:conveyor/pipe/pipeline.py::Pipeline": "the user's API, one typed delegating method per capability: the "
                                                 "forward-only family (logprobs, named_weights, generate) keeps its "
                                                 "logic in pipe/logprobs.py, pipe/weights.py, pipe/generation.py",
    "kwargs:conveyor/frontend/stage.py::StageModule.forward": "nn.Module.forward of a stage: the model's inputs",
    "kwargs:conveyor/parallel/data.py::data_loader": "torch.utils.data.DataLoader's own keywords (num_workers, "
                                                     "pin_memory, ...), passed to it unchanged",
    "kwargs:conveyor/runtime/stage/main_grad.py::MasterWeights.__init__": "the wrapped optimizer's keywords (lr, "
                                                                          "betas), as torch's ZeroRedundancyOptimizer "
                                                                          "takes them",
    "kwargs:conveyor/testing/references/main_grad.py::MainGradReference.__init__": "the reference optimizer's "
                                                                                   "keywords, as MasterWeights "
                                                                                   "takes them",
    "kwargs:conveyor/testing/models/hf.py::grouped_heads_lm": "transformers config fields over the test model's",
    "kwargs:conveyor/testing/rigs/checkpoint_tensor_parallel.py::build_model": "transformers config fields over the "
                                                                              "test model's",
    "kwargs:conveyor/testing/rigs/checkpoint_models.py::tied_lm": "TiedLM's own keywords (dim, layers, tie), passed "
                                                                  "to it unchanged",
    "kwargs:conveyor/checkpoint/files.py::SafeFileSystemReader.read_metadata": "torch.distributed.checkpoint's "
                                                                               "StorageReader signature",
}


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    named = [a for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def _is_public(qualname: str) -> bool:
    """A name callers can reach: no private part, and not a function nested in another."""
    return "<locals>" not in qualname and all(not part.startswith("_") or part == "__init__"
                                              for part in qualname.split("."))


def _measure() -> dict[str, int]:
    """Each budgeted thing's size: "kind:path[::qualified name]" -> lines, parameters or kwargs (0/1)."""
    sizes: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE.parent))
        text = path.read_text()
        sizes[f"file:{name}"] = len(text.splitlines())
        _walk(ast.parse(text, filename=name), name, "", sizes)
    return sizes


def _walk(node: ast.AST, path: str, prefix: str, sizes: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            qualname = prefix + child.name
            sizes[f"class:{path}::{qualname}"] = child.end_lineno - child.lineno + 1
            _walk(child, path, qualname + ".", sizes)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            qualname = prefix + child.name
            key = f"{path}::{qualname}"
            lines = child.end_lineno - child.lineno + 1
            sizes[f"function:{key}"] = max(sizes.get(f"function:{key}", 0), lines)
            if _is_public(qualname):
                sizes[f"parameters:{key}"] = max(sizes.get(f"parameters:{key}", 0), _parameters(child))
                sizes[f"kwargs:{key}"] = int(child.args.kwarg is not None)
            _walk(child, path, qualname + ".<locals>.", sizes)
        else:
            _walk(child, path, prefix, sizes)


def _over(sizes: dict[str, int]) -> dict[str, int]:
    return {key: size for key, size in sizes.items() if size > LIMITS[key.split(":", 1)[0]]}


def test_no_library_file_class_function_or_signature_outgrows_its_budget():
    over = {key: size for key, size in _over(_measure()).items() if key not in ALLOWED}
    assert not over, "split these (or name them in ALLOWED with the reason): " + ", ".join(
        f"{key} ({size}, budget {LIMITS[key.split(':', 1)[0]]})" for key, size in sorted(over.items()))


def test_every_allowed_exception_is_still_needed():
    over = _over(_measure())
    stale = [key for key in ALLOWED if key not in over]
    assert not stale, f"within the budgets now: drop them from ALLOWED: {stale}"


def test_ruff_checks_lines_at_120_characters():
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["ruff"]
    assert config["line-length"] == 120
    assert "E501" not in config["lint"].get("ignore", []), "E501 is the line-length check: keep it on"

"""The public surface, frozen: a new public name, or one gone, is a deliberate edit of this file.

Three lists, written out literally below:

- ``TOP_LEVEL``: what ``import conveyor`` offers (its lazy names, ``conveyor._LAZY``, and ``__all__`` if it has one);
- ``MODULE_ALL``: the ``__all__`` of every library module that declares one, by module;
- ``TRAIN_KEYS``: every dotted key ``conveyor train`` accepts (``conveyor.train.config.config_reference()``,
  what ``conveyor train --help`` lists).

After a deliberate change (a merge that moved modules, a new option), regenerate the lists and
read the diff before committing it:

    .venv/bin/python tests/test_surface.py --print    # the three lists as they are now, in this file's format
    .venv/bin/python tests/test_surface.py --write    # the same, written into this file between its markers
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "# --- surface: begin (python tests/test_surface.py --write) ---", "# --- surface: end ---"

# --- surface: begin (python tests/test_surface.py --write) ---
TOP_LEVEL = (
    "DistributedLayout", "InProcessLayout", "LossScaling", "MasterWeights", "Microbatches", "Pipeline",
    "PipelineOptions", "Plan", "RecomputePolicy", "SplitOptions", "StageOptions", "TransferOptions", "WholeModel",
    "pipeline",
)

MODULE_ALL = {
    "conveyor.checkpoint": (
        "PretrainedReport", "check", "checkpoints", "export", "latest", "load", "load_pretrained", "save",
        "to_state_dict",
    ),
    "conveyor.cli": (
        "build_parser", "main",
    ),
    "conveyor.frontend": (
        "ModelSplit", "SPLIT_METHODS", "SplitError", "StageModule", "TiedParameter", "TracingError", "ValueSpec",
        "run_sequential", "split_model",
    ),
    "conveyor.parallel": (
        "count_tokens", "data_loader",
    ),
    "conveyor.parallel.experts": (
        "ExpertParallel", "dispatch_combine", "find_experts",
    ),
    "conveyor.parallel.tensor": (
        "check_plan", "parallelize_stage", "tensor_parallel_plan",
    ),
    "conveyor.pipe": (
        "DistributedRanks", "InProcessRanks", "Pipeline",
    ),
    "conveyor.plan": (
        "Candidate", "CostTable", "Machine", "Measurement", "Plan", "PlanOptions", "SearchResult", "SearchSpace",
        "UnitCost", "analytic_units", "as_plan", "choose", "format_plan", "format_size", "parse_size", "plan",
        "profile_units", "search", "synthetic_table", "unit_costs",
    ),
    "conveyor.processes": (
        "MAX_RESULT_BYTES", "RankGroup", "Worker", "Zygote", "place", "run_once",
    ),
    "conveyor.processes.group": (
        "MAX_RESULT_BYTES", "RankGroup", "START_METHODS", "place", "run_once",
    ),
    "conveyor.schedule": (
        "Action", "ActionKind", "CommSpan", "CostModel", "Executable", "PairTiming", "Placement", "Schedule",
        "Span", "StageCosts", "Timeline", "available", "build", "dumps_csv", "executable", "infer_placement",
        "load_csv", "loads_csv", "lower", "overlap_pair", "pair_forward_backward", "pair_timing", "pairs_of",
        "parse_schedule", "register", "render_grid", "save_csv", "simulate", "unregister", "verify",
    ),
    "conveyor.testing": (
        "HarnessConfigError", "MAX_RESULT_BYTES", "RankError", "RankFailure", "RankTimeout", "run_ranks",
    ),
    "conveyor.testing.models": (
        "Block", "BlockStack", "Emulated", "GPTBlock", "GPTStage", "GROUPED_FAMILIES", "Overhead", "ReferenceModel",
        "ResidualMLP", "SkipNet", "SleepBlock", "Stack", "TextBlock", "TinyConfig", "TinyGPT", "TinyStage",
        "TwoEncoders", "UnevenMLP", "VOCAB", "WORKLOADS", "Workload", "build_stage", "default_causal_lm", "gpt2",
        "grouped_heads_lm", "llama", "lm_loss", "make_batch", "reference_model", "reference_step", "token_batch",
        "two_encoder_batch",
    ),
    "conveyor.testing.models.workloads": (
        "BlockStack", "Emulated", "GPTBlock", "GPTStage", "Overhead", "SleepBlock", "TinyGPT", "WORKLOADS",
        "Workload",
    ),
    "conveyor.testing.multiprocess": (
        "HarnessConfigError", "MAX_RESULT_BYTES", "RankError", "RankFailure", "RankTimeout", "run_ranks",
    ),
}

TRAIN_KEYS = (
    "model.name", "model.layers", "model.width", "model.heads", "model.seq_len", "model.intermediate",
    "model.kv_heads", "model.hf_config", "data.source", "data.format", "data.text_key", "data.tokenizer",
    "data.val_fraction", "data.max_bytes", "data.batching", "parallel.pp", "parallel.virtual", "parallel.schedule",
    "parallel.microbatches", "parallel.dp", "parallel.data_parallel", "parallel.tp", "parallel.sequence_parallel",
    "parallel.ep", "parallel.expert_capacity", "parallel.expert_overlap", "parallel.plan", "parallel.in_process",
    "stage.recompute", "stage.autocast", "stage.param_dtype", "stage.grad_accum_dtype", "stage.loss_scaling",
    "stage.compile", "stage.random_streams", "stage.measure_memory", "stage.record_timeline", "transfer.transport",
    "transfer.timeout_s", "transfer.fixed_shapes", "transfer.shapes", "transfer.variable_shapes", "optim.lr",
    "optim.betas", "optim.weight_decay", "optim.warmup_steps", "optim.lr_schedule", "optim.min_lr_ratio",
    "train.steps", "train.batch_size", "train.eval_interval", "train.eval_batches", "train.clip", "train.seed",
    "train.sample_tokens", "train.sample_prompt", "train.parity", "loss.normalize", "loss.on_nonfinite",
    "checkpoint.dir", "checkpoint.interval", "checkpoint.keep_last", "checkpoint.resume", "run.dir",
    "run.log_interval", "run.tensorboard", "run.max_restarts", "run.device", "run.share_gpus",
)
# --- surface: end ---


def current_top_level() -> tuple[str, ...]:
    """The names ``import conveyor`` offers, sorted."""
    import conveyor

    return tuple(sorted(set(conveyor._LAZY) | set(getattr(conveyor, "__all__", ()))))


def modules_with_all() -> list[str]:
    """Every library module whose source assigns ``__all__``, by dotted name, sorted."""
    names = []
    for path in sorted((ROOT / "conveyor").rglob("*.py")):
        if re.search(r"^__all__\b", path.read_text(), re.MULTILINE):
            dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            names.append(dotted.removesuffix(".__init__"))
    return names


def current_module_all() -> dict[str, tuple[str, ...]]:
    """Each such module's ``__all__`` (imported: the list as Python sees it), sorted."""
    return {name: tuple(sorted(importlib.import_module(name).__all__)) for name in modules_with_all()}


def current_train_keys() -> tuple[str, ...]:
    """Every dotted key ``conveyor train`` accepts, in the order ``conveyor train --help`` lists them."""
    from conveyor.train.config import config_reference

    return tuple(line.split()[0] for line in config_reference().splitlines()[1:])


def difference(where: str, listed: Iterable[str], current: Iterable[str], list_name: str) -> str | None:
    """None when ``listed`` and ``current`` hold the same names; else what was added and removed, and the fix.

    Example:
        >>> print(difference("conveyor.plan.__all__", ["Plan", "plan"], ["Plan", "search"], "MODULE_ALL"))
        conveyor.plan.__all__ changed: added ['search']; removed ['plan']. A public name is a deliberate change: \
if it is one, edit MODULE_ALL in tests/test_surface.py (python tests/test_surface.py --write rewrites the lists \
from the code; read the diff); if not, put the code back.
    """
    listed, current = set(listed), set(current)
    if listed == current:
        return None
    added, removed = sorted(current - listed), sorted(listed - current)
    return (f"{where} changed: added {added}; removed {removed}. A public name is a deliberate change: if it is "
            f"one, edit {list_name} in tests/test_surface.py (python tests/test_surface.py --write rewrites the lists "
            "from the code; read the diff); if not, put the code back.")


def test_the_top_level_names_are_the_listed_ones():
    problem = difference("import conveyor's names (_LAZY, __all__)", TOP_LEVEL, current_top_level(), "TOP_LEVEL")
    assert problem is None, problem


def test_the_modules_that_declare_all_are_the_listed_ones():
    problem = difference("the modules that declare __all__", MODULE_ALL, modules_with_all(), "MODULE_ALL")
    assert problem is None, problem


def test_each_modules_all_is_the_listed_one():
    problems = [difference(f"{module}.__all__", MODULE_ALL[module], names, "MODULE_ALL")
                for module, names in current_module_all().items() if module in MODULE_ALL]
    problems = [problem for problem in problems if problem is not None]
    assert not problems, "\n".join(problems)


def test_the_trainer_keys_are_the_listed_ones():
    problem = difference("conveyor train's keys", TRAIN_KEYS, current_train_keys(), "TRAIN_KEYS")
    assert problem is None, problem


def test_the_lists_are_sorted_and_without_repeats():
    """Kept in --write's order, so a regenerated list differs from the old one only where the surface did."""
    for name, names in [("TOP_LEVEL", TOP_LEVEL), *((f"MODULE_ALL[{m!r}]", n) for m, n in MODULE_ALL.items())]:
        assert list(names) == sorted(set(names)), f"{name} is not sorted or repeats a name"
    assert len(set(TRAIN_KEYS)) == len(TRAIN_KEYS), "TRAIN_KEYS repeats a key"


def test_a_difference_names_what_was_added_and_removed():
    """The check can fail, and says where to edit."""
    message = difference("conveyor train's keys", ["run.dir", "loss.normalize"], ["run.dir", "run.new"], "TRAIN_KEYS")
    assert message is not None
    assert "added ['run.new']" in message and "removed ['loss.normalize']" in message and "TRAIN_KEYS" in message
    assert difference("same", ["a", "b"], ["b", "a"], "TOP_LEVEL") is None


def _quoted_lines(names: Iterable[str], indent: str, width: int = 116) -> list[str]:
    """``names`` as quoted, comma-separated items packed into lines of at most ``width`` characters."""
    lines, line = [], indent
    for name in names:
        item = f'"{name}", '
        if len(line) + len(item.rstrip()) > width and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += item
    if line.strip():
        lines.append(line.rstrip())
    return lines


def surface_source() -> str:
    """The three lists as they are in the code now, in this file's format (between its markers)."""
    lines = [BEGIN, "TOP_LEVEL = (", *_quoted_lines(current_top_level(), "    "), ")", "", "MODULE_ALL = {"]
    for module, names in current_module_all().items():
        lines += [f'    "{module}": (', *_quoted_lines(names, "        "), "    ),"]
    lines += ["}", "", "TRAIN_KEYS = (", *_quoted_lines(current_train_keys(), "    "), ")", END]
    return "\n".join(lines) + "\n"


def _write_surface() -> None:
    path = Path(__file__).resolve()
    text = path.read_text()
    start, end = text.index(BEGIN + "\n", text.index("ROOT = ")), text.index(END + "\n", text.index("ROOT = "))
    path.write_text(text[:start] + surface_source() + text[end + len(END) + 1:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--print"]:
        print(surface_source(), end="")
    elif sys.argv[1:] == ["--write"]:
        _write_surface()
    else:
        sys.exit("usage: python tests/test_surface.py --print | --write")

"""`conveyor train` at every layout it and ``conveyor plan`` accept: saved, resumed bitwise, and started from one model.

Each layout of pp in {1, 2} x tp in {1, 2}, and dp=2 under fsdp, trains a tied model (gpt: the embedding is
the head's weight) and an untied one (llama) for 2 steps, saving after each; a second run resumes from the
step-1 checkpoint. The resumed step 2 gives the uninterrupted run's loss and parameters, ``torch.equal``
(the same computation on the same values). pp=1 x tp=2 on a tied model once failed at its first save: the
head's name of the one tied Parameter stayed on the meta device on a stage holding both ends.

The same seed starts the same model everywhere: each layout's starting parameters, gathered whole by their
original names, are ``torch.equal`` to the model built eagerly on one device (pp=1 x tp=1,
:func:`conveyor.frontend.materialize.initialise_as_on_meta`), whatever pp, tp or dp, and every layout builds
it on the meta device. So the step-0 validation losses of the layouts of one launch agree within
``VAL_TOLERANCE`` (the same model computed in another order; see there).

One launch per world size (1, 2 and 4 ranks), each rank training its layouts one after another; and the
planner's proposals on 2 ranks, each a layout saved here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conveyor.testing import run_ranks
from conveyor.train.config import load_config

TINY = ["train.steps=2", "checkpoint.interval=1", "model.layers=2", "model.width=32", "model.heads=2",
        "model.seq_len=16", "data.max_bytes=50000", "data.val_fraction=0.2", "train.batch_size=4",
        "parallel.microbatches=2", "optim.warmup_steps=1", "train.eval_interval=2", "train.eval_batches=1",
        "train.sample_tokens=0", "run.tensorboard=false", "run.device=cpu", "run.log_interval=1"]
MODELS = {"gpt": ["model.name=gpt"],  # tied: lm_head.weight is transformer.wte.weight
          "llama": ["model.name=llama", "model.kv_heads=2", "model.intermediate=64"]}  # untied
FSDP = ["parallel.dp=2", "parallel.data_parallel=fsdp"]
# By world size: the layouts one launch trains (gpt's tied ends cannot be fsdp-sharded over two stages:
# the config refuses pp=2 x dp=2 under fsdp for it, before any rank starts).
LAYOUTS = {
    1: {"pp1": ["parallel.pp=1"]},
    2: {"pp2": ["parallel.pp=2"], "pp1-tp2": ["parallel.pp=1", "parallel.tp=2"], "pp1-dp2": ["parallel.pp=1", *FSDP]},
    4: {"pp2-tp2": ["parallel.pp=2", "parallel.tp=2"], "pp1-dp2-tp2": ["parallel.pp=1", "parallel.tp=2", *FSDP]},
}
# tp=2 sums each row-parallel projection's two halves, then all-reduces them; dp=2 replicas each average
# their half of the validation batch, then the two means: a step-0 validation loss (a mean of 4 x 16 cross
# entropies over 256 logits) is the same model's computed in another order. Each such sum of at most 64
# products (width 32, intermediate 64) rounds within 64 x 2^-24 ~ 4e-6 of its magnitude; through two blocks
# and the head that stays well under 1e-5 relative of the loss (measured: 0 for tp=2, 8.6e-8 for llama at
# dp=2). A start from other weights, as tp=2 gave before its shards were slices of the tp=1 draw, moved it by
# 2e-3 relative.
VAL_TOLERANCE = 1e-5


def _pp_tp(keys: list[str]) -> tuple[int, int]:
    values = dict(key.split("=") for key in keys)
    return int(values["parallel.pp"]), int(values.get("parallel.tp", 1))


def _initial_parameters(pipe) -> dict[str, torch.Tensor]:
    """Every parameter of the pipeline, whole (DTensors gathered), by original name, from all ranks."""
    import torch.distributed as dist

    mine = {}
    for name, param in pipe.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        mine[name] = full.detach().clone()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, torch.Tensor] = {}
    for found in everyone:
        for name, tensor in found.items():
            if name in merged:
                assert torch.equal(merged[name], tensor), f"{name} differs between the ranks holding it"
            merged[name] = tensor
    return merged


def _local_parameters(pipe) -> dict[str, torch.Tensor]:
    return {name: (param.to_local() if hasattr(param, "to_local") else param).detach().clone()
            for name, param in pipe.named_parameters()}


def _save_and_resume(rank: int, world_size: int, run_dir: str) -> dict:
    import torch.distributed as dist

    import conveyor.train.loop as loop
    from conveyor.testing.rigs.trainer_pipelines import keep_built_pipelines

    torch.set_num_threads(1)
    # This rank's process only (forked); each pipeline's parameters before any step.
    built = keep_built_pipelines(lambda pipe, kept: kept.update(initial=_initial_parameters(pipe)))
    found = {}
    for layout, layout_keys in LAYOUTS[world_size].items():
        for model, model_keys in MODELS.items():
            where = f"{run_dir}/{layout}-{model}"
            keys = [*TINY, *model_keys, *layout_keys]
            whole = loop.train(load_config(None, [*keys, f"run.dir={where}"], world_size=world_size))
            initial, params = built["initial"], _local_parameters(built["pipe"])
            resumed = loop.train(load_config(None, [*keys, f"run.dir={where}-resumed",
                                                    f"checkpoint.resume={where}/checkpoints/step_000001"],
                                             world_size=world_size))
            again = _local_parameters(built["pipe"])
            found[(layout, model)] = {
                "steps": (whole["steps"], resumed["steps"]),
                "losses": (whole["last_loss"], resumed["last_loss"]),
                "val_at_0": whole["first_val_loss"],
                "saved": sorted(p.name for p in Path(where, "checkpoints").glob("step_*")) if rank == 0 else None,
                "unequal_after_resume": sorted(n for n in params if not torch.equal(params[n], again[n])),
                "finite": all(bool(torch.isfinite(t).all()) for t in [*params.values(), *again.values()]),
                "initial": initial if rank == 0 else None,
            }
    dist.barrier()
    return found


def _eager_model(model: str) -> dict[str, torch.Tensor]:
    """The model built eagerly on one device (pp=1 x tp=1), as the trainer seeds it."""
    from conveyor.frontend.materialize import initialise_as_on_meta
    from conveyor.train.models import build_model

    cfg = load_config(None, [*TINY, *MODELS[model]])
    torch.manual_seed(cfg.train.seed + 1)  # another global generator state: the values must not depend on it
    built = initialise_as_on_meta(build_model(cfg, 256, device="cpu"), cfg.train.seed)
    return dict(built.named_parameters(remove_duplicate=False))  # a tied Parameter under both names


@pytest.mark.distributed
@pytest.mark.timeout(900)
# The 4-rank launch (pp=2 x tp=2, and fsdp x tp=2) is in the extended tier. CI keeps a narrower twin of each
# of its promises: the trainer's start from the eager model and its bitwise resume under tp=2 and under fsdp
# at 2 ranks here; pp=2 x tp=2 checkpoints resuming bitwise (tests/checkpoint/test_tensor_parallel.py) and
# fsdp x tp=2 ones loading shard for shard (test_tensor_data_parallel.py); the trainer at pp=2 x tp=2
# (tests/train/test_tensor_parallel.py). It took about 60 s of CI's 15 minutes.
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.extended)])
def test_each_layout_saves_resumes_bitwise_and_starts_from_the_eager_model(tmp_path, world_size):
    results: dict = {}
    for rank, found in enumerate(run_ranks(_save_and_resume, world_size, args=(str(tmp_path),), timeout_s=800)):
        for key, value in found.items():
            results.setdefault(key, {})[rank] = value
    for model in MODELS:
        eager = _eager_model(model)
        aliases = {n: [a for a in eager if eager[a] is eager[n]] for n in eager}
        val_at_0 = {}
        for layout in LAYOUTS[world_size]:
            by_rank = results[(layout, model)]
            run, where = by_rank[0], f"{layout}/{model}"
            assert run["saved"] == ["step_000001", "step_000002"], (where, run["saved"])
            for r in by_rank.values():
                assert r["steps"] == (2, 2) and r["finite"], (where, r)
                assert all(math.isfinite(loss) for loss in r["losses"]), (where, r)
                # resumed at step 1: step 2's loss and the parameters after it exactly as without the stop
                assert r["losses"][0] == r["losses"][1] and r["unequal_after_resume"] == [], (where, r)
            initial = run["initial"]
            # every parameter, a tied one under either of its names, equal to the eager build's
            missing = [n for n in eager if not any(a in initial for a in aliases[n])]
            assert set(initial) <= set(eager) and missing == [], (where, missing, sorted(initial))
            unequal = sorted(n for n in initial if not torch.equal(initial[n], eager[n]))
            assert unequal == [], (where, unequal)
            val_at_0[layout] = run["val_at_0"]
            assert math.isfinite(val_at_0[layout]), (where, val_at_0)
        # The step-0 validation loss of the other layouts of this launch against its first: the same model
        # computed in another order (tp=2 against tp=1; replicas each averaging their half of the batch).
        first = val_at_0[next(iter(LAYOUTS[world_size]))]
        relative = {layout: abs(val - first) / abs(first) for layout, val in val_at_0.items()}
        assert all(r <= VAL_TOLERANCE for r in relative.values()), (model, val_at_0, relative)


@pytest.mark.parametrize("model", MODELS)
def test_the_planner_proposes_only_layouts_saved_above(tmp_path, capsys, model):
    # On 2 ranks the planner's tp search weighs pp=2 x tp=1 and pp=1 x tp=2 (its proposal in the report that
    # lost a run at the first save); whichever each tp's plan is, the trainer takes it and the test above
    # saves and resumes that pp x tp for the tied and the untied model. A stage tensor left on the meta
    # device, the cause of that failure, is now refused when the pipeline is built (shards.py), never at a
    # save after training.
    from conveyor.cli import main
    from conveyor.plan.result import Plan

    sizes = [item for key in TINY + MODELS[model] if key.startswith("model.") for item in ("--set", key)]
    saved_layouts = {_pp_tp(keys) for layouts in LAYOUTS.values() for keys in layouts.values()
                     if "parallel.dp=2" not in keys}
    for tp in (1, 2):
        out = tmp_path / f"{model}-tp{tp}.json"
        status = main(["plan", model, "--ranks", "2", "--global-batch", "4", "--analytic", "--tp", str(tp),
                       *sizes, "--out", str(out)])
        assert status == 0, capsys.readouterr().out
        chosen = Plan.load(out)
        pp = chosen.ranks
        assert (pp, chosen.tensor_parallel) in saved_layouts, (pp, chosen.tensor_parallel, saved_layouts)
        cfg = load_config(None, [*TINY, *MODELS[model], f"parallel.plan={out}", f"parallel.pp={pp}",
                                 f"parallel.tp={tp}"], world_size=2)
        assert (cfg.parallel.pp, cfg.parallel.tp, cfg.world_size) == (pp, tp, 2), cfg.parallel

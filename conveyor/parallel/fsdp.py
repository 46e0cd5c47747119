"""FSDP2 per pipeline stage: parameters gathered once per step, gradients reduced once per stage.

Each stage module is wrapped with torch's ``fully_shard`` over the "dp" dimension of a device
mesh, as torchtitan does for pipeline parallelism. Within a step the pipeline runs every
microbatch's F, B, I and W through conveyor's own runtime (explicit engine runs, not
``loss.backward()``), so FSDP's usual "the backward is over" signal would fire after every
microbatch, and even after each I before its W. The hooks below take that decision away from
FSDP, as ``torch.distributed.pipelining`` does in ``backward_maybe_with_nosync`` and
``perform_reduce_grad``:

- :func:`before_step`: gather each stage's parameters once (``unshard``), keep them gathered
  until the stage's last backward (no reshard after forward or backward), and turn the
  per-backward gradient sync off. Weight gradients of every microbatch, from B or from W,
  then accumulate in the gathered parameters' ``.grad``, where FSDP's post-backward reads
  them; the runners are told which Parameter objects those are (``refresh_params``).
- :func:`after_last_backward`: once a stage's last B or W of the step is done, run FSDP's
  post-backward for it: one reduce-scatter of the accumulated gradients over "dp" (the
  mean over replicas, as DDP), into the sharded parameters' ``.grad``, then reshard.
  The replicas' stage part (:class:`conveyor.parallel.replicas.Replicas`) calls it when the
  executor says a stage's gradients are final, so it overlaps the other stages' work.
- :func:`after_step`: reduce any stage not reduced yet, reshard, and give FSDP its defaults
  back. The optimizer (built on the sharded parameters) then steps.

Every schedule whose weight gradients come from B or W actions works, the zero-bubble I/W
split included: the parameters stay gathered from the first F to the last W, so a W finds the
same Parameter objects its I recorded, and nothing is reduced before the last W
(:func:`check_supported` says what is refused and why).

Example (on each of 4 ranks, pp=2 x dp=2)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stages = [shard_stage(build_stage(s), mesh["dp"]) for s in sched.stages_of(pp_rank)]
    pipe = conveyor.Pipeline(stages, schedule=sched, loss_fn=loss_fn,
                             layout=conveyor.DistributedLayout(group=mesh["pp"].get_group()))
    optimizer = torch.optim.AdamW(pipe.parameters())     # the sharded parameters
    before_step(pipe.runners.values())
    loss = pipe.step(my_shard_of_x, target=my_shard_of_y)
    after_step(pipe.runners.values())
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # FSDP2 and DTensor weigh ~45 MiB per process: imported only where used
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from conveyor.errors import PipelineConfigError, UsageError
from conveyor.runtime.stage.runner import StageRunner
from conveyor.schedule.ir import ActionKind, Schedule

# FSDP warns when a wrapped module returns a view, since an in-place op on it would skip a
# hook; conveyor never writes a stage's output in place (the next stage gets fresh leaves).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)

# Where a stage module is in the step, kept on the module itself (as FSDP2 keeps its own state there):
# _AWAITING_REDUCE between before_step and its reduce-scatter (after_last_backward refuses any other
# module: a reduce outside a step would average a partial or stale gradient); _AWAITING_FINAL once its
# reduction started and its end-of-backward bookkeeping waits for after_step; absent otherwise.
_STEP_PHASE, _AWAITING_REDUCE, _AWAITING_FINAL = "_conveyor_fsdp_step_phase", "awaiting reduce", "awaiting final"


def replicate_stage(module: torch.nn.Module, dp_mesh: DeviceMesh, *,
                    ignored_params: set[torch.nn.Parameter] | None = None) -> FSDPModule:
    """Replicate ``module`` over the 1-D ``dp_mesh`` with FSDP2's ``replicate`` (DDP); returns it.

    Every replica keeps all of the stage's parameters; the hooks below then all-reduce its
    gradients (the mean over replicas) once per step, as for a sharded stage. ``ignored_params``
    are left alone (another part reduces them: :func:`conveyor.parallel.part.claim_reduction`).

    Example:
        >>> stage = replicate_stage(build_stage(s, cfg), mesh["dp"])   # doctest: +SKIP
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    _check_stage_mesh(module, dp_mesh)
    return replicate(module, mesh=dp_mesh, ignored_params=ignored_params or None)


def _check_stage_mesh(module: torch.nn.Module, dp_mesh: DeviceMesh) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(dp_mesh, DeviceMesh) or dp_mesh.ndim != 1:
        got = f"a {dp_mesh.ndim}-D mesh" if isinstance(dp_mesh, DeviceMesh) else type(dp_mesh).__name__
        raise PipelineConfigError(f"a stage is wrapped over the 1-D data-parallel mesh (mesh['dp']), got {got}")
    if isinstance(module, FSDPModule):
        raise PipelineConfigError(
            "this stage module is already an FSDP module; the pipeline applies the outermost "
            "fully_shard / replicate itself (shard inner blocks yourself, then pass the plain stage module)"
        )


def shard_stage(module: torch.nn.Module, dp_mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
                ignored_params: set[torch.nn.Parameter] | None = None) -> FSDPModule:
    """Shard ``module`` (one pipeline stage) over the 1-D ``dp_mesh`` with FSDP2; returns it.

    ``reshard_after_forward=False`` (on submodules the user sharded before, too): the gathered
    parameters stay from one microbatch to the next, so a step gathers each stage once rather
    than once per microbatch. Shard submodules (transformer blocks) yourself first if you want
    one all-gather per block; the stage module must be the outermost ``fully_shard``.

    Example:
        >>> stage = shard_stage(build_stage(s, cfg), mesh["dp"])   # doctest: +SKIP
        >>> type(next(stage.parameters())).__name__                 # doctest: +SKIP
        'DTensor'
    """
    from torch.distributed.fsdp import fully_shard

    _check_stage_mesh(module, dp_mesh)
    kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
    sharded = fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, ignored_params=ignored_params or None,
                          **kwargs)
    sharded.set_reshard_after_forward(False, recurse=True)  # inner blocks sharded by the user too
    return sharded


def check_supported(schedule: Schedule, data_parallel: str = "fsdp", tied_parameters: Sequence = ()) -> None:
    """Refuse, with the reason, what data parallelism per stage cannot train correctly.

    Supported: every schedule in which each (stage, microbatch) gets its weight gradient from
    exactly one B or W on the stage's rank. That is every built-in schedule (1f1b, gpipe,
    interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zbv, dualpipev): the gathered parameters stay
    in place from the first F to the last B/W of the step, and the reduction runs after the
    last one. Tested against one process (tests/parallel, pp=2 x dp=2): 1f1b, zbv (also with
    activation checkpointing), interleaved-1f1b and zb-h1; the others hold by the same
    argument. Refused:

    - a schedule where a stage's weight gradient of some microbatch comes from no B or W (an I
      without its W, a forward-only program) or from two: the stage's reduction would run
      before its gradient is complete, or never;
    - tied parameters with two uses on one rank: each stage is its own FSDP2 root, so one
      Parameter cannot sit in two of them. Uses on different ranks are fine with both kinds:
      the copies have one shape, so ``"fsdp"`` shards them alike over "dp" (and TP alike over
      "tp"), and the pipeline's cross-rank sum adds shard to matching shard.

    Example:
        >>> import conveyor.schedule as cs
        >>> check_supported(cs.build("zbv", ranks=2, microbatches=4, virtual=2))
    """
    placement = schedule.placement
    for tied in tied_parameters:
        ranks = [placement.rank_of(stage) for stage, _ in tied.uses]
        if len(set(ranks)) < len(ranks):
            raise PipelineConfigError(
                f"data_parallel={data_parallel!r} cannot hold the tied parameter used as {list(tied.uses)} "
                f"(stages on ranks {ranks}): each stage is its own FSDP2 root and one Parameter cannot be "
                "wrapped by two of them. Untie it, keep its uses in one stage, or use a schedule that puts "
                "its stages on different ranks (1f1b rather than zbv, whose V puts the first and last stage "
                "on rank 0)"
            )
    weight_grads = Counter((action.stage, action.microbatch) for program in schedule.programs for action in program
                           if action.kind in (ActionKind.B, ActionKind.W))
    bad = [(s, m, weight_grads[s, m]) for s in range(schedule.num_stages)
           for m in range(schedule.num_microbatches) if weight_grads[s, m] != 1]
    if bad:
        shown = ", ".join(f"stage {s} microbatch {m}: {n}" for s, m, n in bad[:4])
        raise PipelineConfigError(
            f"schedule {schedule.name!r} cannot run with data_parallel={data_parallel!r}: a stage's gradient "
            "is reduced across replicas once, after the stage's last B or W of the step, so each (stage, "
            f"microbatch) needs exactly one B or W; weight-gradient actions counted: {shown}. Use a "
            "training schedule (every built-in one qualifies: 1f1b, interleaved-1f1b, zbv, ...)"
        )


def _fsdp_modules(module: torch.nn.Module) -> list[FSDPModule]:
    from torch.distributed.fsdp import FSDPModule

    found = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not found or found[0] is not module:
        raise UsageError(
            f"stage module {type(module).__name__} is not sharded: build it with "
            "conveyor.parallel.fsdp.shard_stage(module, mesh['dp'])"
        )
    return found


def before_step(runners: Iterable[StageRunner]) -> None:
    """Gather every stage's parameters once for the step, and keep FSDP from reducing per microbatch.

    Call on every rank before ``pipe.step``. The runners then target the gathered parameters
    (their ``.grad`` is where B and W accumulate and where FSDP's reduce-scatter reads).

    Example:
        >>> before_step(pipe.runners.values())    # doctest: +SKIP
    """
    runners = list(runners)
    handles = []
    for runner in runners:
        root = runner.module
        for fsdp_module in _fsdp_modules(root):
            # Issued for every stage before any wait, so the all-gathers can overlap.
            handles.append(fsdp_module.unshard(async_op=True))
        # Per-microbatch backwards (and the end of each engine run, I included) must neither
        # reduce nor free the gathered parameters: W still accumulates into them.
        root.set_requires_gradient_sync(False)
        root.set_reshard_after_backward(False)
        root.set_is_last_backward(False)
    for handle in handles:
        handle.wait()
    for runner in runners:
        runner.refresh_params()  # the gathered Parameter objects now sit in the module
        runner.module.__dict__[_STEP_PHASE] = _AWAITING_REDUCE


def after_last_backward(runner: StageRunner) -> None:
    """Start reducing this stage's gradients now (its last B or W of the step is done).

    FSDP's post-backward, run by hand as ``torch.distributed.pipelining`` does: each parameter's
    accumulated gradient is averaged over the "dp" replicas (FSDP's default divide factor, the
    dp size: DDP's mean) into the sharded parameter's ``.grad`` (added to what is there, so
    several steps may accumulate before the optimizer), then the stage reshards. What FSDP
    runs at the end of a ``loss.backward()`` (waiting for the reductions, clearing the step's
    bookkeeping) waits for :func:`after_step`, so that the reduction overlaps whatever the
    rank runs meanwhile. A collective over "dp": every replica calls it for the same stage
    at the same point of the same program.

    Example:
        >>> replicas.stage_done(stage)   # calls this   # doctest: +SKIP
    """
    root = runner.module
    if root.__dict__.get(_STEP_PHASE) != _AWAITING_REDUCE:
        raise UsageError(
            f"after_last_backward on stage {runner.stage} without before_step (or twice in one step): "
            "call before_step(runners) before pipe.step"
        )
    root.__dict__[_STEP_PHASE] = _AWAITING_FINAL
    root.set_is_last_backward(True)
    root.set_reshard_after_backward(True)
    root.set_requires_gradient_sync(True)
    for fsdp_module in _fsdp_modules(root):
        for param_group in _param_groups(fsdp_module):
            param_group.post_backward()  # reduce-scatter (gradients present) and reshard


def _param_groups(fsdp_module: Any) -> list[Any]:
    """The module's FSDP2 parameter groups: a list in torch 2.13, one group (or None) before it."""
    state = fsdp_module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def reduction_streams(runner: StageRunner) -> list[Any]:
    """The streams this stage's gradient reductions ran on (FSDP2's reduce-scatter / all-reduce
    streams, those its post-backward used), for timing them with events where they ran.

    Example:
        >>> streams = reduction_streams(pipe.runners[0])   # after after_last_backward   # doctest: +SKIP
    """
    streams: list[Any] = []
    for fsdp_module in _fsdp_modules(runner.module):
        for param_group in _param_groups(fsdp_module):
            comm = param_group.comm_ctx
            used = getattr(comm, "_last_post_reduce_events", None)  # torch 2.13: stream -> its event
            if used is None:  # older torch: the streams FSDP2 reduces on
                used = [s for s in (getattr(comm, "reduce_scatter_stream", None),
                                    getattr(comm, "all_reduce_stream", None)) if s is not None]
            streams.extend(s for s in used if s not in streams)
    return streams


def after_step(runners: Iterable[StageRunner]) -> None:
    """Finish the step: reduce any stage the executor did not, reshard, restore FSDP's defaults.

    Call on every rank after ``pipe.step`` and before the optimizer. A stage not reduced when its
    gradients became final (no replicas' part) is reduced here, in stage order (correct, without
    the overlap).

    Example:
        >>> after_step(pipe.runners.values()); optimizer.step()   # doctest: +SKIP
    """
    for runner in sorted(runners, key=lambda r: r.stage):  # the same order on every replica
        if runner.module.__dict__.get(_STEP_PHASE) == _AWAITING_REDUCE:
            after_last_backward(runner)
        if runner.module.__dict__.pop(_STEP_PHASE, None) == _AWAITING_FINAL:
            # What FSDP runs at the end of a loss.backward(): waits for the reductions and
            # clears the step's bookkeeping (torch's own pipelining reaches in the same way).
            runner.module._get_fsdp_state()._root_post_backward_final_callback()
        for fsdp_module in _fsdp_modules(runner.module):
            fsdp_module.reshard()
        # A plain forward and backward outside the pipeline then behaves as stock FSDP.
        runner.module.set_requires_gradient_sync(True)
        runner.module.set_reshard_after_backward(True)
        runner.module.set_is_last_backward(True)


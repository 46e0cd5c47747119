"""Expert parallelism's all-to-alls hidden behind another microbatch's compute: the stages' forwards in steps.

With ``DistributedLayout(expert_overlap=True)`` the pipeline pairs each rank's forwards with the backwards
next to them in its program (:func:`conveyor.schedule.overlap.pair_forward_backward`), and the executor runs
a pair's two passes by turns (:func:`conveyor.runtime.stage.segments.interleave`). Here each traced stage
that holds experts gets a forward in steps (``StageRunner.stepped``): its graph runs node by node
(``StageModule.run_in_steps``) and each experts call runs
:func:`~conveyor.parallel.experts.dispatch.dispatch_combine_steps`, which posts the counts', the tokens'
and the results' all-to-all, yields, and waits for each when its turn comes back, cutting the autograd graph
at the tokens' two so that the backward yields at their reverse exchanges as well. Per MoE layer and
microbatch: three exchanges in the forward, two in the backward, each in flight while the other
microbatch computes, Megatron's combined 1F1B and DualPipe's overlapped forward-backward on a pipeline's
own pairs. The numbers are those of the plain step (see :mod:`conveyor.runtime.stage.segments`).

Only traced stages (``conveyor.pipeline(...)``'s) run in steps: a hand-built stage's forward is the user's
Python, which cannot pause inside its experts call. Such a stage is refused, as are tensor-parallel
experts (their rows' gather is one more collective inside the call), recomputation and torch.compile (a
recomputed or compiled region replays or fuses the forward the steps cut).

Example (what ``ExpertParallel`` does for each stage under ``expert_overlap=True``)::

    runner.stepped = stepped_forward(part, runner.module, {"model.layers.0.mlp.experts": experts})
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from conveyor.errors import PipelineConfigError
from conveyor.parallel.experts.dispatch import dispatch_combine_steps, local_compute
from conveyor.runtime.stage.segments import Boundary, SegmentedPass

if TYPE_CHECKING:
    from conveyor.parallel.experts.part import ExpertParallel
    from conveyor.runtime.stage.runner import StageRunner


def check_overlap(runner: StageRunner, tensor_parallel: bool) -> None:
    """Refuse, on every rank alike, a stage with experts that cannot run in steps (see the module docstring)."""
    where = f"expert_overlap=True: stage {runner.stage}"
    if not callable(getattr(runner.module, "run_in_steps", None)):  # a traced StageModule's
        raise PipelineConfigError(f"{where} is built by hand ({type(runner.module).__name__}), whose forward cannot "
                                  "pause inside its experts call; let conveyor.pipeline(...) trace and split the "
                                  "model, or drop expert_overlap")
    if tensor_parallel:
        raise PipelineConfigError(f"{where}: expert_overlap does not take tensor-parallel experts yet (tp > 1); "
                                  "drop expert_overlap or tp")
    if runner.recompute is not None or runner.compile is not None:
        raise PipelineConfigError(f"{where} recomputes or compiles its forward, which the overlapped steps cut at "
                                  "each all-to-all; drop expert_overlap, or the recomputation and compile options")


def stepped_forward(part: ExpertParallel, stage: nn.Module, experts: Mapping[str, nn.Module]
                    ) -> Callable[[tuple, dict, SegmentedPass], Generator[None, None, Any]]:
    """``stage``'s forward in steps, each experts module in ``experts`` ({path in the stage: module}) dispatched
    by :func:`dispatch_combine_steps` over ``part``'s group (what ``StageRunner.stepped`` takes)."""
    def steps(args: tuple, kwargs: dict, passes: SegmentedPass) -> Generator[None, None, Any]:
        intercepts = {path: functools.partial(_experts_steps, part, passes) for path in experts}
        return stage.run_in_steps(args, kwargs, intercepts)

    return steps


def _experts_steps(part: ExpertParallel, passes: SegmentedPass, experts: nn.Module, args: tuple, kwargs: dict,
                   map_live: Callable[[Callable[[Any], Any]], None]) -> Generator[None, None, Any]:
    hidden_states, top_k_index, top_k_weights = _experts_arguments(args, kwargs)

    def cut() -> Boundary:
        boundary = passes.boundary()
        map_live(boundary.cut)  # what the stage needs after the experts crosses the cut as leaves
        return boundary

    return (yield from dispatch_combine_steps(
        hidden_states, top_k_index, top_k_weights, num_experts=part.num_experts[experts],
        exchanges=part.all_to_alls, compute=local_compute(experts, top_k_weights.dtype), cut=cut,
        capacity_factor=part.capacity, dropped=part._dropped))


def _experts_arguments(args: tuple, kwargs: dict) -> tuple:
    """(hidden_states, top_k_index, top_k_weights), however the traced call passed them."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args) + [kwargs[name] for name in names[len(args):]]
    if len(values) != 3:
        raise PipelineConfigError(f"an experts module was called with {len(args)} positional and {sorted(kwargs)} "
                                  f"keyword arguments; expert_overlap expects {names}")
    return tuple(values)

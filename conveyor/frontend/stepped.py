"""A traced stage's forward as a generator: its graph run node by node, chosen module calls run as steps.

:class:`~conveyor.frontend.stage.StageModule` runs its graph as generated Python, one call that cannot
pause. :func:`run_in_steps` runs the same graph node by node (the same operations on the same values, so
the same numbers), and hands each ``call_module`` node whose target is in ``intercepts`` to a generator of
its own, which may yield: expert parallelism's all-to-alls pause a microbatch's forward there so that
another microbatch's backward computes while the tokens travel (:mod:`conveyor.parallel.experts.overlap`).

An intercepted call also gets ``map_live``: it replaces every value the graph still needs after that node
(the residual stream that bypasses the experts, say) by what a function makes of it, which is how a
backward cut in segments gets its leaves (:meth:`conveyor.runtime.stage.segments.Boundary.cut`).

Example (nothing intercepted: the steps run through at once, to the stage's own output):
    >>> import torch
    >>> import conveyor.frontend as frontend
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    >>> stage = frontend.split_model(model, 1, example_args=(torch.ones(3, 2),)).stage_module(0)
    >>> steps = run_in_steps(stage, (torch.ones(3, 2),), {}, {})
    >>> try:
    ...     next(steps)
    ... except StopIteration as done:
    ...     torch.equal(done.value, stage(torch.ones(3, 2)))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Any

import torch.fx as fx

from conveyor.frontend.stage import StageModule

StepsOf = Callable[..., Generator[None, None, Any]]
"""``steps(module, args, kwargs, map_live)``: an intercepted module call as a generator returning its value."""


def run_in_steps(stage: StageModule, args: tuple, kwargs: dict[str, Any],
                 intercepts: Mapping[str, StepsOf]) -> Generator[None, None, Any]:
    """``stage(*args, **kwargs)`` as a generator that pauses wherever an intercepted call yields.

    ``intercepts``: {module path in the stage (a ``call_module`` target): its steps}. Every other node runs
    as the generated code runs it; each value is dropped after its last use, as there. The stage's own forward
    hooks run before and after, as its ``__call__`` runs them (FSDP2's, on a replicated stage).
    """
    for hook_id, hook in list(stage._forward_pre_hooks.items()):
        if hook_id in stage._forward_pre_hooks_with_kwargs:
            changed = hook(stage, args, kwargs)
            args, kwargs = changed if changed is not None else (args, kwargs)
        else:
            changed = hook(stage, args)
            args = args if changed is None else changed if isinstance(changed, tuple) else (changed,)
    output = yield from _graph_steps(stage, args, kwargs, intercepts)
    for hook_id, hook in list(stage._forward_hooks.items()):
        if hook_id in stage._forward_hooks_with_kwargs:
            changed = hook(stage, args, kwargs, output)
        else:
            changed = hook(stage, args, output)
        output = output if changed is None else changed
    return output


def _graph_steps(stage: StageModule, args: tuple, kwargs: dict[str, Any],
                 intercepts: Mapping[str, StepsOf]) -> Generator[None, None, Any]:
    graph = stage.graph
    nodes = list(graph.nodes)
    last_use = {node: index for index, node in enumerate(nodes) for node in node.all_input_nodes}
    flat = iter(stage.flat_inputs(args, kwargs))
    interpreter = fx.Interpreter(stage, garbage_collect_values=False, graph=graph)  # runs each node not intercepted
    env = interpreter.env
    for index, node in enumerate(nodes):
        if node.op == "placeholder":
            env[node] = next(flat)
            continue
        if node.op == "output":
            return stage.result(fx.node.map_arg(node.args[0], env.__getitem__))
        call_args, call_kwargs = interpreter.fetch_args_kwargs_from_env(node)
        if node.op == "call_module" and node.target in intercepts:
            def map_live(make: Callable[[Any], Any], after: int = index) -> None:
                for live, value in env.items():
                    if last_use.get(live, -1) > after:
                        env[live] = make(value)

            env[node] = yield from intercepts[node.target](stage.get_submodule(node.target), call_args,
                                                           call_kwargs, map_live)
        else:
            env[node] = getattr(interpreter, node.op)(node.target, call_args, call_kwargs)
        for used in node.all_input_nodes:
            if last_use.get(used) == index:
                del env[used]
    raise AssertionError(f"stage {stage.stage}'s graph has no output node")


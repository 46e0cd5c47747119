"""One stage's activation recomputation, as its :class:`~conveyor.options.RecomputePolicy` says.

Everything recomputed goes through ``torch.utils.checkpoint.checkpoint`` (non-reentrant),
with two contexts around each forward and recomputation:

* :class:`~conveyor.runtime.stage.recomputed_buffers.RecomputedBuffers` of the checkpointed module, so that a
  recomputation reads the buffers its forward read and buffers end as without recomputation;
* with ``save``, torch's selective checkpointing (``create_selective_checkpoint_contexts``):
  the chosen operators' outputs are kept from the forward, the rest recomputed. Torch lets a
  selective region be recomputed once; the zero-bubble schedules' I and W passes each
  recompute it (two backward calls into one graph), so the kept outputs are handed out again
  to the second recomputation, and live until the microbatch's graph is freed.

Where the recomputed region is: the whole stage (no ``every``/``blocks``); else each chosen
block: for a traced stage the stage graph calls a function per block run
(:mod:`conveyor.frontend.regions`, through the stage's ``wrap_blocks``), for a hand-built stage
the block module's ``forward`` is replaced by its checkpointed self (names and parameters stay).

Recomputation replays the same operations on the same operands under the same random state
(``checkpoint`` restores the generators), so losses and gradients are bitwise as without it.

Example:
    >>> import torch
    >>> from conveyor.options import RecomputePolicy
    >>> stage = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    >>> StageRecompute(stage, RecomputePolicy(every=2)).blocks
    ['0', '2']
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy as OpPolicy
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from conveyor.errors import PipelineConfigError, listed
from conveyor.runtime.stage.recomputed_buffers import RecomputedBuffers

if TYPE_CHECKING:
    from conveyor.options import RecomputePolicy

# Counts a tensor kept outside autograd's saved tensors until the returned handle dies (None: no count).
Hold = Callable[[torch.Tensor], object]
_INDEXED = re.compile(r"(?:.*\.)?\d+")


def module_blocks(module: torch.nn.Module, pattern: str | None = None) -> list[str]:
    """The blocks of a stage module, in order: a traced stage's from its graph; a hand-built
    one's, the outermost submodules that are list items (``layers.3``) or match ``pattern``."""
    if hasattr(module, "block_names") and hasattr(module, "wrap_blocks"):
        return module.block_names(pattern)
    found: list[str] = []
    for name, _ in module.named_modules():
        if not name or any(name.startswith(block + ".") for block in found):
            continue
        if re.fullmatch(pattern, name) if pattern is not None else _INDEXED.fullmatch(name):
            found.append(name)
    return found


class StageRecompute:
    """Applies ``policy`` to ``module`` (a stage) and runs the recomputed regions.

    ``hold`` is called at each checkpointed forward and returns what counts the outputs a
    selective region keeps (the stage's memory meter), or None. ``stage``: the stage's id, which a
    refusal names (None: not known).
    """

    def __init__(self, module: torch.nn.Module, policy: RecomputePolicy, *,
                 hold: Callable[[], Hold | None] = lambda: None, stage: int | None = None) -> None:
        self.module = module
        self.policy = policy
        self.stage = stage
        self.hold = hold
        self.saved_operators = frozenset(policy.saved_operators())
        self.blocks: list[str] = []
        self.whole_stage = not policy.per_block
        if policy.per_block:
            self.blocks = self._choose(module_blocks(module, policy.blocks))
            self._wrap_blocks()

    def _choose(self, blocks: Sequence[str]) -> list[str]:
        if not blocks:
            what = (f"matches blocks={self.policy.blocks!r}" if self.policy.blocks is not None
                    else "is an item of a ModuleList or Sequential")
            which = "this stage" if self.stage is None else f"stage {self.stage}"
            has = module_blocks(self.module) if self.policy.blocks is not None else []
            held = (f"its blocks: {listed(has)}" if has else
                    f"it has no blocks; its top modules: {listed([n for n, _ in self.module.named_children()])}")
            raise PipelineConfigError(
                f"checkpoint policy {self.policy.describe()!r}: no module of {which} {what} ({held}); give "
                "blocks= a pattern of its module names (a regular expression matched against each whole "
                "name), or checkpoint the whole stage with {}")
        return list(blocks[::self.policy.every or 1])

    def _wrap_blocks(self) -> None:
        if hasattr(self.module, "wrap_blocks"):
            self.module.wrap_blocks(set(self.blocks), self.checkpointed, self.policy.blocks)
            return
        for name in self.blocks:
            block = self.module.get_submodule(name)
            # The unwrapped forward, kept so that a second pipeline over the module wraps it once.
            forward = block.__dict__.setdefault("_conveyor_plain_forward", block.forward)
            block.forward = self.checkpointed(forward, name)

    def checkpointed(self, function: Callable, block: str | None = None) -> Callable:
        """``function`` recomputed in backward (as is, without gradients), its buffers kept as
        without recomputation; ``block`` names the module holding them (None: the stage)."""
        try:
            holder = self.module if block is None else self.module.get_submodule(block)
        except AttributeError:  # a traced block with no tensors of its own has no container
            holder = None
        buffers = RecomputedBuffers(holder) if holder is not None else None

        def run_checkpointed(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return function(*args, **kwargs)
            return checkpoint(function, *args, use_reentrant=False,
                              context_fn=lambda: self._contexts(buffers), **kwargs)

        return run_checkpointed

    def _contexts(self, buffers: RecomputedBuffers | None) -> tuple[Any, Any]:
        pairs = [buffers()] if buffers is not None else []
        if self.saved_operators:
            pairs.append(_selective(self.saved_operators, self.hold()))
        return _Contexts([forward for forward, _ in pairs]), _Contexts([again for _, again in pairs])


class _Contexts:
    """Several contexts as one, re-enterable (a recomputation may run twice: I, then W)."""

    def __init__(self, contexts: list[Any]) -> None:
        self.contexts = contexts

    def __enter__(self) -> None:
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        for context in reversed(self.contexts):
            context.__exit__(*exc_info)


def _selective(operators: frozenset, hold: Hold | None) -> tuple[Any, Any]:
    """torch's selective-checkpoint contexts for one region: ``operators``' outputs kept."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> OpPolicy:
        return OpPolicy.MUST_SAVE if getattr(op, "overloadpacket", None) in operators else OpPolicy.PREFER_RECOMPUTE

    caching, cached = create_selective_checkpoint_contexts(policy)
    forward = _KeepingForward(caching, hold)
    return forward, _RepeatableRecompute(cached, forward)


class _KeepingForward:
    """The region's forward: after it, a copy of torch's storage of the kept outputs (to hand out again) and
    their count."""

    def __init__(self, caching: Any, hold: Hold | None) -> None:
        self.caching, self.hold = caching, hold
        self.snapshot: dict | None = None
        self.handles: list[object] = []

    def __enter__(self) -> None:
        self.caching.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self.caching.__exit__(*exc_info)
        self.snapshot = {key: dict(entries) for key, entries in self.caching.storage.items()}
        if self.hold is not None:
            tensors = [leaf.val for entries in self.snapshot.values() for entry in entries.values()
                       for leaf in pytree.tree_leaves(entry) if isinstance(getattr(leaf, "val", None), torch.Tensor)]
            self.handles = [self.hold(tensor) for tensor in tensors]


class _RepeatableRecompute:
    def __init__(self, cached: Any, forward: _KeepingForward) -> None:
        self.cached, self.forward = cached, forward

    def __enter__(self) -> None:
        snapshot, storage = self.forward.snapshot, self.forward.caching.storage
        if snapshot is not None:  # what an earlier recomputation consumed, handed out again
            storage.clear()
            storage.update({key: dict(entries) for key, entries in snapshot.items()})
        self.cached.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self.cached.__exit__(*exc_info)

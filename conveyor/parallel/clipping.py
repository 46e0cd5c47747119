"""Clipping by the total gradient norm and the non-finite check, over every stage and replica.

**The total norm, bit for bit.** ``torch.nn.utils.clip_grad_norm_`` takes the norm of each
gradient, stacks those norms (gradients grouped by device and dtype by torch's own grouping
function, the groups in that function's order, parameter order within a group) and takes the
norm of that vector. Clipping each rank by its own parameters' norm would scale every rank by a
different factor: training would silently leave single-device results. Here each rank computes
its parameters' norms exactly as torch does (:func:`parameter_norms`), each tagged with its place
in the unsplit model's parameter order (:func:`local_norms`); :class:`NormExchange` gathers every
rank's norms and every rank stacks them as torch would for the unsplit model, with the same
grouping function. So every rank finds the same total norm, equal to what one device finds, and
scales its gradients by the same factor (:func:`scale_local_grads`). With data parallelism a
gradient may be a DTensor: a replicated one counts whole, a sharded one by its shard's norm
combined over the replicas.

**The exchange.** The stacking order depends on which parameters have gradients and on their
dtypes: the *layout*. It is exchanged once, as Python objects, on the first call (or the first
after ``norm_type``/``foreach`` change, or after :meth:`NormExchange.forget`); every later call
sends only the norms, as one float64 tensor all-gather on the backend's device, and stacks them
on the stage device by indices worked out once. No host read, no object collective. The layout
cannot change on one rank without the others knowing (that would need a host round trip every
call), so a rank whose parameters with gradients changed since the exchange raises, saying so.
A layout with no gradient anywhere (a step dropped by ``on_nonfinite="skip"``) is never kept:
the next call exchanges again.

**The non-finite check.** :func:`nonfinite_flags` marks which stages' gradients or which
microbatch's loss stopped being finite, as a device tensor; the ranks combine theirs with an
all-reduce MAX and :func:`describe_nonfinite` reads the result on the host once per step, only
when the step was asked to (``on_nonfinite``): that read is the one host synchronisation a
checked step makes, since ``"skip"`` must decide, in Python, whether to drop the gradients.

The pipeline's methods (``clip_grad_norm_``, ``forget_norm_layout``, the non-finite report)
are :class:`conveyor.pipe.gradients.GradientChecks`, which calls these.

Example (one process, one dtype: the stacked norms in parameter order are torch's vector):
    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    >>> for p in [*a.parameters(), *b.parameters()]:
    ...     p.grad = torch.ones_like(p)
    >>> grads = [p.grad for m in (a, b) for p in m.parameters()]
    >>> total = torch.linalg.vector_norm(torch.stack(parameter_norms(grads, 2.0)), 2.0)
    >>> torch.equal(total, torch.nn.utils.get_total_norm(grads))
    True
    >>> exchange = NormExchange(lambda mine: [mine], lambda t: t, torch.device("cpu"), torch.device("cpu"))
    >>> places = [(0,), (1,), (2,), (3,)]
    >>> torch.equal(exchange.total(places, grads, parameter_norms(grads, 2.0), 2.0, None), total)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from conveyor.errors import PipelineConfigError
from conveyor.parallel.part import StagePart
from conveyor.runtime.stage.main_grad import gradient
from conveyor.runtime.stage.runner import StageRunner

# -- each rank's norms, and scaling by the total -------------------------------------------------


def parameter_norms(grads: Sequence[torch.Tensor], norm_type: float,
                    foreach: bool | None = None) -> list[torch.Tensor]:
    """Each gradient's norm, computed as ``torch.nn.utils.get_total_norm`` computes it.

    ``foreach`` as in torch: ``None`` uses the foreach kernels where torch would, ``True``
    insists on them (an error on a device that has none), ``False`` never uses them.
    """
    if not grads:
        return []  # a stage without parameters, or whose parameters are all frozen
    norms: list[torch.Tensor | None] = [None] * len(grads)
    grouped = _group_tensors_by_device_and_dtype([list(grads)], with_indices=True)
    for (device, _), ([tensors], indices) in grouped.items():
        if _use_foreach(tensors, device, foreach, "; pass foreach=None (torch picks) or foreach=False"):
            values = torch._foreach_norm(tensors, norm_type)
        else:
            values = [torch.linalg.vector_norm(t, norm_type) for t in tensors]
        for i, value in zip(indices, values):
            norms[i] = value
    return norms  # type: ignore[return-value]


def scale_local_grads(grads: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor,
                      foreach: bool | None = None) -> None:
    """Scale gradients in place as ``torch.nn.utils.clip_grads_with_norm_`` scales parameters' ones.

    For gradients that are not any parameter's ``.grad`` as torch would find it: the local
    tensors of data-parallel DTensor gradients, whose shards each rank scales by the same
    factor (torch's function reads ``p.grad`` and would mix DTensors with a plain total).
    """
    if not grads:
        return
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's formula, to the bit
    grouped = _group_tensors_by_device_and_dtype([list(grads)])
    for (device, _), ([tensors], _) in grouped.items():
        if _use_foreach(tensors, device, foreach):
            torch._foreach_mul_(tensors, coefficient.to(device))
        else:
            for tensor in tensors:
                tensor.mul_(coefficient.to(device))


def _use_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None, advice: str = "") -> bool:
    """Whether torch's clipping runs its foreach kernels on these tensors (``foreach=True`` where a
    device has none: refused, ``advice`` ending the message)."""
    if (foreach is None and _has_foreach_support(tensors, device)) or (foreach and _device_has_foreach_support(device)):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but there are no foreach kernels for {device.type} "
                           f"tensors{advice}")
    return False


def combine_shard_norms(norms: Sequence[torch.Tensor], norm_type: float, group,
                        at: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Whole-tensor norms from each rank's shard norms, over ``group`` (FSDP replicas, TP ranks): the
    p-th root of the summed p-th powers, or the max for the infinity norm, computed in float64 and
    returned in each norm's dtype. One all-reduce; every rank of ``group`` gets the same values.
    ``at``: the positions of the shards' norms among ``norms`` (None: all), the others kept as given."""
    at = range(len(norms)) if at is None else at
    combined = list(norms)
    if not at:
        return combined
    stacked = torch.stack([norms[i].to(torch.float64) for i in at])
    if norm_type == float("inf"):
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
    else:
        stacked = stacked.pow(norm_type)
        dist.all_reduce(stacked, group=group)
        stacked = stacked.pow(1.0 / norm_type)
    for i, value in zip(at, stacked):
        combined[i] = value.to(norms[i].dtype)
    return combined


def check_finite(total: torch.Tensor, norm_type: float) -> None:
    """Raise as torch does when the total norm is NaN or infinite (every rank finds the same total)."""
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the pipeline's gradients is non-finite ({total.item()}), "
            "so it cannot be clipped; to scale the gradients by it anyway pass error_if_nonfinite=False"
        )


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor (a gradient, a parameter): itself, or a DTensor's local tensor
    (differentiable)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def local_norms(runners: Mapping[int, StageRunner], tied_copies: set[int], parameter_order: Mapping[str, int] | None,
                norm_type: float, foreach: bool | None, parts: Sequence[StagePart] = (),
                ) -> tuple[list[tuple[int, ...]], list[torch.Tensor], list[torch.Tensor]]:
    """This rank's gradients' places in the unsplit model's order, the gradients, and their norms
    (device tensors: nothing read on the host).

    ``tied_copies``: ids of copies the unsplit model counts elsewhere (skipped);
    ``parameter_order``: name -> index in the unsplit model (else stage by stage after it);
    ``parts``: the stage parts, each of which makes a gradient it splits count whole
    (:meth:`~conveyor.parallel.part.StagePart.whole_norms`: FSDP replicas' shards, TP shards;
    a collective over the part's group), in their order.
    """
    places, grads, whole = [], [], []
    seen: set[int] = set(tied_copies)
    for stage in sorted(runners):
        for position, (name, param) in enumerate(runners[stage].module.named_parameters()):
            grad = gradient(param)  # main_grad where the gradient accumulates there
            if id(param) not in seen and grad is not None:
                known = parameter_order is not None and name in parameter_order
                places.append((parameter_order[name],) if known else (len(parameter_order or ()), stage, position))
                grads.append(local_part(grad))
                whole.append(grad)
            seen.add(id(param))
    norms = parameter_norms(grads, norm_type, foreach)
    for part in parts:
        norms = part.whole_norms(whole, norms, norm_type)  # a sharded gradient's norm from its shards
    return places, grads, norms


# -- the total norm from every rank's norms ---------------------------------------------------------


@dataclass
class _Layout:
    arguments: tuple  # (norm_type, foreach) it was exchanged for
    mine: tuple  # this rank's (places, gradient dtypes, norm dtypes) then
    width: int  # each rank's slot in the gathered vector: the longest rank's count
    index: torch.Tensor  # positions in the gathered vector, in torch's stacking order (stage device)
    groups: list[tuple[torch.dtype, torch.Tensor]]  # each norm dtype and its positions in the stack
    stacked_dtype: torch.dtype  # what torch.stack makes of those dtypes


class NormExchange:
    """Every rank's gradient norms -> the unsplit model's total norm, on every rank.

    ``gather_objects(mine)`` returns every rank's ``mine`` (by rank; the layout's one exchange);
    ``gather_tensor(t)`` every rank's ``t`` concatenated (an all-gather into one tensor);
    ``device``: the stage device (where the total lives); ``comm_device``: where
    ``gather_tensor`` takes its tensors.
    """

    def __init__(self, gather_objects: Callable[[object], list], gather_tensor: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device, comm_device: torch.device) -> None:
        self.gather_objects, self.gather_tensor = gather_objects, gather_tensor
        self.device, self.comm_device = device, comm_device
        self.layout: _Layout | None = None
        self.exchanges = 0  # how many times the layout travelled (once, normally)

    def forget(self) -> None:
        """Exchange the layout again at the next call (call it on every rank alike)."""
        self.layout = None

    def total(self, places: Sequence[tuple[int, ...]], grads: Sequence[torch.Tensor], norms: Sequence[torch.Tensor],
              norm_type: float, foreach: bool | None) -> torch.Tensor:
        """The total norm of order ``norm_type`` from this rank's ``places``, ``grads`` and ``norms``
        (:func:`local_norms`): equal to torch's for the unsplit model."""
        mine = (tuple(places), tuple(g.dtype for g in grads), tuple(n.dtype for n in norms))
        arguments = (norm_type, foreach)
        layout = self.layout
        if layout is None or layout.arguments != arguments:
            layout = self._exchange(mine, arguments)
        elif layout.mine != mine:
            raise PipelineConfigError(
                f"this rank's parameters with gradients changed since clip_grad_norm_ first exchanged them "
                f"({len(layout.mine[0])} then, {len(mine[0])} now, or their dtypes): ranks agree on them once, so "
                "that later calls need no host round trip. Give every parameter a gradient in every step "
                "(optimizer.zero_grad(set_to_none=False)), or call pipe.forget_norm_layout() on every rank "
                "after changing which parameters train"
            )
        if layout.index.numel() == 0:
            return torch.tensor(0.0, device=self.device)
        vector = torch.zeros(layout.width, dtype=torch.float64, device=self.comm_device)
        if norms:
            vector[: len(norms)] = torch.stack([n.to(torch.float64) for n in norms])
        values = self.gather_tensor(vector).to(self.device).index_select(0, layout.index)
        if len(layout.groups) == 1:
            dtype = layout.groups[0][0]
            stacked = values.to(dtype).to(layout.stacked_dtype)
        else:
            stacked = torch.empty(values.numel(), dtype=layout.stacked_dtype, device=self.device)
            for dtype, positions in layout.groups:
                stacked.index_copy_(0, positions, values.index_select(0, positions).to(dtype).to(layout.stacked_dtype))
        return torch.linalg.vector_norm(stacked, norm_type)

    def _exchange(self, mine: tuple, arguments: tuple) -> _Layout:
        everyone = self.gather_objects(mine)
        self.exchanges += 1
        width = max((len(places) for places, _, _ in everyone), default=0)
        # (place, gradient dtype, norm dtype, position in the gathered vector), in the model's order
        flat = sorted(((place, grad, norm, rank * width + i)
                       for rank, (places, grads, norms) in enumerate(everyone)
                       for i, (place, grad, norm) in enumerate(zip(places, grads, norms))), key=lambda e: e[0])
        # torch's grouping function on placeholders of the gradients' dtypes gives its stacking order.
        placeholders = [torch.empty(0, dtype=grad, device=self.device) for _, grad, _, _ in flat]
        grouped = _group_tensors_by_device_and_dtype([placeholders], with_indices=True) if flat else {}
        order = [i for _, indices in grouped.values() for i in indices]
        norm_dtypes = [flat[i][2] for i in order]
        groups = [(dtype, torch.tensor([k for k, d in enumerate(norm_dtypes) if d == dtype], device=self.device))
                  for dtype in dict.fromkeys(norm_dtypes)]
        stacked_dtype = torch.stack([torch.zeros((), dtype=d) for d in norm_dtypes]).dtype if flat else torch.float32
        layout = _Layout(arguments, mine, width, torch.tensor([flat[i][3] for i in order], dtype=torch.int64,
                                                              device=self.device), groups, stacked_dtype)
        self.layout = layout if flat else None  # no gradient anywhere: exchange again next time
        return layout


# -- the non-finite check ---------------------------------------------------------------------------


def nonfinite_flags(runners: Mapping[int, StageRunner], num_stages: int, num_microbatches: int,
                    device: torch.device | None = None,
                    stage_flag: Callable[[StageRunner], torch.Tensor | None] | None = None) -> torch.Tensor:
    """Per stage, 1 where one of its gradients here is not finite (``stage_flag(runner)`` instead where given,
    None for no flag: loss scaling's unscale); last, 1 + the first microbatch whose loss is not (0: none).
    Combine every rank's with an all-reduce MAX.

    A float64 tensor on ``device`` (the stage device; default the CPU), computed there without a
    host read: only :func:`describe_nonfinite` reads it, once.
    """
    flags = torch.zeros(num_stages + 1, dtype=torch.float64, device=device)
    for stage, runner in runners.items():
        flag = (stage_flag or _nonfinite_gradient)(runner)
        if flag is not None:
            flags[stage] = flag.to(flags.device, torch.float64)
    last = runners.get(num_stages - 1)
    if last is not None:  # 1 + the first microbatch whose loss is not finite, as a device tensor: no host read
        bad = ~torch.stack([last.losses[m].isfinite().all() for m in range(num_microbatches)])
        numbers = torch.arange(1, num_microbatches + 1, device=bad.device)
        first = torch.where(bad, numbers, num_microbatches + 1).min()
        flags[num_stages] = torch.where(first <= num_microbatches, first, 0).to(flags.device, torch.float64)
    return flags


def _nonfinite_gradient(runner: StageRunner) -> torch.Tensor | None:
    """Whether one of ``runner``'s gradients here is not finite (None: it has none here)."""
    grads = [local_part(g) for g in map(gradient, runner.module.parameters()) if g is not None]
    if not grads:
        return None
    return ~torch.stack([g.detach().float().norm() for g in grads]).isfinite().all()


def check_nonfinite_mode(on_nonfinite: str | None) -> None:
    """Refuse an ``on_nonfinite`` other than None, ``"raise"`` or ``"skip"``.

    Example:
        >>> check_nonfinite_mode("skip")
    """
    if on_nonfinite not in (None, "raise", "skip"):
        raise PipelineConfigError(f"on_nonfinite must be None, 'raise' or 'skip'; got {on_nonfinite!r}")


def describe_nonfinite(flags: torch.Tensor | Sequence[float]) -> str:
    """Empty, or the step's non-finite loss and gradients in words, from every rank's combined flags.

    Example:
        >>> describe_nonfinite(torch.tensor([0.0, 1.0, 3.0]))
        'the loss of microbatch 2 (stage 1, the first such microbatch) and the gradients of stage(s) [1] are not finite'
    """
    # The check's one host read (on a GPU, its one synchronisation), unless the caller read them already.
    values = flags.tolist() if isinstance(flags, torch.Tensor) else list(flags)
    num_stages = len(values) - 1
    stages = [s for s in range(num_stages) if values[s]]
    microbatch = int(values[num_stages]) - 1
    parts = []
    if microbatch >= 0:
        parts.append(f"the loss of microbatch {microbatch} (stage {num_stages - 1}, the first such microbatch)")
    if stages:
        parts.append(f"the gradients of stage(s) {stages}")
    return " and ".join(parts) + " are not finite" if parts else ""

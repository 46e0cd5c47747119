"""Dispatch and combine: a mixture of experts' tokens sent to the ranks that own their experts, and back.

Each rank of an expert-parallel group of ``ep`` ranks owns ``num_experts / ep`` consecutive experts
(rank r owns experts ``r * local .. (r + 1) * local - 1``). One call of :func:`dispatch_combine`, for
one microbatch's tokens at one MoE layer:

1. sort this rank's (token, choice) slots by expert (stable: token order within an expert), so the
   slots bound for each rank are contiguous;
2. all-to-all of the per-expert slot counts (``[ep, local]`` each way);
3. **the host read**: the counts become Python split sizes (``.tolist()``), the one device-to-host
   synchronisation of a call, right after the counts' all-to-all and before the tokens' (a stage's
   forward pass waits here once per MoE layer; on a GPU it stalls the host until the counts arrive);
4. all-to-all of the tokens (torch's ``all_to_all_single_autograd``: its backward is the reverse
   all-to-all of the gradients);
5. the local experts' compute, by the model's own expert code (``compute``) on the received tokens
   grouped by local expert (source-rank order within an expert);
6. the reverse all-to-all of the results, then the combine: each slot's result times its routing
   weight, summed into its token in expert order, as transformers' eager experts loop sums them.

No token is dropped unless a capacity factor is given: each expert then takes at most
``ceil(factor x routed slots / num_experts)`` of this rank's slots (GShard's and Switch's per-rank
capacity), the later ones in token order routed nowhere (their token keeps what the other choices give,
as a slot routed nowhere does in transformers). Every call keeps its
state in its own locals and autograd's graph, none on a module, so any number of microbatches may
be in flight in one layer at once (the pipeline's schedules interleave them).

Every all-to-all goes through an :class:`Exchanges` of the group, which posts it, times it (the part's
communication spans) and, for an emulated workload, holds it to a set time. :func:`dispatch_combine_steps`
is the computation as a generator that yields while each is in flight and cuts the autograd graph there, for
the overlapped pairs of :mod:`conveyor.parallel.experts.overlap`; :func:`dispatch_combine` runs it through at
once, cutting nothing.

Example (on each rank of an ``ep``-rank group; ``experts`` computes tokens sorted by local expert)::

    out = dispatch_combine(hidden, top_k_index, top_k_weights, num_experts=8, group=ep_group,
                           compute=lambda tokens, local_ids: experts_math(tokens, local_ids))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.parallel.clipping import local_part
from conveyor.runtime.stage.segments import Boundary, Reverse, run_to_end

Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def dispatch_combine(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                     num_experts: int, group, compute: Compute, capacity_factor: float | None = None,
                     dropped: torch.Tensor | None = None, exchanges: Exchanges | None = None) -> torch.Tensor:
    """The experts' output for ``hidden`` ([tokens, hidden]) routed by ``top_k_index`` / ``top_k_weights``
    ([tokens, k] each), the experts spread over ``group``'s ranks; differentiable.

    ``compute(tokens, local_ids)``: this rank's experts applied to ``tokens`` ([n, hidden], grouped by
    ``local_ids``, the local expert of each row, ascending), unweighted. ``capacity_factor``: see the module
    docstring (None: every slot reaches its expert); ``dropped``: a counter the dropped slots are added to;
    ``exchanges``: how the all-to-alls are posted (None: at once, untimed).

    Example::

        out = dispatch_combine(h, idx, w, num_experts=4, group=group, compute=local_experts)
    """
    return run_to_end(dispatch_combine_steps(
        hidden, top_k_index, top_k_weights, num_experts=num_experts, exchanges=exchanges or Exchanges(group),
        compute=compute, cut=lambda: _Uncut, capacity_factor=capacity_factor, dropped=dropped))


def dispatch_combine_steps(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                           num_experts: int, exchanges: Exchanges, compute: Compute, cut: Callable[[], Boundary],
                           capacity_factor: float | None = None, dropped: torch.Tensor | None = None
                           ) -> Generator[None, None, torch.Tensor]:
    """:func:`dispatch_combine` as steps: yields after posting each all-to-all, waits for it when resumed, and
    cuts the autograd graph at the tokens' two (``cut()`` opens a cut that also takes every value the stage
    still needs after the experts): the segments of :mod:`conveyor.runtime.stage.segments`. Same numbers.

    Example::

        out = yield from dispatch_combine_steps(h, idx, w, num_experts=4, exchanges=exchanges,
                                                compute=local_experts, cut=passes.boundary)
    """
    slots_expert = top_k_index.reshape(-1)  # each (token, choice) slot's expert (num_experts: nowhere)
    if capacity_factor is not None:
        slots_expert = over_capacity_nowhere(slots_expert, num_experts, capacity_factor, dropped)
    # The slots per expert as [ep, local]; an index of num_experts marks a slot routed nowhere (transformers'
    # experts skip it): not counted.
    ep = dist.get_world_size(exchanges.group)
    counts = torch.bincount(slots_expert, minlength=num_experts + 1)[:num_experts].view(ep, num_experts // ep)
    posted = exchanges.post("counts", counts)
    yield
    routes = Routes.of(slots_expert, counts, posted.wait(), top_k_index.shape[-1])
    sent = hidden[routes.slot_token]
    posted = exchanges.post("dispatch", sent, routes.receive_splits, routes.send_splits)
    dispatched = cut()
    weights = dispatched.cut(top_k_weights)  # (``hidden`` only gives the combine its shape: no gradient there)
    yield
    received = dispatched.exchanged(sent, posted.wait(), routes.reverse(exchanges, "dispatch"))
    results = routes.computed(received, compute)
    posted = exchanges.post("combine", results, routes.send_splits, routes.receive_splits)
    combined = cut()
    weights = combined.cut(weights)
    yield
    returned = combined.exchanged(results, posted.wait(), routes.reverse(exchanges, "combine"))
    return routes.combined(hidden, returned, weights)


@dataclass
class Routes:
    """Where one layer's slots go and come back from, once both sides' counts are known (the host read)."""

    send_splits: list[int]
    receive_splits: list[int]
    order: torch.Tensor  # slots sorted by expert, so by owning rank; those routed nowhere left out
    slot_token: torch.Tensor  # each sorted slot's token
    by_expert: torch.Tensor  # received rows ordered by local expert (source-rank order within one)
    local_ids: torch.Tensor  # the local expert of each row, in by_expert order

    @classmethod
    def of(cls, slots_expert: torch.Tensor, counts: torch.Tensor, received_counts: torch.Tensor,
           choices: int) -> Routes:
        """The routes for this rank's ``counts`` and the ``received_counts`` ([source, local expert])."""
        # The host read (step 3 of the module docstring): the split sizes of both token all-to-alls.
        send_splits, receive_splits = counts.sum(1).tolist(), received_counts.sum(1).tolist()
        order = torch.argsort(slots_expert, stable=True)[:sum(send_splits)]
        ep, local = counts.shape
        local_ids = torch.repeat_interleave(torch.arange(local, device=counts.device).repeat(ep),
                                            received_counts.reshape(-1))
        by_expert = torch.argsort(local_ids, stable=True)
        return cls(send_splits, receive_splits, order, order // choices, by_expert, local_ids[by_expert])

    def computed(self, received: torch.Tensor, compute: Compute) -> torch.Tensor:
        """The local experts' results for the received rows, back in the order they came in."""
        computed = compute(received[self.by_expert], self.local_ids).to(received.dtype)
        return computed[torch.argsort(self.by_expert)]  # back to source-rank order (the inverse permutation)

    def combined(self, hidden: torch.Tensor, returned: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each slot's returned result times its routing weight, summed into its token (in expert order)."""
        weighted = returned * weights.reshape(-1)[self.order, None].to(returned.dtype)
        return torch.zeros_like(hidden).index_add(0, self.slot_token, weighted.to(hidden.dtype))

    def reverse(self, exchanges: Exchanges, label: str) -> Callable[[torch.Tensor], PostedExchange]:
        """How the gradient of what ``label`` received goes back (the reverse all-to-all)."""
        forward = {"dispatch": (self.send_splits, self.receive_splits),
                   "combine": (self.receive_splits, self.send_splits)}[label]
        return lambda grad: exchanges.post(f"{label} grad", grad, *forward)


def local_compute(experts: torch.nn.Module, weights_dtype: torch.dtype) -> Compute:
    """``compute(tokens, local_ids)`` for :func:`dispatch_combine`: this rank's experts on received rows."""
    from torch.nn.utils.stateless import _reparametrize_module

    own_forward = type(experts).forward

    def compute(tokens: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        # Each row to its one local expert at weight 1 (x * 1 is exact): the routing weights are
        # applied once the results are back at their tokens, as the model applies them. The model's
        # own code runs on the shards' local tensors (their gradients flow back to the DTensors).
        ones = torch.ones((tokens.shape[0], 1), dtype=weights_dtype, device=tokens.device)
        local = {name: local_part(p) for name, p in experts.named_parameters(recurse=False)}
        with _reparametrize_module(experts, local):
            return own_forward(experts, tokens, local_ids[:, None], ones)

    return compute


class Exchanges:
    """The all-to-alls of one expert-parallel group: posted, timed, and held to ``set_time_s`` when given (an
    emulated workload's all-to-all of tokens takes that long, as its emulated stages take set compute times).

    :attr:`spans`: while :attr:`recording` (the owner's training step), each exchange's (label, posted, waited
    from, done), on ``time.perf_counter``'s clock (three clock reads an all-to-all).
    """

    def __init__(self, group, set_time_s: float | None = None) -> None:
        self.group, self.set_time_s = group, set_time_s
        self.spans: list[tuple[str, float, float, float]] = []
        self.recording = False

    def post(self, label: str, tensor: torch.Tensor, output_splits: list[int] | None = None,
             input_splits: list[int] | None = None) -> PostedExchange:
        """Post the all-to-all of ``tensor``'s rows (split by ``input_splits``; ``output_splits`` arrive)."""
        tensor = tensor.contiguous()
        rows = tensor.shape[0] if output_splits is None else sum(output_splits)
        output = tensor.new_empty((rows, *tensor.shape[1:]))
        posted = time.perf_counter()
        work = dist.all_to_all_single(output, tensor, output_splits, input_splits, group=self.group, async_op=True)
        return PostedExchange(self, label, work, output, posted)


@dataclass
class PostedExchange:
    """One all-to-all in flight; :meth:`wait` gives what arrived."""

    exchanges: Exchanges
    label: str
    work: object
    output: torch.Tensor
    posted: float

    def wait(self) -> torch.Tensor:
        """What arrived (not before the set time after posting, on an emulated workload)."""
        exchanges = self.exchanges
        waited = time.perf_counter()
        self.work.wait()
        if exchanges.set_time_s and self.label != "counts":  # the tokens' all-to-alls; the counts' are 2 x E ints
            left = self.posted + exchanges.set_time_s - time.perf_counter()
            if left > 0:
                time.sleep(left)
        if exchanges.recording:
            exchanges.spans.append((self.label, self.posted, waited, time.perf_counter()))
        return self.output


class _Uncut(torch.autograd.Function):
    """The cut of a pass that is not segmented (:func:`dispatch_combine`'s; the class itself, as a Boundary's
    stand-in): nothing is cut, and what an all-to-all received stays in autograd's graph, its backward the
    reverse all-to-all, waited for at once."""

    @staticmethod
    def cut(value: Any) -> Any:
        return value

    @staticmethod
    def exchanged(sent: torch.Tensor, received: torch.Tensor, reverse: Reverse) -> torch.Tensor:
        return _Uncut.apply(sent, received, reverse)

    @staticmethod
    def forward(ctx, sent: torch.Tensor, received: torch.Tensor, reverse: Reverse) -> torch.Tensor:
        ctx.reverse = reverse
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.reverse(grad).wait(), None, None


def over_capacity_nowhere(slots_expert: torch.Tensor, num_experts: int, capacity_factor: float,
                          dropped: torch.Tensor | None = None) -> torch.Tensor:
    """``slots_expert`` (each slot's expert; ``num_experts``: routed nowhere) with the slots beyond each expert's
    capacity, ``ceil(capacity_factor x routed slots / num_experts)``, routed nowhere: the later ones in slot order.

    Example:
        >>> over_capacity_nowhere(torch.tensor([0, 0, 0, 1, 2]), 2, 1.0).tolist()   # 4 routed slots: 2 an expert
        [0, 0, 2, 1, 2]
    """
    routed = slots_expert < num_experts
    capacity = torch.ceil(routed.sum() * capacity_factor / num_experts)  # a tensor: no host read here
    seen = torch.nn.functional.one_hot(slots_expert, num_experts + 1).cumsum(0)  # slots so far, per expert
    place = seen.gather(1, slots_expert[:, None]).squeeze(1) - 1  # each slot's place among its expert's
    over = routed & (place >= capacity)
    if dropped is not None:
        dropped.add_(over.sum().to(dropped.device))
    return torch.where(over, num_experts, slots_expert)

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

Example (on each rank of an ``ep``-rank group; ``experts`` computes tokens sorted by local expert)::

    out = dispatch_combine(hidden, top_k_index, top_k_weights, num_experts=8, group=ep_group,
                           compute=lambda tokens, local_ids: experts_math(tokens, local_ids))
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def dispatch_combine(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                     num_experts: int, group, compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     capacity_factor: float | None = None, dropped: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' output for ``hidden`` ([tokens, hidden]) routed by ``top_k_index`` / ``top_k_weights``
    ([tokens, k] each), the experts spread over ``group``'s ranks; differentiable.

    ``compute(tokens, local_ids)``: this rank's experts applied to ``tokens`` ([n, hidden], grouped by
    ``local_ids``, the local expert of each row, ascending), unweighted. ``capacity_factor``: see the module
    docstring (None: every slot reaches its expert); ``dropped``: a counter the dropped slots are added to.

    Example::

        out = dispatch_combine(h, idx, w, num_experts=4, group=group, compute=local_experts)
    """
    import torch.distributed as dist

    ep = dist.get_world_size(group)
    local = num_experts // ep
    choices = top_k_index.shape[-1]
    slots_expert = top_k_index.reshape(-1)
    if capacity_factor is not None:
        slots_expert = over_capacity_nowhere(slots_expert, num_experts, capacity_factor, dropped)
    # An index of num_experts marks a slot routed nowhere (transformers' experts skip it): not counted.
    counts = torch.bincount(slots_expert, minlength=num_experts + 1)[:num_experts].view(ep, local)  # per expert
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [source, local expert]: what I get
    # The host read (step 3 of the module docstring): the split sizes of both token all-to-alls.
    send_splits = counts.sum(1).tolist()
    receive_splits = received_counts.sum(1).tolist()
    # Slots by expert, so by owning rank; those routed nowhere sort last and stay here.
    order = torch.argsort(slots_expert, stable=True)[:sum(send_splits)]
    slot_token = order // choices
    received = _all_to_all(hidden[slot_token], receive_splits, send_splits, group)
    local_ids = torch.repeat_interleave(torch.arange(local, device=hidden.device).repeat(ep),
                                        received_counts.reshape(-1))
    by_expert = torch.argsort(local_ids, stable=True)  # source-rank order within each local expert
    computed = compute(received[by_expert], local_ids[by_expert]).to(received.dtype)
    results = computed[torch.argsort(by_expert)]  # back to source-rank order (the inverse permutation)
    returned = _all_to_all(results, send_splits, receive_splits, group)  # [slots], sorted by expert
    weighted = returned * top_k_weights.reshape(-1)[order, None].to(returned.dtype)
    return torch.zeros_like(hidden).index_add(0, slot_token, weighted.to(hidden.dtype))


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


def _all_to_all(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows of ``tensor`` split by ``input_splits`` to each rank; rows received by ``output_splits``;
    differentiable (the gradient goes back the reverse way). Waited for here: the rows are needed now."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(tensor.contiguous(), output_splits, input_splits, group))

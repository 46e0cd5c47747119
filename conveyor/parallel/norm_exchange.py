"""The pipeline's total gradient norm from every rank's norms, through tensor collectives only.

:mod:`conveyor.runtime.clip` says what the total must be, bit for bit: every rank's
per-parameter norms, stacked in the order torch stacks them for the unsplit model (grouped
by gradient dtype, parameter order within a group), each rounded to its norm's dtype. That
order depends on which parameters have gradients and on their dtypes: the *layout*. The
layout is exchanged once, as Python objects, on the first call (or the first after
``norm_type``/``foreach`` change, or after :meth:`NormExchange.forget`); every later call
sends only the norms, as one float64 tensor all-gather on the backend's device, and stacks
them on the stage device by indices worked out once. No host read, no object collective.

The layout cannot change on one rank without the others knowing (that would need a host
round trip every call), so a rank whose parameters with gradients changed since the exchange
raises, saying so. A layout with no gradient anywhere (a step dropped by
``on_nonfinite="skip"``) is never kept: the next call exchanges again.

Example (one process: nobody to exchange with)::

    exchange = NormExchange(lambda mine: [mine], lambda t: t, torch.device("cpu"), torch.device("cpu"))
    total = exchange.total(*local_norms(runners, set(), None, 2.0, None), norm_type=2.0, foreach=None)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from conveyor.errors import PipelineConfigError


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
        (:func:`conveyor.parallel.norms.local_norms`): equal to torch's for the unsplit model."""
        mine = (tuple(places), tuple(_name(g.dtype) for g in grads), tuple(_name(n.dtype) for n in norms))
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
        placeholders = [torch.empty(0, dtype=getattr(torch, grad), device=self.device) for _, grad, _, _ in flat]
        grouped = _group_tensors_by_device_and_dtype([placeholders], with_indices=True) if flat else {}
        order = [i for _, indices in grouped.values() for i in indices]
        norm_dtypes = [getattr(torch, flat[i][2]) for i in order]
        groups = [(dtype, torch.tensor([k for k, d in enumerate(norm_dtypes) if d == dtype], device=self.device))
                  for dtype in dict.fromkeys(norm_dtypes)]
        stacked_dtype = torch.stack([torch.zeros((), dtype=d) for d in norm_dtypes]).dtype if flat else torch.float32
        layout = _Layout(arguments, mine, width, torch.tensor([flat[i][3] for i in order], dtype=torch.int64,
                                                              device=self.device), groups, stacked_dtype)
        self.layout = layout if flat else None  # no gradient anywhere: exchange again next time
        return layout


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""Activation recomputation that leaves a stage's buffers, and its gradients, as a run without it.

``torch.utils.checkpoint`` runs a stage's forward a second time in backward. Two things go
wrong with modules that write to their buffers in forward (BatchNorm's running statistics
and batch counter, spectral norm's power-iteration vectors, a quantisation observer's
range, any ``self.steps += 1``):

* they write again, so after a step their buffers differ from a run without
  recomputation: a BatchNorm stage counts every microbatch twice and its running mean
  moves twice as far;
* a module that also *reads* such a buffer (spectral norm divides by the norm its vectors
  give, an observer scales by its range) reads, in the recomputation, what later
  forwards and the recomputation itself wrote, not what its forward read. The recomputed
  activations differ, and so do the gradients, silently.

One device without recomputation is the reference conveyor keeps bitwise, so each
recomputation starts from the buffers its forward started from and, when it ends, puts
back the buffers it found. Which buffers a forward writes cannot be read off the model or
learned once: BatchNorm's kernel updates the running statistics without bumping their
version counter, and which modules write depends on their modes (a BatchNorm frozen with
``.eval()`` for a while, then unfrozen) and on the branches a forward takes. So every
buffer is compared, and only those whose values (or tensor) differ are written: a buffer
autograd saved for backward must keep its version.

Memory: the buffers as each forward found them live until that microbatch's
recomputation. A buffer that no forward changes (a causal mask, a rotary table) is held
once, not once per microbatch; one that changes (running statistics) costs a copy per
microbatch in flight.

Example:
    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> norm = torch.nn.BatchNorm1d(3)
    >>> out = checkpoint(norm, torch.randn(4, 3, requires_grad=True), use_reentrant=False,
    ...                  context_fn=RecomputedBuffers(norm))
    >>> out.sum().backward()
    >>> int(norm.num_batches_tracked)  # 2 with a plain checkpoint
    1
"""

from __future__ import annotations

import contextlib

import torch

# (module that holds the buffer, its attribute name, the tensor held, the values to have)
_BufferState = tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]


class RecomputedBuffers:
    """``checkpoint(context_fn=...)`` for ``module``: each recomputation sees its forward's buffers.

    Call it once per checkpointed forward (``checkpoint`` does); it returns the two
    contexts, around the forward and around its recomputation, of that one microbatch.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        # The last copy taken of each buffer, by name: reused while the values hold (copies
        # are never written, so any equal one serves a forward or a recomputation alike).
        self._last_copies: dict[str, torch.Tensor] = {}

    def __call__(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        forward = _AroundForward(self)
        return forward, _AroundRecomputation(forward)

    def current_state(self) -> list[_BufferState]:
        """Every buffer with a copy of its values: the last copy taken, if the values are the same."""
        states = []
        for name, buffer in self.module.named_buffers():
            owner_name, _, attribute = name.rpartition(".")
            owner = self.module.get_submodule(owner_name) if owner_name else self.module
            copy = self._last_copies.get(name)
            if copy is None or not _same(copy, buffer):
                copy = self._last_copies[name] = buffer.clone()
            states.append((owner, attribute, buffer, copy))
        return states


# Plain classes, not generator-based contexts (which can be entered once only): a recomputation
# may run more than once, as the zero-bubble schedules' I and W passes each unpack saved tensors.
class _AroundForward:
    def __init__(self, buffers: RecomputedBuffers) -> None:
        self.buffers = buffers
        self.found: list[_BufferState] = []

    def __enter__(self) -> None:
        self.found = self.buffers.current_state()

    def __exit__(self, *exc_info) -> None:
        pass


class _AroundRecomputation:
    def __init__(self, forward: _AroundForward) -> None:
        self.forward = forward
        self.found: list[_BufferState] = []

    def __enter__(self) -> None:
        self.found = self.forward.buffers.current_state()
        _put(self.forward.found)

    def __exit__(self, *exc_info) -> None:
        held = {(id(owner), attribute) for owner, attribute, _, _ in self.found}
        for owner, attribute, _, _ in self.forward.found:  # deleted since the forward: deleted again
            if (id(owner), attribute) not in held:
                owner._buffers.pop(attribute, None)
        _put(self.found)
        self.found = []


def _put(states: list[_BufferState]) -> None:
    """Make each module hold its tensor again, with the values given, writing only what differs."""
    with torch.no_grad():
        for owner, attribute, buffer, values in states:
            if owner._buffers.get(attribute) is not buffer:  # a forward assigned another tensor
                owner._buffers[attribute] = buffer
            if not _same(values, buffer):
                if buffer.shape != values.shape:  # resized in place
                    buffer.resize_(values.shape)
                buffer.copy_(values)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal in dtype, shape and every element, NaN matching NaN (a NaN statistic is not a write)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())

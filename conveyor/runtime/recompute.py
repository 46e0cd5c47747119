"""Activation checkpointing that updates a stage's buffers once, as the forward without it does.

``torch.utils.checkpoint`` runs a stage's forward a second time in backward. Modules that
write to their buffers in forward (BatchNorm's running statistics and batch counter, any
``self.steps += 1``) write again then, so after a step their buffers differ from a run
without checkpointing: a BatchNorm stage counts every microbatch twice and its running
mean moves twice as far. One device without checkpointing is the reference conveyor keeps
bitwise, so the recomputation must leave buffers as it found them.

Which buffers a forward writes cannot be read off the model or learned once: BatchNorm's
kernel updates the running statistics without bumping their version counter, and which
modules write depends on their modes (a BatchNorm frozen with ``.eval()`` for a while,
then unfrozen) and on the branches a forward takes. So every recomputation saves every
buffer of the stage and, when it ends, puts back those whose values (or tensor) changed,
and only those: a buffer autograd saved for backward must keep its version. Buffers are
usually small (normalisation statistics, rotary tables); the copy costs one pass over
them per recomputed microbatch.

Example:
    >>> import torch
    >>> from functools import partial
    >>> from torch.utils.checkpoint import checkpoint
    >>> norm = torch.nn.BatchNorm1d(3)
    >>> out = checkpoint(norm, torch.randn(4, 3, requires_grad=True), use_reentrant=False,
    ...                  context_fn=partial(recompute_contexts, norm))
    >>> out.sum().backward()
    >>> int(norm.num_batches_tracked)  # 2 with a plain checkpoint
    1
"""

from __future__ import annotations

import contextlib

import torch


def recompute_contexts(module: torch.nn.Module) -> tuple[contextlib.AbstractContextManager,
                                                       contextlib.AbstractContextManager]:
    """``(around the forward, around its recomputation)`` for a non-reentrant ``checkpoint`` of ``module``.

    Pass ``functools.partial(recompute_contexts, module)`` as ``checkpoint(context_fn=...)``.
    """
    return contextlib.nullcontext(), _RestoreBuffers(module)


class _RestoreBuffers:
    """Around a recomputation: every buffer it changed is put back as it was."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.saved = [(name, buffer, buffer.clone()) for name, buffer in self.module.named_buffers()]

    def __exit__(self, *exc_info) -> None:
        with torch.no_grad():
            for name, buffer, values in self.saved:
                owner_name, _, attribute = name.rpartition(".")
                owner = self.module.get_submodule(owner_name) if owner_name else self.module
                if owner._buffers.get(attribute) is not buffer:  # the forward assigned another tensor
                    owner._buffers[attribute] = buffer
                if not _same(values, buffer):
                    if buffer.shape != values.shape:  # resized in place
                        buffer.resize_(values.shape)
                    buffer.copy_(values)
        self.saved = []


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal in dtype, shape and every element, NaN matching NaN (a NaN statistic is not a write)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())

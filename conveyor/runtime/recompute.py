"""Activation checkpointing that updates a stage's buffers once, as the forward without it does.

``torch.utils.checkpoint`` runs a stage's forward a second time in backward. Modules that
write to their buffers in forward (BatchNorm's running statistics and batch counter, any
``self.steps += 1``) write again then, so after a step their buffers differ from a run
without checkpointing: a BatchNorm stage counts every microbatch twice and its running
mean moves twice as far. One device without checkpointing is the reference conveyor keeps
bitwise, so the recomputation must leave buffers as it found them.

Which buffers a forward writes cannot be read off the model: BatchNorm's kernel updates the
running statistics without bumping their version counter. So the first checkpointed forward
in each mode (train or eval) compares every buffer before and after, and learns the set;
every recomputation then saves those buffers and puts them back when it ends. A buffer the
first forward left alone but a later recomputation changes (version counter moved, or the
attribute now holds another tensor) is added to the set, with a warning that one step
updated it twice.

Example:
    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> norm = torch.nn.BatchNorm1d(3)
    >>> guard = RecomputeGuard(norm)
    >>> out = checkpoint(norm, torch.randn(4, 3, requires_grad=True), use_reentrant=False,
    ...                  context_fn=guard.contexts)
    >>> out.sum().backward()
    >>> int(norm.num_batches_tracked)  # 2 with a plain checkpoint
    1
"""

from __future__ import annotations

import contextlib
import warnings

import torch


class RecomputeGuard:
    """Hands ``torch.utils.checkpoint`` the contexts that keep ``module``'s buffers from being written twice.

    Pass :meth:`contexts` as ``context_fn`` to a non-reentrant ``checkpoint`` of ``module``.
    ``where`` names the module in warnings (``"rank 1, stage 2"``).
    """

    def __init__(self, module: torch.nn.Module, where: str = "this stage") -> None:
        self.module = module
        self.where = where
        self.written: dict[bool, set[str]] = {}  # per training flag: the buffers a forward writes

    def contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``(around the forward, around its recomputation)``, for ``checkpoint(context_fn=...)``."""
        training = self.module.training
        first = contextlib.nullcontext() if training in self.written else _LearnWrites(self, training)
        return first, _RestoreBuffers(self, training)

    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_buffers())

    def put_back(self, name: str, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the module's buffer ``name`` again (after a forward that assigned another)."""
        owner_name, _, attribute = name.rpartition(".")
        owner = self.module.get_submodule(owner_name) if owner_name else self.module
        owner._buffers[attribute] = tensor


class _LearnWrites:
    """Around the first checkpointed forward of a mode: which buffers it changes."""

    def __init__(self, guard: RecomputeGuard, training: bool) -> None:
        self.guard = guard
        self.training = training

    def __enter__(self) -> None:
        self.before = {name: (buffer, buffer.clone()) for name, buffer in self.guard.buffers().items()}

    def __exit__(self, *exc_info) -> None:
        if exc_info[0] is not None:
            return  # learn from a forward that completed
        written = set()
        for name, buffer in self.guard.buffers().items():
            previous = self.before.get(name)
            if previous is None or previous[0] is not buffer or not _same(previous[1], buffer):
                written.add(name)
        self.guard.written[self.training] = written


class _RestoreBuffers:
    """Around a recomputation: the buffers the forward writes are put back as they were."""

    def __init__(self, guard: RecomputeGuard, training: bool) -> None:
        self.guard = guard
        self.training = training

    def __enter__(self) -> None:
        buffers = self.guard.buffers()
        written = self.guard.written.setdefault(self.training, set())
        self.saved = {name: (buffers[name], buffers[name].clone()) for name in written if name in buffers}
        self.versions = {name: (buffer, buffer._version) for name, buffer in buffers.items()}

    def __exit__(self, *exc_info) -> None:
        with torch.no_grad():
            for name, (tensor, values) in self.saved.items():
                self.guard.put_back(name, tensor)
                tensor.copy_(values)
        newly_written = [
            name for name, buffer in self.guard.buffers().items()
            if name not in self.saved and (name not in self.versions or self.versions[name][0] is not buffer
                                           or self.versions[name][1] != buffer._version)
        ]
        if newly_written:
            self.guard.written[self.training].update(newly_written)
            warnings.warn(
                f"activation checkpointing on {self.guard.where}: the recomputed forward changed buffer(s) "
                f"{', '.join(sorted(newly_written))}, which the first forward left alone, so this step "
                "updated them twice; conveyor restores them after every recomputation from now on",
                stacklevel=2,
            )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal in dtype, shape and every element, NaN matching NaN (a NaN statistic is not a write)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())

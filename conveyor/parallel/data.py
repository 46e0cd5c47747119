"""Data only where it is read: loaders on the ranks that run the first or the last stage.

A pipeline's inputs are read by the rank that runs stage 0 and its targets by the rank that
runs the last stage; every other rank passes ``None`` to ``pipe.step``. :func:`data_loader`
builds the dataset (from a factory, so a middle rank never holds it) and a ``DataLoader``
over this replica's share of it (torch's ``DistributedSampler`` over the "dp" replicas) on
those ranks only, and returns ``None`` elsewhere. The first and the last rank of a replica
draw the same samples in the same order (same replica, same seed), so inputs and targets
meet again at the last stage.

Example (the same script on every rank)::

    loader = data_loader(pipe, lambda: load_my_dataset(), batch_size=8)
    batches = iter(loader) if loader is not None else itertools.repeat((None, None))
    for step in range(steps):
        x, y = next(batches)
        loss = pipe.step(x if pipe.needs_inputs else None, target=y if pipe.needs_target else None)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def data_loader(pipe: Any, dataset_factory: Callable[[], Any], batch_size: int, *, shuffle: bool = True,
                seed: int = 0, drop_last: bool = True, **loader_kwargs: Any):
    """A ``DataLoader`` over this replica's share of ``dataset_factory()``, or None on a rank that reads no data.

    ``pipe`` is a :class:`conveyor.Pipeline` (its ``needs_inputs``, ``needs_target``,
    ``dp_rank`` and ``dp_size`` say where this rank stands); ``batch_size`` is one replica's
    minibatch (the global one is ``batch_size x dp``). ``loader_kwargs`` go to the DataLoader.
    Call ``loader.sampler.set_epoch(epoch)`` at each epoch, as with any ``DistributedSampler``.

    Example:
        >>> loader = data_loader(pipe, lambda: TensorDataset(x, y), batch_size=8)   # doctest: +SKIP
    """
    from torch.utils.data import DataLoader, DistributedSampler

    if not (pipe.needs_inputs or pipe.needs_target):
        return None
    dataset = dataset_factory()
    sampler = DistributedSampler(dataset, num_replicas=pipe.dp_size, rank=pipe.dp_rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)

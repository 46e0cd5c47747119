"""A stage's pass in segments, cut where it exchanges tensors with other ranks, so that two passes interleave.

An overlapped pair (:func:`conveyor.schedule.overlap.pair_forward_backward`) runs one microbatch's forward
and another's backward on one rank, each posting its exchange (an expert-parallel all-to-all) and yielding
to the other, which computes while the exchange is in flight. A forward is a generator that can pause
anywhere; autograd's backward is one engine call that cannot. So the forward cuts its autograd graph where
it exchanges: what it sends stays the root of the segment before, what it receives starts the next as a
detached leaf, and every other gradient-carrying tensor still needed after the cut continues as a leaf of
its own (:meth:`Boundary.cut`). The backward (:func:`segmented_backward`) then runs the segments last to
first, one engine call each from the roots whose leaves received gradients, and posts the reverse exchange
of each received leaf's gradient between them.

The numbers are those of one backward: every operation and its gradient formula are the same; a tensor
used on both sides of a cut gets its gradients summed once, two operands (a residual stream's two uses),
and a sum of two is the same in either order. A stage of the pipeline never runs the segmented form
unless a part that exchanges asks for it (:attr:`StageRunner.stepped`).

Example (a cut by hand; ``posted`` is what the exchange would carry back):
    >>> import torch
    >>> x = torch.ones(2, requires_grad=True)
    >>> passes = SegmentedPass()
    >>> y = passes.boundary().cut(x * 3)        # the segment after the cut starts from a leaf
    >>> loss = (y * y).sum()
    >>> grads, _ = run_to_end(segmented_backward(passes, [loss], [None], [x]))
    >>> grads[0].tolist()
    [18.0, 18.0]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from conveyor.runtime.stage.backward import PendingWeightGrad, backward_full, backward_input


class Posted(Protocol):
    """An exchange in flight: ``wait()`` gives what arrived."""

    def wait(self) -> torch.Tensor: ...


Reverse = Callable[[torch.Tensor], Posted]
"""Posts the reverse exchange of a received tensor's gradient; what arrives is the sent tensor's gradient."""


@dataclass
class Boundary:
    """One cut of a pass: the roots of the segment before it, and their leaves in the segment after."""

    roots: list[torch.Tensor] = field(default_factory=list)
    leaves: list[torch.Tensor] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)  # exchanged: the root before...
    received: list[torch.Tensor] = field(default_factory=list)  # ...the leaf after...
    reverse: list[Reverse] = field(default_factory=list)  # ...and how its gradient goes back
    hold: Callable[[torch.Tensor], object] | None = field(default=None, repr=False)  # counts what the cut keeps
    _by_id: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _held: list[object] = field(default_factory=list, repr=False)  # hold's handles: the counts end with the cut

    def cut(self, value: Any) -> Any:
        """``value`` (any pytree) with each tensor that autograd computed replaced by a detached leaf (one per
        tensor). Leaves stay: a parameter's gradient must sum all its uses in one engine call, and a leaf of an
        earlier cut gathers its gradients from every later segment before that cut reads them."""
        def leaf_of(tensor: Any) -> Any:
            if not isinstance(tensor, torch.Tensor) or tensor.grad_fn is None:
                return tensor
            leaf = self._by_id.get(id(tensor))
            if leaf is None:
                leaf = self._by_id[id(tensor)] = tensor.detach().requires_grad_()
                self.roots.append(tensor)
                self.leaves.append(leaf)
                self._keep(tensor)  # the root, and with it its leaf (one storage)
            return leaf

        return pytree.tree_map(leaf_of, value)

    def exchanged(self, sent: torch.Tensor, received: torch.Tensor, reverse: Reverse) -> torch.Tensor:
        """The leaf that stands for ``received`` (what ``sent`` became on the way), its gradient sent back by
        ``reverse``."""
        if not sent.requires_grad:
            return received
        leaf = received.detach().requires_grad_()
        self.sent.append(sent)
        self.received.append(leaf)
        self.reverse.append(reverse)
        self._keep(sent)
        self._keep(received)
        return leaf

    def _keep(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` as held for the backward (a memory meter's ``count_kept``): the cut keeps it, where
        an unsegmented pass might have let it go (an all-to-all's input once sent)."""
        if self.hold is not None:
            self._held.append(self.hold(tensor))


@dataclass
class SegmentedPass:
    """What one microbatch's forward through a stage recorded for its backward: its cuts, in order."""

    boundaries: list[Boundary] = field(default_factory=list)
    hold: Callable[[torch.Tensor], object] | None = None  # counts what each cut keeps (a memory meter's)

    def boundary(self) -> Boundary:
        """A new cut after the ones so far."""
        self.boundaries.append(Boundary(hold=self.hold))
        return self.boundaries[-1]


def segmented_backward(passes: SegmentedPass, roots: Sequence[Any], grads: Sequence[torch.Tensor | None],
                       inputs: Sequence[torch.Tensor], split: tuple[Sequence[torch.Tensor], Any] | None = None
                       ) -> Generator[None, None, tuple[list, list[PendingWeightGrad]]]:
    """The backward of a pass cut into segments, last segment first; yields while its reverse exchanges are in
    flight. Returns the input gradients, and what W still has to do per segment (none without ``split``).

    ``roots`` and ``grads``: the stage's outputs' gradient edges (or its loss) and their gradients, as
    :func:`~conveyor.runtime.stage.backward.backward_full` takes them. ``split``: (the stage's parameters, its
    graph-analysis cache) to run I, each segment's weight gradients kept for W
    (:func:`~conveyor.runtime.stage.backward.backward_input`); None: the full backward (B).
    A leaf's gradients from the segments that use it are summed as they come (later segments first).
    """
    boundaries = passes.boundaries
    roots, grads = list(roots), list(grads)
    carried: dict[int, torch.Tensor] = {}  # a leaf's gradient so far, by id
    pending: list[PendingWeightGrad] = []
    for segment in range(len(boundaries), -1, -1):
        # The leaves this segment may use: any earlier cut's (a leaf is never cut again), the stage's inputs.
        candidates = [leaf for cut in boundaries[:segment] for leaf in (*cut.leaves, *cut.received)] + list(inputs)
        if split is None:
            found = backward_full(roots, grads, candidates)
        else:
            pending.append(backward_input(roots, grads, candidates, *split))
            found = pending[-1].input_grads
        for leaf, grad in zip(candidates, found):
            if grad is not None:
                carried[id(leaf)] = grad if id(leaf) not in carried else carried[id(leaf)] + grad
        if segment == 0:
            break
        cut = boundaries[segment - 1]
        posted = [(sent, reverse(carried.pop(id(leaf)))) for sent, leaf, reverse in
                  zip(cut.sent, cut.received, cut.reverse) if id(leaf) in carried]
        roots = [root for root, leaf in zip(cut.roots, cut.leaves) if id(leaf) in carried]
        grads = [carried.pop(id(leaf)) for leaf in cut.leaves if id(leaf) in carried]
        if posted:
            yield  # the other pass computes while the gradients travel
        roots += [sent for sent, _ in posted]
        grads += [handle.wait() for _, handle in posted]
    boundaries.clear()
    return [carried.get(id(x)) for x in inputs], pending


def run_to_end(steps: Generator[None, None, Any]) -> Any:
    """Run a pass's steps with nothing between them (a pass that is not paired); its result.

    Example:
        >>> def steps():
        ...     yield
        ...     return 3
        >>> run_to_end(steps())
        3
    """
    return interleave(steps)[0]


def interleave(*passes: Generator[None, None, Any]) -> list[Any]:
    """Run the passes by turns, each up to its next yield (a posted exchange), until all are done; their
    results, in order. No thread: what overlaps is each exchange in flight with the other pass's compute.

    Example:
        >>> order = []
        >>> def steps(name):
        ...     order.append(name + "1")
        ...     yield
        ...     order.append(name + "2")
        ...     return name
        >>> interleave(steps("F"), steps("B")), order
        (['F', 'B'], ['F1', 'B1', 'F2', 'B2'])
    """
    results: list[Any] = [None] * len(passes)
    running = dict(enumerate(passes))
    while running:
        for index, steps in list(running.items()):
            try:
                next(steps)
            except StopIteration as stop:
                results[index] = stop.value
                del running[index]
    return results


def timed(steps: Generator[None, None, Any], spent: list[float], index: int) -> Generator[None, None, Any]:
    """``steps`` with the seconds of its own stretches between yields added to ``spent[index]``.

    Example:
        >>> spent = [0.0]
        >>> run_to_end(timed(iter(()), spent, 0)), spent[0] >= 0
        (None, True)
    """
    while True:
        began = time.perf_counter()
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        finally:
            spent[index] += time.perf_counter() - began
        yield


def within(steps: Generator[None, None, Any], context: Callable[[], Any]) -> Generator[None, None, Any]:
    """``steps`` with ``context()`` entered around each stretch between yields, not across them: a pass's
    autocast or saved-tensor hooks must not cover the other pass's compute.

    Example:
        >>> import contextlib
        >>> run_to_end(within(iter(()), contextlib.nullcontext)) is None
        True
    """
    while True:
        with context():
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value
        yield

"""conveyor.Pipeline: one class over a ranks backend (every rank in this process, or one per process).

- :mod:`conveyor.pipe.pipeline`: :class:`Pipeline`, written once: the user's API; a step's inputs and its run.
- :mod:`conveyor.pipe.backend`: the ranks contract (:class:`~conveyor.pipe.backend.RanksBackend`) it calls.
- :mod:`conveyor.pipe.ranks`: the in-process backend (:class:`InProcessRanks`).
- :mod:`conveyor.pipe.distributed`: the torch.distributed backend (:class:`DistributedRanks`), over stage parts.
- :mod:`conveyor.pipe.gradients`: clipping and the non-finite check.
- the forward-only family: :mod:`conveyor.pipe.logprobs` (next-token log-probs), :mod:`conveyor.pipe.generation`
  (the token loop, its ``Sampling`` options), :mod:`conveyor.pipe.weights` (whole weights by original names),
  :mod:`conveyor.pipe.broadcast` (the last stage's tensors to every rank).

Example:
    >>> from conveyor.pipe import Pipeline
    >>> Pipeline.__name__
    'Pipeline'
"""

from conveyor.pipe.distributed import DistributedRanks
from conveyor.pipe.pipeline import Pipeline
from conveyor.pipe.ranks import InProcessRanks

__all__ = ["DistributedRanks", "InProcessRanks", "Pipeline"]

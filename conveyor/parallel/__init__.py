"""Data parallelism around pipeline stages (sits below :mod:`conveyor.pipe`: never imports it).

- :mod:`conveyor.parallel.mesh`: a ("pp", "dp") DeviceMesh read into this rank's pipeline and replicas;
- :mod:`conveyor.parallel.replicas`: what a pipeline does per step with ``data_parallel="ddp"`` or ``"fsdp"``;
- :mod:`conveyor.parallel.fsdp`: the FSDP2 mechanics (``replicate`` / ``fully_shard`` per stage) that keep
  conveyor's runtime (B and the I/W split) correct under data parallelism;
- :mod:`conveyor.parallel.data`: data loaders opened only on the ranks that read data;
- :mod:`conveyor.parallel.loss`: the step's loss, and :func:`count_tokens` for a per-token loss
  (``pipe.step(..., normalize_by=count_tokens(pipe, y))``).
- :mod:`conveyor.parallel.clipping`: clipping by the whole pipeline's total gradient norm (bit for bit
  torch's on the unsplit model) and the non-finite check, over every stage and replica.
"""

from conveyor.parallel.data import data_loader
from conveyor.parallel.loss import count_tokens

__all__ = ["count_tokens", "data_loader"]

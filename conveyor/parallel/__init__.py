"""What spans ranks beside the pipeline's stages (sits below :mod:`conveyor.pipe`: never imports it).

- :mod:`conveyor.parallel.part`: the :class:`~conveyor.parallel.part.StagePart` contract, whose hooks
  the distributed pipeline calls; :mod:`conveyor.parallel.parts`: which parts a layout gets, in order;
- :mod:`conveyor.parallel.mesh`: the job's ("pp", "dp", "tp") DeviceMesh (pp outermost), read into this rank's
  pipeline, replicas and tensor-parallel peers;
- :mod:`conveyor.parallel.replicas`: the part for ``data_parallel="ddp"`` or ``"fsdp"``; :mod:`~conveyor.parallel.tied`:
  the part summing tied copies across ranks; :mod:`conveyor.parallel.tensor`: tensor parallelism's part;
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

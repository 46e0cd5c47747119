"""Tensor parallelism inside a pipeline stage: torch's ``parallelize_module`` with plans found by structure.

- :func:`tensor_parallel_plan`: the "auto" plan for a module (attention, MLPs, token
  embedding, LM head; :mod:`~conveyor.parallel.tensor.discover` says how they are recognised),
  keyed by the module's own submodule names;
- :func:`parallelize_stage`: checks a plan ("auto" or the user's) against the module and the
  TP size, then applies it with torch's ``parallelize_module``; tied parameters stay tied;
- :func:`check_plan`: the checks alone (a pattern that matches nothing, a size tp does not divide);
- :mod:`~conveyor.parallel.tensor.styles`: the few ParallelStyles torch lacks (GPT-2's Conv1D,
  a fused q|k|v kept in its original layout through ``_StridedShard``, what a block sees on its rank);
- :mod:`~conveyor.parallel.tensor.traced`: the same plan on a traced stage (no modules left:
  parameters distributed by name, the graph run on DTensors);
- :mod:`~conveyor.parallel.tensor.traced_sequence`: ``sequence_parallel`` on a traced stage (torch's
  sequence-parallel plan placed in its graph as redistributions at the same module boundaries);
- :mod:`~conveyor.parallel.tensor.stages`: a pipeline's stages parallelized, and what crosses a
  stage boundary (each TP rank's local part: its sequence shard under ``sequence_parallel``);
- :mod:`~conveyor.parallel.tensor.shards`: a meta-device model's traced stages materialized shard
  by shard (no rank allocates a whole sharded tensor).

Summation order: TP changes it in the row-parallel projections (each rank's partial product,
then the all-reduce), in the gradients of replicated activations (partial input gradients
all-reduced), and, with ``sequence_parallel``, in the norms' weight gradients (sequence shards'
partial sums). Losses come out bitwise here; gradients within ~5e-7 relative of one device.

Example (on each of 2 ranks)::

    from torch.distributed.device_mesh import init_device_mesh
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_stage(model, tp_mesh, "auto")
"""

from conveyor.parallel.tensor.style_map import check_plan, parallelize_stage, tensor_parallel_plan

__all__ = ["check_plan", "parallelize_stage", "tensor_parallel_plan"]

"""Tensor parallelism inside a pipeline stage: torch's ``parallelize_module`` with plans found by structure.

- :func:`tensor_parallel_plan`: the "auto" plan for a module (attention, MLPs, token
  embedding, LM head), keyed by the module's own submodule names;
- :func:`parallelize_stage`: checks a plan ("auto" or the user's) against the module and the
  TP size, then applies it with torch's ``parallelize_module``;
- :mod:`conveyor.parallel.tensor.styles`: the few ParallelStyles torch lacks (GPT-2's Conv1D,
  fused q|k|v), built from torch's own pieces.

Example (on each of 2 ranks)::

    from torch.distributed.device_mesh import init_device_mesh
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_stage(model, tp_mesh, "auto")
"""

from conveyor.parallel.tensor.plan import check_plan, parallelize_stage, tensor_parallel_plan

__all__ = ["check_plan", "parallelize_stage", "tensor_parallel_plan"]

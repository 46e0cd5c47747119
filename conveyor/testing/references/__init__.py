"""The references each parity test compares a pipeline with, and the rank functions that compare them.

One module per promise; a test, a benchmark and the GPU check that check the same promise import the
same reference, so there is one definition of what "equal to one device" means for each.

- :mod:`~conveyor.testing.references.schedule_parity`: every built-in schedule against the tiny LM
  accumulating gradients on one device (``tests/runtime/``);
- :mod:`~conveyor.testing.references.unsplit`: a traced split, run stage after stage, against the
  unsplit model (``tests/frontend/``, ``tests/train/test_models.py``);
- :mod:`~conveyor.testing.references.main_grad`: ``param_dtype="bf16"`` with fp32 main grads;
- :mod:`~conveyor.testing.references.data_parallel` and :mod:`~conveyor.testing.references.varlen`:
  pipeline x data parallelism, and variable-length microbatches, against one process;
- :mod:`~conveyor.testing.references.tensor_parallel`: a model under tensor parallelism against one
  device (the shared pieces: ``build``, ``tp_mesh``, ``whole``, ``TP_ROUNDING``), and
  :mod:`~conveyor.testing.references.tensor_pipeline`, :mod:`~conveyor.testing.references.tied_tensor`,
  :mod:`~conveyor.testing.references.tensor_moe`, :mod:`~conveyor.testing.references.tensor_sequence`,
  :mod:`~conveyor.testing.references.tensor_sequence_traced`: the pipeline at pp x tp against TP alone
  and one device (``tests/parallel/``);
- :mod:`~conveyor.testing.references.tensor_data_parallel`: pp x dp x tp against TP x DP without a
  pipeline (``tests/parallel/test_tensor_data_parallel.py``, ``python -m benchmarks --tp-parity``).
"""

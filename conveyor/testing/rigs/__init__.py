"""Rigs of the suite and of ``tools/``' commands: each module has named users, listed here, and no other.

Unlike :mod:`conveyor.testing.models` and :mod:`conveyor.testing.references`, these are no promise to a
user's own tests: they change with the tests and commands they serve.

- :mod:`~conveyor.testing.rigs.kill_trials` and :mod:`~conveyor.testing.rigs.kill_check`: kill one rank
  of a training run and time how fast the survivors stop (``python tools/kill_trials.py``;
  ``tests/e2e/test_killed_rank.py`` keeps one trial per transport);
- :mod:`~conveyor.testing.rigs.launches` and :mod:`~conveyor.testing.rigs.launch_check`: real ``torchrun``
  launches, every teardown order (``python tools/launch_stress.py``; ``tests/e2e/test_launches.py`` runs 9);
- :mod:`~conveyor.testing.rigs.host_syncs`: counts host synchronisations and object collectives inside
  steps (``python tools/host_syncs.py``; ``tests/runtime/test_host_syncs.py``);
- :mod:`~conveyor.testing.rigs.checkpoint_models`, :mod:`~conveyor.testing.rigs.checkpoint_tensor_parallel`
  and :mod:`~conveyor.testing.rigs.checkpoint_tensor_data_parallel`: the checkpoint tests' models and
  rank functions (``tests/checkpoint/``; ``tests/parallel/test_data_parallel.py`` borrows the tied LM);
- :mod:`~conveyor.testing.rigs.trainer_pipelines`: the pipelines ``conveyor train`` builds, kept for a look
  (``tests/train/test_tensor_parallel.py``, ``test_expert_parallel_train.py``,
  ``test_layouts_save_and_start_alike.py``);
- :mod:`~conveyor.testing.rigs.silent_peer`: a rank alive and silent until its peer has timed out or found it
  gone (``tests/runtime/test_pipeline_dist.py``, ``test_lifecycle.py``, ``test_shared_memory.py``);
- :mod:`~conveyor.testing.rigs.schedule_golden` and :mod:`~conveyor.testing.rigs.schedule_docs`: the
  schedule layer's pinned results (``tests/schedule/test_golden.py``) and the rendered grid in each
  built-in schedule's docstring (``tests/schedule/test_builtin.py``, ``test_zb_auto.py``).

The commands import them as ``conveyor.testing.rigs.<name>``, as the tests do; each module imports
conveyor and ``conveyor.testing`` as a user's tests would, and no library module imports them.
"""

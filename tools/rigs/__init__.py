"""The rigs behind ``tools/``' commands, outside the library: each module beside the command that runs it.

- :mod:`rigs.kill_trials` and :mod:`rigs.kill_check`: kill one rank of a training run and time how fast
  the survivors stop (``python tools/kill_trials.py``; ``tests/e2e/test_killed_rank.py`` keeps one trial
  per transport);
- :mod:`rigs.launches` and :mod:`rigs.launch_check`: real ``torchrun`` launches, every teardown order
  (``python tools/launch_stress.py``; ``tests/e2e/test_launches.py`` runs 9);
- :mod:`rigs.host_syncs`: counts host synchronisations and object collectives inside steps
  (``python tools/host_syncs.py``; ``tests/runtime/test_host_syncs.py``).

They import conveyor and ``conveyor.testing`` as a user's tests would. Importable as ``rigs`` with
``tools/`` on ``sys.path``, as the commands have it (``tests/rigs.py`` puts it there for the tests).
"""

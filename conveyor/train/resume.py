"""Resuming a run: which checkpoint, what it restores, and what the user is told about it.

:func:`resume` loads ``checkpoint.resume`` (or, in a restarted round of an elastic launch, the
newest checkpoint this job wrote: :mod:`conveyor.train.restarts`) into a run. A checkpoint
records the layout it was saved at (:func:`parallel_layout`, in its ``extra``); a resume at another
layout says so in one line on rank 0, naming both layouts (:func:`reshard_words`): the weights
and optimizer state are resharded bit for bit, while the random generator states start fresh,
since the saved ones belong to other ranks' stages.

Example (each rank, once the run is set up)::

    resume(run)        # rank 0: "conveyor train: resumed from runs/x/checkpoints/step_000004 at step 4"
"""

from __future__ import annotations

from typing import Any

from conveyor.train.config import TrainConfig


def resume(run: Any) -> None:
    """Load ``checkpoint.resume`` (true: the latest under the checkpoint dir, if any) into ``run`` (a
    :class:`conveyor.train.loop.Run`): its step, the position of its data and where it resumed.

    A restarted round of an elastic launch (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from
    the newest checkpoint this job wrote, if any, whatever ``checkpoint.resume`` says.
    """
    from conveyor.checkpoint import load
    from conveyor.train.preflight import resume_path
    from conveyor.train.restarts import job_started, restart_checkpoint, restart_round

    wanted, restarted = run.cfg.checkpoint.resume, restart_round()
    why = f"restart {restarted} after a failed round: " if restarted else ""
    path = restart_checkpoint(run.cfg.checkpoint_dir, job_started()) if restarted else None
    if path is None:
        if wanted is False or wanted in ("false", ""):
            if restarted and run.rank0:
                print(f"conveyor train: {why}no checkpoint of this job under {run.cfg.checkpoint_dir}; "
                      f"starting again from step 0", flush=True)
            return
        path = resume_path(run.cfg)
    if path is None:
        if run.rank0:
            print(f"conveyor train: {why}no checkpoint under {run.cfg.checkpoint_dir} yet; starting from step 0")
        return
    extra = load(path, run.pipe, run.optimizer, run.scheduler) or {}
    run.step = run.resumed_at = int(extra.get("step", 0))
    run.skipped = run.skipped_before = int(extra.get("skipped_steps", 0))  # the run's count goes on from there
    if run.train_data is not None and "data" in extra:
        run.train_data.load_state_dict(extra["data"])
    if run.rank0:
        now = parallel_layout(run.cfg, run.pipe.schedule.num_stages)
        print(f"conveyor train: {why}resumed from {path} at step {run.step}{reshard_words(extra.get('layout'), now)}",
              flush=True)


def parallel_layout(cfg: TrainConfig, num_stages: int) -> dict[str, Any]:
    """The layout a checkpoint's ``extra`` records, for a resume to name (:func:`reshard_words`); ``num_stages``:
    the pipeline's (``virtual`` is its stages per rank, which ``parallel.virtual`` None leaves to the schedule).

    Example:
        >>> from conveyor.train.config import load_config
        >>> parallel_layout(load_config(None, ["parallel.tp=2"]), num_stages=2)
        {'pp': 2, 'dp': 1, 'tp': 2, 'virtual': 1, 'schedule': '1f1b'}
    """
    p = cfg.parallel
    return {"pp": p.pp, "dp": p.dp, "tp": p.tp, "virtual": num_stages // p.pp, "schedule": p.schedule}


def reshard_words(saved: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """What a resume says after "resumed from ... at step N" when the checkpoint was saved at another layout
    (``saved``, from :func:`parallel_layout`; None: a checkpoint that does not say, and nothing is said).

    Example:
        >>> saved, now = {"pp": 2, "dp": 1, "tp": 2}, {"pp": 4, "dp": 1, "tp": 1}
        >>> print(reshard_words(saved, now))  # doctest: +NORMALIZE_WHITESPACE
        , resharded pp=2 x tp=2 -> pp=4 x tp=1; random generator states start fresh (from train.seed) because the
        saved ones belong to other ranks' stages
        >>> reshard_words(now, now), reshard_words(None, now)
        ('', '')
    """
    if not saved or saved == now:
        return ""
    shown = [key for key in ("pp", "dp", "tp") if key != "dp" or saved.get("dp", 1) > 1 or now.get("dp", 1) > 1]
    if saved.get("virtual", 1) != now.get("virtual", 1):
        shown.append("virtual")
    if saved.get("schedule") != now.get("schedule"):
        shown.append("schedule")

    def words(layout: dict[str, Any]) -> str:
        return " x ".join(f"{key}={layout.get(key, '?')}" for key in shown if key != "schedule") + (
            f" ({layout.get('schedule')})" if "schedule" in shown else "")

    return (f", resharded {words(saved)} -> {words(now)}; random generator states start fresh (from train.seed) "
            f"because the saved ones belong to other ranks' stages")

"""What ``conveyor train`` checks in the launcher's process before any rank starts, beyond the config itself.

A mistake found here costs no process and prints one line (``conveyor: error: ...``, status 2);
found in the ranks, it would end a launch with every rank's traceback. The config's keys and
values are checked by :func:`~conveyor.train.config.load_config`, the data's splits by
:func:`~conveyor.train.data_check.check_data`, the devices by
:func:`~conveyor.train.launch.choose_devices`; here, the checkpoint the run resumes from.

Example:
    >>> from conveyor.train.config import load_config
    >>> resume_path(load_config(None)) is None      # checkpoint.resume=false: nothing to check
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.errors import CheckpointError, ConfigError


def resume_path(cfg: Any) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names: None (false, or true with none under the checkpoint dir yet),
    the latest under ``checkpoint.dir`` (true), or the path given.

    Example:
        >>> from conveyor.train.config import load_config
        >>> resumed = load_config(None, ["checkpoint.resume=true", "checkpoint.dir=/no"])
        >>> resume_path(load_config(None)), resume_path(resumed)
        (None, None)
    """
    wanted = cfg.checkpoint.resume
    if wanted is False or wanted in ("false", ""):
        return None
    if wanted is True or wanted == "true":
        from conveyor.checkpoint import latest

        return latest(cfg.checkpoint_dir)
    return Path(wanted)


def check_resume(cfg: Any) -> Path | None:
    """The checkpoint the run resumes from (None: it starts from step 0), checked as the ranks' load would check it.

    The checkpoint must be complete (its metadata, DCP's index, every tensor's bytes) and hold
    the model ``cfg.model`` builds (the same tensor names and shapes, built on the meta device:
    nothing is allocated), AdamW's state and a learning-rate schedule's. Raises
    :class:`~conveyor.errors.ConfigError` naming ``checkpoint.resume`` and the checkpoint's
    problem; reads no tensor.

    Example:
        >>> from conveyor.train.config import load_config
        >>> check_resume(load_config(None, ["checkpoint.resume=true", "checkpoint.dir=/no/such/dir"])) is None
        True
    """
    path = resume_path(cfg)
    if path is None:
        return None
    from conveyor.checkpoint import check
    from conveyor.train.models import meta_model

    try:
        return check(path, meta_model(cfg), optimizer="AdamW", lr_scheduler=True)
    except CheckpointError as error:
        raise ConfigError(f"checkpoint.resume={str(cfg.checkpoint.resume)!r} cannot be resumed from: {error}") from None

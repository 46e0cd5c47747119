"""``conveyor train [CONFIG.yaml] [key=value ...]``: check the config, then start the ranks and train.

The config is loaded and validated in this process before anything starts, so a mistake
costs no process. Outside a launcher, :func:`launch` starts ``pp x dp x tp`` local workers with
torch's elastic launcher (what ``torchrun`` runs: a c10d rendezvous on a free local port);
under ``torchrun`` (``RANK`` or ``TORCHELASTIC_RUN_ID`` in the environment) this process is
already one of the ranks, and it trains as it is. With ``run.max_restarts=N`` (or ``torchrun
--max-restarts N``), a failed rank ends its round and the launcher starts every rank again, up
to N times; each restarted round resumes from the newest checkpoint the job wrote
(:mod:`conveyor.train.restarts`).

This is the one launcher of training runs: ``conveyor demo`` is ``configs/demo.yaml`` run
through it. What the launcher's process can check is checked before any rank starts (the
config, the data, the devices, the resume checkpoint: :mod:`conveyor.train.preflight`), and a
failed rank ends the output with the rank, its error and what to do
(:mod:`conveyor.train.failures`). Ranks started elsewhere start for other reasons: tests run
functions on ranks with :func:`conveyor.testing.run_ranks`, the calibration keeps live ranks
(:class:`conveyor.processes.RankGroup`), and the rigs in ``tools/`` start real ``torchrun``
(a user's own launcher) and plain processes (kill trials, where no agent may stop the survivors).

Devices (:func:`choose_devices`, ``run.device`` and ``run.share_gpus``): with a GPU per local
rank, each rank trains on its own GPU and the ranks talk over NCCL; with none, on the CPU over
gloo, as always. With fewer GPUs than ranks (the default ``pp=2`` on a one-GPU machine) the run
stays on the CPU and says so in one line, unless ``run.share_gpus=true`` puts several ranks on
one GPU over gloo (with a warning: every boundary tensor then goes through the host).

Example:
    $ conveyor train                                    # the defaults: stdlib sources, 2 ranks
    $ conveyor train configs/gpt.yaml train.steps=50 parallel.pp=2
    $ conveyor train run.max_restarts=2 checkpoint.interval=50     # survive up to 2 failed rounds
    $ torchrun --nproc-per-node 2 -m conveyor.cli train train.steps=50
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.errors import ConfigError
from conveyor.processes.support import free_port  # the rendezvous's port
from conveyor.train.config import TrainConfig, load_config
from conveyor.train.data_check import check_data
from conveyor.train.failures import LAUNCHER_LOGGERS, failure_report, launcher_log
from conveyor.train.preflight import check_resume
from conveyor.train.startup import StartupPhases

if TYPE_CHECKING:
    import torch


def split_arguments(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG.yaml] [key=value ...]`` -> (the config path or None, the overrides).

    Example:
        >>> split_arguments(["run.yaml", "train.steps=5"])
        ('run.yaml', ['train.steps=5'])
        >>> split_arguments(["train.steps=5"])
        (None, ['train.steps=5'])
        >>> split_arguments(["runs/lr=3e-4/config.yaml"])
        ('runs/lr=3e-4/config.yaml', [])
    """
    args = list(args)
    # A config path may hold "=" (runs/lr=3e-4/config.yaml): a YAML name or a file is the config.
    if args and ("=" not in args[0] or args[0].endswith((".yaml", ".yml")) or os.path.isfile(args[0])):
        return args[0], args[1:]
    return None, args


def already_launched() -> bool:
    """Whether this process is a rank of a launch already (torchrun, or another launcher setting RANK)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def prepare(args: Sequence[str]) -> TrainConfig:
    """The checked config the arguments name (raises ConfigError, naming the key, on a mistake).

    Under a launcher, the launched world size must match ``parallel.pp x parallel.dp x parallel.tp``, and
    ``parallel.tp`` must divide the ranks of each node (a TP group inside one node). The
    data's splits must hold what the ranks need (:func:`~conveyor.train.data_check.check_data`), and
    ``run.device=cuda`` needs a GPU per local rank (:func:`choose_devices`).

    Example:
        >>> prepare(["train.steps=3"]).train.steps
        3
    """
    path, overrides = split_arguments(args)
    world = int(os.environ["WORLD_SIZE"]) if already_launched() and "WORLD_SIZE" in os.environ else None
    cfg = load_config(path, overrides, world_size=world)
    if already_launched():
        check_tp_inside_nodes(cfg, local_ranks())
    check_data(cfg)  # a split too short for a batch fails here, not in every rank after the launch
    choose_devices(cfg, local_ranks() if already_launched() else cfg.world_size)  # run.device=cuda without GPUs
    return cfg


def check_tp_inside_nodes(cfg: TrainConfig, local: int) -> None:
    """``parallel.tp`` divides ``local``, the ranks a launcher starts on each node, so that every TP group (its
    collectives run in every layer) lies inside one node; a ConfigError naming the fix otherwise.

    The mesh is ("pp", "dp", "tp") with tp innermost, and torchrun numbers a node's ranks consecutively.

    Example:
        >>> check_tp_inside_nodes(load_config(None, ["parallel.tp=2"]), 4)
        >>> check_tp_inside_nodes(load_config(None, ["parallel.tp=4", "parallel.pp=1"]), 2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        conveyor.errors.ConfigError: parallel.tp=4 does not divide the 2 ranks each node runs (LOCAL_WORLD_SIZE)...
    """
    tp = cfg.parallel.tp
    if tp > 1 and local % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide the {local} ranks each node runs (LOCAL_WORLD_SIZE): a "
                          f"tensor-parallel group would span nodes, its per-layer collectives over the network; "
                          f"launch a multiple of {tp} ranks per node (torchrun --nproc-per-node), or choose a "
                          f"parallel.tp that divides {local}")


def worker(cfg: TrainConfig, exit_when_stopped: bool = True, say_note: bool = True) -> dict:
    """One rank: join the process group the launcher set up (NCCL or gloo, :func:`choose_devices`), train,
    leave it; returns the summary. Rank 0 prints the devices' note when ``say_note`` (under torchrun).

    A run stopped on purpose (``loss.on_nonfinite=stop``) exits 1 when ``exit_when_stopped``;
    :func:`launch` passes False and reads the summary instead, so that the elastic agent does not
    take the stop for a crash and restart a run that would stop again at the same step.
    """
    rank0 = os.environ.get("RANK", "0") == "0"
    startup = StartupPhases(enabled=rank0)  # rank 0 says what a slow start-up is doing, until the first step
    startup.phase("importing torch")  # in a spawned rank; a forked one has it already
    import torch
    import torch.distributed as dist

    from conveyor.train.loop import train

    torch.set_num_threads(threads_per_rank())
    devices = choose_devices(cfg, local_ranks())
    if devices.note and say_note and rank0:
        print(f"conveyor train: {devices.note}", flush=True)
    if devices.device == "cuda":
        stage_device(cfg)  # this rank's GPU current before the group exists: NCCL binds to it
    startup.phase(f"joining the process group (waiting for all {cfg.world_size} ranks to start)")
    join_group(devices.backend)
    try:
        summary = train(cfg, startup)
    finally:
        startup.close()
        dist.destroy_process_group()
    if summary["stopped"] and exit_when_stopped:
        raise SystemExit(1)
    return summary


def threads_per_rank(environ: dict[str, str] | None = None, cores: int | None = None) -> int:
    """``OMP_NUM_THREADS`` when set, else this host's cores shared by its ranks (``LOCAL_WORLD_SIZE``).

    Example:
        >>> threads_per_rank({"LOCAL_WORLD_SIZE": "2"}, cores=2), threads_per_rank({"OMP_NUM_THREADS": "3"}, cores=2)
        (1, 3)
    """
    from conveyor.runtime.stage.device import cpu_threads_per_rank

    environ = os.environ if environ is None else environ
    return cpu_threads_per_rank(int(environ.get("LOCAL_WORLD_SIZE", "1") or 1), environ, cores)


def local_ranks(environ: dict[str, str] | None = None) -> int:
    """How many ranks of this job run on this machine: ``LOCAL_WORLD_SIZE`` (else ``WORLD_SIZE``, else 1).

    Example:
        >>> local_ranks({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}), local_ranks({})
        (4, 1)
    """
    environ = os.environ if environ is None else environ
    return int(environ.get("LOCAL_WORLD_SIZE") or environ.get("WORLD_SIZE") or 1)


@dataclass(frozen=True)
class Devices:
    """How this machine's ranks train: the process group's ``backend`` ("nccl" or "gloo"), each rank's
    stage ``device`` ("cuda": its own GPU, :func:`conveyor.runtime.stage.device.local_gpu`; or "cpu"), and
    the ``note`` the launcher prints once (None: nothing to say)."""

    backend: str
    device: str
    note: str | None = None


def choose_devices(cfg: TrainConfig, ranks: int, gpus: int | None = None) -> Devices:
    """Where ``ranks`` local ranks train, by ``run.device`` and ``run.share_gpus``, on a machine with ``gpus``
    CUDA GPUs (None: the ones torch sees). Every rank of a machine decides alike.

    A GPU per rank: NCCL, each rank on its own GPU. No GPU (``auto``) or ``run.device=cpu``: gloo on the
    CPU. Fewer GPUs than ranks: the CPU with a note saying why and what to change, or with
    ``run.share_gpus=true`` the GPUs shared round-robin over gloo (NCCL takes one GPU per rank), with
    a warning. Raises ConfigError for ``run.device=cuda`` where the GPUs cannot be used.

    Example:
        >>> from conveyor.train.config import load_config
        >>> cfg = load_config(None)
        >>> choose_devices(cfg, 2, gpus=0), choose_devices(cfg, 2, gpus=2)
        (Devices(backend='gloo', device='cpu', note=None), Devices(backend='nccl', device='cuda', note=None))
        >>> print(choose_devices(cfg, 2, gpus=1).note)  # doctest: +NORMALIZE_WHITESPACE
        2 ranks but 1 GPU here: training on the CPU; set parallel.pp x parallel.dp = 1 to train on the GPU, or
        run.share_gpus=true to put the 2 ranks on it (over gloo, slower)
    """
    import torch

    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = cfg.run.device
    if want == "cpu" or (want == "auto" and gpus == 0):
        return Devices("gloo", "cpu")
    if gpus == 0:
        raise ConfigError("run.device='cuda', but torch sees no CUDA GPU here (torch.cuda.is_available() is False "
                          "or CUDA_VISIBLE_DEVICES hides them); use run.device=auto or cpu, or a CUDA build of torch")
    if gpus >= ranks:
        return Devices("nccl", "cuda")
    several = f"{ranks} ranks but {gpus} GPU{'s' if gpus > 1 else ''} here"
    if cfg.run.share_gpus:
        return Devices(
            "gloo",
            "cuda",
            f"warning: {several}: they share the GPUs (run.share_gpus=true) over gloo, "
            f"so every boundary tensor goes through the host; a GPU per rank (NCCL) is faster",
        )
    one = "it" if gpus == 1 else "them"
    advice = (f"set parallel.pp x parallel.dp = {gpus} to train on the GPU{'s' if gpus > 1 else ''}, or "
              f"run.share_gpus=true to put the {ranks} ranks on {one} (over gloo, slower)")
    if want == "cuda":
        raise ConfigError(f"run.device='cuda' needs a GPU per rank (NCCL): {several}; {advice}")
    return Devices("gloo", "cpu", f"{several}: training on the CPU; {advice}")


def stage_device(cfg: TrainConfig) -> torch.device:
    """This rank's stage device under :func:`choose_devices`; a GPU is made the current CUDA device.

    Example:
        >>> from conveyor.train.config import load_config
        >>> stage_device(load_config(None, ["run.device=cpu"]))
        device(type='cpu')
    """
    import torch

    from conveyor.runtime.stage.device import local_gpu, make_current

    if choose_devices(cfg, local_ranks()).device == "cpu":
        return torch.device("cpu")
    return make_current(local_gpu(warn=False))  # sharing was said once, by the launcher


def join_group(backend: str = "gloo") -> None:
    """Join the ``backend`` process group the launcher's environment names (``env://``), with this round's
    own store keys.

    The elastic launcher keeps one store for the whole job: after a restart, the failed
    round's keys (its ranks' addresses, its pipelines' rings) would still answer the new
    round's lookups, and it would connect to processes that are gone.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import default_pg_timeout

    from conveyor.train.restarts import round_prefix

    store, rank, world_size = next(dist.rendezvous("env://", timeout=default_pg_timeout))
    store.set_timeout(default_pg_timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(round_prefix(), store), rank=rank,
                            world_size=world_size)


def name_rendezvous_records_cheaply() -> None:
    """Have torch elastic's c10d rendezvous name its log records' callers from their frames.

    Its ``get_method_name`` calls ``inspect.stack()`` twice per record, which reads the source lines of
    every frame on the stack: about 0.14 s of CPU a call, 2.5 s of a 2-rank launch's start and end
    (18 calls), spent before the ranks start and after they end. The caller's frame gives the same
    name without reading any file.

    Example:
        >>> name_rendezvous_records_cheaply()
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:  # frame 0 is this function's, as inspect.stack()[0] is
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # a stack shallower than depth
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def start_method(devices: Devices) -> str:
    """How :func:`launch` starts its ranks: forked from this process when they train on the CPU, so each one
    inherits the torch and conveyor this process imported (spawned, each rank imports them again: seconds
    of CPU per rank); spawned when they use CUDA, which a forked process cannot use once this one has asked
    the driver about its GPUs.

    Example:
        >>> start_method(Devices("gloo", "cpu")), start_method(Devices("nccl", "cuda"))
        ('fork', 'spawn')
    """
    return "spawn" if devices.device == "cuda" else "fork"


def forked_worker(cfg: TrainConfig, exit_when_stopped: bool = True, say_note: bool = True) -> dict:
    """:func:`worker` in a rank forked from the launcher, once the launcher's own set-up is undone: the elastic
    agent's signal handlers (a SIGTERM must end a rank at once, as in a spawned one, not raise in it where
    a blocked collective may never see it) and its log's handlers (the launcher's lines are its own)."""
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in LAUNCHER_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate, logger.level = True, logging.NOTSET
    return worker(cfg, exit_when_stopped, say_note)


def oversubscribed(cfg: TrainConfig, devices: Devices, cores: int | None = None) -> str | None:
    """A warning when the ranks :func:`launch` would start on the CPU outnumber this machine's ``cores``
    (None: the cores this process may use), else None. A warning, not a refusal: such a run is correct,
    only slower (the ranks take turns on the cores, and a rank's peers wait while it waits for a core).

    Example:
        >>> from conveyor.train.config import load_config
        >>> cfg = load_config(None, ["parallel.pp=4", "parallel.tp=2"])
        >>> print(oversubscribed(cfg, Devices("gloo", "cpu"), cores=2))  # doctest: +NORMALIZE_WHITESPACE
        warning: 8 ranks (pp=4 x dp=1 x tp=2) but 2 CPU cores here: the ranks take turns on them, and each step
        waits for the rank that waits for a core; set parallel.pp x parallel.dp x parallel.tp <= 2 for a rank per core
        >>> oversubscribed(cfg, Devices("gloo", "cpu"), cores=8) is None
        True
    """
    from conveyor.runtime.stage.device import cpu_threads_per_rank

    if cores is None:
        cores = cpu_threads_per_rank(1, {})  # the cores this process may use (its affinity)
    if cfg.parallel.in_process or devices.device != "cpu" or cfg.world_size <= cores:
        return None
    p = cfg.parallel
    return (f"warning: {cfg.world_size} ranks (pp={p.pp} x dp={p.dp} x tp={p.tp}) but {cores} CPU core"
            f"{'s' if cores > 1 else ''} here: the ranks take turns on them, and each step waits for the rank that "
            f"waits for a core; set parallel.pp x parallel.dp x parallel.tp <= {cores} for a rank per core")


def launch(cfg: TrainConfig) -> int:
    """Run :func:`worker` on ``pp x dp x tp`` local ranks through torch's elastic launcher; returns an exit status.

    Ranks that train on the CPU are forked from this process (:func:`start_method`), so they start with
    torch and the training loop already imported; ranks on GPUs are spawned.

    When a rank fails, the launcher ends the others; with ``run.max_restarts`` left it starts
    every rank again (each then resumes from the latest checkpoint this job wrote), else the
    status is 1 and the last lines printed name the rank, its error and what to do
    (:func:`~conveyor.train.failures.failure_report`); the launcher's own log, tracebacks
    included, goes to ``<run.dir>/launch.log``. A run whose ``train.parity`` check found a
    step that differs from one device also ends with status 1.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from conveyor.train.rank_logs import RankLogs

    name_rendezvous_records_cheaply()

    # From the banner until the ranks start (the launcher's own rendezvous): then rank 0 says its phases.
    starting = StartupPhases()
    restarts = cfg.run.max_restarts
    devices = choose_devices(cfg, cfg.world_size)  # a ConfigError here, before any rank starts
    how = start_method(devices)
    # Each rank's stderr goes to <run.dir>/logs/rank<R>.stderr and on to the terminal: a rank that dies of a
    # signal leaves its faulthandler dump there, which the failure report quotes.
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.world_size,
                          run_id=f"conveyor-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=f"localhost:{free_port()}", max_restarts=restarts,
                          monitor_interval=0.5, start_method=how,
                          logs_specs=RankLogs(cfg.run.dir, starting=starting.close),
                          log_line_prefix_template="[rank ${rank}] ")
    if how == "fork":
        with StartupPhases() as startup:
            startup.phase("importing the training loop and the model's code")
            import conveyor.train.loop  # noqa: F401  (imported once here, inherited by every forked rank)
            from conveyor.train.models import model_config

            # transformers and the model's module too: tens of CPU seconds that N ranks would each spend at once
            # on a busy machine. Only a config object is built; what is wrong with it, the ranks say in full.
            with contextlib.suppress(ConfigError):
                model_config(cfg.model, 256)
    on = ("a GPU each over NCCL" if devices.backend == "nccl" else
          "shared GPUs over gloo" if devices.device == "cuda" else "the CPU over gloo")
    ranks = (f"1 process holding every rank (pp={cfg.parallel.pp}, parallel.in_process)" if cfg.parallel.in_process
             else f"{cfg.world_size} local ranks (pp={cfg.parallel.pp} x dp={cfg.parallel.dp}"
             + (f" x tp={cfg.parallel.tp}" if cfg.parallel.tp > 1 else "")
             + (", sequence parallel)" if cfg.parallel.sequence_parallel and cfg.parallel.tp > 1 else ")"))
    print(f"conveyor train: {ranks} on {on}, run dir {cfg.run.dir}"
          + (f", up to {restarts} restart(s)" if restarts else ""), flush=True)
    for note in (devices.note, oversubscribed(cfg, devices)):  # why not the GPUs; more ranks than cores
        if note:
            print(f"conveyor train: {note}", flush=True)
    # Without restarts the report below is the only word; with them, each failed round says so in one line.
    with launcher_log(Path(cfg.run.dir) / "launch.log", notify=restarts > 0) as log_path:
        starting.phase(f"starting {cfg.world_size} ranks (the launcher's rendezvous)")
        try:
            entry = forked_worker if how == "fork" else worker
            summaries = elastic_launch(config, entry)(cfg, False, False)  # the note is said: not again by rank 0
        except ChildFailedError as error:
            with open(log_path, "a") as log:
                log.write(error.format_msg() + "\n")
            sys.stdout.flush()
            print(failure_report(error, restarts, log_path, cfg.run.dir), file=sys.stderr, flush=True)
            return 1
        finally:
            starting.close()
    if any(summary and summary.get("stopped") for summary in summaries.values()):
        return 1  # stopped on purpose (the summary said why): not restarted, since it would stop again
    if any(summary and summary.get("parity_equal") is False for summary in summaries.values()):
        return 1  # train.parity found a step that one device computes differently (rank 0 said which)
    return 0


def main(args: Sequence[str]) -> int:
    """``conveyor train``'s work after argument parsing: check, then launch or run this rank.

    Raises ConfigError (which the command prints as ``conveyor: error: ...``) before starting anything.
    A check that lasts more than a few seconds says so (:class:`~conveyor.train.startup.StartupPhases`).
    """
    with StartupPhases(enabled=not already_launched()) as startup:
        startup.phase("loading torch, checking the config and the data")
        cfg = prepare(args)
    return run(cfg)


def run(cfg: TrainConfig) -> int:
    """Train ``cfg`` (checked by :func:`prepare`): as this rank under a launcher, else on local ranks that
    :func:`launch` starts once the resume checkpoint, if any, has been checked here
    (:func:`~conveyor.train.preflight.check_resume`); returns the exit status."""
    if already_launched():
        worker(cfg)
        return 0
    with StartupPhases() as startup:
        startup.phase("checking the checkpoint to resume from")
        check_resume(cfg)  # a checkpoint the ranks would refuse is refused here, before any rank starts
    return launch(cfg)

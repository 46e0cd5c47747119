"""The training loop behind ``conveyor train``: one call of :func:`train` on every rank.

Each rank seeds, builds the model from ``cfg.model`` (the same initialisation everywhere),
keeps its own stages of the pipeline, and runs ``cfg.train.steps`` optimizer steps: AdamW
with a linear warm-up and a cosine (or constant) learning rate, gradient clipping, a
non-finite step skipped or fatal (``loss.on_nonfinite``), a validation loss (the language
model's alone) through ``pipe.forward`` every ``train.eval_interval`` steps, checkpoints every
``checkpoint.interval`` steps and at the end (with the data loader's position, so a resumed
run draws the batches the uninterrupted one would). Rank 0 writes ``<run.dir>/metrics.jsonl`` (one
JSON object per step, with ``lm_loss`` and ``aux_loss`` beside ``loss`` for a mixture-of-experts
model and ``dropped_slots`` under ``parallel.expert_capacity``, ``tokens``: the tokens trained,
whose targets are not -100 (padding), and ``tokens_per_s`` of them; and one per validation),
``<run.dir>/config.yaml`` (the resolved config), ``loss.png`` (training and validation curves),
``timeline.png`` (the last step measured beside its simulation), ``timeline.json`` (its
Chrome/Perfetto trace), ``sample.txt`` (a greedy continuation after training,
:mod:`conveyor.train.sample`) and TensorBoard events under ``tensorboard/``, and shows progress
(:class:`conveyor.train.report.Progress`) and a summary (bubble measured vs simulated, peak memory
per rank, where the files are, the sample).

Example (on each rank of a ``torchrun --nproc-per-node 2`` launch, after
``torch.distributed.init_process_group("gloo")``)::

    cfg = load_config(None, ["train.steps=20"], world_size=2)
    summary = train(cfg)          # {"steps": 20, "first_loss": ..., "last_loss": ..., ...}
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import conveyor
from conveyor.errors import ConfigError, NonFiniteError
from conveyor.parallel import count_tokens
from conveyor.parallel.loss import loss_divisor
from conveyor.pipe.logprobs import logits_of
from conveyor.runtime.stage.device import group_device, to_device
from conveyor.train.config import TrainConfig, save_config
from conveyor.train.data import by_length_options, length_loader, load_tokenizer, resumable_loader, splits_factory
from conveyor.train.expert_shards import dropped_slots, expert_size
from conveyor.train.launch import stage_device
from conveyor.train.models import aux_loss_coefficient, build_model, load_weights
from conveyor.train.parity import start_parity
from conveyor.train.report import (
    Progress,
    format_summary,
    open_tensorboard,
    peak_rss_mib,
    write_loss_plot,
    write_timeline,
)
from conveyor.train.restarts import continue_log
from conveyor.train.resume import parallel_layout, resume
from conveyor.train.sample import write_sample
from conveyor.train.startup import StartupPhases

# --- pieces ---------------------------------------------------------------------------------

def lm_loss(reduction: str = "mean"):
    """A ``loss_fn`` for ``conveyor.pipeline``: cross entropy of the output's logits against the targets.

    ``reduction="sum"`` is for the per-token normalisation (``pipe.step(normalize_by=N)``).

    Example:
        >>> from types import SimpleNamespace
        >>> out = SimpleNamespace(logits=torch.zeros(1, 3, 4))
        >>> round(lm_loss()(out, torch.tensor([[0, 1, 2]])).item(), 4)     # ln 4
        1.3863
    """
    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 target.reshape(-1), reduction=reduction)

    return loss_fn


class LossWithAux:
    """A ``loss_fn`` for a mixture-of-experts model: the language-model loss plus ``coefficient`` x the
    model's auxiliary (load-balancing) loss, as Mixtral's own forward adds them, recording both parts.

    Each call (one per microbatch, on the last stage) appends the two parts, detached, to
    ``parts``; :meth:`step_parts` scales and sums them as the pipeline scales and sums the loss,
    so the step's language-model and auxiliary losses are reported exactly, without a second
    forward. With ``reduction="sum"`` (``loss.normalize=tokens``) the auxiliary loss, a mean
    over the microbatch's tokens, counts once per target token, so after the division by the
    step's token count it is the token-weighted mean of the microbatches' auxiliary losses.

    Example:
        >>> out = {"logits": torch.zeros(1, 3, 4), "aux_loss": torch.tensor(2.0)}
        >>> loss_fn = LossWithAux(0.5)
        >>> round(loss_fn(out, torch.tensor([[0, 1, 2]])).item(), 4)     # ln 4 + 0.5 x 2
        2.3863
        >>> [round(v, 4) for v in loss_fn.step_parts(divisor=1).tolist()]
        [1.3863, 1.0]
    """

    def __init__(self, coefficient: float, reduction: str = "mean") -> None:
        self.coefficient, self.reduction = coefficient, reduction
        self.lm = lm_loss(reduction)
        self.parts: list[torch.Tensor] = []

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        lm = self.lm(output, target)
        aux = output.get("aux_loss") if isinstance(output, dict) else getattr(output, "aux_loss", None)
        if aux is None:
            keys = ", ".join(output.keys()) if hasattr(output, "keys") else type(output).__name__
            raise ConfigError(f"the model's output has no aux_loss (it has: {keys}); a "
                              f"mixture-of-experts model returns it when built with output_router_logits=True")
        aux = self.coefficient * aux.to(lm.dtype)
        if self.reduction == "sum":
            aux = aux * (target != -100).sum()  # cross_entropy's ignore_index: the tokens the sum counts
        self.parts.append(torch.stack([lm.detach(), aux.detach()]))
        return lm + aux

    def step_parts(self, divisor: int | float) -> torch.Tensor:
        """(language-model, auxiliary) loss of the step's microbatches, each divided by ``divisor`` as the
        pipeline divides the loss and summed in microbatch order; clears ``parts``."""
        parts, self.parts = self.parts, []
        return sum((part / divisor for part in parts[1:]), parts[0] / divisor)


def train_loss(cfg: TrainConfig, model: torch.nn.Module) -> Any:
    """The pipeline's ``loss_fn`` for ``model``: :func:`lm_loss`, or :class:`LossWithAux` for a
    mixture-of-experts model that returns an auxiliary loss (``moe``, or any with
    ``output_router_logits=True``)."""
    reduction = "sum" if cfg.loss.normalize == "tokens" else "mean"
    coefficient = aux_loss_coefficient(model)
    return lm_loss(reduction) if coefficient is None else LossWithAux(coefficient, reduction)


def lr_lambda(cfg: TrainConfig):
    """The learning rate's factor at each step: linear warm-up to 1, then cosine down to
    ``optim.min_lr_ratio`` at ``train.steps`` (or constant 1), for ``torch.optim.lr_scheduler.LambdaLR``.

    Example:
        >>> from conveyor.train.config import load_config
        >>> f = lr_lambda(load_config(None, ["optim.warmup_steps=10", "train.steps=110"]))
        >>> f(0), f(9), round(f(59), 3), round(f(109), 3)
        (0.1, 1.0, 0.55, 0.1)
    """
    warmup, total, floor = cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.min_lr_ratio
    cosine = cfg.optim.lr_schedule == "cosine"

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not cosine or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup + 1) / (total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def optimizer_and_schedule(cfg: TrainConfig, parameters: Any) -> tuple[Any, Any]:
    """The ``optim`` keys' AdamW over ``parameters`` and its :func:`lr_lambda` schedule (the parity reference's too)."""
    o = cfg.optim
    optimizer = torch.optim.AdamW(parameters, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def build_pipeline(cfg: TrainConfig, model: torch.nn.Module, loss_fn: Any = None) -> Any:
    """This rank's pipeline of ``model`` on the layout the ``parallel`` keys say (:meth:`ParallelConfig.layout
    <conveyor.train.config.ParallelConfig.layout>`: the ("pp", "dp", "tp") mesh the pipeline builds from the
    sizes, or every rank in this process), on the device :func:`~conveyor.train.launch.choose_devices`
    gives this rank (its GPU, or the CPU), with ``loss_fn`` (None: :func:`train_loss`'s for the model).
    The config's ``stage`` and ``transfer`` sections are the pipeline's records, passed whole."""
    p = cfg.parallel
    microbatch = cfg.replica_batch_size // p.microbatches
    example = torch.zeros(microbatch, cfg.model.seq_len, dtype=torch.long)
    split, transfer = conveyor.SplitOptions(method="parameters"), cfg.transfer
    if cfg.data.batching == "by_length":  # every microbatch its own rows and length: one trace for all
        split, transfer = by_length_options(model, transfer)
    options = conveyor.PipelineOptions(virtual=p.virtual, stage=cfg.stage, transfer=transfer, split=split)
    # With a plan (read once, by load_config), the pipeline takes schedule, microbatches, virtual and the cut
    # from it, the schedule's order too where it was planned for the measured costs (zb-1p, zb-2p).
    return conveyor.pipeline(model, example_args=(example,), plan=cfg.plan, schedule=p.schedule,
                             microbatches=p.microbatches, layout=p.layout(stage_device(cfg)),
                             loss_fn=loss_fn if loss_fn is not None else train_loss(cfg, model), options=options)


@dataclass
class Run:
    """What the loop carries between steps (one per rank)."""

    cfg: TrainConfig
    pipe: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_data: Any
    val_data: Any
    step: int = 0
    metrics: Any = None  # the open metrics.jsonl on rank 0
    losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)  # a mixture-of-experts model's auxiliary part
    val_losses: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)  # the step of each validation loss
    resumed_at: int | None = None  # the step a resumed run started from (None: a fresh run)
    tokens: int = 0  # tokens trained (targets not -100) in the steps this process ran
    step_tokens: int = 0  # the last step's
    train_time: float = 0.0
    stopped: str | None = None
    skipped: int = 0  # steps dropped for a non-finite loss or gradient (loss.on_nonfinite=skip), resumed ones too
    skipped_before: int = 0  # of them, those dropped before the checkpoint this run resumed from
    progress: Any = None  # a Progress; shows only on rank 0
    tensorboard: Any = None  # rank 0's TensorBoardLog, when run.tensorboard is on and it is installed
    loss_fn: Any = None  # the pipeline's: a LossWithAux records the parts of each step's loss
    parity: Any = None  # under train.parity: rank 0 trains one device beside the pipeline (conveyor.train.parity)
    startup: Any = None  # a StartupPhases: says what a slow start-up does, until the first step begins

    @property
    def rank0(self) -> bool:
        return dist.get_rank() == 0

    def log(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.tensorboard is not None:
            self.tensorboard.log(record)


def setup(cfg: TrainConfig, startup: Any = None) -> Run:
    """Seed, build model, pipeline, optimizer, schedule and loaders, and resume if asked; each phase named to
    ``startup`` (a :class:`~conveyor.train.startup.StartupPhases`, None: a silent one)."""
    startup = startup if startup is not None else StartupPhases(enabled=False)
    startup.phase(f"building the model ({cfg.model.name})")
    random.seed(cfg.train.seed)  # checkpoints hold Python's state too: seeded, a rerun writes the same
    torch.manual_seed(cfg.train.seed)  # every rank initialises the whole model alike, keeps its stages
    vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    # On the meta device: each rank allocates and initialises only its own stages (conveyor.frontend
    # seeds each owning module from its path, so every split, TP shard and rank gets the same values).
    model = build_model(cfg, vocab, device="meta")
    loss_fn = train_loss(cfg, model)
    if isinstance(loss_fn, LossWithAux):
        # transformers' MoE layers pick histc's dtype by the device type (int32 off the CPU, which the
        # CPU kernel refuses); traced on meta, the trace keeps the meta choice. On the stage's device
        # the trace takes the branch the stages will run, at the cost of every rank holding the whole
        # model once, until the stages are cut from it. Its values are made the meta build's, so that the
        # same seed starts the same model whichever way it is built.
        from conveyor.frontend.materialize import initialise_as_on_meta

        model = initialise_as_on_meta(build_model(cfg, vocab, device=stage_device(cfg)), cfg.train.seed)
    startup.phase(f"tracing the model and splitting it for {cfg.parallel.pp} pipeline ranks")
    pipe = build_pipeline(cfg, model, loss_fn)
    startup.phase("loading the pretrained weights")
    loaded = load_weights(cfg, pipe)  # a pretrained directory: each rank reads its own stages' tensors
    if loaded is not None and dist.get_rank() == 0:
        print(f"conveyor train: rank 0 loaded {loaded.tensors} tensors ({loaded.bytes_read:,} of "
              f"{loaded.total_bytes:,} bytes) from {cfg.model.name}", flush=True)
    optimizer, scheduler = optimizer_and_schedule(cfg, pipe.parameters())
    startup.phase(f"reading and tokenizing the corpus (data.source={cfg.data.source!r})")
    splits = splits_factory(cfg.data, cfg.model.seq_len)
    batch = cfg.replica_batch_size
    train_data = resumable_loader(pipe, lambda: splits().train, batch, seed=cfg.train.seed)
    if cfg.data.batching == "by_length":
        startup.phase("batching by length: the training documents cut into pieces (cached on disk after)")
        train_data = length_loader(pipe, cfg.data, cfg.model.seq_len, batch, pipe.schedule.num_microbatches,
                                   seed=cfg.train.seed, progress=startup.progress)
    val_data = None
    if cfg.train.eval_interval > 0 and cfg.data.val_fraction > 0:
        val_data = resumable_loader(pipe, lambda: splits().val, batch, seed=cfg.train.seed, shuffle=False)
    run = Run(cfg, pipe, optimizer, scheduler, train_data, val_data, loss_fn=loss_fn, startup=startup)
    startup.phase("loading the checkpoint to resume from")
    resume(run)
    startup.phase("starting the run")
    run.parity = start_parity(run, vocab)  # None unless train.parity
    if run.rank0:
        out = Path(cfg.run.dir)
        save_config(cfg, out / "config.yaml")
        # A resumed run continues the log after its step; a fresh one starts it over.
        run.metrics = continue_log(out / "metrics.jsonl", run.step)
        run.tensorboard = open_tensorboard(out, cfg.run.tensorboard, run.step)
    return run


# --- the loop -------------------------------------------------------------------------------

def train_step(run: Run) -> tuple[float, dict[str, float]]:
    """One optimizer step; returns the step's loss and its parts (the same on every rank).

    The parts are ``{"lm_loss": ..., "aux_loss": ...}`` for a model with an auxiliary loss
    (:func:`loss_parts`), else empty.

    A step whose loss or gradients are not finite, under ``loss.on_nonfinite=skip``, leaves
    parameters and optimizer state as they were (``pipe.skipped_steps`` counts it); the data
    and the learning-rate schedule move on, as they would for any step. Under ``stage.autocast=fp16``
    the loss is scaled (``stage.loss_scaling``) and a step whose gradients overflowed is skipped so
    whatever ``loss.on_nonfinite`` says, as ``torch.amp.GradScaler`` skips it; a scale that falls below its
    floor stops the run (:class:`~conveyor.errors.NonFiniteError`).
    """
    cfg, pipe = run.cfg, run.pipe
    x = y = None
    if run.train_data is not None:
        x, y = next(run.train_data) if cfg.data.batching != "by_length" else zip(*next(run.train_data))
    run.step_tokens = trained_tokens(run, y)
    normalize_by = None
    if cfg.loss.normalize == "tokens":
        counted = y if cfg.data.batching != "by_length" or y is None else torch.cat([t.reshape(-1) for t in y])
        normalize_by = count_tokens(pipe, counted if pipe.needs_target else None)
    mode = "skip" if cfg.loss.on_nonfinite == "skip" else "raise"
    if isinstance(run.loss_fn, LossWithAux):
        run.loss_fn.parts.clear()  # a step that failed earlier may have left some
    inputs, target = x if pipe.needs_inputs else None, y if pipe.needs_target else None
    if cfg.data.batching == "by_length":  # microbatches of their own lengths (conveyor.train.data.length_loader)
        inputs = conveyor.Microbatches(inputs=[(ids,) for ids in x] if pipe.needs_inputs else None,
                                       targets=list(y) if pipe.needs_target else None)
        target = None  # each microbatch's targets travel in the Microbatches
    loss = pipe.step(inputs, target=target, on_nonfinite=mode, normalize_by=normalize_by)
    parts = loss_parts(run, normalize_by)
    norm = pipe.clip_grad_norm_(cfg.train.clip) if cfg.train.clip > 0 else None  # a collective: every rank
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    if run.parity is not None:  # never with by_length (parity_problems refuses it)
        run.parity.step(run.step + 1, x, y, loss, norm)  # the same step on one device, printed beside this one
    return float(loss), parts


def trained_tokens(run: Run, targets: Any) -> int:
    """The tokens a step trains on, over every replica: its target positions that are not -100 (padding).

    Fixed windows (:class:`~conveyor.train.data.TokenBlocks`) pad nothing: ``train.batch_size x
    model.seq_len``, no communication. Batches by length (``targets``: this replica's microbatches'
    targets) are counted where the targets are, on the last stage of each replica, and summed in one
    small collective over the default group (every rank calls it), every TP rank of a last stage
    counting once per replica.

    Example:
        >>> from types import SimpleNamespace
        >>> from conveyor.train.config import load_config
        >>> trained_tokens(SimpleNamespace(cfg=load_config(None, ["train.batch_size=8"]), pipe=None), None)  # 8 x 128
        1024
    """
    cfg, pipe = run.cfg, run.pipe
    if cfg.data.batching != "by_length":
        return cfg.train.batch_size * cfg.model.seq_len
    total = torch.zeros(1, dtype=torch.int64, device=group_device(pipe.device))
    if pipe.needs_target and targets is not None:
        total += sum(int((target != -100).sum()) for target in targets)
    dist.all_reduce(total)
    return int(total.item()) // cfg.parallel.tp


def loss_parts(run: Run, normalize_by: Any = None) -> dict[str, float]:
    """The step's language-model and auxiliary losses, on every rank (empty without an auxiliary loss).

    The last stage's :class:`LossWithAux` recorded each microbatch's parts; they are divided by
    what the pipeline divided the loss by and summed in microbatch order, as the pipeline sums the
    loss, and then summed over the replicas' last stages and divided by their count (the mean the
    pipeline takes of the replicas' losses). Their sum is the step's loss up to the rounding of
    one addition. One small collective over the default group, as :func:`evaluate`'s.
    """
    pipe = run.pipe
    if not isinstance(run.loss_fn, LossWithAux):
        return {}
    total = torch.zeros(2, dtype=torch.float64, device=pipe.device)
    if pipe.needs_target:
        got, wanted = len(run.loss_fn.parts), run.cfg.parallel.microbatches
        if got != wanted:
            raise RuntimeError(f"the loss function ran {got} times in a step of {wanted} microbatches; "
                                 f"expected once per microbatch")
        divisor = loss_divisor(normalize_by, wanted, pipe.dp_size)
        total += run.loss_fn.step_parts(divisor).double()
    total = total.to(group_device(pipe.device))
    dist.all_reduce(total)
    # Every TP rank of a last stage holds the same parts: counted once per replica.
    lm, aux = (total / (pipe.dp_size * run.cfg.parallel.tp)).tolist()
    return {"lm_loss": lm, "aux_loss": aux}


@torch.no_grad()
def validation_sums(run: Run) -> torch.Tensor:
    """This rank's (loss sum, batches) over ``train.eval_batches`` batches (the same ones each time), float64
    on the stage device; non-zero on the ranks that run the last stage only.

    The language-model loss alone, also for a model with an auxiliary loss: that is what the
    model is judged by, and what compares with other models.

    The loss is computed where the logits are (the targets go there, :func:`~conveyor.runtime.stage.device.to_device`)
    and added there: no host read per batch.
    """
    pipe, data = run.pipe, run.val_data
    total = torch.zeros(2, dtype=torch.float64, device=pipe.device)
    if data is not None:
        data.restart()
    for _ in range(run.cfg.train.eval_batches):
        x, y = next(data) if data is not None else (None, None)
        out = pipe.forward(x if pipe.needs_inputs else None)
        if pipe.needs_target:
            loss = lm_loss()(out, to_device(y, pipe.device)).double()
            total += torch.stack([loss, torch.ones_like(loss)])
    return total


def evaluate(run: Run) -> float:
    """The mean validation loss over ``train.eval_batches`` batches (the same ones each time), on every rank.

    A collective over the default group, on the device its backend carries (NCCL: the stage's GPU).
    """
    total = validation_sums(run).to(group_device(run.pipe.device))
    # Every replica's last stage holds its share; the sum over all ranks is the mean's parts.
    dist.all_reduce(total)
    return float(total[0] / total[1])


def save_checkpoint(run: Run) -> Path:
    """A checkpoint of the whole run at ``<checkpoint dir>/step_<N>`` (a collective)."""
    from conveyor.checkpoint import save

    keep = run.cfg.checkpoint.keep_last or None
    data = run.train_data.state_dict() if run.train_data is not None else None
    path = Path(run.cfg.checkpoint_dir) / f"step_{run.step:06d}"
    layout = parallel_layout(run.cfg, run.pipe.schedule.num_stages)  # a resume at another layout names both
    extra = {"step": run.step, "data": data, "layout": layout, "skipped_steps": run.skipped}
    return save(path, run.pipe, run.optimizer, run.scheduler, extra=extra, keep_last=keep)


def validate_now(run: Run, start: float, log: bool = True) -> None:
    """Evaluate, log the validation loss (unless ``log`` is False) and print it on rank 0."""
    loss = evaluate(run)
    run.val_losses.append(loss)
    run.val_steps.append(run.step)
    if log:
        run.log({"step": run.step, "val_loss": loss, "elapsed": round(time.perf_counter() - start, 3)})
    run.progress.validation(run.step, loss)


def loop(run: Run) -> Path | None:
    """Steps from ``run.step`` to ``train.steps``, with validations and checkpoints; returns the last checkpoint."""
    cfg = run.cfg
    evaluating = cfg.train.eval_interval > 0 and cfg.data.val_fraction > 0
    start = time.perf_counter()
    run.progress = Progress(cfg.train.steps, run.step, cfg.run.log_interval, enabled=run.rank0)
    if evaluating and (run.step == 0 or run.resumed_at is not None):
        if run.startup is not None:
            run.startup.phase("validating before the first step")
        # The loss before training (or at the resume), to compare the last one with. At a resume the log
        # already holds what the saved run measured, and the random generators must come out as they went
        # in (the model's dropout draws from them): the log and the steps stay an uninterrupted run's.
        if run.resumed_at is None:
            validate_now(run, start)
        else:
            gpus = [run.pipe.device] if torch.device(run.pipe.device).type == "cuda" else []
            with torch.random.fork_rng(devices=gpus):
                validate_now(run, start, log=False)
    if run.startup is not None:
        run.startup.close()  # the progress lines speak from here on
    saved = None
    while run.step < cfg.train.steps:
        lr = run.scheduler.get_last_lr()[0]  # the rate this step uses (the scheduler moves on after it)
        began = time.perf_counter()
        try:
            loss, parts = train_step(run)
        except NonFiniteError as error:
            run.stopped = f"step {run.step + 1}: {error}"
            break
        took = time.perf_counter() - began
        run.step += 1
        run.tokens += run.step_tokens
        tokens_per_s = run.step_tokens / took  # trained tokens: padding (targets -100) not counted
        run.train_time += took
        run.losses.append(loss)
        if parts:
            run.aux_losses.append(parts["aux_loss"])
        skipped = run.skipped_before + run.pipe.skipped_steps > run.skipped
        run.skipped = run.skipped_before + run.pipe.skipped_steps
        scale = run.pipe.loss_scale  # fp16's loss scale after this step (None: not scaled)
        scaling = {} if scale is None else {"loss_scale": scale, "skipped_steps": run.skipped}
        capped = cfg.parallel.expert_capacity is not None and expert_size(cfg.parallel) > 1
        experts = {"dropped_slots": dropped_slots(run.pipe)} if capped else {}  # a collective
        run.log({"step": run.step, "loss": loss, **parts, "lr": lr, "tokens": run.step_tokens,
                 "tokens_per_s": round(tokens_per_s, 1), **scaling, **experts,
                 "elapsed": round(time.perf_counter() - start, 3), **({"skipped": True} if skipped else {})})
        run.progress.step(run.step, loss, lr, tokens_per_s, took, parts=parts,
                          scaling=None if scale is None else (scale, run.skipped))
        if evaluating and (run.step % cfg.train.eval_interval == 0 or run.step == cfg.train.steps):
            validate_now(run, start)
        interval = cfg.checkpoint.interval
        if (interval and run.step % interval == 0) or run.step == cfg.train.steps:
            saved = save_checkpoint(run)
    return saved


def train(cfg: TrainConfig, startup: Any = None) -> dict[str, Any]:
    """Train as ``cfg`` says, on this rank of an initialised process group of ``pp x dp x tp`` ranks.

    Returns (on every rank) a summary: steps, first and last training and validation
    losses, tokens per second, the last checkpoint, why it stopped early (or None), peak RSS
    per rank, and (for a run that finished its steps) the last step's measured and simulated
    bubble and the plots' paths, and the sample's prompt and text (``train.sample_tokens`` > 0).

    ``startup``: a :class:`~conveyor.train.startup.StartupPhases` that names each phase of a slow start-up
    (rank 0's, from :func:`~conveyor.train.launch.worker`); None: nothing said.

    Example (each rank, under torchrun)::

        dist.init_process_group("gloo")
        summary = train(load_config("configs/gpt.yaml", world_size=dist.get_world_size()))
    """
    if dist.get_world_size() != cfg.world_size:
        raise ConfigError(f"parallel.pp x parallel.dp x parallel.tp = {cfg.world_size}, but {dist.get_world_size()} "
                          f"ranks were launched")
    run = setup(cfg, startup)
    pictures: dict[str, Any] = {}
    sample: dict[str, Any] = {}
    try:
        saved = loop(run)
        if run.losses and run.stopped is None:
            # A collective, so before close; a run stopped by a non-finite step has no whole step to draw.
            pictures = write_timeline(run.pipe, cfg.run.dir, run.rank0)
            if run.tensorboard is not None:
                run.tensorboard.log({"step": run.step, **pictures})  # the bubbles
        if cfg.train.sample_tokens and run.stopped is None:
            sample = write_sample(run)  # forwards through the pipeline: a collective, before close
    finally:
        for opened in (run.progress, run.pipe, run.metrics, run.tensorboard):
            if opened is not None:
                opened.close()
    if run.rank0:
        out = Path(cfg.run.dir)
        pictures["loss_png"] = str(write_loss_plot(out / "metrics.jsonl", out / "loss.png"))
    summary = {"steps": run.step, "first_loss": run.losses[0] if run.losses else None,
               "last_loss": run.losses[-1] if run.losses else None,
               "first_val_loss": run.val_losses[0] if run.val_losses else None,
               "last_val_loss": run.val_losses[-1] if run.val_losses else None,
               "resumed_at": run.resumed_at, "val_steps": run.val_steps[:1] + run.val_steps[-1:],
               "tokens_per_s": run.tokens / run.train_time if run.train_time else None,
               "first_aux_loss": run.aux_losses[0] if run.aux_losses else None,
               "last_aux_loss": run.aux_losses[-1] if run.aux_losses else None,
               "checkpoint": str(saved) if saved else None, "stopped": run.stopped, "skipped_steps": run.skipped,
               "peak_rss_mib": peak_rss_mib(), **pictures, **sample}
    if run.rank0:
        print(format_summary(summary, cfg))
    if run.parity is not None:
        summary["parity_equal"] = run.parity.finish()  # rank 0: whether every step was bitwise equal
    return summary

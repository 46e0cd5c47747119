"""``train.parity=true``: rank 0 trains the unsplit model on one device beside the pipeline, step for step.

The library's promise is that a pipeline computes exactly what one device with gradient
accumulation computes. With ``train.parity=true`` (``configs/demo.yaml``: ``conveyor demo``)
rank 0 checks it on the run itself: it also holds the whole model, initialised as the stages
are (every module seeded from its path, so the values do not depend on the split), with its
own AdamW and learning-rate schedule. After each pipeline step it trains the same step on its
device: the same batch cut into the same microbatches (``torch.tensor_split``), each loss
divided by M and backpropagated in microbatch order, the gradients clipped as the pipeline's
(``train.clip``), then the optimizer and schedule step. It prints the two losses and gradient
norms side by side and whether both pairs are bitwise equal (``torch.equal``), and at the end
whether every step was; the summary's ``parity_equal`` says the same, and the launcher exits 1
when it is False.

:func:`parity_problems` lists what parity cannot be checked with (a ConfigError before any rank
starts): data-parallel replicas, autocast, per-token loss normalisation, a mixture-of-experts
or pretrained model, and resuming (the reference starts from the initialisation).

Example:
    $ conveyor train configs/demo.yaml        # what `conveyor demo` trains
    step 1: pipeline loss 5.5602198 | one device 5.5602198   grad norm 0.9147312 | 0.9147312   bitwise equal
"""

from __future__ import annotations

from typing import Any

from conveyor.train.config import model_kind

PARITY_KEY = "train.parity"


def parity_problems(cfg: Any) -> list[str]:
    """What in ``cfg`` rules out ``train.parity=true`` (empty when it is off or possible), one line each.

    Example:
        >>> from conveyor.train.config import TrainConfig
        >>> cfg = TrainConfig()
        >>> cfg.train.parity, cfg.parallel.dp = True, 2
        >>> parity_problems(cfg)  # doctest: +ELLIPSIS
        ['train.parity=true compares one pipeline with one device: parallel.dp=2 replicas ...; set parallel.dp=1']
    """
    if not getattr(cfg.train, "parity", False):
        return []
    why = f"{PARITY_KEY}=true compares one pipeline with one device"
    rules = [
        (cfg.parallel.dp != 1, f"parallel.dp={cfg.parallel.dp} replicas have no single-device reference here; "
                               f"set parallel.dp=1"),
        (cfg.parallel.tp != 1, f"parallel.tp={cfg.parallel.tp}: tensor parallelism "
                                              f"sums the row-parallel projections' partial products in another "
                                              f"order, so its steps match one device to rounding, not bit for "
                                              f"bit; set parallel.tp=1"),
        (getattr(cfg.data, "batching", "windows") == "by_length",
         "data.batching=by_length: the reference steps fixed windows; set data.batching=windows"),
        (cfg.stage.autocast is not None, f"stage.autocast={cfg.stage.autocast!r}: the reference trains in fp32; "
                                         f"set stage.autocast=null"),
        (cfg.stage.param_dtype is not None, f"stage.param_dtype={cfg.stage.param_dtype!r}: the reference trains "
                                            f"fp32 parameters; set stage.param_dtype=null"),
        (cfg.loss.normalize != "microbatch", f"loss.normalize={cfg.loss.normalize!r}: the reference divides each "
                                             f"microbatch's loss by M; set loss.normalize=microbatch"),
        (cfg.model.name == "moe", "model.name='moe': its auxiliary loss has no reference here; use gpt, llama or mpt"),
        (model_kind(cfg.model.name) == "pretrained", f"model.name={cfg.model.name!r}: the reference is built from "
                                                     f"scratch, not from pretrained weights; use a recipe model"),
        (cfg.checkpoint.resume not in (False, "false", ""), f"checkpoint.resume={cfg.checkpoint.resume!r}: the "
                                                             f"reference starts from the initialisation; set "
                                                             f"checkpoint.resume=false"),
        (cfg.run.max_restarts > 0, f"run.max_restarts={cfg.run.max_restarts}: a restarted round resumes, the "
                                   f"reference cannot; set run.max_restarts=0"),
    ]
    return [f"{why}: {message}" for broken, message in rules if broken]


class ParityReference:
    """Rank 0's single-device twin of the pipeline (see the module docstring); built by :func:`start_parity`.

    Example (rank 0, inside :func:`conveyor.train.loop.train`)::

        reference = ParityReference(cfg, vocab_size, torch.device("cpu"))
        reference.step(step, x, y, pipeline_loss, pipeline_norm)   # prints the comparison
        reference.finish()                                         # True: every step bitwise equal
    """

    def __init__(self, cfg: Any, vocab_size: int, device: Any) -> None:
        from conveyor.train.loop import optimizer_and_schedule, train_loss

        self.cfg = cfg
        self.model = unsplit_model(cfg, vocab_size, device)
        self.model.train()
        self.loss_fn = train_loss(cfg, self.model)
        self.optimizer, self.scheduler = optimizer_and_schedule(cfg, self.model.parameters())
        self.steps = 0
        self.different: list[int] = []  # the steps whose loss or norm differed

    def train_step(self, x: Any, y: Any) -> tuple[Any, Any]:
        """One step on the unsplit model: (the loss, the gradients' total norm before clipping, or None)."""
        import torch

        microbatches = self.cfg.parallel.microbatches
        total = None
        for inputs, targets in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches)):
            loss = self.loss_fn(self.model(inputs), targets) / microbatches
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        clip = self.cfg.train.clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip) if clip > 0 else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total, norm

    def step(self, step: int, x: Any, y: Any, loss: Any, norm: Any) -> bool:
        """Train step ``step`` (1-based) here, print it beside the pipeline's ``loss`` and ``norm``; True if equal."""
        import torch

        want, want_norm = self.train_step(x, y)
        loss = loss.detach().to(want.device)
        equal = torch.equal(loss, want)
        norms = ""
        if want_norm is not None and norm is not None:
            norm = norm.detach().to(want_norm.device)
            equal = equal and torch.equal(norm, want_norm)
            norms = f"   grad norm {norm.item():.7f} | {want_norm.item():.7f}"
        self.steps += 1
        if not equal:
            self.different.append(step)
        print(f"step {step}: pipeline loss {loss.item():.7f} | one device {want.item():.7f}{norms}   "
              f"{'bitwise equal' if equal else 'DIFFERENT'}", flush=True)
        _start_together()
        return equal

    def finish(self) -> bool:
        """Print whether every step was bitwise equal to one device; returns it."""
        if not self.different:
            print(f"parity: all {self.steps} steps bitwise equal to single-device training "
                  f"(loss and gradient norm, torch.equal)", flush=True)
            return True
        shown = ", ".join(map(str, self.different[:10])) + (" ..." if len(self.different) > 10 else "")
        print(f"parity: MISMATCH with single-device training at {len(self.different)} of {self.steps} steps "
              f"(steps {shown})", flush=True)
        return False


def unsplit_model(cfg: Any, vocab_size: int, device: Any) -> Any:
    """The whole model of ``cfg`` on ``device``, with the values the pipeline's stages get from the same seed.

    The stages are materialised from the meta-device model, each owning module seeded from
    ``(train.seed, its path)`` (:func:`conveyor.frontend.materialize.materialize`), so a tensor's values
    depend on its name alone; doing the same for every tensor gives the unsplit model the same values,
    tied tensors staying one tensor.
    """
    from conveyor.frontend.materialize import materialize, named_tensors
    from conveyor.train.models import build_model

    model = build_model(cfg, vocab_size, device="meta")
    names = [name for name, _ in named_tensors(model)]
    for name, tensor in materialize(model, names, device, cfg.train.seed).items():
        path, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(path), leaf, tensor)  # fills a parameter's slot or a buffer's alike
    return model


class ParityPeer:
    """What the other ranks do under ``train.parity``: wait for rank 0's reference step before the next step."""

    def step(self, step: int, x: Any, y: Any, loss: Any, norm: Any) -> None:
        _start_together()

    def finish(self) -> None:
        return None


def _start_together() -> None:
    # Every rank starts the next step together: without this, rank 0's reference step would show in
    # the measured timeline as the other ranks' waiting (bubble the simulation cannot have).
    import torch.distributed as dist

    dist.barrier()


def start_parity(run: Any, vocab_size: int) -> ParityReference | ParityPeer | None:
    """Under ``train.parity``: rank 0's :class:`ParityReference` (on the stage's device), a :class:`ParityPeer`
    on the other ranks; None when it is off."""
    import torch.distributed as dist

    if not getattr(run.cfg.train, "parity", False):
        return None
    if dist.get_rank() != 0:
        return ParityPeer()
    if run.train_data is None:
        raise RuntimeError(f"{PARITY_KEY}=true: rank 0 reads no training data, so it cannot train the reference; "
                           f"use a schedule that places stage 0 on rank 0")
    reference = ParityReference(run.cfg, vocab_size, run.pipe.device)
    count = sum(p.numel() for p in reference.model.parameters())
    print(f"parity: rank 0 also trains the unsplit model ({count:,} parameters) on {run.pipe.device}, "
          f"{run.cfg.parallel.microbatches} microbatches accumulated per step", flush=True)
    return reference

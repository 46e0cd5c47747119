"""What ``conveyor train`` shows and leaves behind besides the model: progress and the run directory's pictures.

* :class:`Progress`: rank 0's live line (a ``tqdm`` bar on a terminal, plain lines otherwise)
  with step/total, loss (and its language-model and auxiliary parts, for a mixture-of-experts
  model), the last validation loss, trained tokens/s (target tokens, padding not counted) and the time left.
* :func:`write_timeline`: ``timeline.png`` (the last step measured, beside its simulation fed
  with the stage costs measured in that step) and ``timeline.json`` (a Chrome/Perfetto trace).
* :func:`write_loss_plot`: ``loss.png``, the training and validation curves of ``metrics.jsonl`` (and
  the auxiliary loss in a panel of its own, where the run has one).
* :func:`peak_rss_mib`: every rank's peak resident memory.
* :class:`TensorBoardLog`: the metrics as TensorBoard scalars under ``<run.dir>/tensorboard``
  (when ``tensorboard`` is installed and ``run.tensorboard`` is on).

Example (rank 0, after a run)::

    write_loss_plot("runs/train/metrics.jsonl", "runs/train/loss.png")
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from conveyor.train.sample import sample_lines


def format_eta(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS`` (or ``M:SS`` under an hour).

    Example:
        >>> format_eta(75), format_eta(3725.2)
        ('1:15', '1:02:05')
    """
    seconds = int(round(max(0.0, seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Rank 0's progress: a ``tqdm`` bar when stdout is a terminal, else one plain line per logged step.

    The plain lines stay for logs and pipes, where a redrawn bar would be a mess of carriage returns.

    Example:
        >>> p = Progress(total=4, initial=0, log_interval=1, enabled=True, live=False)
        >>> p.step(1, loss=5.0, lr=1e-3, tokens_per_s=1000.0, took=0.5)   # doctest: +ELLIPSIS
        step     1/4  loss 5.0000  lr 1.00e-03  1,000 trained tokens/s  ETA ...
        >>> p.step(2, 5.0, 1e-3, 1000.0, 0.5, parts={"lm_loss": 4.96, "aux_loss": 0.04})  # doctest: +ELLIPSIS
        step     2/4  loss 5.0000 (lm 4.9600 + aux 0.0400)  lr 1.00e-03  1,000 trained tokens/s  ETA ...
        >>> p.close()
    """

    def __init__(self, total: int, initial: int, log_interval: int, enabled: bool, live: bool | None = None):
        self.total, self.initial, self.log_interval, self.enabled = total, initial, log_interval, enabled
        self.val_loss: float | None = None
        self.elapsed = 0.0  # training time of the steps this process ran: the ETA's rate
        live = sys.stdout.isatty() if live is None else live
        self.bar = None
        if enabled and live:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stdout)

    def eta(self, step: int) -> float:
        done = step - self.initial
        return self.elapsed / done * (self.total - step) if done > 0 else 0.0

    def step(self, step: int, loss: float, lr: float, tokens_per_s: float, took: float,
             parts: dict[str, float] | None = None, scaling: tuple[float, int] | None = None) -> None:
        """Record one finished step (``step`` counts from 1) and show it, with ``parts``
        (``lm_loss``, ``aux_loss``) where the loss has an auxiliary part, and ``scaling`` (fp16's loss
        scale after the step, and the steps skipped so far) where the loss is scaled."""
        self.elapsed += took
        if not self.enabled:
            return
        if self.bar is not None:
            postfix = {"loss": f"{loss:.4f}"}
            if parts:
                postfix.update(lm=f"{parts['lm_loss']:.4f}", aux=f"{parts['aux_loss']:.4f}")
            postfix["trained tok/s"] = f"{tokens_per_s:,.0f}"
            if scaling is not None:
                postfix.update(scale=f"{scaling[0]:g}", skipped=str(scaling[1]))
            if self.val_loss is not None:
                postfix["val"] = f"{self.val_loss:.4f}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)  # tqdm draws its own ETA from the rate of updates
        elif step % self.log_interval == 0 or step == 1 or step == self.total:
            val = f"  val {self.val_loss:.4f}" if self.val_loss is not None else ""
            split = f" (lm {parts['lm_loss']:.4f} + aux {parts['aux_loss']:.4f})" if parts else ""
            scaled = f"  loss scale {scaling[0]:g} ({scaling[1]} skipped)" if scaling is not None else ""
            print(f"step {step:5d}/{self.total}  loss {loss:.4f}{split}{val}{scaled}  lr {lr:.2e}  "
                  f"{tokens_per_s:,.0f} trained tokens/s  ETA {format_eta(self.eta(step))}", flush=True)

    def validation(self, step: int, loss: float) -> None:
        """Record and show a validation loss."""
        self.val_loss = loss
        if not self.enabled:
            return
        line = f"step {step:5d}  validation loss {loss:.4f}"
        if self.bar is not None:
            self.bar.write(line)  # above the bar, which redraws below it
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def write_timeline(pipe: Any, run_dir: str | Path, rank0: bool) -> dict[str, Any]:
    """``timeline.png`` and ``timeline.json`` of the pipeline's last step (a collective: every rank calls it).

    Returns, on every rank, the measured and simulated bubble ratios and the files' paths
    (which only rank 0 writes).
    """
    import conveyor.schedule as cs
    from conveyor.schedule.cost import costs_from_timeline
    from conveyor.schedule.render import side_by_side_png, write_chrome_trace

    measured = pipe.timeline()
    schedule = pipe.schedule
    # The program the ranks ran (I+W pairs merged), timed with the stage costs they measured:
    # what this step would have taken with no waiting beyond the schedule's own.
    plan = cs.simulate(cs.executable(schedule).compute, costs_from_timeline(measured, schedule.num_stages),
                       time_unit="s")
    out = Path(run_dir)
    png, trace = out / "timeline.png", out / "timeline.json"
    if rank0:
        side_by_side_png(plan, measured, png)
        write_chrome_trace(measured, trace)
    return {"measured_bubble": measured.bubble_ratio, "simulated_bubble": plan.bubble_ratio,
            "measured_step_s": measured.makespan, "simulated_step_s": plan.makespan,
            "timeline_png": str(png), "timeline_trace": str(trace)}


def write_loss_plot(metrics_path: str | Path, path: str | Path) -> Path:
    """``path``: the training loss per step and the validation losses of ``metrics_path`` (a metrics.jsonl).

    A run with an auxiliary loss also draws the language-model part beside the total (the
    validation loss is a language-model loss too), and the auxiliary part below, on its own
    scale (it is some hundred times smaller).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]

    def curve(key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in records if r.get(key) is not None]

    train, lm, aux, val = curve("loss"), curve("lm_loss"), curve("aux_loss"), curve("val_loss")
    figure, axes = plt.subplots(2 if aux else 1, 1, figsize=(7, 6 if aux else 4), dpi=100, sharex=True,
                                squeeze=False, height_ratios=[2, 1] if aux else None)
    ax = axes[0][0]
    try:
        for points, label, style in ((train, "training" if not lm else "training (total)", {"linewidth": 1.2}),
                                     (lm, "training (language model)", {"linewidth": 1.2}),
                                     (val, "validation", {"marker": "o", "linewidth": 1.5})):
            if points:
                ax.plot(*zip(*points, strict=True), label=label, **style)
        ax.set_ylabel("loss")
        if aux:
            low = axes[1][0]
            low.plot(*zip(*aux, strict=True), label="auxiliary (load balancing)", color="tab:red", linewidth=1.2)
            low.set_ylabel("auxiliary loss")
            low.grid(alpha=0.3)
            low.legend()
        axes[-1][0].set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, bbox_inches="tight")
    finally:
        plt.close(figure)
    return out


def peak_rss_mib() -> list[float]:
    """Every rank's peak resident set size in MiB, indexed by rank (a collective)."""
    # ru_maxrss is in KiB on Linux (bytes on macOS, where it reads 1024x too large).
    mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if sys.platform == "darwin":
        mine /= 1024
    # Through the store, not a collective: this is the last exchange of a run, and a gloo collective
    # this close to the interpreter's exit can leave its worker thread freeing the collective's
    # Python tensors during finalisation, which aborts the process (SIGABRT, "terminate called
    # without an active exception") after a successful run.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"conveyor/peak_rss/{dist.get_rank()}", repr(mine))
    return [float(store.get(f"conveyor/peak_rss/{rank}").decode()) for rank in range(dist.get_world_size())]


def report_lines(summary: dict[str, Any]) -> list[str]:
    """The summary's lines on the pipeline and memory (empty for what the run did not measure).

    Example:
        >>> print("\\n".join(report_lines({"measured_bubble": 0.41, "simulated_bubble": 0.25,
        ...     "measured_step_s": 0.2, "simulated_step_s": 0.15, "peak_rss_mib": [812.0, 790.5]})))
        bubble (last step): measured 0.410, simulated 0.250; step 200.0 ms measured, 150.0 ms simulated
        peak memory (RSS): rank 0 812 MiB, rank 1 790 MiB
    """
    lines = []
    if summary.get("measured_bubble") is not None:
        lines.append(f"bubble (last step): measured {summary['measured_bubble']:.3f}, simulated "
                     f"{summary['simulated_bubble']:.3f}; step {summary['measured_step_s'] * 1e3:.1f} ms measured, "
                     f"{summary['simulated_step_s'] * 1e3:.1f} ms simulated")
    if summary.get("peak_rss_mib"):
        lines.append("peak memory (RSS): " + ", ".join(f"rank {r} {m:.0f} MiB"
                                                        for r, m in enumerate(summary["peak_rss_mib"])))
    return lines



class TensorBoardLog:
    """Rank 0's TensorBoard events: each metrics.jsonl record as scalars, and the last step's bubble.

    Tags: ``train/loss``, ``train/lm_loss`` and ``train/aux_loss`` (a model with an auxiliary
    loss), ``train/lr``, ``train/tokens_per_s``, ``val/loss``,
    ``bubble/measured``, ``bubble/simulated``; the step is the record's ``step``, so the
    scalars equal metrics.jsonl's (as float32). Build it with :func:`open_tensorboard`.

    Example:
        >>> import tempfile
        >>> board = open_tensorboard(tempfile.mkdtemp(), enabled=True)
        >>> board.log({"step": 1, "loss": 5.5, "lr": 1e-3, "tokens_per_s": 900.0, "elapsed": 0.1})
        >>> board.close()
    """

    TAGS = MappingProxyType({"loss": "train/loss", "lm_loss": "train/lm_loss", "aux_loss": "train/aux_loss",
                             "lr": "train/lr", "tokens_per_s": "train/tokens_per_s", "val_loss": "val/loss",
                             "measured_bubble": "bubble/measured", "simulated_bubble": "bubble/simulated"})

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, record: dict[str, Any]) -> None:
        """Each value of ``record`` (a metrics.jsonl record, or the summary's bubbles) that has a tag, at its step."""
        for key, tag in self.TAGS.items():
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], global_step=record["step"])
        self.writer.flush()  # a run killed later still leaves what it logged

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(run_dir: str | Path, enabled: bool = True, step: int = 0) -> TensorBoardLog | None:
    """A :class:`TensorBoardLog` writing under ``<run_dir>/tensorboard``, or None when off or when
    ``tensorboard`` is not installed (it is optional: the run goes on without it).

    A resumed run (``step`` > 0) drops the events a previous run logged after that step, and a
    fresh one (``step`` 0) all of them, so the curves match ``metrics.jsonl`` and do not fold back.

    Example:
        >>> open_tensorboard("runs/train", enabled=False) is None
        True
    """
    if not enabled:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    # Events at or after purge_step are dropped: a run resumed at step S logs from S + 1 (S is
    # logged already), and a fresh run (step 0) drops whatever an earlier run left in the directory.
    return TensorBoardLog(SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=step + 1 if step else 0))


def format_summary(summary: dict[str, Any], cfg: Any) -> str:
    """The end-of-run lines rank 0 prints; after a resume they say where it resumed and which steps the
    losses come from.

    Example:
        >>> from conveyor.train.config import load_config
        >>> print(format_summary({"steps": 2, "first_loss": 5.5, "last_loss": 5.0, "first_val_loss": None,
        ...     "last_val_loss": None, "tokens_per_s": 100.0, "checkpoint": "c/step_2", "stopped": None},
        ...     load_config(None)))
        done: 2 steps; training loss 5.5000 -> 5.0000; 100 trained tokens/s
        checkpoint: c/step_2; metrics: runs/train/metrics.jsonl
        >>> print(format_summary({"steps": 8, "first_loss": 5.2, "last_loss": 5.0, "first_val_loss": 5.3003,
        ...     "last_val_loss": 5.1, "tokens_per_s": 100.0, "checkpoint": "c/step_8", "stopped": None,
        ...     "resumed_at": 4, "val_steps": [4, 8]}, load_config(None)).splitlines()[0])
        ... # doctest: +NORMALIZE_WHITESPACE
        done: 8 steps, resumed at step 4; training loss 5.2000 (step 5) -> 5.0000 (step 8);
        validation loss 5.3003 (step 4) -> 5.1000 (step 8); 100 trained tokens/s
    """
    resumed = summary.get("resumed_at")

    def pair(first: float | None, last: float | None, name: str, steps: list[int] | None = None) -> str:
        if first is None:
            return ""
        if resumed is None or not steps:
            return f"; {name} loss {first:.4f} -> {last:.4f}"
        return f"; {name} loss {first:.4f} (step {steps[0]}) -> {last:.4f} (step {steps[-1]})"

    head = f"done: {summary['steps']} steps" if not summary["stopped"] else f"stopped at {summary['stopped']}"
    if resumed is not None:
        head += f", resumed at step {resumed}"
    trained = [resumed + 1, summary["steps"]] if resumed is not None else None
    rate = f"; {summary['tokens_per_s']:,.0f} trained tokens/s" if summary["tokens_per_s"] else ""
    if summary.get("skipped_steps"):
        rate += f"; {summary['skipped_steps']} step(s) skipped (loss or gradients not finite)"
    lines = [head + pair(summary["first_loss"], summary["last_loss"], "training", trained)
             + pair(summary.get("first_aux_loss"), summary.get("last_aux_loss"), "auxiliary", trained)
             + pair(summary["first_val_loss"], summary["last_val_loss"], "validation", summary.get("val_steps"))
             + rate,
             *report_lines(summary),
             f"checkpoint: {summary['checkpoint']}; metrics: {cfg.run.dir}/metrics.jsonl"]
    files = [summary[key] for key in ("loss_png", "timeline_png", "timeline_trace") if summary.get(key)]
    if files:
        lines.append("files: " + ", ".join(files))
    return "\n".join(lines + sample_lines(summary))

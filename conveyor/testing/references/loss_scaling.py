"""The single-device reference for fp16 with loss scaling: ``torch.amp.GradScaler`` over the same microbatches.

What a pipeline built with ``StageOptions(autocast="fp16")`` (or ``param_dtype="fp16"``) must
equal bit for bit, step after step (tests and ``tools/gpu_rows`` share it). One step, on one device:

1. for each microbatch ``i`` in order, under ``torch.autocast(device, float16)``:
   ``scaler.scale(loss_fn(model(x_i), y_i) / M).backward()`` (fp16 weights: each microbatch's
   fp16 gradient then added into an fp32 ``main_grad``, as the pipeline's stages do);
2. ``scaler.step(optimizer)`` (which unscales, and skips the step if a gradient is not finite),
   ``scaler.update()``; with fp16 weights the optimizer steps fp32 masters, rounded into the weights.

The model is a stack of ``Linear + Tanh`` stages whose first weight column is zero and whose inputs'
first column is zero, except in :func:`batches`' ``overflow_step``, where it is 3e4: the first
stage's weight gradient then overflows fp16 (its column's gradient sums 3e4 x the incoming
gradient) while its forward, and every other stage's gradient, stay as they were. So that step
overflows on the first stage only: a pipeline must skip it on every rank, as GradScaler skips it.

Example:
    >>> run = grad_scaler_run(mlp_stages(2), batches(3, overflow_step=1), num_microbatches=2,
    ...                       scaling=SCALING, device=torch.device("cpu"))
    >>> [round(s) for s in run.scales]          # grown after 2 good steps (growth_interval=2); never here
    [256, 128, 128]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from conveyor.runtime.stage.loss_scale import LossScaling

WIDTH, OUTPUTS, ROWS, LR = 8, 2, 8, 1e-2
SCALING = LossScaling(init_scale=256.0, growth_interval=2)  # small enough that only the forced step overflows
OVERFLOW_INPUT = 3e4  # fp16's largest is 65504: the input fits, its weight gradient does not


def mlp_stages(num_stages: int, seed: int = 0) -> list[nn.Module]:
    """``num_stages`` stages (``Linear + Tanh``, the last a plain ``Linear``) whose first weight column is zero."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    stages: list[nn.Module] = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_stages - 1)]
    stages.append(nn.Linear(WIDTH, OUTPUTS))
    torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        stages[0][0].weight[:, 0] = 0  # the column the overflow step's input reaches: no effect on the forward
    return stages


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean square error in fp32 (what autocast would do to an fp16 output anyway)."""
    return nn.functional.mse_loss(output.float(), target)


def batches(num_steps: int, overflow_step: int | None = None, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (inputs, targets) minibatch per step; in ``overflow_step`` the inputs' first column is 3e4."""
    out = []
    for step in range(num_steps):
        generator = torch.Generator().manual_seed(step)
        x, t = torch.randn(ROWS, WIDTH, generator=generator), torch.randn(ROWS, OUTPUTS, generator=generator)
        x[:, 0] = OVERFLOW_INPUT if step == overflow_step else 0.0  # zero: the zero weight column stays zero
        out.append((x.to(device, dtype), t.to(device)))
    return out


@dataclass
class Run:
    """Per step: the loss, the scale after it, whether it was skipped; the parameters after it, by (stage, name)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    params: list[dict[tuple[int, str], torch.Tensor]] = field(default_factory=list)


def grad_scaler_run(stages: Sequence[nn.Module], minibatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    num_microbatches: int, scaling: LossScaling, device: torch.device,
                    fp16_weights: bool = False, num_replicas: int = 1) -> Run:
    """The stages, unsplit, trained on one device with GradScaler (``fp16_weights``: fp16 stages, fp32
    main grads and masters); AdamW at lr 1e-2. ``num_replicas`` > 1: each replica's rows of a minibatch
    accumulated on their own, then the gradients and losses averaged in replica order (what data-parallel
    replicas compute: :mod:`conveyor.testing.references.data_parallel`), then the scaler's step."""
    model = nn.Sequential(*stages).to(device)
    scaler = torch.amp.GradScaler(device.type, init_scale=scaling.init_scale, growth_factor=scaling.growth_factor,
                                  backoff_factor=scaling.backoff_factor, growth_interval=scaling.growth_interval)
    named = {(s, n): p for s, stage in enumerate(stages) for n, p in stage.named_parameters()}
    params = list(named.values())
    if fp16_weights:
        model.half()
        masters = [nn.Parameter(p.detach().float()) for p in params]
    optimizer = torch.optim.AdamW(masters if fp16_weights else params, lr=LR)
    run = Run()
    for x, t in minibatches:
        if num_replicas == 1:
            total, main_grads = _accumulate(model, params, x, t, num_microbatches, scaler, fp16_weights)
        else:
            replicas = []
            for x_r, t_r in zip(x.chunk(num_replicas), t.chunk(num_replicas)):
                replicas.append((*_accumulate(model, params, x_r, t_r, num_microbatches, scaler, False),
                                 [p.grad for p in params]))
                optimizer.zero_grad(set_to_none=True)
            total = average([loss for loss, _, _ in replicas])
            for param, grads in zip(params, zip(*(grads for _, _, grads in replicas))):
                param.grad = average(list(grads))
        if fp16_weights:
            for master, grad in zip(masters, main_grads):
                master.grad = grad
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if fp16_weights:
            with torch.no_grad():
                for param, master in zip(params, masters):
                    param.copy_(master)
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(total)
        run.scales.append(scaler.get_scale())
        run.skipped.append(run.scales[-1] < scale_before)
        run.params.append({key: p.detach().clone() for key, p in named.items()})
    return run


def _accumulate(model: nn.Module, params: list[torch.Tensor], x: torch.Tensor, t: torch.Tensor,
                num_microbatches: int, scaler: torch.amp.GradScaler, fp16_weights: bool):
    """Every microbatch's scaled backward in order: the summed loss (each / M), and with fp16 weights the
    fp32 main grads (each microbatch's fp16 gradient added in fp32, ``.grad`` dropped)."""
    total, main_grads = None, [None] * len(params)
    device_type = next(model.parameters()).device.type
    for x_i, t_i in zip(x.tensor_split(num_microbatches), t.tensor_split(num_microbatches)):
        with torch.autocast(device_type, dtype=torch.float16, enabled=not fp16_weights):
            loss = mse_loss(model(x_i), t_i) / num_microbatches
            scaler.scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
        if fp16_weights:
            for i, param in enumerate(params):
                main_grads[i] = param.grad.float() if main_grads[i] is None else main_grads[i] + param.grad
                param.grad = None
    return total, main_grads


def average(values: list[torch.Tensor]) -> torch.Tensor:
    """Summed in order, divided by their count: how data-parallel replicas average."""
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total / len(values)

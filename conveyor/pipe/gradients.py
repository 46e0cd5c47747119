"""What a pipeline does with a step's gradients: clipping by the total norm, the non-finite check, fp16's
loss scaling (:mod:`conveyor.pipe.loss_scaling`).

The object a :class:`~conveyor.pipe.Pipeline` holds for its ``clip_grad_norm_``, its
``forget_norm_layout`` and its step's ``on_nonfinite``: the norms, their exchange, the scaling and the flags are
:mod:`conveyor.parallel.clipping`. Both stay on the stage device: clipping sends its norms
through a tensor all-gather (the layout of which parameters have gradients travels once, see
:mod:`conveyor.parallel.clipping`); the non-finite check combines device flags with an
all-reduce and reads them on the host once per step, only when the step was asked to
(``on_nonfinite``): that read is the one host synchronisation a checked step makes, since
``"skip"`` must decide, in Python, whether to drop the gradients.

Example:
    >>> import torch, conveyor
    >>> pipe = conveyor.Pipeline([torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)], "1f1b", microbatches=2,
    ...                          loss_fn=lambda y, t: (y - t).pow(2).mean(), layout=conveyor.InProcessLayout())
    >>> loss = pipe.step(torch.ones(4, 2), target=torch.zeros(4, 1), on_nonfinite="raise")
    >>> pipe.clip_grad_norm_(1.0).shape
    torch.Size([])
"""

from __future__ import annotations

import logging

import torch

from conveyor.errors import NonFiniteError
from conveyor.options import WholeModel
from conveyor.parallel.clipping import (
    NormExchange,
    check_finite,
    describe_nonfinite,
    local_norms,
    local_part,
    nonfinite_flags,
    scale_local_grads,
)
from conveyor.parallel.tied import tied_copies_outside_their_first_stage
from conveyor.pipe.backend import RanksBackend
from conveyor.pipe.loss_scaling import StepLossScaling
from conveyor.runtime.stage.loss_scale import LossScaling
from conveyor.runtime.stage.main_grad import drop_gradients, gradient
from conveyor.runtime.stage.runner import StageRunner, named_unique
from conveyor.schedule.ir import Schedule

log = logging.getLogger("conveyor.pipe")


class GradientChecks:
    """Clipping and the non-finite check of a pipeline's gradients: this process's ``runners`` (by
    stage) of ``schedule``, combined across ranks by its ranks ``backend`` (a gather and an
    all-reduce over torch.distributed and its parts' groups, nothing to combine in one process).

    From ``model``: its tied parameters, whose copies the unsplit model counts on one stage only
    (:func:`~conveyor.parallel.tied.tied_copies_outside_their_first_stage`), and its parameter order
    (name -> index; None: stage by stage), which the total norm's rounding depends on.
    """

    def __init__(self, backend: RanksBackend, runners: dict[int, StageRunner], schedule: Schedule,
                 model: WholeModel, scaling: LossScaling | None = None) -> None:
        self.backend, self.runners, self.schedule = backend, runners, schedule
        # Built once the backend connected: replicas may have swapped the stages' Parameters.
        self.tied_copies = tied_copies_outside_their_first_stage(runners, model.tied_parameters)
        self.parameter_order = dict(model.parameter_order) if model.parameter_order is not None else None
        self.skipped_steps = 0  # steps dropped by on_nonfinite="skip"
        self.norm_exchange: NormExchange | None = None  # built on the first clip
        # fp16's loss scaling (StageOptions.loss_scaling; None: off): each step's gradients unscaled here.
        self.loss_scaling = None if scaling is None else StepLossScaling(scaling, self)

    def finish_step(self, on_nonfinite: str | None) -> None:
        """After a training step, on every rank alike. With loss scaling the gradients are unscaled, and the step
        is dropped if they overflowed on any rank, whatever ``on_nonfinite`` says (as ``GradScaler`` skips it:
        :mod:`conveyor.pipe.loss_scaling`). Otherwise ``on_nonfinite`` (the same on every rank): ``"raise"``
        raises :class:`NonFiniteError` naming the first microbatch whose loss and the stages whose gradients
        are not finite (the pipeline stays usable); ``"skip"`` drops the step's gradients instead
        (``optimizer.step()`` then leaves parameters and state as they were), logs a warning and counts it in
        ``skipped_steps``; None: no check."""
        if self.loss_scaling is not None:
            self.loss_scaling.finish_step(on_nonfinite)
        elif on_nonfinite is not None:
            report = self.backend.guarded(self._nonfinite_report)
            if report:
                self.after_nonfinite(report, on_nonfinite)

    @property
    def loss_scale(self) -> float | None:
        """The scale the next step's losses are multiplied by (None: no loss scaling); a host read."""
        return None if self.loss_scaling is None else self.loss_scaling.scale

    def parameters(self) -> list[torch.nn.Parameter]:
        """This process's parameters, shared ones once."""
        return [p for _, p in named_unique(self.runners, lambda m: m.named_parameters())]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
        """Clip the whole pipeline's gradients by their total norm; returns that norm on every rank.

        Equal, bit for bit, to ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
        on the unsplit model: every rank computes the same total norm from all ranks'
        gradients and scales its own by the same factor. The model's parameter order, which
        the norm's rounding depends on, is ``parameter_order`` (name -> index, which
        :func:`conveyor.pipeline` passes) or else stage by stage; a tied parameter counts once.
        Clipping with ``torch.nn.utils.clip_grad_norm_(pipe.parameters())`` instead would scale
        each rank by its own norm. A collective on a distributed pipeline: call it on every rank.
        ``foreach`` means what it means to torch and, like the other arguments, must be the
        same on every rank. Which parameters have gradients is exchanged on the first call
        only; later calls make no host round trip (see :meth:`forget_norm_layout`).
        ``error_if_nonfinite=True`` reads the total on the host (a synchronisation on a GPU).

        Example:
            >>> norm = pipe.gradient_checks.clip_grad_norm_(1.0)   # as pipe.clip_grad_norm_(1.0)   # doctest: +SKIP
        """
        norm_type = float(norm_type)
        total = self.backend.guarded(self._total_norm, norm_type, foreach)
        if error_if_nonfinite:
            check_finite(total, norm_type)  # the same total on every rank: all raise, none waits
        grads = [local_part(g) for g in map(gradient, self.parameters()) if g is not None]  # main_grad if any
        scale_local_grads(grads, max_norm, total, foreach)  # as torch's clip_grads_with_norm_, to the bit
        return total

    def forget_norm_layout(self) -> None:
        """Make the next clip exchange again which parameters have gradients.

        Call it on every rank after changing which parameters train (freezing some, say): the ranks
        agree on that once, so that later clips need no host round trip, and a rank whose parameters
        with gradients changed since raises until this is called.
        """
        if self.norm_exchange is not None:
            self.norm_exchange.forget()

    def _total_norm(self, norm_type: float, foreach: bool | None) -> torch.Tensor:
        places, grads, norms = local_norms(self.runners, self.tied_copies, self.parameter_order, norm_type,
                                           foreach, self.backend.parts)
        if self.norm_exchange is None:
            self.norm_exchange = self.backend.norm_exchange()  # over the ranks backend's collectives
        return self.norm_exchange.total(places, grads, norms, norm_type, foreach)

    def _nonfinite_report(self) -> str:
        """Empty, or where this step's loss or gradients stopped being finite (on every rank alike)."""
        flags = self.backend.combine_flags(nonfinite_flags(self.runners, self.schedule.num_stages,
                                                           self.schedule.num_microbatches, self.backend.device))
        return describe_nonfinite(flags)  # the one host read

    def after_nonfinite(self, report: str, on_nonfinite: str) -> None:
        """Raise (``"raise"``), or drop this step's gradients everywhere and count the step (``"skip"``)."""
        if on_nonfinite == "raise":
            raise NonFiniteError(f"this step's {report}; pass on_nonfinite='skip' to drop such steps")
        drop_gradients(self.parameters())  # the optimizer then leaves every parameter and its state as they are
        self.forget_norm_layout()  # every rank dropped its gradients alike: the layout changed everywhere
        self.skipped_steps += 1
        log.warning("conveyor: skipped a step: %s; gradients dropped (%d step(s) skipped so far)",
                    report, self.skipped_steps)

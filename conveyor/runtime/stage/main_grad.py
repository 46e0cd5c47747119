"""bf16 parameters with fp32 gradient accumulation across microbatches (Megatron's ``main_grad``).

``StageOptions(param_dtype="bf16")`` on a pipeline casts each stage module to bf16 (``module.to``, as
``model.to(torch.bfloat16)`` would: parameters and floating-point buffers), so forward and
backward run in bf16 and every activation crosses stages in bf16. Summing the microbatches'
gradients in bf16 would lose the small ones to rounding, so with ``grad_accum_dtype="fp32"``
(the default with a ``param_dtype``) each parameter gets an fp32 buffer ``param.main_grad``:
after each microbatch's weight gradient (a full B, or W after I: a hook on the parameter's
gradient accumulation, which fires once per engine run that reaches it), the bf16 gradient of
that microbatch is added into ``main_grad`` and ``.grad`` is dropped. Every built-in schedule
runs a stage's weight gradients in microbatch order, so the sum is, bit for bit, the one a single
device forms looping over microbatches (:class:`conveyor.testing.references.main_grad.MainGradReference`);
a custom schedule that reorders them, or a parameter two stages use (tied), gets it to rounding
(each use's bf16 gradient is added on its own, where one device sums them in bf16 first).
``param_dtype="fp16"`` works alike, its loss scaled (:mod:`conveyor.runtime.stage.loss_scale`, on by
default for fp16): each microbatch's scaled fp16 gradient lands in fp32 ``main_grad``, unscaled there
once per step; fp16 gradients summed in fp16 ``.grad`` (``grad_accum_dtype="none"``) are refused.

:class:`MasterWeights` is the optimizer side: fp32 master copies of the bf16 parameters, an
optimizer over them, ``main_grad`` as their gradient, and the rounded masters copied back into
the bf16 parameters after each step. Clipping and the non-finite check read ``main_grad``
where a parameter has one (:func:`gradient`), and tied copies on several ranks sum it.

Memory per parameter element: 2 bytes (bf16 parameter) + 4 (fp32 main_grad) + 4 (fp32
master) + the optimizer's state over the masters (AdamW: 8): 18 bytes, against 16 for fp32
parameters and gradients with AdamW; what it buys is bf16 compute and half the activation
bytes. :meth:`MasterWeights.memory` reports it per rank.

Checkpoints: ``conveyor.checkpoint.save(path, pipe, master_weights)`` saves the fp32 masters
in place of the bf16 parameters (under the model's names, so they reshard like any checkpoint)
and the inner optimizer's state keyed by those names; ``load`` with a :class:`MasterWeights`
fills the masters and rounds them into the parameters (without one, a bf16 pipeline gets the
same rounded values). ``save(path, pipe)`` alone saves the bf16 parameters. Not supported yet
(refused with a message): data parallelism (``data_parallel=``).

Example:
    >>> import torch, conveyor
    >>> pipe = conveyor.Pipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], "1f1b", microbatches=2,
    ...                          loss_fn=lambda y, t: (y.float() - t).pow(2).mean(),
    ...                          stage=conveyor.StageOptions(param_dtype="bf16"), layout=conveyor.InProcessLayout())
    >>> optimizer = conveyor.MasterWeights(pipe, torch.optim.AdamW, lr=1e-3)
    >>> loss = pipe.step(torch.ones(4, 4, dtype=torch.bfloat16), target=torch.zeros(4, 1))
    >>> p = next(pipe.parameters()); p.dtype, p.main_grad.dtype, p.grad
    (torch.bfloat16, torch.float32, None)
    >>> optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.errors import PipelineConfigError
from conveyor.runtime.stage.precision import DTYPE_NAMES, refuse_fp16

_HOOKED = "_conveyor_main_grad_dtype"  # on a parameter whose accumulation hook is registered: its dtype


@dataclass(frozen=True, slots=True)
class ParamPrecision:
    """The dtype stage parameters are kept in, and the dtype their gradients accumulate in
    across microbatches (``param.main_grad``; None: in ``.grad``, in the parameters' dtype)."""

    param_dtype: torch.dtype
    grad_accum_dtype: torch.dtype | None

    def describe(self) -> str:
        """A short text for the ranks' agreement and logs.

        Example:
            >>> ParamPrecision(torch.bfloat16, torch.float32).describe()
            'bfloat16 params, float32 main_grad'
        """
        accum = f"{_short(self.grad_accum_dtype)} main_grad" if self.grad_accum_dtype else "grads in .grad"
        return f"{_short(self.param_dtype)} params, {accum}"


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(spec: str | torch.dtype, what: str) -> torch.dtype:
    if isinstance(spec, torch.dtype) and spec.is_floating_point:
        return spec
    if isinstance(spec, str) and spec.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[spec.lower()]
    raise PipelineConfigError(f"{what}={spec!r} is not a floating-point dtype conveyor knows; use 'bf16', "
                              "'fp32' or a torch dtype")


def param_precision(param_dtype: str | torch.dtype | None, grad_accum_dtype: str | torch.dtype | None = None,
                    data_parallel: str | None = None) -> ParamPrecision | None:
    """What ``param_dtype=`` / ``grad_accum_dtype=`` ask for, checked; None: parameters as given.

    ``grad_accum_dtype`` defaults to fp32 when ``param_dtype`` is lower than fp32; ``"none"``
    keeps plain ``.grad`` accumulation in the parameters' dtype.

    Example:
        >>> param_precision("bf16")
        ParamPrecision(param_dtype=torch.bfloat16, grad_accum_dtype=torch.float32)
        >>> param_precision(None) is None
        True
    """
    if param_dtype is None:
        if grad_accum_dtype is not None:
            raise PipelineConfigError(f"grad_accum_dtype={grad_accum_dtype!r} needs param_dtype= (e.g. "
                                      "param_dtype='bf16'): with parameters as given, gradients accumulate in .grad")
        return None
    dtype = _dtype(param_dtype, "param_dtype")
    if isinstance(grad_accum_dtype, str) and grad_accum_dtype.lower() == "none":
        accum = None
    elif grad_accum_dtype is None:
        accum = torch.float32 if dtype.itemsize < 4 else None
    else:
        accum = _dtype(grad_accum_dtype, "grad_accum_dtype")
        if accum != torch.float32:
            raise PipelineConfigError(f"grad_accum_dtype={grad_accum_dtype!r}: gradients accumulate across "
                                      "microbatches in 'fp32' main_grad, or in .grad with 'none'")
    if dtype == torch.float16 and accum is None:  # fp16 weights train with loss scaling over fp32 main_grad
        refuse_fp16("grad_accum_dtype", grad_accum_dtype, "fp16 parameters would sum their scaled gradients in "
                    "fp16 .grad, where they overflow and which torch.amp.GradScaler refuses to unscale",
                    "leave grad_accum_dtype unset (fp32 main_grad, unscaled there)")
    if accum is not None and data_parallel is not None:
        raise PipelineConfigError(
            f"param_dtype={param_dtype!r} with gradients accumulated in {_short(accum)} main_grad does not "
            f"work with data_parallel={data_parallel!r} yet (the replicas' reduction reads .grad, not main_grad): "
            f"drop data_parallel=, or use autocast='{'fp16' if dtype == torch.float16 else 'bf16'}' with fp32 "
            "parameters, which data parallelism supports")
    return ParamPrecision(dtype, accum)


def apply_param_precision(module: torch.nn.Module, precision: ParamPrecision | None) -> None:
    """Cast ``module`` to the parameter dtype and hook every trainable parameter's gradient
    accumulation so that it lands in ``param.main_grad`` (once per parameter object).

    Example:
        >>> lin = torch.nn.Linear(2, 1)
        >>> apply_param_precision(lin, ParamPrecision(torch.bfloat16, torch.float32))
        >>> lin(torch.ones(3, 2, dtype=torch.bfloat16)).sum().backward()
        >>> lin.weight.main_grad.tolist(), lin.weight.grad
        ([[3.0, 3.0]], None)
    """
    if precision is None:
        return
    module.to(precision.param_dtype)  # keeps the Parameter objects (their .data changes)
    if precision.grad_accum_dtype is None:
        return
    for param in module.parameters():
        if param.requires_grad and not hasattr(param, _HOOKED):
            param.main_grad = None  # None until a microbatch's gradient arrives, as .grad
            param.register_post_accumulate_grad_hook(
                functools.partial(_accumulate, dtype=precision.grad_accum_dtype))
            setattr(param, _HOOKED, precision.grad_accum_dtype)


def _accumulate(param: torch.Tensor, dtype: torch.dtype) -> None:
    # .grad holds exactly this microbatch's gradient (it is None before every accumulation),
    # added in fp32: the bf16 -> fp32 conversion is exact, the sum is rounded once, in fp32.
    if param.main_grad is None:
        param.main_grad = torch.zeros_like(param, dtype=dtype)
    param.main_grad.add_(param.grad)
    param.grad = None


def has_main_grad(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient accumulates in ``param.main_grad`` (see :func:`apply_param_precision`).

    Example:
        >>> has_main_grad(torch.nn.Parameter(torch.ones(1)))
        False
    """
    return hasattr(param, "main_grad")


def gradient_attribute(param: torch.Tensor) -> str:
    """``"main_grad"`` where ``param`` accumulates there, else ``"grad"``: the gradient clipping,
    the non-finite check and tied copies' sum work on.

    Example:
        >>> gradient_attribute(torch.nn.Parameter(torch.ones(1)))
        'grad'
    """
    return "main_grad" if has_main_grad(param) else "grad"


def gradient(param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s accumulated gradient: ``main_grad`` where it has one, else ``.grad``.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)
        >>> gradient(p).tolist()
        [1.0, 1.0]
    """
    return getattr(param, gradient_attribute(param))


def drop_gradients(params: Iterable[torch.Tensor]) -> None:
    """Set every gradient of ``params`` (``.grad`` and ``main_grad``) to None: the optimizer then
    leaves them and their state as they are.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2); drop_gradients([p]); p.grad
    """
    for param in params:
        param.grad = None
        if has_main_grad(param):
            param.main_grad = None


@dataclass(frozen=True, slots=True)
class ParameterMemory:
    """One rank's bytes of parameters and what trains them (see :meth:`MasterWeights.memory`).

    ``main_grad_bytes`` is what a step holds (every trainable parameter's buffer), whether or
    not the buffers exist right now; ``optimizer_bytes`` the optimizer's state tensors as they
    are (none before its first step).
    """

    param_bytes: int
    main_grad_bytes: int
    master_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.main_grad_bytes + self.master_bytes + self.optimizer_bytes


class MasterWeights:
    """An optimizer over fp32 master copies of a pipeline's low-precision parameters.

    ``pipe``: a pipeline built with ``param_dtype=`` (or anything with ``runners``);
    ``optimizer_cls(masters, **kwargs)`` builds the inner optimizer (``self.optimizer``: give it
    to an LR scheduler). The masters start as the parameters' values in fp32 (build this after
    loading weights). :meth:`step` hands each master its parameter's ``main_grad`` (None where a
    parameter got no gradient, or the step was skipped: the optimizer leaves it alone), steps,
    and copies the masters, rounded, into the parameters; :meth:`zero_grad` clears ``main_grad``.

    Example:
        >>> import torch, conveyor
        >>> pipe = conveyor.Pipeline([torch.nn.Linear(2, 1)], "gpipe", microbatches=1,
        ...                          loss_fn=lambda y, t: y.float().sum(),
        ...                          stage=conveyor.StageOptions(param_dtype="bf16"), layout=conveyor.InProcessLayout())
        >>> optimizer = conveyor.MasterWeights(pipe, torch.optim.SGD, lr=0.5)
        >>> _ = pipe.step(torch.ones(1, 2, dtype=torch.bfloat16), target=None)
        >>> before = optimizer.masters[0].clone(); optimizer.step()
        >>> torch.equal(optimizer.masters[0], before - 0.5), optimizer.params[0].dtype
        (True, torch.bfloat16)
    """

    def __init__(self, pipe: Any, optimizer_cls: Callable[..., torch.optim.Optimizer], **kwargs: Any) -> None:
        self.pipe = pipe
        self.names, self.params, self.ranks = [], [], []
        for rank, name, param in _every_parameter(pipe):
            if param.requires_grad:
                self.names.append(name)
                self.params.append(param)
                self.ranks.append(rank)
        missing = [n for n, p in zip(self.names, self.params) if not has_main_grad(p)]
        if missing:
            raise PipelineConfigError(
                f"MasterWeights needs parameters that accumulate in main_grad; {missing[0]!r} (and "
                f"{len(missing) - 1} more) do not: build the pipeline with stage=StageOptions(param_dtype='bf16') (its "
                "grad_accum_dtype defaults to fp32), or use a plain torch optimizer over pipe.parameters()")
        self.masters = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.params]
        self.optimizer = optimizer_cls(self.masters, **kwargs)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        """main_grad -> master.grad; the inner optimizer's step; masters rounded into the parameters."""
        for param, master in zip(self.params, self.masters):
            master.grad = param.main_grad  # shared, not copied: clipping already scaled it in place
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        self.copy_to_params()

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Each parameter becomes its master rounded to the parameter's dtype (nearest even, as ``.to``)."""
        for param, master in zip(self.params, self.masters):
            param.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every ``main_grad`` (None, or zeros with ``set_to_none=False``) and ``.grad``."""
        for param, master in zip(self.params, self.masters):
            param.grad = master.grad = None
            if set_to_none or param.main_grad is None:
                param.main_grad = None
            else:
                param.main_grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The masters and the inner optimizer's state, keyed by parameter name (this process's)."""
        return {"masters": {n: m.detach().clone() for n, m in zip(self.names, self.masters)},
                "optimizer": self.optimizer.state_dict(), "names": list(self.names)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s masters and optimizer state; the parameters become the rounded masters."""
        if state["names"] != self.names:
            raise PipelineConfigError(
                f"this MasterWeights holds {len(self.names)} parameters ({self.names[:3]}...), the state "
                f"{len(state['names'])} ({state['names'][:3]}...): load the state saved by the same rank of "
                "the same pipeline layout")
        for name, master in zip(self.names, self.masters):
            master.copy_(state["masters"][name])
        self.copy_to_params()
        self.optimizer.load_state_dict(state["optimizer"])

    def memory(self) -> dict[int, ParameterMemory]:
        """Per rank of this process: bytes of parameters, main_grad buffers, masters and optimizer state.

        Example:
            >>> {rank: m.total_bytes for rank, m in optimizer.memory().items()}   # doctest: +SKIP
            {0: 1234, 1: 1234}
        """
        sizes: dict[int, list[int]] = {}
        for rank, _, param in _every_parameter(self.pipe):
            sizes.setdefault(rank, [0, 0, 0, 0])[0] += param.numel() * param.element_size()
        for param, master, rank in zip(self.params, self.masters, self.ranks):
            entry = sizes.setdefault(rank, [0, 0, 0, 0])
            entry[1] += param.numel() * getattr(param, _HOOKED).itemsize
            entry[2] += master.numel() * master.element_size()
            for value in self.optimizer.state.get(master, {}).values():
                if isinstance(value, torch.Tensor):
                    entry[3] += value.numel() * value.element_size()
        return {rank: ParameterMemory(*sizes[rank]) for rank in sorted(sizes)}


def _every_parameter(pipe: Any) -> Iterator[tuple[int, str, torch.nn.Parameter]]:
    """(rank, name, parameter) of every stage of ``pipe`` in this process, each parameter once,
    under the names ``pipe.named_parameters()`` gives them."""
    rank_of: dict[int, int] = {}
    for stage in sorted(pipe.runners):
        for param in pipe.runners[stage].module.parameters():
            rank_of.setdefault(id(param), pipe.runners[stage].rank)  # a tied one where it is first used
    for name, param in pipe.named_parameters():
        yield rank_of[id(param)], name, param

"""``compile=``: each stage's forward compiled once with ``torch.compile``.

What the option takes: ``False`` / ``None`` (eager, the default), ``True`` (torch's defaults:
inductor, ``dynamic=None``), or a dict of ``torch.compile`` keywords (``backend``, ``mode``,
``dynamic``, ``fullgraph``, ``options``, ``disable``), the same for every stage.

How it composes with the rest of a stage:

* **Shapes that change.** With torch's default ``dynamic=None`` a stage compiles for the
  first shapes it sees; the first microbatch whose sequence length (or batch size: an uneven
  last microbatch) differs recompiles it once with that dimension dynamic, and later lengths
  reuse that graph. ``{"dynamic": True}`` compiles dynamic from the start (one compile);
  ``{"dynamic": False}`` compiles every new shape anew until torch's
  ``torch._dynamo.config.recompile_limit``, after which torch runs the stage eagerly and warns.
* **Recompile budget per stage.** Stages of one class share their ``forward``'s code, and
  torch counts recompiles per code object: four hand-built stages of one class, each
  compiled static, then dynamic, then in eval mode, would exhaust the shared limit of 8 and
  fall back to eager. So each stage is compiled through a function of its own, named
  ``conveyor_stage_<s>`` (the name torch's recompile logs show), and counts its own.
* **Autocast** (``autocast=``): the compiled call runs inside the stage's autocast region;
  dynamo traces the region's state, as for ``torch.compile(model)`` under ``torch.autocast``.
* **Recomputation** (``recompute=True``): ``torch.utils.checkpoint``
  wraps the compiled forward; backward runs the compiled forward again to rebuild what it
  saved, then the compiled backward. The recomputation is a second call of the compiled
  code, not a recompute inside one compiled graph (torch's partitioner does that only for a
  checkpoint traced inside the compiled region, which would lose conveyor's buffer handling:
  see :mod:`conveyor.runtime.stage.recomputed_buffers`).
* **Data parallelism** (``data_parallel="ddp"`` / ``"fsdp"``): FSDP2 wraps the stage module in
  place, and the compiled call goes through it (its hooks included).
* **The I/W split** (zero-bubble schedules): a compiled region's backward is one graph
  (AOTAutograd) that computes its inputs' and its weights' gradients together, so it cannot
  be cut in two. Where such a region sits between a stage's inputs and its weights, that
  stage's I runs the full backward and its W has nothing left to do (logged once per stage;
  see :func:`conveyor.runtime.stage.backward.backward_input`). Stage 0, whose inputs carry no
  gradient, keeps its split (I is empty, W runs the backward).

Example:
    >>> import torch
    >>> compile_options(True), compile_options(False), compile_options({"backend": "aot_eager"})
    ({}, None, {'backend': 'aot_eager'})
    >>> stage = compile_stage(torch.nn.Linear(2, 2), 0, {"backend": "eager"})
    >>> stage(torch.ones(1, 2)).shape
    torch.Size([1, 2])
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from conveyor.errors import PipelineConfigError

# torch.compile's keywords besides the model.
_KEYWORDS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")

CompileSpec = bool | Mapping[str, Any] | None


def compile_options(spec: CompileSpec) -> dict[str, Any] | None:
    """The ``torch.compile`` keywords a ``compile=`` argument asks for, or None for eager stages.

    Example:
        >>> compile_options({"mode": "max-autotune", "dynamic": True})
        {'mode': 'max-autotune', 'dynamic': True}
    """
    if spec is None or spec is False:
        return None
    if spec is True:
        return {}
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(_KEYWORDS))
        if unknown:
            raise PipelineConfigError(
                f"compile= got {unknown}, which torch.compile does not take; use only {list(_KEYWORDS)} "
                "(e.g. compile={'backend': 'inductor', 'mode': 'max-autotune', 'dynamic': True})"
            )
        return dict(spec)
    raise PipelineConfigError(
        f"compile= takes True, False or a dict of torch.compile keywords; got {type(spec).__name__} {spec!r}"
    )


def describe_compile(spec: CompileSpec) -> str:
    """A short, stable description of a ``compile=`` argument (what ranks compare when they agree).

    Example:
        >>> describe_compile(None), describe_compile({"dynamic": True, "backend": "aot_eager"})
        ('off', "backend='aot_eager' dynamic=True")
    """
    options = compile_options(spec)
    if options is None:
        return "off"
    return " ".join(f"{key}={_stable(options[key])}" for key in sorted(options)) or "torch defaults"


def _stable(value: Any) -> str:
    # A backend given as a function: its name, not its address (which differs between processes).
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return repr(value)


def compile_stage(module: torch.nn.Module, stage: int, options: Mapping[str, Any]) -> Callable[..., Any]:
    """``module`` called through ``torch.compile`` with ``options``, under a code object of its own.

    The module itself is left as it is (names, ``state_dict``, hooks): only calls through the
    returned function are compiled, lazily, at the first call.

    Example:
        >>> fn = compile_stage(torch.nn.Linear(2, 2), 3, {"backend": "eager"})
        >>> fn.__wrapped__.__code__.co_name
        'conveyor_stage_3'
    """
    def call(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    name = f"conveyor_stage_{stage}"
    # A new code object: torch keeps compiled graphs and counts recompiles per code object.
    own = types.FunctionType(call.__code__.replace(co_name=name, co_qualname=name), call.__globals__, name,
                             call.__defaults__, call.__closure__)
    try:
        compiled = torch.compile(own, **options)
    except Exception as exc:
        raise PipelineConfigError(
            f"torch.compile refused the options {dict(options)} for stage {stage}: {type(exc).__name__}: {exc}; "
            "pass compile=True for torch's defaults or fix the named option"
        ) from exc
    compiled.__wrapped__ = own
    return compiled

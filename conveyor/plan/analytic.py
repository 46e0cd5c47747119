"""Unit costs from a cost model, for models too large to run here (a 70B config on the meta device).

No tracing and no allocation: the units are found from the module tree (the children of
the outermost block containers, and the modules around them, in registration order, which is
execution order for the transformers models), and each unit's costs come from its parameter
shapes and the microbatch's tokens:

- FLOPs: 2 x tokens x (weights of its ``nn.Linear`` modules) for F, the same again for I and
  for W; attention adds 4 x tokens x seq x width to F and 8 x tokens x seq x width to I (no
  weights, so nothing to W); a unit without linear layers (an embedding's lookup, a norm) moves
  bytes at ``bytes_per_second`` instead;
- activations (the tensors a transformer block keeps for backward): each ``nn.Linear``'s input
  (``in_features`` per token, what W needs after I), plus ``6 x width`` per token for the norms,
  attention and residuals;
- seconds = FLOPs / ``flops_per_second`` (a device constant: the sustained throughput).
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.errors import PlanError
from conveyor.frontend.units import module_units
from conveyor.plan.costs import CostTable, UnitCost
from conveyor.plan.settings import DEFAULT_BYTES_PER_SECOND, DEFAULT_FLOPS_PER_SECOND


def analytic_units(model: nn.Module, *, microbatch_size: int, seq_len: int,
                   flops_per_second: float = DEFAULT_FLOPS_PER_SECOND,
                   bytes_per_second: float = DEFAULT_BYTES_PER_SECOND,
                   dtype: torch.dtype | None = None) -> CostTable:
    """Costs of every unit of ``model`` (any device, meta included) for ``microbatch_size`` sequences
    of ``seq_len`` tokens; ``dtype`` sizes parameters and activations (default: the parameters').

    Example:
        >>> blocks = nn.Sequential(nn.Embedding(100, 16), *[nn.Linear(16, 16) for _ in range(2)])
        >>> table = analytic_units(blocks, microbatch_size=2, seq_len=8, flops_per_second=1e9)
        >>> [unit.name for unit in table.units], table.units[1].forward
        (['0', '1', '2'], 8.192e-06)
    """
    if microbatch_size < 1 or seq_len < 1 or flops_per_second <= 0 or bytes_per_second <= 0:
        raise PlanError(f"analytic_units needs microbatch_size, seq_len >= 1 and positive throughputs; got "
                        f"microbatch_size={microbatch_size}, seq_len={seq_len}, flops_per_second={flops_per_second}, "
                        f"bytes_per_second={bytes_per_second}")
    units = [unit for unit in module_units(model) if any(True for _ in unit[1].parameters()) or unit[2]]
    if len(units) < 2:
        raise PlanError(f"{type(model).__name__} has {len(units)} unit(s) with parameters; a plan needs at least 2")
    tokens = microbatch_size * seq_len
    width = _width(model)
    seen: set[int] = set()
    out = []
    for name, module, is_block in units:
        params = [p for p in module.parameters() if id(p) not in seen]
        element = (torch.empty((), dtype=dtype).element_size() if dtype is not None
                   else params[0].element_size() if params else 4)
        count = sum(p.numel() for p in module.parameters())
        seen.update(id(p) for p in params)
        linear_weights = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))
        linear_inputs = sum(m.in_features for m in module.modules() if isinstance(m, nn.Linear))
        attention = is_block and _has_attention(module)
        flops = 2.0 * tokens * linear_weights
        attention_flops = 4.0 * tokens * seq_len * width if attention else 0.0
        forward = (flops + attention_flops) / flops_per_second
        backward_input = (flops + 2 * attention_flops) / flops_per_second
        backward_weight = flops / flops_per_second
        kept_for_weights = float(tokens * linear_inputs * element)
        activations = kept_for_weights + (6.0 * tokens * width * element if is_block else 0.0)
        if not linear_weights:  # memory-bound: an embedding's lookup, a norm
            moved = 2.0 * tokens * width * element
            forward = backward_input = moved / bytes_per_second
            backward_weight = (moved + count * element) / bytes_per_second
            activations = kept_for_weights = float(tokens * width * element)
            if isinstance(module, nn.Embedding):
                # Its input is the ids: no input gradient; W scatters into the whole table's gradient.
                backward_input, activations, kept_for_weights = 0.0, float(tokens * 8), float(tokens * 8)
        out.append(UnitCost(name, forward, backward_input, backward_weight, activations, kept_for_weights,
                            float(count * element), float(count), float(tokens * width * element), is_block))
    return CostTable(tuple(out), microbatch_size, source=f"analytic ({flops_per_second:.3g} FLOP/s)")


def _width(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for key in ("hidden_size", "n_embd", "d_model"):
        if config is not None and isinstance(getattr(config, key, None), int):
            return int(getattr(config, key))
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None:
        return embedding.embedding_dim
    linear = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    return linear.in_features if linear is not None else 1


def _has_attention(module: nn.Module) -> bool:
    return any("attn" in name.lower() or "attention" in name.lower() for name, _ in module.named_modules())

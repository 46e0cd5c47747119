"""``conveyor train CONFIG --dry-run``: the run's split and memory per rank, with nothing allocated.

In the launcher process, without starting a rank: the model is built on the meta device
(shapes, no storage), traced and cut into the configured stages by the very call a run makes
(``conveyor.frontend.split_model`` with the schedule's stage count and ``split_method=
"parameters"``, as :func:`conveyor.train.loop.build_pipeline` does), and for each stage the
table gives its rank, its first and last module, its blocks and parameters. Memory per rank is
predicted as

* parameters, gradients and AdamW's two moments, all fp32: 16 bytes per parameter of the
  rank's stages (``fsdp`` shards them over the ``dp`` replicas but gathers one stage whole
  while it runs);
* activations: each stage's forward on one microbatch is run on the meta device under
  ``torch.autograd.graph.saved_tensors_hooks``, which sees every tensor autograd keeps for the
  backward (parameters left out; the last stage's loss included; with checkpointing
  (``stage.recompute``: the whole stage, or a policy per stage) the stage runs
  with its policy applied as a rank applies it, so what is counted is what the checkpoints keep,
  the outputs a selective policy saves included, plus, once per rank, the set one checkpointed
  region rebuilds while it is recomputed: the whole stage's, or one block's share). The schedule
  simulator (``conveyor.schedule.simulate``, uniform pass costs) weighs each (stage, microbatch)
  in flight with those bytes and gives each rank's peak.

Not counted: the framework itself (~0.4 GiB per rank on CPU), communication buffers,
allocator slack, the data.

Example:
    >>> from conveyor.train.config import load_config
    >>> cfg = load_config(None, ["model.layers=2", "model.width=32", "model.seq_len=16"])
    >>> layout = run_layout(cfg)
    >>> [(row.stage, row.rank) for row in layout.stages], layout.total_parameters
    ([(0, 0), (1, 1)], 34176)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.frontend.stage import as_received
from conveyor.options import RecomputePolicy, StageOptions
from conveyor.plan.profile import SavedTensorBytes
from conveyor.train.config import TrainConfig

BYTES_PER_PARAMETER = 16  # fp32: the parameter, its gradient, AdamW's exp_avg and exp_avg_sq
_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")  # a module path down to its first numbered part: a block


@dataclass
class StageRow:
    """One stage of the split: where it runs, what it holds, what one microbatch keeps for backward."""

    stage: int
    rank: int
    first: str
    last: str
    blocks: int
    parameters: int
    activation_bytes: int  # what one microbatch keeps until its backward (checkpointed: the inputs)
    recompute_bytes: int  # what one checkpointed region of the stage rebuilds in backward (0: none)
    local_parameters: int = -1  # on one tensor-parallel rank (parallel.tp > 1); -1: all of ``parameters``
    shards: list = field(default_factory=list)  # its parameters' shards on one TP rank (tensor_parallel.Shard)

    @property
    def held(self) -> int:
        """Parameters one rank of this stage holds: its TP shard's, else all of them."""
        return self.parameters if self.local_parameters < 0 else self.local_parameters


@dataclass
class RankRow:
    """One rank's predicted memory (bytes), with the schedule's peak in-flight microbatch-stages."""

    rank: int
    state_bytes: int
    activation_bytes: int  # the schedule's peak of kept activations, plus recompute_bytes
    in_flight: int
    recompute_bytes: int = 0  # the largest region of the rank's stages rebuilt in backward, at the peak

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


@dataclass
class RunLayout:
    """What :func:`run_layout` found: the model, the split per stage, the memory per rank."""

    model_class: str
    total_parameters: int
    stages: list[StageRow] = field(default_factory=list)
    ranks: list[RankRow] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)  # with parallel.ep: what each rank keeps (expert_shards)


def run_layout(cfg: TrainConfig) -> RunLayout:
    """The split and the memory per rank of the run ``cfg`` describes, computed on the meta device.

    Example:
        >>> from conveyor.train.config import load_config
        >>> layout = run_layout(load_config(None, ["model.name=llama", "model.layers=2", "model.width=32"]))
        >>> layout.stages[0].first, layout.stages[1].last
        ('model.embed_tokens', 'lm_head')
    """
    from conveyor.frontend import split_model
    from conveyor.schedule.registry import resolve_schedule
    from conveyor.train.models import meta_model

    model = meta_model(cfg)
    p = cfg.parallel
    schedule = resolve_schedule(p.schedule, p.microbatches, p.virtual, p.pp)
    example = torch.zeros(cfg.replica_batch_size // p.microbatches, cfg.model.seq_len, dtype=torch.long)
    split_points = list(cfg.plan.split_points) if cfg.plan else None  # the cut the run will make
    split = split_model(model, schedule.num_stages, example_args=(example,), split_method="parameters",
                        split_points=split_points)
    sizes = {name: t.numel() for name, t in model.named_parameters(remove_duplicate=False)}
    saved = activation_bytes(split, example, cfg.stage)
    layout = RunLayout(type(model).__name__, sum(t.numel() for t in model.parameters()),
                   tied=[" = ".join(group.names) for group in split.tied_groups])
    for stage in range(split.num_stages):
        names = split.stage_parameter_names(stage)
        modules = [_block_of(name) for name in names] or ["(no parameters)"]
        blocks = {m for m in modules if _BLOCK.match(m + ".")}
        layout.stages.append(StageRow(stage, schedule.placement.rank_of(stage), modules[0], modules[-1], len(blocks),
                                    sum(sizes[name] for name in names), *saved[stage]))
    if p.tp > 1:
        _add_shards(cfg, model, split, layout.stages)
    if p.ep != 1:
        from conveyor.train.expert_shards import expert_shard_lines

        layout.experts = expert_shard_lines(cfg, model, split, schedule)
    layout.ranks = _rank_memory(cfg, schedule, layout.stages)
    return layout


def _add_shards(cfg: TrainConfig, model: torch.nn.Module, split: Any, stages: list[StageRow]) -> None:
    """Each stage's parameters as one TP rank holds them, placed as the pipeline places them (the same plan)."""
    from conveyor.train.tensor_parallel import model_placements_for, parameter_shards

    placements = model_placements_for(cfg, model, split.tied_groups)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    for row in stages:
        names = split.stage_parameter_names(row.stage)
        row.shards = parameter_shards([(name, tensors[name]) for name in names], placements, cfg.parallel.tp)
        row.local_parameters = sum(shard.local_bytes // tensors[shard.name].element_size() for shard in row.shards)


def _block_of(name: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``; ``lm_head.weight`` -> ``lm_head``."""
    module = name.rsplit(".", 1)[0] if "." in name else name
    match = _BLOCK.match(module + ".")
    return match.group(1) if match else module


def activation_bytes(split: Any, example: torch.Tensor, options: StageOptions) -> list[tuple[int, int]]:
    """Per stage, the bytes autograd keeps for the backward of one microbatch (parameters excluded):
    ``(kept, recompute)``, where ``kept`` is what the stage keeps under its checkpoint policy in
    ``options`` (everything without one) and ``recompute`` what one of its checkpointed regions
    rebuilds in backward (0 without a policy).

    Every stage runs on the meta device, in order, each on what the one before returned, the
    last with the training loss; no storage is allocated.
    """
    inputs: tuple = (example.to("meta"),)
    target = torch.zeros(example.shape, dtype=torch.long, device="meta")
    found = []
    for stage in range(split.num_stages):
        module = split.stage_module(stage, "meta")
        last = stage == split.num_stages - 1
        output, full = _saved_by(module, inputs, target if last else None)
        found.append(_checkpointed_bytes(split, stage, inputs, target if last else None, full,
                                         options.recompute_policy(stage, split.num_stages)))
        if not last:
            # What the next rank receives: fresh leaves (the graph behind them stays on this stage).
            inputs = tuple(as_received(v) for v in (output if isinstance(output, tuple) else (output,)))
    return found


def _checkpointed_bytes(split: Any, stage: int, inputs: tuple, target: torch.Tensor | None, full: int,
                        policy: RecomputePolicy | None) -> tuple[int, int]:
    """``(kept, recompute)`` of one stage under ``policy``, applied to a fresh meta copy of the stage."""
    from conveyor.runtime.stage.recompute import StageRecompute

    if policy is None:
        return full, 0
    module = split.stage_module(stage, "meta")
    saved = SavedTensorBytes(module)
    checkpointing = StageRecompute(module, policy, hold=lambda: saved.pack, stage=stage)
    call = checkpointing.checkpointed(module) if checkpointing.whole_stage else module
    kept = _saved_by(module, inputs, target, call=call, saved=saved)[1]
    if checkpointing.whole_stage:
        return kept, full  # the whole stage rebuilt in its backward
    # Per block: what the checkpointed blocks do not keep, rebuilt one block at a time.
    return kept, max(full - kept, 0) // len(checkpointing.blocks)


def _saved_by(module: torch.nn.Module, inputs: tuple, target: torch.Tensor | None, *,
              call: Any = None, saved: SavedTensorBytes | None = None) -> tuple[Any, int]:
    """The stage's output on ``inputs`` and the bytes autograd saved for it (with the loss, given a
    target), running it as ``call`` (default: the module) and counting with ``saved`` (default: a new counter)."""
    from conveyor.train.loop import lm_loss

    saved = saved if saved is not None else SavedTensorBytes(module)
    with saved, _CpuAttention():
        output = (call or module)(*inputs)
        if target is not None:
            lm_loss()(output, target)
    return output, saved.bytes


class _CpuAttention(torch.overrides.TorchFunctionMode):
    """``scaled_dot_product_attention`` as a CPU rank runs it (the fused kernel, which keeps the
    log-sum-exp), not as meta tensors would (the math path, keeping the seq x seq probabilities)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not torch.ops.aten.scaled_dot_product_attention.default:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        options = {**dict(zip(("attn_mask", "dropout_p", "is_causal"), rest)), **kwargs}
        if options.get("enable_gqa") and key.shape[-3] != query.shape[-3]:
            # Grouped-query attention: the fused CPU kernel is sized as if each query head had its own.
            repeats = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, options.get("dropout_p", 0.0), options.get("is_causal", False),
            attn_mask=options.get("attn_mask"), scale=options.get("scale"))[0]


def _rank_memory(cfg: TrainConfig, schedule: Any, stages: list[StageRow]) -> list[RankRow]:
    import conveyor.schedule as cs

    costs = cs.CostModel(tuple(cs.StageCosts(1.0, 1.0, 1.0, float(row.activation_bytes)) for row in stages))
    timeline = cs.simulate(schedule, costs)
    peak_bytes, peak_count = timeline.peak_activation_bytes(), timeline.peak_activations()
    dp, fsdp = cfg.parallel.dp, cfg.parallel.data_parallel == "fsdp" and cfg.parallel.dp > 1
    rows = []
    for rank in range(schedule.num_ranks):
        mine = [row for row in stages if row.rank == rank]
        parameters = sum(row.held for row in mine)
        state = BYTES_PER_PARAMETER * parameters
        if fsdp:
            # Shards, plus every stage of the rank gathered for the whole step (conveyor gathers
            # once per step, not per microbatch) and its gradients whole until their reduce-scatter.
            state = state // dp + 8 * parameters
        extra = max((row.recompute_bytes for row in mine), default=0)  # one region recomputed at a time
        rows.append(RankRow(rank, state, int(peak_bytes[rank]) + extra, peak_count[rank], extra))
    return rows


def format_layout(layout: RunLayout, cfg: TrainConfig) -> str:
    """The dry run's text: a header, the stage table, the rank table, how memory was estimated.

    Example:
        >>> from conveyor.train.config import load_config
        >>> cfg = load_config(None, ["model.layers=2", "model.width=32", "model.seq_len=16"])
        >>> print(format_layout(run_layout(cfg), cfg).splitlines()[0])  # doctest: +ELLIPSIS
        conveyor train --dry-run: GPT2LMHeadModel, 34,176 parameters (0.00B); pp=2 x dp=1, schedule 1f1b...
    """
    p = cfg.parallel
    micro = cfg.replica_batch_size // p.microbatches
    lines = [f"conveyor train --dry-run: {layout.model_class}, {layout.total_parameters:,} parameters "
             f"({layout.total_parameters / 1e9:.2f}B); pp={p.pp} x dp={p.dp}{f' x tp={p.tp}' if p.tp > 1 else ''}"
             f"{f' (ep={p.ep})' if p.ep != 1 else ''}, "
             f"schedule {p.schedule}, "
             f"{len(layout.stages)} stages, {p.microbatches} microbatches of {micro} x {cfg.model.seq_len} tokens"]
    width = max(len(r.first) for r in layout.stages) + 2
    lines.append(f"{'stage':>5}  {'rank':>4}  {'first module':<{width}}{'last module':<{width}}{'blocks':>6}  "
                 f"{'parameters':>14}  {'kept/microbatch':>16}")
    lines += [f"{r.stage:>5}  {r.rank:>4}  {r.first:<{width}}{r.last:<{width}}{r.blocks:>6}  "
              f"{r.parameters:>14,}  {_gib(r.activation_bytes):>16}" for r in layout.stages]
    lines.append(f"{'rank':>5}  {'params+grads+AdamW':>18}  {'in flight':>9}  {'activations':>11}  {'total':>9}")
    lines += [f"{r.rank:>5}  {_gib(r.state_bytes):>18}  {r.in_flight:>9}  {_gib(r.activation_bytes):>11}  "
              f"{_gib(r.total_bytes):>9}" for r in layout.ranks]
    if layout.tied:
        lines.append("tied: " + "; ".join(layout.tied) + " (each stage holding it keeps a copy)")
    if p.tp > 1:
        lines += shard_lines(layout, cfg)
    lines += layout.experts
    sharded = p.data_parallel == "fsdp" and p.dp > 1
    lines += [
        "memory per rank = parameters, gradients and AdamW's two moments in fp32 (16 bytes per parameter"
        + ("; fsdp: sharded over the dp replicas, plus the rank's stages gathered with whole gradients for the step"
           if sharded else "") + ")",
        "  + activations: what autograd keeps for one microbatch of each stage, measured by running its forward "
        "on the meta device" + (f"; with recomputation ({_policies(cfg)}), what the recomputed regions keep, plus "
                                "one region's set while it is recomputed" if cfg.stage.recompute else ""),
        "    x the microbatches in flight at the peak of the schedule's simulation (uniform pass costs)",
        "  not counted: the framework (~0.4 GiB per rank on CPU), communication buffers, the data",
        *(["  with tp: parameters, gradients and AdamW state are each TP rank's shards (above); activations are "
           "the whole stage's, an upper bound (TP splits those inside attention and the MLP)"] if p.tp > 1 else []),
        "nothing was allocated and no rank was started",
    ]
    return "\n".join(lines)


def global_ranks(parallel: Any, pipeline_rank: int) -> list[int]:
    """The global ranks holding pipeline rank ``pipeline_rank``'s stages on the ("pp", "dp", "tp") mesh, tp innermost.

    Example:
        >>> from types import SimpleNamespace
        >>> global_ranks(SimpleNamespace(pp=2, dp=2, tp=2), 1)
        [4, 5, 6, 7]
    """
    per_stage = parallel.dp * parallel.tp
    return list(range(pipeline_rank * per_stage, (pipeline_rank + 1) * per_stage))


def shard_lines(layout: RunLayout, cfg: TrainConfig) -> list[str]:
    """Each pipeline rank's parameters as one of its TP ranks holds them: name pattern (blocks as ``*``), how
    many, whole shape, placement, local shape, local bytes; and the rank's bytes against the whole stage's."""
    from conveyor.parallel.mesh import mesh_dims

    p = cfg.parallel
    mesh = " x ".join(f"{name}={size}" for name, size in mesh_dims(p.pp, p.dp, p.tp))
    lines = [f"tensor parallel: tp={p.tp} on the mesh {mesh} (tp innermost: a stage's TP ranks are consecutive "
             f"global ranks, inside one node); the parameters one TP rank holds:"]
    for rank in sorted({row.rank for row in layout.stages}):
        shards = [shard for row in layout.stages if row.rank == rank for shard in row.shards]
        whole = sum(math.prod(s.shape) * (s.local_bytes // max(1, math.prod(s.local_shape))) for s in shards)
        local = sum(s.local_bytes for s in shards)
        lines.append(f"  pipeline rank {rank} (global ranks {', '.join(map(str, global_ranks(p, rank)))}): "
                     f"{_gib(local)} of its stages' {_gib(whole)} of parameters on each")
        groups: dict[tuple, list] = {}
        for s in shards:
            key = (re.sub(r"\.\d+\.", ".*.", s.name), s.shape, s.placement, s.local_shape)
            groups.setdefault(key, []).append(s.local_bytes)
        width = max(len(key[0]) for key in groups) + 2
        for (pattern, shape, placement, local_shape), sizes in groups.items():
            lines.append(f"    {pattern:<{width}}x{len(sizes):<4}{str(shape):<16}{placement:<13}-> "
                         f"{str(local_shape):<16}{_gib(sum(sizes)):>12}")
    return lines


def _policies(cfg: TrainConfig) -> str:
    policies = cfg.stage.recompute
    if isinstance(policies, tuple):
        return "; ".join(f"stage {s}: {p.describe() if p else 'none'}" for s, p in enumerate(policies))
    return f"every stage: {policies.describe()}"


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**26 else f"{size / 2**20:.2f} MiB"


def dry_run(cfg: TrainConfig) -> int:
    """Print the split and the memory per rank of the run ``cfg`` describes; returns 0 (the exit status).

    Example:
        >>> from conveyor.train.config import load_config
        >>> dry_run(load_config(None, ["model.layers=2", "model.width=32"]))  # doctest: +ELLIPSIS
        conveyor train --dry-run: GPT2LMHeadModel, ...
        0
    """
    print(format_layout(run_layout(cfg), cfg))
    return 0

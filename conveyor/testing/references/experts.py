"""Rank functions of the expert-parallel tests: pp=2 x dp=2 on 4 gloo ranks, the experts over ep=2.

Each rank's stages hold half of every experts module (ep=2 over the two replicas). References:

- **EP alone** (:func:`train_ep_alone`): the whole model, unpiped, its experts sharded the same way
  over this rank's two replicas, each replica accumulating its own microbatches in order (loss / M),
  then the dense gradients' and the losses' replica mean (summed, halved: exact) and the expert
  shards' gradients halved. The pipeline must equal it bit for bit: the same kernels on the same
  rows, each microbatch's all-to-all pairing the same two replicas' same microbatch.
- **one device** (:func:`train_one_device`): the whole model, whole experts, every replica's
  microbatches accumulated in one process (loss / (M x dp)), replica by replica.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.layout import DistributedLayout, Layout
from conveyor.options import PipelineOptions, TransferOptions
from conveyor.parallel.clipping import local_part
from conveyor.parallel.experts.discover import find_experts
from conveyor.parallel.experts.part import _dispatched_forward, shard_experts
from conveyor.parallel.part import reduced_by
from conveyor.testing.compare import relative_difference, worst_absolute, worst_relative
from conveyor.testing.models.moe import (
    MOE_VOCAB,
    MoEStage,
    lm_loss_only,
    moe_loss,
    moe_stages,
    tiny_moe,
    traced_moe_loss,
)

MICROBATCHES = 4
ROWS, LENGTH = 4, 8  # a replica's rows per step, tokens per row
STEPS = 3
DP = EP = 2


def batches(replica: int, dp: int = DP) -> list[torch.Tensor]:
    """Replica ``replica``'s token ids for each step (the global minibatch's rows ``replica`` x ROWS on)."""
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, MOE_VOCAB, (dp * ROWS, LENGTH), generator=torch.Generator().manual_seed(step))
        out.append(ids[replica * ROWS:(replica + 1) * ROWS])
    return out


def variant(family: str) -> tuple[str, str, Callable]:
    """A case's family ("mixtral", "qwen3_moe", with ":attached" for DeepSeek-V3's way of adding the
    auxiliary loss, ":fsdp" for the dense part sharded over the replicas): the model family, where the
    auxiliary loss goes, and the loss."""
    name, _, aux = family.partition(":")
    if aux == "traced":  # the unchanged model, traced (conveyor.pipeline), its router logits carried
        return name, "traced", traced_moe_loss
    return name, "attached" if aux == "attached" else "carried", lm_loss_only if aux == "attached" else moe_loss


def _whole(family: str, num_layers: int) -> nn.Module:
    name, aux, _ = variant(family)
    if aux == "traced":
        return tiny_moe(name, num_layers)
    return MoEStage(tiny_moe(name, num_layers), list(range(num_layers)), first=True, last=True, aux=aux)


def _train(named, step_loss, settle) -> tuple[list, dict, dict]:
    """Losses of STEPS AdamW steps, the first step's gradients and the parameters after the last."""
    named = dict(named)
    optimizer = torch.optim.AdamW(named.values(), lr=1e-2)
    losses, first_grads = [], {}
    for step in range(STEPS):
        losses.append(step_loss(step))
        settle()
        if step == 0:
            first_grads = {n: _mine(n, p.grad) for n, p in named.items() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
    return losses, first_grads, {n: _mine(n, p) for n, p in named.items()}


def _mine(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What EP alone holds of ``name``: an expert shard's local tensor, any other tensor whole (gathered
    over the replicas when FSDP shards it: a collective, in the same order on every rank)."""
    return local_copy(tensor) if ".experts." in name else whole_value(tensor)


def local_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of this rank's tensor (a replicated DTensor's local tensor is the whole one)."""
    return local_part(tensor).detach().clone()


def train_ep_alone(family: str, num_layers: int, group, ep_rank: int, *, replica: int | None = None, dp: int = DP,
                   dense_group=None, expert_replicas=None, device: str = "cpu",
                   microbatches: list[list[torch.Tensor]] | None = None) -> tuple[list, dict, dict]:
    """The whole model under EP alone over ``group`` (this rank's expert-parallel group): see the docstring.

    ``replica`` (default ``ep_rank``) of ``dp`` picks the rows; ``dense_group`` (default ``group``)
    averages the dense gradients and the loss; ``expert_replicas`` (None: none) sums the experts'.
    ``microbatches``: each step's microbatches as given (variable lengths), instead of the rows split."""
    whole = _whole(family, num_layers).to(device)
    # What _dispatched_forward reads of its part (no TP here: every token goes in whole).
    part = types.SimpleNamespace(group=group, capacity=None, _dropped=None, tp_mesh=None, all_to_alls=None)
    for name, experts in find_experts(whole, "auto").items():
        num_experts = experts.num_experts
        shard_experts(experts, ep_rank, dist.get_world_size(group), name)
        experts.forward = functools.partial(_dispatched_forward, experts, part, num_experts)
    ids, loss_fn = [x.to(device) for x in batches(ep_rank if replica is None else replica, dp)], variant(family)[2]
    dense_group = group if dense_group is None else dense_group

    def step_loss(step):
        total = None
        for microbatch in microbatches[step] if microbatches else torch.tensor_split(ids[step], MICROBATCHES):
            loss = loss_fn(whole(microbatch), microbatch) / MICROBATCHES
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        dist.all_reduce(total, group=dense_group)
        return total / dp

    def settle():
        for param in whole.parameters():
            if reduced_by(param) is None:
                dist.all_reduce(param.grad, group=dense_group)
            elif expert_replicas is not None:
                dist.all_reduce(param.grad, group=expert_replicas)
            param.grad.div_(dp)

    return _train(whole.named_parameters(), step_loss, settle)


def train_one_device(family: str, num_layers: int) -> tuple[list, dict, dict]:
    """The whole model, whole experts: both replicas' microbatches in one process, replica by replica."""
    whole = _whole(family, num_layers)
    ids, loss_fn = [batches(replica) for replica in range(DP)], variant(family)[2]

    def step_loss(step):
        total = None
        for replica in range(DP):
            for microbatch in torch.tensor_split(ids[replica][step], MICROBATCHES):
                loss = loss_fn(whole(microbatch), microbatch) / (MICROBATCHES * DP)
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
        return total

    return _train(whole.named_parameters(), step_loss, lambda: None)


def train_pipeline(pipe, pp_rank: int, dp_rank: int, device: str = "cpu") -> tuple[list, dict, dict]:
    ids = [x.to(device) for x in batches(dp_rank)]
    first = pipe.schedule.placement.rank_of(0)
    last = pipe.schedule.placement.rank_of(pipe.schedule.num_stages - 1)

    def step_loss(step):
        return pipe.step(ids[step] if pp_rank == first else None, target=ids[step] if pp_rank == last else None)

    return _train(pipe.named_parameters(), step_loss, lambda: None)


def expert_slice(tensor: torch.Tensor, ep_rank: int) -> torch.Tensor:
    """Rank ``ep_rank``'s experts of a whole 3-D expert tensor."""
    local = tensor.shape[0] // EP
    return tensor[ep_rank * local:(ep_rank + 1) * local]


def schedules_against_ep_alone(rank: int, world_size: int, cases: tuple[tuple[str, str], ...]) -> dict:
    """pp=2 x dp=2, ep=2: for each (family, schedule) of ``cases``, the losses, first gradients and parameters
    after STEPS AdamW steps against EP alone (torch.equal everywhere) and the expert shards' shapes; for
    each model with the carried auxiliary loss, EP alone against one device (:func:`against_one_device`)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    dp_group = mesh["dp"].get_group()
    references: dict[tuple[str, str, int], tuple] = {}  # EP alone by (model, auxiliary loss, layers)
    results = {}
    for family, name in cases:
        schedule = cs.build(name, ranks=2, microbatches=MICROBATCHES, virtual=cs.available()[name].default_virtual)
        layers = schedule.num_stages  # one decoder layer per stage
        model_name, aux, loss_fn = variant(family)
        if (model_name, aux, layers) not in references:  # the dense part's data parallelism changes nothing here
            references[model_name, aux, layers] = train_ep_alone(family, layers, dp_group, dp_rank)
        layout = DistributedLayout(mesh=mesh, expert_parallel="auto", ep=EP,
                        data_parallel="fsdp" if family.endswith(":fsdp") else None)
        if aux == "traced":
            pipe = traced_pipeline(tiny_moe(model_name, layers), schedule, layout, dp_rank)
        else:
            stages = moe_stages(tiny_moe(model_name, layers), layers, aux)
            pipe = conveyor.Pipeline([stages[s] for s in schedule.stages_of(pp_rank)], schedule, loss_fn=loss_fn,
                                     layout=layout, transfer=TransferOptions(timeout_s=120))
        results[family, name] = _compare(train_pipeline(pipe, pp_rank, dp_rank), references[model_name, aux, layers])
        pipe.close()
    # Against one device for the carried auxiliary loss only: the attached one's backward gives each
    # replica's auxiliary loss a gradient of one whatever the loss's scale, so DP x M microbatches on
    # one device weigh it dp times more than dp replicas averaging theirs (the pattern's own semantics).
    # At the layer count of the model's first EP-alone reference (no extra one).
    for (model_name, aux, layers), alone in list(references.items()):
        if aux == "carried" and (model_name, "one device") not in results:
            results[model_name, "one device"] = against_one_device(alone, train_one_device(model_name, layers),
                                                                   dp_rank)
    results["varlen"] = varlen_against_ep_alone(mesh, pp_rank, dp_rank)
    results["plan matching nothing"] = _refusal(mesh, pp_rank)
    return results


def traced_pipeline(model: nn.Module, schedule, layout: Layout, dp_rank: int, device: str = "cpu"):
    """The unchanged ``model`` traced and cut before each decoder layer but the first (one per stage), its
    experts modules leaves of the trace, placed by name, that the expert-parallel part shards."""
    example = batches(dp_rank)[0][:ROWS // MICROBATCHES].to(device)
    cuts = [f"model.layers.{i}" for i in range(1, schedule.num_stages)]
    return conveyor.pipeline(model, example_args=(example,), split_points=cuts, schedule=schedule,
                             loss_fn=traced_moe_loss,
                             layout=layout, options=PipelineOptions(transfer=TransferOptions(timeout_s=120)))


def checkpoint_across_ep(rank: int, world_size: int, directory: str) -> dict:
    """Saved at pp=2 x dp=2 with ep=2 (each rank half of the experts, as DTensor shards), after one AdamW
    step; loaded at ep=1 (every rank every expert) into another model's weights and a fresh AdamW:
    each parameter and AdamW moment equals the saved one, whole (gathered from the ep=2 shards). On the
    way, the pipeline's gradient norm (``clip_grad_norm_``: expert shards' norms combined over their
    group) against one summed by hand in float64 (``norm_rel``), and the model's element count."""
    from torch.distributed.device_mesh import init_device_mesh

    import conveyor.checkpoint

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    schedule = cs.build("1f1b", ranks=2, microbatches=MICROBATCHES)
    ids = batches(dp_rank)[0]

    def pipeline(seed: int, layout: Layout):
        stages = moe_stages(tiny_moe("mixtral", 2, seed=seed), 2)
        pipe = conveyor.Pipeline([stages[pp_rank]], schedule, loss_fn=moe_loss, layout=layout,
                                 transfer=TransferOptions(timeout_s=120))
        return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2)

    saved, optimizer = pipeline(0, DistributedLayout(mesh=mesh, expert_parallel="auto", ep=EP))
    saved.step(ids if pp_rank == 0 else None, target=ids if pp_rank == 1 else None)
    norm = saved.clip_grad_norm_(1e9)  # the whole model's gradient norm (nothing clipped)
    optimizer.step()
    conveyor.checkpoint.save(directory, saved, optimizer)
    own_norm = _whole_norm(saved, DP)
    want = {n: whole_value(p) for n, p in saved.named_parameters()}
    want_moments = {n: whole_value(optimizer.state[p]["exp_avg_sq"]) for n, p in saved.named_parameters()}
    shards = {n: (type(p).__name__, tuple(local_copy(p).shape), tuple(p.shape)) for n, p in saved.named_parameters()
              if ".experts." in n}
    saved.close()
    loaded, fresh = pipeline(1, DistributedLayout(mesh=mesh))  # ep=1: every expert whole on every rank
    before = {n: local_copy(p) for n, p in loaded.named_parameters()}
    conveyor.checkpoint.load(directory, loaded, fresh)
    got = dict(loaded.named_parameters())
    result = {
        "norm_rel": relative_difference(norm, own_norm),
        "elements": sum(p.numel() for p in tiny_moe("mixtral", 2).parameters()),
        "shards": shards,
        "changed_by_load": all(not torch.equal(before[n], local_copy(p)) for n, p in got.items()),
        "params_equal": sorted(got) == sorted(want)
        and all(torch.equal(local_copy(p), want[n]) for n, p in got.items()),
        "moments_equal": all(torch.equal(local_copy(fresh.state[p]["exp_avg_sq"]), want_moments[n])
                             for n, p in got.items()),
    }
    loaded.close()
    return result


def traced_checkpoint(rank: int, world_size: int, directory: str) -> dict:
    """The traced Mixtral (conveyor.pipeline, experts as leaves) at pp=2 x dp=2 with ep=2, after one AdamW step,
    saved by the model's own names; loaded at ep=1 (pp=2) and at pp=1 x dp=4 with ep=4 (each rank one expert of
    each layer): each parameter and AdamW moment equals the saved one (whole, or this rank's expert of it). The
    pp=1 pipeline's logits on this rank's rows, for the export's check."""
    from torch.distributed.device_mesh import init_device_mesh

    import conveyor.checkpoint

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    schedule = cs.build("1f1b", ranks=2, microbatches=MICROBATCHES)
    layout = DistributedLayout(mesh=mesh, expert_parallel="auto", ep=EP)
    saved = traced_pipeline(tiny_moe("mixtral", 2), schedule, layout,
                            dp_rank)
    optimizer = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    ids = batches(dp_rank)[0]
    saved.step(ids if pp_rank == 0 else None, target=ids if pp_rank == 1 else None)
    optimizer.step()
    conveyor.checkpoint.save(directory, saved, optimizer)
    want = {n: whole_value(p) for n, p in saved.named_parameters()}
    want_moments = {n: whole_value(optimizer.state[p]["exp_avg_sq"]) for n, p in saved.named_parameters()}
    shards = {n: tuple(local_copy(p).shape) for n, p in saved.named_parameters() if ".experts." in n}
    saved.close()
    every: list = [None] * world_size  # pp=1 holds every stage's parameters
    dist.all_gather_object(every, (want, want_moments))
    result = {"shards": shards}
    one_mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("pp", "dp"))
    for where, layout, sched in (("ep=1", DistributedLayout(mesh=mesh), schedule),
                                 ("pp=1 ep=4", DistributedLayout(mesh=one_mesh, expert_parallel="auto", ep=world_size),
                                  cs.build("1f1b", ranks=1, microbatches=MICROBATCHES))):
        loaded = traced_pipeline(tiny_moe("mixtral", 2, seed=1), sched, layout, dp_rank)
        fresh = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
        conveyor.checkpoint.load(directory, loaded, fresh)
        got = dict(loaded.named_parameters())
        whole = {n: (w, m[n]) for w, m in every for n, w in w.items()}

        def kept(name, tensor, where=where):  # at ep=4 rank r keeps expert r of each experts module
            return tensor[rank:rank + 1] if where != "ep=1" and ".experts." in name else tensor

        result[where] = {
            "names": sorted(got), "want_names": sorted(set(want)) if where == "ep=1" else sorted(whole),
            "params_equal": all(torch.equal(local_copy(p), kept(n, whole[n][0])) for n, p in got.items()),
            "moments_equal": all(torch.equal(local_copy(fresh.state[p]["exp_avg_sq"]), kept(n, whole[n][1]))
                                 for n, p in got.items()),
            "expert_shapes": sorted({tuple(local_copy(p).shape)[:1] for n, p in got.items() if ".experts." in n}),
        }
        if where != "ep=1":
            result["ids"], result["logits"] = ids, loaded.forward(ids).logits
        loaded.close()
    return result


def _whole_norm(pipe, dp: int) -> torch.Tensor:
    """The gradient norm of the whole model, summed by hand over every rank: a dense gradient is whole on
    each of its dp replicas (counted once: 1/dp each), an expert shard's is its own part."""
    squares = torch.zeros((), dtype=torch.float64)
    for name, param in pipe.named_parameters():
        local = local_copy(param.grad).double()
        squares += (local * local).sum() / (1 if ".experts." in name else dp)
    dist.all_reduce(squares)
    return squares.sqrt()


def whole_value(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor (an expert shard's DTensor gathered over its group: a collective)."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def varlen_batches(replica: int) -> list[list[torch.Tensor]]:
    """Replica ``replica``'s microbatches of each step, each of its own (rows, length): the lengths differ
    between microbatches and between the replicas whose tokens meet at the experts."""
    shapes = ((2, 5), (1, 8), (3, 3), (2, 7))
    generator = torch.Generator().manual_seed(100 + replica)
    return [[torch.randint(0, MOE_VOCAB, shapes[(i + step + replica) % 4], generator=generator)
             for i in range(MICROBATCHES)] for step in range(STEPS)]


def varlen_against_ep_alone(mesh, pp_rank: int, dp_rank: int) -> dict:
    """pp=2 x dp=2, ep=2, 1f1b, variable-length microbatches (conveyor.Microbatches): against EP alone."""
    want = train_ep_alone("mixtral", 2, mesh["dp"].get_group(), dp_rank, microbatches=varlen_batches(dp_rank))
    schedule = cs.build("1f1b", ranks=2, microbatches=MICROBATCHES)
    stages = moe_stages(tiny_moe("mixtral", 2), 2)
    pipe = conveyor.Pipeline([stages[pp_rank]], schedule, loss_fn=moe_loss, transfer=TransferOptions(timeout_s=120),
                             layout=DistributedLayout(mesh=mesh, expert_parallel="auto", ep=EP))
    given = varlen_batches(dp_rank)

    def step_loss(step):
        return pipe.step(conveyor.Microbatches(inputs=[(x,) for x in given[step]] if pp_rank == 0 else None,
                                               targets=given[step] if pp_rank == 1 else None))

    got = _train(pipe.named_parameters(), step_loss, lambda: None)
    pipe.close()
    return _compare(got, want)


def experts_with_replicas(rank: int, world_size: int) -> dict:
    """pp=1 x dp=4 with ep=2: two expert-parallel groups (replicas 0-1, 2-3), each expert's gradient summed
    over its expert-data-parallel pair (replicas 0-2, 1-3); against EP alone over the same groups."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh.get_local_rank("dp")
    # Every rank builds every group, in one order (torch names groups by the job's count).
    ep_groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    expert_replicas = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    want = train_ep_alone("mixtral", 2, ep_groups[dp_rank // EP], dp_rank % EP, replica=dp_rank, dp=4,
                          dense_group=mesh["dp"].get_group(), expert_replicas=expert_replicas[dp_rank % EP])
    schedule = cs.build("gpipe", ranks=1, microbatches=MICROBATCHES)
    stage = MoEStage(tiny_moe("mixtral", 2), [0, 1], first=True, last=True)
    pipe = conveyor.Pipeline([stage], schedule, loss_fn=moe_loss, transfer=TransferOptions(timeout_s=120),
                             layout=DistributedLayout(mesh=mesh, expert_parallel="auto", ep=EP))
    ids = batches(dp_rank, 4)
    (losses, grads, params) = _train(pipe.named_parameters(), lambda step: pipe.step(ids[step], target=ids[step]),
                                     lambda: None)
    pipe.close()
    (want_losses, want_grads, want_params), experts = want, [n for n in params if ".experts." in n]
    dense = sorted(set(params) - set(experts))
    # The experts' first gradients bitwise (their pair's sum of two is commutative, /4 exact); the dense
    # part's four-term replica sum is FSDP's ring over its flattened buffer here and gloo's over each
    # tensor there, and from the second step on every parameter carries that rounding.
    return {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, want_losses, strict=True)),
        "experts": experts,
        "expert_grads_equal": all(torch.equal(grads[n], want_grads[n]) for n in experts),
        "dense_grad_rel": worst_relative((grads[n], want_grads[n]) for n in dense),
        "param_abs": worst_absolute((params[n], want_params[n]) for n in sorted(params)),
    }


def dispatch_with_unrouted_slots(group, ep_rank: int) -> bool:
    """dispatch_combine over ``group`` (2 ranks, 4 experts of 4 x 4 weights, top-2) with some slots routed
    nowhere (index 4, as transformers marks them) and unequal splits, against the whole experts' loop
    on this rank: torch.equal (each slot's product is the same row times the same weight)."""
    from conveyor.parallel.experts.dispatch import dispatch_combine

    weights = torch.randn(4, 4, 4, generator=torch.Generator().manual_seed(7))
    generator = torch.Generator().manual_seed(ep_rank)
    hidden = torch.randn(6, 4, generator=generator)
    index = torch.randint(0, 4, (6, 2), generator=generator)
    index[ep_rank::2, 1] = 4  # routed nowhere
    scale = torch.rand(6, 2, generator=generator)
    want = torch.zeros_like(hidden)
    for expert in range(4):
        tokens, choice = torch.where(index == expert)
        want.index_add_(0, tokens, (hidden[tokens] @ weights[expert]) * scale[tokens, choice, None])
    mine = weights[2 * ep_rank:2 * ep_rank + 2]

    def compute(tokens, local_ids):
        return torch.cat([tokens[local_ids == e] @ mine[e] for e in range(2)])

    return torch.equal(dispatch_combine(hidden, index, scale, num_experts=4, group=group, compute=compute), want)


def expert_parallel_checks(rank: int, world_size: int, cases: tuple[tuple[str, str], ...], directory: str) -> dict:
    """One launch for the test file: :func:`schedules_against_ep_alone`, :func:`checkpoint_across_ep`, then
    :func:`experts_with_replicas`."""
    results = schedules_against_ep_alone(rank, world_size, cases)
    results["checkpoint"] = checkpoint_across_ep(rank, world_size, directory)
    results["expert replicas"] = experts_with_replicas(rank, world_size)
    results["traced checkpoint"] = traced_checkpoint(rank, world_size, f"{directory}-traced")
    pairs = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]  # every rank builds both, in one order
    results["unrouted slots"] = dispatch_with_unrouted_slots(pairs[rank // 2], rank % 2)
    return results


def _refusal(mesh, pp_rank: int) -> str:
    """The error every rank raises for a plan that names no module of the model (last: it leaves the
    failed pipeline's groups to the job's end)."""
    schedule = cs.build("1f1b", ranks=2, microbatches=MICROBATCHES)
    stages = moe_stages(tiny_moe("mixtral", 2), 2)
    try:
        conveyor.Pipeline([stages[pp_rank]], schedule, loss_fn=moe_loss, transfer=TransferOptions(timeout_s=60),
                          layout=DistributedLayout(mesh=mesh, expert_parallel={"blocks.*.moe": "ep_dispatch_experts"},
                                                   ep=EP))
    except PipelineConfigError as error:
        return str(error)
    return "no error"


def against_one_device(alone, device, ep_rank: int) -> dict:
    """EP alone against one device: worst relative difference of the losses and of the first step's
    gradients (each tensor's, this rank's expert slices against the whole experts' same slices), and
    the worst absolute difference of the parameters after STEPS AdamW steps."""
    (losses, grads, params), (want_losses, want_grads, want_params) = alone, device

    def mine(name, tensor):
        return expert_slice(tensor, ep_rank) if ".experts." in name else tensor

    return {
        "loss_rel": worst_relative((a, b) for a, b in zip(losses, want_losses, strict=True)),
        "grad_rel": worst_relative((g, mine(n, want_grads[n])) for n, g in sorted(grads.items())),
        "param_abs": worst_absolute((p, mine(n, want_params[n])) for n, p in sorted(params.items())),
        "grads_compared": sorted(grads) == sorted(want_grads) == sorted(params),
    }


def _compare(got, want) -> dict:
    (losses, grads, params), (want_losses, want_grads, want_params) = got, want
    experts = sorted(n for n in params if ".experts." in n)
    return {
        "losses": [float(x) for x in losses],
        "losses_equal": len(losses) == STEPS and all(torch.equal(a, b) for a, b in zip(losses, want_losses)),
        "finite": all(torch.isfinite(torch.as_tensor(x)).all() for x in losses),
        "grads_equal": sorted(grads) == sorted(params) and all(torch.equal(g, want_grads[n]) for n, g in grads.items()),
        "params_equal": all(torch.equal(p, want_params[n]) for n, p in params.items()),
        "moved": all(not torch.equal(p, want_params[n] * 0) for n, p in params.items()),
        "experts": experts,
        "expert_shapes": {n: tuple(params[n].shape) for n in experts},
        "num_params": len(params),
    }

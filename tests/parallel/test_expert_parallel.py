"""Expert parallelism: experts sharded over the replicas, tokens moved all-to-all, at pp=2 x dp=2 (ep=2).

Tiny Mixtral and Qwen3-MoE (4 experts, 2 per token, grouped K/V heads, the router's load-balancing
loss on, carried to the last stage) in hand-built stages that run the models' own modules, and the
unchanged models traced (``conveyor.pipeline``: each experts module a leaf of the trace, by its name). Against
EP alone (the unpiped model, experts sharded alike): losses, the first step's gradients and the
parameters after 3 AdamW steps ``torch.equal`` under the schedules; against one device within the
bounds derived below. In the same launch: the dense part under FSDP, variable-length microbatches,
pp=1 x dp=4 with ep=2 (expert-data-parallel pairs), clip_grad_norm_, a checkpoint saved at ep=2 and
loaded at ep=1 (the traced Mixtral's, by its own names, at ep=1 and at pp=1 with ep=4 too, then exported and
loaded by from_pretrained), a plan that names nothing. The checks without ranks: the option's refusals, discovery.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.layout import DistributedLayout, InProcessLayout
from conveyor.parallel.experts import find_experts
from conveyor.parallel.experts.part import expert_memberships, shard_experts
from conveyor.parallel.mesh import MeshLayout
from conveyor.testing import run_ranks
from conveyor.testing.compare import adamw_difference_bound, relative_difference, reordered_sum_bound
from conveyor.testing.models.moe import tiny_moe
from conveyor.testing.references.experts import DP, LENGTH, MICROBATCHES, ROWS, STEPS

# EP alone against one device. Both compute every product alike; what differs is the order of sums:
# - a gradient element is a sum over the minibatch's tokens (DP x ROWS x LENGTH = 64; an expert's over
#   those routed to it, at most the same 64): one device adds replica 0's microbatches then replica 1's,
#   one GEMM per microbatch; EP sums both replicas' tokens of a microbatch in the owner's one GEMM (the
#   dense part: per replica, then the replicas' sum). Chained once per decoder layer (2 or 4, one per
#   stage) on the way down: reordered_sum_bound(64, depth=4) = 2.3e-5 of the largest element (condition
#   1, as in conveyor.testing.references.tensor_parallel); measured 2-4e-7.
GRADIENT_BOUND = reordered_sum_bound(DP * ROWS * LENGTH, depth=4)
# - a loss is a sum of DP x M microbatch means, added in another association (/2 is exact), and each
#   row's expert output comes from a GEMM over another set of rows (a kernel may reorder a row's 32-term
#   dot products: 2 GEMMs per layer, up to 4 layers); measured 0.0.
LOSS_BOUND = reordered_sum_bound(DP * MICROBATCHES) + reordered_sum_bound(32, depth=8)
# - parameters after STEPS AdamW steps: where a gradient is at rounding level AdamW turns its rounding
#   into a step of up to lr (conveyor.testing.references.tensor_pipeline says why no tighter bound holds).
PARAMETER_BOUND = adamw_difference_bound(1e-2, STEPS)
# pp=1 x dp=4: the dense gradients' replica mean sums four terms, in FSDP's ring order over its flattened
# buffer in the pipeline and gloo's over each tensor in EP alone: reordered_sum_bound(4) = 1.4e-6 of the
# largest element (condition 1). The experts' first gradients (pair sums, commutative) are bitwise; the
# parameters after it carry the dense rounding: held to PARAMETER_BOUND.
DENSE_FOUR_REPLICAS = reordered_sum_bound(4)

SCHEDULES = tuple(sorted(cs.available()))
# ":attached": each layer's auxiliary loss added by an autograd Function (DeepSeek-V3), not carried.
# ":fsdp": the dense part sharded over the replicas (FSDP2), the experts over the same ranks by EP.
# ":traced": the unchanged model through conveyor.pipeline, its experts modules leaves of the trace.
CI_CASES = (("mixtral:fsdp", "1f1b"), ("qwen3_moe", "zbv"), ("mixtral:attached", "zbv"), ("mixtral:traced", "1f1b"),
            ("qwen3_moe:traced", "1f1b"))
ALL_CASES = tuple((family, name) for family in ("mixtral", "qwen3_moe", "mixtral:attached", "mixtral:fsdp",
                                                "mixtral:traced", "qwen3_moe:traced")
                  for name in SCHEDULES)


def _check_results(results: list[dict], cases: tuple[tuple[str, str], ...]) -> None:
    for rank, by_case in enumerate(results):
        for case in cases:
            result = by_case[case]
            assert result["finite"] and result["moved"], (rank, case, result)
            assert result["losses_equal"] and result["grads_equal"] and result["params_equal"], (rank, case, result)
            # This rank keeps 2 of the 4 experts of each of its layers.
            assert result["experts"] and all(shape[0] == 2 for shape in result["expert_shapes"].values()), result
        for family in {family.partition(":")[0] for family, _ in cases}:  # with the carried auxiliary loss
            device = by_case[family, "one device"]
            assert device["grads_compared"], (rank, family, device)
            assert device["loss_rel"] <= LOSS_BOUND, (rank, family, device)
            assert device["grad_rel"] <= GRADIENT_BOUND, (rank, family, device)
            assert device["param_abs"] <= PARAMETER_BOUND, (rank, family, device)
        assert by_case["unrouted slots"] is True, rank  # slots routed nowhere stay home, as in transformers
        varlen = by_case["varlen"]  # microbatches of their own (rows, length), differing between the replicas
        assert varlen["finite"] and varlen["moved"], (rank, varlen)
        assert varlen["losses_equal"] and varlen["grads_equal"] and varlen["params_equal"], (rank, varlen)
        refusal = by_case["plan matching nothing"]
        assert "found no experts" in refusal and "drop expert_parallel" in refusal, refusal
        assert "experts modules the plan does not name" in refusal, refusal
        # pp=1 x dp=4, ep=2: each expert's gradient summed with its other group's owner's, bitwise.
        replicas = by_case["expert replicas"]
        assert replicas["experts"] and replicas["losses_equal"] and replicas["expert_grads_equal"], (rank, replicas)
        assert replicas["dense_grad_rel"] <= DENSE_FOUR_REPLICAS, (rank, replicas)
        assert replicas["param_abs"] <= PARAMETER_BOUND, (rank, replicas)


# One launch: each case builds a pipeline and trains 3 steps (~2 s each on 4 ranks over 2 busy
# cores), plus one EP-alone reference per (model, auxiliary loss, stage count), the checkpoint and the
# dp=4 case. CI runs Mixtral under 1f1b (dense part FSDP) and zbv (2 stages per rank, the I/W split;
# the attached auxiliary loss), Qwen3-MoE under zbv, both traced (2 layers) under 1f1b, then the traced
# Mixtral's checkpoint (3 traced pipelines; with the traced cases ~13 s of the launch's 33 s, measured at
# load 10 on 2 cores); the extended tier every built-in schedule for each.
@pytest.mark.distributed
@pytest.mark.parametrize("cases", [CI_CASES, pytest.param(ALL_CASES, marks=pytest.mark.extended)],
                         ids=["ci", "every-schedule"])
def test_expert_parallel_equals_ep_alone_and_one_device_and_clips_and_reshards_its_checkpoint(cases, tmp_path):
    from conveyor.checkpoint import to_state_dict
    from conveyor.testing.references.experts import expert_parallel_checks

    directory = tmp_path / "ep2"
    results = run_ranks(expert_parallel_checks, 4, args=(cases, str(directory)), timeout_s=280)
    _check_results(results, cases)
    for rank, result in enumerate(results):
        checkpoint = result["checkpoint"]
        # Saved from DTensor shards of 2 experts each (global shape 4), loaded whole at ep=1.
        assert checkpoint["shards"] and all(kind == "DTensor" and local[0] == 2 and whole[0] == 4
                                            for kind, local, whole in checkpoint["shards"].values()), checkpoint
        assert checkpoint["changed_by_load"] and checkpoint["params_equal"] and checkpoint["moments_equal"], \
            (rank, checkpoint)
        # clip_grad_norm_'s fp32 sum of every element's square against a float64 one: the squares are
        # positive (condition 1), so reordered_sum_bound over the model's elements bounds it (1e-4 here).
        assert checkpoint["norm_rel"] <= reordered_sum_bound(checkpoint["elements"]), (rank, checkpoint)
    _check_traced_checkpoint(results, tmp_path)
    # One process, no ranks: the checkpoint's expert tensors are whole, by their names.
    experts = {name: tensor for name, tensor in to_state_dict(directory).items() if ".experts." in name}
    assert len(experts) == 4 and all(t.shape[0] == 4 and torch.isfinite(t).all() for t in experts.values()), \
        {name: tuple(t.shape) for name, t in experts.items()}


def _check_traced_checkpoint(results: list[dict], tmp_path) -> None:
    """The traced Mixtral's checkpoint, saved at ep=2 by the model's own names: loaded at ep=1 and at pp=1 on every
    rank; exported (one process) as whole expert tensors that from_pretrained turns into the pipeline's logits."""
    import safetensors.torch
    import transformers

    from conveyor.checkpoint import export

    for rank, result in enumerate(results):
        traced = result["traced checkpoint"]
        assert traced["shards"] and all(shape[0] == 2 for shape in traced["shards"].values()), (rank, traced)
        for where, kept in (("ep=1", [(4,)]), ("pp=1 ep=4", [(1,)])):  # experts kept per experts module
            loaded = traced[where]
            assert loaded["names"] == loaded["want_names"] and loaded["expert_shapes"] == kept, (rank, where, loaded)
            assert loaded["params_equal"] and loaded["moments_equal"], (rank, where, loaded)
    export(tmp_path / "ep2-traced", tmp_path / "exported")
    tensors = safetensors.torch.load_file(tmp_path / "exported" / "model.safetensors")
    model = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "exported").train()  # as traced
    assert sorted(tensors) == sorted(model.state_dict()), sorted(tensors)  # the model's own names
    experts = {name: tensor for name, tensor in tensors.items() if ".experts." in name}
    assert len(experts) == 4 and all(t.shape[0] == 4 for t in experts.values()), experts.keys()
    # The pp=1 pipeline (ep=4) runs the traced graph on each microbatch (one row of replica 0's four), its experts
    # computed by their owners over every rank's tokens routed there; from_pretrained's model runs eagerly, on one
    # thread as the ranks. Two computations of the same products, sums in other orders (GEMMs over other rows,
    # transformers' traced grouped_mm_fallback against the eager torch._grouped_mm): a logit is a chain of 32-term
    # dot products (hidden and intermediate sizes 32; the vocabulary head's too), 2 GEMMs per layer in attention and
    # experts each, 2 layers, then the head: reordered_sum_bound(32, depth=9) = 3.6e-5 of the largest logit
    # (condition 1, as LOSS_BOUND above). Measured 6e-8 absolute at ep=1 (logits ~0.3).
    first, threads = results[0]["traced checkpoint"], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits = torch.cat([model(rows).logits for rows in torch.tensor_split(first["ids"], MICROBATCHES)])
    finally:
        torch.set_num_threads(threads)
    assert torch.isfinite(logits).all() and torch.isfinite(first["logits"]).all()
    assert relative_difference(logits, first["logits"]) <= reordered_sum_bound(32, depth=9), \
        relative_difference(logits, first["logits"])


# -- the option, refused before any rank starts ---------------------------------------------------

class _FakeMesh:
    """What Layout reads of a mesh: its dim names and sizes."""

    def __init__(self, **sizes: int) -> None:
        self.mesh_dim_names, self._sizes = tuple(sizes), tuple(sizes.values())

    def size(self, dim: int) -> int:
        return self._sizes[dim]


@pytest.mark.parametrize(("layout", "message"), [
    (dict(mesh=_FakeMesh(pp=2, dp=4), expert_parallel="auto", ep=3), r"ep=3 does not divide dp=4"),
    (dict(mesh=_FakeMesh(pp=2, dp=2), ep=2), r"give expert_parallel='auto'"),
    (dict(mesh=_FakeMesh(pp=2), expert_parallel="auto"), r"borrows its ranks from the pipeline's replicas"),
    (dict(dp=4, expert_parallel="auto", ep=3), r"ep=3 does not divide dp=4"),  # the sizes, no mesh yet
    (dict(expert_parallel="auto"), r"borrows its ranks from the pipeline's replicas"),
    (dict(mesh=_FakeMesh(pp=2, dp=2), expert_parallel={"layers.*.experts": "alltoall"}), r"takes module-name pat"),
    (dict(mesh=_FakeMesh(pp=2, dp=2), expert_parallel="all"), r"takes 'auto' or a dict"),
    (dict(mesh=_FakeMesh(pp=2, dp=2), expert_parallel="auto", ep=0), r"takes a positive int"),
    (dict(mesh=_FakeMesh(pp=2, dp=2), expert_capacity=1.25), r"expert_capacity=1.25 shapes expert parallelism"),
    (dict(mesh=_FakeMesh(pp=2, dp=2), expert_parallel="auto", expert_capacity=0), r"a capacity factor > 0"),
    (dict(mesh=_FakeMesh(pp=2, dp=2), expert_parallel="auto", expert_capacity=float("inf")), r"a capacity factor"),
])
def test_the_option_is_refused_with_the_fix(layout, message):
    with pytest.raises(PipelineConfigError, match=message):
        DistributedLayout(**layout)


def test_an_in_process_pipeline_has_no_expert_option_to_set():
    # Every rank in one process moves no tokens between processes: the in-process record has no such field.
    assert "expert_parallel" not in [f.name for f in dataclasses.fields(InProcessLayout)]


def test_a_valid_option_describes_itself():
    layout = DistributedLayout(mesh=_FakeMesh(pp=2, dp=4), expert_parallel="auto", ep=2)
    assert "expert_parallel='auto' ep=2" in layout.describe()


# -- discovery ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_auto_finds_each_layers_experts_by_structure_and_the_models_ep_plan(family):
    model = tiny_moe(family, 2)
    assert model.config.base_model_ep_plan  # the config's plan is what "auto" follows
    found = find_experts(model, "auto")
    assert sorted(found) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert find_experts(model, {"layers.1.mlp.experts": "ep_dispatch_experts"}).keys() == {
        "model.layers.1.mlp.experts"}
    assert find_experts(model, {"blocks.*.moe": "ep_dispatch_experts"}) == {}


def test_auto_finds_gpt_oss_experts_whose_forward_names_its_arguments_otherwise():
    import transformers

    config = transformers.GptOssConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=32, head_dim=8,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                       num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"])
    model = transformers.GptOssForCausalLM(config)
    assert list(find_experts(model, "auto")) == ["model.layers.0.mlp.experts"]  # with its [E, out] biases


class _ListMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


def test_experts_in_a_module_list_are_refused_naming_the_way_out():
    with pytest.raises(PipelineConfigError, match=r"'block'.*nn.ModuleList of 3 MLPs.*Stack the experts"):
        find_experts(nn.ModuleDict({"block": _ListMoE()}), "auto")


def test_sharding_keeps_this_ranks_experts_and_refuses_an_ep_not_dividing_their_count():
    experts = tiny_moe("mixtral", 1).model.layers[0].mlp.experts
    whole = experts.gate_up_proj.detach().clone()
    shard_experts(experts, 1, 2, "layer 0")
    assert torch.equal(experts.gate_up_proj, whole[2:]) and experts.num_experts == 2
    with pytest.raises(PipelineConfigError, match=r"holds 4 experts, which ep=3 does not divide"):
        shard_experts(tiny_moe("mixtral", 1).model.layers[0].mlp.experts, 0, 3, "layer 0")


def test_expert_groups_take_consecutive_replicas_and_the_rest_reduce_their_gradients():
    # 8 ranks: 4 replicas of a 2-rank pipeline; replica r's pipeline is ranks (2r, 2r + 1).
    layout = MeshLayout(tuple((2 * r, 2 * r + 1) for r in range(4)), 0, 0, None)
    ep_groups, replica_groups = expert_memberships(layout, 2)
    assert ep_groups == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert replica_groups == [[0, 4], [2, 6], [1, 5], [3, 7]]


def _capacity_ranks(rank: int, world_size: int, capacity: float | None) -> dict:
    """Two ranks dispatch skewed routing (every token's first choice is expert 0) under a capacity factor; each
    checks its output against the rule computed here: per expert, its first ceil(factor x routed / experts)
    slots in token order are computed, the rest dropped."""
    import math

    import torch.distributed as dist

    from conveyor.parallel.experts.dispatch import dispatch_combine

    experts, width, tokens, choices = 4, 8, 12, 2
    torch.manual_seed(0)
    weights = torch.randn(experts, width, width)  # the same experts on both ranks; each computes its own half
    torch.manual_seed(1 + rank)
    hidden = torch.randn(tokens, width)
    index = torch.randint(0, experts, (tokens, choices))
    index[:, 0] = 0  # expert 0 is everyone's first choice: over any capacity near 1
    index[0, 1] = experts  # one slot routed nowhere: not counted, not computed
    gates = torch.rand(tokens, choices)
    local = experts // world_size

    def compute(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([row @ weights[rank * local + int(e)] for row, e in zip(rows, local_ids)])

    dropped = torch.zeros((), dtype=torch.long)
    out = dispatch_combine(hidden, index, gates, num_experts=experts, group=dist.group.WORLD, compute=compute,
                           capacity_factor=capacity, dropped=dropped)
    routed = int((index < experts).sum())
    limit = math.inf if capacity is None else math.ceil(capacity * routed / experts)
    taken = [0] * experts
    want = torch.zeros_like(hidden)
    for t in range(tokens):
        for k in range(choices):
            e = int(index[t, k])
            if e == experts:
                continue
            taken[e] += 1
            if taken[e] <= limit:
                want[t] += gates[t, k] * (hidden[t] @ weights[e])
    return {"equal": torch.equal(out, want), "dropped": int(dropped), "expected": sum(max(0, n - limit)
                                                                                       for n in taken)}


@pytest.mark.distributed
@pytest.mark.parametrize("capacity", [None, 1.0, 1.5])
def test_a_capacity_factor_drops_each_experts_later_slots_and_counts_them(capacity, one_thread):
    from conveyor.testing import run_ranks

    for rank, result in enumerate(run_ranks(_capacity_ranks, 2, args=(capacity,), timeout_s=120)):
        assert result["equal"], (rank, capacity, result)
        assert result["dropped"] == result["expected"], (rank, capacity, result)
        assert (result["dropped"] > 0) == (capacity is not None), (rank, capacity, result)  # expert 0 overflows

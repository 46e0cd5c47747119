"""Bad tensor-parallel input is refused before anything moves, naming the module and the sizes.

The plan checks need no process group (they read the module and the TP size), so they run
here; ``parallelize_stage`` runs the same checks first on every rank alike.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from conveyor.errors import PipelineConfigError
from conveyor.parallel.tensor import check_plan, tensor_parallel_plan
from conveyor.testing.models import grouped_heads_lm


class MLP(nn.Module):
    def __init__(self, hidden: int = 32, inner: int = 33) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, inner)
        self.proj = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))


class WithAdapter(nn.Module):
    """An MLP, then a lone projection (not the last layer) that no pattern explains."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(inner=64)
        self.adapter = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.adapter(self.mlp(x)))


def _llama(**config):
    model_class, config = grouped_heads_lm("llama", num_layers=1, **config)
    return model_class(config)


CATALOGUE = [
    # (what, build the model, tp, the message's parts)
    ("hidden 33 over tp=2", lambda: MLP(inner=33), 2,
     ["tp=2 does not divide the intermediate (hidden) size of the module (MLP): 33 is not a multiple of 2"]),
    ("attention heads over tp=3", lambda: _llama(vocab_size=96), 3,
     ["number of attention heads of model.layers.0.self_attn (LlamaAttention): 4 is not a multiple of 3"]),
    ("key/value heads over tp=4", lambda: _llama(), 4,
     ["number of key/value heads of model.layers.0.self_attn (LlamaAttention): 2 is not a multiple of 4"]),
    ("intermediate over tp=4", lambda: _llama(num_key_value_heads=4, intermediate_size=50), 4,
     ["intermediate (hidden) size of model.layers.0.mlp (LlamaMLP): 50 is not a multiple of 4"]),
    ("vocabulary over tp=2", lambda: _llama(vocab_size=97), 2,
     ["vocabulary (embedding rows) of model.embed_tokens (Embedding): 97 is not a multiple of 2"]),
    ("a projection auto cannot place", WithAdapter, 2,
     ["tensor_parallel='auto' cannot place adapter (Linear)", "give parallelize_stage", "ColwiseParallel()"]),
]


@pytest.mark.parametrize(("what", "make", "tp", "parts"), CATALOGUE, ids=[case[0] for case in CATALOGUE])
def test_auto_plan_refuses_with_the_module_and_its_sizes(what, make, tp, parts):
    with pytest.raises(PipelineConfigError) as raised:
        tensor_parallel_plan(make(), tp)
    for part in parts:
        assert part in str(raised.value), str(raised.value)


def test_a_plan_pattern_that_matches_no_module_is_refused():
    with pytest.raises(PipelineConfigError, match=r"pattern 'layers\.\*\.mlp\.fc' matches no module of this MLP"):
        check_plan(MLP(inner=64), {"layers.*.mlp.fc": ColwiseParallel()}, 2)


def test_a_plan_that_splits_a_size_tp_does_not_divide_is_refused():
    with pytest.raises(PipelineConfigError) as raised:
        check_plan(MLP(inner=33), {"fc": ColwiseParallel(), "proj": RowwiseParallel()}, 2)
    assert "tp=2 does not divide the out_features of fc (Linear), 33, which ColwiseParallel splits" in str(raised.value)


def test_a_plan_that_splits_a_hidden_size_tp_does_not_divide_is_refused():
    # ColwiseParallel on an embedding splits its hidden size (embedding_dim)
    model = nn.Sequential(nn.Embedding(64, 33))
    with pytest.raises(PipelineConfigError) as raised:
        check_plan(model, {"0": ColwiseParallel()}, 2)
    assert "tp=2 does not divide the embedding_dim of 0 (Embedding), 33, which ColwiseParallel splits" in str(
        raised.value)


def test_a_plan_value_that_is_not_a_parallel_style_is_refused():
    with pytest.raises(PipelineConfigError, match="maps 'fc' to str; it takes torch ParallelStyles"):
        check_plan(MLP(inner=64), {"fc": "colwise"}, 2)


def test_wildcard_patterns_match_as_parallelize_module_matches_them():
    model = _llama()
    plan = {"model.layers.*.self_attn.q_proj": ColwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel()}
    check_plan(model, plan, 2)  # both patterns match, every split size is even


def test_auto_plan_uses_the_modules_own_names_and_leaves_experts_whole():
    model_class, config = grouped_heads_lm("mixtral", num_layers=1)
    plan = tensor_parallel_plan(model_class(config), 2)
    assert set(plan) == {"model.embed_tokens", "lm_head"} | {
        f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"}
    assert isinstance(plan["model.layers.0.self_attn.o_proj"], RowwiseParallel)


class _Mixer(nn.Module):
    """A learned mix of sequence positions between the blocks: neither a norm, an embedding nor a block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, width))


def test_sequence_parallel_refuses_a_module_between_the_blocks_it_cannot_place():
    model = _llama()
    model.model.mixer = _Mixer(model.config.hidden_size)
    with pytest.raises(PipelineConfigError) as raised:
        tensor_parallel_plan(model, 2, sequence_parallel=True)
    assert "sequence_parallel=True cannot place model.mixer (_Mixer)" in str(raised.value)
    assert "Use sequence_parallel=False" in str(raised.value)


def test_sequence_parallel_gives_each_moe_block_the_whole_sequence_and_takes_its_rows_back():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    model_class, config = grouped_heads_lm("mixtral", num_layers=2)
    plan = tensor_parallel_plan(model_class(config), 2, sequence_parallel=True)
    for layer in range(2):
        style = plan[f"model.layers.{layer}.mlp"]  # the router and the experts run whole, on the whole sequence
        assert isinstance(style, PrepareModuleInputOutput)
        assert style.prepare_module_input.desired_input_layouts == (Replicate(),)
        assert style.prepare_module_output.desired_output_layouts == (Shard(1),)
        assert not any(name.startswith(f"model.layers.{layer}.mlp.") for name in plan)


def test_sequence_parallel_refuses_moe_blocks_in_stages_built_by_hand():
    from conveyor.parallel.tensor import parallelize_stage

    class OneDimMesh:  # refused before any communication: the sizes are all it reads
        ndim = 1

        def size(self) -> int:
            return 2

    model_class, config = grouped_heads_lm("mixtral", num_layers=1)
    with pytest.raises(PipelineConfigError, match=r"does not take its mixture-of-experts blocks \(model.layers.0.mlp"):
        parallelize_stage(model_class(config), OneDimMesh(), sequence_parallel=True)

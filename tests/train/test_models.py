"""conveyor.train.models: the recipes, hf:<class>, a pretrained directory, and the refusals said before any rank.

In one process, no ranks: each model is built and split by the same tracing frontend a run
uses; the stages run in a row must give the unsplit model's loss and gradients bit for bit (a
tied embedding's two copies: their sum, up to the order of additions).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import conveyor.frontend as frontend
import conveyor.schedule as cs
from conveyor.errors import ConfigError
from conveyor.layout import InProcessLayout
from conveyor.parallel.loss import loss_divisor
from conveyor.pipe import Pipeline
from conveyor.testing.references.unsplit import check_parity
from conveyor.train.config import TrainConfig, load_config
from conveyor.train.loop import LossWithAux, train_loss
from conveyor.train.models import build_model, ties_embeddings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = ["model.layers=2", "model.width=32", "model.heads=4", "model.seq_len=16"]


def _refusal(overrides) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    return str(caught.value)


def _splits_exactly(model: torch.nn.Module, num_stages: int = 2) -> frontend.ModelSplit:
    """Cut as a run cuts; the stages in a row give the model's loss and gradients (tied ones summed)."""
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    split = frontend.split_model(model, num_stages, example_kwargs={"input_ids": ids, "labels": ids})
    check_parity(model, split, kwargs={"input_ids": ids, "labels": ids})
    return split


@pytest.mark.parametrize("name, cls, tied", [("gpt", "GPT2LMHeadModel", True), ("llama", "LlamaForCausalLM", False),
                                             ("mpt", "MptForCausalLM", True)])
def test_each_recipe_builds_splits_and_ties_as_it_should(name, cls, tied):
    # moe: test_moe_recipe_under_zbv_equals_one_device_with_its_loss_parts
    grouped = ["model.kv_heads=2"] if name == "llama" else []  # as configs/llama.yaml: grouped heads, bitwise
    cfg = load_config(None, [f"model.name={name}", *SMALL, "model.layers=4", *grouped])
    torch.manual_seed(0)
    model = build_model(cfg, 256)
    assert type(model).__name__ == cls
    assert ties_embeddings(cfg.model) is tied
    split = _splits_exactly(model, num_stages=4 if name == "mpt" else 2)
    assert bool(split.tied_groups) is tied  # gpt and mpt: the embedding is also the head, on both end stages
    dropouts = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert all(p == 0 for p in dropouts)  # resumes repeat a run bit for bit only without dropout


def test_model_keys_reach_the_transformers_config():
    cfg = load_config(None, ["model.name=llama", *SMALL, "model.kv_heads=2", "model.intermediate=48",
                             "model.hf_config.rope_theta=500000", "model.hf_config.rms_norm_eps=1e-5"])
    config = build_model(cfg, 300, device="meta").config
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (2, 48, 300)
    assert config.rope_parameters["rope_theta"] == 500000 and config.rms_norm_eps == 1e-5
    assert config.tie_word_embeddings is False
    mpt = build_model(load_config(None, ["model.name=mpt", *SMALL, "model.intermediate=96"]), 256, device="meta")
    assert mpt.config.expansion_ratio == 3 and mpt.config.attn_config.alibi
    gpt = build_model(load_config(None, [*SMALL, "model.intermediate=40"]), 256, device="meta")
    assert gpt.config.n_inner == 40 and all(p.is_meta for p in gpt.parameters())


def test_hf_class_builds_from_its_config_class_with_derived_sizes_and_splits():
    cfg = load_config(None, ["model.name=hf:Qwen2ForCausalLM", *SMALL, "model.kv_heads=2",
                             "model.hf_config.tie_word_embeddings=true"])
    torch.manual_seed(0)
    model = build_model(cfg, 256)
    c = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (2, 32, 4, 2)
    assert (c.intermediate_size, c.max_position_embeddings, c.vocab_size, c.use_cache) == (128, 16, 256, False)
    assert c.tie_word_embeddings and ties_embeddings(cfg.model)  # hf_config goes over what is derived
    assert len(_splits_exactly(model).tied_groups) == 1


def test_a_pretrained_directory_builds_on_meta_from_its_config(tmp_path):
    torch.manual_seed(0)
    build_model(load_config(None, ["model.name=llama", *SMALL]), 256).save_pretrained(tmp_path,
                                                                                      safe_serialization=True)
    cfg = load_config(None, [f"model.name={tmp_path}", "model.seq_len=16", "model.width=64"])  # width: ignored
    model = build_model(cfg, 256)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 32
    assert all(p.is_meta for p in model.parameters())  # the ranks read their stages' weights from the files
    assert "takes at most 16 positions" in _refusal([f"model.name={tmp_path}", "model.seq_len=32"])
    with pytest.raises(ConfigError, match="the tokenizer has 1000 ids but the pretrained model"):
        build_model(cfg, 1000)


@pytest.mark.parametrize("overrides, expected", [
    (["model.name=hf:Qwen2ForCausalLm"], "has no class 'Qwen2ForCausalLm'; did you mean 'Qwen2ForCausalLM'?"),
    (["model.name=hf:BertModel"], "BertModel is a transformers class but not a causal language model"),
    (["model.name=hf:LlamaConfig"], "not a causal language model"),
    (["model.hf_config.n_embdd=3"], "GPT2Config has no field 'n_embdd'; did you mean 'n_embd'?"),
    (["model.name=llama", "model.hf_config.rms_norm_eps=abc"], "LlamaConfig refuses the config"),
    (["model.name=gpt", "model.kv_heads=2"], "gpt has no grouped-query attention"),
    (["model.name=llama", "model.kv_heads=3"], "model.kv_heads=3: must divide model.heads=4"),
    (["model.name=mpt", "model.intermediate=200"], "a whole multiple of model.width=128; try 256"),
    (["model.intermediate=0"], "model.intermediate=0: expected a value >= 1"),
    (["parallel.dp=2", "parallel.data_parallel=fsdp"], "embedding is tied to the output head"),
    (["model.name=mpt", "parallel.dp=2", "parallel.schedule=zbv"], "puts the first and last stage on one rank"),
])
def test_model_mistakes_are_refused_before_any_rank(overrides, expected):
    assert expected in _refusal(overrides)


def test_a_directory_without_config_json_is_refused(tmp_path):
    assert "no config.json there" in _refusal([f"model.name={tmp_path}"])
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertForMaskedLM"]}')
    assert "BertForMaskedLM is a transformers class but not a causal language model" in _refusal(
        [f"model.name={tmp_path}"])


def test_untied_models_shard_and_the_recipe_files_load():
    load_config(None, ["model.name=llama", "parallel.dp=2", "parallel.data_parallel=fsdp"])
    load_config(None, ["model.name=mpt", "parallel.dp=2", "parallel.schedule=interleaved-1f1b", "parallel.virtual=2"])
    assert load_config(CONFIGS / "gpt.yaml") == TrainConfig()  # gpt.yaml writes the defaults out
    names = {name: load_config(CONFIGS / f"{name}.yaml").model.name for name in ("llama", "mpt", "llama-1b", "moe")}
    assert names == {"llama": "llama", "mpt": "mpt", "llama-1b": "llama", "moe": "moe"}
    moe = load_config(CONFIGS / "moe.yaml")
    assert moe.parallel.schedule == "zbv" and moe.model.kv_heads < moe.model.heads


def _moe_steps(model, loss_fn, step, batches):
    """Per AdamW step: the loss, the (language-model, auxiliary) parts, and the parameters at the end."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    results = []
    for x, y in batches:
        loss = step(x, y)
        results.append((loss, loss_fn.step_parts(loss_divisor(None, 4))))
        optimizer.step()
        optimizer.zero_grad()
    return results, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_moe_recipe_under_zbv_equals_one_device_with_its_loss_parts():
    """The moe recipe (grouped heads, router logits to the loss) pipelined under zbv, loss parts included."""
    cfg = load_config(None, ["model.name=moe", *SMALL, "model.layers=4", "model.kv_heads=2", "model.intermediate=24"])
    torch.manual_seed(0)
    model = build_model(cfg, 256)
    assert type(model).__name__ == "MixtralForCausalLM" and not ties_embeddings(cfg.model)
    assert model.config.num_key_value_heads == 2 and model.config.output_router_logits
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, 256, (8, 16), generator=generator), torch.randint(0, 256, (8, 16), generator=generator))
        for _ in range(2)
    ]

    ref_fn = train_loss(cfg, reference)
    assert isinstance(ref_fn, LossWithAux) and ref_fn.coefficient == 0.02

    def one_device(x, y):
        total = None
        for xi, yi in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
            loss = ref_fn(reference(xi), yi) / 4
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    want, want_params = _moe_steps(reference, ref_fn, one_device, batches)
    schedule = cs.build("zbv", ranks=2, microbatches=4)
    split = frontend.split_model(model, schedule.num_stages, example_args=(batches[0][0][:2],),
                                 split_method="parameters")
    loss_fn = train_loss(cfg, model)
    pipe = Pipeline(split.stage_modules(), schedule, loss_fn=loss_fn, layout=InProcessLayout())
    got, got_params = _moe_steps(model, loss_fn, lambda x, y: pipe.step(x, target=y), batches)
    for (loss, parts), (want_loss, want_parts) in zip(got, want):
        assert torch.equal(loss, want_loss) and torch.equal(parts, want_parts), (loss, parts, want_loss, want_parts)
        assert parts[1] > 0 and torch.allclose(parts.sum(), loss)  # the parts add up to the loss, to rounding
    for name, value in got_params.items():
        assert torch.equal(value, want_params[name]), f"{name} differs after 2 steps"
    with pytest.raises(ConfigError, match="no aux_loss .* output_router_logits=True"):
        loss_fn({"logits": torch.zeros(1, 2, 4, requires_grad=True)}, torch.zeros(1, 2, dtype=torch.long))

"""The planner on real models: measured unit costs (no timing asserted), the command, the train config."""

from __future__ import annotations

import json

import pytest
import torch

import conveyor
import conveyor.plan as cp
from conveyor.errors import ConfigError


def tiny_llama(vocab: int = 512, width: int = 32, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
                         tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(config)


def test_profiled_units_of_a_llama_and_its_plan(one_thread):
    model = tiny_llama()
    example = torch.zeros(2, 32, dtype=torch.long)
    plan = conveyor.plan.plan(model, example, ranks=2, global_batch=8, memory_per_rank="1GiB",
                              schedules=["1f1b", "zb-h1", "zbv"], measure=cp.Measurement(repeats=2))
    units = {unit.name: unit for unit in plan.costs.units}
    assert {"model.embed_tokens", "model.layers.0", "model.layers.3", "model.norm", "lm_head"} <= set(units)
    block, head = units["model.layers.0"], units["lm_head"]
    assert block.forward > 0 and block.backward_input > 0 and block.backward_weight > 0
    assert 0 < block.weight_activation_bytes < block.activation_bytes
    assert head.parameter_bytes == 512 * 32 * 4 and head.output_bytes == 0
    assert units["model.embed_tokens"].backward_input == 0  # its input is the ids
    assert plan.costs.fixed is not None  # profiled at two microbatch sizes
    assert plan.schedule in ("1f1b", "zb-h1", "zbv") and max(plan.memory_per_rank) <= 2**30
    assert len(plan.split_points) == plan.num_stages - 1
    assert all(name in units for name in plan.split_points)


def test_the_plan_command_prints_the_table_and_writes_a_plan_train_accepts(tmp_path, capsys):
    from conveyor.cli import main
    from conveyor.train.config import load_config

    out = tmp_path / "plan.json"
    status = main(["plan", "gpt", "--ranks", "2", "--global-batch", "8", "--memory-per-rank", "2GiB", "--top", "3",
                   "--set", "model.layers=4", "--set", "model.width=32", "--set", "model.seq_len=32",
                   "--repeats", "1", "--schedules", "1f1b,zb-h1,interleaved-1f1b", "--tp", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "schedule" in printed and "chosen:" in printed and "others:" in printed and "wrote" in printed
    assert ", uncalibrated: " in printed and "plan with `--calibrate`" in printed  # beside the predicted step
    saved = json.loads(out.read_text())
    assert saved["ranks"] == 2 and saved["global_batch"] == 8 and saved["costs"]["units"]
    cfg = load_config(None, [f"parallel.plan={out}", "train.batch_size=8", "model.layers=4", "model.width=32",
                             "model.seq_len=32"])
    assert (cfg.parallel.schedule, cfg.parallel.microbatches) == (saved["schedule"], saved["microbatches"])
    with pytest.raises(ConfigError, match="is for 2 pipeline ranks but parallel.pp=4"):
        load_config(None, [f"parallel.plan={out}", "train.batch_size=8", "parallel.pp=4", "model.layers=8"])
    with pytest.raises(ConfigError, match="parallel.plan="):
        load_config(None, [f"parallel.plan={tmp_path / 'none.json'}"])


def test_a_meta_model_is_costed_from_its_shapes():
    with torch.device("meta"):
        model = tiny_llama(vocab=4096, width=64, layers=8)
    table = cp.unit_costs(model, (torch.zeros(1, 64, dtype=torch.long),), None, global_batch=8, ranks=4)
    assert table.source.startswith("analytic") and len(table.units) == 11
    plan = cp.plan(model, torch.zeros(1, 64, dtype=torch.long), ranks=4, global_batch=8,
                   measure=cp.Measurement(costs=table))
    assert plan.num_stages in (4, 8)


def test_a_cpu_model_is_profiled_with_the_threads_each_rank_computes_with(monkeypatch):
    """conveyor train gives each of P local ranks the host's cores / P threads (or OMP_NUM_THREADS);
    a unit profiled with all of them would look P times faster than it runs in a rank."""
    import conveyor.plan.planner as planner

    seen: list[int] = []
    real = planner.unit_costs

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "unit_costs", spy)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        for threads in ("auto", 1, None):
            cp.plan(model, torch.randn(2, 8), ranks=2, global_batch=8, schedules=["1f1b"], microbatches=[4],
                    machine=cp.Machine(threads=threads), measure=cp.Measurement(repeats=1))
            assert torch.get_num_threads() == 2  # the caller's setting is put back
    finally:
        torch.set_num_threads(previous)
    assert seen == [1, 1, 2]

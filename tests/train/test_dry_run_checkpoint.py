"""``conveyor train --dry-run`` with a checkpoint policy per stage: what each stage keeps, as the ranks apply it."""

from __future__ import annotations

from conveyor.train.config import load_config
from conveyor.train.dry_run import format_layout, run_layout

BASE = ["model.name=llama", "model.layers=4", "model.width=32", "model.heads=4", "model.kv_heads=2",
        "model.seq_len=32", "train.batch_size=8", "parallel.microbatches=4"]


def _kept(*overrides: str) -> tuple[list[int], list[int], object]:
    cfg = load_config(None, [*BASE, *overrides])
    layout = run_layout(cfg)
    return [row.activation_bytes for row in layout.stages], [row.recompute_bytes for row in layout.stages], (
        layout, cfg)


def test_each_policy_keeps_less_the_more_it_recomputes_and_per_stage_lists_apply_per_stage():
    plain, plain_rebuilt, _ = _kept()
    every_other, _, _ = _kept("stage.recompute={every: 2}")
    every, rebuilt, _ = _kept("stage.recompute={every: 1}")
    selective, _, _ = _kept("stage.recompute={every: 1, save: [matmul]}")
    first_only, first_rebuilt, (layout, cfg) = _kept("stage.recompute=[{every: 1}, null]")
    assert plain_rebuilt == [0, 0]
    for stage in range(2):
        assert every[stage] < every_other[stage] < plain[stage]
        assert every[stage] < selective[stage] < plain[stage]  # the kept matmul outputs count
        assert 0 < rebuilt[stage] < plain[stage]  # one block's share is rebuilt at a time
    assert first_only == [every[0], plain[1]] and first_rebuilt == [rebuilt[0], 0]
    assert layout.ranks[0].activation_bytes - layout.ranks[0].recompute_bytes < layout.ranks[1].activation_bytes
    assert "(stage 0: every=1; stage 1: none)" in format_layout(layout, cfg)

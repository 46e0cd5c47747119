"""``--varlen``: batching by length against padding to the longest, at pp=2, on the stdlib's definitions.

The corpus is every top-level function and class of the standard library (``data.source=
stdlib-definitions``, :mod:`conveyor.train.corpus`), bytes as tokens, each document cut at its
end into pieces of at most ``seq_len + 1`` tokens. Two sides train the same hand-built
transformer stages (:mod:`conveyor.testing.models.tiny_lm`) over 2 gloo ranks, loss per token
(``normalize_by``), in rounds whose first side alternates:

- ``padded``: microbatches of ``rows`` pieces, each padded to ``seq_len`` (what a fixed-shape
  pipeline needs);
- ``by_length``: the same pieces sorted by length in pools and cut into microbatches of at most
  ``rows x seq_len`` tokens (:class:`conveyor.train.data.LengthBatchLoader`), each as long as its
  longest piece: ``pipe.step(conveyor.Microbatches(inputs=..., targets=...))``.

Printed per side: real (unpadded) tokens per second, the padding share, the host's CPU steal
while that side ran, and the measured step beside the simulator's prediction for that step's
varying microbatch costs (per-token costs calibrated on the padded side's timeline, each
microbatch costed by its own rows x length; :func:`conveyor.schedule.simulate`).

``--varlen-parity`` prints the whole schedule x transport parity table of
:mod:`conveyor.testing.references.varlen` (bitwise or the largest difference), which CI samples.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

import conveyor
import conveyor.schedule as cs
from benchmarks.steal import StealMeter
from conveyor.schedule.cost import CostModel, StageCosts
from conveyor.schedule.ir import ActionKind
from conveyor.testing.models import TinyConfig, build_stage
from conveyor.testing.multiprocess import run_ranks
from conveyor.train.corpus import definition_documents
from conveyor.train.data import ByteTokenizer, Document, document_pieces, length_microbatches, padding_share

SEQ_LEN, ROWS, MICROBATCHES = 128, 4, 4
CONFIG = TinyConfig(num_stages=2, blocks_per_stage=2, vocab_size=256, dim=64, num_heads=4, seq_len=SEQ_LEN)


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             reduction="sum", ignore_index=-100)


def _steps(max_bytes: int, num_steps: int) -> dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Each side's steps over the same pieces, in the same shuffled order."""
    docs = [Document(*d) for d in definition_documents(max_bytes)]
    pieces = document_pieces(docs, ByteTokenizer(), SEQ_LEN)
    order = torch.randperm(len(pieces), generator=torch.Generator().manual_seed(0)).tolist()
    pieces = [pieces[i] for i in order]
    by_length = []
    for start in range(0, len(pieces), 256):
        by_length += length_microbatches(sorted(pieces[start:start + 256], key=len, reverse=True), ROWS * SEQ_LEN)
    padded = length_microbatches(pieces, ROWS * SEQ_LEN, pad_to=SEQ_LEN, rows=ROWS)
    return {side: [batches[i * MICROBATCHES:(i + 1) * MICROBATCHES] for i in range(num_steps)]
            for side, batches in (("padded", padded), ("by_length", by_length))}


def _rank(rank: int, world_size: int, steps: dict, rounds: int) -> dict[str, Any]:
    schedule = cs.build("1f1b", ranks=2, microbatches=MICROBATCHES)
    pipe = conveyor.Pipeline([build_stage(rank, CONFIG)], schedule=schedule, loss_fn=_token_loss,
                             transfer=conveyor.TransferOptions(timeout_s=120))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    sides = list(steps)
    record: dict[str, Any] = {side: {"times": [], "tokens": 0, "timelines": []} for side in sides}
    meter = StealMeter()
    per_round = len(steps["padded"]) // rounds
    for round_index in range(rounds):
        for side in (sides if round_index % 2 == 0 else sides[::-1]):
            chunk = steps[side][round_index * per_round:(round_index + 1) * per_round]
            with meter.window(side):
                for index, microbatches in enumerate(chunk):
                    tokens = sum(int((t != -100).sum()) for _, t in microbatches)
                    given = conveyor.Microbatches(inputs=[(ids,) for ids, _ in microbatches] if rank == 0 else None,
                                                  targets=[t for _, t in microbatches] if rank == 1 else None)
                    start = time.perf_counter()
                    pipe.step(given, normalize_by=tokens)
                    stepped = time.perf_counter()
                    optimizer.step()
                    optimizer.zero_grad()
                    elapsed = time.perf_counter() - start
                    if index == 0:
                        continue  # the first step of each run warms the side up
                    record[side]["times"].append(elapsed)
                    record[side]["last_step_s"] = stepped - start
                    record[side]["tokens"] += tokens
            timeline = pipe.timeline()  # a collective: the last step of this chunk
            record[side]["timelines"].append(
                [(s.rank, s.action.kind.name, s.action.stage, s.action.microbatch, s.duration) for s in timeline.spans])
            record[side]["last_shapes"] = [tuple(ids.shape) for ids, _ in chunk[-1]]
    record["steal"] = meter.percent()
    pipe.close()
    return record


class _VaryingCosts(CostModel):
    """Per-token costs of each (stage, pass), times each microbatch's own rows x length."""

    def __init__(self, per_token: list[StageCosts], tokens: list[int]) -> None:
        super().__init__(stages=tuple(per_token))
        object.__setattr__(self, "tokens", tokens)

    def duration(self, action: Any) -> float:
        return super().duration(action) * self.tokens[action.microbatch]


def _per_token_costs(spans: list, tokens_per_microbatch: int) -> list[StageCosts]:
    costs = []
    for stage in range(2):
        forward = statistics.median(d for _, kind, s, _, d in spans if s == stage and kind == "F")
        backward = statistics.median(d for _, kind, s, _, d in spans if s == stage and kind in ("B", "I"))
        weight = [d for _, kind, s, _, d in spans if s == stage and kind == "W"]
        costs.append(StageCosts(forward / tokens_per_microbatch, backward / tokens_per_microbatch,
                                (statistics.median(weight) if weight else 0.0) / tokens_per_microbatch))
    return costs


def _predicted(record: dict, shapes: list[tuple[int, int]]) -> tuple[float, float]:
    """(simulated, measured) makespan of the by_length side's last step, costs from the padded side."""
    per_token = _per_token_costs(record["padded"]["timelines"][-1], ROWS * SEQ_LEN)
    schedule = cs.build("1f1b", ranks=2, microbatches=MICROBATCHES)
    predicted = cs.simulate(schedule, _VaryingCosts(per_token, [rows * length for rows, length in shapes])).makespan
    spans = record["by_length"]["timelines"][-1]
    compute = [d for _, kind, _, _, d in spans if kind in {k.name for k in ActionKind if k.is_compute}]
    return predicted, sum(compute)


def run(args: Any) -> int:
    """Measure both sides and print the table."""
    if getattr(args, "varlen_parity", False):
        return parity_table()
    rounds, per_round = args.varlen_rounds, args.varlen_steps
    steps = _steps(args.varlen_bytes, rounds * per_round)
    shares = {side: padding_share([mb for step in chosen for mb in step]) for side, chosen in steps.items()}
    by_rank = run_ranks(_rank, 2, args=(steps, rounds), timeout_s=1200)
    record = by_rank[0]
    print(f"--varlen: pp=2 1f1b, M={MICROBATCHES}, {ROWS} x {SEQ_LEN} tokens per microbatch at most, stdlib "
          f"definitions ({args.varlen_bytes:,} bytes), {rounds} rounds x {per_round - 1} timed steps per side")
    print(f"{'side':<10} {'tokens/s':>9} {'padding':>8} {'median step s':>14} {'steal %':>8}")
    rates = {}
    for side in ("padded", "by_length"):
        times = record[side]["times"]
        rates[side] = record[side]["tokens"] / sum(times)
        steal = record["steal"].get(side)
        print(f"{side:<10} {rates[side]:>9.0f} {shares[side]:>7.1%} {statistics.median(times):>14.3f} "
              f"{'n/a' if steal is None else f'{steal:.0f}':>8}")
    print(f"by_length / padded tokens/s: {rates['by_length'] / rates['padded']:.2f}x")
    shapes = record["by_length"]["last_shapes"]
    predicted, compute = _predicted(record, shapes)
    measured = record["by_length"]["last_step_s"]
    print(f"last by_length step: microbatches (rows, length) {shapes}; simulated {predicted * 1e3:.1f} ms "
          f"(per-token costs from the padded side's last step) vs measured pipe.step {measured * 1e3:.1f} ms "
          f"(its compute actions: {compute * 1e3:.1f} ms summed over both ranks)")
    return 0


def parity_table() -> int:
    """Every built-in schedule at P=2 over every transport with variable-length microbatches: bitwise or not."""
    from conveyor.testing.references.varlen import differences, reference_varlen, train_each

    cases = sorted({(name, virtual) for name, info in cs.available().items()
                    for virtual in (info.virtual_choices or (1, 2)) if virtual in (1, 2)})
    print(f"{'schedule':<22} " + " ".join(f"{t:>15}" for t in _TRANSPORTS))
    worst = 0
    table = {transport: run_ranks(train_each, 2, args=(cases, transport), timeout_s=1200) for transport in _TRANSPORTS}
    for index, (name, virtual) in enumerate(cases):
        want = reference_varlen(name, virtual, 2)
        cells = []
        for transport in _TRANSPORTS:
            found = differences(name, [results[index] for results in table[transport]], want)
            cells.append("bitwise" if not found else f"{len(found)} differ")
            worst = max(worst, len(found))
        print(f"{f'{name} V={virtual}':<22} " + " ".join(f"{c:>15}" for c in cells))
    return 1 if worst else 0


_TRANSPORTS = ("shared_memory", "process_group", "hybrid", "ordered")

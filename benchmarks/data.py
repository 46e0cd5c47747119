"""Data only where it is read: each rank's peak RSS with a 200 MB dataset, pp=3 x dp=2.

Every rank builds the same pipeline and calls ``conveyor.parallel.data.data_loader`` with a
factory that reads a token file of ``--data-mb`` MB into memory; only the ranks that run the
first or the last stage call it. Printed per rank: its place, whether it opened the data,
and its peak RSS after building the pipeline and after two steps (``ru_maxrss``). A middle
rank's peak must not grow with the dataset.

Run through the one benchmark command:
    .venv/bin/python -m benchmarks --data [--data-mb 200]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
from pathlib import Path

import numpy
import torch

from conveyor.testing.multiprocess import run_ranks

SEQ, WIDTH = 64, 64


class _Stage(torch.nn.Module):
    def __init__(self, stage: int, num_stages: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, WIDTH) if stage == 0 else None
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 256) if stage == num_stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        x = x + self.mix(x)
        return self.head(x) if self.head is not None else x


class _Tokens(torch.utils.data.Dataset):
    """Rows of SEQ + 1 byte tokens, read whole into memory from ``path``."""

    def __init__(self, path: str) -> None:
        self.tokens = torch.from_numpy(numpy.fromfile(path, dtype=numpy.uint8))  # read, not mapped
        self.rows = self.tokens.numel() // (SEQ + 1)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int):
        row = self.tokens[index * (SEQ + 1):(index + 1) * (SEQ + 1)].long()
        return row[:-1], row[1:]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank: int, world_size: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import conveyor
    import conveyor.schedule as cs
    from conveyor.parallel.data import data_loader

    mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("pp", "dp"))
    schedule = cs.build("1f1b", ranks=3, microbatches=4)
    pp_rank = mesh.get_local_rank("pp")
    pipe = conveyor.Pipeline([_Stage(pp_rank, 3)], schedule=schedule,
                             loss_fn=lambda y, t: torch.nn.functional.cross_entropy(y.flatten(0, 1), t.flatten()),
                             transfer=conveyor.TransferOptions(timeout_s=120),
                             layout=conveyor.DistributedLayout(mesh=mesh))
    built = _peak_mib()
    loader = data_loader(pipe, lambda: _Tokens(path), batch_size=8, num_workers=0)
    batches = iter(loader) if loader is not None else None
    for _ in range(2):
        x, y = next(batches) if batches is not None else (None, None)
        pipe.step(x if pipe.needs_inputs else None, target=y if pipe.needs_target else None)
    pipe.close()
    return {"pp": pp_rank, "dp": pipe.dp_rank, "opened": loader is not None, "built": built, "peak": _peak_mib()}


def run(args: argparse.Namespace) -> int:
    """Write the token file, run the 6 ranks, print each one's peak RSS."""
    with tempfile.TemporaryDirectory(prefix="conveyor-data-bench-") as scratch:
        path = Path(scratch) / "tokens.bin"
        generator = torch.Generator().manual_seed(0)
        with path.open("wb") as out:
            for _ in range(args.data_mb):
                out.write(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=generator).numpy().tobytes())
        ranks = run_ranks(_rank, 6, args=(str(path),), timeout_s=600)
    print(f"pp=3 x dp=2, a {args.data_mb} MB dataset read whole into memory where it is opened:")
    print("| rank | replica | stage | opened the data | peak RSS after build (MiB) | peak RSS after 2 steps (MiB) |")
    print("|---|---|---|---|---|---|")
    for rank, r in enumerate(ranks):
        place = {0: "first", 1: "middle", 2: "last"}[r["pp"]]
        opened = "yes" if r["opened"] else "no"
        print(f"| {rank} | {r['dp']} | {place} | {opened} | {r['built']:.0f} | {r['peak']:.0f} |")
    return 0

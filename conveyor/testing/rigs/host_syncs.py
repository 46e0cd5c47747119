"""Counting what a training step asks of the host: object collectives and host reads of tensors.

On a GPU every ``.item()``, ``.tolist()``, ``.cpu()`` or ``bool(tensor)`` of a device tensor
waits for the device to drain, and every ``*_object*`` collective pickles through the host.
A CPU run cannot see the waits, but it can see the calls: :class:`HostSyncCounter` patches
them, so that each call made while it is active is recorded with the code that made it. On
the CPU every tensor stands in for a device tensor, so every device-to-host read and object
collective of a step is counted. It is not an upper bound of a GPU run's synchronisations: it
cannot see a host-to-device copy (a Python value written into a device tensor, ``t[i] = x``),
nor what a library does inside a kernel launch; the H100 run of ``tools/gpu_check.sh`` found one
such copy per step that this count had missed (benchmarks/README.md, ``world1-syncs``). Only
``torch.cuda.set_sync_debug_mode`` on a GPU (that row) sees every synchronisation.

Two reads are expected and reported apart, not as failures: the one draw of the user's CPU
generator that seeds a step's random streams (:mod:`conveyor.runtime.stage.rng`: a CPU tensor on
every machine, never a device one), and the non-finite check's one read of its flags, made
only when the step is given ``on_nonfinite`` (the skip decision is a Python bool).

:func:`count_rank` trains every built-in schedule (pipeline parallel, optionally with
replicas) a few steps with clipping and the non-finite check, and counts per step after the
first; ``python tools/host_syncs.py`` prints the table.

Example:
    >>> import torch
    >>> with HostSyncCounter() as counter:
    ...     _ = torch.ones(2).sum().item()
    >>> counter.host_syncs
    1
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from typing import Any

import torch

import conveyor
import conveyor.schedule as cs

_TENSOR_READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")
# (file name ending, function) of the expected reads: the CPU generator's draw, the asked-for check.
_CPU_GENERATOR = ("conveyor/runtime/stage/rng.py", "__enter__")
_ASKED = ("conveyor/parallel/clipping.py", "describe_nonfinite")


class HostSyncCounter:
    """While active, records every object collective and host read of a tensor, by caller."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()  # (what, where) -> count
        self._saved: list[tuple[Any, str, Any]] = []
        self._inside = threading.local()

    def _wrap(self, what: str, original: Any) -> Any:
        counter = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(counter._inside, "depth", 0) == 0:  # a read inside a counted call is that call's
                frame = sys._getframe(1)
                where = f"{frame.f_code.co_filename.replace(chr(92), '/')}:{frame.f_code.co_name}"
                counter.calls[(what, where)] += 1
            counter._inside.depth = getattr(counter._inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._inside.depth -= 1

        return counted

    def __enter__(self) -> HostSyncCounter:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for module in (dist, c10d):
            for name in dir(module):
                if "_object" in name and callable(getattr(module, name)) and not name.startswith("_"):
                    self._patch(module, name, f"dist.{name}")
        for name in _TENSOR_READS:
            self._patch(torch.Tensor, name, f"Tensor.{name}")
        return self

    def _patch(self, owner: Any, name: str, what: str) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original if name in vars(owner) else None))
        setattr(owner, name, self._wrap(what, original))

    def __exit__(self, *exc_info: object) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)  # inherited (Tensor's methods live on TensorBase)
            else:
                setattr(owner, name, original)
        self._saved.clear()

    def _count(self, expected: tuple[str, str] | None, objects: bool) -> int:
        """Calls of one kind (objects or reads): those made at ``expected``, or (None) the unexpected ones."""
        return sum(n for (what, where), n in self.calls.items() if objects == what.startswith("dist.")
                   and (_made_at(where, expected) if expected is not None else _unexpected(what, where)))

    @property
    def object_collectives(self) -> int:
        """Calls of ``torch.distributed.*_object*``."""
        return self._count(None, objects=True)

    @property
    def host_syncs(self) -> int:
        """Host reads of tensors other than the two expected ones."""
        return self._count(None, objects=False)

    @property
    def generator_draws(self) -> int:
        """Reads of the CPU generator's draw (one per step with random streams)."""
        return self._count(_CPU_GENERATOR, objects=False)

    @property
    def asked_reads(self) -> int:
        """The non-finite check's reads (one per step given ``on_nonfinite``)."""
        return self._count(_ASKED, objects=False)

    def unexpected(self) -> list[str]:
        """Each unexpected call as ``what at file:function xN``."""
        return [f"{what} at {where} x{n}"
                for (what, where), n in sorted(self.calls.items()) if _unexpected(what, where)]


def _made_at(where: str, place: tuple[str, str]) -> bool:
    file_name, _, function = where.rpartition(":")
    return file_name.endswith(place[0]) and function == place[1]


def _unexpected(what: str, where: str) -> bool:
    return what.startswith("dist.") or not (_made_at(where, _CPU_GENERATOR) or _made_at(where, _ASKED))


def count_rank(rank: int, world_size: int, schedules: list[str], transports: list[str], dp: int = 1,
               data_parallel: str | None = None, steps: int = 3) -> list[dict]:
    """A rank's counts for every (schedule, transport): per step after the first, with clipping
    and ``on_nonfinite="skip"`` in every step (see the module docstring)."""
    from conveyor.parallel.mesh import pipeline_mesh
    from conveyor.testing.models import lm_loss
    from conveyor.testing.references.data_parallel import MLPStage, make_batch

    mesh = pipeline_mesh(world_size // dp) if dp > 1 else None
    pp_rank = mesh.get_local_rank("pp") if mesh is not None else rank
    dp_rank = mesh.get_local_rank("dp") if mesh is not None else 0
    rows = []
    for name in schedules:
        virtual = cs.available()[name].default_virtual
        schedule = cs.build(name, ranks=world_size // dp, microbatches=2 * (world_size // dp), virtual=virtual)
        for transport in transports:
            modules = [MLPStage(s, schedule.num_stages) for s in schedule.stages_of(pp_rank)]
            pipe = conveyor.Pipeline(modules, schedule, lm_loss,
                                     transfer=conveyor.TransferOptions(transport=transport, timeout_s=60),
                                     layout=conveyor.DistributedLayout(mesh=mesh, data_parallel=data_parallel))
            optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
            counter = HostSyncCounter()
            for step in range(steps):
                ids, targets = (t.chunk(dp)[dp_rank] for t in make_batch(seed=step))
                with counter if step > 0 else contextlib.nullcontext():
                    pipe.step(ids if pipe.needs_inputs else None, target=targets if pipe.needs_target else None,
                              on_nonfinite="skip")
                    pipe.clip_grad_norm_(1.0)
                optimizer.step()
                optimizer.zero_grad()
            pipe.close()
            per_step = steps - 1
            rows.append({"schedule": name, "transport": transport, "rank": rank,
                         "object_collectives": counter.object_collectives / per_step,
                         "host_syncs": counter.host_syncs / per_step,
                         "asked_reads": counter.asked_reads / per_step,
                         "generator_draws": counter.generator_draws / per_step,
                         "unexpected": counter.unexpected()})
    return rows


def table(rows: list[dict]) -> str:
    """The counts as a table, one line per (schedule, transport, data parallel), worst rank shown.

    Example:
        >>> print(table([{"schedule": "1f1b", "transport": "shared_memory", "rank": 0, "object_collectives": 0.0,
        ...               "host_syncs": 0.0, "asked_reads": 1.0, "generator_draws": 1.0, "unexpected": []}]))
        schedule          transport       dp    objects/step  syncs/step  asked/step  cpu draws/step
        1f1b              shared_memory   -     0             0           1           1
    """
    lines = [f"{'schedule':<17} {'transport':<15} {'dp':<5} {'objects/step':<13} {'syncs/step':<11} "
             f"{'asked/step':<11} cpu draws/step"]
    worst: dict[tuple, dict] = {}
    for row in rows:
        key = (row["schedule"], row["transport"], row.get("dp", "-"))
        seen = worst.setdefault(key, dict(row))
        for field in ("object_collectives", "host_syncs", "asked_reads", "generator_draws"):
            seen[field] = max(seen[field], row[field])
    for (name, transport, dp), row in worst.items():
        lines.append(f"{name:<17} {transport:<15} {dp!s:<5} {row['object_collectives']:<13g} "
                     f"{row['host_syncs']:<11g} {row['asked_reads']:<11g} {row['generator_draws']:g}")
    return "\n".join(lines)


def main() -> None:
    """Print the table for every built-in schedule and both transports, and with replicas (dp=2)."""
    from conveyor.testing.multiprocess import run_ranks

    names = sorted(cs.available())
    rows = [row for ranks in run_ranks(count_rank, 2, args=(names, ["process_group", "shared_memory", "ordered"]),
                                       timeout_s=280) for row in ranks]
    for kind in ("ddp", "fsdp"):
        for ranks in run_ranks(count_rank, 4, args=(["1f1b", "zbv"], ["shared_memory"], 2, kind), timeout_s=280):
            rows += [{**row, "dp": f"2 {kind}"} for row in ranks]
    print(table(rows))
    for row in rows:
        if row["unexpected"]:
            print(row["schedule"], row["transport"], row["rank"], row["unexpected"])


if __name__ == "__main__":
    main()

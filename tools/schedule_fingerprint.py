"""Canonical record of what the schedule layer prints: ``conveyor simulate --json`` for every built-in
at P in {2, 4, 8}, M in {P, 2P, 4P} (and V where a schedule takes more than one), every float as
``float.hex``, one line per case; plus the same with latency and uneven costs. Diff two runs to show
that a refactor changed no byte.

    PYTHONPATH=$PWD .venv/bin/python tools/schedule_fingerprint.py > simulate.txt
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def _hexed(value: object) -> object:
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {key: _hexed(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_hexed(item) for item in value]
    return value


def cases() -> list[list[str]]:
    """Every command line (after ``conveyor simulate``) the record holds."""
    import conveyor.schedule as cs

    out = []
    for name, info in cs.available().items():
        virtuals = info.virtual_choices if info.virtual_choices is not None else (1, 2, 3)
        for P in (2, 4, 8):
            for M in (P, 2 * P, 4 * P):
                for V in virtuals:
                    base = ["--schedule", name, "--ranks", str(P), "--microbatches", str(M), "--virtual", str(V)]
                    out.append(base)
                    out.append([*base, "--latency", "0.25", "--costs", "1,2,1.5"])
    return out


def main() -> int:
    from conveyor.cli import main as cli

    for argv in cases():
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                code = cli(["simulate", *argv, "--json"])
            text = json.dumps(_hexed(json.loads(buffer.getvalue())), sort_keys=True) if code == 0 else f"exit {code}"
        except Exception as error:  # noqa: BLE001 - the record keeps what a failing case said
            text = f"{type(error).__name__}: {error}"
        print(" ".join(argv), "=>", text)
    for line in deeper():
        print(line)
    return 0


def deeper() -> list[str]:
    """Per built-in and size: a digest of every span (compute-only and lowered, with latency) and of
    the lowered and merged programs the ranks run."""
    import hashlib

    import conveyor.schedule as cs
    from conveyor.schedule.passes import executable

    lines = []
    for argv in cases()[::2]:
        name, P, M, V = argv[1], int(argv[3]), int(argv[5]), int(argv[7])
        try:
            sched = cs.build(name, ranks=P, microbatches=M, virtual=V)
        except Exception as error:  # noqa: BLE001
            lines.append(f"{name} P={P} M={M} V={V} => {type(error).__name__}: {error}")
            continue
        costs = cs.CostModel.uniform(sched.num_stages, 1.0, 2.0, 1.5, latency=0.25)
        runs = executable(sched)
        digests = []
        for target, model in ((sched, None), (sched, costs), (runs.train, costs), (runs.train, None)):
            timeline = cs.simulate(target, model)
            spans = sorted((s.rank, str(s.action), s.start.hex(), s.end.hex()) for s in timeline.spans)
            digests.append(hashlib.sha1(repr(spans).encode()).hexdigest()[:16])
        programs = [" ".join(map(str, p)) for p in (*runs.train.programs, *runs.eval.programs)]
        digests.append(hashlib.sha1(repr(programs).encode()).hexdigest()[:16])
        channels = (sorted(runs.train_in_order), sorted(runs.eval_in_order))
        digests.append(hashlib.sha1(repr(channels).encode()).hexdigest()[:16])
        lines.append(f"{name} P={P} M={M} V={V} => {' '.join(digests)}")
    return lines


if __name__ == "__main__":
    sys.exit(main())

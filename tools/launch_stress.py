"""Launch a short pipelined training script through torchrun N times and count the clean exits.

    .venv/bin/python tools/launch_stress.py                 # 300 launches (about 40 min on 2 cores)
    .venv/bin/python tools/launch_stress.py --launches 9    # what CI runs (tests/e2e/test_launches.py)

Each launch cycles through P in {2, 4}, the three transports, three schedules and six teardown
orders (see conveyor/testing/rigs/launch_check.py); exit code 0 when every launch was clean.
"""

from __future__ import annotations

import argparse
import sys

from conveyor.testing.rigs.launches import run_cases, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=300)
    parser.add_argument("--timeout-s", type=float, default=180.0, help="a launch running longer counts as hung")
    args = parser.parse_args()
    results = run_cases(args.launches, report=lambda line: print(line, flush=True), timeout_s=args.timeout_s)
    print(summary(results))
    return 0 if all(r.clean for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

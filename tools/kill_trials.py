"""Kill one rank of a 4-rank training run at each point, with each death, over each transport.

    .venv/bin/python tools/kill_trials.py --trials 20     # the issue's count (about 45 min on 2 cores)
    .venv/bin/python tools/kill_trials.py --trials 1      # one of each (about 3 min)

Points: in a stage's forward, in its backward, while waiting for input, on the way into
clip_grad_norm_'s exchange, in the user's optimizer step. Deaths: SIGKILL, SIGTERM,
MemoryError. A trial passes when every survivor exits non-zero within 30 s of the death,
naming the dead rank, with no process left over. Exit code 0 when every trial passed.
"""

from __future__ import annotations

import argparse
import sys

from conveyor.testing.rigs.kill_trials import run_cases, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1, help="trials of each point x death x transport")
    args = parser.parse_args()
    results = run_cases(args.trials, report=lambda line: print(line, flush=True))
    print(summary(results))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

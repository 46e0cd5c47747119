"""Print a test run's time per file, from the JUnit XML that pytest writes with ``--junitxml``.

``tools/test.sh`` writes one such file per run and prints this table after it, so each run of the
suite shows where its time went file by file (setup, call and teardown of every test in the file,
summed); ``--durations`` shows single tests only. With two xdist workers the wall time is about
half the summed total when the workers stay equally busy.

Usage::

    python tools/file_times.py .pytest-times.xml            # the 40 slowest files and the total
    python tools/file_times.py .pytest-times.xml --top 0    # every file

Example:
    >>> import io
    >>> xml = ('<testsuites><testsuite>'
    ...        '<testcase classname="tests.runtime.test_a" name="t1" time="2.5"/>'
    ...        '<testcase classname="tests.runtime.test_a" name="t2" time="1.0"/>'
    ...        '<testcase classname="tests.test_b" name="t" time="0.25"/>'
    ...        '</testsuite></testsuites>')
    >>> per_file(io.StringIO(xml))
    {'tests/runtime/test_a.py': (3.5, 2), 'tests/test_b.py': (0.25, 1)}
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from typing import IO


def per_file(source: str | IO[str]) -> dict[str, tuple[float, int]]:
    """Seconds and test count per test file, slowest first, from a pytest JUnit XML report.

    pytest names a test's module in ``classname`` (``tests.runtime.test_x``, or
    ``tests.runtime.test_x.TestClass`` for a test in a class); the file is the longest dotted prefix
    whose last part starts with ``test_``.
    """
    totals: dict[str, tuple[float, int]] = {}
    for case in ElementTree.parse(source).iter("testcase"):
        parts = case.get("classname", "").split(".")
        ends = [i for i, part in enumerate(parts) if part.startswith("test_") or part == "conftest"]
        module = parts[: ends[-1] + 1] if ends else parts
        path = "/".join(module) + ".py"
        seconds, count = totals.get(path, (0.0, 0))
        totals[path] = (seconds + float(case.get("time", 0.0)), count + 1)
    return dict(sorted(totals.items(), key=lambda item: -item[1][0]))


def table(totals: dict[str, tuple[float, int]], top: int) -> str:
    """The table ``main`` prints: the ``top`` slowest files (all for 0), then the total."""
    shown = list(totals.items())[: top or None]
    lines = [f"{'seconds':>8}  {'tests':>5}  file"]
    lines += [f"{seconds:8.1f}  {count:5d}  {path}" for path, (seconds, count) in shown]
    if len(shown) < len(totals):
        rest = list(totals.values())[len(shown):]
        lines.append(f"{sum(s for s, _ in rest):8.1f}  {sum(c for _, c in rest):5d}  "
                     f"({len(rest)} other files)")
    total_s = sum(s for s, _ in totals.values())
    lines.append(f"{total_s:8.1f}  {sum(c for _, c in totals.values()):5d}  total (summed over the workers)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="the JUnit XML file pytest wrote (--junitxml)")
    parser.add_argument("--top", type=int, default=40, help="how many files to list (0: all)")
    args = parser.parse_args(argv)
    try:
        totals = per_file(args.report)
    except (OSError, ElementTree.ParseError) as error:
        print(f"file_times: cannot read {args.report} as pytest's JUnit XML ({error}); "
              "run pytest with --junitxml=PATH first", file=sys.stderr)
        return 2
    print(table(totals, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

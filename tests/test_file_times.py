"""``tools/file_times.py``, the per-file table ``tools/test.sh`` prints: each file's tests summed, a test
in a class counted under its file, and the files past the top folded into one line with the total; and the
list of slowest files that ``tests/conftest.py`` starts first names files that exist."""

from __future__ import annotations

import doctest
import importlib.util
import io
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "file_times.py"
_spec = importlib.util.spec_from_file_location("file_times", TOOL)
file_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(file_times)

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.runtime.test_slow" name="test_a[2]" time="30.5"/>
<testcase classname="tests.runtime.test_slow.TestGroup" name="test_b" time="9.5"/>
<testcase classname="tests.test_fast" name="test_c" time="0.125"/>
<testcase classname="tests.schedule.test_middle" name="test_d" time="2.0"><skipped/></testcase>
</testsuite></testsuites>"""


def test_each_files_tests_are_summed_slowest_first():
    totals = file_times.per_file(io.StringIO(REPORT))
    assert totals == {"tests/runtime/test_slow.py": (40.0, 2), "tests/schedule/test_middle.py": (2.0, 1),
                      "tests/test_fast.py": (0.125, 1)}
    assert list(totals) == ["tests/runtime/test_slow.py", "tests/schedule/test_middle.py", "tests/test_fast.py"]


def test_the_table_folds_the_files_past_the_top_and_ends_with_the_total():
    lines = file_times.table(file_times.per_file(io.StringIO(REPORT)), top=1).splitlines()
    assert lines[1].split() == ["40.0", "2", "tests/runtime/test_slow.py"]
    assert lines[2].split() == ["2.1", "2", "(2", "other", "files)"]
    assert lines[3].split()[:3] == ["42.1", "4", "total"]


def test_an_unreadable_report_says_how_to_make_one(tmp_path, capsys):
    assert file_times.main([str(tmp_path / "missing.xml")]) == 2
    assert "--junitxml" in capsys.readouterr().err


def test_the_docstring_example_holds():
    result = doctest.testmod(file_times)
    assert result.attempted > 0 and result.failed == 0


def test_the_slowest_files_that_go_first_exist():
    from tests.conftest import SLOWEST_FILES_FIRST

    root = TOOL.parents[1]
    assert [path for path in SLOWEST_FILES_FIRST if not (root / path).is_file()] == []

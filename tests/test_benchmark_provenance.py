"""Every benchmark result that is written records the commit it measured, the command, the CPU steal
and the load average; so do the results kept in benchmarks/results/."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import compare, plan, provenance
from benchmarks.cases import Settings
from benchmarks.report import markdown, summarize
from benchmarks.steal import StealMeter

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_a_run_records_commit_command_steal_and_load(monkeypatch):
    readings = iter([(100, 1000), (130, 1100)])  # (steal, wanted) ticks: 30 of 100 stolen meanwhile
    monkeypatch.setattr(StealMeter, "read", staticmethod(lambda: next(readings)))
    loads = iter([(1.5, 1.0, 0.5), (3.25, 2.0, 1.0)])
    monkeypatch.setattr(provenance.os, "getloadavg", lambda: next(loads))
    run = provenance.RunProvenance(["--plan", "--predict-ranks", "2,4"]).start()
    record = run.record()
    assert set(record) == set(provenance.FIELDS)
    assert record["command"] == "python -m benchmarks --plan --predict-ranks 2,4"
    assert record["commit"].split(" + ")[0] == _head()
    assert record["load_average_start"] == [1.5, 1.0, 0.5] and record["load_average_end"] == [3.25, 2.0, 1.0]
    assert record["steal_pct"] == 30.0
    assert "on commit " + record["commit"] in provenance.line(record) and "CPU steal 30.0%" in provenance.line(record)


def test_without_git_the_commit_says_it_is_unknown(tmp_path):
    assert provenance.git_commit(tmp_path).startswith("unknown: ")


def test_the_comparison_records_its_commit_and_command_and_shows_them():
    settings = Settings(repeats=1, warmup=0, cost_repeats=1, step_timeout_s=1.0, libraries=("conveyor",),
                        conveyor_options={})
    meta = compare._meta(argparse.Namespace(sleep_ms=5.0), ["--compare", "--quick"], settings)
    assert meta["command"] == "python -m benchmarks --compare --quick"
    assert meta["commit"].split(" + ")[0] == _head()
    assert len(meta["load_average_start"]) == 3  # the end figures and steal_pct are added as the cases run
    text = markdown({"meta": meta, "records": []}, summarize({"meta": meta, "records": []}))
    assert f"`python -m benchmarks --compare --quick` on commit {meta['commit']}" in text


def test_the_plan_benchmark_writes_its_provenance_into_both_files(tmp_path):
    kept = json.loads((RESULTS / "plan" / "plan.json").read_text())
    meta = {**kept["meta"], **provenance.RunProvenance(["--plan"]).start().record()}
    plan._write(tmp_path, meta, kept["cases"])
    written = json.loads((tmp_path / "plan.json").read_text())["meta"]
    assert {field: written[field] for field in provenance.FIELDS} == {field: meta[field] for field in provenance.FIELDS}
    assert f"Made by {provenance.line(meta)}." in (tmp_path / "plan.md").read_text()


@pytest.mark.parametrize("result", ["compare.json", "plan/plan.json"])
def test_every_kept_result_says_how_it_was_made(result):
    meta = json.loads((RESULTS / result).read_text())["meta"]
    for field in ("command", "commit", "load_average_start", "load_average_end", "steal_pct"):
        assert meta.get(field) not in (None, "", []), f"{result}: meta[{field!r}] is missing"

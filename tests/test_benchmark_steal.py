"""The benchmark's CPU-steal meter: per-side shares of the CPU time wanted, and how the report shows them."""

from __future__ import annotations

import json

from benchmarks.report import compact, markdown, summarize, write_summary
from benchmarks.steal import StealMeter


def test_steal_is_summed_per_side_over_its_windows(monkeypatch):
    # (steal, wanted) ticks since boot, as successive reads of /proc/stat return them.
    readings = iter([(100, 1000), (110, 1040), (110, 1040), (150, 1140), (150, 1140), (150, 1200)])
    monkeypatch.setattr(StealMeter, "read", staticmethod(lambda: next(readings)))
    meter = StealMeter()
    with meter.window("conveyor"):  # 10 of 40 wanted ticks stolen
        pass
    with meter.window("torch"):  # 40 of 100
        pass
    with meter.window("conveyor"):  # 0 of 60
        pass
    assert meter.percent() == {"conveyor": 10.0, "torch": 40.0}


def test_no_proc_stat_means_no_figure(monkeypatch):
    monkeypatch.setattr(StealMeter, "read", staticmethod(lambda: None))
    meter = StealMeter()
    with meter.window("conveyor"):
        pass
    assert meter.percent() == {}


def test_the_real_proc_stat_reads_as_ticks():
    reading = StealMeter.read()
    if reading is not None:  # Linux
        steal, wanted = reading
        assert 0 <= steal <= wanted


def _record() -> dict:
    return {
        "workload": "emulated", "schedule": "1f1b", "ranks": 2, "virtual": 1, "stages": 2,
        "microbatches": 8, "ideal_ms": 100.0, "conveyor_ms": 101.0, "torch_ms": 105.0,
        "conveyor_status": "ok", "torch_status": "ok", "conveyor_vs_ideal": 1.01,
        "torch_vs_ideal": 1.05, "conveyor_vs_torch": 101 / 105,
        "steal_pct": {"conveyor": 31.4, "torch": 12.0, "ideal": 2.0},
        "conveyor_steps_ms": [100.0, 101.0, 102.0], "torch_steps_ms": [104.0, 105.0, 106.0],
        "conveyor_rss_mb": [180.25, 183.5], "torch_rss_mb": [250.0, 251.0],
        "conveyor_rss_growth_mb": [20.0, 21.5], "torch_rss_growth_mb": [30.0, 29.0],
    }


def test_the_report_warns_when_the_host_took_much_of_the_cpu():
    record = _record()
    results = {"meta": {"steal_pct": 25.0, "cpus": 2}, "records": [record]}
    text = markdown(results, summarize(results))
    assert "The host took 25% of the CPU time" in text
    assert "| 31 / 12 / 2 |" in text
    quiet = {"meta": {"steal_pct": 3.0, "cpus": 2}, "records": [record]}
    assert "The host took" not in markdown(quiet, summarize(quiet))


def test_the_summary_kept_in_git_renders_what_the_full_results_render(tmp_path):
    results = {"meta": {"steal_pct": 25.0, "cpus": 2}, "records": [_record()]}
    path = tmp_path / "compare.json"
    write_summary(results, path)
    kept = json.loads(path.read_text())
    (record,) = kept["records"]
    assert "conveyor_steps_ms" not in record  # every step stays in the raw file only
    assert (record["conveyor_rss_mb"], record["torch_rss_growth_mb"]) == (183.5, 30.0)
    assert record["steal_pct"] == {"conveyor": 31.4, "torch": 12.0, "ideal": 2.0}
    assert markdown(kept, summarize(kept)) == markdown(results, summarize(results))
    assert "| 184 (+22) / 251 (+30) |" in markdown(kept, summarize(kept))
    assert compact(kept)["records"] == kept["records"]

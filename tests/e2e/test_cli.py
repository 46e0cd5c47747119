"""The `conveyor` command as a user runs it: in-process through main(argv), plus one real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import conveyor.schedule as cs
from conveyor.cli import main
from conveyor.errors import ScheduleError
from conveyor.schedule import registry
from conveyor.schedule.builtin.one_f_one_b import one_f_one_b
from conveyor.schedule.compare import run_compare

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def simulate_json(capsys, *extra: str) -> dict:
    code, out, err = run(capsys, "simulate", *extra, "--json")
    assert (code, err) == (0, "")
    lines = out.strip().splitlines()
    assert len(lines) == 1  # exactly one JSON object
    return json.loads(lines[0])


@pytest.fixture
def fussy_schedule(monkeypatch):
    """A registered schedule that needs M to be a multiple of P (removed again after the test)."""

    def build(num_ranks: int, num_microbatches: int, virtual: int) -> cs.Schedule:
        if num_microbatches % num_ranks:
            raise ScheduleError(
                f"fussy needs microbatches to be a multiple of ranks, got M={num_microbatches}, "
                f"P={num_ranks}\nsecond line of detail"
            )
        return one_f_one_b(num_ranks, num_microbatches, virtual)

    info = registry.ScheduleInfo("fussy", build, "test-only schedule", 1, None)
    monkeypatch.setitem(registry._REGISTRY, "fussy", info)
    return info


def test_schedules_lists_every_registered_schedule(capsys, fussy_schedule):
    code, out, err = run(capsys, "schedules")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    names = list(cs.available())
    assert [line.split()[0] for line in lines] == names
    assert "gpipe" in names and "1f1b" in names
    by_name = dict(zip(names, lines))
    assert by_name["1f1b"].split()[1] == "V=1"
    assert "Narayanan" in by_name["1f1b"]
    assert by_name["fussy"].split()[1:4] == ["V>=1", "(default", "1)"]


def test_simulate_json_for_1f1b_p4_m8(capsys):
    result = simulate_json(capsys, "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8")
    assert result["schedule"] == "1f1b"
    assert (result["ranks"], result["virtual"], result["stages"], result["microbatches"]) == (
        4,
        1,
        4,
        8,
    )
    assert result["costs"] == {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}
    assert result["makespan"] == 33.0  # (M + P - 1) x (F + B + W)
    assert result["bubble_ratio"] == 3 / 11  # (P - 1) / (M + P - 1)
    assert result["peak_activations"] == [4, 3, 2, 1]
    assert result["busy"] == [24.0] * 4
    assert (result["png"], result["trace"]) == (None, None)


def test_simulate_gpipe_with_costs_and_latency(capsys):
    result = simulate_json(capsys, "--schedule", "gpipe", "-p", "2", "-m", "3", "--costs", "1,2,1")
    assert result["makespan"] == 16.0  # (3 + 2 - 1) x (1 + 2 + 1)
    assert result["bubble_ratio"] == 0.25
    assert result["peak_activations"] == [3, 3]
    # One message latency per rank crossing: 1 on the way down, 1 on the way back.
    slow = simulate_json(
        capsys, "--schedule", "gpipe", "-p", "2", "-m", "3", "--costs", "1,2,1", "--latency", "1"
    )
    assert slow["makespan"] == 18.0
    assert slow["latency"] == 1.0


def test_simulate_text_summary_and_files(capsys, tmp_path):
    png, trace = tmp_path / "pics" / "1f1b.png", tmp_path / "1f1b.json"
    code, out, err = run(
        capsys, "simulate", "--schedule", "1f1b", "-p", "4", "-m", "8",
        "--png", str(png), "--trace", str(trace),
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert "makespan          33 units" in out
    assert "bubble ratio      27.3%" in out
    assert "peak activations  r0:4 r1:3 r2:2 r3:1" in out
    assert f"wrote {png}" in out and f"wrote {trace}" in out
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 64


def test_compare_lists_every_schedule_and_draws_one_png(capsys, tmp_path, fussy_schedule):
    png = tmp_path / "compare.png"
    code, out, err = run(capsys, "simulate", "--compare", "-p", "4", "-m", "6", "--png", str(png))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    names = list(cs.available())
    assert lines[1].split() == ["schedule", "V", "makespan", "bubble", "peak", "act.", "=", "x", "model/P"]
    rows = dict(zip(names, lines[2 : 2 + len(names)]))
    assert [line.split()[0] for line in rows.values()] == names
    assert lines[2 + len(names)].startswith("peak act.: live (stage, microbatch) activations")
    assert rows["1f1b"].split() == ["1f1b", "1", "27", "33.3%", "4", "4"]
    assert rows["gpipe"].split() == ["gpipe", "1", "27", "33.3%", "6", "6"]
    assert rows["fussy"].split()[:6] == ["fussy", "1", "-", "-", "-", "-"]
    assert rows["fussy"].endswith(
        "cannot serve: fussy needs microbatches to be a multiple of ranks, got M=6, P=4"
    )
    assert f"wrote {png}" in out
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_compare_json_and_run_compare(capsys, tmp_path, fussy_schedule):
    code, out, _ = run(
        capsys, "simulate", "--compare", "-p", "2", "-m", "4", "--virtual", "3",
        "--png", str(tmp_path / "c.png"), "--trace", str(tmp_path / "c.json"), "--json",
    )  # fmt: skip
    assert code == 0
    result = json.loads(out)
    by_name = {row["schedule"]: row for row in result["schedules"]}
    assert set(by_name) == set(cs.available())
    # fussy takes any V, so it runs the asked V=3; 1f1b only takes 1 and keeps it.
    assert by_name["fussy"]["virtual"] == 3 and by_name["1f1b"]["virtual"] == 1
    assert by_name["1f1b"]["peak_activations"] == [2, 1]
    assert (tmp_path / "c.json").exists()

    rows = run_compare(4, 8, png=None)
    assert [(r["schedule"], r["makespan"], r["peak_activations_max"]) for r in rows[:2]] == [
        ("gpipe", 33.0, 8),
        ("1f1b", 33.0, 4),
    ]
    assert all(r["error"] is None for r in rows if r["schedule"] in {"gpipe", "1f1b"})


def test_compare_simulates_the_same_model_whatever_v():
    """With V stages per rank each stage gets costs / V, so makespans compare directly."""
    by_name = {r["schedule"]: r for r in run_compare(4, 8, costs=(1.0, 2.0, 1.0), png=None)}
    interleaved = by_name["interleaved-1f1b"]
    assert (interleaved["virtual"], interleaved["stage_costs"]) == (2, [0.5, 1.0, 0.5])
    assert interleaved["bubble_ratio"] == pytest.approx(3 / 19)  # (P-1)/(V*M+P-1)
    assert interleaved["makespan"] == 38.0  # (V*M + P - 1) x (F + B + W) / V
    assert interleaved["peak_activation_share"] == interleaved["peak_activations_max"] / 2
    assert by_name["1f1b"]["makespan"] == 44.0  # (M + P - 1) x (F + B + W)
    raw = {r["schedule"]: r for r in run_compare(4, 8, costs=(1.0, 2.0, 1.0), png=None, same_model=False)}
    assert raw["interleaved-1f1b"]["makespan"] == 76.0


def test_readme_demo_command_trains_bitwise_equal_and_draws_both_pictures(tmp_path):
    """The README's demo command, as a new user runs it (shorter: 2 steps): `conveyor train configs/demo.yaml`."""
    root = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "demo"
    done = subprocess.run(
        ["bash", "tools/demo.sh", "train.steps=2", f"run.dir={run_dir}"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for name in cs.available():
        assert any(line.startswith(name + " ") for line in lines)
    assert "wrote out/compare.png" in lines
    assert "conveyor train: 2 local ranks (pp=2 x dp=1)" in done.stdout  # the one launcher of `conveyor train`
    compared = [line for line in lines if line.startswith(("step 1: ", "step 2: "))]
    assert len(compared) == 2 and all(" | one device " in line and " grad norm " in line for line in compared)
    assert all(line.endswith("bitwise equal") for line in compared), compared
    assert lines[-1] == (
        "parity: all 2 steps bitwise equal to single-device training (loss and gradient norm, torch.equal)"
    )
    assert any(line.startswith("bubble (last step): measured ") for line in lines)
    assert (run_dir / "timeline.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (root / "out" / "compare.png").read_bytes()[:8] == PNG_SIGNATURE


BAD_INPUTS = [
    (["simulate", "--schedule", "nope", "-p", "4", "-m", "8"], "unknown schedule 'nope'; known schedules: 1f1b"),
    (["simulate", "--schedule", "1f1b", "-p", "0", "-m", "8"],
     "argument --ranks/-p: must be a positive integer (>= 1), got 0"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "x"],
     "argument --microbatches/-m: expected a positive integer, got 'x'"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "-v", "2"],
     "schedule '1f1b' runs 1 stage(s) per rank, not virtual=2"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--costs", "1,-1,1"],
     "argument --costs: the input-gradient cost must be a finite number >= 0, got '-1'"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--costs", "-1,1,1"],
     "argument --costs: the forward cost must be a finite number >= 0, got '-1'"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--costs", "1,1"],
     "argument --costs: expected three comma-separated numbers F,B,W"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--costs", "1,a,1"],
     "argument --costs: the input-gradient cost must be a number, got 'a'"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--costs"], "argument --costs: expected one argument"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--latency", "-1"],
     "argument --latency: must be a finite number >= 0, got '-1'"),
    (["simulate", "--schedule", "1f1b", "-m", "8"], "the following arguments are required: --ranks/-p"),
    (["simulate", "-p", "4", "-m", "8"], "one of the arguments --schedule --compare is required"),
    (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--costs", "1e308,1e308,1e308"],
     "the simulated timeline overflows a float"),
    (["simulate", "--compare", "-p", "4", "-m", "8", "--latency", "1e308"], "a simulated makespan overflows a float"),
    (["simulate", "--schedule", "1f1b", "-p", "100000000000000000000", "-m", "1"],
     "100000000000000000000 ranks x 1 microbatches means about 6e+20 actions"),
    (["demo", "parallel.schedule=nope"], "parallel.schedule='nope': expected one of gpipe, 1f1b"),
    (["demo", "parallel.pp=0"], "parallel.pp=0: expected"),
    ([], "the following arguments are required: command"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS, ids=[message for _, message in BAD_INPUTS])
def test_bad_input_exits_2_with_the_rule(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.rstrip().splitlines()[-1].startswith(f"conveyor: error: {message}")
    assert "Traceback" not in err


def test_a_png_path_without_suffix_reports_the_file_it_wrote(capsys, tmp_path):
    result = simulate_json(capsys, "--schedule", "1f1b", "-p", "2", "-m", "2", "--png", str(tmp_path / "plan"))
    assert result["png"] == str(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes().startswith(PNG_SIGNATURE)


def test_a_folder_as_png_path_is_an_error(capsys, tmp_path):
    code, out, err = run(capsys, "simulate", "--schedule", "1f1b", "-p", "2", "-m", "2", "--png", str(tmp_path))
    assert (code, out) == (2, "")
    assert "is a folder; give a file name such as" in err
    assert not tmp_path.with_suffix(".png").exists()


def test_unwritable_output_is_an_error_not_a_traceback(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(
        capsys, "simulate", "--schedule", "1f1b", "-p", "2", "-m", "2", "--trace", str(blocker / "t.json")
    )
    assert code == 2
    assert err.startswith("conveyor: error: cannot write output:")


def test_installed_console_script_runs():
    script = Path(sys.executable).parent / "conveyor"
    done = subprocess.run(
        [str(script), "simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["bubble_ratio"], result["peak_activations"]) == (3 / 11, [4, 3, 2, 1])
    bad = subprocess.run(
        [str(script), "simulate", "--schedule", "nope", "-p", "4", "-m", "8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("conveyor: error: unknown schedule 'nope'")
    assert "Traceback" not in bad.stderr

"""Schedules as text and as torch-compatible CSV: round trips, torch's own files, clear errors.

``data/torch/`` holds CSVs written by torch.distributed.pipelining's schedule
classes (``_dump_csv``, P=4, M=8); ``test_the_stored_csvs_are_what_torch_writes``
regenerates them with torch and compares, so they stay torch's. To refresh
them after a torch upgrade: ``.venv/bin/python -m tests.schedule.test_csv``.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.schedule.csv_io import UNSUPPORTED_KINDS
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule

DATA = Path(__file__).parent / "data" / "torch"
BUILTINS = ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2", "zbv", "dualpipev"]
TORCH_RANKS, TORCH_MICROBATCHES = 4, 8
# file stem: (torch schedule class, placement of its stages)
TORCH_SCHEDULES = {
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "looped"),
    "looped_bfs": ("ScheduleLoopedBFS", "looped"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "looped"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", "vshape"),
    "dualpipev": ("ScheduleDualPipeV", "vshape"),
}


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_round_trip_through_csv_and_text(name):
    for num_ranks, num_microbatches in [(1, 2), (2, 3), (4, 8)]:
        sched = cs.build(name, ranks=num_ranks, microbatches=num_microbatches)
        assert cs.loads_csv(cs.dumps_csv(sched), name=name) == sched
        lowered = cs.lower(sched)
        assert cs.loads_csv(cs.dumps_csv(sched, "compute_comms"), name=name, format="compute_comms") == lowered
        assert cs.loads_csv(cs.dumps_csv(lowered, "compute_only"), name=name) == sched
        assert cs.parse_schedule(str(sched)) == sched
        assert cs.parse_schedule(str(lowered)) == lowered


def test_csv_is_torchs_layout_one_row_per_rank():
    sched = cs.build("1f1b", ranks=2, microbatches=2)
    assert cs.dumps_csv(sched) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    assert cs.dumps_csv(sched, "compute_comms") == (
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
        "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n"
    )


def test_save_and_load_a_file(tmp_path):
    sched = cs.build("zbv", ranks=3, microbatches=4)
    path = tmp_path / "my-zbv.csv"
    cs.save_csv(sched, path)
    loaded = cs.load_csv(path)
    assert loaded.name == "my-zbv"
    assert loaded.placement == Placement.vshape(3)
    assert loaded.programs == sched.programs
    assert cs.load_csv(path, name="zbv") == sched


def test_empty_cells_are_idle_steps_and_the_microbatch_count_can_be_given():
    sched = cs.loads_csv("0F0,,,0B0\n,1F0,1B0,\n", num_microbatches=1, name="t")
    assert [[str(a) for a in p] for p in sched.programs] == [["0F0", "0B0"], ["1F0", "1B0"]]
    padded = cs.loads_csv("0F0,0B0\n1F0,1B0\n", num_microbatches=3, name="t")
    assert padded.num_microbatches == 3  # inferred would be 1; verify() then reports the missing ones
    with pytest.raises(ScheduleError, match="stage 0 microbatch 1 is never forwarded"):
        cs.verify(padded)


def test_the_text_form_reads_back_with_or_without_its_header():
    text = "# my schedule\nrank 0: 0F0 0B0\n\nrank 1: 1F0 1B0  # the last stage\n"
    sched = cs.parse_schedule(text, name="mine")
    assert str(sched) == "schedule mine: 2 ranks, 2 stages, 1 microbatches\nrank 0: 0F0 0B0\nrank 1: 1F0 1B0"
    assert cs.parse_schedule("0F0 0B0\n1F0 1B0") == Schedule.from_programs(
        "custom", Placement.looped(2), 1, [["0F0", "0B0"], ["1F0", "1B0"]]
    )


def test_user_rows_become_a_schedule_with_the_placement_inferred():
    second = (text for text in ("1F0", "2F0", "2B0", "1B0"))  # any iterable of strings and Actions
    sched = Schedule.from_programs("v", None, None, [["0F0", Action.parse("3F0"), "3B0", "0B0"], second])
    assert sched.placement == Placement.vshape(2)
    assert sched.num_microbatches == 1
    cs.verify(sched)


# -- torch's own files -----------------------------------------------------------------------------


@pytest.mark.parametrize("stem", list(TORCH_SCHEDULES))
def test_torchs_compute_only_csvs_load_verify_and_simulate(stem):
    sched = cs.load_csv(DATA / f"{stem}.csv")
    assert sched.num_ranks == TORCH_RANKS and sched.num_microbatches == TORCH_MICROBATCHES
    expected = Placement.vshape(4) if TORCH_SCHEDULES[stem][1] == "vshape" else Placement.looped(4, 2)
    assert sched.placement == expected
    cs.verify(sched)
    lowered = cs.lower(sched)
    cs.verify(lowered)
    assert cs.simulate(lowered).makespan == cs.simulate(sched).makespan


@pytest.mark.parametrize("stem", list(TORCH_SCHEDULES))
def test_torchs_compute_comms_csvs_load_with_fsdp_actions_dropped(stem):
    path = DATA / f"{stem}_comms.csv"
    with pytest.raises(ScheduleError) as raised:
        cs.load_csv(path)
    assert str(raised.value) == (
        f"{path}: rank 0, column 0: '0UNSHARD' is a UNSHARD action, which conveyor does not run (it belongs to "
        "torch's FSDP/DDP integration; conveyor.parallel handles sharding and gradient reduction itself). Remove "
        "it, or load with drop=('UNSHARD', 'RESHARD', 'REDUCE_GRAD') to skip such actions"
    )
    sched = cs.load_csv(path, drop=UNSUPPORTED_KINDS, format="compute_comms")
    assert sched.is_lowered
    cs.verify(sched)  # torch places receives where the sender's send is: deadlock-free too
    assert sched.compute_only().programs == cs.load_csv(DATA / f"{stem}.csv").programs
    assert cs.lower(sched) == sched  # nothing missing
    # torch posts each receive where its sender sends, often long before the compute that uses it;
    # run as blocking receives (conveyor's semantics), those early receives can only add waiting.
    assert cs.simulate(sched).makespan >= cs.simulate(sched.compute_only()).makespan


def test_torchs_interleaved_1f1b_is_our_interleaved_1f1b():
    theirs = cs.load_csv(DATA / "interleaved_1f1b.csv", name="interleaved-1f1b")
    assert theirs == cs.build("interleaved-1f1b", ranks=TORCH_RANKS, microbatches=TORCH_MICROBATCHES)


def test_torchs_overlapped_forward_backward_cells_load_as_pairs_and_other_overlaps_in_turn():
    # torch's DualPipeV writes "(0F7;7B3)OVERLAP_F_B": 0F7, then 7B3, a pair conveyor runs overlapped.
    sched = cs.load_csv(DATA / "dualpipev.csv")
    text = (DATA / "dualpipev.csv").read_text().splitlines()[0].split(",")
    at = text.index("(0F7;7B3)OVERLAP_F_B")
    assert [str(a) for a in sched.programs[0][at : at + 2]] == ["0F7", "7B3"]
    assert [f"{f}+{b}" for f, b in sched.overlapped[0]] == ["0F7+7B3", "7F4+0B0", "7F5+0B1", "7F6+0B2", "7F7+0B3"]
    cs.verify(sched)  # lowered with each pair's receives before it and sends after it, torch's own order
    assert cs.pair_forward_backward(sched) is sched  # its own pairs are the ones run
    # An overlap that is no pair (a microbatch's own backward, or three actions) runs its actions in turn.
    same = cs.loads_csv("(0F0;0B0)OVERLAP_F_B\n")
    assert [str(a) for a in same.programs[0]] == ["0F0", "0B0"] and same.overlapped == ()
    # So does a pair that would stop the schedule, lowered as pairs run (0B0 needs what 0F1 sends first).
    gpipe = cs.loads_csv("0F0,(0F1;0B0)OVERLAP_F_B,0B1\n1F0,1F1,1B0,1B1\n")
    assert gpipe.overlapped == () and [str(a) for a in gpipe.programs[0]] == ["0F0", "0F1", "0B0", "0B1"]
    cs.verify(gpipe)


def test_pairs_survive_csv_and_text_both_ways():
    paired = cs.pair_forward_backward(cs.build("zbv", ranks=2, microbatches=4))
    text = cs.dumps_csv(paired)
    assert "(0F3;0I0)OVERLAP_F_B" in text.splitlines()[0]
    assert cs.loads_csv(text, name=paired.name) == paired
    lowered = cs.loads_csv(cs.dumps_csv(paired, "compute_comms"), name=paired.name)
    assert lowered == cs.lower(paired) and lowered.overlapped == paired.overlapped
    assert "rank 1 overlaps: 2F1+2I0 1F2+1I0" in str(paired)
    assert cs.parse_schedule(str(paired)) == paired
    # An empty overlaps line lists no pair: the schedule is paired as any other.
    plain = cs.build("zbv", ranks=2, microbatches=4)
    empty = cs.parse_schedule(str(plain) + "\nrank 0 overlaps:")
    assert empty == plain and cs.pair_forward_backward(empty) == paired
    with pytest.raises(ScheduleError, match="expected FORWARD\\+BACKWARD"):
        cs.parse_schedule("rank 0: 0F0 0F1 0B0 0B1\nrank 0 overlaps: 0F1")
    with pytest.raises(ScheduleError, match="its backward must directly follow its forward"):
        cs.verify(cs.parse_schedule("rank 0: 0F0 0F1 0B0 0B1\nrank 0 overlaps: 0F0+0B1"))


def test_the_stored_csvs_are_what_torch_writes_and_torch_reads_ours(tmp_path):
    written = write_torch_csvs(tmp_path)
    for path in written:
        assert path.read_text() == (DATA / path.name).read_text(), path.name
    # torch loads our files and its dry run finds our lowering deadlock-free.
    from torch.distributed.pipelining import schedules as torch_schedules

    sched = cs.build("interleaved-1f1b", ranks=TORCH_RANKS, microbatches=TORCH_MICROBATCHES)
    cs.save_csv(sched, tmp_path / "ours.csv")
    cs.save_csv(sched, tmp_path / "ours_comms.csv", format="compute_comms")
    lowered = cs.lower(sched)
    for name, form in (("ours.csv", "compute_only"), ("ours_comms.csv", "compute_comms")):
        runtime = torch_schedules._PipelineScheduleRuntime(
            mock_stages(TORCH_RANKS, [0, TORCH_RANKS]), TORCH_MICROBATCHES, loss_fn=lambda output, target: output
        )
        runtime._load_csv(str(tmp_path / name), format=form)
        assert runtime.stage_index_to_group_rank == {s: s % TORCH_RANKS for s in range(2 * TORCH_RANKS)}
        if form == "compute_only":
            assert [list(map(str, runtime.pipeline_order[r])) for r in range(TORCH_RANKS)] == [
                list(map(str, p)) for p in sched.programs
            ]
        else:
            assert [list(map(str, runtime.pipeline_order_with_comms[r])) for r in range(TORCH_RANKS)] == [
                list(map(str, p)) for p in lowered.programs
            ]
    ours = {rank: [torch_schedules._Action.from_str(str(a)) for a in p] for rank, p in enumerate(lowered.programs)}
    torch_schedules._simulate_comms_compute(ours, lambda s: s % TORCH_RANKS, 2 * TORCH_RANKS)


def mock_stages(num_ranks: int, stage_indices: list[int]):
    """Just enough of torch's _PipelineStageBase for its schedule classes to plan (rank 0's stages)."""
    import torch

    class MockStage:
        def __init__(self, index: int) -> None:
            self.stage_index = index
            self.num_stages = 2 * num_ranks
            self.group_size = num_ranks
            self.group_rank = 0
            self.submod = torch.nn.Linear(1, 1)
            self.is_first = index == 0
            self.is_last = index == self.num_stages - 1

    return [MockStage(i) for i in stage_indices]


def write_torch_csvs(directory: Path) -> list[Path]:
    """Have torch's schedule classes write their compute-only and compute+comms CSVs into ``directory``."""
    from torch.distributed.pipelining import schedules as torch_schedules

    written = []
    for stem, (class_name, placement) in TORCH_SCHEDULES.items():
        stages = [0, 2 * TORCH_RANKS - 1] if placement == "vshape" else [0, TORCH_RANKS]
        schedule_class = getattr(torch_schedules, class_name)
        torch_schedule = schedule_class(
            mock_stages(TORCH_RANKS, stages), TORCH_MICROBATCHES, loss_fn=lambda output, target: output
        )
        for suffix, form in (("", "compute_only"), ("_comms", "compute_comms")):
            path = directory / f"{stem}{suffix}.csv"
            torch_schedule._dump_csv(str(path), format=form)
            written.append(path)
    return written


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kwargs", "expected"),
    [
        (
            "0F0,0X0\n1F0,1B0\n",
            {},
            "rank 0, column 1: cannot read action '0X0': expected {stage}{kind}{microbatch} with kind one of "
            "F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, e.g. '2F0' or '1SEND_B3'",
        ),
        (
            "0F0,0B0,1REDUCE_GRAD\n1F0,1B0\n",
            {},
            "rank 0, column 2: '1REDUCE_GRAD' is a REDUCE_GRAD action, which conveyor does not run",
        ),
        (
            "0F0,1B0\n1F0,0B0\n",
            {},
            "stage 1 appears on rank 0 (1B0) and on rank 1 (1F0); a stage runs on one rank: move one of them, "
            "or pass placement= explicitly",
        ),
        (
            "0F0,0B0\n2F0,2B0\n",
            {},
            "stages [1] have no actions, but stage 2 does: stages are numbered 0..S-1 without gaps, each with its "
            "forward and backward",
        ),
        (
            "0F0,0B0\n\n",
            {"placement": Placement.looped(2)},
            "the placement has 2 ranks but there are 1 rows of actions",
        ),
        (
            "0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0\n",
            {"format": "compute_only"},
            "format='compute_only' but rank 0 has the communication action 0SEND_F0 (its step 1); load with "
            "format='compute_comms', or remove the SEND/RECV cells",
        ),
        (
            "0F0\n",
            {"format": "compute"},
            "format must be one of ('compute_only', 'compute_comms') or None, got 'compute'",
        ),
        ("0F0\n", {"drop": ("FSDP",)}, "drop= names unknown action kinds ['FSDP']"),
        ("", {}, "no programs: expected one row of actions per rank"),
    ],
)
def test_bad_csv_text_gets_a_message_naming_the_cell(text, kwargs, expected):
    with pytest.raises(ScheduleError) as raised:
        cs.loads_csv(text, **kwargs)
    assert str(raised.value).startswith(expected)


def test_an_empty_rank_row_is_named():
    with pytest.raises(ScheduleError, match=r"ranks \[1\] have no actions: every rank runs at least one stage"):
        cs.loads_csv("0F0,1F0,0B0,1B0\n,,\n")


def test_a_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(ScheduleError, match=f"cannot read schedule CSV '{missing}': No such file or directory"):
        cs.load_csv(missing)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ("0F0 0B0", "expected one sequence of actions per rank (e.g. [['0F0', '0B0'], ['1F0', '1B0']]), got str"),
        ([["0F0", 5]], "rank 0, column 1: expected an Action or a string such as '2F0', got 5 (int)"),
        (["0F0 0B0"], "the row of rank 0 must be a sequence of actions or action strings, got str '0F0 0B0': split"),
        ([["0F0", "-1B0"]], "rank 0, column 1: cannot read action '-1B0'"),
        ([["0F0", "0B0"], []], "ranks [1] have no actions"),
    ],
)
def test_user_rows_with_mistakes_get_a_message(rows, expected):
    with pytest.raises(ScheduleError) as raised:
        Schedule.from_programs("mine", None, None, rows)
    assert str(raised.value).startswith(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("rank 0: 0F0\nrank 0: 0B0", "line 2: rank 0 has a second line; give each rank one line"),
        ("rank 1: 1F0 1B0", "ranks [1] in the text; expected lines for ranks 0..0"),
        ("schedule x: 3 ranks, 2 stages, 1 microbatches\nrank 0: 0F0 0B0\nrank 1: 1F0 1B0", "the header says 3 ranks"),
        ("", "no ranks in the text: expected lines such as 'rank 0: 0F0 0B0'"),
    ],
)
def test_bad_text_gets_a_message(text, expected):
    with pytest.raises(ScheduleError) as raised:
        cs.parse_schedule(text)
    assert str(raised.value).startswith(expected)


def test_dumping_wants_a_schedule_and_a_known_format():
    with pytest.raises(ScheduleError, match="expected a Schedule, got list"):
        cs.dumps_csv([["0F0"]])
    with pytest.raises(ScheduleError, match="format must be one of"):
        cs.dumps_csv(cs.build("1f1b", ranks=2, microbatches=2), "compute")


def test_module_examples_hold():
    for name in ("conveyor.schedule.csv_io", "conveyor.schedule.grid"):
        result = doctest.testmod(importlib.import_module(name))
        assert result.failed == 0 and result.attempted >= 1, name


def test_actions_print_and_parse_in_torchs_compact_form():
    for text in ("2F0", "13B7", "0I4", "5W5", "1SEND_B3", "2RECV_F0", "3SEND_F11", "4RECV_B2"):
        assert str(Action.parse(text)) == text
    assert Action.parse(" 1SEND_B3 ") == Action(ActionKind.SEND_B, 1, 3)


if __name__ == "__main__":
    DATA.mkdir(parents=True, exist_ok=True)
    for written_path in write_torch_csvs(DATA):
        print(written_path)


@pytest.mark.parametrize("name", ["zb#custom", "", "a: b", "schedule x: 1 rank"])
def test_the_text_form_reads_back_any_one_line_name(name):
    built = cs.build("1f1b", ranks=2, microbatches=2)
    schedule = Schedule(name, built.placement, built.num_microbatches, built.programs)
    assert cs.parse_schedule(str(schedule)) == schedule
    assert cs.parse_schedule(str(schedule) + "  # a trailing comment").programs == schedule.programs

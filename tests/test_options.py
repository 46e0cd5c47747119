"""conveyor.options: the records normalise what they are given and refuse bad values and combinations
naming the fix; the ranks compare them; one Pipeline class, with one public API, over both backends;
no public callable of the pipeline API takes more than 12 parameters or forwards **kwargs."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.layout import DistributedLayout, InProcessLayout
from conveyor.options import (
    PipelineOptions,
    SplitOptions,
    StageOptions,
    TransferOptions,
    WholeModel,
)
from conveyor.testing import run_ranks


def test_values_are_normalised_so_that_equal_options_compare_equal():
    assert StageOptions(autocast=torch.bfloat16) == StageOptions(autocast="BFloat16") == StageOptions(autocast="bf16")
    assert StageOptions(autocast="fp32").autocast is None
    assert StageOptions(param_dtype=torch.bfloat16) == StageOptions(param_dtype="bf16", grad_accum_dtype="fp32")
    assert StageOptions(param_dtype="bf16", grad_accum_dtype="none").grad_accum_dtype == "none"
    assert StageOptions(compile={}) == StageOptions(compile=True)
    assert TransferOptions(timeout_s=30).timeout_s == 30.0


@pytest.mark.parametrize(("make", "says"), [
    (lambda: StageOptions(autocast="fp16", loss_scaling=False), r"loss_scaling=False: fp16 needs loss scaling"),
    (lambda: StageOptions(param_dtype="half", grad_accum_dtype="none"),
     r"grad_accum_dtype='none': fp16 parameters would sum.*leave grad_accum_dtype unset"),
    (lambda: StageOptions(loss_scaling={"growth": 3}), r"loss_scaling does not know \['growth'\]"),
    (lambda: StageOptions(loss_scaling={"growth_interval": 0}), r"growth_interval takes a whole number"),
    (lambda: StageOptions(grad_accum_dtype="fp32"), r"grad_accum_dtype='fp32' needs param_dtype="),
    (lambda: StageOptions(param_dtype="bf16", grad_accum_dtype="bf16"), r"accumulate.*in 'fp32' main_grad"),
    (lambda: StageOptions(compile={"mode": "fast", "speed": 2}), r"compile= got \['speed'\].*use only"),
    (lambda: StageOptions(recompute="yes"), r"recompute='yes': a policy is true, false, a RecomputePolicy"),
    (lambda: TransferOptions(transport="tcp"), r"transport must be one of 'auto'"),
    (lambda: TransferOptions(timeout_s=0), r"timeout_s must be a positive number.*set it above your slowest step"),
    (lambda: DistributedLayout(group=object(), mesh=object()), r"mesh= or group=, not both"),
    (lambda: DistributedLayout(data_parallel="zero3"), r"data_parallel must be 'ddp', 'fsdp' or None"),
    (lambda: DistributedLayout(dp=0), r"DistributedLayout.dp takes a positive number of ranks; got 0"),
    (lambda: DistributedLayout(group=object(), tp=2), r"is one pipeline's ranks.*without group="),
    (lambda: DistributedLayout(sequence_parallel=True), r"sequence_parallel=True is part of tensor parallelism"),
    (lambda: DistributedLayout(tensor_parallel="auto"), r"needs tensor-parallel ranks.*give tp="),
    (lambda: InProcessLayout(ranks=0), r"InProcessLayout.ranks takes a positive number of ranks or None; got 0"),
    (lambda: WholeModel(tied_parameters=[("wte", "lm_head")]), r"records with `uses`"),
    (lambda: SplitOptions(method="layers"), r"use 'uniform', 'parameters', 'time' or 'type:<regex>'"),
    (lambda: PipelineOptions(stage=TransferOptions()), r"PipelineOptions.stage takes a StageOptions"),
])
def test_a_bad_value_or_combination_is_refused_when_the_record_is_made(make, says):
    with pytest.raises(PipelineConfigError, match=says):
        make()


def test_records_are_frozen_and_pipeline_refuses_anything_else():
    with pytest.raises(dataclasses.FrozenInstanceError):
        StageOptions().autocast = "bf16"
    with pytest.raises(PipelineConfigError, match=r"stage= takes a conveyor.options.StageOptions; got dict"):
        conveyor.Pipeline([torch.nn.Linear(2, 1)], "gpipe", microbatches=1, stage={"autocast": "bf16"},
                          layout=conveyor.InProcessLayout())
    with pytest.raises(PipelineConfigError, match=r"layout= takes a conveyor.InProcessLayout or "
                                                  r"conveyor.DistributedLayout; got dict"):
        conveyor.Pipeline([torch.nn.Linear(2, 1)], "gpipe", microbatches=1, layout={"ranks": 1})


def test_bf16_main_grad_with_replicas_is_refused_across_records():
    from conveyor.options import check_together

    check_together(StageOptions(param_dtype="bf16"), None)  # one replica: fine
    with pytest.raises(PipelineConfigError, match=r"drop data_parallel=, or use autocast='bf16'"):
        check_together(StageOptions(param_dtype="bf16"), "fsdp")


def test_a_new_stage_option_is_one_field_the_ranks_compare_without_more_code():
    # describe() walks the fields: a new field is compared across ranks with no change elsewhere.
    Extended = dataclasses.make_dataclass("Extended", [("new_option", int, dataclasses.field(default=3))],
                                          bases=(StageOptions,), frozen=True)
    assert Extended().describe().endswith("record_timeline=True new_option=3")
    assert [f.name for f in dataclasses.fields(StageOptions)] == [
        "recompute", "autocast", "param_dtype", "grad_accum_dtype", "loss_scaling", "compile", "random_streams",
        "measure_memory", "record_timeline"]
    for record in (StageOptions, TransferOptions, InProcessLayout, DistributedLayout, WholeModel, SplitOptions,
                   PipelineOptions):
        assert all(f.metadata.get("help") for f in dataclasses.fields(record)), record  # each field says what it does


def test_a_new_mesh_dim_is_one_size_field_and_one_field_the_ranks_compare_without_more_code():
    # What a dim of its own (context parallelism, say) adds: a size field naming its mesh dim, and a field
    # saying what the dim does. (Expert parallelism borrows the dp ranks, so it has no size field of a dim.)
    Extended = dataclasses.make_dataclass("Extended", [
        ("cp", int, dataclasses.field(default=1, metadata={"help": "context ranks", "mesh_dim": "cp"})),
        ("context_parallel", bool, dataclasses.field(default=False, metadata={"help": "shard sequences"}))],
        bases=(DistributedLayout,), frozen=True)
    assert Extended.mesh_dims() == ("dp", "tp", "cp")
    assert Extended(cp=2).describe().endswith("expert_capacity=None expert_overlap=False cp=2 context_parallel=False")
    with pytest.raises(PipelineConfigError, match=r"DistributedLayout.cp takes a positive number of ranks"):
        Extended(cp=0)
    with pytest.raises(PipelineConfigError, match=r"is one pipeline's ranks"):
        Extended(group=object(), cp=2)


def test_each_layout_record_holds_only_what_its_kind_of_pipeline_uses():
    assert [f.name for f in dataclasses.fields(InProcessLayout)] == ["ranks", "device"]
    assert [f.name for f in dataclasses.fields(DistributedLayout)] == [
        "group", "mesh", "device", "dp", "tp", "data_parallel", "tensor_parallel", "sequence_parallel",
        "loss_parallel", "expert_parallel", "ep", "expert_capacity", "expert_overlap", "parts"]
    assert "layout" not in [f.name for f in dataclasses.fields(PipelineOptions)]  # given once: layout=
    for function in (conveyor.Pipeline.__init__, conveyor.pipeline):
        keywords = inspect.signature(function).parameters
        assert "layout" in keywords and not {"mesh", "data_parallel", "tensor_parallel"} & set(keywords)
    assert not hasattr(conveyor, "LocalPipeline") and not hasattr(conveyor, "Layout")
    assert DistributedLayout(tp=2).tensor_parallel == "auto"  # tp ranks each running the whole stage: never


def _two_ranks_built_differently(rank, world_size):
    schedule = cs.build("1f1b", ranks=world_size, microbatches=2)
    try:
        conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule, lambda y, t: y.sum(),
                          stage=StageOptions(recompute=rank == 1),
                          transfer=TransferOptions(timeout_s=30))
    except PipelineConfigError as error:
        return str(error)
    return "built"


def test_ranks_given_different_stage_options_refuse_to_build_saying_what_differs():
    for message in run_ranks(_two_ranks_built_differently, 2, timeout_s=60):
        assert "their stage options differs" in message and "recompute=stage" in message, message


def _public(cls) -> dict[str, str]:
    return {name: type(inspect.getattr_static(cls,
                                              name)).__name__ for name in dir(cls) if not name.startswith("_")}


def test_one_pipeline_class_with_one_public_api_over_both_backends():
    pipe = conveyor.Pipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], "gpipe",
                             lambda y, t: (y - t).sum(), microbatches=2, stage=StageOptions(measure_memory=True),
                             layout=conveyor.InProcessLayout())
    assert type(pipe) is conveyor.Pipeline and type(pipe.ranks).__name__ == "InProcessRanks"
    for name in ("step", "forward", "clip_grad_norm_", "forget_norm_layout", "memory", "timeline", "state_dict",
                 "parameters", "named_parameters", "load_pretrained", "train", "eval", "close", "closed",
                 "needs_inputs", "needs_target", "dp_rank", "dp_size", "modules", "replicas", "checkpoint_group"):
        assert name in _public(conveyor.Pipeline), name
    pipe.step(torch.ones(4, 4), target=torch.zeros(4, 1))
    assert type(pipe.memory()).__name__ == "MemoryReport" and len(pipe.memory(all_ranks=True)) == 2
    assert (pipe.needs_inputs, pipe.needs_target, pipe.dp_rank, pipe.dp_size, len(pipe.modules)) == (True, True, 0,
                                                                                                     1, 2)
    pipe.close()
    assert pipe.closed


@pytest.mark.parametrize("function", [
    conveyor.Pipeline.__init__, conveyor.pipeline,
    conveyor.runtime.stage.runner.StageRunner.__init__, conveyor.runtime.stage.runner.build_runners,
])
def test_no_public_callable_takes_more_than_12_parameters_or_forwards_keywords(function):
    parameters = [p for name, p in inspect.signature(function).parameters.items() if name != "self"]
    assert len(parameters) <= 12, f"{function.__qualname__} takes {len(parameters)} parameters"
    assert all(p.kind is not p.VAR_KEYWORD for p in parameters), function.__qualname__

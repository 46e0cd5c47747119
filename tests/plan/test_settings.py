"""The planner's option records: fields normalised, bad values refused with the fix named."""

from __future__ import annotations

import dataclasses
import math

import pytest

import conveyor.plan as cp
from conveyor.errors import PlanError


def test_records_normalise_their_fields():
    assert cp.SearchSpace(virtual=[1, 4]).virtual == (1, 4)
    assert cp.Measurement(unsplittable="model.layers.0").unsplittable == ("model.layers.0",)
    options = cp.PlanOptions(memory_per_rank="8GiB", schedules="1f1b", microbatches=[4, 8])
    assert (options.memory_per_rank, options.schedules, options.microbatches) == (8 * 2**30, ("1f1b",), (4, 8))
    assert cp.PlanOptions().memory_per_rank == math.inf
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.global_batch = 4


@pytest.mark.parametrize(("make", "message"), [
    (lambda: cp.SearchSpace(virtual=[0]), r"SearchSpace\.virtual must be positive ints, got \[0\]; e\.g\. virtual="),
    (lambda: cp.SearchSpace(balance_tolerance=-0.1), r"balance_tolerance must be a non-negative number"),
    (lambda: cp.Machine(latency=-1), r"Machine\.latency must be a non-negative number .*drop it for the default"),
    (lambda: cp.Machine(flops_per_second=0), r"Machine\.flops_per_second must be a positive number"),
    (lambda: cp.Machine(threads="many"), r"Machine\.threads must be a positive int, 'auto' or None"),
    (lambda: cp.Measurement(costs={"units": 1}), r"Measurement\.costs must be a conveyor\.plan\.CostTable"),
    (lambda: cp.PlanOptions(memory_per_rank="lots"), r"memory size 'lots': expected bytes or a number with a unit"),
    (lambda: cp.PlanOptions(global_batch=0), r"PlanOptions\.global_batch must be a positive int or None"),
    (lambda: cp.PlanOptions(machine=cp.SearchSpace()), r"PlanOptions\.machine takes a Machine; got SearchSpace"),
])
def test_bad_values_name_the_fix(make, message):
    with pytest.raises(PlanError, match=message):
        make()


def test_every_field_has_its_help():
    for record in (cp.SearchSpace, cp.Machine, cp.Measurement, cp.PlanOptions):
        for field in dataclasses.fields(record):
            assert field.metadata.get("help"), f"{record.__name__}.{field.name} has no help"

"""Plan JSON: exact round trip, the published schema, validation and version errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autockpt import Plan, PlanFormatError, PlanMismatchError
from autockpt.plan import SCHEMA_VERSION, MemoryBreakdown, Segment

SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "plan.schema.json").read_text())

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
seconds = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
sizes = st.integers(min_value=0, max_value=2**50)


@st.composite
def plans(draw) -> Plan:
    num_stages = draw(st.integers(min_value=1, max_value=8))
    cuts = sorted(draw(st.sets(st.integers(0, num_stages), max_size=6)))
    segments = []
    for start, end in zip(cuts[::2], cuts[1::2], strict=False):
        if start < end:
            segments.append(
                Segment(
                    start_stage=start,
                    end_stage=end,
                    first_node=draw(names),
                    last_node=draw(names),
                    recompute_seconds=draw(seconds),
                    bytes_freed=draw(sizes),
                    preserve_rng=draw(st.booleans()),
                    restore_buffers=tuple(draw(st.lists(names, max_size=3))),
                )
            )
    return Plan(
        model=draw(names),
        graph_fingerprint=draw(names),
        input_signature=draw(names),
        input_names=tuple(draw(st.lists(names, max_size=3))),
        capture_method=draw(st.sampled_from(["fx", "fx+leaves", "export"])),
        leaf_modules=tuple(draw(st.lists(names, max_size=3))),
        num_nodes=draw(st.integers(num_stages, 10_000)),
        stages=tuple((draw(names), draw(names)) for _ in range(num_stages)),
        budget_bytes=draw(st.integers(1, 2**50)),
        scope=draw(st.sampled_from(["total", "activations"])),
        solver=draw(st.sampled_from(["dp", "ilp", "sqrt", "greedy"])),
        solver_status=draw(st.sampled_from(["optimal", "feasible"])),
        solve_seconds=draw(seconds),
        solver_gap=draw(st.none() | st.floats(0, 1)),
        segments=tuple(segments),
        predicted_peak_bytes=draw(sizes),
        no_checkpoint_peak_bytes=draw(sizes),
        minimum_peak_bytes=draw(sizes),
        predicted_recompute_seconds=draw(seconds),
        predicted_step_seconds=draw(seconds),
        recompute_fraction=draw(st.floats(0, 1)),
        memory=MemoryBreakdown(*(draw(sizes) for _ in range(6))),
        calibration_bytes=draw(sizes),
        measured_peak_bytes=draw(st.none() | sizes),
        measured_step_seconds=draw(st.none() | seconds),
        times_estimated=draw(st.booleans()),
        device=draw(st.sampled_from(["cpu", "cuda:0"])),
        notes=tuple(draw(st.lists(names, max_size=2))),
    )


@settings(max_examples=60, deadline=None)
@given(plans())
def test_json_round_trip_is_exact_and_matches_the_schema(plan):
    text = plan.to_json()
    assert Plan.from_json(text) == plan
    assert Plan.from_json(plan.to_json(indent=None)) == plan
    jsonschema.validate(json.loads(text), SCHEMA)


def test_schema_lists_exactly_the_plan_fields():
    fields = {f.name for f in dataclasses.fields(Plan)}
    assert set(SCHEMA["properties"]) == fields
    assert set(SCHEMA["properties"]["segments"]["items"]["properties"]) == {
        f.name for f in dataclasses.fields(Segment)
    }
    assert set(SCHEMA["properties"]["memory"]["properties"]) == {
        f.name for f in dataclasses.fields(MemoryBreakdown)
    }
    assert SCHEMA["properties"]["schema_version"]["const"] == SCHEMA_VERSION


def _sample() -> dict:
    return json.loads(
        Plan(
            model="M",
            graph_fingerprint="abc",
            input_signature="[]",
            input_names=("x",),
            capture_method="fx",
            leaf_modules=(),
            num_nodes=3,
            stages=(("a", "a"), ("b", "c")),
            budget_bytes=100,
            scope="total",
            solver="dp",
            solver_status="optimal",
            solve_seconds=0.1,
            solver_gap=0.0,
            segments=(Segment(0, 1, "a", "a", 0.5, 10, False),),
            predicted_peak_bytes=90,
            no_checkpoint_peak_bytes=120,
            minimum_peak_bytes=80,
            predicted_recompute_seconds=0.5,
            predicted_step_seconds=2.0,
            recompute_fraction=0.25,
            memory=MemoryBreakdown(1, 2, 3, 4, 5, 6),
        ).to_json()
    )


def test_save_and_load(tmp_path):
    plan = Plan.from_dict(_sample())
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "not valid JSON"),
        ('{"schema_version": 1,', "not valid JSON"),
        ("[1, 2]", "must be an object"),
    ],
)
def test_corrupt_text_is_a_format_error(text, message):
    with pytest.raises(PlanFormatError, match=message):
        Plan.from_json(text)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("segments"), "segments is missing"),
        (lambda d: d.update(budget_bytes="lots"), "budget_bytes must be an integer"),
        (lambda d: d.update(surprise=1), "unknown field"),
        (
            lambda d: d["segments"][0].update(preserve_rng="yes"),
            "preserve_rng must be true or false",
        ),
        (lambda d: d.update(segments=[{"start_stage": 0}]), "missing"),
        (lambda d: d["segments"][0].update(end_stage=9), "segment"),
        (lambda d: d.update(scope="everything"), "scope"),
    ],
)
def test_invalid_fields_are_format_errors(mutate, message):
    data = _sample()
    mutate(data)
    with pytest.raises(PlanFormatError, match=message):
        Plan.from_dict(data)


def test_other_schema_version_is_a_mismatch_naming_both_versions():
    data = _sample()
    data["schema_version"] = SCHEMA_VERSION + 1
    data["autockpt_version"] = "9.9.9"
    with pytest.raises(
        PlanMismatchError,
        match=rf"schema_version {SCHEMA_VERSION + 1}.*9\.9\.9.*reads schema_version {SCHEMA_VERSION}",
    ):
        Plan.from_dict(data)

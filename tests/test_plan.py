"""Plan JSON: exact round trip, the published schema, validation and version errors."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import jsonschema
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from autockpt import Plan, PlanFormatError, PlanMismatchError, cli
from autockpt.api import Planner
from autockpt.capture.captured import node_module
from autockpt.errors import GIB
from autockpt.plan import SCHEMA_VERSION, MemoryBreakdown, Segment
from autockpt.report import render_plan

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
                    first_module=draw(st.none() | st.just("") | names),
                    last_module=draw(st.none() | st.just("") | names),
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
        (
            lambda d: d["segments"][0].update(first_module=3),
            "first_module must be a string or null",
        ),
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


# ---------------------------------------------------------------------------------------------
# readable plans: segments by module path, opaque leaves with their reason

WIDTH, VOCAB, SEQ = 16, 11, 24


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    """nanoGPT's root: a length check in Python (fx cannot trace it, so the model is
    captured with torch.export) and the loss ``if targets is not None``."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        _, t = idx.size()
        assert t <= 64, "sequence longer than the block size"
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is not None:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, VOCAB, (2, SEQ), generator=generator),
        torch.randint(0, VOCAB, (2, SEQ), generator=generator),
    )


def _halfway(planner: Planner) -> Plan:
    budget = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) / 2 / GIB
    return planner.optimize(budget_gb=budget, verify=False).plan


@pytest.fixture(scope="module")
def export_planned() -> tuple[TinyGPT, Planner, Plan]:
    torch.manual_seed(0)
    model = TinyGPT()
    planner = Planner(model, _tokens())
    return model, planner, _halfway(planner)


def test_export_segments_name_the_modules_of_their_first_and_last_node(export_planned):
    model, planner, plan = export_planned
    assert plan.capture_method == "export" and plan.segments
    nodes = {n.name: n for n in planner.capture.compute_nodes()}
    modules = {name for name, _ in model.named_modules()}
    for seg in plan.segments:
        assert seg.first_module == node_module(nodes[seg.first_node])
        assert seg.last_module == node_module(nodes[seg.last_node])
        assert {seg.first_module, seg.last_module} <= modules  # "" is the root's own code
        assert seg.first_label == f"{seg.first_module or '<root>'} ({seg.first_node})"
        assert seg.last_label == f"{seg.last_module or '<root>'} ({seg.last_node})"
    assert any(seg.first_module.startswith("blocks.") for seg in plan.segments)


def test_module_paths_round_trip_and_show_prints_them(export_planned, tmp_path, capsys):
    _, _, plan = export_planned
    data = json.loads(plan.to_json())
    jsonschema.validate(data, SCHEMA)
    assert [(s["first_module"], s["last_module"]) for s in data["segments"]] == [
        (seg.first_module, seg.last_module) for seg in plan.segments
    ]
    assert Plan.from_json(plan.to_json()) == plan
    for seg in plan.segments:
        assert f"{seg.first_label} .. {seg.last_label}" in plan.summary()
        wide = render_plan(plan, width=240)
        assert seg.first_label in wide and seg.last_label in wide
    path = tmp_path / "plan.json"
    plan.save(path)
    assert cli.main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    for seg in plan.segments:
        for text in (seg.first_module, seg.first_node, seg.last_module, seg.last_node):
            assert (text or "<root>") in shown


def test_plans_without_module_paths_still_load_and_show_node_names():
    data = _sample()
    for seg in data["segments"]:
        del seg["first_module"], seg["last_module"]
    plan = Plan.from_dict(data)
    seg = plan.segments[0]
    assert (seg.first_module, seg.last_module) == (None, None)
    assert (seg.first_label, seg.last_label) == (seg.first_node, seg.last_node)


class Router(nn.Module):
    """Branches on a shape: fx cannot trace it, so it runs as an opaque leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            return self.proj(x)
        return -self.proj(x)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
        self.router = Router()
        self.out = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.router(self.inp(x))))


def test_every_opaque_leaf_says_why_in_the_plan_notes():
    torch.manual_seed(0)
    planner = Planner(Routed(), torch.randn(64, WIDTH), leaf_modules=["inp"])
    plan = _halfway(planner)
    assert plan.capture_method == "fx+leaves"
    assert plan.leaf_modules == ("inp", "router")
    lines, first = inspect.getsourcelines(Router.forward)
    offset = next(k for k, line in enumerate(lines) if "if x.shape[0] > 1:" in line)
    where = f"{inspect.getsourcefile(Router.forward)}:{first + offset}"
    assert "inp kept whole (opaque leaf): named in leaf_modules" in plan.notes
    assert any(
        note.startswith("router kept whole (opaque leaf): fx cannot trace the code at ")
        and f"{where}: `if x.shape[0] > 1:`" in note
        for note in plan.notes
    )
    assert any("router kept whole" in line for line in render_plan(plan, width=400).splitlines())


def test_leaves_an_export_graph_inlines_are_said():
    torch.manual_seed(0)
    planner = Planner(TinyGPT(layers=1), _tokens(), leaf_modules=["blocks.0"])
    plan = _halfway(planner)
    assert plan.capture_method == "export" and plan.leaf_modules == ()
    assert any(note.startswith("leaf_modules blocks.0 not kept whole") for note in plan.notes)

"""Reports: the plan's stored timeline, plan tables, timeline and frontier figures (checked
through the figure objects before saving, then as real PNG files)."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn

from autockpt import Plan, PlanFormatError
from autockpt.api import Planner
from autockpt.cli import Progress
from autockpt.errors import GIB
from autockpt.report import (
    ReportError,
    frontier,
    frontier_figure,
    render_plan,
    repeated_block_segments,
    save_figure,
    timeline_figure,
)
from solvers import simulate
from tests.cli_models import tiny_patch_transformer

SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "plan.schema.json").read_text())
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> tuple[int, int]:
    """A real PNG: signature, IHDR size, decodable, not a blank canvas. Returns (w, h)."""
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (height, width) and width > 300 and height > 200
    assert pixels[..., :3].std() > 0.05, "image is (nearly) one colour"
    return width, height


@pytest.fixture(scope="module")
def planner() -> Planner:
    model, images = tiny_patch_transformer()
    return Planner(model, images)


@pytest.fixture(scope="module")
def plan(planner: Planner) -> Plan:
    middle = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) / 2 / GIB
    return planner.optimize(budget_gb=middle, solver="dp", verify=False).plan


def test_plan_stores_the_simulated_timeline(planner, plan):
    timeline = plan.timeline
    assert timeline is not None and plan.segments
    assert max(timeline.plan_bytes) == plan.predicted_peak_bytes
    assert max(timeline.no_checkpoint_bytes) == plan.no_checkpoint_peak_bytes
    segments = [(s.start_stage, s.end_stage) for s in plan.segments]
    expected = simulate(planner.chain.problem, segments).timeline
    assert [(p[0], k) for p, k, _ in expected] == list(
        zip(timeline.phases, timeline.stages, strict=True)
    )
    recomputed = {
        k for phase, k in zip(timeline.phases, timeline.stages, strict=True) if phase == "r"
    }
    assert recomputed == {k for start, end in segments for k in range(start, end)}
    assert len(timeline.no_checkpoint_bytes) == 2 * len(plan.stages)


def test_plan_with_timeline_round_trips_and_matches_the_schema(plan, tmp_path):
    assert Plan.from_json(plan.to_json()) == plan
    jsonschema.validate(json.loads(plan.to_json()), SCHEMA)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").timeline == plan.timeline


def test_plans_without_a_timeline_still_load_but_cannot_be_plotted(plan):
    old = json.loads(plan.to_json())
    del old["timeline"]
    loaded = Plan.from_dict(old)
    assert loaded.timeline is None and loaded == dataclasses.replace(plan, timeline=None)
    jsonschema.validate(old, SCHEMA)
    with pytest.raises(ReportError, match="no memory timeline.*autockpt plan"):
        timeline_figure(loaded)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.update(phases="x" * len(t["phases"])), "phases"),
        (lambda t: t["plan_bytes"].pop(), "one entry per event"),
        (lambda t: t["no_checkpoint_bytes"].pop(), "no_checkpoint_bytes"),
        (lambda t: t["stage_forward_seconds"].pop(), "seconds"),
        (lambda t: t["stages"].__setitem__(0, 10**6), "stages"),
        (lambda t: t["plan_bytes"].__setitem__(0, "many"), "integer"),
    ],
)
def test_malformed_timelines_are_format_errors(plan, mutate, message):
    data = json.loads(plan.to_json())
    mutate(data["timeline"])
    with pytest.raises(PlanFormatError, match=message):
        Plan.from_dict(data)


def test_plan_table_names_every_segment_and_the_peaks(plan):
    text = render_plan(plan)
    for heading in (
        "memory breakdown",
        "predicted",
        "measured",
        "not measured",
        "solver",
        "checkpointed segment",
    ):
        assert heading in text
    for seg in plan.segments:
        assert seg.first_node in text and seg.last_node in text
    assert plan.solver in text and plan.solver_status in text


def test_a_verified_but_untimed_step_is_not_called_unmeasured(plan):
    """optimize verifies with one untimed step: the table shows its peak and says the step
    was not timed (not "not measured" beside a measured peak)."""
    verified = dataclasses.replace(plan, measured_peak_bytes=plan.predicted_peak_bytes)
    text = render_plan(verified)
    assert "not timed" in text and "not measured" not in text
    timed = dataclasses.replace(verified, measured_step_seconds=0.0123)
    assert "12.30 ms" in render_plan(timed)


def test_timeline_figure_has_both_curves_and_the_budget(plan, tmp_path):
    fig = timeline_figure(plan)
    (ax,) = fig.axes
    assert "time" in ax.get_xlabel() and "ms" in ax.get_xlabel()
    assert "memory" in ax.get_ylabel() and "MiB" in ax.get_ylabel()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("no checkpointing") for t in legend)
    assert any(t.startswith("plan, ") for t in legend)
    assert any(t.startswith("budget") for t in legend)
    assert "recompute" in legend
    lines = {line.get_label(): line for line in ax.get_lines()}
    budget = next(line for label, line in lines.items() if label.startswith("budget"))
    assert budget.get_ydata()[0] == pytest.approx(plan.budget_bytes / 2**20)
    curve = next(line for label, line in lines.items() if label.startswith("plan, "))
    base = next(line for label, line in lines.items() if label.startswith("no checkpointing"))
    assert max(curve.get_ydata()) == pytest.approx(plan.predicted_peak_bytes / 2**20)
    assert max(base.get_ydata()) == pytest.approx(plan.no_checkpoint_peak_bytes / 2**20)
    assert max(curve.get_ydata()) <= budget.get_ydata()[0] < max(base.get_ydata())
    # the plan's step is longer by its recompute, the seconds the tables report (one time
    # model in every report): each recompute band is its segment's recompute, less the fixed
    # cost of entering a checkpoint
    assert curve.get_xdata()[-1] > base.get_xdata()[-1]
    drawn = sum(
        1e3 * seconds for phase, _, _, seconds in plan.timeline.plan_events() if phase == "r"
    )
    stage_ms = [1e3 * t for t in plan.timeline.stage_forward_seconds]
    for seg in plan.segments:
        inside = sum(stage_ms[seg.start_stage : seg.end_stage])
        assert inside <= seg.recompute_seconds * 1e3 + 1e-6
    assert drawn <= plan.predicted_recompute_seconds * 1e3 + 1e-6
    assert drawn == pytest.approx(plan.predicted_recompute_seconds * 1e3, rel=0.5)
    save_figure(fig, str(tmp_path / "timeline.png"))
    assert_png(tmp_path / "timeline.png")


def test_per_block_segments_follow_the_sequential_of_blocks(planner):
    container, segments = repeated_block_segments(planner)
    assert container == "blocks"
    assert len(segments) == len(planner.model.blocks)
    names = planner.chain.node_names
    for k, (start, end) in enumerate(segments):
        first, stop = planner.chain.node_range(start, end)
        inside = names[first:stop]
        assert any(name.startswith(f"blocks_{k}_") for name in inside)
        strangers = [
            n for n in inside if n.startswith("blocks_") and not n.startswith(f"blocks_{k}_")
        ]
        assert not strangers and "embed" not in inside and "head" not in inside, inside


def test_frontier_is_pareto_from_leanest_to_none_with_baselines(planner, tmp_path):
    result = frontier(planner, budgets=6)
    points = result.points
    assert points[0].predicted_peak_bytes == planner.minimum_peak_bytes
    assert points[-1].predicted_peak_bytes == planner.no_checkpoint_peak_bytes
    assert points[-1].segments == () and points[-1].overhead == 0
    for lower, higher in zip(points, points[1:], strict=False):
        assert lower.predicted_peak_bytes < higher.predicted_peak_bytes
        assert lower.predicted_recompute_seconds > higher.predicted_recompute_seconds
    for point in points:
        assert point.budget_bytes is not None and point.predicted_peak_bytes <= point.budget_bytes
    assert len(result.sqrt_point.segments) == math.isqrt(planner.chain.num_stages - 1) + 1
    assert result.per_block is not None and result.block_container == "blocks"
    assert result.per_block_note is None
    # every point is labelled with its solver's status, as plan and show label plans
    assert {p.label for p in points} <= {"optimal", "feasible"}
    assert points[0].label == planner.solve(points[0].budget_bytes).status
    # the optimal plans are at least as good as either baseline at the baseline's peak
    for baseline in (result.sqrt_point, result.per_block):
        fitting = [p for p in points if p.predicted_peak_bytes <= baseline.predicted_peak_bytes]
        if fitting:
            assert fitting[-1].predicted_recompute_seconds <= baseline.predicted_recompute_seconds
    json.dumps(result.to_dict())

    fig = frontier_figure(result)
    (ax,) = fig.axes
    assert "peak memory" in ax.get_xlabel() and "overhead" in ax.get_ylabel()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    for start in ("plans across", "sqrt(n)", "per block", "leanest plan", "no checkpointing"):
        assert any(t.startswith(start) for t in legend), (start, legend)
    optimal = next(line for line in ax.get_lines() if line.get_label().startswith("plans across"))
    assert len(optimal.get_xdata()) == len(points)
    save_figure(fig, str(tmp_path / "frontier.png"))
    assert_png(tmp_path / "frontier.png")


def test_measured_frontier_saves_real_memory(planner):
    result = frontier(planner, budgets=2, measure=True)
    leanest, none = result.points[0], result.points[-1]
    assert all(p.measured_peak_bytes is not None for p in (*result.points, result.sqrt_point))
    assert leanest.measured_peak_bytes < none.measured_peak_bytes
    fig = frontier_figure(result)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(t.startswith("measured") for t in legend)


def test_progress_is_off_for_quiet_json_and_pipes(monkeypatch):
    from argparse import Namespace

    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    assert Progress.for_args(Namespace(quiet=False, json=False)).enabled
    assert not Progress.for_args(Namespace(quiet=True, json=False)).enabled
    assert not Progress.for_args(Namespace(quiet=False, json=True)).enabled
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    assert not Progress.for_args(Namespace(quiet=False, json=False)).enabled
    with Progress(False) as progress:  # disabled: every call is a no-op
        progress.stage("solving", 3)
        progress.advance(1)


def test_a_field_from_a_newer_writer_names_the_writer(plan):
    data = json.loads(plan.to_json())
    data["added_later"] = 1
    data["autockpt_version"] = "9.0.0"
    with pytest.raises(
        PlanFormatError, match=r"unknown field.*added_later.*autockpt 9\.0\.0.*upgrade"
    ):
        Plan.from_dict(data)


def test_schema_lists_exactly_the_timeline_fields():
    from autockpt.plan import MemoryTimeline

    timeline = SCHEMA["properties"]["timeline"]["oneOf"][1]
    assert set(timeline["properties"]) == {f.name for f in dataclasses.fields(MemoryTimeline)}
    assert set(timeline["required"]) == set(timeline["properties"])
    assert "timeline" not in SCHEMA["required"]


def test_frontier_with_a_heuristic_skips_budgets_it_cannot_meet(planner):
    result = frontier(planner, budgets=4, solver="greedy")
    assert result.points and result.solver == "greedy"
    assert result.points[-1].predicted_peak_bytes <= planner.no_checkpoint_peak_bytes
    for point in result.points:
        assert point.predicted_peak_bytes <= point.budget_bytes


def test_measured_peak_is_shown_as_the_scope_counts_it(plan):
    from autockpt.errors import format_bytes

    m = plan.memory
    static = m.parameters + m.buffers + m.inputs + m.gradients
    scoped = dataclasses.replace(plan, scope="activations", measured_peak_bytes=static + 3 * 2**20)
    assert f"{format_bytes(3 * 2**20)} ({format_bytes(static + 3 * 2**20)} in all)" in render_plan(
        scoped
    )
    total = dataclasses.replace(plan, measured_peak_bytes=static + 3 * 2**20)
    assert "in all" not in render_plan(total)


def test_user_guide_factories_build(monkeypatch):
    """docs/user-guide.md runs its commands on docs/examples/my_models.py: keep it loadable."""
    from torch import nn

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "docs" / "examples"))
    import my_models

    model, x = my_models.block_stack()
    assert isinstance(model, nn.Module) and len(model.blocks) == 32 and tuple(x.shape) == (512, 128)
    pytest.importorskip("transformers")
    gpt2, inputs = my_models.gpt2()
    assert isinstance(gpt2, nn.Module) and set(inputs) == {"input_ids", "labels"}
    assert gpt2(**inputs).loss.ndim == 0


def test_user_guide_first_model_trains_like_eager_within_its_budget(monkeypatch):
    """docs/user-guide.md's first model (docs/examples/first_model.py), as the guide runs
    it: the GPT returning logits planned with its loss and AdamW under 0.2 GiB trains like
    the original (losses, gradients, parameters after the step) and its iteration, measured,
    is within the budget."""
    import copy

    import autockpt

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "docs" / "examples"))
    import first_model

    model, idx, loss_fn = first_model.first_model()
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    fast = autockpt.optimize(model, (idx,), budget_gb=0.2, loss_fn=loss_fn, optimizer=opt)
    assert isinstance(fast, first_model.GPT) and fast.plan.loss == "first_model:next_token_loss"
    assert fast.plan.segments
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=3e-4)
    for net, optimizer in ((fast, opt), (eager, eager_opt)):
        torch.manual_seed(1)
        optimizer.zero_grad()
        loss_fn(net(idx)).backward()
        optimizer.step()
    for (name, a), b in zip(fast.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    measured = autockpt.measure(fast, (idx,), loss_fn=loss_fn, optimizer=opt, repeat=1)
    assert measured.peak_bytes <= fast.plan.budget_bytes


class _LayersByName(nn.Module):
    """Layers held by name in an ``nn.ModuleDict`` (as some model code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(
            {f"l{k}": nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for k in range(4)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = x + layer(x)
        return x


class _NoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Conv1d(64, 32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).transpose(1, 2)).transpose(1, 2)


def test_frontier_has_a_per_block_row_for_layers_by_name_and_says_why_when_none():
    torch.manual_seed(0)
    with_dict = frontier(Planner(_LayersByName(), (torch.randn(64, 8, 32),)), budgets=3)
    assert with_dict.per_block is not None and with_dict.block_container == "layers"
    assert len(with_dict.per_block.segments) == 4 and with_dict.per_block_note is None
    without = frontier(Planner(_NoLayers(), (torch.randn(64, 8, 32),)), budgets=3)
    assert without.per_block is None and "no repeated blocks" in without.per_block_note
    assert without.to_dict()["per_block_note"] == without.per_block_note

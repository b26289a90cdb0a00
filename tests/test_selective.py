"""Selective recompute: segments that keep chosen operator outputs (solvers/selective.py,
replay rule 6, autockpt/rewrite/ ``_KeepCalls``). Kept plans train like eager, the replay
predicts what the allocator measures, keeping costs memory monotonically, and plans carry
their kept operators through JSON, ``apply`` and ``torch.compile``."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autockpt
from autockpt.api import Planner
from autockpt.costs.cost_model import KEEP_OVERHEAD_SECONDS
from autockpt.errors import GIB, PlanMismatchError
from autockpt.plan import KeptOp, Plan
from autockpt.planning.specs import kept_calls
from autockpt.rewrite import segments_of
from autockpt_zoo.toy import ZOO
from solvers.replay import MemoryTrace, OpCall, Window, replayer
from solvers.selective import keep_greedily, keepable_nodes, plan_cost
from tests.conftest import assert_same_step, quiet_planner, train_step


def _planner(name: str) -> tuple:
    model, inputs = ZOO[name]()
    return model, inputs, quiet_planner(model, inputs)


@pytest.fixture(scope="module")
def gpt():
    return _planner("gpt")


@pytest.fixture(scope="module")
def kept_gpt(gpt):
    """One segment per block, with the outputs greedy keeps in a budget a fifth of the way
    from that plan's peak to no checkpointing: (segments, kept, budget)."""
    _, _, planner = gpt
    segments = planner.per_block_segments
    peak = planner.predict(segments)
    budget = peak + (planner.no_checkpoint_peak_bytes - peak) // 5
    found = keep_greedily(planner.search.replay_chain, segments, budget)
    assert any(found.kept), "greedy keeps matmul outputs in the room the budget leaves"
    return segments, found.kept, budget


@pytest.fixture(scope="module")
def unet_selective():
    """A budget at which optimize itself keeps an output: the zoo U-Net's segment plan
    there leaves room that one kept node fits in (the first of 50 budgets from the leanest
    plan up where the search keeps one: which one depends on the measured node times)."""
    model, inputs, planner = _planner("unet")
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    budget = next(
        (
            b
            for k in range(1, 50)
            if planner.solve(b := low + (high - low) * k // 50).method == "selective"
        ),
        None,
    )
    assert budget is not None, "no budget of the U-Net keeps an output"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = planner.optimize(budget_gb=budget / GIB)
    return model, inputs, planner, result, budget


def test_keepable_nodes_are_deterministic_single_operator_nodes(gpt):
    _, _, planner = gpt
    trace = planner.trace
    keepable = keepable_nodes(trace)
    names = planner.chain.node_names
    assert keepable, "a GPT has matrix multiplies to keep"
    for i in keepable:
        ops = trace.forward_ops[i]
        assert sum(1 for op in ops if op.allocations) == 1
        assert not any(op.seeded or op.writes for op in ops)
    # dropout draws random numbers: recomputing from a restored generator is the only safe way
    dropouts = [i for i, name in enumerate(names) if "drop" in name]
    assert dropouts and not keepable.intersection(dropouts)
    linears = [i for i, name in enumerate(names) if name.endswith(("c_fc", "c_proj", "c_attn"))]
    assert linears and set(linears) <= keepable


def test_keepable_nodes_exclude_outputs_written_later():
    ops = (
        (OpCall("aten.mm.default", (0,)),),
        (OpCall("aten.add_.Tensor", (), writes=(0,)),),
        (OpCall("aten.relu.default", (1,)),),
        (OpCall("aten.bernoulli.default", (2,), seeded=True),),
        (OpCall("aten.clone.default", (3,)), OpCall("aten.mm.default", (4,))),
    )
    trace = MemoryTrace(
        num_nodes=5,
        windows=(Window("forward", 0),),
        events=(),
        sizes=(8, 8, 8, 8, 8),
        reads=((),) * 5,
        outputs=((),) * 5,
        saved=((),) * 5,
        output_allocations=(),
        static_bytes=0,
        source="storages",
        forward_ops=ops,
    )
    assert keepable_nodes(trace) == frozenset({2})


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_keeping_more_never_lowers_the_peak(gpt, data):
    """Rule 5 holds a kept output at least as long as its recomputed copy would live, at
    every point of the step: adding a kept node can only raise the replayed peak."""
    _, _, planner = gpt
    trace = planner.trace
    ranges = [planner.chain.node_range(s, e) for s, e in planner.per_block_segments]
    keepable = keepable_nodes(trace)
    replay = replayer(trace)
    rng = planner.search.replay_chain.preserve_rng(planner.per_block_segments)
    candidates = [
        (k, i)
        for k, (first, stop) in enumerate(ranges)
        for i, reached in zip(range(first, stop), replay.recomputed_nodes(first, stop), strict=True)
        if reached and i in keepable
    ]
    chosen = data.draw(st.lists(st.sampled_from(candidates), unique=True, max_size=8))
    kept: list[list[int]] = [[] for _ in ranges]
    previous = replay.peak_bytes(ranges, rng, None)
    for k, i in chosen:
        kept[k].append(i)
        as_tuples = [tuple(sorted(nodes)) for nodes in kept]
        peak = replay.peak_bytes(ranges, rng, as_tuples)
        assert peak >= previous
        # the sorted replay (timelines, reports) agrees with the fast one
        assert replay.simulate(ranges, rng, as_tuples).peak_bytes == peak
        previous = peak


def test_greedy_keeps_only_within_the_budget_and_lowers_the_cost(gpt, kept_gpt):
    _, _, planner = gpt
    segments, kept, budget = kept_gpt
    chain = planner.search.replay_chain
    assert planner.predict(segments, kept) <= budget
    nothing = tuple(() for _ in segments)
    assert plan_cost(chain, tuple(segments), kept) < plan_cost(chain, tuple(segments), nothing)


def test_kept_plan_trains_like_eager_and_is_predicted(gpt, kept_gpt):
    """Outputs, every gradient, buffers and the RNG (dropout masks replayed) equal eager's;
    the allocator-measured peak is the replay's and within the budget."""
    model, inputs, planner = gpt
    segments, kept, budget = kept_gpt
    result = planner.rewrite(segments, kept)
    predicted = planner.predict(segments, kept)
    measured = autockpt.measure(result, inputs).peak_bytes
    assert measured <= budget
    assert abs(measured - predicted) <= 0.01 * predicted
    assert_same_step(train_step(model, inputs), train_step(result, inputs))
    # the segments carry what the plan keeps, by node and operator call
    specs = [seg.spec for seg in segments_of(result).values()]
    for spec, nodes in zip(specs, kept, strict=True):
        expected = kept_calls(planner.trace, spec.first, spec.end, nodes)
        names = planner.chain.node_names
        assert spec.kept_ops == tuple((names[i], op, k) for i, op, k in expected)


def test_kept_plan_compiles(gpt, kept_gpt):
    """Under torch.compile the segments pass torch's selective-checkpoint policy naming the
    same calls, which the compiler traces: gradients equal eager's."""
    model, inputs, planner = gpt
    segments, kept, _ = kept_gpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(planner.rewrite(segments, kept), backend="aot_eager")
        got = train_step(compiled, inputs)
    expected = train_step(model, inputs)
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
    grads = {name.removeprefix("_orig_mod."): grad for name, grad in got["grads"].items()}
    assert grads.keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_node_that_cannot_be_kept_is_refused(gpt):
    _, _, planner = gpt
    names = planner.chain.node_names
    dropout = next(i for i, name in enumerate(names) if name.endswith("attn_dropout"))
    segment = next(
        (s, e)
        for s, e in planner.per_block_segments
        if planner.chain.node_range(s, e)[0] <= dropout < planner.chain.node_range(s, e)[1]
    )
    with pytest.raises(ValueError, match="cannot be kept"):
        planner.rewrite([segment], [(dropout,)])


def test_optimize_keeps_outputs_where_its_plan_leaves_room(unet_selective):
    model, inputs, planner, result, budget = unet_selective
    plan = result.plan
    assert plan.solver == "selective"
    assert any(seg.kept_ops for seg in plan.segments)
    segment_only = planner.solve(budget, selective=False)
    assert [(s.start_stage, s.end_stage) for s in plan.segments] == [
        tuple(seg) for seg in segment_only.segments
    ]
    assert planner.solve(budget).recompute_seconds < segment_only.recompute_seconds
    assert plan.measured_peak_bytes <= budget
    # the result shares the model's batch-norm buffers: the reference steps a copy
    expected = train_step(copy.deepcopy(model), inputs)
    assert_same_step(expected, train_step(result, inputs))


def test_selective_false_keeps_nothing(unet_selective):
    _, _, planner, _, budget = unet_selective
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = planner.optimize(budget_gb=budget / GIB, selective=False, verify=False)
    assert result.plan.solver != "selective"
    assert not any(seg.kept_ops for seg in result.plan.segments)


def test_selective_plan_round_trips_and_reapplies(unet_selective):
    model, inputs, _, result, budget = unet_selective
    plan = result.plan
    again = Plan.from_json(plan.to_json())
    assert again == plan
    applied = autockpt.apply(model, again, inputs)
    kept = [k for seg in segments_of(applied).values() for k in seg.spec.kept_ops]
    assert kept == [(k.node, k.op, k.index) for seg in plan.segments for k in seg.kept_ops]
    expected = train_step(copy.deepcopy(model), inputs)
    assert_same_step(expected, train_step(applied, inputs))
    assert autockpt.measure(applied, inputs).peak_bytes <= budget


def test_plan_keeping_an_unknown_operator_is_refused(unet_selective):
    model, inputs, _, result, _ = unet_selective
    plan = result.plan
    k = next(k for k, seg in enumerate(plan.segments) if seg.kept_ops)
    seg = plan.segments[k]
    bad = dataclasses.replace(
        seg, kept_ops=(KeptOp(seg.kept_ops[0].node, "aten.no_such_op.default", 0),)
    )
    broken = dataclasses.replace(plan, segments=(*plan.segments[:k], bad, *plan.segments[k + 1 :]))
    with pytest.raises(PlanMismatchError, match="no_such_op"):
        autockpt.apply(model, broken, inputs)


def test_keeping_is_not_chosen_where_it_costs_more_than_it_saves(unet_selective, monkeypatch):
    """Keeping a node costs ``KEEP_OVERHEAD_SECONDS`` (marker calls, a dispatch mode around
    the node): a node cheaper than that is never kept."""
    model, inputs, planner, _, budget = unet_selective
    assert any(planner.solve(budget).kept)
    monkeypatch.setitem(KEEP_OVERHEAD_SECONDS, "cpu", 1.0)  # dearer than any node
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dear = Planner(model, inputs)
    assert not any(dear.search.replay_chain.node_seconds)
    charged = dear.solve(budget)
    assert not any(charged.kept)
    assert charged.segments == dear.solve(budget, selective=False).segments


def test_plans_without_kept_ops_still_load(unet_selective):
    """Plans written before selective recompute have no ``kept_ops``: they read as keeping
    nothing (schema version 1 still)."""
    plan = unet_selective[3].plan
    data = json.loads(plan.to_json())
    for segment in data["segments"]:
        segment.pop("kept_ops")
    old = Plan.from_dict(data)
    assert old.schema_version == plan.schema_version == 1
    assert all(seg.kept_ops == () for seg in old.segments)
    assert [s.first_node for s in old.segments] == [s.first_node for s in plan.segments]


def test_kept_calls_count_each_operator_within_the_segment(gpt):
    """The policy names a kept call by its operator and its index among that operator's
    calls in the segment's forward; the index counts from the segment's first node."""
    _, _, planner = gpt
    trace = planner.trace
    names = planner.chain.node_names
    linears = [i for i, name in enumerate(names) if name.endswith(("c_attn", "c_fc", "c_proj"))]
    first, stop = linears[0], linears[3] + 1  # one block's four linear layers
    calls = kept_calls(trace, first, stop, linears[:4])
    assert [index for _, _, index in calls] == [0, 1, 2, 3]
    assert {op for _, op, _ in calls} == {"aten.addmm.default"}
    # from a later first node the same calls count from 0 again
    later = kept_calls(trace, linears[1], stop, linears[1:4])
    assert [index for _, _, index in later] == [0, 1, 2]

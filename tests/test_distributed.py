"""Plans under DDP and FSDP2: two gloo ranks on CPU against single-process eager.

One module-scoped run plans four cases (the zoo's GPT and a held-out vision transformer that
is not in the zoo, each under DDP and FSDP2) at a per-rank budget that forces
checkpointing, spawns two ranks that re-apply each plan, wrap it the way users do and
measure one step at allocator level, and compares every rank with eager.
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import torch.distributed as dist

import autockpt
from autockpt.api import Planner, budget_in_bytes
from autockpt.base.runtime import default_loss
from autockpt.distributed import _AllocationLedger, _Failure, fsdp_bf16_twin, measure_rank
from autockpt.errors import (
    AutockptError,
    InfeasibleBudgetError,
    PrecisionWarning,
    ShardingError,
    TraceError,
    UncoveredCallWarning,
)
from autockpt.plan import Plan
from autockpt.planning.sharding import RANK_MARGIN_BYTES, detect_units
from autockpt_zoo.toy import block_stack, gpt
from benchmarks.distributed import (
    DEFAULT_KWARGS,
    STEP_SEED,
    Case,
    plan_case,
    reference,
    run_ranks,
    vit,
)

WORLD_SIZE = 2
CASES = (("gpt", "ddp"), ("gpt", "fsdp"), ("vit", "ddp"), ("vit", "fsdp"))
SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "plan.schema.json").read_text())

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


@pytest.fixture(scope="module")
def run():
    """Plans, per-rank results and eager references for every case (one spawn)."""
    cases = {}
    for model_name, sharding in CASES:
        case, plan = plan_case(model_name, sharding, WORLD_SIZE, fraction=0.3)
        cases[case.name] = (case, plan)
    results = run_ranks([case for case, _ in cases.values()], WORLD_SIZE)
    return {
        name: (case, plan, results[name], reference(case, WORLD_SIZE))
        for name, (case, plan) in cases.items()
    }


@pytest.mark.parametrize("name", [f"{m}-{s}" for m, s in CASES])
def test_every_rank_matches_single_process_eager(run, name):
    _, _, ranks, expected = run[name]
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["loss"], expected["losses"][rank], rtol=1e-5, atol=1e-6)
        assert got["grads"].keys() == expected["grads"].keys()
        for param, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][param], grad, rtol=1e-4, atol=1e-5, msg=param)


@pytest.mark.parametrize("name", [f"{m}-{s}" for m, s in CASES])
def test_every_rank_measures_under_its_budget(run, name):
    _, plan, ranks, _ = run[name]
    assert plan.segments, "the budget was chosen to need checkpointing"
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    for got in ranks:
        measured = got["measured"]
        assert measured["world_size"] == WORLD_SIZE
        assert measured["resident_bytes"] < measured["peak_bytes"] <= plan.budget_bytes


@pytest.mark.slow  # about 35 s: a plan and a spawn of its own
def test_every_rank_measures_under_the_stated_per_rank_minimum():
    """The minimum a sharded planner states is a plan's, for one rank (NOTE [search:
    per-rank peaks]): planned at exactly that budget, both FSDP2 ranks measure within it."""
    case, plan = plan_case("gpt", "fsdp", WORLD_SIZE, fraction=0.0)
    assert plan.budget_bytes == plan.minimum_peak_bytes
    assert plan.segments and plan.predicted_peak_bytes <= plan.budget_bytes
    for got in run_ranks([case], WORLD_SIZE)[case.name]:
        measured = got["measured"]
        assert measured["world_size"] == WORLD_SIZE
        assert measured["peak_bytes"] <= plan.budget_bytes


def test_fsdp_ranks_keep_a_shard_of_the_parameters(run):
    for model_name in ("gpt", "vit"):
        _, fsdp, fsdp_ranks, _ = run[f"{model_name}-fsdp"]
        _, ddp, ddp_ranks, _ = run[f"{model_name}-ddp"]
        # DDP keeps full parameters and a bucket copy of the gradients; FSDP a shard.
        assert fsdp.rank_memory.parameters < ddp.rank_memory.parameters / 1.5
        assert ddp.rank_memory.buckets == ddp.memory.gradients
        for f, d in zip(fsdp_ranks, ddp_ranks, strict=True):
            assert f["measured"]["resident_bytes"] < d["measured"]["resident_bytes"]
            # DDP's buckets are real: resident = parameters + buckets + buffers + inputs.
            resident = d["measured"]["resident_bytes"]
            assert abs(resident - ddp.rank_memory.static) <= 0.05 * ddp.rank_memory.static


def test_plans_record_world_size_sharding_and_units(run):
    for name, (_, plan, _, _) in run.items():
        assert plan.world_size == WORLD_SIZE
        assert plan.sharding == name.split("-")[1]
        assert Plan.from_json(plan.to_json()) == plan
        jsonschema.validate(json.loads(plan.to_json()), SCHEMA)
        assert plan.measured_peak_bytes is None  # verified unsharded: not a per-rank number
    assert run["gpt-fsdp"][1].fsdp_units == ("h.0", "h.1", "h.2", "h.3")
    assert run["vit-fsdp"][1].fsdp_units == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert run["gpt-ddp"][1].fsdp_units == ()


def test_units_stay_module_calls_and_segments_recompute_whole_units():
    model, batch = vit()
    planner = Planner(model, batch, world_size=2, sharding="fsdp")
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    result = planner.optimize(budget_gb=(low + 0.3 * (high - low)) / 2**30, verify=False)
    calls: Counter[str] = Counter()
    for unit in result.plan.fsdp_units:
        result.get_submodule(unit).register_forward_pre_hook(
            lambda module, args, unit=unit: calls.update([unit])
        )
    default_loss(result(*batch)).backward()
    # Every unit's own hooks fire (FSDP2 gathers there); a unit inside a checkpoint
    # segment is called again, whole, when backward recomputes it.
    assert set(calls) == set(result.plan.fsdp_units)
    assert set(calls.values()) <= {1, 2}
    assert 2 in calls.values()


def test_old_v1_plans_without_distributed_fields_still_load():
    model, x = block_stack(blocks=4, width=32, batch=4)
    plan = autockpt.optimize(model, x, budget_gb=1.0, verify=False).plan
    data = json.loads(plan.to_json())
    for key in ("world_size", "sharding", "fsdp_units", "rank_memory"):
        del data[key]
    old = Plan.from_json(json.dumps(data))
    assert (old.world_size, old.sharding, old.fsdp_units, old.rank_memory) == (1, None, (), None)
    assert old == plan


def test_unit_detection_picks_the_repeated_blocks():
    assert detect_units(gpt()[0]) == ("h.0", "h.1", "h.2", "h.3")
    assert detect_units(vit()[0]) == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")


def test_bad_distributed_arguments_raise_typed_errors():
    model, batch = gpt()
    with pytest.raises(ShardingError, match="world_size must be an integer >= 1"):
        autockpt.optimize(model, batch, budget_gb=1, world_size=0, sharding="ddp")
    with pytest.raises(ShardingError, match="sharding must be None, 'ddp' or 'fsdp'"):
        autockpt.optimize(model, batch, budget_gb=1, world_size=2, sharding="zero3")
    with pytest.raises(ShardingError, match=r"does not have: \['h.9'\]"):
        autockpt.optimize(
            model, batch, budget_gb=1, world_size=2, sharding="fsdp", fsdp_units=["h.0", "h.9"]
        )
    with pytest.raises(ShardingError, match="must not contain one another"):
        autockpt.optimize(
            model, batch, budget_gb=1, world_size=2, sharding="fsdp", fsdp_units=["h.0", "h.0.attn"]
        )
    with pytest.raises(ShardingError, match="not module calls"):
        autockpt.optimize(
            model, batch, budget_gb=1, world_size=2, sharding="fsdp", fsdp_units=["h"]
        )
    with pytest.raises(ShardingError, match="only applies with sharding='fsdp'"):
        autockpt.optimize(model, batch, budget_gb=1, world_size=2, sharding="ddp", fsdp_units=[])
    with pytest.raises(ShardingError, match="needs sharding="):
        autockpt.optimize(model, batch, budget_gb=1, world_size=4)
    with pytest.raises(ShardingError, match="no repeated blocks"):
        autockpt.optimize(
            torch.nn.Linear(4, 4), torch.randn(2, 4), budget_gb=1, world_size=2, sharding="fsdp"
        )


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_already_wrapped_models_are_refused(one_rank_group):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model, batch = gpt()
    with pytest.raises(
        ShardingError, match="DistributedDataParallel.*optimize on the plain module first"
    ):
        autockpt.optimize(DistributedDataParallel(model), batch, budget_gb=1)
    model, batch = gpt()
    fully_shard(model.h[0])
    with pytest.raises(ShardingError, match=r"FSDP2 fully_shard \(module 'h.0'\)"):
        autockpt.optimize(model, batch, budget_gb=1, world_size=2, sharding="fsdp")
    fully_shard(model)
    with pytest.raises(AutockptError, match="optimize on the plain module first"):
        autockpt.apply(model, Plan.from_json(_any_plan_json()))
    # Sharded parameters without any wrapper module are refused too.
    model, batch = gpt()
    stripped = fully_shard(model)
    stripped.__class__ = type(model).__mro__[2]  # the plain GPT class again
    assert not isinstance(stripped, torch.distributed.fsdp.FSDPModule)
    with pytest.raises(ShardingError, match="optimize on the plain module first"):
        autockpt.optimize(stripped, batch, budget_gb=1)


def test_budget_below_the_per_rank_minimum_names_the_engine_buffers():
    model, batch = vit()
    with pytest.raises(autockpt.InfeasibleBudgetError) as info:
        autockpt.optimize(
            model, batch, budget_gb=1e6 / 2**30, world_size=2, sharding="fsdp", verify=False
        )
    message = str(info.value)
    assert "parameters per rank of 2 (fsdp)" in message
    assert "FSDP all-gathered parameters" in message
    planner = Planner(model, batch, world_size=2, sharding="fsdp")
    assert info.value.minimum_bytes == planner.minimum_peak_bytes


def _any_plan_json() -> str:
    model, x = block_stack(blocks=2, width=16, batch=2)
    return autockpt.optimize(model, x, budget_gb=1.0, verify=False).plan.to_json()


def test_allocation_ledger_frees_a_block_whose_free_went_unreported_when_its_address_returns():
    ledger = _AllocationLedger()
    # 100 bytes at 0x10 freed on an unwatched thread (no event), then 0x10 allocated again.
    assert ledger.apply([(0x10, 100), (0x20, 50), (0x10, 80)]) == 150
    assert ledger.current == 130
    assert ledger.apply([(0x20, -50), (0x30, 10), (0x30, -10)]) == 130
    assert ledger.current == 80
    assert ledger.apply([(0x99, -7)]) == 80  # a free of a block it never saw changes nothing


def test_allocation_ledger_reads_frees_on_other_threads_from_the_allocator_total():
    ledger = _AllocationLedger()
    # Events carry the allocator's running total after them; 0x10 (100 bytes) is freed on
    # another thread before the third event: the total drops by 100 that nobody reported.
    assert ledger.apply([(0x10, 100, 100), (0x20, 50, 150), (0x30, 10, 60)]) == 150
    assert ledger.current == 60 and 0x10 not in ledger.live
    # The address returning later frees nothing twice.
    assert ledger.apply([(0x10, 20, 80)]) == 80
    # A rise nobody reported is memory of another thread: counted until the total drops.
    assert ledger.apply([(0x40, 5, 100)]) == 100
    assert ledger.apply([(0x40, -5, 80)]) == 100
    assert ledger.current == 80
    # A drop matching no block (nor two or three of them: 50, 10 and 20 are live) and no
    # other thread's bytes stays counted (upper bound).
    assert ledger.apply([(0x50, 1, 5)]) == 81


def test_allocation_ledger_reads_several_frees_on_other_threads_from_one_drop():
    ledger = _AllocationLedger()
    # 0x10 (100) and 0x20 (50) are both freed on another thread between two watched events:
    # one drop of 150 explains both (a bucket and its copy), timing decides how many fall
    # between two events.
    assert ledger.apply([(0x10, 100, 100), (0x20, 50, 150), (0x30, 30, 180), (0x40, 1, 31)]) == 180
    assert ledger.current == 31 and set(ledger.live) == {0x30, 0x40}


def test_allocation_ledger_corrects_a_drop_that_retired_the_wrong_block_of_its_size():
    ledger = _AllocationLedger()
    # Two gathered units of one size (0x10, 0x20). 0x10 is freed on another thread: the
    # drop of 100 cannot say which, and retires the most recent, 0x20.
    assert ledger.apply([(0x10, 100, 100), (0x20, 100, 200), (0x30, 1, 101)]) == 200
    assert ledger.current == 101 and set(ledger.live) == {0x10, 0x30}
    # 0x20 is then freed on a watched thread: it was alive, so the drop was 0x10's.
    assert ledger.apply([(0x20, -100, 1)]) == 101
    assert ledger.current == 1 and set(ledger.live) == {0x30}
    # 0x10 returning later frees nothing twice; a free of a block never seen changes nothing
    assert ledger.apply([(0x10, 50, 51), (0x99, -7, 44)]) == 51
    assert ledger.current == 51


def test_evaluation_after_fully_shard_uses_the_trained_root_parameters(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    reference, batch = vit()
    model, _ = vit()
    result = autockpt.optimize(
        model, batch, budget_gb=1, world_size=1, sharding="fsdp", verify=False
    )
    for name in result.plan.fsdp_units:
        fully_shard(result.get_submodule(name))
    fully_shard(result)
    for module in (reference, result):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
        default_loss(module(*batch)).backward()
        optimizer.step()
    reference.eval()
    result.eval()  # the other mode runs the original forward: on the sharded, trained tensors
    with torch.no_grad():
        torch.testing.assert_close(result(*batch), reference(*batch), rtol=1e-5, atol=1e-6)


def test_cli_plans_per_rank_and_rejects_bad_sharding_arguments(tmp_path, capsys):
    from autockpt.cli import EXIT_OK, EXIT_USAGE, main

    out = tmp_path / "plan.json"
    spec = "autockpt.zoo:block_stack"
    args = ["plan", spec, "--budget-gb", "1", "--world-size", "2", "--sharding", "fsdp"]
    assert main([*args, "-o", str(out), "--quiet"]) == EXIT_OK
    plan = Plan.load(out)
    assert (plan.world_size, plan.sharding) == (2, "fsdp")
    assert plan.fsdp_units == tuple(f"layers.{i}" for i in range(16))
    assert main(["verify", spec, str(out)]) == EXIT_OK
    assert "per rank of 2 under fsdp" in capsys.readouterr().out
    bad = [*args, "--fsdp-units", "layers.0,nope", "-o", str(out)]
    assert main(bad) == EXIT_USAGE
    assert "does not have: ['nope']" in capsys.readouterr().err
    # FSDP2's reshard_after_forward for every unit: planned, and said back by the plan
    assert main([*args, "--reshard-after-forward", "false", "-o", str(out), "--quiet"]) == EXIT_OK
    kept = Plan.load(out)
    assert kept.fsdp_kept_gathered == ("", *plan.fsdp_units)
    assert not any(kept.reshards(name) for name in ("", *kept.fsdp_units))
    assert kept.no_checkpoint_peak_bytes > plan.no_checkpoint_peak_bytes
    ddp = ["plan", spec, "--budget-gb", "1", "--world-size", "2", "--sharding", "ddp"]
    assert main([*ddp, "--reshard-after-forward", "true", "-o", str(out)]) == EXIT_USAGE
    assert "only applies with sharding='fsdp'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the torchrun pattern: every rank calls optimize; rank 0 plans, every rank applies its plan

SPAWN_TIMEOUT_S = 300  # the whole spawn; a hung collective is killed and fails the test
COLLECTIVE_TIMEOUT_S = 120  # gloo's own timeout, so a hung rank also errors out by itself


def _rank_entry(
    worker: Callable[..., dict[str, Any]], rank: int, world_size: int, out: str, args: tuple
) -> None:
    """A spawned rank: join the gloo group, run ``worker``, save what it returns (or the
    traceback that stopped it) for the parent."""
    result: dict[str, Any]
    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(out).resolve() / 'rendezvous'}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        result = worker(rank, world_size, *args)
    except BaseException:
        result = {"crash": traceback.format_exc()}
        raise
    finally:
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _spawn(worker: Callable[..., dict[str, Any]], args: tuple, out: Path) -> list[dict[str, Any]]:
    """Run ``worker(rank, world_size, *args)`` on WORLD_SIZE gloo ranks; never hang: ranks
    still running after SPAWN_TIMEOUT_S are killed and the test fails."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    procs = [
        context.Process(target=_rank_entry, args=(worker, rank, WORLD_SIZE, str(out), args))
        for rank in range(WORLD_SIZE)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join()
    if hung:
        pytest.fail(f"ranks {hung} still ran after {SPAWN_TIMEOUT_S} s: a collective hung")
    results = []
    for rank, proc in enumerate(procs):
        path = out / f"rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} exited with code {proc.exitcode} and saved nothing")
        result = torch.load(path, weights_only=False)
        if "crash" in result:
            pytest.fail(f"rank {rank} failed:\n{result['crash']}")
        results.append(result)
    return results


def _gpt_case(sharding: str) -> Case:
    return Case(f"gpt-{sharding}", "gpt", dict(DEFAULT_KWARGS["gpt"]), sharding, "")


def _wrap_as_users_do(model: torch.nn.Module, sharding: str) -> torch.nn.Module:
    """docs/distributed.md's lines: DDP(model), or fully_shard each unit and then the root."""
    if sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for name in model.plan.fsdp_units:
        fully_shard(model.get_submodule(name))
    fully_shard(model)
    return model


def _raised(call: Callable[[], Any]) -> dict[str, Any]:
    """What ``call`` raised: class, message, attributes and notes (empty if it returned)."""
    try:
        call()
    except Exception as error:
        attributes = {k: v for k, v in vars(error).items() if k != "__notes__"}
        return {
            "type": f"{type(error).__module__}.{type(error).__qualname__}",
            "message": str(error),
            "attributes": attributes,
            "notes": list(getattr(error, "__notes__", [])),
        }
    return {}


def _torchrun_rank(rank: int, world_size: int, budgets: dict[str, float]) -> dict[str, Any]:
    """One rank of a torchrun job: it calls autockpt.optimize itself, wraps the result, and
    runs one step; then the failure cases, each of which must raise on every rank."""
    results: dict[str, Any] = {}
    for sharding in ("fsdp", "ddp"):
        case = _gpt_case(sharding)
        model, inputs = case.model_and_rank_batch(rank)
        result = autockpt.optimize(
            model, inputs, budget_gb=budgets[sharding], world_size=world_size, sharding=sharding
        )
        plan = result.plan
        wrapped = _wrap_as_users_do(result, sharding)
        torch.manual_seed(STEP_SEED)
        loss = default_loss(wrapped(*inputs.args, **inputs.kwargs))
        loss.backward()
        grads = {}
        for name, p in wrapped.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("module.")] = grad.detach().clone()

        def build(case: Case = case, plan: Plan = plan) -> tuple[torch.nn.Module, Any]:
            model, inputs = case.model_and_rank_batch(rank)
            return _wrap_as_users_do(autockpt.apply(model, plan), plan.sharding), inputs

        _, _, measured = measure_rank(build)
        results[sharding] = {
            "plan_json": plan.to_json(),
            "loss": loss.detach(),
            "grads": grads,
            "peak_bytes": measured.peak_bytes,
            "world_size": measured.world_size,
        }

    model, inputs = _gpt_case("fsdp").model_and_rank_batch(rank)
    results["infeasible"] = _raised(
        lambda: autockpt.optimize(
            model, inputs, budget_gb=1e-3, world_size=world_size, sharding="fsdp", verify=False
        )
    )
    small, x = block_stack(blocks=4, width=32, batch=4)
    results["world_size_too_large"] = _raised(
        lambda: autockpt.optimize(small, x, budget_gb=1.0, world_size=4, sharding="ddp")
    )
    # Rank 1's model has a block fewer: it cannot apply rank 0's plan, so rank 0 fails too.
    other, x = block_stack(blocks=4 - rank, width=32, batch=4)
    results["different_model"] = _raised(
        lambda: autockpt.optimize(other, x, budget_gb=1.0, verify=False)
    )
    # Rank 1 plans (plan_rank=1); rank 0 asked for another budget.
    results["different_budget"] = _raised(
        lambda: autockpt.optimize(small, x, budget_gb=1.0 + rank, verify=False, plan_rank=1)
    )
    # Budgets a few bytes apart (each rank derived its own): one plan, for the smaller.
    nearly = autockpt.optimize(small, x, budget_gb=0.0278156668 - rank * 5e-9, verify=False)
    results["nearly_same_budget"] = nearly.plan.to_json()
    # plan_rank=None: each rank plans its own batch (of another size: a broadcast plan would
    # not fit rank 1's).
    own, batch = block_stack(blocks=2, width=16, batch=3 + rank)
    planned = autockpt.optimize(own, batch, budget_gb=1.0, verify=False, plan_rank=None)
    results["plan_rank_none"] = planned.plan.input_signature
    return results


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory):
    """Both ranks' results, the budgets and the eager references (one spawn)."""
    budgets, references = {}, {}
    for sharding in ("fsdp", "ddp"):
        case = _gpt_case(sharding)
        model, batch = case.build(0)
        planner = Planner(model, batch, world_size=WORLD_SIZE, sharding=sharding)
        low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
        budgets[sharding] = (low + 0.3 * (high - low)) / 2**30
        references[sharding] = reference(case, WORLD_SIZE)
    out = tmp_path_factory.mktemp("torchrun")
    ranks = _spawn(_torchrun_rank, (budgets,), out)
    return budgets, references, ranks


@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_ranks_that_each_call_optimize_apply_one_plan_and_match_eager(torchrun, sharding):
    _, references, ranks = torchrun
    expected = references[sharding]
    plans = [got[sharding]["plan_json"] for got in ranks]
    assert plans[0] == plans[1], "every rank must checkpoint the same segments"
    assert Plan.from_json(plans[0]).segments, "the budget was chosen to need checkpointing"
    for rank, got in enumerate(ranks):
        got = got[sharding]
        torch.testing.assert_close(got["loss"], expected["losses"][rank], rtol=1e-5, atol=1e-6)
        assert got["grads"].keys() == expected["grads"].keys()
        for param, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][param], grad, rtol=1e-4, atol=1e-5, msg=param)


@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_ranks_that_each_call_optimize_measure_under_the_budget(torchrun, sharding):
    budgets, _, ranks = torchrun
    plan = Plan.from_json(ranks[0][sharding]["plan_json"])
    assert plan.budget_bytes == int(budgets[sharding] * 2**30)
    assert (plan.world_size, plan.sharding) == (WORLD_SIZE, sharding)
    for got in ranks:
        assert got[sharding]["world_size"] == WORLD_SIZE
        assert got[sharding]["peak_bytes"] <= plan.budget_bytes


def test_a_planning_failure_on_rank_0_is_raised_on_every_rank(torchrun):
    _, _, ranks = torchrun
    first, second = (got["infeasible"] for got in ranks)
    assert first["type"] == second["type"] == "autockpt.errors.InfeasibleBudgetError"
    assert first["message"] == second["message"]
    assert first["attributes"] == second["attributes"]  # minimum and breakdown included
    assert first["attributes"]["minimum_bytes"] > first["attributes"]["budget_bytes"]
    assert "FSDP all-gathered parameters" in first["attributes"]["breakdown"]
    assert any("raised on rank 0 while planning" in note for note in second["notes"])


def test_a_world_size_larger_than_the_group_is_refused_on_every_rank(torchrun):
    _, _, ranks = torchrun
    first, second = (got["world_size_too_large"] for got in ranks)
    assert first["type"] == second["type"] == "autockpt.errors.ShardingError"
    assert first["message"] == second["message"]
    assert "world_size=4 does not fit the process group of 2 ranks" in first["message"]


def test_a_rank_that_cannot_apply_the_plan_fails_every_rank(torchrun):
    _, _, ranks = torchrun
    first, second = (got["different_model"] for got in ranks)
    assert first["type"] == second["type"] == "autockpt.errors.PlanMismatchError"
    assert first["message"] == second["message"]
    assert "different graph" in first["message"]
    assert any("raised on rank 1 while applying the plan of rank 0" in n for n in first["notes"])


def test_ranks_asking_for_different_plans_fail_every_rank(torchrun):
    _, _, ranks = torchrun
    first, second = (got["different_budget"] for got in ranks)
    assert first["type"] == second["type"] == "autockpt.errors.ShardingError"
    assert first["message"] == second["message"]
    assert "budget_gb=1.0 here, 2.0 on rank 1" in first["message"]


def test_budgets_a_few_bytes_apart_get_one_plan_for_the_smallest(torchrun):
    _, _, ranks = torchrun
    first, second = (Plan.from_json(got["nearly_same_budget"]) for got in ranks)
    assert first == second
    assert first.budget_bytes == budget_in_bytes(0.0278156668 - 5e-9)
    assert any("one plan for the smallest" in note for note in first.notes)


def test_ranks_agree_on_a_budget_or_all_refuse_before_planning():
    """Every rank computes the same verdict from every rank's request (no collective)."""
    from autockpt.distributed import PlanRequest, _agreed_budget

    near = [PlanRequest(0.027815666794776917, 2, "ddp", "total"), None]
    near[1] = dataclasses.replace(near[0], budget_gb=0.02781566195189953)
    assert _agreed_budget(near, 0) == (0.02781566195189953, _agreed_budget(near, 1)[1])
    assert "0.02781566195189953" in _agreed_budget(near, 0)[1]
    same = [near[0], near[0]]
    assert _agreed_budget(same, 1) == (near[0].budget_gb, None)
    far = [near[0], dataclasses.replace(near[0], budget_gb=0.03)]
    for plan_rank in (0, 1):
        with pytest.raises(ShardingError, match="budget_gb="):
            _agreed_budget(far, plan_rank)
    other = [near[0], dataclasses.replace(near[0], scope="activations")]
    with pytest.raises(ShardingError, match="scope='total' here, 'activations' on rank 1"):
        _agreed_budget(other, 1)


def test_plan_rank_none_plans_on_every_rank_separately(torchrun):
    _, _, ranks = torchrun
    # Each rank's plan is made for its own batch (3 and 4 rows): nothing was broadcast.
    assert [got["plan_rank_none"] for got in ranks] == [
        "(['Tensor[3, 16]:float32'], {})",
        "(['Tensor[4, 16]:float32'], {})",
    ]


def test_a_failure_crosses_ranks_with_its_class_message_and_attributes():
    errors = [
        InfeasibleBudgetError(1000, 5000, {"parameters": 4000}, "total", "Raise it."),
        TraceError("h.0", "model.py:12", "if x.sum() > 0:", "data-dependent branch"),
        ShardingError("bad world_size"),
        KeyError("h.9"),
    ]
    for error in errors:
        again = _Failure.of(error, 0, "planning").rebuild()
        assert type(again) is type(error)
        assert str(again) == str(error)
        assert {k: v for k, v in vars(again).items() if k != "__notes__"} == vars(error)
    again = _Failure.of(errors[0], 0, "planning").rebuild()
    assert again.minimum_gb == errors[0].minimum_gb and again.breakdown == {"parameters": 4000}


# ---------------------------------------------------------------------------------------------
# FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): precision="fsdp-bf16"

MIXED_GPT = {"layers": 4, "dim": 64, "heads": 4, "vocab_size": 128, "seq_len": 32, "batch": 4}


def _mixed_precision_rank(rank: int, world_size: int, plan_json: str) -> dict[str, Any]:
    """One rank: the plan (made on the bfloat16 twin) applied to the float32 model, wrapped
    with the policy and measured; then the same step under FSDP2 alone with the policy.
    Returns both steps' losses and full gradients and the measurement."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from autockpt.distributed import wrap

    plan = Plan.from_json(plan_json)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def model_and_my_batch() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        return gpt(**MIXED_GPT, seed=0)[0], gpt(**MIXED_GPT, seed=100 + rank)[1]

    def build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        model, batch = model_and_my_batch()
        result = autockpt.apply(model, plan, batch)
        return wrap(result, "fsdp", plan.fsdp_units, mp_policy=policy), batch

    def step(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(STEP_SEED)
        loss = default_loss(model(*batch))
        loss.backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        return {"loss": loss.detach().float(), "grads": grads}

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        wrapped, inputs, measured = measure_rank(build)
        planned = step(wrapped, inputs.args)
    model, batch = model_and_my_batch()
    for unit in plan.fsdp_units:
        fully_shard(model.get_submodule(unit), mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return {
        "planned": planned,
        "fsdp": step(model, batch),
        "measured": dataclasses.asdict(measured),
        # what autockpt said about the calls: another precision, an uncovered call
        "warned": [
            str(w.message)
            for w in said
            if issubclass(w.category, (PrecisionWarning, UncoveredCallWarning))
        ],
    }


@pytest.mark.slow  # about a minute: a plan, then two ranks
def test_fsdp_mixed_precision_plan_runs_under_the_policy_like_fsdp2_alone(tmp_path):
    """NOTE [precision: FSDP2 mixed precision]: planned on the model in bfloat16 with
    ``precision="fsdp-bf16"``, applied to the float32 model that ``fully_shard(...,
    mp_policy=...)`` wraps: every rank is within the per-rank budget and its prediction,
    and trains like the same FSDP2 run without autockpt."""
    model, batch = gpt(**MIXED_GPT, seed=0)
    twin = fsdp_bf16_twin(model)  # bfloat16 parameters, buffers as they are
    planner = Planner(twin, batch, world_size=WORLD_SIZE, sharding="fsdp", precision="fsdp-bf16")
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    plan = planner.optimize(budget_gb=(low + 0.3 * (high - low)) / 2**30).plan
    assert plan.segments and plan.fsdp_units == ("h.0", "h.1", "h.2", "h.3")
    # the rank keeps float32 shards of the float32 model it trains
    assert plan.rank_memory.parameters == -(-sum(p.nbytes for p in model.parameters()) // 2)
    for got in _spawn(_mixed_precision_rank, (plan.to_json(),), tmp_path):
        # the wrapped float32 model runs the planned precision: the graph, no warning
        assert got["warned"] == []
        torch.testing.assert_close(got["planned"]["loss"], got["fsdp"]["loss"])
        assert got["planned"]["grads"].keys() == got["fsdp"]["grads"].keys()
        for name, grad in got["fsdp"]["grads"].items():
            assert grad.dtype == torch.float32  # reduce-scattered in float32, kept in float32
            torch.testing.assert_close(got["planned"]["grads"][name], grad, msg=name)
        measured = got["measured"]
        assert measured["peak_bytes"] <= plan.predicted_peak_bytes <= plan.budget_bytes
        # float32 shards and buffers: what the rank keeps is what the plan counts
        assert measured["resident_bytes"] <= plan.rank_memory.static + RANK_MARGIN_BYTES


def test_measure_rank_with_an_optimizer_measures_whole_iterations_from_steady_state():
    """``measure_rank(..., optimizer=...)``: the optimizer is built over the wrapped model
    inside the measurement, each step is forward, backward and ``optimizer.step()``, and
    its state (made by the warm-up) is resident between steps, as a plan with an optimizer
    counts it."""
    width = 256

    def build() -> tuple[torch.nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        return torch.nn.Linear(width, width), torch.randn(8, width)

    built: list[torch.optim.Optimizer] = []

    def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
        built.append(torch.optim.AdamW(model.parameters()))
        return built[-1]

    _, _, plain = measure_rank(build)
    model, _, stepped = measure_rank(build, optimizer=adamw)
    parameters = (width * width + width) * 4
    state = stepped.resident_bytes - plain.resident_bytes
    assert 2 * parameters <= state <= 2 * parameters + 4096  # two moments (and step counts)
    assert stepped.peak_bytes - stepped.resident_bytes > plain.peak_bytes - plain.resident_bytes
    assert built and built[0].state[next(model.parameters())]["step"] == 3  # warm-up 2, then 1

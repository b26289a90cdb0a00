"""Plans under DDP and FSDP2: two gloo ranks on CPU against single-process eager.

One module-scoped run plans four cases (the zoo's GPT and a held-out vision transformer that
is not in the zoo, each under DDP and FSDP2) at a per-rank budget that forces
checkpointing, spawns two ranks that re-apply each plan, wrap it the way users do and
measure one step at allocator level, and compares every rank with eager.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import torch
import torch.distributed as dist

import autockpt
from autockpt.api import Planner
from autockpt.distributed import _AllocationLedger, detect_units
from autockpt.errors import AutockptError, ShardingError
from autockpt.plan import Plan
from autockpt.runtime import default_loss
from autockpt.zoo import block_stack, gpt
from benchmarks.distributed import plan_case, reference, run_ranks, vit

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
    planner = Planner(model, batch, world_size=2, sharding="fsdp", calibrate=False)
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
    planner = Planner(model, batch, world_size=2, sharding="fsdp", calibrate=False)
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
    # A drop matching no block and no other thread's bytes stays counted (upper bound).
    assert ledger.apply([(0x50, 1, 1)]) == 81


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

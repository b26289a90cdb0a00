"""One per-rank memory model under DDP and FSDP2 (NOTE [search: per-rank peaks]): the search,
the leanest plan, ``minimum_peak_bytes``, the breakdown and every refusal judge plans by a
rank's prediction (the replay plus the plan's rank shift), not by one process's.

A small language model on the meta device with AdamW (shapes alone: no probe, no
verification), planned for 8 ranks: FSDP shards the parameters, gradients and optimizer
state, so a rank's peaks lie far below one process's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autockpt.distributed import fsdp_bf16_twin
from autockpt.errors import GIB, InfeasibleBudgetError, PrecisionError, ShardingError
from autockpt.plan import Plan
from autockpt.planning.sharding import resolve_sharding
from autockpt_zoo.toy import param_heavy, square_mean
from solvers.search import leanest
from tests.conftest import quiet_planner

WORLD_SIZE = 8


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.n1(x)).chunk(3, -1)
        b, t, d = q.shape
        q, k, v = (y.view(b, t, 8, d // 8).transpose(1, 2) for y in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), target.flatten())


def _planner(sharding: str, precision: str | None = None, bf16: bool = False):
    """The LM on meta with AdamW; ``bf16``: with bfloat16 parameters (as ``bf16-true`` and
    ``fsdp-bf16`` take it)."""
    with torch.device("meta"):
        model = fsdp_bf16_twin(LM().train()) if bf16 else LM().train()
    idx = torch.empty(4, 128, dtype=torch.long, device="meta")
    return quiet_planner(
        model,
        (idx, idx),
        optimizer=torch.optim.AdamW(model.parameters()),
        loss_fn=lambda loss: loss,
        world_size=WORLD_SIZE,
        sharding=sharding,
        precision=precision,
    )


@pytest.fixture(scope="module")
def fsdp():
    return _planner("fsdp")


@pytest.fixture(scope="module")
def ddp():
    return _planner("ddp")


def _single_process_leanest(planner) -> int:
    """The leanest peak of the same chain judged by one process's replay: what the search
    walked before it took a rank's shift."""
    chain = dataclasses.replace(planner.search.replay_chain, rank_shift=None)
    return leanest(chain, seeds=planner.search.seeds).peak_bytes


def test_a_budget_at_the_rank_no_checkpoint_peak_checkpoints_nothing(fsdp):
    budget = fsdp.no_checkpoint_peak_bytes
    # one process's replay would need checkpoints here
    assert budget < fsdp.predict([]) - fsdp.predictor.rank_shift([])
    assert fsdp.solve(budget).segments == []
    plan = fsdp.optimize(budget_gb=budget / GIB).plan
    assert plan.segments == ()
    assert plan.predicted_peak_bytes == fsdp.no_checkpoint_peak_bytes <= plan.budget_bytes


def test_a_budget_below_one_process_minimum_is_planned_for_a_rank(fsdp):
    low, single = fsdp.minimum_peak_bytes, _single_process_leanest(fsdp)
    assert low < single < fsdp.no_checkpoint_peak_bytes
    budget = (low + single) // 2
    solution = fsdp.solve(budget)
    assert solution.segments  # it needs checkpoints, and a rank's peak fits
    assert solution.peak_bytes == fsdp.predict(solution.segments, solution.kept) <= budget
    plan = fsdp.optimize(budget_gb=budget / GIB).plan
    assert plan.segments and plan.predicted_peak_bytes <= plan.budget_bytes


def test_the_leanest_plan_is_a_ranks(fsdp, ddp):
    for planner in (fsdp, ddp):
        lean = planner.search.leanest()
        assert lean.peak_bytes == planner.minimum_peak_bytes == planner.predict(lean.segments)
        for seed in planner.search.seeds:
            assert lean.peak_bytes <= planner.predict(seed)
    # FSDP units are leaves: a short chain, where the search proves its answer
    assert fsdp.chain.num_stages <= 10 and fsdp.search.leanest().status == "optimal"


@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_planning_at_the_stated_minimum_succeeds(sharding, fsdp, ddp):
    planner = {"fsdp": fsdp, "ddp": ddp}[sharding]
    minimum = planner.minimum_peak_bytes
    assert planner.solve(minimum).peak_bytes <= minimum
    plan = planner.optimize(budget_gb=minimum / GIB).plan
    assert plan.budget_bytes == minimum and plan.predicted_peak_bytes <= minimum
    with pytest.raises(InfeasibleBudgetError) as refused:
        planner.solve(minimum - 1)
    assert refused.value.minimum_bytes == minimum
    assert "solver='auto'" not in str(refused.value)


@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_the_breakdown_is_a_ranks(sharding, fsdp, ddp):
    planner = {"fsdp": fsdp, "ddp": ddp}[sharding]
    memory = planner.rank_memory
    with pytest.raises(InfeasibleBudgetError) as refused:
        planner.solve(planner.minimum_peak_bytes // 2)
    parts = refused.value.breakdown
    assert parts == dict(planner.breakdown)
    assert parts["optimizer state per rank"] == memory.optimizer_state > 0
    assert "optimizer state" not in parts  # one process's figure is not listed
    assert parts[f"parameters per rank of {WORLD_SIZE} ({sharding})"] == memory.parameters
    assert parts["leanest plan's peak"] == planner.minimum_peak_bytes
    whole = dict(planner.trace.resident)["optimizer state"]  # one process's AdamW state
    share = -(-whole // WORLD_SIZE) if sharding == "fsdp" else whole
    assert memory.optimizer_state == share


# -- FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) ----------------


def _bf16_planner(precision: str, sharding: str = "fsdp"):
    return _planner(sharding, precision, bf16=True)


def _elements(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_fsdp_mixed_precision_keeps_float32_shards_and_gathers_bfloat16_units():
    """NOTE [sharding: FSDP2 mixed precision]: the step is the bfloat16 model's; a rank
    keeps float32 shards, gradient shards and AdamW state, gathers each unit in bfloat16,
    and reduce-scatters each unit's bfloat16 gradients through a float32 input."""
    policy, true = _bf16_planner("fsdp-bf16"), _bf16_planner("bf16-true")
    model, n = policy.model, WORLD_SIZE
    units = [model.get_submodule(u) for u in policy.sharding.units]
    unit_elements = [_elements(u) for u in units]
    root_elements = _elements(model) - sum(unit_elements)
    kept, gathered = policy.rank_memory, true.rank_memory

    def shard(nbytes: int) -> int:
        return -(-nbytes // n)

    float32_shards = sum(shard(4 * e) for e in unit_elements) + shard(4 * root_elements)
    assert kept.parameters == kept.gradients == float32_shards
    assert gathered.parameters == sum(shard(2 * e) for e in unit_elements) + shard(
        2 * root_elements
    )
    # two units and the root gathered in bfloat16, as bf16-true gathers them
    bf16_gathered = 2 * 2 * max(unit_elements) + 2 * root_elements
    assert kept.gathered_parameters == gathered.gathered_parameters == bf16_gathered

    # NOTE [sharding: what a reduce-scatter holds]: a window is the larger of every
    # bfloat16 gradient beside the float32 input, and the group's last gradient (FSDP2's
    # order: a block's down.bias, the root's head) beside input and shard; the previous
    # unit's input, retained, beside the gradients being made is no larger here (equal units)
    def window(elements: int, last: int, kept_size: int) -> int:
        computed, kept_bytes = 2 * elements, kept_size * elements
        return max(computed + kept_bytes, 2 * last + kept_bytes + shard(kept_bytes))

    lasts = [u.down.bias.numel() for u in units] + [model.head.weight.numel()]
    sizes = [*unit_elements, root_elements]
    assert kept.reduce_scatter == max(window(e, b, 4) for e, b in zip(sizes, lasts, strict=True))
    assert gathered.reduce_scatter == max(
        window(e, b, 2) for e, b in zip(sizes, lasts, strict=True)
    )
    # AdamW steps the float32 shards: twice the state of a bfloat16 rank (shards rounded up)
    assert abs(kept.optimizer_state - 2 * gathered.optimizer_state) <= 1
    assert kept.static - gathered.static == (
        kept.parameters - gathered.parameters + kept.optimizer_state - gathered.optimizer_state
    )
    # the same step, more kept: every plan of the policy peaks higher on a rank
    assert policy.minimum_peak_bytes > true.minimum_peak_bytes
    assert policy.no_checkpoint_peak_bytes - true.no_checkpoint_peak_bytes >= (
        kept.static - gathered.static
    )
    plan = policy.optimize(budget_gb=policy.no_checkpoint_peak_bytes / GIB).plan
    assert plan.rank_memory == kept and plan.predicted_peak_bytes <= plan.budget_bytes
    assert "kept in float32 by FSDP2's mixed precision" in " ".join(plan.notes)


def test_fsdp_mixed_precision_is_refused_without_fsdp_or_on_a_float32_model():
    with pytest.raises(ShardingError, match="sharding='fsdp'"):
        _bf16_planner("fsdp-bf16", sharding="ddp")
    with torch.device("meta"):
        model = LM().train()
    idx = torch.empty(4, 128, dtype=torch.long, device="meta")
    with pytest.raises(PrecisionError, match="fsdp_bf16_twin"):
        quiet_planner(
            model, (idx, idx), world_size=WORLD_SIZE, sharding="fsdp", precision="fsdp-bf16"
        )


def test_cpu_ranks_count_gloos_copy_of_each_reduce_scatter_input(fsdp):
    """NOTE [sharding: the backend's reduce-scatter]: a plan for CPU ranks (a CPU target
    from meta) counts gloo's copy of each reduce-scatter's input, a meta plan without a
    target (GPU ranks, NCCL) does not; what a rank keeps is the same."""
    import autockpt

    cpu = autockpt.Target("cpu", "cpu", 64 * GIB, (("float32", 1e11),), 2e10, "test")
    with torch.device("meta"):
        model = LM().train()
    idx = torch.empty(4, 128, dtype=torch.long, device="meta")
    on_cpu = quiet_planner(
        model,
        (idx, idx),
        optimizer=torch.optim.AdamW(model.parameters()),
        loss_fn=lambda loss: loss,
        world_size=WORLD_SIZE,
        sharding="fsdp",
        target=cpu,
    )
    n = WORLD_SIZE
    units = [model.get_submodule(u) for u in fsdp.sharding.units]
    unit_bytes = [4 * sum(p.numel() for p in u.parameters()) for u in units]
    root = 4 * sum(p.numel() for p in model.parameters()) - sum(unit_bytes)

    lasts = [4 * u.down.bias.numel() for u in units] + [4 * model.head.weight.numel()]

    def window(b: int, last: int, copies: int) -> int:
        # every gradient beside the input; the last one beside the input's copies and shard
        return max(b + b, last + b * (1 + copies) + -(-b // n))

    def windows(copies: int) -> int:
        return max(
            window(b, last, copies) for b, last in zip([*unit_bytes, root], lasts, strict=True)
        )

    assert fsdp.rank_memory.reduce_scatter == windows(0)
    assert on_cpu.rank_memory.reduce_scatter == windows(1)
    assert on_cpu.rank_memory.static == fsdp.rank_memory.static
    # the root's reduce-scatter, which ends backward, holds its input twice on CPU ranks
    gpu_end = fsdp.search.replay_chain.rank_shift.end_bytes
    cpu_end = on_cpu.search.replay_chain.rank_shift.end_bytes
    assert cpu_end - gpu_end == window(root, lasts[-1], 1) - window(root, lasts[-1], 0) > 0
    assert on_cpu.no_checkpoint_peak_bytes >= fsdp.no_checkpoint_peak_bytes


def test_a_refusal_under_fsdp2_mixed_precision_counts_accumulated_gradients_in_float32():
    """The breakdown of a refused budget agrees with the rank model: under ``fsdp-bf16``
    the gradients a micro-batch accumulates are kept as float32 shards, twice what a
    ``bf16-true`` rank keeps (it used to list them at the bfloat16 size)."""
    found = {}
    for precision in ("fsdp-bf16", "bf16-true"):
        with torch.device("meta"):
            model = fsdp_bf16_twin(LM().train())
        idx = torch.empty(4, 128, dtype=torch.long, device="meta")
        planner = quiet_planner(
            model,
            (idx, idx),
            optimizer=torch.optim.AdamW(model.parameters()),
            accumulation_steps=2,
            loss_fn=lambda loss: loss,
            world_size=WORLD_SIZE,
            sharding="fsdp",
            precision=precision,
        )
        with pytest.raises(InfeasibleBudgetError) as refused:
            planner.optimize(budget_gb=1e-6)
        found[precision] = refused.value.breakdown["accumulated gradients per rank"]
    assert abs(found["fsdp-bf16"] - 2 * found["bf16-true"]) <= 1
    assert found["bf16-true"] > 0


# -- measured: what a reduce-scatter holds, on two gloo ranks ------------------------------------


class RootHeavy(nn.Module):
    """An embedding and a head (the root, both large) around one small unit: each rank
    peaks at the root's reduce-scatter, which ends backward."""

    def __init__(self, vocab: int = 8192, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = Block(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.block(self.emb(idx))).flatten(0, 1), target.flatten())


def _root_heavy(
    seed: int, frozen: bool = False
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = RootHeavy().train()
    model.emb.weight.requires_grad_(not frozen)
    idx = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(seed + 1))
    return model, (idx, idx.roll(1, dims=1))


def _root_heavy_rank(rank: int, world_size: int, plan_json: str, frozen: bool) -> dict:
    import autockpt
    from autockpt.distributed import measure_rank, wrap
    from autockpt.plan import Plan

    plan = Plan.from_json(plan_json)

    def build():
        model, batch = _root_heavy(0, frozen)
        model = autockpt.apply(model, plan, batch)
        return wrap(model, "fsdp", plan.fsdp_units), batch

    _, _, measured = measure_rank(build, loss_fn=lambda loss: loss)
    return {"peak": measured.peak_bytes, "resident": measured.resident_bytes}


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-embedding"])
def test_the_root_reduce_scatter_holds_only_the_last_gradient_as_measured(tmp_path, frozen):
    """NOTE [sharding: what a reduce-scatter holds]: FSDP2 releases a group's unsharded
    gradients at the copy into the flat input, all but its last parameter's (the head's
    here), so the root's reduce-scatter holds the head's gradient, not the embedding's.
    Counting both put this rank's peak 2 MiB (the embedding's gradient, 15%) above the truth;
    now the prediction is within 1% of the allocator's count, and not below it. A frozen
    embedding is gathered but makes no gradient: the end of backward counts the gradients
    the root makes, not its parameters (counting the parameters put it below the truth)."""
    from tests.test_distributed import _spawn

    model, batch = _root_heavy(0, frozen)
    planner = quiet_planner(
        model,
        batch,
        loss_fn=lambda loss: loss,
        world_size=2,
        sharding="fsdp",
        fsdp_units=["block"],
    )
    plan = planner.optimize(budget_gb=planner.no_checkpoint_peak_bytes / GIB).plan
    assert plan.fsdp_units == ("block",) and not plan.segments
    embedding = model.emb.weight.nbytes
    # gloo's worker thread drops its copy of the block's reduce-scatter input after the
    # collective returns; on a loaded machine that free has come after the root's
    # allocations (NOTE [sharding: the backend's reduce-scatter]): 199,924 bytes over, once
    # in about ten runs; a race of the CPU backend, not part of the plan
    late = sum(p.nbytes for p in model.block.parameters())
    for got in _spawn(_root_heavy_rank, (plan.to_json(), frozen), tmp_path):
        assert got["peak"] <= plan.predicted_peak_bytes + late
        assert plan.predicted_peak_bytes <= 1.01 * got["peak"]
        assert plan.predicted_peak_bytes - got["peak"] < embedding // 4


# -- FSDP2's reshard_after_forward, and segments of several units (NOTE [search: gathered
# units]) -------------------------------------------------------------------------------------


def _heavy(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Six units of 2.1 MB around a root of 1 MB: the gathered units are a large part of a
    rank's peak, and the loss (``square_mean``) runs outside the model."""
    return param_heavy(seed=seed)


def _heavy_planner(reshard_after_forward=None, world_size: int = 2):
    model, batch = _heavy()
    planner = quiet_planner(
        model,
        batch,
        loss_fn=square_mean,
        world_size=world_size,
        sharding="fsdp",
        reshard_after_forward=reshard_after_forward,
    )
    return model, planner


def test_reshard_after_forward_is_read_as_fully_shard_takes_it():
    """NOTE [sharding: reshard after forward]: None is FSDP2's defaults (units reshard, the
    root does not), a bool is every unit's, a mapping names units and '' the root; the
    plan records which modules stay gathered and says what to pass to fully_shard."""
    model, _ = _heavy()
    units = tuple(f"layers.{i}" for i in range(6))

    def kept(choice):
        return resolve_sharding(model, 2, "fsdp", None, choice).kept_gathered

    assert kept(None) == kept(True) == ("",)
    assert kept(False) == ("", *units)
    assert kept({"": True, "layers.3": False}) == ("layers.3",)
    for bad, says in (
        ({"layers.9": False}, "not FSDP units"),
        ({"layers.0": 2}, "must be bools"),
        (2, "not modelled"),
    ):
        with pytest.raises(ShardingError, match=says):
            kept(bad)
    with pytest.raises(ShardingError, match="only applies with sharding='fsdp'"):
        resolve_sharding(model, 2, "ddp", None, False)
    _, planner = _heavy_planner({"": True, "layers.3": False})
    plan = planner.optimize(budget_gb=planner.no_checkpoint_peak_bytes / GIB, verify=False).plan
    assert plan.fsdp_kept_gathered == ("layers.3",)
    assert Plan.from_json(plan.to_json()) == plan
    assert [plan.reshards(m) for m in ("", *units)] == [True, True, True, True, False, True, True]
    with pytest.raises(ValueError, match="not one of the plan's fsdp_units"):
        plan.reshards("inp")
    said = "kept gathered after forward: layers.3; the root resharded after forward"
    assert said in plan.summary()


def test_units_kept_gathered_count_from_their_forward_to_their_backward():
    """Keeping every unit gathered after forward costs a rank the units beyond the two the
    default counts, at the end of forward; the root resharded after forward is not held
    while the loss runs (the model's output only), and is gathered again for backward."""
    _, default = _heavy_planner(None)
    _, kept = _heavy_planner(False)
    unit = sum(p.nbytes for p in default.model.layers[0].parameters())
    shifts = [p.predictor.replay_chain.rank_shift for p in (default, kept)]
    last = 6  # the compute node calling layers.5 (stage 6: one node per stage here)
    # its forward holds the five units before it beside itself and its gather's output
    assert shifts[1].gathering[last] - shifts[0].gathering[last] == 5 * unit
    # its backward, all six: four more than the static part counts
    assert shifts[0].units.backward(last) == 0 and shifts[1].units.backward(last) == 4 * unit
    assert kept.no_checkpoint_peak_bytes > default.no_checkpoint_peak_bytes + unit
    assert kept.rank_memory.gathered_parameters > default.rank_memory.gathered_parameters
    _, root = _heavy_planner({"": True})
    shift = root.predictor.replay_chain.rank_shift
    root_bytes = sum(p.nbytes for m in (root.model.inp, root.model.out) for p in m.parameters())
    assert shift.loss_bytes == -root_bytes and shift.backward_start_bytes == root_bytes


def _heavy_rank(rank: int, world_size: int, plan_json: str) -> dict:
    import autockpt
    from autockpt.distributed import measure_rank, wrap

    plan = Plan.from_json(plan_json)

    def build():
        model, batch = _heavy()
        return wrap(autockpt.apply(model, plan, batch), "fsdp", plan=plan), batch

    _, _, measured = measure_rank(build, loss_fn=square_mean)
    return {"peak": measured.peak_bytes, "resident": measured.resident_bytes}


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)
@pytest.mark.parametrize(
    ("choice", "segments"),
    [(None, [(1, 7)]), (False, []), ({"": True}, [])],
    ids=["one-segment-over-every-unit", "units-kept-gathered", "root-resharded"],
)
def test_a_rank_holds_what_the_plan_predicts_as_measured(tmp_path, choice, segments):
    """NOTE [search: gathered units], measured on two gloo ranks. A segment's recompute
    runs its units' forward inside the backward, where FSDP2 does not reshard them: the
    six units stay gathered until each one's backward (counting two put the prediction
    4.1 MB, 12.6%, under the measured peak of this model); units kept gathered after forward are
    held until their backward; the root resharded after forward is gathered again. Each
    rank's peak is within the prediction and the prediction, less the one
    copy the backend may free before the peak, within 12% of it."""
    from solvers.solution import Solution
    from tests.test_distributed import _spawn

    model, planner = _heavy_planner(choice)
    assert [str(n.target) for n in planner.capture.compute_nodes()][1:7] == list(
        planner.sharding.units
    )
    predicted = planner.predict(segments)
    given = Solution(segments, 0.0, predicted, "feasible", "given", 0.0, None)
    plan = planner.route.plan_of(given, predicted)
    assert plan.predicted_peak_bytes == predicted
    # gloo's worker thread may free its copy of a reduce-scatter's input after the next
    # group's allocations on a loaded machine (NOTE [sharding: the backend's
    # reduce-scatter]): one unit's flat input at most
    late = sum(p.nbytes for p in model.layers[0].parameters())
    for got in _spawn(_heavy_rank, (plan.to_json(),), tmp_path):
        assert got["peak"] <= predicted + late // 2
        # the backend's copy of a unit, which the prediction counts at the peak (NOTE
        # [sharding: what a forward all-gather holds]), is made and freed on gloo's thread:
        # on a loaded machine its life can miss the main thread's peak. Root resharded,
        # torch 2.13, with the suite running: 24,153,152 B, one unit (2,102,272 B) under
        # the 26,255,424 B measured alone, and 13.3% under the prediction
        assert predicted - late <= 1.12 * got["peak"]

"""Real architectures end to end: Hugging Face models (and the torch-only classics) optimize,
train exactly like eager with dropout on, and fit the measured budget at three budgets.

The default run covers the Hugging Face zoo the capture path was built against; the
held-out architectures and the torch-only classics run with ``-m slow`` (and in
``python -m benchmarks.models``). Skipped as a whole when ``transformers`` is missing.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import autockpt  # noqa: E402
from autockpt.api import Planner  # noqa: E402
from autockpt.capture import Inputs, capture  # noqa: E402
from autockpt.errors import GIB, PlanMismatchError  # noqa: E402
from autockpt.rewrite import SegmentSpec, rewrite  # noqa: E402
from autockpt_zoo.hf import HF_HELD_OUT, HF_ZOO  # noqa: E402
from autockpt_zoo.toy import ZOO  # noqa: E402
from tests.conftest import assert_same_step, train_step  # noqa: E402

FRACTIONS = (0.1, 0.5, 0.9)
PREDICTION_TOLERANCE = 0.05
CLASSICS = ("gpt", "resnet", "unet", "mlp_mixer")
WITHOUT_DROPOUT = ("hf_resnet", "resnet", "unet", "mlp_mixer")
FACTORIES = {**HF_ZOO, **HF_HELD_OUT, **{name: ZOO[name] for name in CLASSICS}}


def _planner(name: str):
    model, inputs = FACTORIES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, inputs)
    return model, inputs, planner


def _check_three_budgets(name: str) -> None:
    """At three budgets across the plannable range: same tensors and names as the user's
    model, loss / outputs / every gradient / every buffer / RNG equal to eager's, measured
    peak (allocator truth) within the budget and within 5% of the prediction, and checkpointing
    really used at the lowest."""
    model, inputs, planner = _planner(name)
    low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
    assert low < high, f"{name}: no plan saves memory, so the zoo size is wrong"
    for fraction in FRACTIONS:
        budget = int(low + fraction * (high - low))
        fast = planner.optimize(budget_gb=budget / GIB)
        assert list(fast.state_dict()) == list(model.state_dict())
        assert [id(p) for p in fast.parameters()] == [id(p) for p in model.parameters()]
        expected = train_step(copy.deepcopy(model), inputs)
        got = train_step(fast, inputs)
        assert_same_step(expected, got)
        measured = autockpt.measure(fast, inputs, repeat=1)
        assert measured.peak_bytes <= budget, (name, fraction, measured.peak_bytes, budget)
        # the plan simulator's prediction is the measured peak to within 5%, as on fx
        predicted = fast.plan.predicted_peak_bytes
        assert abs(predicted - measured.peak_bytes) <= PREDICTION_TOLERANCE * measured.peak_bytes, (
            name,
            fraction,
            predicted,
            measured.peak_bytes,
        )
        if fraction == FRACTIONS[0]:
            assert fast.plan.segments, f"{name}: the tightest budget needs checkpointing"
    if name not in WITHOUT_DROPOUT:
        # dropout survived capture in training mode: the profile saw random nodes
        assert any(node.random for node in planner.profile.nodes), name


@pytest.mark.parametrize("name", sorted(HF_ZOO))
def test_hf_model_trains_like_eager_within_budget(name: str) -> None:
    _check_three_budgets(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HF_HELD_OUT) + list(CLASSICS))
def test_held_out_and_classic_models(name: str) -> None:
    _check_three_budgets(name)


def test_hf_models_capture_whole_with_export() -> None:
    """fx cannot trace Hugging Face bodies (they branch on shapes); automatic leaves would
    make the whole body one opaque node, so capture goes to torch.export, which keeps every
    operation plannable and names parameters by their place in the user's tree."""
    model, inputs = HF_ZOO["hf_llama"]()
    captured = capture(model, Inputs.of(inputs))
    assert captured.method == "export"
    assert captured.leaf_modules == ()
    assert any("opaque leaves" in note for note in captured.warnings)
    targets = {str(n.target) for n in captured.graph.nodes if n.op == "get_attr"}
    assert "model.layers.0.self_attn.q_proj.weight" in targets
    assert len(captured.compute_nodes()) > 100


def test_keyword_inputs_model_output_and_default_loss() -> None:
    """Keyword inputs go in by name, a ModelOutput comes back, and its ``loss`` is what is
    differentiated when no loss_fn is given."""
    model, inputs = HF_ZOO["hf_bert"]()
    assert set(inputs) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    eager = copy.deepcopy(model)
    planner = Planner(model, inputs)
    fast = planner.optimize(budget_gb=1.2 * planner.minimum_peak_bytes / GIB)
    assert fast.plan.segments
    torch.manual_seed(0)
    out = fast(**inputs)
    torch.manual_seed(0)
    ref = eager(**inputs)
    assert type(out) is type(ref)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.logits, ref.logits)
    # evaluation mode (no dropout) runs the user's forward on the same tensors
    fast.eval(), eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(**inputs).logits, eager(**inputs).logits)


def test_export_plan_saves_and_applies(tmp_path) -> None:
    """A plan made through torch.export re-applies to a fresh copy of the model (same
    fingerprint, same segments), with or without example inputs, and trains like eager."""
    model, inputs = HF_ZOO["hf_gpt2"]()
    planner = Planner(model, inputs)
    budget = planner.minimum_peak_bytes + 0.2 * (
        planner.no_checkpoint_peak_bytes - planner.minimum_peak_bytes
    )
    fast = planner.optimize(budget_gb=budget / GIB)
    path = tmp_path / "plan.json"
    fast.plan.save(path)
    fresh, _ = HF_ZOO["hf_gpt2"]()
    again = autockpt.apply(fresh, autockpt.Plan.load(path), inputs)
    assert again.plan.segments == fast.plan.segments
    assert_same_step(train_step(copy.deepcopy(fresh), inputs), train_step(again, inputs))
    # without inputs the plan re-captures from the inputs it recorded (shapes and dtypes)
    bare = autockpt.apply(copy.deepcopy(fresh), autockpt.Plan.load(path))
    assert bare.plan.segments == fast.plan.segments
    assert_same_step(train_step(copy.deepcopy(fresh), inputs), train_step(bare, inputs))


def test_model_with_cache_on_captures_and_trains_like_eager() -> None:
    """Models as users have them return a key/value cache object (use_cache on by default);
    export cannot carry it, so capture leaves it out of the output, says so, and the
    optimized model still trains like eager with checkpointing inside the body."""
    model, inputs = HF_ZOO["hf_llama"]()
    model.config.use_cache = True
    assert model(**inputs).past_key_values is not None
    planner = Planner(model, inputs)
    assert planner.capture.method == "export"
    assert any("DynamicCache" in note for note in planner.capture.warnings)
    assert "forward" not in vars(model)  # the temporary override is gone
    fast = planner.optimize(budget_gb=planner.minimum_peak_bytes / GIB)
    assert fast.plan.segments
    assert fast(**inputs).past_key_values is None
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(fast, inputs))


def test_export_plan_refuses_inputs_its_graph_cannot_take_with_a_clear_error() -> None:
    """An export graph takes other batch and sequence sizes where torch.export kept them
    dynamic, but is specialised to the example's dtypes: int32 token ids must be refused up
    front with a typed error, also on a deep copy, while evaluation mode (the user's own
    forward) takes them. (Sizes: tests/test_trace_shapes.py.)"""
    model, inputs = HF_ZOO["hf_gpt2"]()
    captured = capture(model, Inputs.of(inputs))
    assert "input_ids[0]" in captured.dynamic_dims
    fast = rewrite(model, captured, [SegmentSpec(10, 60, preserve_rng=True)])
    smaller = {name: value[:2] for name, value in inputs.items()}
    smaller["input_ids"] = smaller["input_ids"].to(torch.int32)
    with pytest.raises(PlanMismatchError, match="drop_last"):
        fast(**smaller)
    with pytest.raises(PlanMismatchError, match="drop_last"):
        copy.deepcopy(fast)(**smaller)
    fast(**inputs).loss.backward()  # the planned shape still runs
    fast(**{name: value[:2] for name, value in inputs.items()}).loss.backward()  # and a smaller
    fast.eval()
    with torch.no_grad():
        assert fast(**smaller).logits.shape[0] == 2


def test_model_checkpointed_by_hand_is_reported_on_the_export_path() -> None:
    """Hugging Face's own gradient checkpointing is inlined by capture (the plan replaces
    it), as on the fx path, and the user is told; training still matches eager."""
    model, inputs = HF_ZOO["hf_llama"]()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.warns(UserWarning, match="already calls torch.utils.checkpoint"):
        captured = capture(model, Inputs.of(inputs))
    assert captured.method == "export"
    assert any("already calls torch.utils.checkpoint" in note for note in captured.warnings)
    fast = rewrite(model, captured, [SegmentSpec(20, 120, preserve_rng=True)])
    assert_same_step(train_step(copy.deepcopy(model), inputs), train_step(fast, inputs))

"""Hugging Face's causal mask under export (``autockpt/capture/causal_masks.py``): the
captured graph attends as the eager call does (no materialised mask, grouped key/value heads
inside SDPA), computes the model's values for any later call the input check lets through,
and transformers is left as found."""

from __future__ import annotations

import sys

import pytest
import torch

import autockpt
from autockpt.capture import Inputs, capture
from autockpt.capture.causal_masks import eager_causal_masks

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped: eager passes enable_gqa=True, no repeat_kv
        intermediate_size=128,
        vocab_size=256,
        use_cache=False,
        attn_implementation="sdpa",
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def _sdpa_calls(model: torch.nn.Module, kwargs: dict[str, torch.Tensor]) -> list[torch.fx.Node]:
    captured = capture(model, Inputs((), kwargs))
    assert captured.method == "export"
    return [
        n
        for n in captured.graph.nodes
        if n.op == "call_function" and "scaled_dot_product" in str(n.target)
    ]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_graph_attends_as_eager_does_and_costs_what_eager_costs():
    model = _llama()
    ids = torch.randint(0, 256, (2, 64))
    example = {"input_ids": ids, "labels": ids}
    calls = _sdpa_calls(model, example)
    assert len(calls) == 2
    for call in calls:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        named = dict(zip(names, call.args, strict=False), **call.kwargs)
        assert named.get("attn_mask") is None  # no batch x seq x seq mask
        assert named.get("is_causal") is True
        assert named.get("enable_gqa") is True  # key/value heads not repeated
    # the graph is the model: its step's peak without checkpointing is eager's, measured
    planned = autockpt.optimize(model, example, budget_gb=1.0)
    plan = planned.plan
    assert plan.as_written_peak_bytes == plan.no_checkpoint_peak_bytes
    # and computes eager's values, at the example's sizes and at others
    for batch, seq in ((2, 64), (2, 40), (2, 17)):  # any length up to the planned one
        x = torch.randint(0, 256, (batch, seq))
        y = torch.where(torch.rand(batch, seq) < 0.2, -100, x)
        model.zero_grad()
        eager = model(input_ids=x, labels=y).loss
        eager.backward()
        expected = _grads(model)
        model.zero_grad()
        got = planned(input_ids=x, labels=y).loss
        got.backward()
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
        for name, grad in _grads(planned).items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6)


def test_a_padding_mask_passed_in_is_still_applied():
    """A padding mask is an input: transformers does not read a traced one's values, so the
    graph builds the mask from whatever mask a later call passes."""
    model = _llama()
    ids = torch.randint(0, 256, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    planned = autockpt.optimize(
        model, {"input_ids": ids, "attention_mask": mask, "labels": ids}, budget_gb=1.0
    )
    padded = mask.clone()
    padded[1, :12] = 0  # the second sequence is left-padded to 32 tokens
    labels = torch.where(padded.bool(), ids, -100)
    eager = model(input_ids=ids, attention_mask=padded, labels=labels).loss
    got = planned(input_ids=ids, attention_mask=padded, labels=labels).loss
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    unmasked = model(input_ids=ids, labels=labels).loss
    assert not torch.allclose(got, unmasked)  # the mask changed the values: it was applied


def test_transformers_is_left_as_found():
    masking = sys.modules["transformers.masking_utils"]
    found = masking.is_torchdynamo_exporting
    with eager_causal_masks():
        assert masking.is_torchdynamo_exporting() is False
    assert masking.is_torchdynamo_exporting is found
    with pytest.raises(RuntimeError), eager_causal_masks():
        raise RuntimeError("a capture that fails")
    assert masking.is_torchdynamo_exporting is found


def test_without_transformers_imported_nothing_is_touched(monkeypatch):
    monkeypatch.delitem(sys.modules, "transformers.masking_utils")
    with eager_causal_masks():
        assert "transformers.masking_utils" not in sys.modules


def test_positions_passed_in_keep_transformers_packing_test():
    """Position ids given as an input may mark packed sequences (two per row here): their
    values are the call's, so the graph keeps transformers' mask, and computes eager's
    values for packed and unpacked positions alike."""
    model = _llama()
    ids = torch.randint(0, 256, (2, 32))
    packed = torch.arange(16).repeat(2).expand(2, 32)
    planned = autockpt.optimize(
        model, {"input_ids": ids, "position_ids": packed, "labels": ids}, budget_gb=1.0
    )
    for positions in (packed, torch.arange(32).expand(2, 32)):
        eager = model(input_ids=ids, position_ids=positions, labels=ids).loss
        got = planned(input_ids=ids, position_ids=positions, labels=ids).loss
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    unpacked = model(input_ids=ids, position_ids=torch.arange(32).expand(2, 32), labels=ids)
    packed_loss = model(input_ids=ids, position_ids=packed, labels=ids).loss
    assert not torch.allclose(unpacked.loss, packed_loss)  # packing changes the values

"""Sanity checks for the built-in model zoo (:mod:`autockpt_zoo.toy`).

Every factory must build a deterministic, trainable model whose example inputs run forward and
backward, and the two capture-hostile models must fail ``torch.fx`` in exactly the way they are
designed to (and stay capturable by the intended fallback).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autockpt_zoo.toy import (
    DEFAULT_MODEL,
    HEAVY_ZOO,
    ZOO,
    ShapeDependentRouter,
    call_example,
    seed_block_stack,
)

NAMES = sorted(ZOO)


def _tensors(obj: Any) -> Iterator[Tensor]:
    """Yield every tensor in a (possibly nested) model output or example-input structure."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _tensors(value)
    elif is_dataclass(obj):
        for field in fields(obj):
            yield from _tensors(getattr(obj, field.name))


def _to_scalar(out: Any) -> Tensor:
    """``.loss`` or a ``(logits, loss)`` tuple's loss where present, else sum of float outputs."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Tensor):
        return out[1]
    floats = [t.sum() for t in _tensors(out) if t.is_floating_point()]
    assert floats, f"no floating-point output in {type(out).__name__}"
    return torch.stack(floats).sum()


def _saved_activation_bytes(model: nn.Module, inputs: Any) -> tuple[int, Any]:
    """Bytes of distinct non-parameter storages autograd saves during one forward."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call_example(model, inputs)
    return sum(saved.values()), out


def test_registry() -> None:
    assert DEFAULT_MODEL in ZOO
    assert len(ZOO) == 10
    assert not set(ZOO) & set(HEAVY_ZOO)


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_gives_finite_grads(name: str) -> None:
    model, inputs = ZOO[name]()
    assert model.training
    out = call_example(model, inputs)
    loss = _to_scalar(out)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert params
    for pname, p in params:
        assert p.grad is not None, f"{name}: {pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}: {pname} has a non-finite gradient"
    for t in _tensors(inputs):
        if t.requires_grad:
            assert t.grad is not None and torch.isfinite(t.grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_factory_is_deterministic(name: str) -> None:
    (m1, in1), (m2, in2) = ZOO[name](), ZOO[name]()
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    for key in s1:
        assert torch.equal(s1[key], s2[key]), f"{name}: {key} differs between calls"
    t1, t2 = list(_tensors(in1)), list(_tensors(in2))
    assert type(in1) is type(in2) and len(t1) == len(t2) > 0
    for a, b in zip(t1, t2, strict=True):
        assert torch.equal(a, b) and a.requires_grad == b.requires_grad
    if isinstance(in1, dict):
        assert list(in1) == list(in2)


@pytest.mark.parametrize("name", NAMES)
def test_activations_matter(name: str) -> None:
    """Saved activations are in the same range as the parameters, so checkpointing matters."""
    model, inputs = ZOO[name]()
    act_bytes, _ = _saved_activation_bytes(model, inputs)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if name == "gpt_checkpointed":
        gpt_bytes, _ = _saved_activation_bytes(*ZOO["gpt"]())
        assert act_bytes < gpt_bytes / 4  # the manual checkpointing is really in effect
    elif name == "block_stack":
        assert act_bytes >= 0.15 * param_bytes  # tutorial shape; ~0.19 at the defaults
    else:
        assert act_bytes >= param_bytes


def test_overrides_change_size() -> None:
    small, x = ZOO["block_stack"](blocks=2, width=8, batch=3)
    assert len(small.layers) == 2 and x.shape == (3, 8)
    with pytest.raises(TypeError):
        ZOO["block_stack"](no_such_option=1)


def test_gpt_checkpointed_matches_gpt() -> None:
    (plain, inputs), (ckpt, inputs_ckpt) = ZOO["gpt"](), ZOO["gpt_checkpointed"]()
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(a, b)
    assert plain.lm_head.weight is plain.wte.weight  # tied
    plain.eval(), ckpt.eval()
    torch.testing.assert_close(plain(*inputs)[1], ckpt(*inputs_ckpt)[1])


def test_seed_block_stack_on_meta() -> None:
    model, x = seed_block_stack(device="meta")
    assert len(model.layers) == 100 and x.shape == (8, 2048) and x.is_meta
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 100 * (2 * 2048 * 4096 + 4096 + 2048)


def test_fx_traces_block_stack() -> None:
    model, x = ZOO["block_stack"]()
    gm = torch.fx.symbolic_trace(model)
    torch.testing.assert_close(gm(x), model(x))


def test_fx_fails_on_untraceable_submodule_unless_leaf() -> None:
    model, x = ZOO["untraceable_submodule"]()
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)

    class LeafTracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, ShapeDependentRouter) or super().is_leaf_module(m, qualname)

    gm = torch.fx.GraphModule(model, LeafTracer().trace(model))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert "router" in targets and len(targets) > 1
    torch.testing.assert_close(gm(x), model(x))


def test_root_shape_branch_fails_fx_but_exports() -> None:
    model, x = ZOO["root_shape_branch"]()
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(model, (x,), strict=False)
    torch.testing.assert_close(exported.module()(x), model(x))

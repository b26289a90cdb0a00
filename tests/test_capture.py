"""Graph capture: fx, fx with automatic leaves, torch.export, and the error when all fail."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import pytest
import torch
from torch import nn

import autockpt
from autockpt.capture import Capture, Inputs, capture, given_input_names
from autockpt.capture.captured import node_module
from autockpt.costs.interpret import run_graph

WIDTH = 8


def _mlp(hidden: nn.Module | None = None, depth: int = 2) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH)]
    for _ in range(depth - 1):
        layers += [hidden if hidden is not None else nn.ReLU(), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers)


def _x(batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, WIDTH)


def _capture(model: nn.Module, example: object, **kwargs) -> Capture:
    return capture(model, Inputs.of(example), **kwargs)


class ValueRouter(nn.Module):
    """Branches on a tensor value: fx cannot trace it, but as a leaf it is fine."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.proj(x)
        return -self.proj(x)


class RoutedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.router = ValueRouter()
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.router(self.inp(x))))


class RootShapeBranch(nn.Module):
    """Branches on the input's *shape* in the root: fx fails, export specialises."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = self.proj(x)
        return torch.tanh(x)


class RootValueBranch(nn.Module):
    """Branches on a tensor *value* in the root: neither fx nor export can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if x.sum() > 0:
            h = h * 2
        return h


class KwargsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        scale: float = 2.0,
    ) -> torch.Tensor:
        h = self.proj(x) * scale
        if y is not None:
            h = h + y
        if mask is not None:
            h = h * mask
        return h


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> Output:
        h = self.proj(x)
        return Output(logits=torch.relu(h), hidden=h)


# --------------------------------------------------------------------------------------------
# fx


def test_plain_model_traces_with_fx():
    model, x = _mlp(depth=3), _x()
    cap = _capture(model, x)
    assert cap.method == "fx"
    assert cap.leaf_modules == ()
    # every nn.Module of the Sequential stays one call_module node, in execution order
    names = [str(node.target) for node in cap.compute_nodes()]
    assert names == [name for name, _ in model.named_children()]
    assert all(node.op == "call_module" for node in cap.compute_nodes())
    torch.testing.assert_close(run_graph(cap, model, Inputs.of(x)), model(x))


def test_fingerprint_is_stable_and_structural():
    x = _x()
    first = _capture(_mlp(), x).fingerprint()
    # same architecture, other weights, other batch size: same fingerprint
    other = _mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    assert _capture(other, _x(batch=5)).fingerprint() == first
    assert _capture(_mlp(), x).fingerprint() == first
    # a changed architecture changes it
    assert _capture(_mlp(depth=3), x).fingerprint() != first
    deeper = nn.Sequential(*_mlp(), nn.ReLU())
    assert _capture(deeper, x).fingerprint() != first


def test_fingerprint_sees_module_types():
    """Swapping a submodule's class (Identity -> Dropout, ReLU -> BatchNorm) is another
    architecture: a plan made without RNG preservation or buffer restoring must not be
    applied to it."""
    x = _x()
    prints = {
        type(hidden).__name__: _capture(_mlp(hidden), x).fingerprint()
        for hidden in (nn.Identity(), nn.Dropout(0.5), nn.ReLU(), nn.BatchNorm1d(WIDTH))
    }
    assert len(set(prints.values())) == len(prints), prints


# --------------------------------------------------------------------------------------------
# fallbacks


def test_untraceable_submodule_becomes_a_leaf():
    torch.manual_seed(0)
    model, x = RoutedModel(), _x()
    cap = _capture(model, x)
    assert cap.method == "fx+leaves"
    assert cap.leaf_modules == ("router",)
    router_nodes = [
        n for n in cap.compute_nodes() if n.op == "call_module" and n.target == "router"
    ]
    assert len(router_nodes) == 1
    # nothing inside the router was traced through
    assert not any(str(n.target).startswith("router.") for n in cap.graph.nodes)
    assert any("router" in note for note in cap.warnings)
    torch.testing.assert_close(run_graph(cap, model, Inputs.of(x)), model(x))


def _source_line(fn: object, text: str) -> str:
    """``file:line`` of the line of ``fn``'s source that holds ``text``."""
    lines, first = inspect.getsourcelines(fn)
    offset = next(k for k, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{first + offset}"


class RoutedStack(nn.Module):
    """Two routed models: the same untraceable line in two submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([RoutedModel(), RoutedModel()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_untraceable_leaves_say_why_once_per_reason():
    """A leaf made opaque says why: the line fx could not trace and its error, one note for
    every module that failed the same way (each layer of a stack)."""
    cap = _capture(RoutedStack(), _x())
    assert cap.leaf_modules == ("layers.0.router", "layers.1.router")
    where = _source_line(ValueRouter.forward, "if x.sum() > 0:")
    notes = [note for note in cap.warnings if "kept whole" in note]
    assert notes == [
        "layers.0.router, layers.1.router kept whole (opaque leaves): fx cannot trace the code "
        f"at {where}: `if x.sum() > 0:` (TraceError: symbolically traced variables cannot be "
        "used as inputs to control flow); each runs as one call the plan cannot checkpoint inside"
    ]


def test_user_leaf_modules_stay_calls():
    model, x = RoutedModel(), _x()
    cap = _capture(model, x, leaf_modules=["router"])
    assert cap.method == "fx"  # nothing had to be discovered
    assert cap.leaf_modules == ("router",)
    assert [str(n.target) for n in cap.compute_nodes() if n.op == "call_module"] == [
        "inp",
        "router",
        "out",
    ]


def test_missing_leaf_module_name_is_rejected():
    with pytest.raises(ValueError, match="no_such_module"):
        _capture(RoutedModel(), _x(), leaf_modules=["router", "no_such_module"])


def test_root_shape_branch_falls_back_to_export():
    torch.manual_seed(0)
    model, x = RootShapeBranch(), _x()
    cap = _capture(model, x)
    assert cap.method == "export"
    assert cap.leaf_modules == ()
    assert any("torch.export" in note for note in cap.warnings)
    # the training IR keeps the original parameter names as attribute targets
    targets = {str(n.target) for n in cap.graph.nodes if n.op == "get_attr"}
    assert targets == {"proj.weight", "proj.bias"}
    torch.testing.assert_close(run_graph(cap, model, Inputs.of(x)), model(x))


def test_root_value_branch_raises_trace_error_naming_the_line():
    with pytest.raises(autockpt.TraceError) as info:
        _capture(RootValueBranch(), _x())
    error = info.value
    lines, first = inspect.getsourcelines(RootValueBranch.forward)
    offset = next(k for k, line in enumerate(lines) if "if x.sum() > 0:" in line)
    location = f"{RootValueBranch.forward.__code__.co_filename}:{first + offset}"
    assert error.module == ""
    assert error.location == location
    assert error.source_line == "if x.sum() > 0:"
    message = str(error)
    assert location in message
    assert "if x.sum() > 0:" in message
    assert "root module" in message
    assert isinstance(error, autockpt.AutockptError)


def test_forced_fx_method_does_not_fall_back():
    with pytest.raises(autockpt.TraceError):
        _capture(RootShapeBranch(), _x(), method="fx")
    with pytest.raises(ValueError, match="method"):
        _capture(_mlp(), _x(), method="jit")


class NoGradBufferUpdate(nn.Module):
    """Updates a running buffer under ``torch.no_grad()`` inside forward (EMA codebooks,
    momentum queues)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("center", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        with torch.no_grad():
            self.center.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return h - self.center


def test_grad_mode_blocks_inside_forward_are_kept():
    # fx would record nothing for the root's `with torch.no_grad():`; export keeps it
    torch.manual_seed(0)
    model, x = NoGradBufferUpdate(), _x()
    cap = _capture(model, x)
    assert cap.method == "export"
    for _ in range(2):
        run_graph(cap, model, Inputs.of(x)).sum().backward()
    assert not model.center.requires_grad
    assert model.center.grad_fn is None


# --------------------------------------------------------------------------------------------
# inputs and outputs


def test_kwargs_inputs_with_defaults_are_specialised():
    torch.manual_seed(0)
    model, x, y = KwargsModel(), _x(), _x()
    cap = _capture(model, {"x": x, "y": y})
    assert cap.method == "fx"
    placeholders = [str(n.target) for n in cap.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["x", "y", "mask", "scale"]  # real names, not mask_1
    expected = model(x, y)
    torch.testing.assert_close(cap.graph_module(x=x, y=y), expected)
    torch.testing.assert_close(cap.graph_module(y=y, x=x), expected)
    torch.testing.assert_close(run_graph(cap, model, Inputs.of({"y": y, "x": x})), expected)
    # mask was specialised to its default: passing a tensor now is refused, not ignored
    with pytest.raises(AssertionError, match="mask"):
        cap.graph_module(x=x, y=y, mask=torch.ones_like(x))


def test_kwargs_input_errors():
    model, x = KwargsModel(), _x()
    with pytest.raises(TypeError, match="nope"):
        _capture(model, {"x": x, "nope": x})
    with pytest.raises(TypeError, match="'x'"):
        _capture(model, {"y": x})


def test_dataclass_output_traces():
    torch.manual_seed(0)
    model, x = DataclassModel(), _x()
    cap = _capture(model, x)
    assert cap.method == "fx"
    out = cap.graph_module(x)
    expected = model(x)
    assert type(out) is Output
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.hidden, expected.hidden)


def test_inputs_of_accepts_tensor_tuple_list_dict():
    x, y = _x(), _x()
    assert Inputs.of(x) == Inputs((x,), {})
    assert Inputs.of((x, y)).args == (x, y)
    assert Inputs.of([x, y]).args == (x, y)
    given = Inputs.of({"x": x, "y": y})
    assert given.args == () and given.kwargs == {"x": x, "y": y}
    assert Inputs.of(given) is given
    assert [id(t) for t in Inputs((x, 3), {"y": y}).tensors()] == [id(x), id(y)]


@pytest.mark.parametrize("bad", [None, 3, 2.5, "x", {1, 2}])
def test_inputs_of_rejects_other_types(bad):
    with pytest.raises(TypeError, match="example_inputs"):
        Inputs.of(bad)


def test_input_signature_describes_shapes_and_dtypes():
    a = Inputs.of((torch.zeros(2, 3), 4))
    assert a.signature() == Inputs.of((torch.ones(2, 3), 4)).signature()
    assert a.signature() != Inputs.of((torch.zeros(2, 4), 4)).signature()
    assert a.signature() != Inputs.of((torch.zeros(2, 3, dtype=torch.float64), 4)).signature()
    assert a.signature() != Inputs.of((torch.zeros(2, 3), 5)).signature()


def test_given_input_names_follow_the_signature_order():
    model, x = KwargsModel(), _x()
    assert given_input_names(model, Inputs.of(x)) == ("x",)
    assert given_input_names(model, Inputs.of((x, x))) == ("x", "y")
    assert given_input_names(model, Inputs.of({"mask": x, "x": x})) == ("x", "mask")
    assert given_input_names(model, Inputs((x,), {"mask": x})) == ("x", "mask")
    assert given_input_names(model, Inputs((), {})) == ()


# --------------------------------------------------------------------------------------------
# models as libraries write them: decorated forwards, shape branches in the body, constants


def _returns_dict(forward):
    """A decorator like Hugging Face's ``can_return_tuple``: the class's ``forward`` becomes
    a ``(self, *args, **kwargs)`` wrapper around the real one."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return {"out": forward(self, *args, **kwargs)}

    return wrapper


class DecoratedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    @_returns_dict
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        if mask is not None:
            h = h * mask
        return h * kwargs.get("scale", 1.0)


def test_decorated_forward_traces_with_fx_as_called():
    torch.manual_seed(0)
    model, x = DecoratedForward(), _x()
    mask = (torch.rand(3, WIDTH) > 0.5).float()
    cap = _capture(model, {"x": x, "mask": mask})
    assert cap.method == "fx"
    assert [str(n.target) for n in cap.graph.nodes if n.op == "placeholder"] == ["x", "mask"]
    got = run_graph(cap, model, Inputs.of({"mask": mask, "x": x}))
    torch.testing.assert_close(got["out"], model(x, mask=mask)["out"])
    positional = _capture(model, (x,))
    torch.testing.assert_close(run_graph(positional, model, Inputs.of(x))["out"], model(x)["out"])
    # re-capturing from the saved input names gives the same graph (autockpt.apply)
    again = capture(model, Inputs((), {}), method="fx", input_names=("x", "mask"))
    assert again.fingerprint() == cap.fingerprint()


class ShapeBranchBody(nn.Module):
    """Branches on ``ndim`` like a transformer body checking its mask: fx fails here."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 3:
            x = x.unsqueeze(1)
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return x.squeeze(1)


class ValueBranchBody(ShapeBranchBody):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = -x
        return super().forward(x)


class Wrapped(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_mostly_opaque_fx_capture_gives_way_to_export():
    """A leaf holding most of the model leaves nothing to plan: export captures it whole,
    in training mode (dropout stays in the graph), under the user's parameter names."""
    torch.manual_seed(0)
    model, x = Wrapped(ShapeBranchBody()).train(), _x()
    cap = _capture(model, x)
    assert cap.method == "export"
    assert cap.leaf_modules == ()
    assert any("opaque leaves" in note for note in cap.warnings)
    targets = {str(n.target) for n in cap.graph.nodes if n.op == "get_attr"}
    assert "body.layers.3.weight" in targets and "head.bias" in targets
    assert any("dropout" in str(n.target) for n in cap.compute_nodes())
    torch.manual_seed(7)
    got = run_graph(cap, model, Inputs.of(x))
    torch.manual_seed(7)
    torch.testing.assert_close(got, model(x))


def test_mostly_opaque_capture_is_kept_when_export_fails_too():
    torch.manual_seed(0)
    model, x = Wrapped(ValueBranchBody()), _x()
    cap = _capture(model, x)
    assert cap.method == "fx+leaves"
    assert cap.leaf_modules == ("body",)
    assert any("cannot checkpoint inside" in note for note in cap.warnings)


class BuildsConstant(nn.Module):
    """Makes a tensor in forward (export lifts it into a graph constant) and branches on a
    shape in the root (so fx gives way to export)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * torch.tensor([0.5])
        return torch.relu(self.proj(x))


def test_export_constants_are_profiled_and_rewritten():
    torch.manual_seed(0)
    model, x = BuildsConstant(), _x()
    cap = _capture(model, x)
    assert cap.method == "export"
    assert any(str(n.target).startswith("lifted_tensor") for n in cap.graph.nodes)
    torch.testing.assert_close(run_graph(cap, model, Inputs.of(x)), model(x))
    fast = autockpt.optimize(model, x, budget_gb=1.0)
    torch.testing.assert_close(fast(x), model(x))


# --------------------------------------------------------------------------------------------
# module paths of nodes


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class TwiceCalled(nn.Module):
    """Blocks, the first called again at the end (export names the second call
    ``blocks.0@1``), and the root's own code around them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TinyBlock(), TinyBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.tanh(self.blocks[0](x))


def test_nodes_carry_module_paths_alike_under_fx_and_export():
    torch.manual_seed(0)
    model, x = TwiceCalled().train(), torch.randn(2, 4, WIDTH)
    by_fx = _capture(model, x, method="fx")
    by_export = _capture(model, x, method="export")
    assert (by_fx.method, by_export.method) == ("fx", "export")
    paths = {
        cap.method: [node_module(n) for n in cap.compute_nodes()] for cap in (by_fx, by_export)
    }
    modules = {name for name, _ in model.named_modules()}
    assert set(paths["fx"]) == set(paths["export"]) <= modules
    for found in paths.values():
        assert found[-1] == ""  # the root's tanh
        assert "blocks.0.attn" in found and "blocks.1.mlp.2" in found  # a Dropout's node
        assert found[-2] == "blocks.0"  # its second call's residual add, not "blocks.0@1"
    softmax = [n for n in by_export.compute_nodes() if "softmax" in str(n.target)]
    assert [node_module(n) for n in softmax] == ["blocks.0.attn", "blocks.1.attn", "blocks.0.attn"]


def _tiny_llama_config() -> Any:
    """A 2-layer Hugging Face Llama's config with SDPA attention (export-captured)."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        use_cache=False,
        attn_implementation="sdpa",
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


@pytest.mark.parametrize("precision", [None, "bf16-mixed"])
@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_plan_made_on_the_meta_device_applies_to_the_real_model(method, precision):
    """Plans move between devices: the device is not part of a plan's identity (an export
    graph writes it into its operators' arguments), shapes and dtypes are. Planned on meta,
    applied to the same model on the CPU, it trains like the model. Planned for a GPU's
    bfloat16 autocast, an export graph holds autocast's casts: the plan applies to the
    float32 model all the same (captured in the plan's autocast); its steps are the GPU's
    (``python -m benchmarks.on_target`` runs them there)."""
    if method == "fx":
        from autockpt_zoo.toy import gpt

        real, (idx, targets) = gpt(dropout=0.0)
        with torch.device("meta"):
            meta, _ = gpt(dropout=0.0)
        example, meta_example = (idx, targets), (idx.to("meta"), targets.to("meta"))
    else:
        transformers = pytest.importorskip("transformers")
        # scaled-dot-product attention: a meta model is traced as the device it runs on, so
        # its export graph is the CPU's (NOTE [capture: meta traced as a device])
        config = _tiny_llama_config()
        torch.manual_seed(0)
        real = transformers.LlamaForCausalLM(config)
        with torch.device("meta"):
            meta = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, 256, (2, 32))
        example = {"input_ids": ids, "labels": ids}
        on_meta = ids.to("meta")
        meta_example = {"input_ids": on_meta, "labels": on_meta}
    planned = autockpt.optimize(
        meta.train(),
        meta_example,
        budget_gb=1.0,
        loss_fn=lambda out: out[-1] if isinstance(out, tuple) else out.loss,
        precision=precision,
    )
    assert planned.plan.capture_method == method and planned.plan.device == "meta"
    fast = autockpt.apply(real.train(), planned.plan, example)
    assert fast.plan.graph_fingerprint == planned.plan.graph_fingerprint
    if precision is not None:
        assert "cuda:bfloat16" in " ".join(fast.plan.notes)
        return

    def step(module: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        out = module(*example) if isinstance(example, tuple) else module(**example)
        loss = out[-1] if isinstance(out, tuple) else getattr(out, "loss", out)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in module.parameters()]

    torch.manual_seed(0)
    loss, grads = step(fast)
    torch.manual_seed(0)
    eager_loss, eager_grads = step(real)
    torch.testing.assert_close(loss, eager_loss)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_a_tensor_passed_twice_is_captured_as_two_inputs():
    """NOTE [capture: one tensor passed twice]: planned with ``input_ids=ids, labels=ids``
    (what the examples do), the exported graph embedded ``labels``; a later call with labels
    of their own, masked with -100, raised an index error. Each input is its own tensor in
    the graph: that call trains like the model, and the plan is the one made with separate
    tensors."""
    transformers = pytest.importorskip("transformers")
    config = _tiny_llama_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 256, (2, 32))
    shared = autockpt.optimize(
        model, {"input_ids": ids, "labels": ids}, budget_gb=1.0, loss_fn=lambda o: o.loss
    )
    assert shared.plan.capture_method == "export"
    separate = autockpt.apply(model, shared.plan, {"input_ids": ids, "labels": ids.clone()})
    assert separate.plan.graph_fingerprint == shared.plan.graph_fingerprint
    other = torch.randint(0, 256, (2, 32))
    labels = other.clone()
    labels[:, :5] = -100

    def step(module: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        loss = module(input_ids=other, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in module.parameters()]

    loss, grads = step(shared)
    eager_loss, eager_grads = step(model)
    torch.testing.assert_close(loss, eager_loss)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want)

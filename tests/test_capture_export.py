"""torch.export capture (``autockpt/capture/export.py``): export's grad-mode passes inline
each region without recompiling the whole graph after each (NOTE [export: one recompile per
split]), and the fidelity watch covers the model's call, its root hooks included."""

from __future__ import annotations

import contextlib
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autockpt.capture import Inputs, capture
from autockpt.errors import TraceError


class ShapeBranchNet(nn.Module):
    """Branches on the input's shape in the root, which fx cannot trace: captured by
    torch.export. ``scale`` is a plain attribute its forward reads (export bakes it in)."""

    def __init__(self, width: int = 48, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.drop = nn.Dropout(0.1)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * self.scale
        for layer in self.layers:
            x = torch.tanh(layer(self.drop(x)))
        return x


class NormLinear(nn.Module):
    """EDM2's forced weight normalisation (lucidrains' karras_unet.py): in training, the
    weight is normalised in place under ``no_grad``, a grad-mode region export splits at."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.weight.copy_(F.normalize(self.weight, dim=1))
        return F.linear(x, F.normalize(self.weight, dim=1))


class NormalisedStack(nn.Module):
    """Layers with a ``no_grad`` region each behind a root that branches on a shape (so
    capture takes torch.export)."""

    def __init__(self, depth: int = 6, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(NormLinear(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * 0.5
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_export_inlines_grad_mode_regions_without_recompiling_after_each(monkeypatch):
    """NOTE [export: one recompile per split]: the same graph and code, with fewer
    recompiles of the whole graph module; export's pass gets its function back."""
    from torch._export.passes import replace_set_grad_with_hop_pass as grad_pass

    from autockpt.capture import export as export_path

    inline = grad_pass.node_inline_
    recompiles = []
    recompile = torch.fx.GraphModule.recompile

    def counted(self):
        recompiles.append(len(self.graph.nodes))
        return recompile(self)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    model, x = NormalisedStack(), torch.randn(8, 16)
    fast = capture(model, Inputs((x,), {}), method="export")
    assert grad_pass.node_inline_ is inline
    fast_count, recompiles[:] = len(recompiles), []
    monkeypatch.setattr(export_path, "_inlined_unrecompiled", contextlib.nullcontext)
    slow = capture(model, Inputs((x,), {}), method="export")
    assert fast.method == slow.method == "export"
    assert fast.fingerprint() == slow.fingerprint()
    assert fast.graph_module.code == slow.graph_module.code
    # one recompile fewer per region inlined (each of the 6 regions and what lies between
    # them), in export's one run (NOTE [capture: one export])
    assert len(recompiles) - fast_count >= len(model.layers)


class Counted(NormalisedStack):
    """Assigns a buffer in its forward, which the graph must keep (the watch finds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return super().forward(x)


@pytest.mark.parametrize("cls", [NormalisedStack, Counted])
def test_export_runs_once_watched_on_fake_tensors_with_the_same_graph(cls, monkeypatch):
    """NOTE [capture: one export]: the watch runs over the forward on fake tensors, and
    export runs once (with dynamic sizes); the graph, its code and its notes are those of
    the capture that watched a static export first."""
    from autockpt.capture import export as export_path

    runs = []
    export = torch.export.export

    def counted(*args, **kwargs):
        runs.append(kwargs.get("dynamic_shapes"))
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    model, x = cls(), torch.randn(8, 16)
    once = capture(model, Inputs((x,), {}), method="export")
    assert len(runs) == 1 and runs[0] is not None
    monkeypatch.setattr(export_path, "_watched_on_fakes", lambda *args: None)
    twice = capture(model, Inputs((x,), {}), method="export")
    assert len(runs) == 3
    assert once.fingerprint() == twice.fingerprint()
    assert once.graph_module.code == twice.graph_module.code
    assert once.warnings == twice.warnings and once.dynamic_dims == twice.dynamic_dims
    if cls is Counted:  # the buffer's assignment is kept: the graph writes it
        assert "copy_" in once.graph_module.code


def test_a_python_draw_in_a_root_hook_is_still_seen_by_the_watch():
    """The watch covers the model's call, its root hooks included (export.py's
    ``_WatchedCall``): a Python draw there is baked into an export graph, so refused."""
    model = ShapeBranchNet()
    model.register_forward_pre_hook(lambda module, args: (args[0] * random.random(),))
    with pytest.raises(TraceError, match="random"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            capture(model, Inputs((torch.randn(8, 48),), {}))


class KeepsLast(ShapeBranchNet):
    """Keeps its last input in a plain attribute (and so holds a fake after a fake run)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x.detach()
        return super().forward(x)


def test_the_watched_forward_leaves_the_models_attributes_as_found(monkeypatch):
    """The watch's run on fake tensors puts back what the forward set (a fake tensor left in
    an attribute would reach export's trace): the graph is the watched export's."""
    from autockpt.capture import export as export_path

    model, x = KeepsLast(), torch.randn(8, 48)
    once = capture(model, Inputs((x,), {}), method="export")
    assert model.last is None
    monkeypatch.setattr(export_path, "_watched_on_fakes", lambda *args: None)
    twice = capture(model, Inputs((x,), {}), method="export")
    assert once.graph_module.code == twice.graph_module.code

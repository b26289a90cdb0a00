"""Stage 1, the front — graph capture: turn an ``nn.Module`` and example inputs into an fx graph.

Three capture paths are tried in order, each one only when the previous one fails:

1. ``fx``: :class:`torch.fx.Tracer` symbolic tracing of the whole model. Modules from
   ``torch.nn`` and the user's ``leaf_modules`` stay single ``call_module`` nodes
   (``autockpt/capture/fx.py``).
2. ``fx+leaves``: when tracing fails inside a submodule, that submodule (the innermost one
   that raised) becomes a leaf and tracing is retried. A leaf is run as an opaque call, so
   its parameters and buffers stay in place and its memory is still profiled. An ``assert``
   in a submodule's code is no reason for a leaf: it is kept as a guard in the graph
   (``autockpt/capture/guards.py``).
3. ``export``: when the failure is in the root's own code (nothing to make a leaf), the model
   is captured with ``torch.export.export(strict=False)``, whose training IR keeps dropout,
   batch-norm statistics updates and parameter names (``autockpt/capture/export.py``).
   Export is also preferred over an fx capture whose automatic leaves hold most of the
   parameters (a Hugging Face body that branches on shapes would be one opaque node), when
   it succeeds.

The graph must run what the model runs: what tracing sees that a graph would not keep is
the watch's job (``autockpt/capture/watch.py``). Every fallback is said in
:attr:`~autockpt.capture.captured.Capture.warnings`. Tracing consumes no random numbers.

Every path yields a graph whose ``get_attr`` / ``call_module`` targets are qualified names in
the *original* module tree, so the rewritten module can keep using the user's own parameter
and buffer objects (``state_dict()`` keys stay the same, optimizers keep working).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.base.runtime import as_found
from autockpt.capture.captured import Capture
from autockpt.capture.export import _capture_export
from autockpt.capture.fx import _trace_fx_with_leaves
from autockpt.capture.watch import _Unfaithful, _user_frame
from autockpt.errors import TraceError


def capture(
    model: nn.Module,
    inputs: Inputs,
    *,
    leaf_modules: Iterable[str] = (),
    method: str | None = None,
    input_names: Iterable[str] | None = None,
    module_calls: Iterable[str] = (),
    prefer_export: Callable[[nn.Module, Capture], str | None] | None = None,
) -> Capture:
    """Capture ``model``'s forward as an fx graph, falling back as the module docstring says.

    ``prefer_export`` (with ``method`` None) judges an fx capture: a reason it gives is a
    reason to capture with torch.export instead, as for a mostly opaque capture, keeping the
    fx one when export fails (the planner's rule for leaves that hide repeated blocks: NOTE
    [routes: leaves that hide blocks]).

    ``module_calls`` name submodules that must stay module calls on every path (FSDP units):
    fx keeps them as leaves, the export path folds their inlined calls back into one call
    each where that is exact (NOTE [capture: module calls], autockpt/capture/outline.py).

    ``method`` forces one path ("fx" also allows automatic leaves, "export"); ``None`` tries
    them in order. ``input_names`` names the forward parameters that will be passed when
    ``inputs`` is empty (re-applying a saved plan with no example inputs); the others are
    specialised to their defaults, exactly as when the plan was made. Raises
    :class:`TraceError` naming the module and source line when every path fails.

    Tracing runs the forward's Python code, which may assign to the model (fx stores a
    proxy where a forward replaces a buffer) or draw random numbers: the model, the inputs
    and the global generators are left as found (:func:`autockpt.base.runtime.as_found`).
    """
    with as_found(model, inputs):
        return _capture(
            model, inputs, leaf_modules, method, input_names, tuple(module_calls), prefer_export
        )


def _capture(
    model: nn.Module,
    inputs: Inputs,
    leaf_modules: Iterable[str],
    method: str | None,
    input_names: Iterable[str] | None,
    calls: tuple[str, ...],
    prefer_export: Callable[[nn.Module, Capture], str | None] | None = None,
) -> Capture:
    leaves = set(leaf_modules) | set(calls)
    _check_leaf_names(model, leaves)
    notes: list[str] = []
    fx_failure: tuple[str, BaseException] | None = None
    if method in (None, "fx", "fx+leaves"):
        result = _trace_fx_with_leaves(model, inputs, leaves, input_names)
        if isinstance(result, Capture):
            reason = None
            if method is None and _mostly_opaque(model, result, leaves):
                reason = (
                    f"fx would run {', '.join(result.leaf_modules)} as opaque leaves holding "
                    "most of the parameters"
                )
            elif method is None and prefer_export is not None:
                reason = prefer_export(model, result)
            return (
                result if reason is None else _prefer_export(model, inputs, result, calls, reason)
            )
        fx_failure = result
        if method is not None:
            raise _trace_error(*fx_failure)
    if method in (None, "export"):
        try:
            return _capture_export(model, inputs, notes, fx_failure, calls)
        except TraceError:
            raise
        except Exception as export_error:  # noqa: BLE001 - reported with the fx failure
            if fx_failure is None:
                raise _trace_error("", export_error) from export_error
            module, error = fx_failure
            raise _trace_error(module, error, also=export_error) from error
    raise ValueError(f"unknown capture method {method!r}; use 'fx', 'export' or None")


_MAX_OPAQUE_SHARE = 0.5


def _mostly_opaque(model: nn.Module, captured: Capture, user_leaves: set[str]) -> bool:
    """Whether the automatic leaves of an fx capture hold more than half of the model's
    parameters. A leaf is one node to the planner: nothing inside it can be checkpointed
    apart, so a capture that is mostly leaves (a Hugging Face model whose body branches on
    shapes becomes a single leaf) leaves the planner nothing to choose from."""
    auto = [name for name in captured.leaf_modules if name not in user_leaves]
    if not auto:
        return False
    total = sum(p.numel() for p in model.parameters())
    opaque: set[int] = set()
    for name in auto:
        opaque |= {id(p) for p in model.get_submodule(name).parameters()}
    held = sum(p.numel() for p in model.parameters() if id(p) in opaque)
    return total > 0 and held > _MAX_OPAQUE_SHARE * total


def _prefer_export(
    model: nn.Module, inputs: Inputs, fx_capture: Capture, calls: tuple[str, ...], reason: str
) -> Capture:
    """Capture with torch.export instead of an fx graph whose leaves hide too much
    (``reason`` says what); keep the fx capture when export fails too (e.g. value-dependent
    control flow inside the leaves)."""
    leaves = ", ".join(fx_capture.leaf_modules)
    try:
        return _capture_export(model, inputs, [], reason, calls)
    except Exception as error:  # noqa: BLE001 - the fx capture still works
        why = error.reason if isinstance(error, TraceError) else type(error).__name__
        fx_capture.warnings.append(
            f"torch.export could not capture the model either ({why}), so "
            f"{leaves} stay opaque leaves: the plan cannot checkpoint inside them"
        )
        return fx_capture


def _check_leaf_names(model: nn.Module, leaves: set[str]) -> None:
    names = {name for name, _ in model.named_modules()}
    missing = sorted(leaves - names)
    if missing:
        raise ValueError(f"leaf_modules name modules that do not exist: {missing}")


def _trace_error(
    module: str, error: BaseException, also: BaseException | None = None
) -> TraceError:
    if isinstance(error, _Unfaithful):
        location, line = error.location, error.source_line
        reason = f"its own code {error}"
    else:
        location, line = _user_frame(error)
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if also is not None:
        reason += f"; torch.export also failed: {type(also).__name__}: {str(also).splitlines()[0] if str(also) else ''}"
    # fx failed in the root's own code and export was tried too: nothing reaches inside
    return TraceError(module, location, line, reason, in_root_code=not module and also is not None)

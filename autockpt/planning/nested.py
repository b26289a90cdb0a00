"""Per-module plans, for a root whose own forward cannot be captured.

Real models put code that neither fx nor torch.export can capture around their stack of
layers: an input check by value (Wav2Vec2ForCTC: ``if labels.max() >= vocab_size: raise``),
a LayerDrop loop that draws ``torch.rand([]) < p`` and branches on it (the Wav2Vec2/HuBERT
encoder), routing on a tensor's value. The same code inside a submodule that holds the
layers makes that submodule an fx leaf hiding them; where torch.export refuses it too, the
step is planned the same way (NOTE [routes: leaves that hide blocks]): the leaf's code is
descended into like the root's.

NOTE [nested: units]. That code runs eagerly; the submodules it calls are planned as
*units*:

1. find the units (:func:`find_units`): one run of the root's forward that keeps nothing
   for a backward (``autockpt/rewrite/submodule.record_calls``) lists the submodules called
   from the root's own code; each that holds parameters and captures is a unit, each that
   does not capture, or whose outputs the capture would drop (an object the root reads),
   is descended into (its own code runs eagerly too), down to :data:`_MAX_DEPTH` levels, as
   is one given an object that is not plain data (a key-value cache the rest of the run
   fills: planned on its own, it would see another state); one that saves nothing for a
   backward (frozen, on inputs without gradients) is the root's.
   The run draws torch's scalars at their worst case, so every LayerDrop layer is called
   and planned (the worst case, as inside captured graphs); a module the run did not call
   that holds a unit's place in another child of a container above it (an expert not routed
   to, a layer a Python draw skipped) is a unit too, for the worst case that it runs. A
   module called more than once (a block reused, shared weights) is not a unit: it runs
   eagerly and the notes say so (planning it per call would double-count or miss a call);
2. plan each distinct unit once (same class, inputs, parameter and buffer shapes: the
   layers of a stack share one planner) with an ordinary planner, and summarise a few of its
   plans (leave it alone, checkpoint it whole, its leanest plan, least-recompute plans at
   budgets in between) by the replay's numbers: peak, bytes held after its forward, seconds
   (:class:`solvers.units.UnitOption`);
3. choose one option per unit under the one budget of the whole step
   (:func:`solvers.units.least_seconds`: units run in order, each while the earlier ones
   hold what they kept): checkpoint a unit whole, plan inside it, or leave it alone;
4. verify: measure the root's whole step. What the units' replays do not see (the root's
   own activations: a head, a loss, a feature extractor running eagerly) is learnt when
   planning begins from measured steps of three choices (the replays' leanest, each
   repeated block checkpointed whole, every unit checkpointed whole): the leanest measured
   is the stated minimum, achievable by construction and never above checkpointing each
   block by hand, and its measured minus predicted peak corrects every later prediction
   (never downwards when the root draws from Python's or NumPy's generator, which cannot be
   put at its worst case). The measure-and-tighten loop (``autockpt/planning/verify.py``)
   takes care of the rest.

The result is a new instance of the user's class sharing every parameter, buffer and module
with the original, except the units that are checkpointed, which are replaced by their
rewritten modules; the user's model is not changed. docs/design.md ("Planning a model that
cannot be captured whole") gives the reasons and limits.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.capture.export import DROPPED_OUTPUTS
from autockpt.capture.front import capture
from autockpt.errors import AutockptError, TraceError
from autockpt.rewrite.result import plain_module
from autockpt.rewrite.submodule import Call, record_calls, sibling_path

_MAX_DEPTH = 3
"""Levels of uncapturable code descended through (the root, a body, an encoder)."""


@dataclasses.dataclass(frozen=True)
class Unit:
    """A submodule call planned on its own (NOTE [nested: units])."""

    path: str
    inputs: Inputs
    """Its call's ``(args, kwargs)`` in the recorded run (a sibling's, see ``called``)."""
    called: bool = True
    """False: the recorded run never called it (an expert not routed to, a layer skipped by
    a Python draw); it is planned with the inputs of the unit in its place in another child
    of a container above it (``rewrite/submodule.sibling_path``), for the worst case that
    it runs."""


@dataclasses.dataclass(frozen=True)
class Units:
    """What :func:`find_units` found: the units in call order, and notes on what runs
    eagerly instead."""

    units: tuple[Unit, ...]
    notes: tuple[str, ...]
    python_draws: tuple[str, ...] = ()
    """Generators other than torch's the root's run drew from (``random``, ``numpy``):
    their draws cannot be put at their worst case, so measured steps may skip what a later
    step runs (NOTE [nested: units], step 4)."""


def find_units(
    model: nn.Module, inputs: Inputs, leaf_modules: tuple[str, ...], error: TraceError
) -> Units:
    """The units of ``model``'s step (NOTE [nested: units], step 1). When no submodule
    captures, raises ``error`` (the root's capture failure) with the first failure of each
    level tried (:attr:`TraceError.tried`)."""
    levels, notes = {""}, []
    found: dict[str, tuple[int, Inputs]] = {}
    failures: dict[tuple, str | None] = {}
    failed_levels: dict[str, str] = {}
    for _ in range(_MAX_DEPTH):
        current = frozenset(levels)
        recorded = record_calls(model, inputs, lambda path, caller, at=current: caller in at)
        calls = recorded.calls
        levels = set()
        for call in sorted(calls.values(), key=lambda c: c.order):
            if call.caller not in current or call.inputs is None:
                continue
            module = model.get_submodule(call.path)
            if call.path in leaf_modules or not any(True for _ in module.parameters()):
                continue  # no parameters: its activations are the root's own (measured)
            if not _needs_a_backward(module, call.inputs):
                continue  # frozen, on inputs without gradients: it saves nothing to recompute
            if call.count > 1:
                notes.append(
                    f"'{call.path}' is called {call.count} times per step (a reused block or "
                    "shared weights): it is not planned and runs as written; its memory is "
                    "measured with the root's"
                )
                continue
            key = unit_key(module, call.inputs)
            if key not in failures:
                failures[key] = _capture_error(model, call.path, call.inputs, leaf_modules)
            if failures[key] is None:
                found[call.path] = (call.order, call.inputs)
            else:
                levels.add(call.path)
                if call.caller not in failed_levels:  # the first failure of each level
                    failed_levels[call.caller] = failures[key]
        if not levels:
            break
    if levels:
        notes.append(
            "not planned, deeper than the levels searched: "
            + ", ".join(f"'{path}'" for path in sorted(levels))
        )
    if not found:
        raise TraceError(
            error.module,
            error.location,
            error.source_line,
            error.reason,
            error.in_root_code,
            tried=tuple(failed_levels.values()),
        )
    units = _with_siblings(model, found, calls)
    return Units(units, tuple(notes), recorded.python_draws)


def _with_siblings(
    model: nn.Module, found: dict[str, tuple[int, Inputs]], calls: dict[str, Call]
) -> tuple[Unit, ...]:
    """The units in call order, with each module the run never called that holds the same
    place as a unit in another child of a container above it (an expert the router did not
    pick, a layer a Python draw skipped): planned for the worst case that it runs, with
    that unit's inputs, and placed after it."""
    keyed: dict[str, tuple[tuple[int, int], Unit]] = {
        path: ((order, 0), Unit(path, unit_inputs)) for path, (order, unit_inputs) in found.items()
    }
    classes = {type(model.get_submodule(path)) for path in found}
    registered = {path: k for k, (path, _) in enumerate(model.named_modules())}
    for path, module in model.named_modules():
        if not path or path in calls or type(module) not in classes:
            continue
        if any(path.startswith(f"{unit}.") for unit in keyed):
            continue  # inside a unit: planned with it
        source = sibling_path(model, path, lambda p: p in found)
        if source is None:
            continue
        # where it would run: after the called unit registered last before it
        before = [p for p in found if registered[p] < registered[path]]
        anchor = max(before, key=registered.__getitem__) if before else source
        keyed[path] = (
            (found[anchor][0], registered[path] + 1),
            Unit(path, found[source][1], called=False),
        )
    return tuple(unit for _, unit in sorted(keyed.values(), key=lambda item: item[0]))


def _needs_a_backward(module: nn.Module, inputs: Inputs) -> bool:
    """Whether a call saves anything for a backward: a parameter or an input tensor that
    requires grad (a frozen positional embedding on integer positions does not; a frozen
    block inside a stack that is trained does, through its input). A call that saves nothing
    has nothing to checkpoint, and its planner would have no loss to plan for."""
    return any(p.requires_grad for p in module.parameters()) or any(
        t.requires_grad for t in inputs.tensors()
    )


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


def _held_objects(inputs: Inputs) -> list[str]:
    """The type names of what a recorded call is given besides tensors and plain values
    (pytree's containers are looked into). A unit is planned on its recorded inputs after
    the run: a mutable object there (Hugging Face's ``EncoderDecoderCache``) holds what
    the rest of the run put in it, tensors of that run's graph included."""
    leaves = torch.utils._pytree.tree_leaves((inputs.args, inputs.kwargs))
    return sorted({type(v).__name__ for v in leaves if not isinstance(v, (torch.Tensor, *_PLAIN))})


def unit_key(module: nn.Module, inputs: Inputs) -> tuple:
    """Units with equal keys share one planner and one plan: same class, call signature,
    parameter and buffer shapes, dtypes and ``requires_grad``."""
    return (
        type(plain_module(module)),
        inputs.signature(),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()),
    )


def _capture_error(
    model: nn.Module, path: str, inputs: Inputs, leaf_modules: tuple[str, ...]
) -> str | None:
    """Why the submodule at ``path`` is not a unit (one line), or None when it is one:
    its call is given an object that is not plain data (a key-value cache the root's later
    calls fill), or it does not capture."""
    held = _held_objects(inputs)
    if held:
        return (
            f"'{path}': its call is given {', '.join(held)}, an object later calls may "
            "change (a cache): planning it on its own would see another state"
        )
    prefix = f"{path}."
    leaves = [name.removeprefix(prefix) for name in leaf_modules if name.startswith(prefix)]
    try:  # a result of optimize is planned from the user's module it was made from
        captured = capture(plain_module(model.get_submodule(path)), inputs, leaf_modules=leaves)
    except TraceError as error:
        inside = f"{path}.{error.module}" if error.module else path
        return f"'{inside}' at {error.location}: `{error.source_line}` ({error.reason})"
    except (AutockptError, TypeError) as error:
        return f"'{path}': {str(error).splitlines()[0]}"
    dropped = [note for note in captured.warnings if note.startswith(DROPPED_OUTPUTS)]
    if dropped:  # the root's own code reads its outputs: they must come back whole
        return f"'{path}': its {dropped[0]}"
    return None

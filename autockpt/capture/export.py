"""The export path of capture: ``torch.export`` when the root's own code cannot be traced.

Export graphs keep the batch size and the sequence length dynamic where the model allows
(:func:`_dynamic_shapes`), so smaller batches run the plan; where export cannot, the graph
is specialised to the example shapes, as the notes say. Calls are checked against the graph
before it runs (:func:`_input_check`, stored under :data:`INPUT_CHECK`). Output objects
export cannot carry (a key/value cache) are returned as ``None``, with a note in
:attr:`~autockpt.capture.captured.Capture.warnings`. What export drops (a Python draw, a
mode switch, an assignment) is refused by name (:func:`_check_export_kept`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autockpt.base.inputs import Inputs
from autockpt.base.rng import rng_as_found
from autockpt.base.runtime import caches_as_found
from autockpt.capture.captured import Capture
from autockpt.capture.causal_masks import eager_causal_masks
from autockpt.capture.export_watch import (
    _check_export_kept,
    _not_kept,
    _quiet_torch_logs,
    _watched_on_fakes,
    _WatchedCall,
)
from autockpt.capture.on_device import on_meta_again, traced_as_device
from autockpt.capture.outline import outline_calls
from autockpt.capture.watch import (
    _CHECKPOINT_WARNING,
    _CheckpointSeen,
    _Unfaithful,
    _unique,
    _Watch,
)
from autockpt.errors import PlanMismatchError

DROPPED_OUTPUTS = "outputs that are not tensors or containers of them are returned as None"
"""How a capture's note on dropped outputs begins: a root's step never reads them (its loss is
computed from tensors), but the root's own code may read a submodule's (planning/nested.py
does not plan such a submodule as a unit)."""


def _capture_export(
    model: nn.Module,
    inputs: Inputs,
    notes: list[str],
    fx_failure: tuple[str, BaseException] | str | None,
    module_calls: tuple[str, ...] = (),
) -> Capture:
    """Capture ``model`` called with ``inputs`` by ``torch.export`` (non-strict), after fx
    failed with ``fx_failure`` (the module and its error, or a reason): the graph with export's
    guards taken out and run by the input check instead, and ``notes`` extended with what the
    capture changed or could not keep. The submodules ``module_calls`` name stay module
    calls where they can (NOTE [capture: module calls]): the capture's ``leaf_modules`` are
    those that do, and a note says why each other one does not."""
    dropped: list[str] = []
    inputs = _each_input_its_own(inputs)
    counted: list[bool] = []
    # attention masks as the eager call makes them (NOTE [capture: Hugging Face's causal mask])
    dynamic = _dynamic_shapes(model, inputs)
    watched = _watched_on_fakes(model, inputs, fx_failure) if dynamic is not None else None
    with eager_causal_masks(counted):
        if watched is None:
            exported, watch, seen = _export_watched(
                model, inputs, dropped, fx_failure, module_calls
            )
            exported, dynamic_failure = _export_dynamic(
                model, inputs, exported, dynamic, dropped, module_calls
            )
        else:  # NOTE [capture: one export]
            watch, seen = watched
            exported, dynamic_failure = _export_dynamic(
                model, inputs, None, dynamic, dropped, module_calls
            )
    gm = on_meta_again(exported.module())
    assigned = _keep_assignments(gm, watch, fx_failure)
    if seen.saw_checkpoint:
        notes.append(_CHECKPOINT_WARNING)
        warnings.warn(_CHECKPOINT_WARNING, stacklevel=3)
    if dropped:
        notes.append(
            f"{DROPPED_OUTPUTS} by the "
            f"optimized model: {', '.join(sorted(set(dropped)))} (a training step does not "
            "use them; turn them off in the model, e.g. use_cache=False, to silence this)"
        )
    guards = _take_out_guards(gm)
    kept, inlined = outline_calls(gm, exported, model, module_calls)
    notes.extend(
        f"'{path}' could not be kept a module call: torch.export inlined it and {reason}"
        for path, reason in inlined.items()
    )
    extras = {name: getattr(gm, name) for name in ("_in_spec", "_out_spec") if hasattr(gm, name)}
    layouts = _input_layouts(gm, dict(exported.range_constraints))
    dims = tuple(
        f"{name}[{d}]"
        for name, layout in layouts
        if layout is not None
        for d, size in enumerate(layout[1])
        if isinstance(size, tuple)
    )
    if "_in_spec" in extras:
        extras[INPUT_CHECK] = _input_check(guards, extras["_in_spec"], inputs.signature(), layouts)
    notes.append(_how_captured(fx_failure))
    notes.extend(_assignment_and_size_notes(assigned, dynamic, dynamic_failure, dims))
    counted_out = bool(counted) and all(counted)
    return Capture(gm, "export", kept, notes, extras, dims, counted_out_positions=counted_out)


def _each_input_its_own(inputs: Inputs) -> Inputs:
    """``inputs`` with a tensor passed a second time replaced by a copy (NOTE [capture: one
    tensor passed twice]).

    NOTE [capture: one tensor passed twice]. Examples often pass one tensor for two
    parameters (``input_ids=ids, labels=ids``). torch.export traces each input as one fake
    tensor, so the graph reads whichever placeholder came last wherever the tensor is used:
    Hugging Face Llama's embedding read ``labels``. Called later with labels of their own
    (-100 where masked) the captured step embedded the labels: wrong values, or an index
    error. Each input is therefore traced as its own tensor; the copy is made only while
    capturing (free on meta, one input's bytes otherwise), and the graph is the same
    whether the example shared the tensor or not, so a plan made with shared inputs applies
    to calls with separate ones."""
    seen: set[int] = set()

    def own(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) not in seen:
            seen.add(id(leaf))
            return leaf
        return leaf.detach().clone().requires_grad_(leaf.requires_grad)

    args, kwargs = torch.utils._pytree.tree_map(own, (inputs.args, inputs.kwargs))
    return Inputs(args, kwargs)


def _export_watched(
    model: nn.Module,
    inputs: Inputs,
    dropped: list[str],
    fx_failure: tuple[str, BaseException] | str | None,
    module_calls: tuple[str, ...],
) -> tuple[torch.export.ExportedProgram, _Watch, _CheckpointSeen]:
    """Export with static shapes under the watch (what the model's Python does while
    traced, as on the fx path), refused where the graph does not run what the model runs
    (:func:`_check_export_kept`). Also the watch and what it saw of checkpoints. Used
    where nothing is dynamic, or where the forward cannot run on fake tensors outside
    export (:func:`_watched_on_fakes`, NOTE [capture: one export]); then the dynamic
    export, if any, runs after it unwatched (:func:`_export_dynamic`): export's shape
    reasoning makes many Python calls in SymPy, and a profile hook on each of them more
    than quadrupled its time (tiny GPT-2: 1.0 s, 4.5 s watched). The model's code runs the
    same way in both (the same example inputs): what the first saw holds for the second.
    The watch, and the generators' comparison, cover the model's call alone
    (:class:`_WatchedCall`), not export's passes after it."""
    seen = _CheckpointSeen()
    watch = _Watch(seen, model=model)
    call = _WatchedCall(watch)
    with rng_as_found(), warnings.catch_warnings(), _quiet_torch_logs():
        warnings.simplefilter("ignore")
        exported = _export(model, inputs, None, dropped, module_calls, call)
    _check_export_kept(model, watch, tuple(call.moved), fx_failure)
    return exported, watch, seen


def _export_dynamic(
    model: nn.Module,
    inputs: Inputs,
    exported: torch.export.ExportedProgram | None,
    dynamic: Any | None,
    dropped: list[str],
    module_calls: tuple[str, ...],
) -> tuple[torch.export.ExportedProgram, BaseException | None]:
    """The run of export with the batch and sequence sizes of ``dynamic``
    (:func:`_dynamic_shapes`): its graph, or the static one and why the dynamic one could
    not stand; the static one and ``None`` when nothing is dynamic. ``exported`` is the
    static graph when one was made (:func:`_export_watched`); None: it is made here only
    where it is needed (NOTE [capture: one export])."""

    def static() -> torch.export.ExportedProgram:
        return (
            exported
            if exported is not None
            else _export(model, inputs, None, dropped, module_calls)
        )

    with rng_as_found(), warnings.catch_warnings(), _quiet_torch_logs():
        warnings.simplefilter("ignore")
        if dynamic is None:
            return static(), None
        try:
            sized = _export(model, inputs, dynamic, dropped, module_calls)
        except Exception as error:  # noqa: BLE001 - the static graph stands
            return static(), error
        # Symbolic sizes can turn a size computation into a value read (DeBERTa's relative
        # positions: ``.item()``), which planning must refuse; the static graph computes
        # those sizes as constants.
        reads = _value_reads(sized)
        if reads and reads > _value_reads(fixed := static()):
            error = RuntimeError("with symbolic sizes the graph reads tensor values (.item())")
            return fixed, error
    return sized, None


def _take_out_guards(gm: fx.GraphModule) -> list[Any]:
    """The export graph's guard submodules, erased from the graph (with the code only they
    used): they are not part of the user's tree, and the input check runs them instead
    (rewrite.py runs it before the graph)."""
    guards = []
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            guards.append(gm.get_submodule(str(node.target)))
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    return guards


def _how_captured(fx_failure: tuple[str, BaseException] | str | None) -> str:
    """The capture's note that it used torch.export, and why fx could not."""
    note = "captured with torch.export (non-strict)"
    if isinstance(fx_failure, str):
        note += f" because {fx_failure}"
    elif fx_failure is not None:
        module, error = fx_failure
        where = f"module '{module}'" if module else "the root module"
        if isinstance(error, _Unfaithful):
            note += f" because {where}'s own code {error}"
        else:
            note += f" because fx could not trace {where}: {type(error).__name__}: {error}"
    return note


def _assignment_and_size_notes(
    assigned: tuple[str, ...],
    dynamic: Any | None,
    dynamic_failure: BaseException | None,
    dims: tuple[str, ...],
) -> list[str]:
    """The capture's notes on the buffers the forward assigns and on the input sizes the
    graph takes (``dims``: those export kept dynamic)."""
    notes = []
    if assigned:
        notes.append(
            f"torch.export keeps the assignment of {', '.join(assigned)} in forward as an "
            "in-place update of the registered tensor at the end of the forward: its values "
            "advance exactly as in eager, and the slot keeps holding the same tensor object"
        )
    if dynamic_failure is not None:
        first = str(dynamic_failure).strip().splitlines()[0] if str(dynamic_failure) else ""
        notes.append(
            "torch.export could not keep batch and sequence sizes dynamic "
            f"({type(dynamic_failure).__name__}: {first}), so the graph is specialised to "
            "the planned input shapes: a call with other shapes raises PlanMismatchError"
        )
    elif dims:
        notes.append(
            f"the graph takes other sizes in {', '.join(dims)} (torch.export keeps them "
            "dynamic; its guards refuse sizes the model's code branches on) and the planned "
            "size in every other dimension: smaller batches and sequences run the plan, "
            "larger ones follow `on_larger_input`"
        )
    elif dynamic is not None:
        notes.append(
            "torch.export fixed every input size while tracing, so the graph is specialised "
            "to the planned input shapes: a call with other shapes raises PlanMismatchError"
        )
    return notes


def _value_reads(exported: Any) -> int:
    """How many nodes of an exported graph read a tensor's value into Python."""
    reads = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
    return sum(
        1
        for node in exported.graph_module.graph.nodes
        if node.op == "call_function" and node.target in reads
    )


def _dynamic_shapes(model: nn.Module, inputs: Inputs) -> Any | None:
    """Export's ``dynamic_shapes`` for the example inputs: the batch dimension (dim 0) of
    every tensor and the sequence dimension (dim 1) of every integer or boolean tensor of
    rank 2 or more (token ids, attention masks, labels, positions), each as ``Dim.AUTO``:
    export keeps a dimension dynamic where the model allows it and silently specialises
    it where the model fixes it (a size-1 example, a view to a literal shape, a table of
    fixed length). Floating tensors keep their other sizes (channels, features, a
    sequence of embeddings). Every other input gets ``None`` (all sizes fixed): 0-dim
    tensors, non-tensors and ``None``, wherever they are passed, ``**kwargs`` included. The
    spec is for the forward as :func:`_keywords_as_parameters` shows it to export, which
    :func:`_export` does whenever it is given a spec. ``None`` when nothing is marked or
    export's helper cannot map the inputs to the forward's parameters."""
    from torch.export import Dim, ShapesCollection

    shapes = ShapesCollection()
    marked = False
    for t in inputs.tensors():
        dims = {}
        if t.dim() >= 1:
            dims[0] = Dim.AUTO
        if t.dim() >= 2 and not (t.is_floating_point() or t.is_complex()):
            dims[1] = Dim.AUTO
        if dims:
            shapes[t] = dims
            marked = True
    if not marked:
        return None
    try:
        with _keywords_as_parameters(model, inputs):
            return shapes.dynamic_shapes(model, inputs.args, inputs.kwargs)
    except Exception:  # noqa: BLE001 - exported with static shapes instead
        return None


def _keyword_parameters(model: nn.Module, inputs: Inputs) -> inspect.Signature | None:
    """The forward's signature with each keyword input that its ``**kwargs`` receives as a
    keyword-only parameter of its own, and no ``**kwargs``; ``None`` when no input goes
    through ``**kwargs`` or such a signature cannot be written (a keyword that is not an
    identifier, or has the name of a positional-only parameter)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    extra = [name for name in inputs.kwargs if name not in named]
    if not extra:
        return None
    kept = [p for p in params if p.kind is not p.VAR_KEYWORD]
    try:
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in extra]
        return signature.replace(parameters=kept + added)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def _keywords_as_parameters(model: nn.Module, inputs: Inputs) -> Iterator[None]:
    """While exporting with dynamic shapes, ``model.forward`` shows the keyword inputs its
    ``**kwargs`` receive (the Trainer's ``num_items_in_batch``) as parameters of their own
    (:func:`_keyword_parameters`). torch.export checks ``dynamic_shapes`` against the
    forward's signature, where such inputs sit in a dict under the ``**kwargs`` parameter's
    name, and later matches it against the inputs in call order, where they sit at the top
    level (pytorch/pytorch#150022, up to at least torch 2.13): no spec passes both, and
    export fails ("Must provide a tree_name when there might be a mismatch"), so a Hugging
    Face causal LM planned with the Trainer's call was specialised to the planned shapes.
    With parameters of their own both views agree. The call is unchanged (the override
    passes everything on), and so is the graph: its placeholders are named after the
    keywords either way, and its input spec is the call's. The model is restored on exit
    (the override is an instance attribute, removed again); without such inputs nothing
    is changed."""
    signature = _keyword_parameters(model, inputs)
    if signature is None:
        yield
        return
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    with _forward_replaced(model, forward):
        yield


@contextlib.contextmanager
def _forward_replaced(model: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``model.forward`` is ``forward`` (an instance attribute) until exit, then what the
    instance had again: its own attribute, or none (the class's method)."""
    had_own = "forward" in vars(model)
    previous = vars(model).get("forward")
    model.forward = forward
    try:
        yield
    finally:
        if had_own:
            model.forward = previous
        else:
            del model.forward


def _export(
    model: nn.Module,
    inputs: Inputs,
    dynamic: Any | None,
    dropped: list[str],
    module_calls: tuple[str, ...] = (),
    watched: _WatchedCall | None = None,
) -> torch.export.ExportedProgram:
    """``torch.export.export(strict=False)``, retried once with outputs export cannot
    carry (a key/value cache object a model returns with use_cache on) left out (their
    class names are appended to ``dropped``); anything else fails the same way again, and
    the first error stands. The calls of ``module_calls`` keep their signatures (NOTE
    [capture: module calls]); without any, export is called exactly as before. ``watched``:
    the model's call is watched (:class:`_WatchedCall`)."""
    preserved = {"preserve_module_call_signature": module_calls} if module_calls else {}

    def run() -> torch.export.ExportedProgram:
        # tracing runs the model's code on fake tensors: caches it fills hold fakes
        with contextlib.ExitStack() as stack, caches_as_found(model), _inlined_unrecompiled():
            if watched is not None:
                stack.enter_context(watched.around(model))
            if dynamic is not None:  # the spec is for the forward as this shows it
                stack.enter_context(_size_oblivious())
                stack.enter_context(_keywords_as_parameters(model, inputs))
            # a meta model is traced as the device it runs on (NOTE [capture: meta traced
            # as a device])
            traced = stack.enter_context(traced_as_device(model, inputs))
            return torch.export.export(
                model,
                traced.args,
                traced.kwargs,
                strict=False,
                dynamic_shapes=dynamic,
                **preserved,
            )

    try:
        return run()
    except Exception as error:  # noqa: BLE001 - retried once, else the first error stands
        try:
            with _outputs_without_opaque_objects(model, dropped):
                return run()
        except Exception:  # noqa: BLE001
            raise error from None


@contextlib.contextmanager
def _inlined_unrecompiled() -> Iterator[None]:
    """While exporting, export's passes that turn grad-mode and autocast regions into
    higher-order ops inline each region they keep inline without recompiling the whole
    graph module after each one.

    NOTE [export: one recompile per split]. Those passes (``replace_set_grad_with_hop_pass``,
    ``replace_autocast_with_hop_pass``, torch 2.14) split the graph at every region, then
    inline the regions back one by one with ``node_inline_``, which ends with
    ``gm.recompile()``: Python code generated for the whole graph and for every remaining
    split piece, after every region. A model with a ``no_grad`` block in each layer (the
    forced weight normalisation of EDM2's U-Net: lucidrains' ``KarrasUnet``, 4.3M
    parameters, 2,924 nodes, ~200 regions) spent 70% of its capture there: 216-278 s on
    one CPU thread, against an eager step of 0.4-1.3 s. The pass's own helper recompiles
    the module once after inlining them all
    (``_sequential_split_and_maybe_inline_subgraphs_helper``), and nothing between reads
    the generated code, so each inline's recompile is skipped: the graph is the same node
    for node (the same fingerprint), and that capture took 92-99 s (37-46 s with the watch
    on the model's call alone, :class:`_WatchedCall`). Where those private names are
    missing (another torch), export runs as it is."""
    try:
        from torch._export.passes import replace_autocast_with_hop_pass as autocast_pass
        from torch._export.passes import replace_set_grad_with_hop_pass as grad_pass
        from torch._export.passes import replace_with_hop_pass_util as util
    except ImportError:  # pragma: no cover - another torch: export as it is
        yield
        return
    passes = [
        p
        for p in (grad_pass, autocast_pass)
        if callable(getattr(p, "node_inline_", None))
        # not while another export (another thread) holds it: that one puts it back
        and not isinstance(p.node_inline_, functools.partial)
    ]
    if not passes or not hasattr(util, "_sequential_split_and_maybe_inline_subgraphs_helper"):
        yield  # pragma: no cover
        return
    originals = [p.node_inline_ for p in passes]

    def inline(node: fx.Node, original: Callable[[fx.Node], Any]) -> Any:
        gm = node.graph.owning_module
        if gm is None or "recompile" in vars(gm):
            return original(node)
        vars(gm)["recompile"] = _recompiled_later
        try:
            return original(node)
        finally:
            del vars(gm)["recompile"]

    for p, original in zip(passes, originals, strict=True):
        p.node_inline_ = functools.partial(inline, original=original)
    try:
        yield
    finally:
        for p, original in zip(passes, originals, strict=True):
            p.node_inline_ = original


def _recompiled_later() -> None:
    """A graph module's ``recompile`` while export's pass inlines its regions (NOTE [export:
    one recompile per split]): the pass recompiles it once after the last."""


_Size = int | tuple[int, int | None]
"""A dimension of an export graph's input: its fixed size, or the range (lowest, highest
or ``None``) of a dimension export kept dynamic."""


_Layouts = list[tuple[str, tuple[torch.dtype, tuple[_Size, ...]] | None]]


def _size_oblivious() -> contextlib.AbstractContextManager[Any]:
    """Export with sizes reasoned about for every value, 0 and 1 included
    (``backed_size_oblivious``): by default export assumes each dynamic size is at least 2
    and takes a branch such as ``if x.shape[0] > 1`` without a guard, so a last batch of
    one would be refused (:func:`_input_layouts`); with it, such a branch becomes a guard
    and a batch of one runs where the model allows it. A private switch of torch's: where
    it is missing, export's default stands."""
    try:
        from torch.fx.experimental import _config
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    if not hasattr(_config, "backed_size_oblivious"):  # pragma: no cover
        return contextlib.nullcontext()
    return _config.patch(backed_size_oblivious=True)


def _input_layouts(gm: fx.GraphModule, ranges: dict[Any, Any]) -> _Layouts:
    """For each input of an export graph, in its flattened order: its name and, for a
    tensor, its dtype and sizes. A dynamic size comes with the range export traced it
    for (``range_constraints``): without :func:`_size_oblivious` export assumes a dynamic
    size is at least 2 and may take a branch that is wrong for 1 (``if x.shape[0] > 1``)
    without leaving a guard for it, so a size outside the range is refused like a fixed
    size that differs."""
    from torch.utils._sympy.numbers import int_oo

    def size_range(size: torch.SymInt) -> tuple[int, int | None]:
        bounds = ranges.get(size.node.expr)
        if bounds is None:
            return (2, None)
        try:
            lowest = max(0, int(bounds.lower))
        except (TypeError, ValueError):
            lowest = 2
        try:
            highest = None if bounds.upper == int_oo else int(bounds.upper)
        except (TypeError, ValueError, OverflowError):
            highest = None
        return (lowest, highest)

    layouts: _Layouts = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            layouts.append((node.name, None))
            continue
        sizes = tuple(d if isinstance(d, int) else size_range(d) for d in value.shape)
        layouts.append((node.name, (value.dtype, sizes)))
    return layouts


def _keep_assignments(
    gm: fx.GraphModule, watch: _Watch, fx_failure: tuple[str, BaseException] | str | None
) -> tuple[str, ...]:
    """Check that the export graph keeps every buffer assignment the forward made, and
    return the assigned buffers' names.

    Non-strict export turns ``self.steps = self.steps + 1`` into an in-place
    ``copy_(steps, new)`` at the end of the graph: the values advance as in eager, but the
    tensor object stays the same. Export drops an assignment to a parameter, and may drop
    one next to a ``no_grad`` region; an in-place copy cannot change a buffer's shape or
    dtype (a table rebuilt for a new size). Each of those is refused with a
    :class:`TraceError` naming the line. A copy in place would also change the tensor
    that autograd saved where the forward read the old value (``h * self.steps`` before
    the assignment; eager saved the old object, which no one changes), so the reads of a
    buffer the graph copies into read a clone of it, made where the graph first reads it.
    That holds for every such copy: export also writes one for ``self.mask =
    self.mask.to(x.dtype)``, which puts back the very tensor the slot holds."""
    copies: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if (
            node.op == "call_function"
            and node.target is torch.ops.aten.copy_.default
            and isinstance(node.args[0], fx.Node)
            and node.args[0].op == "get_attr"
        ):
            copies[str(node.args[0].target)] = node
    sightings = _unique(watch.assignments)
    lost = [
        s
        for s in sightings
        if s.parameter or s.slot not in copies or not _same_layout(gm, copies[s.slot])
    ]
    if lost:
        in_root = isinstance(fx_failure, tuple) and not fx_failure[0]
        raise _not_kept(
            lost,
            "the forward assigns a registered buffer or parameter (",
            "), which torch.export does not keep as an in-place update of the same "
            "buffer (a parameter, another shape or dtype, or dropped by export), and fx "
            "cannot keep it either in code that cannot run as a leaf; update the buffer in "
            "place instead (self.buf.copy_(...) or self.buf.add_(...))",
            in_root,
        )
    for copy_node in copies.values():  # also those export made of a no-op assignment
        _read_a_clone(gm.graph, copy_node)
    return tuple(sorted({str(s.slot) for s in sightings}))


def _same_layout(gm: fx.GraphModule, copy_node: fx.Node) -> bool:
    """Whether the value ``copy_node`` writes has the shape and dtype of the buffer it
    writes (a static shape: a size that follows the input cannot be copied in place)."""
    value = copy_node.args[1]
    new = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(new, torch.Tensor):
        return True  # unknown: the copy itself checks at run time
    try:
        held = gm.get_buffer(str(copy_node.args[0].target))
    except AttributeError:
        return False
    sizes = tuple(new.shape)
    return (
        new.dtype == held.dtype
        and all(isinstance(d, int) for d in sizes)
        and sizes == tuple(held.shape)
    )


def _read_a_clone(graph: fx.Graph, copy_node: fx.Node) -> None:
    """Make the graph's reads of the buffer ``copy_node`` updates read a clone taken before
    the first of them (see :func:`_keep_assignments`). Left as it is when a reader may
    write it (an in-place op, a higher-order op) or reads it after the copy (the forward's
    own ``self.buf.copy_(...)`` followed by a read of the new values): those must reach the
    buffer itself."""
    attr = copy_node.args[0]
    assert isinstance(attr, fx.Node)
    readers = [user for user in attr.users if user is not copy_node]
    if not readers:
        return
    order = {node: i for i, node in enumerate(graph.nodes)}
    for reader in readers:
        target = reader.target
        if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
            return
        if order[reader] > order[copy_node]:
            return
    first = min(readers, key=order.__getitem__)
    with graph.inserting_before(first):
        clone = graph.call_function(torch.ops.aten.clone.default, (attr,))
    if "val" in attr.meta:
        clone.meta["val"] = attr.meta["val"]
    for reader in readers:
        reader.replace_input_with(attr, clone)


INPUT_CHECK = "_autockpt_check_inputs"
"""Name of the attribute (a plain function ``check(args, kwargs)``) by which an export
capture's input guards reach the rewritten module."""


def _input_check(
    guards: list[Any],
    in_spec: Any,
    planned: str,
    layouts: _Layouts,
) -> Callable[[tuple, dict], None]:
    """Export specialises its graph to the example's dtypes, to the sizes it could not
    keep dynamic (all of them when exported with static shapes) and to non-tensor inputs
    (a view to ``[4, -1]``); another shape would fail deep inside the graph with an
    unrelated message, or not at all. This check runs on every call of the optimized model
    before the graph: each tensor's dtype, rank, fixed sizes and the range of each dynamic
    size (:func:`_input_layouts`), then export's own guards (relations between sizes), and
    raises a typed error that says what to do. Whether a size is larger than planned is
    the rewrite's check, the same as for fx graphs (``on_larger_input``)."""
    from torch.fx._pytree import tree_flatten_spec

    dynamic = any(
        layout is not None and any(isinstance(size, tuple) for size in layout[1])
        for _, layout in layouts
    )
    specialised = (
        "its graph takes other sizes only where torch.export kept them dynamic"
        if dynamic
        else "its graph is specialised to them"
    )

    def refuse(detail: str) -> None:
        raise PlanMismatchError(
            f"this optimized model's graph was captured for inputs {planned} and {specialised} "
            f"({detail}); give inputs of the planned shape there (e.g. drop_last=True, "
            "padding to the planned length) or plan again for this one"
        )

    def check_inputs(args: tuple, kwargs: dict) -> None:
        try:
            flat = tree_flatten_spec((list(args), kwargs), in_spec)
        except Exception:  # noqa: BLE001 - the graph's own input handling reports it
            return
        if len(flat) == len(layouts):
            for (name, layout), value in zip(layouts, flat, strict=True):
                if layout is None or not isinstance(value, torch.Tensor):
                    continue
                dtype, sizes = layout
                if value.dtype != dtype or value.dim() != len(sizes):
                    shape = f"{list(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
                    refuse(f"{name} is {shape}; the graph takes rank {len(sizes)} {dtype}")
                for d, (got, want) in enumerate(zip(value.shape, sizes, strict=True)):
                    if isinstance(want, int) and got != want:
                        refuse(f"{name} has size {got} in dimension {d}, fixed at {want}")
                    if isinstance(want, tuple) and not (
                        want[0] <= got and (want[1] is None or got <= want[1])
                    ):
                        bounds = f"{want[0]}..{'' if want[1] is None else want[1]}"
                        refuse(
                            f"{name} has size {got} in dimension {d}; torch.export traced "
                            f"that dynamic size for {bounds}"
                        )
        for guard in guards:
            try:
                guard(*flat)
            except AssertionError as error:
                refuse(str(error))

    return check_inputs


def takes_inputs(captured: Capture, inputs: Inputs) -> bool:
    """Whether an export capture's graph runs ``inputs`` as the model would: its batch or
    sequence sizes are dynamic (:attr:`Capture.dynamic_dims`) and its input check takes them
    (dtypes, ranks, fixed sizes, each dynamic size's range and export's own guards). The
    same check the optimized model runs before every call, so a graph that takes them
    here is the graph a plan's model runs them through."""
    check = captured.extra_attributes.get(INPUT_CHECK)
    if not captured.dynamic_dims or check is None:
        return False
    try:
        check(inputs.args, inputs.kwargs)
    except PlanMismatchError:
        return False
    return True


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


@contextlib.contextmanager
def _outputs_without_opaque_objects(model: nn.Module, dropped: list[str]) -> Iterator[None]:
    """While exporting, ``model`` returns its output with every leaf that is not a tensor or
    a plain value (one pytree does not know how to take apart) replaced by ``None``; the
    class names of what was replaced are appended to ``dropped``. The model is restored on
    exit (the override is an instance attribute, removed again)."""
    original = model.forward

    def strip(value: Any) -> Any:
        if isinstance(value, _PLAIN_LEAVES):
            return value
        dropped.append(type(value).__name__)
        return None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return torch.utils._pytree.tree_map(strip, original(*args, **kwargs))

    with _forward_replaced(model, forward):
        yield


def _is_impure(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    return node.is_impure()

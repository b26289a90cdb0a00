"""A plan applied to a model: the road from a :class:`~autockpt.plan.Plan` to the result.

Plans reach the rewrite by one road, whoever made them: the planner writes a ``Plan`` and
the rewrite reads its node names back into :class:`~autockpt.rewrite.segment.SegmentSpec`
s (:func:`segment_specs_from_plan`); ``apply`` captures the model again, checks that its
graph is the plan's (fingerprint, inputs) and takes the same road. An unpickled result
comes back this way too (:func:`_rebuild`, NOTE [rewrite: rebuild on load] in
``autockpt/rewrite/result.py``).

Which module is planned is decided here too (:func:`unwrap`): a ``torch.compile`` wrapper
is planned inside and handed back compiled, a result of ``optimize`` is planned from the
user's module it was made from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autockpt.base.inputs import Inputs, given_input_names
from autockpt.base.precision import Precision
from autockpt.base.runtime import as_found, device_of, training_mode, warn_if_eval
from autockpt.capture.captured import Capture
from autockpt.capture.front import capture
from autockpt.distributed import check_not_wrapped, release_planning_garbage, step_model
from autockpt.errors import AutockptError, CompileError, PlanMismatchError
from autockpt.plan import Plan
from autockpt.rewrite.graph import rewrite
from autockpt.rewrite.result import (
    _STATE,
    inputs_like,
    is_checkpointed,
    plain_module,
    planned_inputs,
)
from autockpt.rewrite.segment import SegmentSpec
from autockpt.rewrite.submodule import (
    Call,
    record_calls,
    replace_submodule,
    replace_submodules,
    sibling_path,
    submodule_inputs,
)


def check_model(model: Any) -> None:
    """A module autockpt can plan: an ``nn.Module``, not yet wrapped by DDP or FSDP."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_not_wrapped(model)


def unwrap(model: Any) -> tuple[nn.Module, Callable[[nn.Module], nn.Module]]:
    """The eager module to plan, and how to hand a result back to look like ``model``.

    * ``torch.compile(m)`` (an ``OptimizedModule``): plan ``m``; the result is compiled with
      the same dynamo context (backend, mode, options: what ``torch.compile`` was given).
    * An ``optimize`` result: re-plan the user's original module (the result's graph has
      segment calls in it, and capturing it again would plan a plan).
    * ``m.compile()`` (compiled in place): :class:`CompileError`; its options cannot be
      recovered, and a rewritten module would silently run uncompiled.
    """
    check_model(model)
    hand_back: Callable[[nn.Module], nn.Module] = same
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # nothing is compiled without it
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        hand_back = CompiledHandBack(model.dynamo_ctx)
        model = model._orig_mod

    if getattr(model, "_compiled_call_impl", None) is not None:
        raise CompileError(
            f"{type(model).__name__} was compiled in place with Module.compile(), whose "
            "options autockpt cannot carry over to the rewritten module. Plan the eager "
            "module, then compile the result: fast = autockpt.optimize(model, ...); "
            "fast.compile(...) (or torch.compile(model) before optimize, which it keeps)"
        )
    if is_checkpointed(model):
        model = plain_module(model)  # the user's class, tree and mode, without the plan
    return model, hand_back


def same(result: nn.Module) -> nn.Module:
    """The hand-back of a module that came eager: the result itself."""
    return result


RECOMPILE_LIMIT = 1024
"""dynamo's recompile limit for results compiled at a partitioner budget (the user's
compile keeps its own setting)."""


class PartitionerBudget:
    """A ``torch.compile`` backend: the user's, compiling with
    ``torch._functorch.config.activation_memory_budget`` patched to ``fraction`` (NOTE
    [compiled: partitioner budgets]). The partitioner reads the setting when a graph is
    compiled, which is lazy (at a first call, or a recompile after a guard fails), so it is
    patched in the backend, not around one call. Compile caches are off inside it: a cached
    graph of another budget must not be handed back for this one."""

    def __init__(self, inner: Callable[..., Any], fraction: float | None, context: Any) -> None:
        self.inner, self.fraction = inner, fraction
        self.context = context
        """The dynamo context the user compiled with: what a re-plan hands back with."""

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        if self.fraction is None:  # the user's own setting: nothing patched
            return self.inner(graph, example_inputs)
        with (
            functorch_config.patch(activation_memory_budget=self.fraction),
            inductor_config.patch(force_disable_caches=True),
        ):
            return self.inner(graph, example_inputs)

    def __repr__(self) -> str:
        return f"PartitionerBudget({self.inner!r}, {self.fraction})"


@dataclasses.dataclass(frozen=True)
class CompiledHandBack:
    """How a result goes back to a user who gave ``torch.compile(m)``: compiled again with
    the same dynamo context (backend, mode, options, ``dynamic``, ``fullgraph``)."""

    context: Any

    def __post_init__(self) -> None:
        backend = _backend_of(self.context)
        if isinstance(backend, PartitionerBudget):  # a result of ours: the user's context
            object.__setattr__(self, "context", backend.context)

    def __call__(self, result: nn.Module) -> nn.Module:
        return self.at_budget(result, None)

    def at_budget(self, result: nn.Module, fraction: float | None) -> nn.Module:
        """``result`` compiled with the user's backend and options, its partitioner at
        ``activation_memory_budget=fraction`` (None: the user's setting), in a dynamo
        context of its own (its own cache entries and recompile limit: every result runs
        one shared forward, which dynamo compiles once per result object; under the
        user's context a budget sweep used up its limit of 8 and the next result silently
        ran eagerly)."""
        budget = PartitionerBudget(_backend_of(self.context), fraction, self.context)
        options: dict[str, Any] = {
            "fullgraph": bool(getattr(self.context, "fullgraph", False)),
            "dynamic": getattr(self.context, "_dynamic", None),
        }
        accepted = inspect.signature(torch.compile).parameters
        if "isolate_recompiles" in accepted:
            # their own cache entries: the user's compile reaching its limit on the shared
            # forward must not make dynamo skip it for these too
            options["isolate_recompiles"] = True
        if "recompile_limit" in accepted:
            # every result runs one shared forward, compiled once per result object (and
            # again when its plan is replaced): a partition-only result must not fall
            # back to eager, which checkpoints nothing, when a budget sweep used up
            # dynamo's default limit of 8
            options["recompile_limit"] = RECOMPILE_LIMIT
        return torch.compile(result, backend=budget, **options)

    @property
    def backend_name(self) -> str:
        """What the backend is, for the store's key and the plan's notes."""
        backend = _backend_of(self.context)
        name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
        return str(name or type(backend).__name__)


def _backend_of(context: Any) -> Any:
    """The compiler function inside a dynamo context (``torch.compile``'s ``backend``)."""
    from torch._dynamo.eval_frame import innermost_backend

    backend = innermost_backend(context.callback)
    inner = getattr(backend, "compiler_fn", None)  # torch.compile's wrapper of a callable
    return inner if isinstance(inner, PartitionerBudget) else backend


def compile_budget(module: nn.Module) -> float | None:
    """The partitioner budget a module handed back compiled runs at (None: the user's)."""
    context = getattr(module, "dynamo_ctx", None)
    if context is None:
        return None
    backend = _backend_of(context)
    return backend.fraction if isinstance(backend, PartitionerBudget) else None


def compiled_backend(module: nn.Module) -> Any:
    """The user's backend a module handed back compiled runs (under our wrapper, if any)."""
    backend = _backend_of(module.dynamo_ctx)
    return backend.inner if isinstance(backend, PartitionerBudget) else backend


def apply_plan(model: nn.Module, plan: Plan, example_inputs: Any = None) -> nn.Module:
    """``autockpt.apply``: re-apply a saved plan to ``model`` without profiling or solving,
    leaving the model, the inputs and the random generators as found, and no garbage of
    the capture holding its tensors (NOTE [distributed: garbage holding full parameters])."""
    check_model(model)
    with as_found(model, () if example_inputs is None else example_inputs):
        result = _apply(model, plan, example_inputs)
    release_planning_garbage(plan)
    return result


def _apply(model: nn.Module, plan: Plan, example_inputs: Any) -> nn.Module:
    model, hand_back = unwrap(model)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autockpt.Plan, got {type(plan).__name__}")
    inputs = Inputs.of(example_inputs).as_called(model) if example_inputs is not None else None
    if plan.compile_memory_budget is not None and not isinstance(hand_back, CompiledHandBack):
        raise PlanMismatchError(
            "this plan leaves recompute to torch.compile's partitioner "
            f"(activation_memory_budget={plan.compile_memory_budget:g}) and has no segments: "
            "run eagerly it would not checkpoint anything. Apply it to the compiled model: "
            "autockpt.apply(torch.compile(model), plan, ...)"
        )
    if plan.units:  # the root runs eagerly around planned units (planning/nested.py)
        return hand_back(apply_units(model, plan, inputs))
    if plan.submodule is not None:  # the root runs eagerly around a planned submodule
        return hand_back(apply_inside(model, plan, inputs))
    missing = sorted(set(plan.leaf_modules) - {name for name, _ in model.named_modules()})
    if missing:
        raise PlanMismatchError(
            f"the plan (for {plan.model}) names modules this {type(model).__name__} lacks "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): it was made for "
            "another model"
        )
    capture_inputs = inputs
    if plan.capture_method == "export" and inputs is None:
        # torch.export traces with real tensors: zeros of the shapes the plan records
        capture_inputs = _recorded_inputs(model, plan)
    method = "export" if plan.capture_method == "export" else "fx"
    warn_if_eval(model)
    try:
        with training_mode(model), _planned_autocast(plan, method, model, capture_inputs):
            captured = capture(
                # an export graph holds the planned dtypes (FSDP2's bfloat16 step)
                step_model(model, plan) if method == "export" else model,
                capture_inputs or Inputs((), {}),
                leaf_modules=plan.leaf_modules,
                method=method,
                input_names=plan.input_names,
                module_calls=plan.fsdp_units,
            )
    except TypeError as error:
        raise PlanMismatchError(
            f"plan was made for {plan.model} called with ({', '.join(plan.input_names)}); this "
            f"{type(model).__name__} cannot be called that way: {error}"
        ) from error
    except AutockptError as error:
        raise PlanMismatchError(
            f"the plan (for {plan.model}) cannot be applied: this model's graph does not "
            f"capture the same way ({error})"
        ) from error
    fingerprint = captured.fingerprint()
    # plans saved before devices left the fingerprint still apply on their own device
    legacy = captured.fingerprint(devices=True)
    if plan.graph_fingerprint not in (fingerprint, legacy):
        raise PlanMismatchError(
            f"plan was made for a different graph: plan {plan.graph_fingerprint} for model "
            f"{plan.model} ({plan.num_nodes} nodes); this model {type(model).__name__} has "
            f"graph {fingerprint} ({len(captured.compute_nodes())} nodes)"
        )
    if inputs is not None and inputs.signature() != plan.input_signature:
        raise PlanMismatchError(
            f"plan was made for inputs {plan.input_signature}, got {inputs.signature()}"
        )
    specs = segment_specs_from_plan(captured, plan)
    # Calls are checked against the planned inputs (their shapes are in the plan).
    planned = inputs if inputs is not None else planned_inputs(plan.input_signature)
    rewritten = rewrite_for_training(model, captured, specs, planned)
    if plan.compile_memory_budget is not None:
        assert isinstance(hand_back, CompiledHandBack)
        result = hand_back.at_budget(rewritten, plan.compile_memory_budget)
    else:
        result = hand_back(rewritten)
    result.plan = plan
    return result


def _planned_autocast(
    plan: Plan, method: str, model: nn.Module, inputs: Inputs | None
) -> contextlib.AbstractContextManager[None]:
    """The autocast the plan was made in, for an export capture: ``torch.export`` writes
    autocast's casts into the graph, so a plan made for a bfloat16 autocast step (on meta for
    a GPU, say) is for a graph with them, whatever autocast the caller is in while applying
    it. fx graphs hold module calls and no casts: captured as they are."""
    planned = Precision.from_notes(plan.notes) if method == "export" else None
    if planned is None:
        return contextlib.nullcontext()
    return planned.entered(device_of(model, inputs or Inputs((), {})))


def _recorded_inputs(model: nn.Module, plan: Plan) -> Inputs:
    """Example inputs rebuilt from the plan (zeros of its recorded shapes and dtypes, on the
    model's device), for re-capturing an export plan applied without any."""
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    try:
        return inputs_like(plan.input_signature, device)
    except ValueError as error:
        raise PlanMismatchError(
            "this plan's graph was captured with torch.export, which needs example inputs, and "
            f"its recorded inputs cannot be rebuilt ({error}): call autockpt.apply(model, plan, "
            "example_inputs)"
        ) from error


def segment_specs_from_plan(captured: Capture, plan: Plan) -> list[SegmentSpec]:
    """The plan's segments as the rewrite takes them: node names become positions in this
    capture's compute nodes (the one road from a plan to a module, for ``optimize`` and
    ``apply`` alike). Raises :class:`PlanMismatchError` for a name this graph lacks."""
    index = {node.name: i for i, node in enumerate(captured.compute_nodes())}
    specs = []
    for seg in plan.segments:
        if seg.first_node not in index or seg.last_node not in index:
            raise PlanMismatchError(
                f"plan segment {seg.first_node}..{seg.last_node} names nodes this graph lacks"
            )
        specs.append(
            SegmentSpec(
                index[seg.first_node],
                index[seg.last_node] + 1,
                seg.preserve_rng,
                seg.restore_buffers,
                kept_ops=tuple((kept.node, kept.op, kept.index) for kept in seg.kept_ops),
            )
        )
    return specs


def rewrite_for_training(
    model: nn.Module, captured: Capture, specs: list[SegmentSpec], inputs: Inputs | None
) -> nn.Module:
    """``rewrite`` with the model in training mode, the mode its graph was captured in (so
    ``result.train()`` runs the checkpointed graph); the result then takes the model's mode.
    The result can be pickled once it holds a plan (NOTE [rewrite: rebuild on load])."""
    training = model.training
    with training_mode(model):
        result = rewrite(model, captured, specs, inputs)
    result.training = training
    vars(result)[_STATE].rebuild = _rebuild
    return result


def _rebuild(
    plain: nn.Module, plan: Plan, captured_training: bool, on_larger_input: str
) -> nn.Module:
    """Re-apply ``plan`` to an unpickled plain model, captured in the mode it was planned
    in (a result saved in eval mode would otherwise capture another graph), and leave every
    module's mode as it was saved. The plan alone re-captures it (an export plan from zeros
    of its recorded input shapes, as ``apply`` does without example inputs)."""
    modes = {name: module.training for name, module in plain.named_modules()}
    plain.train(captured_training)
    try:
        result = apply_plan(plain, plan)
    finally:
        for name, module in plain.named_modules():
            module.training = modes[name]
    result.training = modes[""]
    result.on_larger_input = on_larger_input
    return result


def apply_inside(model: nn.Module, plan: Plan, inputs: Inputs | None) -> nn.Module:
    """Re-apply a plan whose segments are inside ``plan.submodule``: that submodule is
    captured again, with the inputs a prefix run of the root's forward gives it."""
    path = plan.submodule
    assert path is not None
    if inputs is None:
        raise PlanMismatchError(
            f"this plan's segments are inside submodule '{path}', whose inputs come from "
            "running the root's forward up to it: call autockpt.apply(model, plan, "
            "example_inputs)"
        )
    if inputs.signature() != plan.input_signature:
        raise PlanMismatchError(
            f"plan was made for inputs {plan.input_signature}, got {inputs.signature()}"
        )
    try:
        child = model.get_submodule(path)
    except AttributeError as error:
        raise PlanMismatchError(
            f"the plan's segments are inside submodule '{path}', which this "
            f"{type(model).__name__} lacks (the plan is for {plan.model})"
        ) from error
    found = submodule_inputs(model, path, inputs)
    if found is None:
        raise PlanMismatchError(
            f"the plan's segments are inside submodule '{path}', which this "
            f"{type(model).__name__}'s forward never calls"
        )
    inner = dataclasses.replace(
        plan,
        submodule=None,
        model=type(child).__name__,
        input_signature=found.signature(),
        input_names=given_input_names(child, found),
    )
    result = replace_submodule(model, path, apply_plan(child, inner, found))
    result.plan = plan
    return result


def apply_units(model: nn.Module, plan: Plan, inputs: Inputs | None) -> nn.Module:
    """Re-apply a plan of units (``plan.units``): each unit is captured again with the
    inputs one recorded run of the root's forward gives it, and its own plan applied."""
    if inputs is None:
        raise PlanMismatchError(
            "this plan checkpoints submodule calls of a root whose forward cannot be captured; "
            "their inputs come from running the root's forward: call "
            "autockpt.apply(model, plan, example_inputs)"
        )
    if inputs.signature() != plan.input_signature:
        raise PlanMismatchError(
            f"plan was made for inputs {plan.input_signature}, got {inputs.signature()}"
        )
    paths = {unit.path for unit in plan.units}
    names = {name for name, _ in model.named_modules()}
    missing = sorted(paths - names)
    if missing:
        raise PlanMismatchError(
            f"the plan checkpoints submodules this {type(model).__name__} lacks "
            f"({', '.join(missing[:3])}): it was made for {plan.model}"
        )
    calls = record_calls(model, inputs, lambda path, caller: path in paths).calls
    replacements = {}
    for unit in plan.units:
        call = calls.get(unit.path)
        found = call.inputs if call is not None else sibling_inputs(model, unit.path, calls)
        if found is None:
            raise PlanMismatchError(
                f"the plan checkpoints '{unit.path}', which this {type(model).__name__}'s "
                "forward never calls"
            )
        replacements[unit.path] = apply_plan(model.get_submodule(unit.path), unit.plan, found)
    result = replace_submodules(model, replacements)
    result.plan = plan
    return result


def sibling_inputs(model: nn.Module, path: str, calls: dict[str, Call]) -> Inputs | None:
    """The recorded inputs of the nearest called sibling of ``path``'s class."""
    source = sibling_path(model, path, lambda p: p in calls and calls[p].inputs is not None)
    return None if source is None else calls[source].inputs

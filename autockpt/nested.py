"""Planning inside a submodule, for a root whose own forward cannot be captured.

Some models check their inputs by value at the top of ``forward`` (Wav2Vec2ForCTC and
HubertForCTC: ``if labels.max() >= vocab_size: raise``). Neither fx nor torch.export can
capture such code, yet one call below it the model's body is a plain stack of layers. Here
the root's own code runs eagerly and the plan lives inside that body:

1. choose: descend from the root by parameter count to the largest submodule that the
   forward calls and that captures (fx or export): the body holds the activations;
2. its example inputs: run the root's forward on the user's inputs until it calls that
   submodule (a forward pre-hook records the call and stops the run there), so only the
   root's prefix runs, never the un-checkpointed step;
3. plan it with an ordinary :class:`~autockpt.api.Planner` at the user's budget minus what
   lies outside it (parameters, gradients, buffers and inputs outside it, and the gradient
   of its output that the root's backward hands in);
4. verify: measure the root's whole step with the submodule replaced by its plan, and while
   the measured peak exceeds the budget tighten the submodule's budget by the overshoot and
   solve again (the root's own activations, a head and its loss, are learnt this way). The
   stated minimum is the leanest plan's whole step as measured once when planning begins,
   and the leanest plan is always tried before giving up, so that minimum fits.

The result is a new instance of the user's class sharing every parameter, buffer and module
with the original, except the planned submodule, which is replaced by its rewritten module;
the user's model is not changed. docs/design.md ("Planning inside a submodule") gives the
reasons and limits.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.api import Planner, ProgressFn, apply
from autockpt.errors import GIB, AutockptError, InfeasibleBudgetError, PlanMismatchError, TraceError
from autockpt.measure import Measurement, static_bytes
from autockpt.plan import Plan
from autockpt.rewrite import plain_module, shallow_copy
from autockpt.runtime import LossFn, as_found
from autockpt.trace import Inputs, capture, given_input_names

_MAX_CANDIDATES = 8
"""Submodules tried (each a prefix run and a capture) before giving up."""
_VERIFY_ROUNDS = 4


class SubmodulePlanner:
    """Plan ``model`` inside its largest capturing submodule (chosen here) for any budget.

    ``error`` is the root's capture failure; it is raised again when no submodule fits.
    ``inner`` is the submodule's own planner (scope "total", default loss: the sum of the
    submodule's floating outputs, whose gradient has the shape the real step gives it).
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Inputs,
        error: TraceError,
        *,
        scope: str,
        loss_fn: LossFn | None,
        leaf_modules: Iterable[str],
        max_stages: int,
        progress: ProgressFn,
        measure_step: Callable[[nn.Module], Measurement],
    ) -> None:
        self.model, self.inputs, self.error = model, inputs, error
        self.scope, self.loss_fn, self.measure_step = scope, loss_fn, measure_step
        leaves = tuple(leaf_modules)
        progress("choosing a submodule to plan inside (the root's forward cannot be captured)")
        started = time.perf_counter()
        self.path, self.child_inputs = choose_submodule(model, inputs, leaves, error)
        self.phase_seconds = {"capture": time.perf_counter() - started}
        """Wall seconds of what this planner adds to the submodule's planner's phases."""
        prefix = f"{self.path}."
        self.inner = Planner(
            model.get_submodule(self.path),
            self.child_inputs,
            scope="total",
            leaf_modules=[name.removeprefix(prefix) for name in leaves if name.startswith(prefix)],
            max_stages=max_stages,
            progress=progress,
        )
        # What the submodule's planner does not count, as far as it is known before a
        # measurement: the static part outside it, and its output's gradient (a dense
        # tensor in the real step; the planning loss's is an expanded scalar).
        self.outside_bytes = _outside_bytes(model, inputs, self.path, self.child_inputs)
        self.outside_bytes += self.inner.profile.output_bytes
        # scope="activations" budgets what lies above the whole model's static part
        self.static_bytes = (
            0
            if scope == "total"
            else (static_bytes(model, inputs) + _gradient_bytes(model.parameters()))
        )
        self.no_checkpoint_peak_bytes = self._scoped(self.inner.no_checkpoint_peak_bytes)
        self.breakdown = {
            f"outside '{self.path}' (static, and its output's gradient)": self.outside_bytes,
            **{f"{name} of '{self.path}'": nbytes for name, nbytes in self.inner.breakdown.items()},
        }
        # The root's own activations (a head, its loss) are not predicted, so the whole
        # step's minimum is the leanest plan's measured step (its own step: it fits where
        # the plan fits), or its prediction where that is higher.
        progress("measuring the leanest plan's whole step")
        started = time.perf_counter()
        leanest, _ = self._solve(self.inner.minimum_peak_bytes, "auto", 30.0)
        self.leanest_measured_bytes = measure_step(leanest).peak_bytes - self.static_bytes
        self.phase_seconds["verify"] = time.perf_counter() - started
        self.minimum_peak_bytes = max(
            self._scoped(self.inner.minimum_peak_bytes), self.leanest_measured_bytes
        )

    def _scoped(self, child_bytes: int) -> int:
        """A whole-step prediction in the user's scope from the submodule's prediction."""
        return child_bytes + self.outside_bytes - self.static_bytes

    def _solve(
        self, child_budget: int, solver: str, time_limit_s: float, selective: bool = True
    ) -> tuple[nn.Module, Plan]:
        """The root with the submodule planned for ``child_budget`` bytes, and that plan."""
        budget_gb = child_budget / GIB
        while int(budget_gb * GIB) < child_budget:  # float GiB must not round bytes down
            budget_gb = math.nextafter(budget_gb, math.inf)
        child = self.inner.optimize(
            budget_gb=budget_gb, solver=solver, time_limit_s=time_limit_s, verify=False,
            selective=selective,
        )
        return replace_submodule(self.model, self.path, child), child.plan

    def optimize(
        self, budget_bytes: int, *, solver: str, time_limit_s: float, verify: bool,
        selective: bool = True,
    ) -> nn.Module:
        """Plan the submodule so that the root's whole step fits ``budget_bytes`` (in the
        user's scope); measure the step to check (``verify``), like Planner.optimize. The
        leanest plan, measured to fit the minimum, is always tried before giving up."""
        if budget_bytes < self.minimum_peak_bytes:
            raise self._infeasible(budget_bytes, self.minimum_peak_bytes)
        leanest = self.inner.minimum_peak_bytes
        underestimate = 0  # what the measured whole step exceeded the prediction by, at most
        checked: Measurement | None = None
        for round_ in range(_VERIFY_ROUNDS):
            child_budget = budget_bytes + self.static_bytes - self.outside_bytes - underestimate
            if round_ == _VERIFY_ROUNDS - 1:
                child_budget = leanest
            result, plan = self._solve(
                max(child_budget, leanest), solver, time_limit_s, selective
            )
            if not verify:
                break
            checked = self.measure_step(result)  # the root's whole step, memory only
            used = checked.peak_bytes - self.static_bytes
            if used <= budget_bytes:
                break
            underestimate = max(underestimate + 1, used - self._scoped(plan.predicted_peak_bytes))
        else:  # the leanest plan measured more than when planning began
            raise self._infeasible(budget_bytes, max(used, budget_bytes + 1))
        result.plan = self._plan(plan, budget_bytes, checked)
        return result

    def _infeasible(self, budget_bytes: int, minimum: int) -> InfeasibleBudgetError:
        hint = (
            f"The root's forward runs eagerly and the plan is inside '{self.path}': the "
            "minimum is the whole step of that submodule's leanest plan, as measured "
            f"({self.leanest_measured_bytes} bytes) or predicted, whichever is higher."
        )
        return InfeasibleBudgetError(budget_bytes, minimum, self.breakdown, self.scope, hint)

    def _plan(self, inner: Plan, budget_bytes: int, checked: Measurement | None) -> Plan:
        """The submodule's plan restated for the whole step (docs/plan-schema.md)."""
        shift = self._scoped(0)
        parameters = list(self.model.parameters())
        notes = (
            *inner.notes,
            f"the root's forward has data-dependent control flow ({self.error.location}: "
            f"`{self.error.source_line}`) and runs eagerly; segments are inside "
            f"'{self.path}'",
            f"predicted peaks are the whole step's: the prediction for '{self.path}' plus "
            f"{self.outside_bytes} bytes outside it (parameters, gradients, buffers and inputs "
            f"outside '{self.path}', and the gradient of its output that the root's backward "
            "hands in); the root's own activations are not predicted but measured",
        )
        timeline = inner.timeline
        if timeline is not None:
            timeline = dataclasses.replace(
                timeline,
                plan_bytes=tuple(max(0, b + shift) for b in timeline.plan_bytes),
                no_checkpoint_bytes=tuple(max(0, b + shift) for b in timeline.no_checkpoint_bytes),
            )
        return dataclasses.replace(
            inner,
            model=type(self.model).__name__,
            input_signature=self.inputs.signature(),
            input_names=given_input_names(self.model, self.inputs),
            budget_bytes=budget_bytes,
            scope=self.scope,
            predicted_peak_bytes=inner.predicted_peak_bytes + shift,
            no_checkpoint_peak_bytes=inner.no_checkpoint_peak_bytes + shift,
            minimum_peak_bytes=self.minimum_peak_bytes,
            memory=dataclasses.replace(
                inner.memory,
                parameters=sum(p.nbytes for p in parameters),
                gradients=_gradient_bytes(parameters),
                buffers=sum(b.nbytes for b in self.model.buffers()),
                inputs=sum(t.nbytes for t in self.inputs.tensors()),
            ),
            # the whole step's total, as in every plan (the scope's part is the report's)
            measured_peak_bytes=checked.peak_bytes if checked is not None else None,
            measured_step_seconds=None,
            notes=notes,
            timeline=timeline,
            submodule=self.path,
        )


def choose_submodule(
    model: nn.Module, inputs: Inputs, leaf_modules: tuple[str, ...], error: TraceError
) -> tuple[str, Inputs]:
    """The submodule holding the most parameters among those the forward calls and that
    capture, with the inputs the root calls it with; raises ``error`` when there is none.

    Candidates are visited largest first (ties in registration order); a submodule that is
    not called or does not capture gives way to its own children. A user's leaf module is
    run as one opaque call, so it is neither planned inside nor descended into.
    """
    order = {name: k for k, (name, _) in enumerate(model.named_modules())}
    frontier: list[tuple[int, int, str]] = []

    def push_children(path: str) -> None:
        for name, child in model.get_submodule(path).named_children():
            qualified = f"{path}.{name}" if path else name
            if qualified in order and qualified not in leaf_modules:
                count = sum(p.numel() for p in child.parameters())
                heapq.heappush(frontier, (-count, order[qualified], qualified))

    push_children("")
    for _ in range(_MAX_CANDIDATES):
        if not frontier or frontier[0][0] == 0:
            break
        _, _, path = heapq.heappop(frontier)
        found = submodule_inputs(model, path, inputs)
        if found is not None and _captures(model, path, found, leaf_modules):
            return path, found
        push_children(path)
    raise error


def _captures(model: nn.Module, path: str, inputs: Inputs, leaf_modules: tuple[str, ...]) -> bool:
    prefix = f"{path}."
    leaves = [name.removeprefix(prefix) for name in leaf_modules if name.startswith(prefix)]
    try:  # a result of optimize is planned from the user's module it was made from
        capture(plain_module(model.get_submodule(path)), inputs, leaf_modules=leaves)
    except (AutockptError, TypeError):
        return False
    return True


class _Reached(BaseException):
    """Raised by the pre-hook once the submodule's call is recorded: the run stops there.
    A BaseException (like GeneratorExit), so a forward's ``except Exception`` around the
    call cannot swallow it and run on into the un-checkpointed step."""


def submodule_inputs(model: nn.Module, path: str, inputs: Inputs) -> Inputs | None:
    """The ``(args, kwargs)`` of the root's first call of the submodule at ``path``, from a
    run of the root's forward that stops at that call (``None``: the forward never calls it).

    Tensors are detached, keeping the ``requires_grad`` they had, so the submodule is planned
    for the gradients the real step asks of it. The model, the inputs and every random
    generator are left as found (:func:`autockpt.runtime.as_found`): the prefix may draw
    dropout masks, move statistics or count steps.
    """
    recorded: list[Inputs] = []

    def detached(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(t.requires_grad)

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        recorded.append(
            Inputs(
                pytree.tree_map_only(torch.Tensor, detached, tuple(args)),
                pytree.tree_map_only(torch.Tensor, detached, dict(kwargs)),
            )
        )
        raise _Reached

    # first among the hooks: the replacement module, which has none, is called with these
    handle = model.get_submodule(path).register_forward_pre_hook(
        record, with_kwargs=True, prepend=True
    )
    try:
        with as_found(model, inputs):
            model(*inputs.args, **inputs.kwargs)
    except _Reached:
        pass
    finally:
        handle.remove()
    return recorded[0] if recorded else None


def replace_submodule(model: nn.Module, path: str, replacement: nn.Module) -> nn.Module:
    """A new instance of ``model``'s class sharing everything with it but the module at
    ``path``, which is ``replacement``. The root and each module on the way to ``path`` are
    shallow copies with their own registries (so the user's tree is not changed); their
    parameters, buffers and other children are the user's own objects."""
    root = shallow_copy(model)
    parent = root
    *ancestors, name = path.split(".")
    for part in ancestors:
        clone = shallow_copy(parent._modules[part])
        parent._modules[part] = clone
        parent = clone
    parent._modules[name] = replacement
    return root


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
    result = replace_submodule(model, path, apply(child, inner, found))
    result.plan = plan
    return result


def _outside_bytes(model: nn.Module, inputs: Inputs, path: str, child_inputs: Inputs) -> int:
    """Bytes of the whole step's static part (distinct storages of parameters, buffers and
    inputs, plus parameter gradients) that the submodule's own step does not hold."""
    child = model.get_submodule(path)

    def storages(tensors: Iterable[torch.Tensor]) -> dict[tuple[str, int], int]:
        return {
            (str(t.device), t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
            for t in tensors
            if t.device.type != "meta"
        }

    whole = storages([*model.parameters(), *model.buffers(), *inputs.tensors()])
    inner = storages([*child.parameters(), *child.buffers(), *child_inputs.tensors()])
    inside = {id(p) for p in child.parameters()}
    outside_parameters = [p for p in model.parameters() if id(p) not in inside]
    return sum(n for key, n in whole.items() if key not in inner) + _gradient_bytes(
        outside_parameters
    )


def _gradient_bytes(parameters: Iterable[nn.Parameter]) -> int:
    return sum(p.nbytes for p in parameters if p.requires_grad)

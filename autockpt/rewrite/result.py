"""Stage 6 — the user's model back: the class of the result, its forward and its copies.

Rules the result keeps (and why):

* It is an instance of the user's own class (a generated subclass, like FSDP2's
  ``fully_shard``): a shallow copy of the user's module sharing its parameters, buffers,
  children and attributes, with registries of its own, so the user's model is left as
  found. ``state_dict()`` keys and ``parameters()`` order are unchanged, so optimizers,
  saved checkpoints and FSDP/DDP wrapping keep working, ``.to()`` moves the one copy of
  every tensor, and the class's own methods (``save_pretrained``, ``generate``) are there.
* Its ``forward`` has the original's signature. Calls the plan covers (training mode,
  autograd on, the planned arguments, tensors no larger than planned) run the captured
  graph; every other call runs the original forward on the same tree (see :func:`_forward`).
* Each checkpointed segment is a parameter-free ``CheckpointSegment`` held as a plain
  attribute ``_autockpt_segment_<k>`` (not a registered child: ``named_modules()`` stays the
  user's) whose code resolves attributes against the live root module at call time (never
  against copies), called through ``checkpoint(..., use_reentrant=False)``.
* It pickles as the plain model plus its plan and is rebuilt on load by re-applying the
  plan (NOTE [rewrite: rebuild on load]); ``copy.deepcopy`` copies the tree and re-binds
  the segments to the copy.
* RNG state is preserved only for segments with random ops (dropout), so recomputed masks
  equal the forward's and outputs and gradients equal eager's. A segment that runs the
  user's own Python (a leaf module) also replays Python's and NumPy's generators when its
  forward drew from them (``_PythonRng``, ``autockpt/rewrite/segment.py``): checkpoint
  preserves torch's only.
* Buffers that the forward mutates or replaces (batch-norm running statistics, counters,
  a table built on the first call) are snapshotted (object and values) when a segment runs
  forward; its recompute runs on those and puts the current ones back afterwards, so they
  advance once per step and read as in the forward.
* Without autograd (``torch.no_grad()``), segments run plainly: there is nothing to save.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import re
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autockpt.base.inputs import Inputs, without_defaults
from autockpt.base.precision import Precision, planned_precision
from autockpt.base.precision import check_call as check_precision
from autockpt.base.tree import ModuleTree, check_tree
from autockpt.errors import (
    AutockptError,
    CompileWarning,
    LargerInputWarning,
    PlanMismatchError,
    PrecisionWarning,
    UncoveredCallWarning,
)
from autockpt.plan import Plan
from autockpt.rewrite.segment import CheckpointSegment

_STATE = "_autockpt"
"""Instance attribute holding a result's :class:`_Checkpointing` (its plan, graph code and
checks); its presence is what makes a module a checkpointed result."""


ON_LARGER_INPUT = ("error", "warn")
"""What a result does with a training call whose tensors are larger than planned."""

ON_PRECISION_CHANGE = ("replan", "warn", "raise")
"""What a result does with a training call in another precision than planned (NOTE
[rewrite: precision change])."""

_SETTINGS = {"on_larger_input": ON_LARGER_INPUT, "on_precision_change": ON_PRECISION_CHANGE}


# nn.Module's own registries and hook tables: a shallow copy gets its own, so that adding a
# parameter, a child or a hook to the result leaves the user's module as it was.
_REGISTRIES = tuple(
    name for name, value in vars(nn.Module()).items() if isinstance(value, (dict, set))
)


@dataclass(frozen=True)
class CallShape:
    """How the forward is called: the parameters a call gives (positional ones by their
    names, ``**kwargs`` entries by key, sorted) and, for each, the shape and dtype of every
    tensor in it."""

    names: tuple[str, ...]
    tensors: tuple[tuple[tuple[tuple[int, ...], torch.dtype], ...], ...]

    def describe(self) -> str:
        return ", ".join(
            name
            + "".join(
                f" {list(shape)}:{str(dtype).removeprefix('torch.')}" for shape, dtype in tensors
            )
            for name, tensors in zip(self.names, self.tensors, strict=True)
        )


@dataclass(eq=False)
class _Checkpointing:
    """What a result knows beyond the user's module: the graph's code and when to run it."""

    code: Callable[..., Any]
    captured_training: bool
    # fx graphs are; export graphs are where export kept sizes dynamic (Capture.shape_generic)
    shape_generic: bool
    signature: inspect.Signature | None
    planned: CallShape | None
    input_check: Callable[[tuple, dict], None] | None
    attributes: tuple[str, ...]  # instance attributes the result adds to the user's module
    plan: Plan | None = None
    on_larger_input: str = "error"
    # Keys of what was said: plain values only (strings, ints, tuples, dtypes). The call
    # checks pass the set to functions torch.compile runs at trace time, which rebuild it
    # from its items and cannot rebuild a frozen dataclass (precision.py, Precision.key).
    warned: set[Any] = dataclasses.field(default_factory=set)
    tree: ModuleTree | None = None  # the modules the graph was captured from (tree.py)
    exported: bool = False  # a torch.export graph: specialised to the planned precision
    # How an unpickled result is made again from its plan (NOTE [rewrite: rebuild on load]):
    # given by whoever makes a result for a plan (autockpt.rewrite.apply), which this module
    # cannot import (that one captures and rewrites, and so imports this one).
    rebuild: Callable[[nn.Module, Plan, bool, str], nn.Module] | None = None
    # How a result plans again for a call in another precision, from that call's arguments
    # (NOTE [rewrite: precision change]): given by the front door that planned it, which
    # this module cannot import; None for results made from a saved plan.
    replan: Callable[[nn.Module, tuple, dict], nn.Module] | None = None
    on_precision_change: str = "replan"
    # The plans of the other precisions this result has run (NOTE [rewrite: precision
    # change]), by Precision.key: each one's state and the attributes its code reads. One
    # dict per result, handed from state to state as plans switch.
    by_precision: dict[Any, tuple[_Checkpointing, dict[str, Any]]] = dataclasses.field(
        default_factory=dict
    )

    def __deepcopy__(self, memo: dict[int, Any]) -> _Checkpointing:
        # Code, signature, checks and plan are immutable; only what was warned about is
        # the copy's own. The other precisions' plans are not copied: their segments are
        # bound to the original (a copy plans again for another precision).
        return dataclasses.replace(self, warned=set(self.warned), by_precision={})

    def warn_once(
        self,
        key: Any,
        message: str,
        stacklevel: int,
        category: type[UserWarning] = UncoveredCallWarning,
    ) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, category, stacklevel=stacklevel + 1)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` is a model returned by ``optimize``/``apply``/``rewrite``."""
    return _STATE in vars(module)


def plain_module(module: nn.Module) -> nn.Module:
    """The model a result was made from, as a plain instance of the user's class sharing
    everything with the result (tree, registries, attributes, mode) but what checkpointing
    added; ``module`` itself when it is not a result. What is pickled, and what planning
    again starts from (capturing the result would plan a plan)."""
    state: _Checkpointing | None = vars(module).get(_STATE)
    if state is None:
        return module
    plain = object.__new__(type(module)._autockpt_base)
    skip = {_STATE, *state.attributes}
    vars(plain).update({k: v for k, v in vars(module).items() if k not in skip})
    return plain


def segments_of(module: nn.Module) -> dict[str, CheckpointSegment]:
    """The checkpoint segments of a result, by attribute name, in graph order (they are
    plain attributes, not registered children, so ``named_modules()`` does not list them)."""
    return {
        name: value for name, value in vars(module).items() if isinstance(value, CheckpointSegment)
    }


_CLASSES: dict[type, type] = {}


def _checkpointed_class(base: type) -> type:
    """The subclass of ``base`` that results of ``base`` models are instances of (one per
    class, like FSDP2's ``FSDP<Name>``). It keeps ``base``'s name, module and qualified
    name: libraries record the class name (Hugging Face writes it to ``config.architectures``
    on ``save_pretrained`` and its Trainer's label smoothing picks the causal-LM loss by
    ``_get_name()``), and a renamed class would be saved, or trained, as another model."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = types.new_class(
            base.__name__, (base,), exec_body=functools.partial(_class_body, base)
        )
        _CLASSES[base] = cls
    return cls


def _class_body(base: type, namespace: dict[str, Any]) -> None:
    @functools.wraps(base.forward)  # the original signature, for inspect.signature and HF
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _forward(self, base, args, kwargs)

    namespace.update(
        __module__=base.__module__,
        __qualname__=base.__qualname__,
        __doc__=base.__doc__,
        forward=forward,
        plan=property(_get_plan, _set_plan, doc="The :class:`~autockpt.Plan` applied."),
        on_larger_input=_setting(
            "on_larger_input",
            'What a training call with tensors larger than planned does: "error" (default) '
            'raises PlanMismatchError, "warn" warns once per shape and runs the graph.',
        ),
        on_precision_change=_setting(
            "on_precision_change",
            "What a training call in another precision than planned does (autocast, "
            'parameter dtypes): "replan" (default) plans again for it within the same '
            'budget, "warn" runs the old plan and warns (an export graph raises), '
            '"raise" raises PlanMismatchError.',
        ),
        __reduce_ex__=_reduce_ex,
        __deepcopy__=_deepcopy,
        __copy__=_copy,
        _autockpt_base=base,
    )


def _forward(self: nn.Module, base: type, args: tuple, kwargs: dict) -> Any:
    """Run the checkpointed graph for the calls the plan covers, the original forward for
    every other one, on the same tree.

    The graph is used only in the mode it was captured in (capture baked mode-dependent
    branches in, ``training=self.training``) and only with autograd on (without it there is
    nothing to save, and eager's forward is exact). A training call that gives other
    arguments than planned (no ``labels``, an extra ``attention_mask``, the
    ``num_items_in_batch`` a Trainer adds) cannot run a graph traced without them: it runs
    the original forward, and says so once per argument set, since it then is neither
    checkpointed nor within the budget. Larger tensors than planned run an fx graph
    correctly but not within the budget: ``on_larger_input`` decides (error by default).
    """
    state: _Checkpointing | None = vars(self).get(_STATE)
    if state is None or self.training != state.captured_training or not torch.is_grad_enabled():
        return base.forward(self, *args, **kwargs)
    # A module replaced after planning (LoRA adapters) would be bypassed by the graph, and
    # another precision changes its memory: autockpt/base/tree.py, autockpt/base/precision.py.
    check_tree(self, state.tree)
    if state.on_precision_change == "replan" and state.replan is not None:
        state = _replanned_if_needed(self, state, args, kwargs)
    check_precision(
        self, state.plan, state.exported or state.on_precision_change == "raise", state.warned
    )
    if torch.compiler.is_compiling():
        budget = state.plan.budget_bytes if state.plan is not None else None
        _warn_if_compiled_unverified(state.code, state.warned, type(self).__name__, budget)
    elif state.plan is not None and state.plan.compile_memory_budget is not None:
        # NOTE [compiled: partitioner budgets]: no segments, the partitioner recomputes;
        # run eagerly (dynamo gave up on it) the step checkpoints nothing
        state.warn_once(
            "ran eagerly",
            (
                f"{type(self).__name__}'s plan leaves recompute to torch.compile's partitioner "
                f"(activation_memory_budget={state.plan.compile_memory_budget:g}), but this "
                "training call runs eagerly: it checkpoints nothing and is not within the "
                f"budget ({state.plan.budget_bytes} bytes). Dynamo ran it without compiling "
                "(its recompile limit reached, torch.compiler.disable, or an eager call of "
                "the module inside); torch._dynamo.reset() and a fresh call compile it again "
                "(docs/integrations.md, torch.compile)"
            ),
            stacklevel=5,
            category=CompileWarning,
        )
    given = without_defaults(state.signature, kwargs)  # the call as the graph knows it
    if state.planned is not None:
        call = _call_shape(state.signature, args, given)
        if call is None:  # not a valid call: the original forward says why
            return base.forward(self, *args, **kwargs)
        if call.names != state.planned.names:
            state.warn_once(
                ("names", call.names),
                (
                    f"{type(self).__name__} called in training with ({', '.join(call.names)}) "
                    "runs un-checkpointed, outside the plan's budget: the plan covers calls with "
                    f"({', '.join(state.planned.names)}); plan with these inputs to checkpoint them"
                ),
                stacklevel=5,
            )  # the caller of model(...)
            return base.forward(self, *args, **kwargs)
        if state.input_check is not None:  # export's own guards name the failing dimension
            state.input_check(args, given)
        _check_size(self, state, call)
    elif state.input_check is not None:
        state.input_check(args, given)
    return state.code(self, *args, **given)


# NOTE [rewrite: precision change]. A plan is made for one precision (autocast around the
# call, parameter dtypes), and Hugging Face's ``Trainer(bf16=True)`` trains a model planned
# in float32 under ``torch.autocast(bfloat16)``. Another precision changes every activation's
# size, so the plan's budget no longer describes the step. A result that the front door
# planned (it holds ``replan``) plans again, once per precision, from the arguments of the
# first call in that precision (a real batch, shaped like the ones that follow), within the
# same budget and options, and takes the new plan's graph and segments in place: the user's
# object stays the same, ``result.plan`` is the new plan, and a warning says so. The planner
# gets the plain model (:func:`plain_module`), never the result, and runs under the call's
# own autocast context, so it sees the precision the call runs in. Every plan a result has
# run is kept, one per precision (``by_precision``): a call in a precision planned before
# switches back to that plan (its graph, segments and state), without planning or warning,
# so a model trained in two precisions (float32 and bfloat16 autocast calls alternating)
# plans once per precision, not on every switch (it did: 8-41 s a switch on a ViT). The
# switch is also made inside a ``torch.compile`` trace, which guards on the precision: a
# compiled call in a precision planned before runs that plan (it raised PlanMismatchError
# after a call in another precision had switched the result away from it). A precision not
# planned yet is not planned inside a trace: the check warns or raises as before.
# ``on_precision_change``: "replan" (default), "warn" (an fx graph runs the old plan and
# warns once per precision, an export graph raises: the behaviour before re-planning),
# "raise" (PlanMismatchError for every graph); only "replan" switches between kept plans.
def _replanned_if_needed(
    self: nn.Module, state: _Checkpointing, args: tuple, kwargs: dict
) -> _Checkpointing:
    if state.plan is None or (torch.compiler.is_compiling() and not state.by_precision):
        return state  # inside a trace only a switch to a kept plan is made
    planned = planned_precision(state.plan)
    current = Precision.now(self)
    if planned is None or planned == current:
        return state
    if current.key() in state.by_precision:
        return _switch_plan(self, state, current)
    if torch.compiler.is_compiling():
        return state
    warnings.warn(
        f"{type(self).__name__} was planned with {planned.describe()}; this call runs with "
        f"{current.describe()}: planning again for it, within the same budget "
        f"({state.plan.budget_bytes} bytes). result.plan is the new plan; set "
        "result.on_precision_change = 'raise' to refuse other precisions instead",
        PrecisionWarning,
        stacklevel=5,
    )
    try:
        again = state.replan(self, args, kwargs)
    except AutockptError as error:
        error.add_note(
            f"(raised planning {type(self).__name__} again for {current.describe()}: "
            "plan for this precision yourself, or set on_precision_change='warn' to run "
            "the old plan)"
        )
        raise
    adopt(self, again)
    return vars(self)[_STATE]


def set_precision_change(
    module: nn.Module,
    on_precision_change: str,
    replan: Callable[[nn.Module, tuple, dict], nn.Module],
) -> None:
    """Give a result the front door made its precision-change rule and how to plan again
    (NOTE [rewrite: precision change]). A plan inside a submodule is not re-planned there
    (its budget is the whole model's): such results keep the rule, without ``replan``."""
    state: _Checkpointing | None = vars(module).get(_STATE)
    if state is None:
        return
    state.on_precision_change = on_precision_change
    if state.plan is not None and state.plan.submodule is None:
        state.replan = replan


_UNITS_REPLAN = "_autockpt_units_replan"
"""The attribute of a result of units (a root not captured whole) holding its re-plan."""


def watch_units_precision(
    result: nn.Module, replan: Callable[[tuple, dict], nn.Module], on_precision_change: str
) -> None:
    """NOTE [rewrite: precision change] for a result of units (autockpt/planning/nested.py):
    its root is a shallow copy of the user's class, not a generated class, so a forward
    pre-hook checks each training call's precision against the plan's. In another
    precision, "replan" plans the whole step again from that call (``replan(args, kwargs)``,
    a new result of units) and takes its units in place before the call runs; "raise"
    refuses; "warn" leaves each unit's own check to warn. ``result.on_precision_change``
    switches the rule later."""
    watched = _UNITS_REPLAN in vars(result)  # the front door re-watches the planner's result
    vars(result)["on_precision_change"] = on_precision_change
    vars(result)[_UNITS_REPLAN] = replan
    if not watched:
        result.register_forward_pre_hook(_units_precision_hook, with_kwargs=True)


def _units_precision_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if not module.training or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    plan = vars(module).get("plan")
    planned = planned_precision(plan) if plan is not None else None
    current = Precision.now(module)
    rule = vars(module).get("on_precision_change", "replan")
    check_setting("on_precision_change", rule)
    if planned is None or planned == current or rule == "warn":
        return
    if rule == "raise":
        raise PlanMismatchError(
            f"{type(module).__name__} was planned with {planned.describe()}; this call runs "
            f"with {current.describe()} (on_precision_change='raise')"
        )
    warnings.warn(
        f"{type(module).__name__} was planned with {planned.describe()}; this call runs with "
        f"{current.describe()}: planning its units again for it, within the same budget "
        f"({plan.budget_bytes} bytes). result.plan is the new plan; set "
        "result.on_precision_change = 'raise' to refuse other precisions instead",
        PrecisionWarning,
        stacklevel=4,
    )
    again = vars(module)[_UNITS_REPLAN](args, kwargs)
    # the new units in place: the tree the forward walks, and the plan
    vars(module)["_modules"] = vars(again)["_modules"]
    vars(module)["plan"] = again.plan


def adopt(target: nn.Module, source: nn.Module) -> None:
    """Make ``target`` (a result) run ``source``'s plan: its graph, segments (bound to
    ``target``) and state, ``target``'s own settings and warnings kept. Both share the tree
    (``source`` was planned from ``target``'s plain model). The plan ``target`` ran is kept
    for its precision (NOTE [rewrite: precision change])."""
    old: _Checkpointing = vars(target)[_STATE]
    new: _Checkpointing = vars(source)[_STATE]
    by_precision = _keep_running_plan(target, old)
    _take_attributes(target, old, {name: vars(source)[name] for name in new.attributes})
    vars(target)[_STATE] = dataclasses.replace(
        new,
        on_larger_input=old.on_larger_input,
        on_precision_change=old.on_precision_change,
        warned=old.warned | new.warned,
        by_precision=by_precision,
    )


def _switch_plan(self: nn.Module, state: _Checkpointing, current: Precision) -> _Checkpointing:
    """Make ``self`` run the plan it kept for ``current`` (NOTE [rewrite: precision change]),
    keeping the plan it ran for that plan's precision; ``self``'s settings and warnings
    go with it."""
    by_precision = _keep_running_plan(self, state)
    kept, attributes = by_precision.pop(current.key())
    _take_attributes(self, state, attributes)
    switched = dataclasses.replace(
        kept,
        on_larger_input=state.on_larger_input,
        on_precision_change=state.on_precision_change,
        warned=state.warned,
        by_precision=by_precision,
        replan=state.replan if state.replan is not None else kept.replan,
    )
    vars(self)[_STATE] = switched
    return switched


def _keep_running_plan(
    module: nn.Module, state: _Checkpointing
) -> dict[Any, tuple[_Checkpointing, dict[str, Any]]]:
    """``state.by_precision`` with the plan ``module`` runs now kept for its precision
    (a plan that does not record one is not kept)."""
    planned = planned_precision(state.plan) if state.plan is not None else None
    if planned is not None:
        attributes = {name: vars(module)[name] for name in state.attributes if name in vars(module)}
        state.by_precision[planned.key()] = (state, attributes)
    return state.by_precision


def _take_attributes(module: nn.Module, old: _Checkpointing, attributes: dict[str, Any]) -> None:
    """Replace the attributes ``old``'s code read on ``module`` with ``attributes``,
    segments bound to ``module``."""
    for name in old.attributes:
        vars(module).pop(name, None)
    for name, value in attributes.items():
        object.__setattr__(module, name, value)
        if isinstance(value, CheckpointSegment):
            value.bind(module)


_VERIFIED_COMPILED = "verified compiled"
"""The key in a result's ``warned`` set that says its plan is run under the
``torch.compile`` it was planned and verified with (:func:`mark_verified_compiled`)."""


COMPILED_OVERSHOOT = "from 13% under to 25% over"
"""How far compiled steps of plans verified eagerly were measured from their budget
(docs/integrations.md, "torch.compile"), for the :class:`CompileWarning`."""


def mark_verified_compiled(module: nn.Module) -> None:
    """Say that every optimized model in ``module``'s tree is handed back under the
    ``torch.compile`` its plan is verified with (``optimize(torch.compile(model), ...)``):
    tracing it is expected and does not warn. Copies (``copy.deepcopy``) keep the mark."""
    for found in module.modules():
        state: _Checkpointing | None = vars(found).get(_STATE)
        if state is not None:
            state.warned.add(_VERIFIED_COMPILED)


@torch.compiler.assume_constant_result
def _warn_if_compiled_unverified(
    code: Callable[..., Any], warned: set[Any], name: str, budget_bytes: int | None
) -> bool:
    """Warn, once per generated code (one plan of one model), that ``torch.compile`` is
    tracing a result whose plan was verified for eager steps only; whether it warned is the
    (constant) result.

    Under ``torch.compile`` it runs once per trace, outside the graph, on copies of its
    arguments: the mark of a result verified compiled is read from its ``warned`` set, but
    what was said is kept here, by the graph's code (shared by the results of one plan,
    :func:`_code`, and guarded by dynamo already). It never takes the module: a module
    passed to a function dynamo runs at trace time is guarded by identity, so every result
    of the class would be traced again."""
    if _VERIFIED_COMPILED in warned or code in _WARNED_COMPILED:
        return False
    _WARNED_COMPILED.add(code)
    budget = f"its budget ({budget_bytes} bytes)" if budget_bytes is not None else "its plan"
    warnings.warn(
        f"torch.compile is tracing an optimized {name}; {budget} was verified for eager "
        "steps only. A compiled step keeps other tensors than the eager one (what the "
        "compiled backward saves outside the checkpointed segments, zero gradients for "
        "outputs the loss does not use), and compiled steps of eagerly verified plans were "
        f"measured {COMPILED_OVERSHOOT} their budgets. To have the budget hold for the "
        "compiled step, compile first: autockpt.optimize(torch.compile(model), ...) plans "
        "and verifies the compiled step",
        CompileWarning,
        stacklevel=2,
    )
    return True


_WARNED_COMPILED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
"""The generated codes (plans) whose compiled trace has warned."""


def _check_size(self: nn.Module, state: _Checkpointing, call: CallShape) -> None:
    planned = state.planned
    assert planned is not None
    if not state.shape_generic:
        if call.tensors != planned.tensors:
            raise PlanMismatchError(
                f"this optimized {type(self).__name__} was planned for inputs "
                f"({planned.describe()}) and its graph is specialised to them; got "
                f"({call.describe()}). Give batches of that shape (e.g. drop_last=True) or "
                "plan again for this one"
            )
        return
    if not _exceeds(call, planned):
        return
    if state.on_larger_input == "warn":
        state.warn_once(
            ("larger", call.tensors),
            (
                f"{type(self).__name__} called in training with ({call.describe()}), larger "
                f"than planned ({planned.describe()}): it runs the plan, but the step's peak "
                "memory may exceed the budget"
            ),
            stacklevel=6,
            category=LargerInputWarning,
        )
        return
    raise PlanMismatchError(
        f"this optimized {type(self).__name__} was planned for inputs ({planned.describe()}) "
        f"and its budget holds for those sizes; this call gives ({call.describe()}), which "
        "is larger, so the step's peak memory could exceed the budget. Give batches no "
        "larger than planned, plan again for the largest batch, or set "
        "`model.on_larger_input = 'warn'` to run it anyway"
    )


def _exceeds(call: CallShape, planned: CallShape) -> bool:
    """Whether any tensor of ``call`` is larger than its planned counterpart in some
    dimension or in element size (or the tensors do not correspond at all)."""
    for got, want in zip(call.tensors, planned.tensors, strict=True):
        if len(got) != len(want):
            return True
        for (shape, dtype), (planned_shape, planned_dtype) in zip(got, want, strict=True):
            if len(shape) != len(planned_shape) or dtype.itemsize > planned_dtype.itemsize:
                return True
            if any(x > y for x, y in zip(shape, planned_shape, strict=True)):
                return True
    return False


def _forward_signature(cls: type) -> inspect.Signature | None:
    """``cls.forward``'s signature without ``self`` (None when it cannot be read)."""
    try:
        signature = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]
    return signature.replace(parameters=params)


def _call_shape(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> CallShape | None:
    """The :class:`CallShape` of ``forward(*args, **kwargs)`` (None: not a valid call). A
    keyword argument passed as its very default object (``attention_mask=None``) counts as
    not given: the forward cannot tell the two apart (:func:`autockpt.capture.without_defaults`)."""
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **without_defaults(signature, kwargs))  # idempotent
    except TypeError:
        return None
    entries: list[tuple[str, Any]] = []
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            entries += sorted(value.items())
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            entries += [(f"{name}[{i}]", item) for i, item in enumerate(value)]
        else:
            entries.append((name, value))
    return CallShape(
        tuple(name for name, _ in entries),
        tuple(
            tuple(
                (tuple(leaf.shape), leaf.dtype)
                for leaf in torch.utils._pytree.tree_leaves(value)
                if isinstance(leaf, torch.Tensor)
            )
            for _, value in entries
        ),
    )


def shallow_copy(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A new instance of ``cls`` (default: ``module``'s class) sharing everything with
    ``module`` (parameters, buffers, children, attributes such as a config) but the
    registries and hook tables, which are copies: changing the copy's tree leaves the
    user's as found. Given another class, a ``forward`` set on the instance is left out: it
    is bound to the original object."""
    result = object.__new__(cls or type(module))
    state = dict(vars(module))
    if cls is not None:
        state.pop("forward", None)
    for name in _REGISTRIES:
        if name in state:
            state[name] = copy.copy(state[name])
    vars(result).update(state)
    return result


def _get_plan(self: nn.Module) -> Plan | None:
    return vars(self)[_STATE].plan


def _set_plan(self: nn.Module, plan: Plan | None) -> None:
    vars(self)[_STATE].plan = plan


def check_setting(name: str, value: str) -> None:
    """A result's setting (``on_larger_input``, ``on_precision_change``) is one of its
    choices, or :class:`ValueError` naming them."""
    choices = _SETTINGS[name]
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _setting(name: str, doc: str) -> property:
    """The result's property ``name``: kept in its state, checked when set."""

    def get(self: nn.Module) -> str:
        return getattr(vars(self)[_STATE], name)

    def set_(self: nn.Module, value: str) -> None:
        check_setting(name, value)
        setattr(vars(self)[_STATE], name, value)

    return property(get, set_, doc=doc)


def _deepcopy(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A full copy: every tensor, module and attribute copied, the segments with them and
    bound to the copy (their root is in the same memo), the plan shared."""
    copied = object.__new__(type(self))
    memo[id(self)] = copied
    for name, value in vars(self).items():
        vars(copied)[name] = copy.deepcopy(value, memo)
    return copied


def _copy(self: nn.Module) -> nn.Module:
    """A shallow copy, as ``copy.copy`` makes of any module (the same registries)."""
    copied = object.__new__(type(self))
    vars(copied).update(vars(self))
    return copied


def _reduce_ex(self: nn.Module, protocol: Any) -> tuple[Any, ...]:
    """Pickle as the plain model plus the plan; loading re-applies the plan.

    NOTE [rewrite: rebuild on load]: the generated class and the graph's code are not
    picklable, and need not be: the plan rebuilds them, checked against the model's graph
    again (``autockpt.rewrite.apply._rebuild``, which the result holds in its state)."""
    state: _Checkpointing = vars(self)[_STATE]
    if state.plan is None or state.rebuild is None:
        raise TypeError(
            f"this checkpointed {type(self).__name__} was made by rewrite() without a plan, "
            "so it cannot be rebuilt on load; pickle a model from autockpt.optimize or "
            "autockpt.apply, or the original model"
        )
    return state.rebuild, (
        plain_module(self),
        state.plan,
        state.captured_training,
        state.on_larger_input,
    )


_TENSOR = re.compile(r"Tensor\[([0-9, ]*)\]:(\w+)")


def inputs_like(signature: str, device: torch.device | str = "meta") -> Inputs:
    """Example inputs as a plan's ``input_signature`` describes them (``Inputs.signature``):
    zero tensors of the recorded shapes and dtypes on ``device``, the recorded plain values.
    Raises ValueError for a signature holding values it cannot rebuild (an object)."""
    try:
        args, kwargs = ast.literal_eval(signature)
    except (ValueError, SyntaxError, TypeError) as error:
        raise ValueError(f"cannot read the input signature {signature!r}: {error}") from None

    def build(leaf: Any) -> Any:
        if not isinstance(leaf, str):
            raise ValueError(f"unexpected {leaf!r} in the input signature {signature!r}")
        match = _TENSOR.fullmatch(leaf)
        if match:
            shape = [int(d) for d in match[1].split(",") if d.strip()]
            return torch.zeros(shape, dtype=getattr(torch, match[2]), device=device)
        try:
            return ast.literal_eval(leaf)
        except (ValueError, SyntaxError):
            raise ValueError(
                f"the input signature {signature!r} records a {leaf} object, which cannot "
                "be rebuilt from it"
            ) from None

    tree_map = torch.utils._pytree.tree_map
    return Inputs(tuple(tree_map(build, list(args))), dict(tree_map(build, kwargs)))


def planned_inputs(signature: str) -> Inputs | None:
    """Shape-only (meta) inputs as a plan's ``input_signature`` records them, for checking
    calls of a result applied without example inputs; None when it cannot be read."""
    try:
        return inputs_like(signature, "meta")
    except ValueError:
        return None

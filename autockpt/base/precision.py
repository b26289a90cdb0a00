"""Mixed precision: the autocast state and parameter dtypes a plan is made for, and what a
training step under autocast allocates that a step without it does not.

Why planning needs to know
--------------------------
Memory depends on precision. Under ``torch.autocast`` every eligible operator casts its
floating inputs to the autocast dtype, and the casts of model weights (floating-point
leaves that require grad) go to autocast's **weight cache**: one lower-precision copy per
parameter, made at its first use in the step and held until the outermost autocast context
exits. With the usual training step::

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).loss
        loss.backward()

those copies live from their first use to the end of backward, whatever the plan: a
checkpointed segment's recompute finds them in the cache and allocates none. Nothing else
about them moves with a plan, so the recording of one step (``autockpt/costs/record.py``) keeps
them where and when the cache makes them (:func:`held_by_cache`), and the measurement
(``autockpt/measure.py``) runs each step with an empty cache (:func:`fresh_autocast_cache`),
as a fresh context per step does. (With ``loss.backward()`` outside the context, the cache
is emptied after forward: every point of the step holds at most what the plan predicts.)

The profile's probe (NOTE [profile: probe]) runs under the same context with the
cache emptied before each node (:func:`empty_autocast_cache`: the node's casts are made in
its own windows, where both of the probe's witnesses see them) and left empty after it, and
it measures each node's kernels without the conversions of its casts' gradients back to
float32 (:class:`AutocastCasts`), which the recording places in windows of their own.

How a plan learns it
--------------------
The state is read where it is set: ``optimize``/``Planner`` called inside an autocast
context plan a step under that context (:meth:`Precision.now`). The plan records it as a
note (:meth:`Precision.note`), and the optimized model checks every training call against it
(:func:`check_call`): another precision (a plan made in float32 trained under autocast or
after ``model.to(torch.bfloat16)``) changes every activation's size, so the budget no longer
holds. An fx graph still computes what eager does under the new precision and runs, with a
warning (once); a graph captured with ``torch.export`` may hold casts and dtype checks of the
planned precision, so it is refused with :class:`~autockpt.errors.PlanMismatchError` (plan
again under the precision you train with).
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autockpt.base.autocast_lists import CudaAutocastOnCpu
from autockpt.errors import PlanMismatchError, PrecisionError, PrecisionWarning

__all__ = [
    "AutocastCasts",
    "Precision",
    "PrecisionWarning",
    "check_call",
    "empty_autocast_cache",
    "precision_problem",
    "fresh_autocast_cache",
    "requested_precision",
]

AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
"""Device types whose autocast state is read (those torch has an autocast for)."""

_NOTE = "precision: "
_KEY = re.compile(r"\[parameters=([\w,]*) autocast=([\w:,]*) cache=(on|off)(?: kept=(\w+))?\]")


@dataclass(frozen=True)
class Precision:
    """The precision a training step runs in: the floating dtypes of the model's parameters
    and every enabled autocast context (device type, dtype), sorted; ``autocast_cache`` is
    whether autocast keeps its weight casts (``torch.is_autocast_cache_enabled``).

    ``kept``: the dtype a rank keeps the parameters in between steps when the step computes
    with others (FSDP2's mixed precision: float32 shards gathered as bfloat16, NOTE
    [precision: FSDP2 mixed precision]); only a request sets it (``fsdp-bf16``). It is
    what the per-rank memory model counts, not the step, so :meth:`now`, a plan's note and
    :meth:`key` leave it out, and the call check compares steps: a plan for the policy runs
    on the planned bfloat16 model and on the float32 model FSDP2 gathers in bfloat16 alike.
    Equality keeps it: planning's cache (autockpt/planning/cache.py) must not hand a
    ``bf16-true`` preparation, whose leanest plan is another rank's, to this one."""

    parameters: tuple[str, ...]
    autocast: tuple[tuple[str, str], ...] = ()
    autocast_cache: bool = True
    kept: str | None = None

    @staticmethod
    def now(model: nn.Module | None = None) -> Precision:
        """The state in effect now, for ``model``'s parameters: the dtypes the step computes
        with, which under FSDP2's mixed precision are its ``param_dtype`` for the shards it
        has not gathered (:func:`_fsdp_compute_dtypes`)."""
        dtypes = set()
        if model is not None:
            gathered_as = _fsdp_compute_dtypes(model)
            dtypes = {
                _name(gathered_as.get(id(p), p.dtype))
                for p in model.parameters()
                if p.is_floating_point()
            }
        return Precision(tuple(sorted(dtypes)), autocast_state(), torch.is_autocast_cache_enabled())

    def key(self) -> tuple[str, tuple[str, ...], tuple[tuple[str, str], ...], bool]:
        """This precision as a plain tuple (strings and a bool): what an optimized model's
        record of warnings holds for it. ``torch.compile`` reads that record as a constant
        when it traces a call check, and cannot rebuild a frozen dataclass there."""
        return ("precision", self.parameters, self.autocast, self.autocast_cache)

    def describe(self) -> str:
        """``"float32 parameters under cpu bfloat16 autocast"`` and the like."""
        params = "/".join(self.parameters) or "no floating"
        if self.kept is not None:
            params += f" (kept in {self.kept} by FSDP2's mixed precision)"
        if not self.autocast:
            return f"{params} parameters without autocast"
        contexts = " and ".join(f"{device} {dtype}" for device, dtype in self.autocast)
        cache = "" if self.autocast_cache else " (weight cache off)"
        return f"{params} parameters under {contexts} autocast{cache}"

    def note(self) -> str:
        """The plan's note recording this precision (read back by :meth:`from_notes`)."""
        contexts = ",".join(f"{device}:{dtype}" for device, dtype in self.autocast) or "none"
        kept = f" kept={self.kept}" if self.kept else ""
        return (
            f"{_NOTE}planned with {self.describe()} [parameters={','.join(self.parameters)} "
            f"autocast={contexts} cache={'on' if self.autocast_cache else 'off'}{kept}]"
        )

    @staticmethod
    def from_notes(notes: Iterable[str], *, with_kept: bool = False) -> Precision | None:
        """The precision a plan's notes record (None for plans made before it was noted):
        the step's (what a training call is checked against), and with ``with_kept`` the
        dtype FSDP2's mixed precision keeps the shards in too."""
        for note in notes:
            if note.startswith(_NOTE):
                found = _KEY.search(note)
                if found is None:
                    return None
                params, contexts, cache, kept = found.groups()
                autocast = tuple(
                    tuple(item.split(":", 1)) for item in contexts.split(",") if ":" in item
                )
                return Precision(
                    tuple(p for p in params.split(",") if p),
                    autocast,
                    cache == "on",
                    kept if with_kept else None,
                )
        return None

    @contextlib.contextmanager
    def entered(self, device: torch.device | None = None) -> Iterator[None]:
        """Run a block in this autocast state (each of its contexts entered, every other
        one disabled), whatever the caller's is: the planner verifies its plan in the
        state it planned in.

        ``device``: where the block's tensors are (the model's device; ``None``: a GPU's if
        one is present). A GPU's autocast is emulated on the CPU wherever they are not on a
        GPU: a meta model runs as fake CPU tensors, which ``torch.autocast("cuda")`` does
        not cast even on a machine that has a GPU."""
        on_gpu = torch.cuda.is_available() if device is None else device.type == "cuda"
        with contextlib.ExitStack() as stack:
            planned = dict(self.autocast)
            if "cuda" in planned and not on_gpu:
                # planned for a GPU, run where there is none: its autocast on the CPU
                # (NOTE [precision: a GPU's autocast on the CPU])
                dtype = getattr(torch, planned.pop("cuda"))
                planned.setdefault("cpu", _name(dtype))
                stack.enter_context(CudaAutocastOnCpu(dtype))
            for device in AUTOCAST_DEVICES:
                if device in planned:
                    stack.enter_context(
                        torch.autocast(
                            device,
                            dtype=getattr(torch, planned[device]),
                            cache_enabled=self.autocast_cache,
                        )
                    )
                elif _enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            yield


PRECISIONS: dict[str, tuple[str, torch.dtype]] = {
    "32-true": ("true", torch.float32),
    "fp32": ("true", torch.float32),
    "bf16-true": ("true", torch.bfloat16),
    "16-true": ("true", torch.float16),
    "bf16-mixed": ("mixed", torch.bfloat16),
    "bf16": ("mixed", torch.bfloat16),
    "16-mixed": ("mixed", torch.float16),
    "fp16": ("mixed", torch.float16),
    "fsdp-bf16": ("fsdp", torch.bfloat16),
}
"""The precisions planning takes by name (Lightning's names, and short forms): ``-mixed``
is autocast at that dtype over the model's parameters, ``-true`` parameters of that dtype
without autocast. ``fsdp-bf16`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``: the step of a bfloat16 model, kept as float32 shards (NOTE
[precision: FSDP2 mixed precision])."""

FSDP_KEPT = "float32"
"""The dtype FSDP2's mixed precision (``fsdp-bf16``) keeps shards, gradient shards,
optimizer state and reduce-scatters in."""


# NOTE [precision: FSDP2 mixed precision]. Under FSDP2's
# ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` (what
# torchtitan trains with) a rank keeps float32 shards, float32 gradient shards and the
# optimizer's float32 state; each unit is all-gathered as bfloat16, the forward and
# backward compute in bfloat16 without autocast, and each unit's bfloat16 gradients are
# cast into a float32 reduce-scatter input. The step is therefore a bfloat16 model's
# (``bf16-true``'s) and only what a rank keeps differs. So it is planned as one:
# ``precision="fsdp-bf16"`` takes the model with bfloat16 parameters, as ``bf16-true`` does
# (``autockpt.distributed.fsdp_bf16_twin(model)``: bfloat16 parameters, buffers as FSDP2
# leaves them; free on the meta device), plans its step, and the per-rank model
# (autockpt/planning/sharding.py, NOTE [sharding: FSDP2 mixed precision]) counts shards,
# gradient shards, optimizer state and reduce-scatters in float32. The plan applies to the
# float32 model the user wraps (``autockpt.apply``): its graph is the twin's, and the call
# check reads the dtype FSDP2 gathers each shard in (:func:`_fsdp_compute_dtypes`), so the
# wrapped model runs the planned precision. Why a name and not a ``MixedPrecisionPolicy``
# object: a policy has more knobs (fp16, ``output_dtype``, ``cast_forward_inputs``, a
# bfloat16 reduction) that this model does not count; a name says the one case it does,
# is checked like the other names, and is what a command line or a configuration file can
# carry. Why the user converts and not the planner: one model per planner, as for
# ``bf16-true``; a twin made inside would also be what ``optimize`` hands back, while the
# model to train is the float32 one.


def requested_precision(
    precision: Precision | str | None, model: nn.Module, run_device_type: str
) -> Precision | None:
    """The precision a caller asks to plan for (``None``: the one in effect around the call,
    read when planning begins). ``"bf16-mixed"`` is autocast on ``run_device_type`` (the
    target's, on a meta model) over the model's parameter dtypes; ``"bf16-true"`` checks
    that the parameters are bfloat16 (convert the model first: free on the meta device)."""
    if precision is None or isinstance(precision, Precision):
        return precision
    if not isinstance(precision, str) or precision.lower() not in PRECISIONS:
        raise PrecisionError(
            f"precision must be one of {', '.join(PRECISIONS)} (or None: the autocast context "
            f"around the call), got {precision!r}"
        )
    kind, dtype = PRECISIONS[precision.lower()]
    now = Precision.now(model)
    if kind == "mixed":
        return Precision(now.parameters, ((run_device_type, _name(dtype)),), True)
    if now.parameters and now.parameters != (_name(dtype),):
        convert = (
            "plan autockpt.distributed.fsdp_bf16_twin(model), bfloat16 parameters beside "
            "float32 buffers as FSDP2 runs them, and apply the plan to the float32 model "
            "you shard"
            if kind == "fsdp"
            else f"convert it first (model.to(torch.{_name(dtype)}); free on the meta device)"
        )
        raise PrecisionError(
            f"precision={precision!r} plans {_name(dtype)} parameters and the model's are "
            f"{'/'.join(now.parameters)}: {convert}, or plan mixed precision "
            "(precision='bf16-mixed')"
        )
    return Precision(now.parameters, (), True, FSDP_KEPT if kind == "fsdp" else None)


def _fsdp_compute_dtypes(model: nn.Module) -> dict[int, torch.dtype]:
    """The dtype FSDP2 gathers each of ``model``'s sharded parameters in, by ``id``, for
    the parameters of units with a mixed-precision ``param_dtype``: a unit not running
    holds its float32 shards, and the step computes with their bfloat16 gathers (NOTE
    [precision: FSDP2 mixed precision]). Empty without FSDP2 (not imported: nothing
    wrapped)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return {}
    found: dict[int, torch.dtype] = {}
    for module in model.modules():
        if not isinstance(module, fsdp.FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            dtype = group.mp_policy.param_dtype
            if dtype is None:
                continue
            for param in group.fsdp_params:
                if param.sharded_param.is_floating_point():
                    found[id(param.sharded_param)] = dtype
    return found


def autocast_state() -> tuple[tuple[str, str], ...]:
    """``(device type, dtype)`` of every autocast context enabled now."""
    return tuple(
        (device, _name(torch.get_autocast_dtype(device)))
        for device in AUTOCAST_DEVICES
        if _enabled(device)
    )


def cached_cast_dtypes() -> dict[str, torch.dtype]:
    """Per device type, the dtype autocast's weight cache holds casts of float32
    parameters to (empty without autocast, or with its cache off)."""
    return autocast_dtypes() if torch.is_autocast_cache_enabled() else {}


def held_by_cache(source: torch.Tensor, dtype: Any, cast_to: dict[str, torch.dtype]) -> bool:
    """Whether casting ``source`` to ``dtype`` is one autocast keeps in its weight cache:
    a float32 leaf that requires grad and is no view, cast to the device's autocast dtype
    (the rule of ``at::autocast::cached_cast``; ``cast_to`` from
    :func:`cached_cast_dtypes`)."""
    return (
        cast_to.get(source.device.type) == dtype
        and source.dtype == torch.float32
        and source.requires_grad
        and source.is_leaf
        and not source._is_view()
    )


@contextlib.contextmanager
def fresh_autocast_cache() -> Iterator[None]:
    """Run a block as if in a fresh autocast context: autocast's weight cache is empty when
    it starts and emptied when it ends (the casts it made are then freed, as at a context's
    exit). Nothing happens without autocast. Emptying the cache drops only copies: the next
    use casts again."""
    active = bool(autocast_state())
    if active:
        torch.clear_autocast_cache()
    try:
        yield
    finally:
        if active:
            torch.clear_autocast_cache()


def empty_autocast_cache() -> None:
    """Empty autocast's weight cache now (nothing without autocast). The profile's probe
    does before each node: the node then makes its weight casts itself, inside its own
    windows, where both of the probe's witnesses see them (a cast made earlier would be a
    storage only the allocator knows)."""
    if autocast_state():
        torch.clear_autocast_cache()


class AutocastCasts:
    """While entered (under autocast), notes every cast autocast makes of a float32 tensor
    to its lower precision: ``found[id(source)]`` is the cast of ``source``.

    The profile's probe differentiates a node with respect to these casts instead of their
    sources, so that its backward window holds the node's kernels and not the conversions of
    the casts' gradients back to float32 (``ToCopyBackward``). Those conversions allocate
    no workspace, and in the step they run after the node's own backward, once its saved
    tensors may be freed, which the probe cannot free (it holds the node's inputs and
    output gradients): measured together, the probe's tracked peak would fall at another
    moment than the step's, and the kernels' workspace would come out wrong. The recording
    gives the conversions backward windows of their own, without workspace
    (NOTE [record: autocast cache])."""

    def __init__(self) -> None:
        self.cast_to = autocast_dtypes()
        self.found: dict[int, torch.Tensor] = {}
        self._mode: _CastWatch | None = None

    def __enter__(self) -> AutocastCasts:
        if self.cast_to:
            self._mode = _CastWatch(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None

    def instead_of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` with each one that was cast replaced by its cast (the cast of a
        view of a tensor stands for the tensor too)."""
        return [self.found.get(id(t), t) for t in tensors]


class _CastWatch(TorchDispatchMode):
    def __init__(self, casts: AutocastCasts) -> None:
        super().__init__()
        self.casts = casts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and is_autocast_cast(
            args[0].dtype, kwargs.get("dtype"), args[0].device.type, self.casts.cast_to
        ):
            source = args[0]
            self.casts.found.setdefault(id(source), out)
            if source._is_view() and source._base is not None:
                self.casts.found.setdefault(id(source._base), out)
        return out


def autocast_dtypes() -> dict[str, torch.dtype]:
    """Per device type with autocast enabled now, the dtype it casts to. Read it outside
    operators: inside an autocast kernel autocast reports itself off."""
    return {device: torch.get_autocast_dtype(device) for device, _ in autocast_state()}


def is_autocast_cast(
    source: torch.dtype, dtype: Any, device_type: str, cast_to: dict[str, torch.dtype]
) -> bool:
    """Whether a cast from ``source`` to ``dtype`` on ``device_type`` is one autocast makes
    (a float32 tensor to the device's autocast dtype; ``cast_to`` from
    :func:`autocast_dtypes`)."""
    return source == torch.float32 and dtype is not None and cast_to.get(device_type) == dtype


# -- the optimized model's check at each training call ------------------------------------

_PLANNED: dict[int, Precision | None] = {}


def planned_precision(plan: Any) -> Precision | None:
    """The precision ``plan`` was made with (None when its notes do not say), read once
    per plan object."""
    key = id(plan)
    if key in _PLANNED:
        return _PLANNED[key]
    found = Precision.from_notes(getattr(plan, "notes", ()))
    try:  # kept while the plan lives (its id may be reused after)
        weakref.finalize(plan, _PLANNED.pop, key, None)
    except TypeError:  # not weak-referenceable: read it each time
        return found
    _PLANNED[key] = found
    return found


def check_call(module: nn.Module, plan: Any, specialised: bool, warned: set[Any]) -> None:
    """Check one training call (autograd on, the planned training mode) of an optimized
    model against the precision its plan was made with, before its graph runs.

    The same precision: nothing. Another one: an fx graph (``specialised`` False) computes
    what eager computes under it, so it runs, with one :class:`PrecisionWarning` per
    precision (``warned`` holds those already said); a graph captured with
    ``torch.export`` (``specialised``) may hold the planned casts and dtype checks, so it
    raises :class:`PlanMismatchError` before running. A plan that does not record its
    precision (older plans) is not checked."""
    problem = precision_problem(module, plan, specialised, warned)
    if problem:
        raise PlanMismatchError(problem)


@torch.compiler.assume_constant_result
def precision_problem(module: nn.Module, plan: Any, specialised: bool, warned: set[Any]) -> str:
    """:func:`check_call`'s verdict: the error's message, or "" (having warned if need be).

    Under ``torch.compile`` it runs once per trace, outside the graph: the precision is
    part of what a compiled graph is guarded on (autocast state, parameter dtypes), so a
    call in another precision traces again and checks again. Dynamo hands it a copy of
    ``warned``, rebuilt from its items, so the set holds only plain values (a precision as
    :meth:`Precision.key`): a frozen dataclass in it made every trace after an eager
    warning fail ("can't reconstruct arbitrary frozen dataclass instances")."""
    planned = planned_precision(plan) if plan is not None else None
    if planned is None:
        return ""
    current = Precision.now(module)
    if current == planned:
        return ""
    message = (
        f"{type(module).__name__} was planned with {planned.describe()}; this call runs with "
        f"{current.describe()}, so its memory is not what the plan predicted and the budget "
        "may not hold. Plan under the precision you train with: call autockpt.optimize "
        "inside the same torch.autocast context, after model.to(dtype)"
    )
    if specialised:
        return (
            message + ". Its graph was captured with torch.export for the planned precision "
            "and cannot run under another one"
        )
    if current.key() not in warned:  # plain tuples only: the set reaches torch.compile
        warned.add(current.key())
        warnings.warn(message, PrecisionWarning, stacklevel=7)
    return ""


def _enabled(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type this build has no autocast for
        return False


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

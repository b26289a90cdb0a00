"""Stage 5 — plan: what was decided, why, and what it is predicted to cost, as exact JSON.

A :class:`Plan` is self-describing: it names the graph it was made for (a structural
fingerprint plus the input signature), the library and torch versions, the budget and its
scope, the solver's verdict and every checkpointed segment by its first and last fx node
names (and, for people, the module path of each). ``Plan.from_json(plan.to_json()) == plan``
holds exactly (floats are written with ``repr`` precision).

Compatibility rule: a plan is readable when its ``schema_version`` equals
:data:`SCHEMA_VERSION`; a different schema raises :class:`PlanMismatchError` saying both
versions. Within a version, fields are only ever added as optional ones that default to
``None`` when absent (``timeline`` came this way), so older files stay readable; a renamed
or re-defined field bumps the version. The torch version is informational: the graph
fingerprint decides whether a plan fits a model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from autockpt._version import __version__
from autockpt.errors import GIB, PlanFormatError, PlanMismatchError, format_bytes

SCHEMA_VERSION = 1

SCOPES = ("total", "activations")
"""What a budget counts (README, "Budget semantics"): ``total``, every byte of the step;
``activations``, what lies above the part every plan holds (:func:`scoped_bytes`)."""


def scoped_bytes(total_bytes: int, scope: str, static_bytes: int) -> int:
    """The part of a step's total bytes that a budget of ``scope`` counts: all of it for
    "total"; for "activations", what lies above ``static_bytes`` (parameters, buffers,
    inputs and parameter gradients: what every plan holds). The one scope rule: the
    planner's predictions, its verification and the reports of a plan all count with it."""
    if scope == "total":
        return total_bytes
    return total_bytes - static_bytes


@dataclass(frozen=True)
class KeptOp:
    """An operator output a segment keeps from its forward instead of recomputing it
    (selective recompute): the ``index``-th call (from 0) of operator ``op`` (for example
    ``"aten.mm.default"``) in the segment's forward, made by fx node ``node``."""

    node: str
    op: str
    index: int


@dataclass(frozen=True)
class Segment:
    """A checkpointed run of stages ``[start_stage, end_stage)``; ``first_node`` and
    ``last_node`` name its first and last fx nodes (what the rewrite matches on),
    ``first_module`` and ``last_module`` the modules they lie in (what people read)."""

    start_stage: int
    end_stage: int
    first_node: str
    last_node: str
    recompute_seconds: float
    bytes_freed: int
    preserve_rng: bool
    restore_buffers: tuple[str, ...] = ()
    kept_ops: tuple[KeptOp, ...] = ()
    """Operator outputs kept from the forward (selective recompute); empty: the segment
    recomputes everything inside it."""
    first_module: str | None = None
    """Qualified name in the user's model of the innermost module whose code made the first
    node (``"blocks.3.attn"``; ``""``: the root's own code), so that a reader can find the
    segment in the model; None in plans written before this field."""
    last_module: str | None = None
    """The same for the last node."""

    @property
    def first_label(self) -> str:
        """The first node for people: ``"blocks.3.attn (matmul_4)"``."""
        return _node_label(self.first_module, self.first_node)

    @property
    def last_label(self) -> str:
        """The last node for people: ``"blocks.3.mlp (dropout_11)"``."""
        return _node_label(self.last_module, self.last_node)


ROOT_LABEL = "<root>"
"""How a segment label names the root's own code (module path ``""``)."""


def _node_label(module: str | None, node: str) -> str:
    if module is None:
        return node
    return f"{module or ROOT_LABEL} ({node})"


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where the predicted peak goes, in bytes."""

    parameters: int
    gradients: int
    buffers: int
    inputs: int
    kept_activations: int
    no_checkpoint_activations: int


@dataclass(frozen=True)
class OptimizerRecord:
    """The optimizer the budget covers (``optimize(..., optimizer=opt)``), in bytes: the
    state it keeps between steps (resident for the whole iteration) and the highest its
    step's own temporaries reach (while the gradients are alive). Found by stepping a
    stand-in of it on fake tensors (autockpt/base/optimizer.py), not from a table."""

    name: str
    """The optimizer's class (``"AdamW"``)."""
    state_bytes: int
    step_bytes: int


@dataclass(frozen=True)
class RankMemory:
    """What one rank keeps under a distributed engine, in bytes (see
    ``autockpt.distributed``): local parameters (or shards) and gradients, DDP's gradient
    buckets, FSDP's all-gathered parameters (largest unit twice, plus the root's) and its
    largest reduce-scatter window; ``static`` is what stays resident between steps (local
    parameters, buckets, buffers, inputs; gradients are freed by ``zero_grad``)."""

    parameters: int
    gradients: int
    buckets: int
    gathered_parameters: int
    reduce_scatter: int
    static: int
    optimizer_state: int = 0
    """The optimizer's state one rank keeps (a shard under FSDP), when the budget covers it."""


@dataclass(frozen=True)
class MemoryTimeline:
    """Predicted live bytes at every event of one training step, without checkpointing and
    with the plan: the plan simulator's replay (``solvers.replay.timeline``) folded onto
    the chain's events, each event holding the highest bytes reached during it.

    Stored in the plan so that ``autockpt show --plot`` can draw the step without the model.
    Compact on purpose: the plan's events are a phase string (``f`` forward, ``r``
    recompute, ``b`` backward) plus the stage of each event; the no-checkpoint events are
    always the forward of stages ``0 .. L-1`` then their backward ``L-1 .. 0``. Event
    durations follow from the per-stage forward and backward seconds (a recompute costs the
    stage's forward again), so both curves can be drawn against time.
    """

    phases: str
    stages: tuple[int, ...]
    plan_bytes: tuple[int, ...]
    no_checkpoint_bytes: tuple[int, ...]
    stage_forward_seconds: tuple[float, ...]
    stage_backward_seconds: tuple[float, ...]

    def plan_events(self) -> list[tuple[str, int, int, float]]:
        """``(phase, stage, bytes, seconds)`` for every event of the plan, in order."""
        durations = {
            "f": self.stage_forward_seconds,
            "r": self.stage_forward_seconds,
            "b": self.stage_backward_seconds,
        }
        return [
            (phase, stage, nbytes, durations[phase][stage])
            for phase, stage, nbytes in zip(self.phases, self.stages, self.plan_bytes, strict=True)
        ]

    def no_checkpoint_events(self) -> list[tuple[str, int, int, float]]:
        """``(phase, stage, bytes, seconds)`` for every event without checkpointing."""
        num = len(self.stage_forward_seconds)
        order = [("f", k) for k in range(num)] + [("b", k) for k in range(num - 1, -1, -1)]
        return [
            (
                phase,
                k,
                nbytes,
                (self.stage_forward_seconds if phase == "f" else self.stage_backward_seconds)[k],
            )
            for (phase, k), nbytes in zip(order, self.no_checkpoint_bytes, strict=True)
        ]


@dataclass(frozen=True)
class Plan:
    """A checkpoint plan: segments plus predictions plus provenance."""

    model: str
    graph_fingerprint: str
    input_signature: str
    input_names: tuple[str, ...]
    capture_method: str
    leaf_modules: tuple[str, ...]
    num_nodes: int
    stages: tuple[tuple[str, str], ...]
    budget_bytes: int
    scope: str
    solver: str
    solver_status: str
    solve_seconds: float
    solver_gap: float | None
    segments: tuple[Segment, ...]
    predicted_peak_bytes: int
    no_checkpoint_peak_bytes: int
    minimum_peak_bytes: int
    predicted_recompute_seconds: float
    predicted_step_seconds: float
    recompute_fraction: float
    memory: MemoryBreakdown
    calibration_bytes: int = 0
    """Legacy (schema 1): bytes a calibration step once added to the static part. No step
    calibrates any more (the probe measures workspaces node by node), so new plans write 0;
    plans written before still load, and ``autockpt show`` prints their value."""
    measured_peak_bytes: int | None = None
    measured_step_seconds: float | None = None
    times_estimated: bool = False
    device: str = "cpu"
    target: str | None = None
    """The device the plan is for when planned elsewhere (a name of ``autockpt.TARGETS``:
    its kernels, roofline times and memory; NOTE [target: planning for another device]);
    None: the device planned on (``device``). Plans written before the field load None."""
    time_model: str | None = None
    """What the plan's seconds (and its ranking of segments) come from: ``"measured"``
    (the probe's node seconds), ``"roofline:<target>"`` (the target's datasheet rates) or
    ``"roofline:nominal"`` (nominal rates: the meta device without a target). None in plans
    written before the field."""
    notes: tuple[str, ...] = ()
    world_size: int = 1
    sharding: str | None = None
    fsdp_units: tuple[str, ...] = ()
    fsdp_kept_gathered: tuple[str, ...] | None = None
    """The FSDP2 modules (units, ``""`` for the root) whose parameters stay gathered from
    forward to backward: ``fully_shard(module, reshard_after_forward=False)`` for these,
    ``True`` for every other unit (:meth:`reshards`; NOTE [sharding: reshard after
    forward]). None: FSDP2's defaults, the root alone (plans written before the field, and
    plans not for FSDP)."""
    rank_memory: RankMemory | None = None
    timeline: MemoryTimeline | None = None
    optimizer: OptimizerRecord | None = None
    """The optimizer whose state and step the budget and every prediction cover (the whole
    training iteration from steady state); None: one forward and backward, the optimizer
    outside the budget (plans written before this field load that way)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step: from the second on, the gradients are resident
    through forward and backward, and the budget covers that."""
    loss: str | None = None
    """The loss the budget and every prediction cover: ``"default"`` (the output's ``loss``,
    else the sum of its floating tensors) or the ``loss_fn``'s ``module:qualname``; None in
    plans written before this field. A step with another loss has another peak (the loss's
    own kernels and intermediates), so a check with another loss measures again."""
    submodule: str | None = None
    """Qualified name of the submodule the graph fields describe, when the root's own forward
    could not be captured and runs eagerly around it (autockpt/planning/nested.py); None: the
    root."""
    units: tuple[UnitPlan, ...] = ()
    """Where the root's own forward cannot be captured and runs eagerly, the submodule calls
    it plans on their own (autockpt/planning/nested.py, NOTE [nested: units]): each
    checkpointed unit's own plan, for that unit's graph. Then the graph fields describe the
    units together (``stages`` and ``segments`` named ``unit:node``); empty for a plan of
    one captured graph (and in plans written before this field)."""
    compile_memory_budget: float | None = None
    """Where the model came compiled (``optimize(torch.compile(model), ...)``) and the
    fastest step within the budget was torch.compile's own recompute at this
    ``activation_memory_budget`` (NOTE [compiled: partitioner budgets]): no segments, the
    partitioner decides what the compiled step saves, and the peak was measured, compiled.
    None: the plan's segments are the recompute (and plans written before this field)."""
    as_written_peak_bytes: int | None = None
    """Predicted peak of one step of the model as written, without checkpointing: the
    baseline a user compares with. ``no_checkpoint_peak_bytes`` is the captured graph's,
    which may keep less (it frees each value after its last use; the model's own code may
    hold tensors until its forward returns); both are predicted, never run for real. None in
    plans written before this field, or where the model as written cannot run on fake
    tensors."""
    autockpt_version: str = field(default_factory=lambda: _library_version())
    torch_version: str = field(default_factory=lambda: _torch_version())
    schema_version: int = SCHEMA_VERSION

    def _kept_gathered_text(self) -> str:
        """What the summary says of ``reshard_after_forward`` when it is not FSDP2's default."""
        kept = self.fsdp_kept_gathered
        if self.sharding != "fsdp" or kept is None or kept == ("",):
            return ""
        units = [m for m in kept if m]
        which = "every unit" if units == list(self.fsdp_units) else ", ".join(units) or "no unit"
        root = "" if "" in kept else "; the root resharded after forward"
        return f"; kept gathered after forward: {which}{root}"

    def reshards(self, module: str) -> bool:
        """What to pass as ``fully_shard(..., reshard_after_forward=)`` for ``module`` (a
        name of :attr:`fsdp_units`, or ``""`` for the root): the choice the plan's memory
        counts."""
        if self.sharding != "fsdp":
            raise ValueError(f"the plan is not for FSDP2 (sharding={self.sharding!r})")
        if module and module not in self.fsdp_units:
            raise ValueError(f"{module!r} is not one of the plan's fsdp_units (or '' for the root)")
        kept = ("",) if self.fsdp_kept_gathered is None else self.fsdp_kept_gathered
        return module not in kept

    # -- JSON -----------------------------------------------------------------------------

    def to_json(self, indent: int | None = 2) -> str:
        """Serialise to JSON text; ``Plan.from_json`` restores an equal plan."""
        return json.dumps(dataclasses.asdict(self), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse plan JSON, validating every field. Corrupt text raises
        :class:`PlanFormatError`; another schema version :class:`PlanMismatchError`."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as error:
            raise PlanFormatError(f"plan is not valid JSON: {error}") from error
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        if not isinstance(data, dict):
            raise PlanFormatError("plan JSON must be an object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanMismatchError(
                f"plan has schema_version {version!r} (written by autockpt "
                f"{data.get('autockpt_version', '?')}); this autockpt {_library_version()} reads "
                f"schema_version {SCHEMA_VERSION}. Re-create the plan with `autockpt plan`."
            )
        try:
            plan = _build(cls, data)
            _check_semantics(plan)
            return plan
        except (KeyError, TypeError, ValueError) as error:
            hint = ""
            if "unknown field" in str(error) and data.get("autockpt_version") != _library_version():
                hint = (
                    f"; the plan was written by autockpt {data.get('autockpt_version', '?')} "
                    f"and may hold fields added after {_library_version()}: upgrade to read it"
                )
            raise PlanFormatError(f"plan JSON is malformed: {error}{hint}") from error

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.to_json())
            handle.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except UnicodeDecodeError as error:
            raise PlanFormatError(f"{path} is not a text plan file: {error}") from error
        return cls.from_json(text)

    # -- reading --------------------------------------------------------------------------

    @property
    def budget_gb(self) -> float:
        return self.budget_bytes / GIB

    @property
    def predicted_peak_gb(self) -> float:
        return self.predicted_peak_bytes / GIB

    @property
    def baseline_peak_bytes(self) -> int:
        """The peak "without checkpointing" that a user compares with: the model as written
        (``as_written_peak_bytes``), or the captured graph's where that is unknown."""
        if self.as_written_peak_bytes is None:
            return self.no_checkpoint_peak_bytes
        return self.as_written_peak_bytes

    def budgeted_bytes(self, measured_total: int) -> int:
        """The part of a measured step's total peak that this plan's budget covers
        (:func:`scoped_bytes`; the static part is the plan's memory breakdown)."""
        m = self.memory
        return scoped_bytes(
            measured_total, self.scope, m.parameters + m.buffers + m.inputs + m.gradients
        )

    def summary(self) -> str:
        """A few human lines: budget, prediction, segments."""
        lines = [
            f"plan for {self.model} ({self.num_nodes} nodes in {len(self.stages)} stages, "
            f"captured with {self.capture_method})"
            + (f", inside submodule '{self.submodule}'" if self.submodule else ""),
            f"budget {format_bytes(self.budget_bytes)} (scope={self.scope}); predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)}; without checkpointing "
            f"{format_bytes(self.baseline_peak_bytes)}"
            + (
                f" (the captured graph: {format_bytes(self.no_checkpoint_peak_bytes)})"
                if self.baseline_peak_bytes != self.no_checkpoint_peak_bytes
                else ""
            )
            + f"; leanest plan {format_bytes(self.minimum_peak_bytes)}"
            + (
                f"; the whole iteration with {self.optimizer.name} (state "
                f"{format_bytes(self.optimizer.state_bytes)}, step "
                f"{format_bytes(self.optimizer.step_bytes)})"
                if self.optimizer is not None
                else ""
            )
            + (
                f"; {self.accumulation_steps} micro-batches per step"
                if self.accumulation_steps > 1
                else ""
            ),
            f"solver {self.solver}: {self.solver_status} in {self.solve_seconds:.3f} s; "
            f"{len(self.segments)} segment(s); recompute {self.predicted_recompute_seconds * 1e3:.2f} ms "
            f"({100 * self.recompute_fraction:.1f}% of a step)",
        ]
        if self.measured_peak_bytes is not None:
            lines.append(f"measured peak {format_bytes(self.measured_peak_bytes)}")
        if self.compile_memory_budget is not None:
            lines.append(
                "recompute left to torch.compile's partitioner at activation_memory_budget="
                f"{self.compile_memory_budget:g} (the fastest measured within the budget)"
            )
        if self.sharding is not None:
            lines.append(
                f"per rank of {self.world_size} under {self.sharding}"
                + (f"; {len(self.fsdp_units)} FSDP unit(s)" if self.fsdp_units else "")
                + self._kept_gathered_text()
                + (
                    f"; resident {format_bytes(self.rank_memory.static)}"
                    if self.rank_memory
                    else ""
                )
            )
        if self.rank_memory is not None:
            held = self.rank_memory
            lines.append(
                f"  a rank holds: parameters {format_bytes(held.parameters)}, gradients "
                f"{format_bytes(held.gradients)}, optimizer state "
                f"{format_bytes(held.optimizer_state)}, gathered units "
                f"{format_bytes(held.gathered_parameters)}, reduce-scatter "
                f"{format_bytes(held.reduce_scatter)}, buckets {format_bytes(held.buckets)}"
            )
        if self.target is not None:
            lines.append(
                f"fits on {self.target}: predicted peak {format_bytes(self.predicted_peak_bytes)}"
                f" within {format_bytes(self.budget_bytes)}; predicted step "
                f"{self.predicted_step_seconds:.3g} s ({self.time_model})"
            )
        for seg in self.segments:
            lines.append(
                f"  checkpoint stages [{seg.start_stage}, {seg.end_stage}): {seg.first_label} .. "
                f"{seg.last_label}  frees {format_bytes(seg.bytes_freed)}, recompute "
                f"{seg.recompute_seconds * 1e3:.2f} ms"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class UnitPlan:
    """One unit's plan inside a plan of units (``Plan.units``): the submodule at ``path``
    (qualified from the root) checkpointed as ``plan`` says."""

    path: str
    plan: Plan


def _check_semantics(plan: Plan) -> None:
    """What types alone cannot say: valid enumerations, segments inside the stage list."""
    if plan.scope not in SCOPES:
        raise ValueError(f"scope must be 'total' or 'activations', got {plan.scope!r}")
    if plan.capture_method not in ("fx", "fx+leaves", "export"):
        raise ValueError(f"capture_method {plan.capture_method!r} is not fx, fx+leaves or export")
    if plan.solver_status not in ("optimal", "feasible"):
        raise ValueError(f"solver_status {plan.solver_status!r} is not optimal or feasible")
    if plan.budget_bytes <= 0:
        raise ValueError("budget_bytes must be positive")
    if plan.compile_memory_budget is not None:
        if not 0.0 <= plan.compile_memory_budget < 1.0:
            raise ValueError(
                f"compile_memory_budget must be in [0, 1), got {plan.compile_memory_budget!r}"
            )
        if plan.segments or plan.units:
            raise ValueError("a plan with compile_memory_budget has no segments or units")
    if plan.accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {plan.accumulation_steps}")
    if plan.world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {plan.world_size}")
    if plan.sharding not in (None, "ddp", "fsdp"):
        raise ValueError(f"sharding must be null, 'ddp' or 'fsdp', got {plan.sharding!r}")
    if plan.fsdp_units and plan.sharding != "fsdp":
        raise ValueError("fsdp_units are listed but sharding is not 'fsdp'")
    if plan.fsdp_kept_gathered is not None:
        if plan.sharding != "fsdp":
            raise ValueError("fsdp_kept_gathered is set but sharding is not 'fsdp'")
        strangers = [m for m in plan.fsdp_kept_gathered if m and m not in plan.fsdp_units]
        if strangers:
            raise ValueError(f"fsdp_kept_gathered names modules that are not units: {strangers}")
    previous_end = 0
    for seg in plan.segments:
        if not previous_end <= seg.start_stage < seg.end_stage <= len(plan.stages):
            raise ValueError(
                f"segment [{seg.start_stage}, {seg.end_stage}) is not a sorted, disjoint, "
                f"non-empty range inside the {len(plan.stages)} stages"
            )
        previous_end = seg.end_stage
        calls = [(kept.op, kept.index) for kept in seg.kept_ops]
        if any(index < 0 for _, index in calls) or len(set(calls)) != len(calls):
            raise ValueError(
                f"segment {seg.first_node}..{seg.last_node} keeps an operator call twice or "
                "at a negative index"
            )
    if plan.timeline is not None:
        _check_timeline(plan.timeline, len(plan.stages))


def _check_timeline(timeline: MemoryTimeline, num_stages: int) -> None:
    if not (
        len(timeline.stage_forward_seconds) == len(timeline.stage_backward_seconds) == num_stages
    ):
        raise ValueError(
            f"timeline needs forward and backward seconds for each of the {num_stages} stages"
        )
    if len(timeline.no_checkpoint_bytes) != 2 * num_stages:
        raise ValueError(
            f"timeline.no_checkpoint_bytes needs {2 * num_stages} events (forward and backward of each stage)"
        )
    if not len(timeline.phases) == len(timeline.stages) == len(timeline.plan_bytes):
        raise ValueError("timeline.phases, stages and plan_bytes must have one entry per event")
    if set(timeline.phases) - set("frb"):
        raise ValueError("timeline.phases may only hold f (forward), r (recompute), b (backward)")
    if any(not 0 <= k < num_stages for k in timeline.stages):
        raise ValueError(f"timeline.stages must lie in [0, {num_stages})")


def _build(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a dataclass from JSON data, checking field names and restoring tuples."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} in {cls.__name__}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise KeyError(f"{cls.__name__}.{f.name} is missing")
            continue
        kwargs[f.name] = _convert(f.name, f.type, data[f.name])
    return cls(**kwargs)


def _convert(name: str, annotation: Any, value: Any) -> Any:
    kind = str(annotation)
    if name == "segments":
        return tuple(_build(Segment, item) for item in _list(name, value))
    if name == "kept_ops":
        return tuple(_build(KeptOp, item) for item in _list(name, value))
    if name in ("first_module", "last_module"):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a string or null, got {value!r}")
        return value
    if name == "memory":
        return _build(MemoryBreakdown, value)
    if name == "rank_memory":
        return None if value is None else _build(RankMemory, value)
    if name == "optimizer":
        return None if value is None else _build(OptimizerRecord, value)
    if name == "fsdp_kept_gathered":
        return None if value is None else tuple(str(item) for item in _list(name, value))
    if name == "sharding":
        if value is not None and not isinstance(value, str):
            raise TypeError(f"sharding must be a string or null, got {value!r}")
        return value
    if name == "timeline":
        return None if value is None else _build(MemoryTimeline, value)
    if name == "loss":
        if value is not None and not (isinstance(value, str) and value):
            raise TypeError(f"loss must be a non-empty string or null, got {value!r}")
        return value
    if name == "units":
        units = []
        for item in _list(name, value):
            if not isinstance(item, dict) or set(item) != {"path", "plan"}:
                raise TypeError("each of units must be an object with path and plan")
            if not (isinstance(item["path"], str) and item["path"]):
                raise TypeError(f"a unit's path must be a non-empty string, got {item['path']!r}")
            if not isinstance(item["plan"], dict):
                raise TypeError("a unit's plan must be an object")
            inner = _build(Plan, item["plan"])
            _check_semantics(inner)
            units.append(UnitPlan(item["path"], inner))
        return tuple(units)
    if name == "compile_memory_budget":
        return None if value is None else _float(name, value)
    if name == "submodule":
        if value is not None and not (isinstance(value, str) and value):
            raise TypeError(f"submodule must be a non-empty string or null, got {value!r}")
        return value
    if kind.startswith("tuple[int"):
        return tuple(_int(name, item, optional=False) for item in _list(name, value))
    if kind.startswith("tuple[float"):
        return tuple(_float(name, item) for item in _list(name, value))
    if name == "stages" and kind.startswith("tuple[tuple"):
        return tuple((str(a), str(b)) for a, b in _list(name, value))
    if kind.startswith("tuple[str"):
        return tuple(str(item) for item in _list(name, value))
    if kind.startswith("int"):
        return _int(name, value, optional="None" in kind)
    if kind.startswith("float"):
        if value is None and "None" in kind:
            return None
        return _float(name, value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be true or false, got {value!r}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {value!r}")
        return value
    return value


def _int(name: str, value: Any, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def _list(name: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{name} must be a list, got {type(value).__name__}")
    return value


def _library_version() -> str:
    return __version__


def _torch_version() -> str:
    import torch

    return torch.__version__

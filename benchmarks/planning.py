"""What planning itself costs: memory (resident high-water) and time, per model.

    autockpt bench planning [--quick] [--out out/planning]
    python -m benchmarks.planning [--quick] [--out out/planning] [--models gpt,resnet]

Planning must fit where the plan fits: a user who asks for a budget because the plain step
does not fit cannot plan on a machine that must first run the plain step. This benchmark
(and ``tests/test_planning_memory.py``, which uses the same harness) measures that.

Per model, two fresh processes (a resident high-water mark is per process):

* ``eager``: one plain training step inside the window below, then ``autockpt.measure`` for
  the step's allocator-level peak (outside the window);
* ``plan``: ``Planner(model, inputs)`` then ``optimize`` at a budget 35% of the way from the
  stated minimum (the leanest plan's peak) to the no-checkpoint peak, inside the window;
  then, outside it, one step of the returned model against one eager step (same seed: loss
  and every gradient must agree), ``autockpt.measure`` of the plan (under the budget?) and
  interleaved timing rounds (each step timed right after itself: NOTE [timing:
  interleaved rounds] in ``autockpt/measure.py``).

**The window.** Before it, the process plans (or steps) a tiny model of the same kind, so
imports, the profiler's and OpenMP's one-time set-up and lazily built tables are paid
outside; then it builds the model and inputs (no step runs), collects garbage, returns freed
heap pages to the system (``malloc_trim`` where glibc has it) and reads the resident size.
The window's cost is the resident high-water mark at its end minus that resident size.
On Linux the high-water mark is the process's own ``VmHWM`` (``/proc/self/status``), reset
to the current resident size as the window opens (``/proc/self/clear_refs``): it is what
``getrusage(RUSAGE_SELF).ru_maxrss`` reports, without two flaws of the latter here: it
cannot be reset, and a child process may start with its parent's high-water mark (the
kernel carries ``maxrss`` over ``fork``/``exec``), which would hide the window entirely.
Elsewhere the harness falls back on ``ru_maxrss`` and reports which it used.

**The C allocator.** glibc serves a block of at least ``M_MMAP_THRESHOLD`` bytes with a
mapping of its own and unmaps it on free; but by default the threshold rises to the size of
each freed mapped block (up to 32 MiB), after which such blocks come from the heap, whose
freed pages stay resident. On the activation-dominated stack below that left one eager
step's high-water at 825 MiB above the window's start for an allocator-level peak of 749
MiB: 10% that measures glibc's history, not the step. The measuring process therefore runs
with the threshold fixed (``MALLOC_MMAP_THRESHOLD_=131072``; other C libraries ignore it),
every tensor-sized block is its own mapping, and the same step then measures 749 MiB. It
costs page faults on every fresh block (steps in that process run slower), which is why
times come from interleaved rounds in one process, never across processes.

What the number includes: every tensor the window allocates (activations, gradients,
kernel workspaces, profiler buffers), Python objects it creates (graphs, profiles, event
lists) and memory the C allocator keeps after a free (fragmentation). It excludes what
exists before the window: the interpreter, torch, parameters, buffers and inputs. The
planner's budget (scope ``total``) counts parameters, buffers and inputs too, so the
comparable allowance is the bound minus those static bytes.

**The bound.** Planning may take what the plan may take: ``max(budget, stated minimum)``
plus a slack of ``max(5% of that, 64 MiB)`` for Python objects and the allocator
(:func:`planning_bound`).

Writes ``planning.json``, ``planning.csv``, ``planning.md`` and ``planning.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from autockpt.measure import interleaved_seconds, wall_seconds  # noqa: E402

MIB = 2**20
BUDGET_FRACTION = 0.35
"""Where the budget lies between the stated minimum (0) and the no-checkpoint peak (1)."""
SLACK_FRACTION = 0.05
SLACK_MIN_BYTES = 64 * MIB
MMAP_THRESHOLD = 128 * 1024
"""glibc's ``M_MMAP_THRESHOLD`` in the measuring process (see the module docstring)."""
RESULT_MARK = "PLANNING-RESULT "
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# the model whose activations are nearly all of its step
# ---------------------------------------------------------------------------------------------


class ResidualMLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))`` with a ``hidden``-times wider middle: ten saved floats
    per input float for few FLOPs, so the activations are almost all of a step's memory."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """A stack of :class:`ResidualMLPBlock` s and a linear head."""

    def __init__(self, blocks: int, width: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ResidualMLPBlock(width, hidden) for _ in range(blocks)))
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x))


def residual_mlp(
    *, blocks: int = 12, width: int = 32, hidden: int = 4, batch: int = 49152, seed: int = 0
) -> tuple[nn.Module, Tensor]:
    """Activation-dominated stack; input ``randn(batch, width)``. At the defaults the eager
    step peaks near 755 MiB of which 99% are activations, in about 0.35 s on two CPU cores."""
    torch.manual_seed(seed)
    model = ResidualMLP(blocks, width, hidden).train()
    return model, torch.randn(batch, width)


def hf_gpt2_124m(
    *, layers: int = 12, batch: int = 2, seq_len: int = 256, seed: int = 0
) -> tuple[nn.Module, dict[str, Tensor]]:
    """Hugging Face ``GPT2LMHeadModel`` at GPT-2 small's size (124M parameters: vocabulary
    50257, 1024 positions, width 768, 12 heads) from a config: random weights, nothing
    downloaded; inputs ``input_ids`` and ``labels`` of ``batch x seq_len``."""
    import logging

    import transformers

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        config = transformers.GPT2Config(n_layer=layers, use_cache=False)
        torch.manual_seed(seed)
        model = transformers.GPT2LMHeadModel(config).train()
    finally:
        logger.setLevel(level)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": ids.clone()}


# ---------------------------------------------------------------------------------------------
# models measured
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A model to plan: ``factory`` is ``module:function``; ``warmup`` are the overrides of a
    tiny instance planned first in the same process (None: the model itself is tiny)."""

    name: str
    factory: str
    kwargs: dict[str, Any]
    warmup: dict[str, Any] | None = None


HEAVY = Case("residual_mlp", "benchmarks.planning:residual_mlp", {}, {"batch": 256})
HF_GPT2 = Case("hf_gpt2_124m", "benchmarks.planning:hf_gpt2_124m", {}, {"layers": 1, "seq_len": 16})
QUICK_ZOO = ("block_stack", "gpt")


def cases(quick: bool) -> list[Case]:
    """The zoo at its own sizes (less the model checkpointed by hand), GPT-2 small from Hugging
    Face and the activation-dominated stack; ``quick``: two small zoo models."""
    from autockpt_zoo.toy import ZOO

    names = QUICK_ZOO if quick else sorted(n for n in ZOO if n != "gpt_checkpointed")
    zoo = [Case(n, f"autockpt.zoo:{n}", {}) for n in names]
    return zoo if quick else [*zoo, HF_GPT2, HEAVY]


# ---------------------------------------------------------------------------------------------
# the harness: one fresh process per measurement
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WindowResult:
    """What one process measured (bytes and seconds; ``None`` where the action has none)."""

    model: str
    action: str
    rss_source: str
    rss_before_bytes: int
    rss_increase_bytes: int
    window_seconds: float
    static_bytes: int
    gradient_bytes: int
    eager_peak_bytes: int | None = None
    budget_bytes: int | None = None
    minimum_peak_bytes: int | None = None
    no_checkpoint_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    segments: int | None = None
    trains_like_eager: bool | None = None
    train_error: str | None = None
    eager_step_seconds: float | None = None
    plan_step_seconds: float | None = None

    @property
    def activation_share(self) -> float | None:
        """Share of the eager peak above parameters, buffers, inputs and gradients."""
        if not self.eager_peak_bytes:
            return None
        rest = self.eager_peak_bytes - self.static_bytes - self.gradient_bytes
        return rest / self.eager_peak_bytes

    @property
    def bound_bytes(self) -> int | None:
        """:func:`planning_bound` of this plan (``None`` for an eager window)."""
        if self.budget_bytes is None or self.minimum_peak_bytes is None:
            return None
        return planning_bound(self.budget_bytes, self.minimum_peak_bytes)

    @property
    def allowed_increase_bytes(self) -> int | None:
        """The bound less the static bytes that exist before the window opens."""
        bound = self.bound_bytes
        return None if bound is None else bound - self.static_bytes


def planning_bound(budget_bytes: int, minimum_peak_bytes: int) -> int:
    """The most planning may take: what the plan may take, plus a slack for Python objects
    and the C allocator of ``max(5%, 64 MiB)``."""
    fits = max(budget_bytes, minimum_peak_bytes)
    return fits + max(int(SLACK_FRACTION * fits), SLACK_MIN_BYTES)


def run_window(
    case: Case,
    action: str,
    *,
    timing_rounds: int = 0,
    threads: int | None = None,
    timeout_s: float = 1800.0,
) -> WindowResult:
    """Run ``action`` ("plan" or "eager") on ``case`` in a fresh Python process and return
    what it measured. Raises ``RuntimeError`` with the child's output if it fails."""
    if action not in ("plan", "eager"):
        raise ValueError(f"action must be 'plan' or 'eager', got {action!r}")
    request = {
        **asdict(case),
        "action": action,
        "timing_rounds": timing_rounds,
        "threads": threads or max(1, min(2, os.cpu_count() or 1)),
    }
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("KINETO_LOG_LEVEL", "5")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    code = "import sys; from benchmarks.planning import _child; _child(sys.argv[1])"
    # An empty store of measured seconds per window: planning as a model's first plan on a
    # machine pays it (the probe's timing passes, the timed steps of the step factors); a
    # store left by an earlier run skips both (GPT-2: 22.6 s of planning against 62.7 s).
    with tempfile.TemporaryDirectory(prefix="autockpt-store-") as store:
        env["AUTOCKPT_CACHE_DIR"] = store
        done = subprocess.run(
            [sys.executable, "-c", code, json.dumps(request)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=timeout_s,
            check=False,
        )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"{action} window for {case.name} failed (exit {done.returncode}):\n"
            f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
    return WindowResult(**json.loads(lines[-1][len(RESULT_MARK) :]))


class _Resident:
    """Resident size and its high-water mark since :meth:`reset`, in bytes."""

    def __init__(self) -> None:
        self.source = "VmHWM"
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self._status()
        except OSError:
            self.source = "ru_maxrss"

    @staticmethod
    def _status() -> dict[str, int]:
        values = {}
        with open("/proc/self/status") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0]) * 1024
        return values

    def reset(self) -> int:
        """Open a window: reset the high-water mark; return the resident size now."""
        if self.source == "VmHWM":
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            return self._status()["VmRSS"]
        return self._maxrss()

    def high_water(self) -> int:
        return self._status()["VmHWM"] if self.source == "VmHWM" else self._maxrss()

    @staticmethod
    def _maxrss() -> int:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _release_heap() -> None:
    """Collect garbage and give freed C-heap pages back, so the resident size the window
    starts from holds live memory only (nothing planning could reuse for free)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def _build(case: dict[str, Any], overrides: dict[str, Any] | None = None) -> tuple[nn.Module, Any]:
    import importlib

    module, _, function = case["factory"].partition(":")
    factory = getattr(importlib.import_module(module), function)
    return factory(**{**case["kwargs"], **(overrides or {})})


def _plan(model: nn.Module, example: Any) -> tuple[Any, nn.Module, int]:
    """Profile, then optimize at :data:`BUDGET_FRACTION` of the way from the stated minimum
    to the no-checkpoint peak (what ``autockpt.optimize`` does, with the budget known)."""
    import warnings

    from autockpt.api import Planner
    from autockpt.errors import GIB

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = Planner(model, example)
        low, high = planner.minimum_peak_bytes, planner.no_checkpoint_peak_bytes
        budget = int(low + BUDGET_FRACTION * max(0, high - low))
        result = planner.optimize(budget_gb=budget / GIB)
    return planner, result, budget


def _eager_step(model: nn.Module, example: Any) -> None:
    from autockpt.base.runtime import clear_grads, default_loss
    from autockpt.capture import Inputs

    inputs = Inputs.of(example)
    default_loss(model(*inputs.args, **inputs.kwargs)).backward()
    clear_grads(model)


def _seeded_step(model: nn.Module, example: Any) -> tuple[Tensor, dict[str, Tensor]]:
    from autockpt.base.runtime import clear_grads, default_loss
    from autockpt.capture import Inputs

    inputs = Inputs.of(example)
    clear_grads(model)
    torch.manual_seed(1234)
    loss = default_loss(model(*inputs.args, **inputs.kwargs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    clear_grads(model)
    return loss.detach(), grads


def _trains_like_eager(model: nn.Module, result: nn.Module, example: Any) -> str | None:
    """``None`` when one step of ``result`` gives eager's loss and gradients, else why not."""
    try:
        loss, grads = _seeded_step(result, example)
        ref_loss, ref_grads = _seeded_step(model, example)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        if not grads or grads.keys() != ref_grads.keys():
            return f"gradients for {sorted(grads)} vs eager's {sorted(ref_grads)}"
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    except AssertionError as error:
        return " ".join(str(error).split())[:500]
    return None


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients a step allocates (one per distinct trainable storage)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.requires_grad and p.untyped_storage().data_ptr() not in seen:
            seen.add(p.untyped_storage().data_ptr())
            total += p.untyped_storage().nbytes()
    return total


def _interleaved(steps: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median wall time of each step over ``rounds`` interleaved rounds (NOTE [timing:
    interleaved rounds]): wall time, the clock planning's own seconds are read on."""
    return interleaved_seconds(steps, rounds, wall_seconds)


def _child(request_text: str) -> None:
    """The measuring process (see the module docstring); prints one result line."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    request = json.loads(request_text)
    torch.set_num_threads(int(request["threads"]))
    action = request["action"]
    from autockpt.capture import Inputs
    from autockpt.measure import measure, static_bytes

    # One-time costs outside the window: imports, profiler and thread-pool set-up.
    tiny, tiny_example = _build(request, request["warmup"])
    if action == "plan":
        _plan(tiny, tiny_example)
    else:
        _eager_step(tiny, tiny_example)
    del tiny, tiny_example

    model, example = _build(request)
    static = static_bytes(model, Inputs.of(example))
    gradients = gradient_bytes(model)
    _release_heap()
    resident = _Resident()
    before = resident.reset()
    start = time.perf_counter()
    if action == "plan":
        planner, result, budget = _plan(model, example)
    else:
        _eager_step(model, example)
    seconds = time.perf_counter() - start
    increase = resident.high_water() - before

    out: dict[str, Any] = {
        "model": request["name"],
        "action": action,
        "rss_source": resident.source,
        "rss_before_bytes": before,
        "rss_increase_bytes": increase,
        "window_seconds": seconds,
        "static_bytes": static,
        "gradient_bytes": gradients,
    }
    rounds = int(request["timing_rounds"])
    if action == "eager":
        out["eager_peak_bytes"] = measure(model, example, repeat=1).peak_bytes
        if rounds:
            timed = _interleaved({"eager": lambda: _eager_step(model, example)}, rounds)
            out["eager_step_seconds"] = timed["eager"]
    else:
        plan = result.plan
        error = _trains_like_eager(model, result, example)
        out.update(
            budget_bytes=budget,
            minimum_peak_bytes=plan.minimum_peak_bytes,
            no_checkpoint_peak_bytes=plan.no_checkpoint_peak_bytes,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            measured_peak_bytes=measure(result, example, repeat=1).peak_bytes,
            segments=len(plan.segments),
            trains_like_eager=error is None,
            train_error=error,
        )
        del planner
        if rounds:
            timed = _interleaved(
                {
                    "eager": lambda: _eager_step(model, example),
                    "plan": lambda: _eager_step(result, example),
                },
                rounds,
            )
            out["eager_step_seconds"] = timed["eager"]
            out["plan_step_seconds"] = timed["plan"]
    print(RESULT_MARK + json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------


def _row(eager: WindowResult, plan: WindowResult) -> dict[str, Any]:
    step = plan.eager_step_seconds or eager.eager_step_seconds
    measured, predicted = plan.measured_peak_bytes, plan.predicted_peak_bytes
    return {
        "model": plan.model,
        "static_bytes": plan.static_bytes,
        "eager_peak_bytes": eager.eager_peak_bytes,
        "activation_share": eager.activation_share,
        "eager_step_seconds": step,
        "plan_step_seconds": plan.plan_step_seconds,
        "eager_rss_increase_bytes": eager.rss_increase_bytes,
        "planning_seconds": plan.window_seconds,
        "planning_steps": plan.window_seconds / step if step else None,
        "planning_rss_increase_bytes": plan.rss_increase_bytes,
        "budget_bytes": plan.budget_bytes,
        "minimum_peak_bytes": plan.minimum_peak_bytes,
        "no_checkpoint_peak_bytes": plan.no_checkpoint_peak_bytes,
        "bound_bytes": plan.bound_bytes,
        "allowed_increase_bytes": plan.allowed_increase_bytes,
        "within_bound": plan.rss_increase_bytes <= (plan.allowed_increase_bytes or 0),
        "rss_over_allowed": plan.rss_increase_bytes / plan.allowed_increase_bytes
        if plan.allowed_increase_bytes
        else None,
        "predicted_peak_bytes": predicted,
        "measured_peak_bytes": measured,
        "prediction_error": (predicted - measured) / measured if measured and predicted else None,
        "plan_within_budget": measured is not None and measured <= (plan.budget_bytes or 0),
        "segments": plan.segments,
        "trains_like_eager": plan.trains_like_eager,
        "rss_source": plan.rss_source,
    }


def run(quick: bool, out: Path, models: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Measure every case in two fresh processes each; write JSON, CSV, markdown and PNG into
    ``out``; return the rows (a case that fails gets a row with its error)."""
    out.mkdir(parents=True, exist_ok=True)
    chosen = [c for c in cases(quick) if models is None or c.name in models]
    rounds = 3 if quick else 5
    rows: list[dict[str, Any]] = []
    for case in chosen:
        try:
            eager = run_window(case, "eager")
            plan = run_window(case, "plan", timing_rounds=rounds)
        except RuntimeError as error:
            rows.append({"model": case.name, "error": str(error)[-2000:]})
            print(f"{case.name:<22} error: {str(error).splitlines()[0]}", flush=True)
            continue
        rows.append(_row(eager, plan))
        print(_line(rows[-1]), flush=True)
    _write(rows, out)
    return rows


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / MIB:.1f}"


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['model']:<22} planning +{_mib(row['planning_rss_increase_bytes'])} MiB RSS "
        f"(allowed {_mib(row['allowed_increase_bytes'])}, one eager step "
        f"+{_mib(row['eager_rss_increase_bytes'])}) in {row['planning_steps']:.1f} eager steps; "
        f"predicted {_mib(row['predicted_peak_bytes'])} vs measured "
        f"{_mib(row['measured_peak_bytes'])} MiB"
    )


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    """One row per model: step, planning time and memory, the bound, the plan's peaks."""
    lines = [
        "| model | eager peak (MiB) | activations | eager step (s) | planning (s) "
        "| planning (eager steps) "
        "| eager step RSS + (MiB) | planning RSS + (MiB) | allowed + (MiB) | within bound "
        "| budget (MiB) | stated minimum (MiB) | predicted (MiB) | measured (MiB) "
        "| prediction error | trains like eager |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error'].splitlines()[0][:80]} |" + " |" * 14)
            continue
        error = r["prediction_error"]
        lines.append(
            f"| {r['model']} | {_mib(r['eager_peak_bytes'])} | {r['activation_share']:.0%} "
            f"| {r['eager_step_seconds']:.3f} | {r['planning_seconds']:.1f} "
            f"| {r['planning_steps']:.1f} "
            f"| {_mib(r['eager_rss_increase_bytes'])} | {_mib(r['planning_rss_increase_bytes'])} "
            f"| {_mib(r['allowed_increase_bytes'])} | {'yes' if r['within_bound'] else 'NO'} "
            f"| {_mib(r['budget_bytes'])} | {_mib(r['minimum_peak_bytes'])} "
            f"| {_mib(r['predicted_peak_bytes'])} | {_mib(r['measured_peak_bytes'])} "
            f"| {'' if error is None else f'{100 * error:+.1f}%'} "
            f"| {'yes' if r['trains_like_eager'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def _write(rows: list[dict[str, Any]], out: Path) -> None:
    (out / "planning.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "planning.md").write_text(summary_markdown(rows))
    keys = sorted({k for row in rows for k in row})
    with open(out / "planning.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    good = [r for r in rows if "error" not in r]
    if not good:
        return
    from matplotlib.figure import Figure  # a bare Figure: no pyplot global state

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    memory, timing = fig.subplots(1, 2)
    names = [r["model"] for r in good]
    at = range(len(good))
    width = 0.27
    memory.bar(
        [i - width for i in at],
        [r["eager_rss_increase_bytes"] / MIB for r in good],
        width,
        label="one eager step",
        color="tab:gray",
    )
    memory.bar(
        list(at),
        [r["planning_rss_increase_bytes"] / MIB for r in good],
        width,
        label="planning",
        color="tab:blue",
    )
    memory.bar(
        [i + width for i in at],
        [r["allowed_increase_bytes"] / MIB for r in good],
        width,
        label="allowed (budget bound less static)",
        color="tab:green",
    )
    memory.set_xticks(list(at), names, rotation=30, ha="right", fontsize=8)
    memory.set_ylabel("resident high-water increase (MiB)")
    memory.set_title("planning's memory against the bound")
    memory.legend(fontsize=7)
    timing.bar(list(at), [r["planning_steps"] for r in good], color="tab:blue")
    timing.set_xticks(list(at), names, rotation=30, ha="right", fontsize=8)
    timing.set_yscale("log")
    timing.set_ylabel("planning wall time / eager step time")
    timing.set_title("planning time in eager steps")
    fig.savefig(out / "planning.png", dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("out/planning"))
    parser.add_argument("--models", default=None, help="comma-separated case names")
    args = parser.parse_args(argv)
    models = tuple(args.models.split(",")) if args.models else None
    run(args.quick, args.out, models)


if __name__ == "__main__":
    main()

"""The one time model: the seconds the solver ranks plans by are the seconds plans report.

NOTE [timing: one time model]. A plan's cost is the time its recompute adds to a step: the
forward seconds of every node it recomputes plus a fixed cost per checkpointed segment (and
per kept operator, :mod:`solvers.selective`). Those seconds are *measured*: the probe runs
every node alone on the device (NOTE [profile: probe]), the median over its timing passes,
and a segment's fixed cost is measured once per machine (:func:`segment_seconds`). The
search ranks plans by exactly these numbers and the plan reports them
(``predicted_recompute_seconds``, ``predicted_step_seconds``), so "least recompute" means
least under the seconds the user is shown. Before, the ranking used a nominal roofline (FLOPs
and bytes at fixed rates), which on a 2-core CPU priced layer norms, GELUs and dropouts at a
seventh of their measured time and matrix multiplies at half: plans it called cheapest were
not the fastest measured (issue "Speed that holds").

NOTE [timing: stored]. Measured times differ from process to process (a busy machine), and
plans must not (the brief's "deterministic plans"). The first process to time a model on a
machine stores what it measured; every later process, and every process timing it at the
same moment, uses the stored times instead of its own. The store is a directory of small
JSON files (``AUTOCKPT_CACHE_DIR``, default ``~/.cache/autockpt``), one per key: the
graph's structure, the parameters' shapes and dtypes, the inputs' signature, the precision
and the loss, the device (its model name), the number of threads and the torch version. A file is published atomically and never replaced (``os.link`` fails when it
exists: of processes racing, the first wins and the others read its file), so the same request
ranks its plans by the same seconds in every process of the machine. Ranks of a distributed
job need no store: rank 0 plans and broadcasts. Without a probe (the meta device,
``Planner(probe=False)``) the nominal model stays (NOTE [profile: cost model]), and so it does
when ``AUTOCKPT_CACHE_DIR`` is set to an empty string (nothing stored: a process's own
measurement would make its plans its own; the measured seconds are then only reported).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autockpt.base.runtime import now

TIMING_PASSES = 3
"""Timing passes of the probe (each runs every node once, forward and backward); a node's
seconds are its median over them: one burst of load on a shared machine moves it little,
and a step is timed as the median of steps (the sum of every node's minimum was 16-26%
below the measured median step of a GPT on a 2-core CPU; docs/design.md "One time
model")."""

STEP_ROUNDS = 5
"""Timed steps of the first verified plan (after one untimed step), at most: their median
forward and step times give the step factors (NOTE [timing: step factors])."""

STEP_TIMING_SECONDS = 2.0
"""Planning stops timing the first verified plan's steps once they took this long together
(at least one is timed): on a model whose step takes seconds, five timed steps doubled
planning (Hugging Face GPT-2 124M: 29 of 62 s in verifying, docs/planning.md), and a long
step's median needs fewer samples. Steps up to 0.4 s still get all :data:`STEP_ROUNDS`."""

STEP_FACTOR_RANGE = (0.2, 5.0)
"""Factors outside it are clamped: a step timed during a burst of load on a shared machine
must not make every later prediction of the model absurd."""

STORE_VERSION = 1
"""Bumped when what a stored file means changes: older files are then not read."""

_WRITTEN_HERE: set[str] = set()
"""Timing files this process stored: read back, they are its own seconds, not an earlier
process's (``Timing.reused``, and the plan's note that says which)."""


@dataclass(frozen=True)
class Timing:
    """Measured seconds of one model's step on one machine: per compute node its forward
    and backward alone, and the fixed cost of one checkpointed segment."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    segment: float
    loss: float = 0.0
    """The loss's forward and backward (reported in the step; no plan changes it)."""
    stored: str | None = None
    """The file the seconds were read from or written to (None: nothing stored)."""
    reused: bool = False
    """Whether another process measured them (read from a file this process did not
    write: this one's own times were not used)."""
    factors: StepFactors | None = None
    """How the step ran against its nodes timed alone, once a verified plan timed it
    (NOTE [timing: step factors]; None: not yet, or nothing stored)."""

    @property
    def ranks(self) -> bool:
        """Whether plans are ranked by these seconds: only stored ones, which every process
        of the machine shares (else the cost model ranks: NOTE [timing: stored])."""
        return self.stored is not None

    def stored_at(self, path: str) -> Timing:
        return dataclasses.replace(self, stored=path, reused=False)

    @property
    def forward_factor(self) -> float:
        """What reported forward and recompute seconds are the nodes' times multiplied by."""
        return self.factors.forward if self.factors is not None and self.ranks else 1.0

    @property
    def backward_factor(self) -> float:
        return self.factors.backward if self.factors is not None and self.ranks else 1.0

    def step_seconds(self) -> float:
        """The step without checkpointing as reported: forward and backward node seconds at
        their factors, plus the loss."""
        return (
            self.forward_factor * sum(self.forward)
            + self.backward_factor * sum(self.backward)
            + self.loss
        )

    def with_stored_factors(self) -> Timing:
        """This timing with the factors stored beside it, if a verified plan stored any."""
        if self.stored is None or self.factors is not None:
            return self
        found = _read_factors(stored_beside(self, "step"))
        return self if found is None else dataclasses.replace(self, factors=found)


@dataclass(frozen=True)
class StepFactors:
    """Measured step against the node times (NOTE [timing: step factors])."""

    forward: float
    backward: float
    measured_forward: float
    """The timed step's forward and whole step (seconds), and the plan's recompute seconds
    (ranked, before factors) they were read against: what the factors came from."""
    measured_step: float
    recompute: float


def step_factors(
    timing: Timing, recompute: float, measured_forward: float, measured_step: float
) -> StepFactors:
    """The factors of NOTE [timing: step factors] from one timed plan whose ranked
    recompute seconds are ``recompute``."""
    low, high = STEP_FACTOR_RANGE
    forward = min(high, max(low, measured_forward / max(sum(timing.forward), 1e-9)))
    backward_measured = measured_step - measured_forward - forward * recompute - timing.loss
    backward = min(high, max(low, backward_measured / max(sum(timing.backward), 1e-9)))
    return StepFactors(forward, backward, measured_forward, measured_step, recompute)


def settle_factors(timing: Timing, factors: StepFactors) -> Timing:
    """``timing`` with the factors every process uses: those already stored beside it, else
    ``factors``, stored now (published once, like the node times)."""
    if timing.stored is None:
        return timing
    path = stored_beside(timing, "step")
    assert path is not None
    publish(path, {"version": STORE_VERSION, **dataclasses.asdict(factors)})
    found = _read_factors(path)
    return dataclasses.replace(timing, factors=found or factors)


def _read_factors(path: Path | None) -> StepFactors | None:
    data = read_stored(path) if path is not None else None
    try:
        return (
            None
            if data is None
            else StepFactors(*(float(data[f.name]) for f in dataclasses.fields(StepFactors)))
        )
    except (KeyError, TypeError, ValueError):
        return None


def stored_beside(timing: Timing | None, suffix: str) -> Path | None:
    """A file stored beside ``timing``'s node seconds (same key, ``suffix`` added), where
    other measurements of the same request on this machine are published once too; None
    where nothing is stored."""
    if timing is None or timing.stored is None:
        return None
    return Path(timing.stored).with_suffix(f".{suffix}.json")


def read_stored(path: Path) -> dict[str, Any] | None:
    """A file :func:`publish` wrote (None: none, unreadable, or of another version)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == STORE_VERSION else None


def publish(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically unless a file is there already (then the
    first writer's stays: NOTE [timing: stored]); a store that cannot be written is left."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
            json.dump(payload, out)
        try:
            os.link(out.name, path)  # atomic, and never over an existing file
        except FileExistsError:
            pass
        finally:
            os.unlink(out.name)


def store_dir() -> Path | None:
    """Where measured times are stored (``AUTOCKPT_CACHE_DIR``, default
    ``~/.cache/autockpt``), or None when the variable is set to an empty string."""
    configured = os.environ.get("AUTOCKPT_CACHE_DIR")
    if configured is not None:
        return Path(configured).expanduser() / "timing" if configured.strip() else None
    return Path.home() / ".cache" / "autockpt" / "timing"


def timing_key(
    fingerprint: str,
    model: nn.Module,
    input_signature: str,
    precision: Any,
    device: torch.device,
) -> str:
    """What a stored timing is for (NOTE [timing: stored]), hashed."""
    shapes = [
        (name, list(t.shape), str(t.dtype))
        for name, t in (*model.named_parameters(), *model.named_buffers())
    ]
    described = json.dumps(
        {
            "version": STORE_VERSION,
            "graph": fingerprint,
            "tensors": shapes,
            "inputs": input_signature,
            "precision": repr(precision),
            "device": device_name(device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(described.encode()).hexdigest()[:32]


def device_name(device: torch.device) -> str:
    """The device's model: a GPU's name, or the CPU's model and core count."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{_cpu_model()}:{os.cpu_count()}"


@functools.cache
def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def clear_store() -> int:
    """Delete every stored timing file; how many were deleted."""
    folder = store_dir()
    if folder is None or not folder.is_dir():
        return 0
    deleted = 0
    for path in folder.glob("*.json"):
        with contextlib.suppress(OSError):
            path.unlink()
            deleted += 1
    return deleted


def lookup(key: str, nodes: int) -> Timing | None:
    """The stored timing for ``key`` (of a graph of ``nodes`` compute nodes), if any."""
    folder = store_dir()
    return None if folder is None else _read(folder / f"{key}.json", nodes)


def settle(key: str, measured: Timing) -> Timing:
    """The timing every process uses for ``key``: the stored one when a file exists, else
    ``measured``, stored now (NOTE [timing: stored]). A store that cannot be written (a
    read-only home) leaves ``measured`` as it is."""
    folder = store_dir()
    if folder is None:
        return measured
    path = folder / f"{key}.json"
    payload = {
        "version": STORE_VERSION,
        "forward": list(measured.forward),
        "backward": list(measured.backward),
        "segment": measured.segment,
        "loss": measured.loss,
    }
    publish(path, payload)
    found = _read(path, len(measured.forward))
    if found is None:
        return measured
    # this process's file when it won the race: its own seconds, not reused
    if found.forward != measured.forward:
        return found
    _WRITTEN_HERE.add(str(path))
    return measured.stored_at(str(path))


def _read(path: Path, nodes: int) -> Timing | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("version") != STORE_VERSION or len(data.get("forward", ())) != nodes:
        return None
    return Timing(
        forward=tuple(float(s) for s in data["forward"]),
        backward=tuple(float(s) for s in data["backward"]),
        segment=float(data["segment"]),
        loss=float(data.get("loss", 0.0)),
        stored=str(path),
        reused=str(path) not in _WRITTEN_HERE,
    ).with_stored_factors()


def segment_seconds(device: torch.device, rounds: int = 50) -> float:
    """The fixed cost of one checkpointed segment on ``device``: a non-reentrant
    ``torch.utils.checkpoint`` around a one-operator function on a tiny tensor, forward and
    backward, less the same without the checkpoint (the minimum of each over ``rounds``
    interleaved rounds; the recompute of the one operator is included, a few microseconds)."""
    x = torch.ones(16, device=device, requires_grad=True)

    def twice(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    def once(checkpointed: bool) -> float:
        start = now(device)
        y = checkpoint(twice, x, use_reentrant=False) if checkpointed else twice(x)
        y.sum().backward()
        return now(device) - start

    with torch.enable_grad():
        plain = wrapped = float("inf")
        for _ in range(max(2, rounds)):
            wrapped = min(wrapped, once(True))
            plain = min(plain, once(False))
    x.grad = None
    return max(0.0, wrapped - plain)

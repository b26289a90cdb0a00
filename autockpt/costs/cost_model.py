"""The nominal cost model: node seconds computed from the graph where nothing is measured.

The profile (autockpt/costs/profile.py) prices a node with :func:`estimated_seconds` when no
probe runs (the meta device, ``estimate_times``), and takes from here the fixed cost of a
checkpoint segment where none is measured; the planner takes the cost of a kept node
(selective recompute). Its own module because it is numbers alone, apart from the fake step
and the probe that the profile runs.
"""

from __future__ import annotations

import torch

from autockpt.base.target import Target

# NOTE [profile: cost model]. Where nothing is measured (the meta device, a planner without
# a probe), the solvers' recompute cost is a fixed function of the graph: a roofline of each
# node's FLOPs and memory traffic at nominal rates for its device class, plus a fixed
# per-node dispatch cost. Where the probe runs, the measured seconds replace it (NOTE
# [timing: one time model]).
NOMINAL_RATES: dict[str, tuple[float, float, float]] = {
    # device type: (FLOP/s, bytes/s, seconds per node)
    "cpu": (50e9, 10e9, 10e-6),
    "cuda": (100e12, 2e12, 10e-6),
    "meta": (100e12, 2e12, 10e-6),
}


KEEP_OVERHEAD_SECONDS: dict[str, float] = {"cpu": 50e-6, "cuda": 20e-6, "meta": 20e-6}
"""What keeping one node's output inside a segment (selective recompute) costs, in the cost
model's seconds: two marker calls and a dispatch mode around the node's few operators, in
the forward and in the recompute (autockpt/rewrite/, ``_KeepCalls``). A node is kept only
where its own cost is higher. Measured on a 2-core CPU: see docs/design.md, "Selective
recompute"."""


SEGMENT_OVERHEAD_SECONDS: dict[str, float] = {"cpu": 100e-6, "cuda": 50e-6, "meta": 50e-6}
"""Fixed cost of one checkpoint segment (saved-tensor hooks, recompute dispatch) per device
class, in the cost model's seconds: it keeps the solvers from cutting a cheap model into
many tiny segments."""


Rates = tuple[float, float, float]
"""(FLOP/s, bytes/s, seconds per node): what a roofline prices a node with."""


def rates_of(target: Target | None, device_type: str, dtype: torch.dtype) -> Rates:
    """The roofline's rates: ``target``'s peak for ``dtype`` and its bandwidth (NOTE
    [target: planning for another device]), else the nominal rates of ``device_type``."""
    if target is None:
        return NOMINAL_RATES.get(device_type, NOMINAL_RATES["cuda"])
    return (target.flop_rate(dtype), target.bandwidth, NOMINAL_RATES["cuda"][2])


def estimated_seconds(flops: int, traffic_bytes: int, rates: Rates | str = "cuda") -> float:
    """The cost model's forward seconds of one node (NOTE [profile: cost model]): the slower of
    its arithmetic and its memory traffic (bytes read and written) at ``rates`` (or the
    nominal rates of a device type), plus a fixed per-node cost."""
    if isinstance(rates, str):
        rates = NOMINAL_RATES.get(rates, NOMINAL_RATES["cuda"])
    flop_rate, byte_rate, per_node = rates
    return max(flops / flop_rate, traffic_bytes / byte_rate) + per_node

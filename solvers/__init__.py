"""Torch-free checkpoint-segment solvers for a chain of stages under a memory budget.

The chain model and its reference simulator live in :mod:`solvers.chain`; every method
is scored by :func:`simulate`. Methods (one module each): exact suffix DP
(:mod:`solvers.dp`), MILP via PuLP/CBC (:mod:`solvers.ilp`), Chen et al.'s sqrt(L)
baseline (:mod:`solvers.sqrt`) and budget-aware greedy (:mod:`solvers.greedy`);
:func:`solve` dispatches and ``"auto"`` runs a portfolio (:mod:`solvers.auto`).

The proxy is not what the user sees: :mod:`solvers.replay` replays one recorded step under
a plan, and :mod:`solvers.search` searches plans under that replay directly
(:func:`least_recompute`, :func:`leanest` on a :class:`ReplayChain`).

This package must never import torch.
"""

from .auto import METHODS, minimum_peak_bytes, solve
from .chain import ChainProblem, Simulation, simulate
from .search import ReplayChain, leanest, least_recompute, recompute_seconds, replay_peak
from .solution import InfeasibleError, Solution

__all__ = [
    "ChainProblem",
    "InfeasibleError",
    "METHODS",
    "ReplayChain",
    "Simulation",
    "Solution",
    "leanest",
    "least_recompute",
    "minimum_peak_bytes",
    "recompute_seconds",
    "replay_peak",
    "simulate",
    "solve",
]

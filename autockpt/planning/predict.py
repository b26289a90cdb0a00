"""The one memory model and the one scope rule, for every plan of a prepared model.

:class:`Predictor` answers "what does this plan cost": its peak is the replay of the
recorded step (:mod:`solvers.replay`) under the plan, counted as the budget's scope counts
it (:func:`autockpt.plan.scoped_bytes`) and moved to a rank when sharded; its recompute
seconds are the probe's measured node times. The budget search ranks plans by exactly this
peak (it reads :attr:`Predictor.replay_chain` and calls :meth:`Predictor.predict`), the
verification loop compares a measurement with it, and the plan records it: one model,
so that what the solver optimises is what the plan reports.

Plans are given as stage ranges (``[start, end)`` of the chain's stages, what solvers
speak) and, per range, the compute nodes kept inside it (selective recompute); the replay
speaks node ranges, and :meth:`Predictor.node_ranges` is the one translation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from autockpt.costs.problem import NodeRange, StageRange
from autockpt.costs.profile import KEEP_OVERHEAD_SECONDS, NodeProfile
from autockpt.plan import MemoryTimeline, scoped_bytes
from autockpt.planning.prepared import Prepared
from autockpt.planning.specs import buffers_used, state_tensor
from solvers import Simulation, replay, simulate
from solvers.search import ReplayChain


class Predictor:
    """Predictions for any plan of one :class:`~autockpt.planning.prepared.Prepared`."""

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        problem = prepared.chain.problem
        self.replay_chain = ReplayChain(
            trace=prepared.trace,
            stages=tuple(prepared.chain.stages),
            stage_seconds=problem.forward_seconds,
            random=tuple(self._stage_flags(lambda node: node.random)),
            stash_bytes=tuple(self._stage_stash_bytes()),
            segment_overhead_seconds=problem.segment_overhead_seconds,
            offset_bytes=self.in_scope(0),
            problem=problem,
            # a rank's peak: each replayed moment moved by its event's difference (NOTE
            # [search: per-rank peaks])
            rank_shift=prepared.rank_shift,
            # what keeping a node saves: its cost, less what keeping it costs; only nodes
            # that do arithmetic (docs/design.md, "Selective recompute")
            node_seconds=tuple(
                max(0.0, node.cost_seconds - self.keep_overhead) if node.flops > 0 else 0.0
                for node in prepared.profile.nodes
            ),
        )
        """The chain and recorded step as the torch-free search takes them
        (:class:`solvers.search.ReplayChain`)."""

    # -- the scope rule -------------------------------------------------------------------

    def in_scope(self, total_bytes: int) -> int:
        """A single-process step's total bytes as the budget's scope counts them
        (:func:`autockpt.plan.scoped_bytes`, with this profile's static part)."""
        prof = self.prepared.profile
        return scoped_bytes(
            total_bytes, self.prepared.request.scope, prof.static_bytes + prof.param_grad_bytes
        )

    def rank_shift(self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()) -> int:
        """Per-rank minus single-process prediction of a plan: verification measures one
        unsharded process and moves the result to a rank by this difference (what sharding
        changes is static and engine memory; what the profile missed stays the same)."""
        return self.predict(segments, kept) - self.predict_single(segments, kept)

    # -- predictions ----------------------------------------------------------------------

    def predict(self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()) -> int:
        """Predicted peak (in the budget's scope, per rank when sharded) of a plan given as
        stage ranges (and, per range, the compute nodes kept inside it: selective
        recompute): the plan simulator's replay of the recorded step, for one rank each
        moment moved by its event's difference (NOTE [search: per-rank peaks]): the number
        the search compares (``ReplayChain.peak``)."""
        if self.replay_chain.rank_shift is None:
            return self.predict_single(segments, kept)
        return self.replay_chain.peak(list(segments), kept or None)

    def predict_single(
        self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()
    ) -> int:
        """The plan's peak in one unsharded process (in the budget's scope)."""
        node_ranges, stash = self.node_ranges(segments)
        simulated = replay.simulate(
            self.prepared.trace, node_ranges, stash, kept or None
        ).peak_bytes
        return self.in_scope(simulated)

    def moments(
        self, curve: list[tuple[str, int, int]], segments: Sequence[StageRange]
    ) -> list[tuple[str, int, int]]:
        """A replayed curve (``(phase, node, bytes)`` slots) as the budget counts it: per
        rank when sharded, else in the budget's scope."""
        shift = self.replay_chain.rank_shift
        if shift is None:
            return [(phase, node, self.in_scope(b)) for phase, node, b in curve]
        moved = shift.moments(curve, segments, self.replay_chain.stages)
        return [(phase, node, b) for (phase, node, _), b in zip(curve, moved, strict=True)]

    def recompute_seconds(
        self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()
    ) -> float:
        """Seconds a plan adds to a step: the measured forward seconds of the nodes it
        recomputes (not those kept inside a segment, which cost ``KEEP_OVERHEAD_SECONDS``
        each) plus the measured fixed cost per segment (the cost model's where nothing was
        measured): the seconds the solvers rank plans by (NOTE [timing: one time model])."""
        prof = self.prepared.profile
        nodes = prof.nodes
        skipped = {i for nodes_kept in kept for i in nodes_kept}
        seconds = sum(
            nodes[i].cost_seconds
            for first, stop in self.node_ranges(segments)[0]
            for i in range(first, stop)
            if i not in skipped
        )
        seconds += self.keep_overhead * len(skipped)  # keeping is not free either
        seconds += prof.segment_overhead_seconds * len(segments)
        # at the step's forward factor: one positive constant, the ranking's order kept
        # (NOTE [timing: step factors])
        return prof.forward_factor * seconds

    def simulate(self, segments: Sequence[StageRange]) -> Simulation:
        """The prediction for checkpointing the given stage ranges: the stage proxy's
        simulation with its peak replaced by :meth:`predict`'s and its recompute seconds by
        :meth:`recompute_seconds`'."""
        return dataclasses.replace(
            simulate(self.prepared.chain.problem, segments),
            peak_bytes=self.predict(segments),
            recompute_seconds=self.recompute_seconds(segments),
        )

    def timeline(
        self, segments: Sequence[StageRange], kept: Sequence[Sequence[int]] = ()
    ) -> MemoryTimeline:
        """The plan simulator's curve of one step, without checkpointing and with the plan,
        folded onto the chain's events (what ``autockpt show --plot`` draws): each event's
        bytes are the highest the replay reaches while that stage runs that phase, so the
        curves' maxima are :meth:`predict`'s peaks."""
        chain, trace = self.prepared.chain, self.prepared.trace
        problem = chain.problem
        node_ranges, stash = self.node_ranges(segments)
        stage_of = {
            i: k for k, (first, stop) in enumerate(chain.stages) for i in range(first, stop)
        }
        segment_stages = {
            chain.node_range(start, end)[0]: range(start, end) for start, end in segments
        }
        last = chain.num_stages - 1

        def fold(
            curve: list[tuple[str, int, int]], plan: Sequence[StageRange]
        ) -> dict[tuple[str, int], int]:
            peaks: dict[tuple[str, int], int] = {}
            for phase, node, nbytes in self.moments(curve, plan):
                if phase == "recompute":
                    keys = [("r", k) for k in segment_stages[node]]
                elif phase == "backward":
                    keys = [("b", stage_of.get(node, last))]
                else:  # prologue, forward, loss
                    # a prologue window of a node (a cached autocast cast) is its stage's
                    keys = [("f", stage_of.get(node, 0 if phase == "prologue" else last))]
                for key in keys:
                    peaks[key] = max(peaks.get(key, 0), nbytes)
            return peaks

        def events(
            order: list[tuple[str, int]], peaks: dict[tuple[str, int], int]
        ) -> tuple[int, ...]:
            values, carried = [], 0
            for key in order:
                carried = peaks.get(key, carried)
                values.append(carried)
            return tuple(values)

        letter = {"forward": "f", "recompute": "r", "backward": "b"}
        plan_order = [(letter[phase], k) for phase, k, _ in simulate(problem, segments).timeline]
        base_order = [("f", k) for k in range(last + 1)] + [("b", k) for k in range(last, -1, -1)]
        return MemoryTimeline(
            phases="".join(phase for phase, _ in plan_order),
            stages=tuple(k for _, k in plan_order),
            plan_bytes=events(
                plan_order,
                fold(replay.timeline(trace, node_ranges, stash, kept or None), segments),
            ),
            no_checkpoint_bytes=events(base_order, fold(replay.timeline(trace, []), [])),
            # The seconds the plan's tables report (measured node by node by the probe,
            # :meth:`recompute_seconds`), not the solvers' cost model: one time in every
            # report of a plan.
            stage_forward_seconds=tuple(
                round(sum(self.prepared.profile.nodes[i].forward_seconds for i in range(a, b)), 9)
                for a, b in chain.stages
            ),
            stage_backward_seconds=tuple(round(t, 9) for t in problem.backward_seconds),
        )

    # -- stage ranges to what the replay takes --------------------------------------------

    def node_ranges(self, segments: Sequence[StageRange]) -> tuple[list[NodeRange], list[int]]:
        """Compute-node ranges of stage ranges, and the bytes each segment stashes (its RNG
        state when it holds a random op, snapshots of the buffers it restores)."""
        chain = self.prepared.chain
        node_ranges = [chain.node_range(start, end) for start, end in segments]
        return node_ranges, self.replay_chain.preserve_rng(segments)

    @property
    def keep_overhead(self) -> float:
        """What keeping one node's output inside a segment costs on this device."""
        device = self.prepared.profile.device.split(":")[0]
        return KEEP_OVERHEAD_SECONDS.get(device, KEEP_OVERHEAD_SECONDS["cuda"])

    def _stage_flags(self, flag: Callable[[NodeProfile], bool]) -> list[bool]:
        nodes = self.prepared.profile.nodes
        return [
            any(flag(nodes[i]) for i in range(first, stop))
            for first, stop in self.prepared.chain.stages
        ]

    def _stage_stash_bytes(self) -> list[int]:
        """Per stage, the bytes of the mutated buffers (and parameters the forward writes,
        NOTE [runtime: parameters the forward writes]) its nodes touch: a segment holding
        the stage snapshots them at its forward and again while it recomputes
        (autockpt/rewrite/segment.py, ``_BufferState``). Sizes are the buffers' as the
        recorded step leaves them: a forward may replace one (a table built on the first
        call)."""
        prepared = self.prepared
        mutated = set(prepared.profile.mutated_buffers)
        nodes = prepared.capture.compute_nodes()
        after = dict(prepared.trace.buffer_bytes)
        return [
            sum(
                after.get(name, state_tensor(prepared.model, name).nbytes)
                for name in buffers_used(nodes[first:stop], mutated)
            )
            for first, stop in prepared.chain.stages
        ]

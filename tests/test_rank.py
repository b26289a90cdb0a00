"""One rank's peak moment by moment (``solvers/rank.py``): what FSDP2's gathered units add
by plan (NOTE [search: gathered units]) and what the loss and the first backward moment add
(NOTE [sharding: reshard after forward]). The search's exactness under them is
tests/test_search.py's (brute force per rank, these terms drawn)."""

from __future__ import annotations

import dataclasses

import pytest

from solvers.chain import ChainProblem
from solvers.rank import RankShift, UnitGathers

# four stages: the root's code, two units of 10 bytes, then the root's code again
RESHARDED = UnitGathers(resharded=(0, 10, 10, 0), kept=(0, 0, 0, 0), largest=10, counted=20)
KEPT = UnitGathers(resharded=(0, 0, 0, 0), kept=(0, 10, 10, 0), largest=0, counted=20)


def test_a_kept_stage_holds_the_two_units_the_static_part_counts():
    for stage in range(4):
        assert RESHARDED.backward(stage) == 0


def test_a_segment_holds_its_recomputed_units_until_their_backward():
    # one segment over both units: the recompute gathers both, and each stays gathered until
    # its own backward ends (FSDP2 does not reshard after a forward inside the backward)
    assert RESHARDED.recompute(2, start=1, end=3) == 10 + 10 + 10 - 20  # and the last output
    assert RESHARDED.backward(2, start=1) == 10 + 10 - 20  # nothing prefetched before it
    assert RESHARDED.backward(1, start=1) == 0
    two_more = dataclasses.replace(RESHARDED, resharded=(10, 10, 10, 0))  # a unit before
    assert two_more.backward(2, start=1) == 10 + 10 + 10 - 20  # that one prefetched


def test_units_kept_gathered_are_held_from_their_forward_to_their_backward():
    assert KEPT.backward(3) == 20 - 20 and KEPT.backward(2) == 0
    three = dataclasses.replace(KEPT, kept=(0, 10, 10, 10), counted=20)
    assert three.backward(3) == 10 and three.backward(2) == 0
    assert three.recompute(1, start=1, end=4) == 10  # every kept unit of the segment


def test_the_loss_and_the_first_backward_moment_move_a_rank():
    single = ChainProblem((1, 1), (1, 1), (1.0, 1.0), 0)
    shift = RankShift(single, single, loss_bytes=-7, backward_start_bytes=5)
    stages = [(0, 1), (1, 2)]
    slots = [
        ("forward", 0, 100),
        ("forward", 1, 100),
        ("loss", -1, 100),
        ("backward", 1, 100),
        ("backward", 0, 100),
    ]
    assert shift.moments(slots, [], stages) == [100, 100, 93, 105, 100]
    assert shift.least_bytes == -7  # a lower bound of every moment's difference


def test_bad_terms_are_refused():
    with pytest.raises(ValueError, match="one entry per stage"):
        UnitGathers((0, 1), (0,), 0, 0)
    with pytest.raises(ValueError, match="negative"):
        UnitGathers((0,), (-1,), 0, 0)
    single = ChainProblem((1, 1), (1, 1), (1.0, 1.0), 0)
    with pytest.raises(ValueError, match="units needs one entry per stage"):
        RankShift(single, single, units=UnitGathers((0,), (0,), 0, 0))
    with pytest.raises(ValueError, match="backward_start_bytes"):
        RankShift(single, single, backward_start_bytes=-1)

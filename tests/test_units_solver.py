"""solvers.units: choosing one plan per unit of a step run unit after unit (torch-free),
against brute force over every choice."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from solvers.units import UnitOption, leanest, least_seconds, step_peak, step_seconds

_option = st.builds(
    UnitOption,
    peak_bytes=st.integers(0, 100),
    held_bytes=st.integers(0, 60),
    seconds=st.integers(0, 20).map(float),
)
_units = st.lists(st.lists(_option, min_size=1, max_size=4), min_size=1, max_size=5)


def _choices(options):
    return itertools.product(*(range(len(unit)) for unit in options))


@settings(max_examples=200, deadline=None)
@given(_units, st.integers(0, 300))
def test_least_seconds_is_the_cheapest_choice_that_fits(options, budget):
    fitting = [c for c in _choices(options) if step_peak(options, c) <= budget]
    found = least_seconds(options, budget)
    if not fitting:
        assert found is None
        return
    assert found is not None and step_peak(options, found) <= budget
    assert step_seconds(options, found) == min(step_seconds(options, c) for c in fitting)


@settings(max_examples=200, deadline=None)
@given(_units)
def test_leanest_has_the_least_peak(options):
    found = leanest(options)
    assert step_peak(options, found) == min(step_peak(options, c) for c in _choices(options))


def test_earlier_units_hold_while_later_ones_run():
    # unit 0 holds 50 while unit 1 peaks at 40: 90, unless unit 0 is checkpointed (holds 5)
    options = [
        [UnitOption(60, 50, 0.0), UnitOption(70, 5, 3.0)],
        [UnitOption(40, 30, 0.0)],
    ]
    assert step_peak(options, (0, 0)) == 90 and step_peak(options, (1, 0)) == 70
    assert least_seconds(options, 90) == (0, 0)
    assert least_seconds(options, 89) == (1, 0)
    assert least_seconds(options, 69) is None
    assert leanest(options) == (1, 0)

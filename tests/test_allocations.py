"""The one storage-identity rule (autockpt/base/allocations.py): distinct storages of the
static part, on real, fake and meta tensors, for every consumer (profile, record, measure,
planning inside a submodule)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from autockpt.base.allocations import (
    AllocatorEvent,
    Mark,
    StorageSet,
    deltas_within,
    static_bytes,
    storage_key,
)
from autockpt.base.inputs import Inputs
from autockpt.base.runtime import fake_step
from autockpt.measure import static_bytes as measured_static_bytes

# Parameters: a.weight 64 B (tied to b.weight), a.bias 16, b.bias 16, child 32 + 8 = 136 B;
# the buffer 12 B; the input 32 B, its row a view of it, the buffer passed in again.
PARAMETERS, BUFFERS, INPUTS = 136, 12, 32


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.register_buffer("buf", torch.zeros(3))
        self.child = nn.Sequential(nn.Linear(4, 2))


def _case(device: str) -> tuple[Tied, Inputs]:
    with torch.device(device):
        model, x = Tied(), torch.randn(2, 4)
    return model, Inputs((x, x[0], model.buf), {})


def _by_kind(model: nn.Module, inputs: Inputs) -> tuple[int, int, int]:
    storages = StorageSet()  # the profile's order: parameters, then buffers, then inputs
    return (
        storages.add(model.parameters()),
        storages.add(model.buffers()),
        storages.add(inputs.tensors()),
    )


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_ties_views_and_shared_inputs_count_once(device):
    model, inputs = _case(device)
    assert _by_kind(model, inputs) == (PARAMETERS, BUFFERS, INPUTS)
    assert static_bytes(model, inputs) == PARAMETERS + BUFFERS + INPUTS


def test_a_measured_step_holds_no_meta_bytes():
    real, meta = _case("cpu"), _case("meta")
    assert measured_static_bytes(*real) == PARAMETERS + BUFFERS + INPUTS
    assert measured_static_bytes(*meta) == 0
    assert static_bytes(*meta, skip_meta=True) == 0


def test_fake_twins_count_like_the_real_tensors():
    model, inputs = _case("cpu")
    with fake_step(model, inputs) as fake_inputs:
        assert all(storage_key(p)[0] == "fake" for p in model.parameters())
        assert _by_kind(model, fake_inputs) == (PARAMETERS, BUFFERS, INPUTS)
    # the real tensors again, keyed by address: a view shares its base's key
    x = inputs.args[0]
    assert storage_key(x) == storage_key(x[0]) != storage_key(model.buf)


@settings(max_examples=200, deadline=None)
@given(
    times=st.lists(st.integers(0, 50), max_size=40),
    bounds=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=8),
)
def test_a_marks_events_are_those_within_its_ends(times, bounds) -> None:
    """The probe's per-node windows (autockpt/costs/probe.py) take the allocator events
    within each mark, ends included and in time order, as a scan of every event would."""
    events = [AllocatorEvent(t, 0, k + 1, 0) for k, t in enumerate(sorted(times))]
    stamps = [e.time_ns for e in events]
    for start, end in bounds:
        mark = Mark("m", min(start, end), max(start, end))
        scanned = [e.nbytes for e in events if mark.start_ns <= e.time_ns <= mark.end_ns]
        assert deltas_within(events, stamps, mark) == scanned

"""Stage 6: the user's model back, checkpointing the planned segments."""

from autockpt.errors import UncoveredCallWarning
from autockpt.rewrite.apply import _rebuild, apply_plan, rewrite_for_training
from autockpt.rewrite.graph import SEGMENT_PREFIX, rewrite
from autockpt.rewrite.result import (
    ON_LARGER_INPUT,
    CallShape,
    inputs_like,
    is_checkpointed,
    mark_verified_compiled,
    plain_module,
    planned_inputs,
    segments_of,
    shallow_copy,
)
from autockpt.rewrite.segment import CheckpointSegment, SegmentSpec

__all__ = [
    "ON_LARGER_INPUT",
    "SEGMENT_PREFIX",
    "CallShape",
    "CheckpointSegment",
    "SegmentSpec",
    "UncoveredCallWarning",
    "_rebuild",
    "apply_plan",
    "inputs_like",
    "is_checkpointed",
    "mark_verified_compiled",
    "plain_module",
    "planned_inputs",
    "rewrite",
    "rewrite_for_training",
    "segments_of",
    "shallow_copy",
]

"""Stage 1: the model and its example inputs as one fx graph."""

from autockpt.base.inputs import Inputs, given_input_names, without_defaults
from autockpt.capture.captured import Capture
from autockpt.capture.export import INPUT_CHECK
from autockpt.capture.front import capture

__all__ = ["INPUT_CHECK", "Capture", "Inputs", "capture", "given_input_names", "without_defaults"]

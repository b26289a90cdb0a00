"""Moved to ``autockpt_zoo.hf``. This name stays for CLI specs (``autockpt.zoo_hf:gpt2``)
and code written before the move; nothing in the library imports it."""

from autockpt_zoo.hf import *  # noqa: F403
from autockpt_zoo.hf import __all__  # noqa: F401

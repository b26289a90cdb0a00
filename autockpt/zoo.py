"""Moved to ``autockpt_zoo.toy``. This name stays for CLI specs (``autockpt.zoo:gpt``) and
code written before the move; nothing in the library imports it."""

from autockpt_zoo.toy import *  # noqa: F403
from autockpt_zoo.toy import __all__  # noqa: F401

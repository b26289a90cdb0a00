"""``python -m autockpt.cli``: the same command line as the ``autockpt`` script.

A module of its own because a package runs its ``__main__`` under ``-m``; the guard keeps a
plain import (the house tests import every module) from running the command line.
"""

from autockpt.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

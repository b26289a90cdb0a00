"""How the commands write: human lines (silenced by ``--json``/``--quiet``) and output files.

A file that cannot be written becomes an :class:`OutputError` (exit code 7) naming the file
and what it was for, whichever command writes it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from autockpt.cli.exits import OutputError


def _say(args: argparse.Namespace) -> Callable[..., None]:
    """``print`` for human output, or nothing under ``--json``/``--quiet``."""
    if getattr(args, "quiet", False) or getattr(args, "json", None) not in (None, False):
        return lambda *parts, **kw: None
    return print


def _default_loss_note(args: argparse.Namespace, loss_fn: Any) -> None:
    """One line saying which loss a command plans for when the user named none."""
    if loss_fn is None:
        _say(args)(
            "note: no loss given: the step differentiates the output's `loss` when it has one, "
            "else the sum of its floating tensors; for the loss you train with, give --loss "
            "package.module:function or return (model, example_inputs, loss_fn) from the factory"
        )


def _write(path: str, write: Callable[[str], None], what: str) -> None:
    try:
        write(path)
    except OSError as error:
        raise OutputError(
            f"cannot write the {what} to {path}: {error.strerror or error}"
        ) from error


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)

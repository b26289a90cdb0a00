"""The arguments several commands share: argparse types, option groups, and the optimizers.

A command module adds its own options and calls these for the ones it has in common with
others (``--json``/``--quiet``, ``--loss``, ``--optimizer``/``--accumulation-steps``), so
that the same option reads and behaves the same under every command. Nothing here imports
torch until an optimizer is built.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

SOLVERS = ("auto", "dp", "ilp", "sqrt", "greedy")  # solvers.METHODS, without importing it here
SPEC_HELP = "package.module:factory returning (model, example_inputs[, loss_fn])"

OPTIMIZERS = {
    # name -> (torch.optim class, keyword arguments): what `--optimizer NAME` builds over the
    # model's parameters (docs/cli.md). SGD is the common momentum form.
    "adamw": ("AdamW", {}),
    "adam": ("Adam", {}),
    "sgd": ("SGD", {"lr": 0.01, "momentum": 0.9}),
}


TARGET_NAMES = ("h100", "h200", "a100", "l4", "mi300x")  # autockpt.TARGETS, without torch
PRECISION_NAMES = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "fsdp-bf16")


def _target_options(command: argparse.ArgumentParser) -> None:
    """``--target``/``--precision``: plan before launch, for the device the run uses."""
    command.add_argument(
        "--target",
        choices=TARGET_NAMES,
        default=None,
        help="the device the run uses: the model is built on the meta device and planned "
        "with that device's kernels, roofline times and memory (its capacity less 10%% is "
        "the default budget); implies --meta",
    )
    command.add_argument(
        "--precision",
        choices=PRECISION_NAMES,
        default=None,
        help="the precision the run trains in: -mixed is autocast on the target's device "
        "over the model's parameters, -true parameters of that dtype (build them so), "
        "fsdp-bf16 FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) "
        "over the float32 model (with --sharding fsdp); default: float32 without autocast",
    )


def planned_model(model: Any, precision: str | None) -> Any:
    """The model the planner is given for ``--precision``: the factory's own, or for
    ``fsdp-bf16`` its bfloat16 twin (``autockpt.distributed.fsdp_bf16_twin``: what FSDP2's
    policy computes with, buffers as they are; nothing allocated on meta). The plan applies
    to the float32 model the run wraps (docs/distributed.md); the optimizer is built over
    the twin, whose float32 state the per-rank model counts."""
    if precision != "fsdp-bf16":
        return model
    from autockpt.distributed import fsdp_bf16_twin

    return fsdp_bf16_twin(model)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_at_least_two = _int_at_least(2)


def _common(
    command: argparse.ArgumentParser, json_help: str = "print one JSON object on stdout"
) -> None:
    command.add_argument("--json", action="store_true", help=json_help)
    command.add_argument(
        "--quiet", action="store_true", help="print nothing but errors; no progress"
    )


def _loss_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--loss",
        metavar="MODULE:FUNCTION",
        default=None,
        help="the loss the step differentiates, a function of the model's output (replaces "
        "the one the factory returns; default: the output's loss, else the sum of its "
        "floating tensors)",
    )


def _iteration_options(command: argparse.ArgumentParser) -> None:
    _loss_option(command)
    command.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default=None,
        help="the training loop's optimizer (torch.optim defaults; sgd: lr 0.01, momentum "
        "0.9): the budget then covers the whole iteration, its state and step included",
    )
    command.add_argument(
        "--accumulation-steps",
        type=_positive_int,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation)",
    )


def _build_optimizer(name: str | None, model: Any) -> Any:
    """The optimizer ``--optimizer NAME`` (or a plan's ``optimizer.name``) stands for."""
    if name is None or name == "none":
        return None
    import torch

    by_class = {cls: (cls, kwargs) for cls, kwargs in OPTIMIZERS.values()}
    cls, kwargs = OPTIMIZERS.get(name) or by_class.get(name) or (None, None)
    if cls is None:
        from autockpt.errors import OptimizerError

        raise OptimizerError(
            f"the plan's budget covers a {name}, which the command line cannot build (it builds "
            f"{', '.join(c for c, _ in OPTIMIZERS.values())}): check it from Python with "
            "autockpt.measure(model, inputs, optimizer=your_optimizer)"
        )
    return getattr(torch.optim, cls)(model.parameters(), **kwargs)


def reshard_after_forward(args: argparse.Namespace) -> bool | None:
    """``--reshard-after-forward``: every FSDP2 unit's choice (None: FSDP2's defaults)."""
    choice = getattr(args, "reshard_after_forward", None)
    return None if choice is None else choice == "true"

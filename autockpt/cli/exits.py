"""Exit codes, the command line's own errors, and the one place that maps an error to a code.

Every command's handler raises; :func:`run_command` turns what it raised into one line (or
one JSON object under ``--json``) and the exit code documented in :mod:`autockpt.cli`, so
that the table of codes and the errors behind them are read in one place.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_BUDGET, EXIT_PLAN, EXIT_SPEC, EXIT_TRACE = range(7)
EXIT_OUTPUT, EXIT_DEPENDENCY = 7, 8
EXIT_INTERRUPTED = 130


class SpecError(Exception):
    """The model SPEC could not be imported or called."""


class OutputError(Exception):
    """An output file (plan, plot, report) could not be written."""


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command (``args.run``) and return its exit code, an error's included."""
    from autockpt.errors import (
        AutockptError,
        BudgetError,
        DefaultLossWarning,
        InfeasibleBudgetError,
        PlanFormatError,
        PlanMismatchError,
        PrecisionError,
        ShardingError,
        TargetError,
        TraceError,
    )
    from autockpt.report import MissingDependencyError, ReportError

    # The command line says which loss it plans for in one line of its own output
    # (_default_loss_note), not as a Python warning.
    warnings.filterwarnings("ignore", category=DefaultLossWarning)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("autockpt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except InfeasibleBudgetError as error:
        return _fail(args, EXIT_BUDGET, error)
    except (PlanFormatError, PlanMismatchError, ReportError) as error:
        return _fail(args, EXIT_PLAN, error)
    except OutputError as error:
        return _fail(args, EXIT_OUTPUT, error)
    except MissingDependencyError as error:
        return _fail(args, EXIT_DEPENDENCY, error)
    except SpecError as error:
        return _fail(args, EXIT_SPEC, error)
    except TraceError as error:
        return _fail(args, EXIT_TRACE, error)
    except FileNotFoundError as error:
        return _fail(args, EXIT_PLAN, error)
    except (ShardingError, TargetError, PrecisionError, BudgetError) as error:
        return _fail(args, EXIT_USAGE, error)
    except AutockptError as error:  # any other refusal concerns the model SPEC gave
        return _fail(args, EXIT_SPEC, error)


def _fail(args: argparse.Namespace, code: int, error: BaseException) -> int:
    message = " ".join(str(error).split())  # one line, whatever the error text holds
    if getattr(args, "json", False):
        print(json.dumps({"error": type(error).__name__, "message": message, "exit_code": code}))
    else:
        print(f"autockpt: error: {message}", file=sys.stderr)
    return code

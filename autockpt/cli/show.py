"""``autockpt show PLAN``: print a saved plan as tables, and draw its memory timeline.

Its options and its handler live together so that the command reads in one file; the plan
and report modules load inside :func:`run`, never when the parser is built.
"""

from __future__ import annotations

import argparse

from autockpt.cli.exits import EXIT_OK
from autockpt.cli.loading import _load_plan
from autockpt.cli.options import _common
from autockpt.cli.output import _write


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``show`` and its options to the command line."""
    show = sub.add_parser(
        "show", help="print a saved plan as tables; --plot draws its memory timeline"
    )
    show.add_argument("plan")
    show.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="write the predicted memory over one step (no checkpoint vs the plan, "
        "with the budget) to this image file",
    )
    _common(show, "print the plan JSON on stdout")
    show.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan (or its JSON); write the timeline plot when ``--plot`` names a file."""
    plan = _load_plan(args.plan)
    if args.plot:
        from autockpt.report import save_figure, timeline_figure

        figure = timeline_figure(plan)
        _write(args.plot, lambda path: save_figure(figure, path), "plot")
    if args.json:
        print(plan.to_json())
    elif not args.quiet:
        from autockpt.report import print_plan

        print_plan(plan)
        if args.plot:
            print(f"wrote {args.plot}")
    return EXIT_OK

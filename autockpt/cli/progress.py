"""The progress line long commands show on stderr, and how long it waits before it shows.

Kept apart from the commands because every long one (plan, verify, frontier, fit, demo) uses
it, and apart from the parser because it loads rich only when a bar is really wanted.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from types import TracebackType
from typing import Any

PROGRESS_DELAY_S = 2.0
"""Progress appears only for work that takes longer than this: short commands stay quiet.
The environment variable ``AUTOCKPT_PROGRESS_DELAY_S`` overrides it (0: at once)."""


class Progress:
    """A transient progress line on stderr that appears only once the work has run for
    :data:`PROGRESS_DELAY_S` seconds, so quick commands never flash one.

    ``stage(text)`` names what runs now (an open-ended spinner); ``stage(text, total)``
    with ``advance(done)`` shows a bar. Disabled (every call a no-op) under ``--quiet``,
    ``--json`` or when stderr is not a terminal.
    """

    def __init__(self, enabled: bool, delay_s: float | None = None) -> None:
        self.enabled = enabled
        if delay_s is None:
            delay_s = float(os.environ.get("AUTOCKPT_PROGRESS_DELAY_S", PROGRESS_DELAY_S))
        self.delay_s = delay_s
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._bar: Any = None
        self._task: Any = None
        self._timer: threading.Timer | None = None

    @classmethod
    def for_args(cls, args: argparse.Namespace) -> Progress:
        wanted = not getattr(args, "quiet", False) and getattr(args, "json", None) in (None, False)
        return cls(wanted and sys.stderr.isatty())

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            # "3/12" for counted work (a frontier's budgets); nothing for open-ended stages
            TextColumn("{task.fields[count]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
            # stdout stays stdout: results may be piped while the bar shows on the terminal
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task = self._bar.add_task("starting", total=None, count="")
        self._timer = threading.Timer(self.delay_s, self._start)
        self._timer.daemon = True
        self._timer.start()
        return self

    def _start(self) -> None:
        with self._lock:
            if not self._closed:
                self._bar.start()
                self._started = True

    def stage(self, description: str, total: int | None = None) -> None:
        if self._bar is not None:
            count = "" if total is None else f"0/{total}"
            self._bar.update(
                self._task, description=description, total=total, completed=0, count=count
            )

    def advance(self, done: int) -> None:
        if self._bar is not None:
            total = self._bar.tasks[0].total
            count = "" if total is None else f"{done}/{int(total)}"
            self._bar.update(self._task, completed=done, count=count)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
            if self._started:
                self._bar.stop()

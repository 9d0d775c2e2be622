"""What the CLI's modules share (``main``, ``views``, ``loop`` import it; it imports none of them): progress bars
for the library's ``progress(task, done, total[, label])`` callbacks, and JSON on stdout."""

from __future__ import annotations

import json
import sys


class Bars:
    """rich progress bars on stderr (a terminal only), one per task the library names: ``with Bars(console) as
    bars: job(progress=bars)``."""

    def __init__(self, console=None, transient: bool = False):
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        from parsim.console import console as folding_console

        err = console or folding_console(stderr=True)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err,
                                 transient=transient, disable=not err.is_terminal)
        self.tasks: dict = {}

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def __call__(self, task: str, done: float, total: float, label: str | None = None) -> None:
        if task not in self.tasks:
            self.tasks[task] = self.progress.add_task(task, total=total)
        self.progress.update(self.tasks[task], completed=done, total=total, description=(label or task)[:60])


def emit_json(obj) -> None:
    from parsim.jsonio import _json_default

    sys.stdout.write(json.dumps(obj, indent=1, default=_json_default, allow_nan=False) + "\n")

"""How library jobs report while they run: ``progress(task, done, total[, label])`` (a bar per task; the label its
text when given) and ``log(line)`` for what the user should read on the way. The command line renders them (rich
bars on stderr); a library caller passes its own or none."""

from __future__ import annotations

import sys
from collections.abc import Callable

Progress = Callable[..., None]  # (task, done, total[, label])
Log = Callable[[str], None]


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr)

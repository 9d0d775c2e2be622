"""The rich console every command prints through: tables fold a cell that does not fit onto the next line instead
of cutting it to an ellipsis, so a narrow terminal or a redirected output (80 columns) still shows every number
and name whole."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


class FoldingConsole(Console):
    """``rich.console.Console`` whose tables fold overflowing cells (rich's default cuts them: ``all_g…``)."""

    def print(self, *objects, **kwargs) -> None:  # type: ignore[override]
        for o in objects:
            if isinstance(o, Table):
                for col in o.columns:
                    col.overflow = "fold"
        super().print(*objects, **kwargs)


def console(stderr: bool = False) -> Console:
    return FoldingConsole(stderr=stderr)

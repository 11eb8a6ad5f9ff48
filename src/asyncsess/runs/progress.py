"""Console output with rich: progress bars for long work (silent when disabled) and before/after tables."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

__all__ = ["progress_bar", "print_before_after"]


class _Bar:
    def __init__(self, progress: Progress, total: int | None, description: str) -> None:
        self._progress = progress
        self._task = progress.add_task(description, total=total, status="")

    def advance(self, n: int = 1, status: str = "") -> None:
        self._progress.update(self._task, advance=n, status=status)


@contextmanager
def progress_bar(description: str, total: int | None, enabled: bool = True, console: Console | None = None) -> Iterator[_Bar]:
    """``with progress_bar("train", total=75) as bar: bar.advance(status="reward 0.42")``."""
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
        disable=not enabled,
        console=console,
        transient=False,
    )
    with progress:
        yield _Bar(progress, total, description)


# episode shape and stop reasons: in metrics.jsonl, left out of the before/after table
_SHAPE = ("/turns_per_episode", "/ac_tokens_per_turn", "/ob_tokens_per_turn")


def print_before_after(before: dict[str, float], after: dict[str, float], title: str, console: Console | None = None) -> None:
    """A table of each reward and task metric before and after training, with the change."""
    table = Table(title=title)
    for col in ("metric", "before", "after", "change"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for key in sorted(k for k in set(before) | set(after) if not (k.endswith(_SHAPE) or "/stop/" in f"/{k}")):
        b, a = before.get(key), after.get(key)
        change = f"{a - b:+.3f}" if a is not None and b is not None else ""
        table.add_row(key, "" if b is None else f"{b:.3f}", "" if a is None else f"{a:.3f}", change)
    (console or Console()).print(table)

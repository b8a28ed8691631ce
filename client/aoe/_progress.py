"""Terminal progress for a tuning job: one bar (tasks done / total) and the current stage."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress"]


class Progress:
    """Renders JobEvents with rich on stderr (a no-op when disabled or not a terminal);
    "wait" events are always printed."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and sys.stderr.isatty()
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("starting", total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    def emit(self, event: Any) -> None:
        if (
            event.kind == "wait"
        ):  # said even without a terminal: the user must know why nothing moves
            if self._bar is not None:
                self._bar.console.print(f"aoe: {event.message}")
            else:
                print(f"aoe: {event.message}", file=sys.stderr, flush=True)
            return
        if self._bar is None:
            return
        if event.kind == "stage":
            self._bar.update(self._task, description=event.message)
        elif event.kind == "progress":
            self._bar.update(self._task, completed=event.done, total=event.total)
        elif event.kind == "task":
            self._bar.advance(self._task)

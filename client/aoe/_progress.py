"""Terminal progress for a tuning job: what it is doing now, and its tasks done of all.

Two rows. The job's row (a spinner, the current stage in words, the time since the job
started) has no total, so it never finishes: its spinner and clock move on every refresh
for as long as the job runs, through stages that take long and report no progress (the
confirming A/B, a queue on the daemon). The tasks' row (a bar, done/total) appears with
the first progress event and counts what aoe.outcome calls a task, as the summary does.
Refreshes come from rich's own thread, so a caller blocked on the engine or the daemon
never stops them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Frame", "Progress"]


@dataclass(frozen=True)
class Frame:
    """What one refresh showed on the job's row: the stage as said, the seconds shown on
    its clock, and whether its spinner turns (False once the row has finished)."""

    stage: str
    elapsed_s: float
    spinning: bool


class Progress:
    """Renders JobEvents with rich on stderr (a no-op when disabled or not a terminal);
    "wait" events are always printed. `console`: where to render instead (then it is
    used whatever it is attached to); `on_frame`: called with a `Frame` on every refresh,
    from rich's refresh thread."""

    def __init__(
        self,
        enabled: bool = True,
        *,
        console: Any = None,
        on_frame: Callable[[Frame], None] | None = None,
        refresh_per_second: float = 10,
    ):
        self.enabled = enabled and (console is not None or sys.stderr.isatty())
        self._console = console
        self._on_frame = on_frame
        self._refresh_per_second = refresh_per_second
        self._bar: Any = None
        self._job: Any = None
        self._tasks: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            self._bar = _rich_progress(
                self._console, self._frame if self._on_frame else None, self._refresh_per_second
            )
            self._bar.__enter__()
            self._job = self._bar.add_task("starting", total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    def _frame(self) -> None:
        assert self._on_frame is not None
        if self._bar is None or self._job is None:  # rich renders once before the rows exist
            return
        job = next(t for t in self._bar.tasks if t.id == self._job)
        self._on_frame(Frame(str(job.description), job.elapsed or 0.0, not job.finished))

    def emit(self, event: Any) -> None:
        if event.kind == "wait":
            # said even without a terminal: the user must know why nothing moves
            if self._bar is not None:
                self._bar.console.print(f"aoe: {event.message}")
            else:
                print(f"aoe: {event.message}", file=sys.stderr, flush=True)
            return
        if self._bar is None:
            return
        if event.kind == "stage":
            self._bar.update(self._job, description=event.message)
        elif event.kind == "progress" and event.total:
            if self._tasks is None:
                self._tasks = self._bar.add_task("tasks", total=event.total)
            self._bar.update(self._tasks, completed=event.done, total=event.total)


def _rich_progress(console: Any, on_refresh: Callable[[], None] | None, per_second: float) -> Any:
    """rich's Progress with the two rows' columns; `on_refresh` is called on each refresh."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import Progress as RichProgress
    from rich.text import Text

    class Bar(BarColumn):  # the tasks' row only
        def render(self, task):
            return Text("") if task.total is None else super().render(task)

    class Count(MofNCompleteColumn):
        def render(self, task):
            return Text("") if task.total is None else super().render(task)

    class Clock(TimeElapsedColumn):  # the job's row only: the tasks' row stops at its end
        def render(self, task):
            return super().render(task) if task.total is None else Text("")

    class Hooked(RichProgress):
        def get_renderables(self):
            if on_refresh is not None:
                on_refresh()
            yield from super().get_renderables()

    return Hooked(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        Bar(),
        Count(),
        Clock(),
        console=console or Console(stderr=True),
        transient=True,
        refresh_per_second=per_second,
    )

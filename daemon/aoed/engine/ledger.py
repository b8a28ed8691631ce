"""Per-job identity and accounting: what one job cost the shared engine.

Many jobs share the compile pool and the devices, so totals kept by the agents say
nothing about any one job. Each request carries its job's `JobLedger`; the agent that
serves it charges the device time, the compile time and the peak memory of the child
that did the work to that ledger, and passes the job's "waiting" messages back to it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from aoed.engine.messages import JobEvent

__all__ = ["JobLedger", "new_job_id"]


def new_job_id() -> str:
    """A job id that does not repeat across processes or restarts."""
    return f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


@dataclass
class JobLedger:
    job_id: str
    emit: Callable[[JobEvent], None] = lambda event: None
    #: share of the agents among running jobs (their queues serve jobs by weight)
    weight: int = 1
    started: float = field(default_factory=time.monotonic)
    device_s: float = 0.0
    device_requests: int = 0
    compile_s: float = 0.0
    compile_requests: int = 0
    #: peak resident memory of any child process while it worked for this job
    peak_child_rss_mb: float = 0.0
    #: device seconds by what they were for (search, session, verify, profile, confirm)
    device_by: dict[str, float] = field(default_factory=dict)
    #: wall-clock (start, end) of each device request while it held the device: the
    #: evidence that jobs sharing a device never measured at once
    device_intervals: list[tuple[float, float]] = field(default_factory=list)

    def charge_device(self, seconds: float, category: str = "other") -> None:
        self.device_s += seconds
        self.device_requests += 1
        self.device_by[category] = self.device_by.get(category, 0.0) + seconds

    def charge_compile(self, seconds: float) -> None:
        self.compile_s += seconds
        self.compile_requests += 1

    def note_rss(self, maxrss_kb: object) -> None:
        if isinstance(maxrss_kb, (int, float)) and maxrss_kb > 0:
            self.peak_child_rss_mb = max(self.peak_child_rss_mb, maxrss_kb / 1024.0)

    def waiting(self, message: str) -> None:
        self.emit(JobEvent("wait", message))

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def duty_cycle(self) -> float:
        """Share of the job's wall time its device requests took."""
        elapsed = self.elapsed_s
        return self.device_s / elapsed if elapsed > 0 else 0.0

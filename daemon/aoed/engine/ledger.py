"""Per-job identity and accounting: what one job cost the shared engine.

Many jobs share the compile pool and the devices, so totals kept by the agents say
nothing about any one job. Each request carries its job's `JobLedger`; the agent that
serves it charges the device time, the compile time and the peak memory of the child
that did the work to that ledger, and passes the job's "waiting" messages back to it.
The ledger also carries the job's time scale: the agents' time limits are set for a
small model, and a job's grow with its model (`scale_to_model`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aoed.engine.messages import JobEvent

__all__ = ["JobLedger", "new_job_id", "time_scale"]

#: A job's time limits grow by the configured ones for every this many MiB of model.
SCALE_MIB = 256


def time_scale(model_bytes: int) -> float:
    """How much longer than the configured limits a job may take for a model file of
    `model_bytes`: 1 + MiB/256 (a tiny model 1x, 256 MiB 2x, 2 GiB 9x), to a tenth."""
    return round(1.0 + model_bytes / (1 << 20) / SCALE_MIB, 1)


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
    #: per device (its name): device seconds, requests, trials and the wall-clock spans
    #: of its requests; a job may measure on every device of its fingerprint (devices.py)
    by_device: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: wall-clock (start, end) of each device request while it held the device: the
    #: evidence that jobs sharing a device never measured at once
    device_intervals: list[tuple[float, float]] = field(default_factory=list)
    #: the agents' default time limits for this job's requests are multiplied by this
    time_scale: float = 1.0
    #: the model file's size that set `time_scale`, for messages
    model_mb: float = 0.0
    #: wall-clock seconds of each stage of the job's pipeline (`enter`), in the order run
    stage_s: dict[str, float] = field(default_factory=dict)
    #: device seconds charged while each stage ran, whatever they were for
    stage_device_s: dict[str, float] = field(default_factory=dict)
    #: what a stage was estimated to take before it started (seconds), where estimated
    estimates: dict[str, float] = field(default_factory=dict)
    _stage: tuple[str, float, float] | None = None

    def enter(self, stage: str | None) -> None:
        """End the stage in progress (its wall time is added to `stage_s`, the device
        seconds charged meanwhile to `stage_device_s`) and start `stage` (None: none).
        The pipeline's stages run one after another."""
        now = time.monotonic()
        if self._stage is not None:
            name, t0, dev0 = self._stage
            self.stage_s[name] = self.stage_s.get(name, 0.0) + now - t0
            if self.device_s > dev0:
                self.stage_device_s[name] = (
                    self.stage_device_s.get(name, 0.0) + self.device_s - dev0
                )
        self._stage = None if stage is None else (stage, now, self.device_s)

    def scale_to_model(self, model_bytes: int) -> None:
        """Scale the job's time limits to its model file: loading, checking, saving and
        running it take longer the bigger it is (see `time_scale`)."""
        self.model_mb = model_bytes / (1 << 20)
        self.time_scale = time_scale(model_bytes)

    def scaled(self, seconds: float, why: str) -> tuple[float, str]:
        """(this job's limit for a configured one of `seconds`, `why` it is that: the
        configured one's origin, plus the scale when it is not 1)."""
        if self.time_scale == 1.0:
            return seconds, why
        return (
            seconds * self.time_scale,
            f"{why} x {self.time_scale:g} for a {self.model_mb:.0f} MiB model",
        )

    def charge_device(
        self,
        seconds: float,
        category: str = "other",
        device: str = "",
        trials: int = 0,
        span: tuple[float, float] | None = None,
    ) -> None:
        """Charge one request: `seconds` under `category`, and to `device` (its name) with
        the `trials` it measured and its wall-clock `span` while it held the device."""
        self.device_s += seconds
        self.device_requests += 1
        self.device_by[category] = self.device_by.get(category, 0.0) + seconds
        if span is not None:
            self.device_intervals.append(span)
        if device:
            row = self.by_device.setdefault(
                device, {"device_s": 0.0, "requests": 0, "trials": 0, "intervals": []}
            )
            row["device_s"] += seconds
            row["requests"] += 1
            row["trials"] += trials
            if span is not None:
                row["intervals"].append(span)

    def per_device(self) -> dict[str, dict[str, Any]]:
        """Per device name: device_s, duty_cycle (of the job's wall time), requests,
        trials, and intervals (the wall-clock spans of its requests)."""
        elapsed = self.elapsed_s
        return {
            name: {
                "device_s": round(r["device_s"], 3),
                "duty_cycle": round(r["device_s"] / elapsed, 4) if elapsed > 0 else 0.0,
                "requests": r["requests"],
                "trials": r["trials"],
                "intervals": [(round(a, 6), round(b, 6)) for a, b in r["intervals"]],
            }
            for name, r in sorted(self.by_device.items())
        }

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

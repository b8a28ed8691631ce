"""Measurement as a model is deployed: one session per process, candidates taking turns.

A server runs one model in one process with onnxruntime's defaults and the options
`aoe.session` applies. Two sessions in one process disturb each other on a small
machine: the idle intra-op threads of one steal the cores of the other, and with
spinning turned off to stop that (runner.quiet), every parallel kernel pays a thread
wake-up a deployed session does not. Session options that change threading show it
most: `execution_mode=parallel` won 2.7x in one process on a 2-core machine and ran
1.6x slower deployed. So figures a job reports, and the session options it keeps, are
measured here (MeasurePlan.deployed):

- each candidate is loaded in a worker process of its own (`python -m
  aoed.backends.ort.deployed`), with exactly its options (spinning as onnxruntime
  defaults it, unless the options set it), on the runner's cores and memory limit;
- the worker runs it once for its outputs (written to an .npz, compared with the
  reference's by the runner), then the shared procedure (measure.rounds) drives the
  workers one turn at a time, in rotating order; a worker is stopped (SIGSTOP) as soon
  as it has answered and continued for its next request, so its intra-op threads, which
  spin on for about 25 ms after a run (measured here on 2 cores, every sample model),
  never share the cores with the next worker's turn;
- between requests a worker holds no session (it drops it and its arenas), and the
  runner keeps a few of them for the next request, so a job does not pay an
  interpreter's start for each candidate.

Workers read requests as JSON lines on stdin and answer on stdout; they read inputs
from .npz files only (no pickle) and die with the runner.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aoe.errors import DeviceError
from aoed.backends._deployed import serve

__all__ = ["MODULE", "Worker", "Workers", "workers_for"]

#: Idle workers the runner keeps between requests (a confirming A/B has four candidates).
KEEP = 4
#: How long a worker may take to load a model or answer anything but a turn.
LOAD_TIMEOUT_S = 600.0


class WorkerError(DeviceError):
    """A worker could not do what was asked (its message says what), or died."""


# ------------------------------------------------------------------ worker process


def _ort_session(model: str, options: dict[str, Any]) -> Any:
    from aoed.backends.ort.sessions import session

    return session(model, options)


def describe(sess: Any) -> dict[str, Any]:
    """What a session runs with, as onnxruntime reports it: its execution mode,
    optimization level, thread counts and the spinning entries (None where unset)."""
    so = sess.get_session_options()
    spin = {}
    for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning"):
        try:
            spin[key] = so.get_session_config_entry(key)
        except Exception:  # onnxruntime raises for an entry never set
            spin[key] = None
    return {
        "execution_mode": str(so.execution_mode),
        "graph_optimization_level": str(so.graph_optimization_level),
        "intra_op_num_threads": so.intra_op_num_threads,
        "inter_op_num_threads": so.inter_op_num_threads,
        **spin,
    }


# ------------------------------------------------------------------ runner side


#: The worker of an onnxruntime candidate; another runtime names its own (`Workers.load`).
MODULE = "aoed.backends.ort.deployed"


class Worker:
    """One worker process, started through exec: `module` serves the protocol (this
    module for onnxruntime)."""

    def __init__(self, module: str = MODULE) -> None:
        self.module = module
        # stderr to the runner's own (its log): a worker that logs a lot must never block
        # on a full pipe.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            close_fds=True,
        )
        self.stopped = False

    def stop(self) -> None:
        """Stop the process (SIGSTOP) until its next request, and return once it has
        stopped: its threads, spinning for work after a run, take no core meanwhile."""
        if self.stopped or self.proc.returncode is not None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        while True:
            try:
                _pid, status = os.waitpid(self.proc.pid, os.WUNTRACED)
            except ChildProcessError:
                return
            if os.WIFSTOPPED(status):
                self.stopped = True
                return
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                return

    def ask(self, **req: Any) -> dict[str, Any]:
        """The worker's answer to `req`; WorkerError when it says it failed or died."""
        self.send(req)
        return self.receive()

    def send(self, req: dict[str, Any]) -> None:
        """Send `req` (continuing a stopped worker); a dead one is found by `receive`."""
        assert self.proc.stdin is not None
        if self.stopped:
            with contextlib.suppress(ProcessLookupError):  # it died meanwhile: said below
                os.kill(self.proc.pid, signal.SIGCONT)
            self.stopped = False
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        """The answer to the request sent last; WorkerError when it failed or died."""
        assert self.proc.stdout is not None
        try:
            line = self.proc.stdout.readline()
        except OSError:
            line = ""
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"its process ended (exit status {code}; see the runner's log)")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(str(reply["error"]))
        return reply

    def close(self) -> None:
        if self.stopped:
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.stopped = False
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


_idle: list[Worker] = []


def _take(module: str) -> Worker:
    """An idle worker of `module`, or a new one."""
    for i, w in enumerate(_idle):
        if w.module == module:
            return _idle.pop(i)
    return Worker(module)


class Workers:
    """The workers of one measurement, a candidate each: `load` them, read their `first`
    outputs, then `warm`/`turn` as measure.Turns. Leaving the block unloads them and
    keeps up to KEEP for the next measurement; a worker that failed is closed."""

    def __init__(self, inputs: Path):
        self.inputs = inputs
        self.by: dict[str, Worker] = {}
        self.spare: list[Worker] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="aoe-deployed-"))

    def load(
        self,
        candidates: Sequence[
            tuple[str, Path, dict[str, Any]] | tuple[str, Path, dict[str, Any], str]
        ],
    ) -> dict[str, str]:
        """Start (or reuse) a worker per candidate (id, model, options[, worker module:
        MODULE when not given]) and load its model, all at once; returns why each
        candidate that could not be loaded was not."""
        errors: dict[str, str] = {}
        for c in candidates:
            module = c[3] if len(c) > 3 else MODULE
            self.by[c[0]] = _take(module)
        for cid, model, options, *_module in candidates:  # the loads overlap: none is timed
            req = {
                "op": "load",
                "model": str(model),
                "options": options,
                "inputs": str(self.inputs),
            }
            self.by[cid].send(req)
        for cid, *_rest in candidates:
            try:
                self.by[cid].receive()
            except WorkerError as exc:
                errors[cid] = str(exc) if str(exc).startswith("load") else f"load: {exc}"
                self.drop(cid)
        return errors

    def first(self, cid: str) -> list[np.ndarray]:
        """One run of `cid` and its outputs; WorkerError when it fails."""
        path = self.tmp / "outputs.npz"  # read and removed before the next
        got = self.by[cid].ask(op="first", outputs=str(path))
        self.by[cid].stop()
        with np.load(path, allow_pickle=False) as data:
            outs = [data[f"o{i}"] for i in range(int(got["count"]))]
        path.unlink()
        return outs

    def drop(self, cid: str) -> None:
        """Stop measuring `cid` (it failed or is not timed): its worker waits, unused, for
        the end of the measurement (one that died is closed then)."""
        w = self.by.pop(cid, None)
        if w is not None:
            self.spare.append(w)

    def warm(self, name: str, warmup_s: float) -> float:
        return float(self._ask(name, op="warm", warmup_s=warmup_s)["per_run_s"])

    def turn(self, name: str, samples: int, batch: int) -> list[float]:
        return [
            float(s) for s in self._ask(name, op="turn", samples=samples, batch=batch)["samples_s"]
        ]

    def _ask(self, name: str, **req: Any) -> dict[str, Any]:
        """`req` of the worker of `name`, stopped again once it has answered."""
        try:
            reply = self.by[name].ask(**req)
            self.by[name].stop()
            return reply
        except WorkerError as exc:
            raise DeviceError(f"candidate {name}'s measuring process failed: {exc}") from None

    def close(self) -> None:
        for w in [*self.by.values(), *self.spare]:
            try:
                w.ask(op="unload")
            except WorkerError:
                w.close()
                continue
            if len(_idle) < KEEP:
                _idle.append(w)
            else:
                w.close()
        self.by.clear()
        self.spare.clear()
        with contextlib.suppress(OSError):
            for p in self.tmp.iterdir():
                p.unlink()
            self.tmp.rmdir()


@contextlib.contextmanager
def workers_for(inputs: Path) -> Iterator[Workers]:
    """The workers of one measurement on `inputs` (see Workers)."""
    w = Workers(inputs)
    try:
        yield w
    finally:
        w.close()


if __name__ == "__main__":
    sys.exit(serve(_ort_session, describe))

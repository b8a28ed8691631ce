"""Soak: kill -9 of the daemon at random points of its jobs, many times over.

    python bench/soak.py [--seeds 20] [--max-delay 4] [--budget 3] [--keep]
    python bench/soak.py --hang

One daemon (a real `aoed` on a temporary socket, its own state dir and bank, as the
tests start it) tunes one job per seed, each of a model no earlier seed tuned, so each
job has bank entries to commit. A seed submits its job, waits a random time in
[0.2, --max-delay] s drawn from the seed, kills the daemon (SIGKILL: its workers and
runner die with it), reads the bank's keys, restarts the daemon and waits for the job
to end. It then checks that the job ended SUCCEEDED or FAILED with a message and the
class of the failure, that every bank entry there at the kill is still there, that
SQLite's integrity_check of the job store passes (after the kill and after the job) and
that LMDB opens the bank. `tests/test_faults.py` runs the same round (`kill9_round`)
for three seeds, as a soak test (`make soak` runs it first). The counts at the end: seeds, restarts, bank entries verified intact
(summed over the kills). Exit status 1 when any check failed; the daemon's files are
kept then (and with --keep) for a look.

--hang instead stops a compile worker (SIGSTOP) while it compiles, on a daemon with
dedicated cores: nothing resumes it, so the pool's compile limit (`[engine]
compile_timeout_s`, 120 s by default, as here) must end the request, restart the
worker, and let the job finish. Without dedicated cores the pool itself resumes every
worker after each measurement, so a stray SIGSTOP is undone at the next one. Takes about
two minutes. A worker that hangs by itself (a plugin strategy that sleeps) is in the
test suite, with the limit set to 3 s: tests/test_faults.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.daemon_util import DaemonProcess
from tests.faults_util import (
    FINAL,
    WORKER,
    S,
    bank_keys,
    child_pid,
    job,
    kill9_round,
    model,
    proc_state,
    submit,
    wait_stage,
)
from tests.helpers import wait_for

FINAL_NAMES = {S.JobState.Name(s) for s in FINAL}


def seed_model(d: DaemonProcess, seed: int) -> Path:
    """A model of its own for each seed: MLPs and CNNs of sizes no other seed uses."""
    if seed % 2:
        return model(d, "cnn", width=12 + 4 * seed)
    return model(d, "mlp", hidden=40 + 8 * seed)


def soak(root: Path, seeds: int, max_delay_s: float, budget_s: float) -> bool:
    d = DaemonProcess(root)
    restarts = verified = final = mid_job = 0
    ended: dict[str, int] = {}
    problems = 0
    t0 = time.monotonic()
    try:
        d.start()
        for seed in range(seeds):
            path = seed_model(d, seed)
            try:
                r = kill9_round(d, path, seed, max_delay_s, budget_s)
            except (
                RuntimeError,
                AssertionError,
                grpc.RpcError,
            ) as exc:  # no restart (RuntimeError), or not up or the job not ended in time
                print(f"seed {seed:2d}  PROBLEM: {type(exc).__name__}: {exc}"[:3000], flush=True)
                problems += 1
                break
            restarts += 1
            mid_job += r.state_at_kill not in FINAL_NAMES
            verified += r.bank_at_kill
            ended[r.state] = ended.get(r.state, 0) + 1
            problems += bool(r.problems)
            note = f"  {r.error[:100]}" if r.error else ""
            print(
                f"seed {seed:2d}  {path.name:17s} killed after {r.delay_s:4.2f} s "
                f"({r.state_at_kill.removeprefix('JOB_STATE_').lower()}), bank {r.bank_at_kill:3d} -> "
                f"{r.bank_after:3d}, job {r.state.removeprefix('JOB_STATE_').lower()}{note}",
                flush=True,
            )
            for p in r.problems:
                print(f"  PROBLEM: {p}", flush=True)
        else:
            final = len(bank_keys(d.bank))
            if not d.serving():
                print("PROBLEM: the daemon does not serve after the last restart")
                problems += 1
    finally:
        d.close()
    jobs = ", ".join(
        f"{n} {s.removeprefix('JOB_STATE_').lower()}" for s, n in sorted(ended.items())
    )
    print(
        f"\nseeds {seeds}, restarts {restarts} ({mid_job} killed mid-job), entries verified intact "
        f"{verified} (summed over the kills; the bank ends with {final}); jobs: {jobs or 'none'}; "
        f"rounds with problems {problems}; {time.monotonic() - t0:.0f} s"
    )
    return problems == 0


def hang(root: Path) -> bool:
    d = DaemonProcess(root)
    d.config.write_text(
        d.config.read_text().replace("[engine]\n", "[engine]\ndedicated_cores = true\n")
    )
    try:
        d.start()
        job_id = submit(d, model(d, "cnn", width=24), budget=2.0)
        wait_stage(d, job_id, "tuning ")
        worker = wait_for(lambda: child_pid(d, WORKER), 10, "a compile worker")
        wait_for(lambda: proc_state(worker) == "R", 30, "the worker compiling", poll=0.002)
        os.kill(worker, signal.SIGSTOP)
        t0 = time.monotonic()
        print(f"worker {worker} stopped while compiling; waiting for the pool's limit", flush=True)
        wait_for(lambda: job(d, job_id).state in FINAL, 600, "the job's end", poll=0.5)
        took = time.monotonic() - t0
        j = job(d, job_id)
        timed_out = [ln for ln in d.log().splitlines() if "timed out" in ln]
        print(
            f"job {S.JobState.Name(j.state)} {took:.0f} s after the stop{': ' + j.error if j.error else ''}"
        )
        print(
            f"worker {worker}: {'gone' if not proc_state(worker) else proc_state(worker)}; "
            f"now {child_pid(d, WORKER)}"
        )
        print("\n".join(timed_out) or "no time-out logged")
        return j.state == S.JOB_STATE_SUCCEEDED and bool(timed_out) and not proc_state(worker)
    finally:
        d.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20, help="kill -9 rounds (default 20)")
    ap.add_argument(
        "--max-delay", type=float, default=4.0, help="latest kill, seconds after submit (default 4)"
    )
    ap.add_argument(
        "--budget", type=float, default=3.0, help="each job's tuning budget, seconds (default 3)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the daemon's files")
    ap.add_argument(
        "--hang", action="store_true", help="the stopped-worker scenario instead (about 130 s)"
    )
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="aoed-soak-"))
    ok = (
        hang(root / "d") if args.hang else soak(root / "d", args.seeds, args.max_delay, args.budget)
    )
    if ok and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"the daemon's files: {root / 'd'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

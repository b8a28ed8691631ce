"""Soak: a full disk under mixed load, twice; the daemon never exits and loses nothing.

    python bench/soak_disk.py [--minutes 30] [--size-mb 200] [--floor-mb 16] [--seed 1]
                              [--keep] [--no-write] [--out bench/RESULTS.md]

One daemon (a real `aoed`, started as the tests start it) keeps its state dir, bank,
inbox and models on a tmpfs of --size-mb (mounting it needs root). For --minutes, one
client thread makes mixed calls: jobs submitted by path, uploads submitted as jobs,
uploads left unsubmitted (the quotas and `upload_ttl_h` bound them), good models and
models of the hostile corpus (tests/hostile.py) dropped into the inbox, and reads
(every page of ListJobs, GetJob, health). Meanwhile the filesystem is filled to the last
byte at 1/6 and 1/2 of the run and freed at 1/3 and 2/3.

Checked throughout: the daemon process never exits, and no call fails with another
status than the ones a full disk or a limit allows (RESOURCE_EXHAUSTED). Snapshots of
what is committed (each finished job's state, its events, and the bank's entries and
default records) are taken before each fill, after each free, at the end, and after a
SIGTERM and restart; each must hold everything the one before held. At the end every
file dropped into the inbox must have come out in the outbox or failed/, and the free
space must be back above the floor (`[limits] min_free_mb`). Prints its figures and
writes them into bench/RESULTS.md (its own section); exit status 1 when a check failed
(the daemon's files are kept then, and with --keep).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from aoe.v1 import tuning_pb2  # noqa: E402
from aoed import samples  # noqa: E402
from bench_bank import publish  # noqa: E402
from machine import Machine  # noqa: E402
from tests.daemon_util import DaemonProcess, upload  # noqa: E402
from tests.faults_util import FINAL, S, bank_keys, fill, store_integrity  # noqa: E402
from tests.hostile import KINDS  # noqa: E402

RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- soak-disk:begin -->", "<!-- soak-disk:end -->"
ACTIVE = (S.JOB_STATE_QUEUED, S.JOB_STATE_PREPARING, S.JOB_STATE_TUNING, S.JOB_STATE_VERIFYING)
#: what each kind of call may answer besides OK: a full disk or a limit
ALLOWED = {
    "submit": {"RESOURCE_EXHAUSTED"},
    "upload+submit": {"RESOURCE_EXHAUSTED"},
    "upload": {"RESOURCE_EXHAUSTED"},
    "read": set(),
    "drop": {"ENOSPC"},
    "drop hostile": {"ENOSPC"},
}
WEIGHTS = {"submit": 3, "upload+submit": 2, "upload": 2, "read": 4, "drop": 1, "drop hostile": 2}
#: hostile models bigger than this are left out (the corpus has a 33 MB one)
HOSTILE_MAX_BYTES = 1 << 20
#: no new job while this many are queued or running
MAX_ACTIVE = 6


@dataclass
class Snapshot:
    """What is committed at one moment: finished jobs' states, their events (sequence
    number and kind), and the bank's keys."""

    when: str
    jobs: dict[str, int]
    events: dict[str, tuple[tuple[int, str], ...]]
    bank: set[str]

    def lost_since(self, before: Snapshot) -> list[str]:
        lost = [
            f"job {j} ({S.JobState.Name(s)}) is gone or changed"
            for j, s in before.jobs.items()
            if self.jobs.get(j) != s
        ]
        for j, evs in before.events.items():
            if missing := set(evs) - set(self.events.get(j, ())):
                lost.append(f"job {j}: {len(missing)} events gone, e.g. {sorted(missing)[:3]}")
        if missing := before.bank - self.bank:
            lost.append(f"{len(missing)} bank records gone, e.g. {sorted(missing)[:3]}")
        return [f"{before.when} -> {self.when}: {x}" for x in lost]


def all_jobs(stub, states=()) -> list[tuning_pb2.Job]:
    request, out = tuning_pb2.ListJobsRequest(states=states, page_size=1000), []
    while True:
        reply = stub.ListJobs(request, timeout=60)
        out += reply.jobs
        if not reply.next_page_token:
            return out
        request.page_token = reply.next_page_token


def snapshot(d: DaemonProcess, when: str) -> Snapshot:
    stub = d.tuning()
    jobs = {j.job_id: j.state for j in all_jobs(stub) if j.state in FINAL}
    events = {}
    for job_id in jobs:
        stream = stub.WatchJob(
            tuning_pb2.WatchJobRequest(job_id=job_id, include_logs=True), timeout=60
        )
        events[job_id] = tuple((m.event.sequence, m.event.WhichOneof("event")) for m in stream)
    return Snapshot(when, jobs, events, bank_keys(d.bank))


class Load:
    """Mixed calls from one thread until `stop` is set; counts each call's outcome."""

    def __init__(self, d: DaemonProcess, models: list[Path], hostile: list[Path], seed: int):
        self.d, self.models, self.hostile = d, models, hostile
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.unexpected: list[str] = []
        self.dropped: list[str] = []
        self._n = 0
        self._channel = grpc.insecure_channel(d.target)
        from aoe.v1 import tuning_pb2_grpc

        self.stub = tuning_pb2_grpc.TuningServiceStub(self._channel)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                what = self.rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
                if what != "read" and len(all_jobs(self.stub, ACTIVE)) >= MAX_ACTIVE:
                    what = "read"
                try:
                    getattr(self, "_" + what.replace(" ", "_").replace("+", "_"))()
                    got = "OK"
                except grpc.RpcError as exc:
                    got = exc.code().name
                    if got not in ALLOWED[what]:
                        self.unexpected.append(f"{what}: {got}: {exc.details()}")
                except OSError as exc:
                    got = "ENOSPC" if exc.errno == 28 else type(exc).__name__
                    if got not in ALLOWED[what]:
                        self.unexpected.append(f"{what}: {exc}")
                self.outcomes[what, got] += 1
                self.stop.wait(self.rng.uniform(0.1, 0.4))
        except grpc.RpcError as exc:  # the ListJobs of the pacing: the daemon did not answer
            self.unexpected.append(f"ListJobs: {exc.code().name}: {exc.details()}")
        finally:
            self._channel.close()

    def _options(self) -> tuning_pb2.JobOptions:
        return tuning_pb2.JobOptions(budget_s=self.rng.choice((0.5, 0.75, 1.0)))

    def _submit(self) -> None:
        self.stub.SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_path=str(self.rng.choice(self.models)), options=self._options()
            ),
            timeout=60,
        )

    def _upload_submit(self) -> None:
        model_id = upload(self.stub, self.rng.choice(self.models))
        self.stub.SubmitJob(
            tuning_pb2.SubmitJobRequest(model_id=model_id, options=self._options()), timeout=60
        )

    def _upload(self) -> None:  # left there: the quotas and upload_ttl_h bound what this keeps
        upload(self.stub, self.rng.choice(self.models))

    def _read(self) -> None:
        jobs = all_jobs(self.stub)
        if jobs:
            self.stub.GetJob(
                tuning_pb2.GetJobRequest(job_id=self.rng.choice(jobs).job_id), timeout=60
            )
        if not self.d.serving():
            self.unexpected.append("health: not SERVING")

    def _drop_into(self, src: Path, what: str) -> None:
        self._n += 1
        name = f"drop-{self._n:04d}-{what}.onnx"  # (no name is the start of another)
        part = self.d.inbox / f".{name}.part"
        try:
            shutil.copyfile(src, part)
            part.rename(self.d.inbox / name)
        except OSError:
            part.unlink(missing_ok=True)
            raise
        self.dropped.append(name)

    def _drop(self) -> None:
        self._drop_into(self.rng.choice(self.models), "good")

    def _drop_hostile(self) -> None:
        src = self.rng.choice(self.hostile)
        # (each kind's model is in a folder of its name)
        self._drop_into(src, f"hostile-{src.parent.name}")


def delivered(d: DaemonProcess, name: str) -> bool:
    """The dropped file `name` came out: its result in the outbox, or its reason in
    failed/ (under its name, or one the delivery made unique)."""
    stem = name.removesuffix(".onnx")
    out = [p.name for p in (d.inbox.parent / "outbox").glob(f"{stem}_*result.json")]
    failed = [p.name for p in (d.inbox.parent / "failed").glob(f"{stem}*.error.txt")]
    return bool(out or failed)


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def soak(root: Path, minutes: float, floor_mb: int, seed: int, log: Path) -> tuple[bool, list[str]]:
    floor = floor_mb << 20
    d = DaemonProcess(
        root,
        f"[limits]\nmin_free_mb = {floor_mb}\nmax_uploads_mb = 32\nmax_uploads = 16\n"
        "upload_ttl_h = 0.02\n",
    )
    d.log_path = log  # off the full disk, to read what happened
    models = [
        samples.save(samples.mlp(hidden=24 + 8 * i), d.models / f"mlp{i}.onnx") for i in range(6)
    ]
    models += [
        samples.save(samples.SAMPLES["cnn"](width=8 + 4 * i), d.models / f"cnn{i}.onnx")
        for i in range(4)
    ]
    corpus = Path(tempfile.mkdtemp(prefix="aoed-soak-corpus-"))
    hostile = []
    for kind in KINDS.values():
        if kind.by_path or kind.cli_only:
            continue
        case = kind.build(corpus / kind.name)
        if case.model.is_file() and case.model.stat().st_size <= HOSTILE_MAX_BYTES:
            hostile.append(case.model)
    problems: list[str] = []
    snaps: list[Snapshot] = []
    fills: list[tuple[float, float, int]] = []  # (started, lasted, bytes written)
    pid = 0
    load = None
    failed_by: Counter[str] = Counter()  # failed jobs by the class of their error
    t0 = time.monotonic()
    total = minutes * 60

    def check_alive() -> bool:
        if d.proc is None or d.proc.poll() is not None or d.proc.pid != pid:
            problems.append(f"the daemon exited ({d.proc.returncode if d.proc else '?'})")
            return False
        return True

    def until(t: float) -> bool:
        while time.monotonic() - t0 < t:
            if not check_alive():
                return False
            time.sleep(0.5)
        return check_alive()

    def take(when: str) -> None:
        snaps.append(snapshot(d, when))
        if len(snaps) > 1:
            problems.extend(snaps[-1].lost_since(snaps[-2]))
        s = snaps[-1]
        print(
            f"{time.monotonic() - t0:6.0f} s  {when}: {len(s.jobs)} finished jobs, "
            f"{sum(map(len, s.events.values()))} events, {len(s.bank)} bank records; {mib(free(root))} free",
            flush=True,
        )

    try:
        d.start()
        pid = d.proc.pid
        load = Load(d, models, hostile, seed)
        thread = threading.Thread(target=load.run, name="load")
        thread.start()
        fillers = []
        for k, (at_fill, at_free) in enumerate(
            ((total / 6, total / 3), (total / 2, 2 * total / 3))
        ):
            if not until(at_fill):
                break
            take(f"before fill {k + 1}")
            started = time.monotonic() - t0
            filler = fill(root)
            filler = filler.rename(root / f"filler{k + 1}")
            fillers.append(filler)
            print(
                f"{started:6.0f} s  filled: {mib(filler.stat().st_size)} written, {mib(free(root))} free",
                flush=True,
            )
            if not until(at_free):
                break
            size = filler.stat().st_size
            filler.unlink()
            fills.append((started, time.monotonic() - t0 - started, size))
            print(f"{time.monotonic() - t0:6.0f} s  freed", flush=True)
            if not until(at_free + 15):  # room for the backlog to be written and jobs to end
                break
            take(f"after free {k + 1}")
        else:
            until(total)
        load.stop.set()
        thread.join(120)
        # Drain: what is queued runs, what was dropped comes out.
        deadline = time.monotonic() + 600
        while check_alive() and time.monotonic() < deadline:
            active = all_jobs(d.tuning(), ACTIVE)
            if not active and all(delivered(d, n) for n in load.dropped):
                break
            time.sleep(2)
        if check_alive():
            take("at the end")
            failed_by.update(
                j.error_kind or "?" for j in all_jobs(d.tuning()) if j.state == S.JOB_STATE_FAILED
            )
            left = [n for n in load.dropped if not delivered(d, n)]
            if left:
                problems.append(f"{len(left)} dropped files never came out: {left[:5]}")
            if (room := free(root)) < floor:
                problems.append(
                    f"free space at the end {mib(room)}, below the floor of {mib(floor)}"
                )
            code = d.stop()
            if code != 0:
                problems.append(f"SIGTERM: exit status {code}")
            if (check := store_integrity(d.state)) != "ok":
                problems.append(f"job store after the stop: {check}")
            d.start()
            pid = d.proc.pid
            take("after a restart")
        problems.extend(load.unexpected)
    finally:
        if load is not None:
            load.stop.set()
        end_free = free(root) if root.exists() else -1
        d.close()
        shutil.rmtree(corpus, ignore_errors=True)

    # ------------------------------------------------------------------ figures
    out = load.outcomes if load is not None else Counter()
    jobs = Counter()
    last = snaps[-1] if snaps else None
    if last is not None:
        jobs.update(
            S.JobState.Name(s).removeprefix("JOB_STATE_").lower() for s in last.jobs.values()
        )
    checked = [
        f"{s.when}: {len(s.jobs)} jobs, {sum(map(len, s.events.values()))} events, {len(s.bank)} bank records"
        for s in snaps
    ]
    calls = "; ".join(
        f"{what} " + ", ".join(f"{n} {got}" for (w, got), n in sorted(out.items()) if w == what)
        for what in WEIGHTS
        if any(w == what for w, _ in out)
    )
    lost = [p for p in problems if " -> " in p]
    lines = [
        f"| daemon exits | {sum('daemon exited' in p for p in problems)} (the same process from start to the planned SIGTERM) |",
        "| fills | "
        + "; ".join(
            f"at {a:.0f} s, full for {b:.0f} s ({mib(c)} written to fill it)" for a, b, c in fills
        )
        + " |",
        f"| calls (by outcome) | {calls} |",
        f"| jobs at the end | {sum(jobs.values())}: "
        + ", ".join(f"{n} {s}" for s, n in sorted(jobs.items()))
        + (
            " (failed with: " + ", ".join(f"{n} {k}" for k, n in failed_by.most_common()) + ")"
            if failed_by
            else ""
        )
        + " |",
        f"| inbox drops | {len(load.dropped) if load else 0} ({sum('-hostile-' in n for n in (load.dropped if load else []))}"
        " from the hostile corpus), every one out in outbox/ or failed/ at the end"
        + ("" if not any("never came out" in p for p in problems) else ": NO")
        + " |",
        f"| committed records compared, snapshot to snapshot | {'; '.join(checked)}: {len(lost)} lost |",
        f"| free space at the end | {mib(end_free)} (floor {mib(floor)}) |",
    ]
    return not problems, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="length of the run (default 30)")
    ap.add_argument(
        "--size-mb",
        type=int,
        default=200,
        help="size of the tmpfs holding the state dir (default 200)",
    )
    ap.add_argument(
        "--floor-mb", type=int, default=16, help="[limits] min_free_mb of the daemon (default 16)"
    )
    ap.add_argument("--seed", type=int, default=1, help="seed of the load's choices (default 1)")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the daemon's files (they live in the tmpfs: copied out)",
    )
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    args = ap.parse_args(argv)

    host = Machine()
    work = Path(tempfile.mkdtemp(prefix="aoed-soak-disk-"))
    root = work / "fs"
    root.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={args.size_mb}m", "tmpfs", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        print(
            f"soak_disk: cannot mount a {args.size_mb} MB tmpfs (needs root): {r.stderr.strip()}",
            file=sys.stderr,
        )
        return 2
    log = work / "aoed.log"
    t0 = time.monotonic()
    try:
        ok, rows = soak(root, args.minutes, args.floor_mb, args.seed, log)
        if not ok or args.keep:
            shutil.copytree(
                root,
                work / "kept",
                symlinks=True,
                ignore=shutil.ignore_patterns("filler*"),
                dirs_exist_ok=True,
            )
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False, capture_output=True)
    took = time.monotonic() - t0
    host.finish()
    short = "" if args.minutes >= 30 else " (a short run: `make soak` runs 30 minutes)"
    text = "\n".join(
        [
            "## A full disk under load (`python bench/soak_disk.py`)",
            "",
            f"Machine: {host.describe('onnxruntime', 'lmdb', 'grpcio')}.",
            "",
            f"Run: {args.minutes:g} minutes{short}, {took / 60:.1f} minutes with the drain and the restart; "
            f"{time.strftime('%Y-%m-%d')}. State dir, bank, inbox and models on a {args.size_mb} MB tmpfs, "
            f"`min_free_mb = {args.floor_mb}`; one client thread making mixed calls (seed {args.seed}); the "
            "filesystem filled to the last byte at 1/6 and 1/2 of the run, freed at 1/3 and 2/3.",
            "",
            "| figure | value |",
            "|---|---|",
            *rows,
            "",
            f"Result: {'PASS' if ok else 'FAIL'}.",
        ]
    )
    publish(text, args.out, BEGIN, END, write=not args.no_write)
    if not ok or args.keep:
        print(f"the daemon's log: {log}; its files: {work / 'kept'}")
    if ok and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

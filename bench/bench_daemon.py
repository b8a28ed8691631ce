"""The daemon under load, all phases in one run, written into bench/RESULTS.md.

    python bench/bench_daemon.py [--quick] [--no-write] [--out bench/RESULTS.md]

One real `aoed` (tests/daemon_util.py) on a temporary unix socket, `max_rpcs = 256`, its
bank holding synthetic entries. The same tuning job (the sample CNN, random weights,
budget 10 s, repeat_tune, so every run tunes every task; each run the same graph with
different bytes, so that it is a job of its own) runs in each phase, and its wall time
(the daemon's own started -> finished) is compared with the idle run's:

  idle          nothing else runs (after a small warm-up job; in full mode again at the end)
  RPC load      50 clients, each on a connection of its own in a thread, make 200 calls
                each, drawn from GetJob, ListJobs, LookupEntry (a key the bank holds, a
                well-formed one it does not), GetDaemonInfo and short WatchJob streams
                (three events, then cancel); every call's latency and status is kept
  200 watchers  200 WatchJob streams, each on a connection of its own, opened as the job
                is submitted and read to the end; each must end with SUCCEEDED
  CPU hogs      one busy-loop process per usable core for the whole job; it must succeed

Then a second daemon with `max_rpcs = 16`: 12 watch streams held open on a running job,
50 clients x 20 mixed calls on top (RESOURCE_EXHAUSTED is the expected answer beyond the
limit, at once rather than queued); the held streams released, 4 clients x 20 calls must
all be served. Requirements: no status but OK under the limit, only OK and
RESOURCE_EXHAUSTED beyond it, all watchers see the final state, the hogged job succeeds;
the exit status is 1 when one fails (after the results are written).

--quick: budget 5 s, 20 clients x 200 calls, 50 watchers, 20 x 10 calls beyond the
limit, a bank of 500 entries, no second idle run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from aoe.v1 import daemon_pb2, tuning_pb2, tuning_pb2_grpc
from machine import Machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- daemon:begin -->", "<!-- daemon:end -->"
MIX = ("GetJob", "ListJobs", "LookupEntry hit", "LookupEntry miss", "GetDaemonInfo", "WatchJob")
SUCCEEDED = tuning_pb2.JOB_STATE_SUCCEEDED


@dataclass(frozen=True)
class Size:
    budget_s: float
    clients: int
    calls: int
    watchers: int
    over_clients: int
    over_calls: int
    bank_entries: int
    idle_again: bool


FULL = Size(
    budget_s=10.0,
    clients=50,
    calls=200,
    watchers=200,
    over_clients=50,
    over_calls=20,
    bank_entries=5000,
    idle_again=True,
)
QUICK = Size(
    budget_s=5.0,
    clients=20,
    calls=200,
    watchers=50,
    over_clients=20,
    over_calls=10,
    bank_entries=500,
    idle_again=False,
)


# --------------------------------------------------------------------------- clients


def connect(target: str) -> grpc.Channel:
    """A channel with a connection of its own: by default, channels to one target share a
    subchannel, and "50 clients" would be 50 streams on one connection."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


@dataclass(frozen=True)
class Call:
    kind: str
    outcome: str  # a status code name, or WRONG for an OK answer that says the wrong thing
    seconds: float


def client(
    target: str,
    pid: int,
    n: int,
    job: dict[str, str],
    hits: list[str],
    misses: list[str],
    seed: int,
    start: threading.Barrier,
) -> list[Call]:
    """`n` calls drawn from MIX on a connection of its own, made before `start`; the job
    they ask about is `job["id"]`, there once `start` lets them go."""
    from tests.daemon_util import mixed_calls

    rng = random.Random(seed)
    out = []
    with connect(target) as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        start.wait(timeout=120)
        table = mixed_calls(ch, pid, job["id"], hits, misses, rng)
        for _ in range(n):
            kind = rng.choice(MIX)
            t0 = time.perf_counter()
            try:
                outcome = "OK" if table[kind]() else "WRONG"
            except grpc.RpcError as exc:
                outcome = exc.code().name
            out.append(Call(kind, outcome, time.perf_counter() - t0))
    return out


@dataclass(frozen=True)
class Load:
    calls: list[Call]
    job_id: str
    start: float  # time.time() when the clients were let go
    end: float  # ... when the last one finished

    @property
    def seconds(self) -> float:
        return self.end - self.start


def load(
    target: str,
    pid: int,
    clients: int,
    n: int,
    hits: list[str],
    misses: list[str],
    job: Callable[[], str],
) -> Load:
    """`clients` clients making `n` calls each. Once all are connected, `job()` names the
    job they ask about (it may submit it) and they start together."""
    box: dict[str, str] = {}
    t: list[float] = []

    def go() -> None:  # runs once, in one client thread, before any is released
        box["id"] = job()
        t.append(time.time())

    start = threading.Barrier(clients, action=go)
    with ThreadPoolExecutor(clients) as pool:
        futures = [
            pool.submit(client, target, pid, n, box, hits, misses, seed, start)
            for seed in range(clients)
        ]
        results = [c for f in futures for c in f.result()]
    return Load(results, box["id"], t[0], time.time())


@dataclass(frozen=True)
class Watched:
    in_sequence: bool  # sequence numbers 1, 2, 3, ... without a gap
    final: int  # the state of the last event; 0 when it was not a state change
    opened: float  # time.time() when the first event arrived
    lag_s: float  # from the final event's own time to its arrival here
    error: str = ""  # the status code name when the stream failed


def watch_to_end(target: str, job: dict[str, str], start: threading.Barrier) -> Watched:
    """One WatchJob stream, logs included, read to its end on a connection of its own."""
    with connect(target) as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        start.wait(timeout=120)
        stream = tuning_pb2_grpc.TuningServiceStub(ch).WatchJob(
            tuning_pb2.WatchJobRequest(job_id=job["id"], include_logs=True), timeout=600
        )
        seqs, opened, last, arrived = [], 0.0, None, 0.0
        try:
            for msg in stream:
                arrived = time.time()
                opened = opened or arrived
                seqs.append(msg.event.sequence)
                last = msg.event
        except grpc.RpcError as exc:
            return Watched(False, 0, opened, float("nan"), exc.code().name)
    if last is None:
        return Watched(False, 0, 0.0, float("nan"), "no event")
    final = last.state_change.state if last.WhichOneof("event") == "state_change" else 0
    return Watched(
        seqs == list(range(1, len(seqs) + 1)),
        final,
        opened,
        arrived - last.time.ToNanoseconds() / 1e9,
    )


def watchers(target: str, n: int, job: Callable[[], str]) -> tuple[list[Watched], str]:
    """`n` streams read to the end; once all are connected, `job()` names the job (it may
    submit it) and they open their streams together. Returns (streams, the job's id)."""
    box: dict[str, str] = {}
    start = threading.Barrier(n, action=lambda: box.update(id=job()))
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(watch_to_end, target, box, start) for _ in range(n)]
        return [f.result() for f in futures], box["id"]


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[list[subprocess.Popen]]:
    """`n` busy-loop processes for the duration of the block."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield hogs
    finally:
        for h in hogs:
            h.kill()
            h.wait()


# --------------------------------------------------------------------------- jobs


class Jobs:
    """Submits the phases' job to a daemon: one graph, new bytes each time, so that each
    run is a job of its own (identical submissions join the active one), and repeat_tune,
    so that each run tunes every task rather than taking the last run's bank entries."""

    def __init__(self, d, name: str, budget_s: float) -> None:
        self.d, self.name, self.budget_s, self.runs = d, name, budget_s, 0

    def submit(self, budget_s: float | None = None, name: str | None = None) -> str:
        from aoed import samples

        self.runs += 1
        name = name or self.name
        model = samples.build(name)
        model.doc_string = f"bench run {self.runs}"
        path = samples.save(model, self.d.models / f"{name}-{self.runs}.onnx")
        options = tuning_pb2.JobOptions(budget_s=budget_s or self.budget_s, repeat_tune=True)
        return (
            self.d.tuning()
            .SubmitJob(
                tuning_pb2.SubmitJobRequest(model_path=str(path), options=options), timeout=60
            )
            .job_id
        )

    def run(self, **kw):
        """Submit and wait; returns the final Job."""
        return self.d.wait_job(self.submit(**kw), timeout=600)


def wall_s(job) -> float:
    """The daemon's own started -> finished of a final job."""
    return (job.finished.ToNanoseconds() - job.started.ToNanoseconds()) / 1e9


def fill_bank(path: Path, n: int, tmp: Path) -> tuple[list[str], list[str]]:
    """`n` synthetic entries (a real task signature's shape, this machine's fingerprint) in
    a new bank at `path`; returns keys it holds and well-formed keys it does not."""
    from aoed import samples
    from aoed.engine.prep import prepare
    from bench_bank import build_bank

    # build_bank adds the transformer's own tasks too; the jobs here tune the CNN.
    samples.save(samples.build("transformer"), tmp / "bank-model.onnx")
    keys, _ = build_bank(path, n, prepare(tmp / "bank-model.onnx", tmp / "bank-prep").model)
    hits = [k.decode() for k in keys]
    rng = random.Random(0)
    misses = []
    for key in rng.sample(hits, min(len(hits), 1000)):
        version, _, dev, precision = key.split("/")
        misses.append("/".join((version, f"{rng.getrandbits(128):032x}", dev, precision)))
    return hits, misses


# --------------------------------------------------------------------------- phases


@dataclass
class Run:
    """What the phases measured; `failures` names each requirement not met."""

    walls: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    failures: list[str] = field(default_factory=list)
    hits: list[str] = field(default_factory=list)  # bank keys the lookups use
    misses: list[str] = field(default_factory=list)
    loaded: Load | None = None
    loaded_covered: float = 0.0
    watched: list[Watched] | None = None
    watched_finished: float = 0.0
    hogged_state: int = 0
    hogged_ok: bool = False
    over: Load | None = None
    after: Load | None = None


def main_daemon(tmp: Path, bank: Path, size: Size, cores: int, run: Run, say) -> None:
    """The phases on one daemon with max_rpcs = 256 (the 50 clients and the 200 watchers
    fit), starting with a copy of `bank`."""
    from tests.daemon_util import DaemonProcess

    d = DaemonProcess(tmp / "a", listen_toml="max_rpcs = 256\n")
    shutil.copytree(bank, d.bank)
    hits, misses = run.hits, run.misses
    try:
        d.start()
        jobs = Jobs(d, "cnn", size.budget_s)
        jobs.run(budget_s=1.0, name="mlp")  # warm-up: the first job pays for starting workers
        say("warm-up done")

        idle = jobs.run()
        run.walls["idle"].append(wall_s(idle))
        say(f"idle: {wall_s(idle):.1f} s")

        run.loaded = loaded = load(
            d.target, d.proc.pid, size.clients, size.calls, hits, misses, jobs.submit
        )
        job = d.wait_job(loaded.job_id, timeout=600)
        run.walls["RPC load"].append(wall_s(job))
        began, ended = job.started.ToNanoseconds() / 1e9, job.finished.ToNanoseconds() / 1e9
        run.loaded_covered = max(0.0, min(loaded.end, ended) - max(loaded.start, began)) / wall_s(
            job
        )
        say(
            f"RPC load: {len(loaded.calls)} calls in {loaded.seconds:.1f} s, {codes_text(loaded.calls)}; "
            f"job {wall_s(job):.1f} s"
        )
        if job.state != SUCCEEDED:
            run.failures.append(
                f"the job under RPC load ended {tuning_pb2.JobState.Name(job.state)}"
            )
        if {c.outcome for c in loaded.calls} != {"OK"}:
            run.failures.append(f"under the limit, calls answered {codes_text(loaded.calls)}")

        run.watched, watched_id = watchers(d.target, size.watchers, jobs.submit)
        job = d.wait_job(watched_id, timeout=600)
        run.walls[f"{size.watchers} watchers"].append(wall_s(job))
        run.watched_finished = job.finished.ToNanoseconds() / 1e9
        saw = sum(w.final == SUCCEEDED and w.in_sequence for w in run.watched)
        errors = collections.Counter(w.error for w in run.watched if w.error)
        say(
            f"{size.watchers} watchers: {saw} saw SUCCEEDED, errors {dict(errors)}; job {wall_s(job):.1f} s"
        )
        if saw != size.watchers:
            run.failures.append(
                f"only {saw} of {size.watchers} watchers saw every event and SUCCEEDED "
                f"(errors: {dict(errors)})"
            )

        with cpu_hogs(cores) as hogs:
            job = jobs.run()
            hogs_ran = all(h.poll() is None for h in hogs)
        run.walls[f"{cores} CPU hogs"].append(wall_s(job))
        run.hogged_state = job.state
        run.hogged_ok = (
            job.state == SUCCEEDED and Path(job.result.tuned_model_path).is_file() and hogs_ran
        )
        say(f"CPU hogs: job {wall_s(job):.1f} s, {tuning_pb2.JobState.Name(job.state)}")
        if not run.hogged_ok:
            run.failures.append(
                f"under CPU hogs the job ended {tuning_pb2.JobState.Name(job.state)} "
                f"(hogs ran throughout: {hogs_ran})"
            )

        if size.idle_again:
            again = jobs.run()
            run.walls["idle"].append(wall_s(again))
            say(f"idle again: {wall_s(again):.1f} s")
    finally:
        d.close()


def over_the_limit(tmp: Path, bank: Path, size: Size, run: Run, say) -> None:
    """A daemon with max_rpcs = 16 and a copy of `bank`, 12 of its RPCs held by watch
    streams on a running job: mixed calls on top, then, with the streams released, calls
    within the limit."""
    from tests.daemon_util import DaemonProcess

    limit, held = 16, 12
    hits, misses = run.hits, run.misses
    d = DaemonProcess(tmp / "b", listen_toml=f"max_rpcs = {limit}\n")
    shutil.copytree(bank, d.bank)
    try:
        d.start()
        job_id = Jobs(d, "cnn", 300.0).submit()  # cancelled below, long before its budget
        release, opened = threading.Event(), threading.Semaphore(0)
        held_throughout: list[bool] = []

        def hold() -> None:
            with connect(d.target) as ch:
                stream = tuning_pb2_grpc.TuningServiceStub(ch).WatchJob(
                    tuning_pb2.WatchJobRequest(job_id=job_id), timeout=300
                )
                next(stream)  # admitted: the stream is open and holds its slot
                opened.release()
                release.wait(300)
                held_throughout.append(stream.is_active())
                stream.cancel()

        threads = [threading.Thread(target=hold, daemon=True) for _ in range(held)]
        for t in threads:
            t.start()
        try:
            for _ in range(held):
                if not opened.acquire(timeout=60):
                    raise RuntimeError(
                        f"the {held} held streams did not all open:\n{d.log()[-3000:]}"
                    )
            run.over = load(
                d.target,
                d.proc.pid,
                size.over_clients,
                size.over_calls,
                hits,
                misses,
                lambda: job_id,
            )
        finally:
            release.set()
            for t in threads:
                t.join(30)
        say(f"over the limit: {codes_text(run.over.calls)}")
        # A slot comes back once its stream's handler has returned; wait for that.
        deadline = time.monotonic() + 30
        while True:
            try:
                d.daemon().GetDaemonInfo(daemon_pb2.GetDaemonInfoRequest(), timeout=10)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        run.after = load(d.target, d.proc.pid, 4, 20, hits, misses, lambda: job_id)
        say(f"after: {codes_text(run.after.calls)}")
        d.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=job_id), timeout=60)
    finally:
        d.close()
    outcomes = {c.outcome for c in run.over.calls}
    if outcomes - {"OK", "RESOURCE_EXHAUSTED"}:
        run.failures.append(f"beyond the limit, calls answered {codes_text(run.over.calls)}")
    if "RESOURCE_EXHAUSTED" not in outcomes:
        run.failures.append("beyond the limit, no call was refused")
    if {c.outcome for c in run.after.calls} != {"OK"}:
        run.failures.append(
            f"after the held streams ended, calls answered {codes_text(run.after.calls)}"
        )
    if held_throughout.count(True) != held:
        run.failures.append(
            f"only {held_throughout.count(True)} of the {held} held streams stayed open throughout"
        )


# --------------------------------------------------------------------------- report


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def pct(values: list[float], q: float) -> float:
    from aoed.engine.stats import quantile

    return quantile(values, q)


def codes_text(calls_: list[Call]) -> str:
    counts = collections.Counter(c.outcome for c in calls_)
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def latency_rows(calls_: list[Call]) -> list[str]:
    rows = []
    for kind in (*MIX, "all"):
        mine = [c for c in calls_ if kind in ("all", c.kind)]
        ok = [c.seconds for c in mine if c.outcome == "OK"]
        other = codes_text([c for c in mine if c.outcome != "OK"]) or "none"
        lat = f"{ms(pct(ok, 0.5))} | {ms(pct(ok, 0.99))} | {ms(max(ok))}" if ok else "- | - | -"
        rows.append(
            f"| {'**all**' if kind == 'all' else kind} | {len(mine)} | {len(ok)} | {other} | {lat} |"
        )
    return rows


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(run: Run, size: Size, cores: int, host: Machine, mode: str, total_s: float) -> str:
    loaded, over, after, watched = run.loaded, run.over, run.after, run.watched
    idle_s = sum(run.walls["idle"]) / len(run.walls["idle"])
    wall_rows = []
    for phase, values in run.walls.items():
        ratio = "1.00x (reference)" if phase == "idle" else f"{values[0] / idle_s:.2f}x"
        wall_rows.append(f"| {phase} | {', '.join(f'{v:.2f}' for v in values)} | {ratio} |")
    saw = sum(w.final == SUCCEEDED and w.in_sequence for w in watched)
    opened_running = sum(w.opened < run.watched_finished for w in watched)
    lags = [w.lag_s for w in watched if w.final == SUCCEEDED]
    refused = [c.seconds for c in over.calls if c.outcome == "RESOURCE_EXHAUSTED"]
    over_ok = not {c.outcome for c in over.calls} - {"OK", "RESOURCE_EXHAUSTED"} and bool(refused)
    lines = [
        "## The daemon under load (`python bench/bench_daemon.py`)",
        "",
        f"Machine: {host.describe('grpcio', 'onnxruntime', 'trio')}.",
        "",
        (
            f"Run: {mode}, {time.strftime('%Y-%m-%d')}, {total_s / 60:.1f} min in all. Synthetic models: the sample "
            f"CNN (random weights, synthetic inputs), tuned with budget_s {size.budget_s:g} and repeat_tune in every "
            "phase (the same graph, new bytes each time, so each run is a job of its own); a bank of "
            f"{size.bank_entries} synthetic entries for the lookups. One daemon with `max_rpcs = 256`; the clients "
            "are threads of the benchmark process on the same cores, so their own time is in the latencies. All "
            "figures come from this one run."
        ),
        "",
        f"### {size.clients} clients x {size.calls} calls while the job runs",
        "",
        (
            f"Each client has a connection of its own; {len(loaded.calls)} calls in {loaded.seconds:.1f} s "
            f"({len(loaded.calls) / loaded.seconds:.0f} calls/s), covering {run.loaded_covered:.0%} of the job's run. "
            f"Outcomes: {codes_text(loaded.calls)}. Requirement, no status but OK: "
            f"{_verdict({c.outcome for c in loaded.calls} == {'OK'})}."
        ),
        "",
        "| call | calls | OK | other outcomes | p50 ms | p99 ms | max ms |",
        "|---|--:|--:|---|--:|--:|--:|",
        *latency_rows(loaded.calls),
        "",
        (
            "WatchJob is a short stream: open, three events, cancel. LookupEntry hit / miss: a key the bank holds / "
            "a well-formed key it does not (both answer OK with `found` true / false; a wrong answer counts as WRONG)."
        ),
        "",
        f"### {size.watchers} watchers on one job",
        "",
        f"{size.watchers} WatchJob streams (logs included), each on a connection of its own, {opened_running} of "
        f"them opened while the job ran: {saw} of {size.watchers} read every event in sequence and ended with "
        f"SUCCEEDED ({_verdict(saw == size.watchers)}). "
        + (
            f"The final event reached them {ms(pct(lags, 0.5))} ms (p50), {ms(pct(lags, 0.99))} ms (p99), "
            f"{ms(max(lags))} ms (max) after the daemon recorded it."
            if lags
            else ""
        ),
        "",
        "### Beyond max_rpcs",
        "",
        f"A second daemon with `max_rpcs = 16`, 12 of them held by WatchJob streams on a running job; on top, "
        f"{size.over_clients} clients x {size.over_calls} mixed calls: {codes_text(over.calls)}. Requirement, "
        f"only OK and RESOURCE_EXHAUSTED, and some of the latter: {_verdict(over_ok)}"
        + (
            f"; a refusal came back in {ms(pct(refused, 0.5))} ms (p50), {ms(pct(refused, 0.99))} ms (p99): at "
            "once, not queued"
            if refused
            else ""
        )
        + f". With the held streams ended, 4 clients x 20 calls: {codes_text(after.calls)} "
        f"({_verdict({c.outcome for c in after.calls} == {'OK'})}).",
        "",
        "### The job's wall time",
        "",
        "The daemon's own started -> finished of the same job in each phase; the ratio is to the mean of the "
        "idle runs"
        + (" (one before the loaded phases, one after)." if len(run.walls["idle"]) > 1 else "."),
        "",
        "| phase | wall s | vs idle |",
        "|---|--:|--:|",
        *wall_rows,
        "",
        (
            f"Under {cores} CPU hogs (one `while True: pass` process per usable core, running throughout) the job "
            f"ended {tuning_pb2.JobState.Name(run.hogged_state)} with its tuned model written: "
            f"{_verdict(run.hogged_ok)}."
        ),
    ]
    if run.failures:
        lines += ["", "Requirements not met: " + "; ".join(run.failures) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="fewer clients, calls and watchers; a shorter job"
    )
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    args = ap.parse_args(argv)
    size = QUICK if args.quick else FULL

    cores = len(os.sched_getaffinity(0))
    host = Machine()  # before the work: the load average says what else was running
    t0 = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {text}", file=sys.stderr, flush=True)

    run = Run()
    with tempfile.TemporaryDirectory(prefix="bench-daemon-") as tmp_name:
        tmp = Path(tmp_name)
        run.hits, run.misses = fill_bank(tmp / "bank", size.bank_entries, tmp)
        main_daemon(tmp, tmp / "bank", size, cores, run, say)
        over_the_limit(tmp, tmp / "bank", size, run, say)
    host.finish()

    text = report(run, size, cores, host, "quick" if args.quick else "full", time.monotonic() - t0)
    from bench_bank import publish

    publish(text, args.out, BEGIN, END, write=not args.no_write)
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    # tests/daemon_util.py: a real daemon on a temporary socket
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())

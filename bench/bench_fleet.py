"""One bank across servers: how far behind its followers are, at 1,000 records/s; and
one job on one device vs two devices (cores split) vs three Ray nodes.

    python bench/bench_fleet.py [--quick] [--no-write] [--out bench/RESULTS.md] [--only lag|devices]

Devices: one real `aoed` per configuration, `[tuning] devices = ["cpu:0"]` then
`["cpu:0", "cpu:1"]`, each tuning the same sample model with the same budget (a fresh
bank each run, so nothing is answered from the bank); wall time from the job's start to
its end, device seconds, each device's duty cycle and trials, and the speedup (median
wall time on one device over that on two). Then, with the cluster extra installed, a Ray
cluster of three one-CPU nodes on this machine (ray.cluster_utils.Cluster, each node
offering one device's resource) and a daemon with `[cluster] executor = "ray"` measuring
on `cpu:0`, `cpu:1`, `cpu:2` there. Quick: 2 runs each; full: 5.

Three real `aoed` processes (tests/daemon_util.py) on temporary unix sockets, on this
one machine: `a`, and `b` and `c`, each following the other two (`[bank] follow`). A
writer thread imports synthetic entries into `a` (ImportEntries, overwrite) at 1,000
records/s: a batch of 100 every 100 ms on a fixed schedule. Every bank stamps each write
with its commit time in its log; the benchmark reads the three logs with FollowBank
(aoe.Client.bank_follow, one thread each) and, for each record, takes the time from
its commit in `a` to its commit in `b` and in `c`: the follow lag. One clock (one
machine), so the difference is the lag itself.

Target: p99 <= 1 s. --quick: 10 s of writing (10,000 records); full: 60 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from machine import Machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- fleet:begin -->", "<!-- fleet:end -->"
DEV_BEGIN, DEV_END = "<!-- fleet-devices:begin -->", "<!-- fleet-devices:end -->"
DEV_MODEL, DEV_BUDGET_S = "cnn", 8.0
TARGET_SPEEDUP = 1.7  # two devices, where each has cores of its own
RATE = 1000  # records per second
BATCH = 100  # records per ImportEntries call
TARGET_P99_S = 1.0


@dataclass
class Run:
    seconds: float
    sent: int = 0
    send_s: float = 0.0
    late_batches: int = 0  # batches that left more than one interval after their slot
    commits: dict[str, dict[bytes, int]] = field(default_factory=lambda: {n: {} for n in "abc"})


def entries(n: int) -> list:
    """`n` distinct valid entries (the import checks pass: digests of their canonical
    JSON, keys of their signature and this machine's fingerprint), as BankEntry."""
    from aoe.bankrecord import BankRecord, Measured, encode
    from aoe.fingerprint import device_fingerprint
    from aoe.keys import TaskSignature, bank_key
    from aoe.v1 import bank_pb2

    dev = device_fingerprint("CPUExecutionProvider")
    out = []
    for i in range(n):
        text = json.dumps(
            {"op": "MatMul", "shapes": [[1, 256], [256, 256]], "bench": i}, sort_keys=True
        )
        sig = TaskSignature("MatMul", "", 17, text, hashlib.sha256(text.encode()).hexdigest())
        rec = BankRecord(
            key=bank_key(sig.digest, dev.digest, "exact"),
            signature=sig,
            device=dev,
            strategy="gemm_pretransposed",
            family="matmul",
            precision="exact",
            winner=Measured(10.0, 0.02, 30, 9.5),
            baseline=Measured(12.0, 0.02, 30, 11.5),
            host="bench",
            created_unix=time.time(),
        )
        out.append(bank_pb2.BankEntry.FromString(encode(rec)))
    return out


def watch(stream, name: str, run: Run, ready: threading.Barrier) -> None:
    """Record each entry's commit time in one bank, from its FollowBank stream (until
    the stream is cancelled)."""
    seen = run.commits[name]
    first = True
    for msg in stream:
        for c in msg.changes:
            if c.kind == "entry":
                seen[c.key] = c.committed_unix_ns
        if first:
            first = False
            ready.wait()


def write(a, items: list, run: Run) -> None:
    """Import `items` into `a` at RATE records/s, BATCH per call, on a fixed schedule."""
    from aoe.v1 import bank_pb2

    options = bank_pb2.ImportEntriesRequest(
        options=bank_pb2.ImportOptions(policy=bank_pb2.MERGE_POLICY_OVERWRITE)
    )
    interval = BATCH / RATE
    t0 = time.monotonic()
    for i in range(0, len(items), BATCH):
        slot = t0 + (i // BATCH) * interval
        now = time.monotonic()
        if now < slot:
            time.sleep(slot - now)
        elif now - slot > interval:
            run.late_batches += 1
        requests = [options] + [
            bank_pb2.ImportEntriesRequest(entry=e) for e in items[i : i + BATCH]
        ]
        reply = a.ImportEntries(iter(requests), timeout=60)
        run.sent += reply.added + reply.updated
    run.send_s = time.monotonic() - t0


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(tmp: Path, seconds: float, say) -> Run:
    from aoe.client import Client
    from aoe.v1 import bank_pb2_grpc
    from tests.daemon_util import DaemonProcess

    run = Run(seconds)
    daemons = {n: DaemonProcess(tmp / n) for n in "abc"}
    for n, d in daemons.items():
        targets = ", ".join(f'"unix://{p.socket}"' for m, p in daemons.items() if m != n)
        d.config.write_text(
            d.config.read_text().replace("[bank]\n", f"[bank]\nfollow = [{targets}]\n", 1)
        )
    items = entries(int(seconds * RATE))
    say(f"{len(items)} entries built")
    clients = {}
    try:
        for d in daemons.values():
            d.start()
        say("three daemons serving, each following the other two")
        ready = threading.Barrier(4)
        clients = {n: Client(d.socket, timeout=30) for n, d in daemons.items()}
        streams = {n: c.bank_follow(0) for n, c in clients.items()}
        watchers = [
            threading.Thread(target=watch, args=(streams[n], n, run, ready), daemon=True)
            for n in "abc"
        ]
        for t in watchers:
            t.start()
        ready.wait()
        write(bank_pb2_grpc.BankServiceStub(daemons["a"].channel()), items, run)
        say(f"wrote {run.sent} records in {run.send_s:.1f} s")
        keys = [e.key.encode() for e in items]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            len(run.commits[n]) >= len(keys) for n in "abc"
        ):
            time.sleep(0.1)
        for stream in streams.values():
            stream.cancel()
        for t in watchers:
            t.join(10)
        for c in clients.values():
            c.close()
    finally:
        for d in daemons.values():
            d.close()
    return run


def report(run: Run, host: Machine, mode: str, elapsed: float) -> str:
    a = run.commits["a"]
    rows, verdicts = [], []
    for n in "bc":
        got = run.commits[n]
        lags = [(got[k] - a[k]) / 1e9 for k in a if k in got]
        missing = len(a) - len(lags)
        p50, p99, worst = (
            (percentile(lags, q) for q in (0.5, 0.99, 1.0)) if lags else (float("nan"),) * 3
        )
        ok = missing == 0 and p99 <= TARGET_P99_S
        verdicts.append(ok)
        rows.append(
            f"| a -> {n} | {len(lags)} of {len(a)} | {p50 * 1000:.1f} | {p99 * 1000:.1f} | {worst * 1000:.1f} |"
            f" {'PASS' if ok else 'FAIL'} |"
        )
    rate = run.sent / run.send_s if run.send_s else 0.0
    lines = [
        "## One bank across servers: follow lag (`python bench/bench_fleet.py`)",
        "",
        f"Machine: {host.describe('grpcio', 'lmdb', 'trio')}.",
        "",
        f"Run: {mode}, {time.strftime('%Y-%m-%d')}, {elapsed / 60:.1f} min in all. Synthetic records: distinct "
        "valid bank entries (this machine's fingerprint), imported into daemon `a` in batches of "
        f"{BATCH} on a fixed schedule for {run.seconds:g} s: {run.sent} records in {run.send_s:.1f} s, "
        f"{rate:.0f} records/s achieved ({run.late_batches} batches left later than one interval after their "
        "slot). Three daemons on this one machine, each following the other two over unix sockets; the "
        "benchmark reads each bank's log with FollowBank too (a fourth stream on `a`, one more on `b` and "
        "`c`). Lag: from a record's commit in `a` to its commit in the follower, both stamped by the banks "
        "(one clock). All three daemons, the writer and the readers share the machine's "
        f"{host.usable} cores, so the figures include their competition for them (and with the other work "
        "the load average shows).",
        "",
        *(
            [
                f"The writer fell short of {RATE} records/s: ImportEntries checks each record through its JSON "
                "exchange form, on cores it shares with everything else here; that limits the writing, not the "
                "following.",
                "",
            ]
            if rate < 0.98 * RATE
            else []
        ),
        "What this cannot show: servers apart. Here a peer is a unix socket away; between machines add the "
        "network's round trip and TLS to each figure, and the peers' clocks' difference to the lag "
        "`aoed_bank_follow_lag_seconds` reports (not to these figures: one clock).",
        "",
        "| follower | records seen | p50 ms | p99 ms | max ms | target p99 <= 1 s, none lost |",
        "|---|--:|--:|--:|--:|---|",
        *rows,
    ]
    return "\n".join(lines)


def device_runs(tmp: Path, devices: list[str], reps: int, say, extra_toml: str = "") -> list[dict]:
    """One job per run on a fresh daemon measuring on `devices` (with `extra_toml` in its
    config): wall s, device s, and per device (device_s, duty_cycle, trials)."""
    from aoe.v1 import tuning_pb2
    from aoed import samples
    from tests.daemon_util import DaemonProcess, upload

    out = []
    for i in range(reps):
        d = DaemonProcess(tmp / f"{len(devices)}-{i}", extra_toml)
        listed = ", ".join(f'"{n}"' for n in devices)
        d.config.write_text(
            d.config.read_text().replace("[tuning]\n", f"[tuning]\ndevices = [{listed}]\n", 1)
        )
        model = d.models / f"{DEV_MODEL}.onnx"
        samples.save(samples.build(DEV_MODEL), model)
        try:
            d.start(timeout=240)
            job_id = (
                d.tuning()
                .SubmitJob(
                    tuning_pb2.SubmitJobRequest(
                        model_id=upload(d.tuning(), model),
                        options=tuning_pb2.JobOptions(budget_s=DEV_BUDGET_S),
                    ),
                    timeout=30,
                )
                .job_id
            )
            job = d.wait_job(job_id, timeout=600)
            if job.state != tuning_pb2.JOB_STATE_SUCCEEDED:
                raise RuntimeError(f"job on {devices} ended {job.state}: {job.error}")
            res = json.loads(Path(job.result.result_json_path).read_text())["resources"]
            wall = (job.finished.ToNanoseconds() - job.started.ToNanoseconds()) / 1e9
            out.append(
                {
                    "wall_s": wall,
                    "device_s": res["device_s"],
                    "trials": res["trials"],
                    "devices": {
                        n: {k: v for k, v in r.items() if k != "intervals"}
                        for n, r in res["devices"].items()
                    },
                }
            )
            say(f"{devices}: run {i + 1}: {wall:.1f} s wall, {res['device_s']:.1f} device s")
        finally:
            d.close()
    return out


RAY_DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


def ray_runs(tmp: Path, reps: int, say) -> list[dict] | None:
    """`device_runs` on a three-node Ray cluster on this machine; None without ray."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        say("three Ray nodes: skipped (the cluster extra is not installed)")
        return None
    store = 75 * 1024 * 1024  # Ray's floor for a node's object store
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store}
    )
    try:
        for name in RAY_DEVICES:
            cluster.add_node(
                num_cpus=1,
                object_store_memory=store,
                resources={f"aoe_device_{name.replace(':', '')}": 1},
            )
        cluster.wait_for_nodes()
        toml = f'[cluster]\nexecutor = "ray"\naddress = "{cluster.address}"\n'
        return device_runs(tmp, RAY_DEVICES, reps, say, toml)
    finally:
        cluster.shutdown()


def device_report(runs: dict[str, list[dict]], host: Machine, mode: str) -> str:
    import statistics

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    rows = []
    for name, rs in runs.items():
        per = sorted({d for r in rs for d in r["devices"]})
        duty = "; ".join(
            f"{d}: {statistics.median(r['devices'].get(d, {}).get('duty_cycle', 0.0) for r in rs):.2f}"
            for d in per
        )
        trials = "; ".join(
            f"{d}: {statistics.median(r['devices'].get(d, {}).get('trials', 0) for r in rs):g}"
            for d in per
        )
        rows.append(
            f"| {name} | {len(rs)} | {spread([r['wall_s'] for r in rs])} | "
            f"{spread([r['device_s'] for r in rs])} | {duty} | {trials} |"
        )
    walls = [statistics.median(r["wall_s"] for r in rs) for rs in runs.values()]
    speedup = walls[0] / walls[1] if walls[1] else float("nan")
    ray = ""
    if len(walls) > 2:
        one_run, ray_runs_ = (runs[k] for k in (list(runs)[0], list(runs)[2]))
        t1, t3 = (statistics.median(r["trials"] for r in rs) for rs in (one_run, ray_runs_))
        ray = (
            f"Three Ray nodes, one device each (the last row): one device's median wall time over theirs, "
            f"{walls[0] / walls[2]:.2f}x. Not a speedup of devices: on the Ray executor the compile "
            "workers are actors that are not paused while a device measures (the local ones, on these 2 "
            "cores, are), so compiling and measuring overlap, noisier for it; and the job measured "
            f"{t3:g} trials (median) against {t1:g} on one device. The three nodes, their Ray processes "
            "(head, raylets, actors) and the daemon share this machine's cores, and `cpu:2` names a core it "
            "lacks (its actor measures unpinned). What the row shows: one job's trials spread over three "
            "devices reached through Ray, end to end. What it cannot show: the speed of three machines."
        )
    else:
        ray = "Three Ray nodes: not measured (the cluster extra, ray, is not installed)."
    return "\n".join(
        [
            "## One job on one device vs two vs three Ray nodes (`python bench/bench_fleet.py --only devices`)",
            "",
            f"Machine: {host.describe('onnxruntime', 'trio')}.",
            "",
            f"Run: {mode}, {time.strftime('%Y-%m-%d')}. One `aoed` per run, `[tuning] devices` as named, the "
            f"`{DEV_MODEL}` sample model with `budget_s = {DEV_BUDGET_S:g}`, a fresh bank each run. Wall: the "
            "job's start to its end in the daemon; device s: every request's time on a device; duty: a "
            "device's seconds over the job's wall time; figures are the median (min-max) of the runs.",
            "",
            "| devices | runs | wall s | device s | duty per device | trials per device |",
            "|---|--:|--:|--:|---|---|",
            *rows,
            "",
            f"Speedup, one device over two (median wall time): {speedup:.2f}x. Target: >= {TARGET_SPEEDUP}x "
            "with two devices where the machine has the cores to give each its own, besides the compile "
            f"workers. This machine has {host.usable} usable cores: the two one-core devices take both, so the "
            "compile workers share them and are paused while either measures, and the daemon, the job's "
            "own stages and everything else running here compete for the same two cores. What these figures "
            "can show: that one job's trials spread over both devices (trials per device), and how much of "
            "the job's device time a second device can take at all: only the task searches spread, while "
            "profile, session options, verification and the confirming A/B stay on the job's home device "
            "(the duty split says how much that is for this model). What they cannot show: the wall-time "
            "speedup of devices with cores (or accelerators) of their own.",
            "",
            ray,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 s of writing instead of 60 s")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    ap.add_argument("--only", choices=["lag", "devices"], help="run one of the two sections")
    args = ap.parse_args(argv)
    host = Machine()  # before the work: the load average says what else was running
    t0 = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {text}", file=sys.stderr, flush=True)

    from bench_bank import publish

    mode = "quick" if args.quick else "full"
    failed = False
    if args.only != "devices":
        with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
            run = measure(Path(tmp), 10.0 if args.quick else 60.0, say)
        host.finish()
        text = report(run, host, mode, time.monotonic() - t0)
        publish(text, args.out, BEGIN, END, write=not args.no_write)
        failed = "FAIL" in text
    if args.only != "lag":
        host = Machine()
        reps = 2 if args.quick else 5
        with tempfile.TemporaryDirectory(prefix="bench-devices-") as tmp:
            runs = {
                "cpu:0": device_runs(Path(tmp), ["cpu:0"], reps, say),
                "cpu:0 + cpu:1": device_runs(Path(tmp), ["cpu:0", "cpu:1"], reps, say),
            }
            if (on_ray := ray_runs(Path(tmp), reps, say)) is not None:
                runs["3 Ray nodes: cpu:0 + cpu:1 + cpu:2"] = on_ray
        host.finish()
        publish(
            device_report(runs, host, mode), args.out, DEV_BEGIN, DEV_END, write=not args.no_write
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    # tests/daemon_util.py: a real daemon on a temporary socket
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())

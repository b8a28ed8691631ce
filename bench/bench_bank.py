"""Bank lookup speed, side by side in one run, written into bench/RESULTS.md.

    python bench/bench_bank.py [--quick] [--no-write] [--out bench/RESULTS.md]

Rows (per-call medians over batches of calls, keys cycling over the whole bank so that
each call decodes a different entry; every median with a distribution-free 95% interval):
  raw lmdb get                 one read transaction + get on the same environment
  aoe.bank lookup by key       the same + the layer walk + BankEntry decoding; timed in the
                               same rounds as the raw get, on the same keys, in an order
                               that alternates, so both see the same cache state; the
                               ratio is the median of the per-round ratios
  node, model indexed once     lookup_node(node, ModelTasks(model)): the task's
                               signature comes from the model's index
  node, signature per call     task_signature(the task's nodes) + key + lookup
  aggregate                    4 reader processes looking up continuously while a
                               writer process commits batches of new entries

Targets: by key within 3x of raw get; from a node, with the model indexed once and with
the signature computed per call (`aoe.signature.task_signature`), <= 30 us median; over
100k lookups/s aggregate.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from machine import Machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- bank:begin -->", "<!-- bank:end -->"
HEADER = "# Benchmark results\n\nThis file is written by `make bench`; each benchmark owns one section.\n"
SIGNATURE_MAX_US = 30.0
NODE_MAX_US = 30.0
BY_KEY_MAX_RATIO = 3.0
AGGREGATE_MIN = 100_000


# --------------------------------------------------------------------------- setup


def _template(model):
    """A realistic entry: a real task signature and this machine's fingerprint."""
    from aoe.bankrecord import BankRecord, Measured, encode
    from aoe.fingerprint import device_fingerprint
    from aoe.keys import bank_key
    from aoe.partition import partition
    from aoe.signature import ModelContext

    tasks = partition(model, ModelContext(model))
    dev = device_fingerprint("CPUExecutionProvider")
    sig = max((t.signature for t in tasks), key=lambda s: len(s.canonical_json))
    rec = BankRecord(
        key=bank_key(sig.digest, dev.digest, "exact"),
        signature=sig,
        device=dev,
        strategy="fused_conv",
        family="conv",
        precision="exact",
        winner=Measured(80.0, 0.02, 40, 78.0),
        baseline=Measured(100.0, 0.02, 40, 97.0),
        host=platform.node(),
        aoed_version="bench",
        created_unix=time.time(),
        job_id="bench",
        model="bench",
    )
    return tasks, dev, rec, encode


def _synthetic_key(i: int, dev_digest: str) -> bytes:
    from aoe.keys import bank_key

    return bank_key(f"{i:032x}" + "0" * 32, dev_digest, "exact")


def build_bank(path: Path, n: int, model) -> tuple[list[bytes], list]:
    """A bank of n synthetic entries plus one per task of `model`; returns its keys."""
    import dataclasses

    from aoed.bank.store import BankStore

    tasks, dev, rec, encode = _template(model)
    items, keys = [], []
    for i in range(n):
        key = _synthetic_key(i, dev.digest)
        items.append((key, encode(dataclasses.replace(rec, key=key))))
        keys.append(key)
    from aoe.keys import bank_key

    for t in tasks:
        key = bank_key(t.signature.digest, dev.digest, "exact")
        items.append((key, encode(dataclasses.replace(rec, key=key, signature=t.signature))))
    store = BankStore(path)
    try:
        store.commit(entries=items)
    finally:
        store.close()
    return keys, tasks


# --------------------------------------------------------------------------- timing


def per_call_us(fn, args: list, batches: int, batch: int) -> list[float]:
    """Mean per-call time of each of `batches` batches of `batch` calls, microseconds."""
    n = len(args)
    out = []
    j = 0
    for _ in range(batches):
        chunk = [args[(j + k) % n] for k in range(batch)]
        j += batch
        t0 = time.perf_counter()
        for a in chunk:
            fn(a)
        out.append((time.perf_counter() - t0) / batch * 1e6)
    return out


def interleaved_per_call(
    fns: dict[str, Callable[[object], object]], args: list, rounds: int, batch: int
) -> dict[str, list[float]]:
    """Mean per-call microseconds of every fn in each round. A round gives every fn the
    same `batch` args (the next chunk of `args`), in an order that rotates from round to
    round, so each fn goes first equally often and they see the same cache state."""
    names = list(fns)
    n = len(args)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        chunk = [args[(r * batch + k) % n] for k in range(batch)]
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = fns[name]
            t0 = time.perf_counter()
            for a in chunk:
                fn(a)
            out[name].append((time.perf_counter() - t0) / batch * 1e6)
    return out


def summary(values: Sequence[float], unit: str = " us") -> str:
    """'median [lo, hi]' with the distribution-free 95% interval of the median."""
    from aoed.engine.stats import median, median_ci

    lo, hi = median_ci(values)
    return f"{median(values):.2f}{unit} [{lo:.2f}, {hi:.2f}]"


def _reader_proc(path: str, keys: list[bytes], ready, start, stop, results) -> None:
    from aoe.bank import open_bank

    bank = open_bank(path, use_env=False)
    lookup = bank.lookup
    rng = random.Random(os.getpid())
    order = keys[:]
    rng.shuffle(order)
    n, misses = 0, 0
    for k in order[:100]:
        lookup(k)  # warm
    ready.put(os.getpid())
    start.wait()
    while not stop.is_set():
        for k in order[:2000]:
            if lookup(k)[0] is None:
                misses += 1
        n += 2000
        order = order[2000:] + order[:2000]
    results.put((n, misses))


def _writer_proc(path: str, ready, start, stop, results) -> None:
    import dataclasses

    from aoe.bankrecord import decode, encode
    from aoed.bank.store import BankStore

    store = BankStore(path)
    first = next(store.items())[1]
    rec = decode(first)
    commits, i = 0, 10_000_000
    ready.put(os.getpid())
    start.wait()
    while not stop.is_set():
        items = []
        for _ in range(100):
            key = _synthetic_key(i, rec.device.digest)
            items.append((key, encode(dataclasses.replace(rec, key=key))))
            i += 1
        store.commit(entries=items)
        commits += 1
    store.close()
    results.put(("writer", commits))


def aggregate(
    path: Path, keys: list[bytes], readers: int, seconds: float
) -> tuple[float, int, int]:
    """Lookups/s summed over `readers` processes while a writer commits; (rate, commits, misses)."""
    ctx = mp.get_context("spawn")
    ready, start, stop, results = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Queue()
    common = (ready, start, stop, results)
    procs = [
        ctx.Process(target=_reader_proc, args=(str(path), keys, *common)) for _ in range(readers)
    ]
    procs.append(ctx.Process(target=_writer_proc, args=(str(path), *common)))
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)  # every process has imported, opened the bank and warmed up
    start.set()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    got = [results.get(timeout=60) for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(timeout=30)
    lookups = sum(n for n, _ in got if n != "writer")
    misses = sum(m for n, m in got if n != "writer")
    commits = next(m for n, m in got if n == "writer")
    return lookups / elapsed, commits, misses


# --------------------------------------------------------------------------- report


def write_section(text: str, out: Path = RESULTS, begin: str = BEGIN, end: str = END) -> None:
    """Put `text` between the `begin` and `end` markers of the results file (appended
    when they are not there yet), leaving every other section as it is."""
    doc = out.read_text() if out.exists() else HEADER
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        _, tail = rest.split(end, 1)
        doc = head + block + tail
    else:
        doc = doc.rstrip() + "\n\n" + block + "\n"
    out.write_text(doc)


def publish(text: str, out: Path, begin: str, end: str, write: bool = True) -> None:
    """Print a benchmark's section and, unless told not to, put it in the results file."""
    print(text)
    if write:
        write_section(text, out, begin, end)
        print(f"wrote {out}", file=sys.stderr)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller bank, shorter runs")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    args = ap.parse_args(argv)

    from aoe.bank import ModelTasks, open_bank
    from aoe.signature import task_signature
    from aoed import samples
    from aoed.engine.prep import prepare
    from aoed.engine.stats import median, median_ci, paired_ratios

    host = Machine()  # before the work: the load average says what else was running
    n_entries = 5_000 if args.quick else 50_000
    rounds, batch = (30, 1000) if args.quick else (100, 2000)
    agg_s = 2.0 if args.quick else 5.0

    with tempfile.TemporaryDirectory(prefix="bench-bank-") as tmp:
        tmp = Path(tmp)
        samples.save(samples.build("transformer"), tmp / "model.onnx")
        prep = prepare(tmp / "model.onnx", tmp / "prep")
        keys, _ = build_bank(tmp / "bank", n_entries, prep.model)
        random.Random(0).shuffle(keys)

        bank = open_bank(tmp / "bank", use_env=False)
        layer = bank._layers[0]  # the very environment the reader uses
        env, db = layer.env, layer.entries

        def raw_get(key: bytes) -> bytes | None:
            with env.begin(db=db) as txn:
                return txn.get(key)

        by_round = interleaved_per_call(
            {"raw": raw_get, "by_key": bank.lookup}, keys, rounds, batch
        )
        raw, by_key = by_round["raw"], by_round["by_key"]
        ratios = paired_ratios(by_key, raw)
        ratio, (ratio_lo, ratio_hi) = median(ratios), median_ci(ratios)

        t0 = time.perf_counter()
        index = ModelTasks(prep.model)
        index_ms = (time.perf_counter() - t0) * 1e3
        by_name = {n.name: n for n in prep.model.graph.node}
        anchors = [by_name[tt.node_names[0]] for t in index.tasks for tt in (t, *t.twins)]
        assert all(bank.lookup_node(a, index)[0] is not None for a in anchors)
        node_warm = per_call_us(lambda a: bank.lookup_node(a, index), anchors, rounds, batch // 4)
        chains = [[by_name[n] for n in tt.node_names] for t in index.tasks for tt in (t, *t.twins)]
        ctx = index.ctx

        def node_cold(chain) -> object:
            return bank.lookup_signature(task_signature(chain, ctx))

        node_sig = per_call_us(node_cold, chains, max(10, rounds // 5), max(50, batch // 20))
        entry_bytes = len(bank.lookup_raw(keys[0])[0])
        bank.close()

        rate, commits, misses = aggregate(tmp / "bank", keys, 4, agg_s)
    host.finish()

    rows = [
        ("raw lmdb get (txn + get)", summary(raw), ""),
        (
            "aoe.bank lookup by key (+ decode)",
            summary(by_key),
            (
                f"{ratio:.2f}x raw [{ratio_lo:.2f}, {ratio_hi:.2f}] over {len(ratios)} paired rounds; "
                f"target <= {BY_KEY_MAX_RATIO:g}x: {_verdict(ratio <= BY_KEY_MAX_RATIO)}"
            ),
        ),
        (
            "from a node, model indexed once",
            summary(node_warm),
            (
                f"target <= {NODE_MAX_US:g} us: {_verdict(median(node_warm) <= NODE_MAX_US)}; index "
                f"build {index_ms:.1f} ms for {len(index)} tasks"
            ),
        ),
        (
            "from a node, signature computed per call",
            summary(node_sig),
            f"target <= {SIGNATURE_MAX_US:g} us: {_verdict(median(node_sig) <= SIGNATURE_MAX_US)}",
        ),
        (
            "4 reader processes during writes",
            f"{rate / 1e3:.0f}k lookups/s",
            (
                f"target > {AGGREGATE_MIN // 1000}k/s: {_verdict(rate > AGGREGATE_MIN)}; writer "
                f"committed {commits * 100} entries meanwhile; {misses} misses"
            ),
        ),
    ]
    mode = "quick" if args.quick else "full"
    lines = [
        "## Bank lookups (`python bench/bench_bank.py`)",
        "",
        f"Machine: {host.describe('onnxruntime', 'numpy', 'lmdb', 'protobuf')}.",
        "",
        (
            f"Run: {mode}, {n_entries} entries of {entry_bytes} bytes (a real task signature and "
            f"this machine's fingerprint); {time.strftime('%Y-%m-%d')}. The raw get and the lookup "
            f"by key are timed in the same {rounds} rounds of {batch} keys each, in alternating "
            "order, so both see the same cache state. Each median comes with a distribution-free "
            "95% interval over its rounds (batches) of calls."
        ),
        "",
        "| measurement | median per call [95% interval] | notes |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        (
            "The node rows use `ModelTasks(model)`, which forms the model's tasks with the tuner's "
            "own partition code once per model; the per-call row recomputes the task signature "
            "(`aoe.signature.task_signature`) on every call."
        ),
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(text, args.out)
        print(f"\nwritten to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

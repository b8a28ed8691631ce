"""Many reader processes and one writer process on one bank, including a writer killed
with SIGKILL in the middle of its commits, and another process growing the bank past
this one's map."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aoe.bank import open_bank
from aoe.errors import BankBusyError
from aoe.v1 import bank_pb2
from aoed.bank.store import BankStore
from tests.helpers import wait_for

# Entry i of the synthetic bank these tests write (key(i), entry(i)); its winner median
# is 1 + i, so a reader can tell that an entry decodes to itself.
ENTRIES = r"""
from aoe.keys import bank_key
from aoe.fingerprint import device_fingerprint
from aoe.v1 import bank_pb2

dev = device_fingerprint("CPUExecutionProvider")
proto = bank_pb2.BankEntry(schema_version=1)
proto.signature.op_type = "MatMul"
proto.signature.canonical_json = '{"nodes":[{"op":"MatMul"}]}' * 8
proto.device.digest = dev.digest
proto.device.canonical_json = dev.canonical_json
proto.strategy.name = "fused_gemm"
proto.strategy.family = "matmul"

def key(i):
    return bank_key(f"{i:032x}{0:032x}", dev.digest, "exact")

def entry(i):
    proto.key = key(i).decode()
    proto.signature.digest = f"{i:032x}{0:032x}"
    proto.winner.median_us = 1.0 + i
    return proto.SerializeToString()
"""

# The writer commits BATCH entries plus one history trial per transaction; after each
# commit it prints the number of entries committed so far.
WRITER = (
    ENTRIES
    + r"""
import sys
from aoed.bank.store import BankStore

path, total, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = BankStore(path)
done = 0
while total == 0 or done < total:
    items = [(key(i), entry(i)) for i in range(done, done + batch)]
    store.commit(entries=items, trials=[(key(done), {"batch": done})])
    done += batch
    print(done, flush=True)
store.close()
"""
)

# A reader looks up continuously until STOP exists, then looks at the bank's size once
# more: after it has seen n entries in one snapshot, every key below n must be found (and
# decode to itself) in any later one.
READER = r"""
import json, os, random, sys, time
from aoe.bank import open_bank
from aoe.keys import bank_key
from aoe.fingerprint import device_fingerprint

path, stop = sys.argv[1], sys.argv[2]
dev = device_fingerprint("CPUExecutionProvider")
keys = {}
def key(i):
    k = keys.get(i)
    if k is None:
        k = keys[i] = bank_key(f"{i:032x}{0:032x}", dev.digest, "exact")
    return k

bank = open_bank(path, use_env=False)
print("ready", flush=True)
seen, lookups, errors, growth = 0, 0, [], set()
rng = random.Random(os.getpid())
while not os.path.exists(stop):
    n = bank.stats()[0].entries
    if n < seen:
        errors.append(f"entries went back from {seen} to {n}")
    seen = max(seen, n)
    growth.add(n)
    if seen == 0:
        continue
    for _ in range(200):
        i = rng.randrange(seen)
        entry, layer = bank.lookup(key(i))
        lookups += 1
        if entry is None:
            errors.append(f"key {i} missing after {seen} entries were seen")
        elif entry.key != key(i).decode() or entry.winner.median_us != 1.0 + i:
            errors.append(f"key {i} decoded to another entry")
    if len(errors) > 5:
        break
n = bank.stats()[0].entries  # STOP comes after the writer's last commit: a look at the final snapshot
if n < seen:
    errors.append(f"entries went back from {seen} to {n}")
seen = max(seen, n)
print(json.dumps({"lookups": lookups, "seen": seen, "snapshots": len(growth), "errors": errors[:5]}))
"""


def _spawn(code: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _expected_key(i: int) -> bytes:
    from aoe.fingerprint import device_fingerprint
    from aoe.keys import bank_key

    return bank_key(f"{i:032x}{0:032x}", device_fingerprint("CPUExecutionProvider").digest, "exact")


def test_readers_see_consistent_snapshots_while_a_writer_commits(tmp_path: Path) -> None:
    path, stop = tmp_path / "bank", tmp_path / "stop"
    total, batch = 4000, 40
    # The bank exists before readers start: they open it, the writer keeps committing.
    BankStore(path).close()
    readers = [_spawn(READER, path, stop) for _ in range(3)]
    for r in readers:
        assert r.stdout is not None and r.stdout.readline() == "ready\n"
    writer = _spawn(WRITER, path, total, batch)
    try:
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
        assert out.split()[-1] == str(total)
    finally:
        stop.touch()
        results = []
        for r in readers:
            out, err = r.communicate(timeout=30)
            assert r.returncode == 0, err
            results.append(json.loads(out))
    for res in results:
        assert res["errors"] == [], res
        assert res["lookups"] > 0
        assert res["snapshots"] > 2  # it read while the writer committed
        assert res["seen"] == total
    with open_bank(path, use_env=False) as bank:
        [st] = bank.stats()
        assert (st.entries, st.history) == (total, total // batch)
        for i in range(0, total, 97):
            entry, _ = bank.lookup(_expected_key(i))
            assert entry.winner.median_us == 1.0 + i


def test_sigkill_mid_write_leaves_every_committed_entry(tmp_path: Path) -> None:
    path, batch = tmp_path / "bank", 25
    writer = _spawn(WRITER, path, 0, batch)  # 0: commit until killed
    committed = 0
    try:
        assert writer.stdout is not None
        for line in writer.stdout:
            committed = int(line)
            if committed >= 2500:
                break
        with pytest.raises(BankBusyError, match=f"being written by pid {writer.pid} "):
            BankStore(path)  # one writer at a time
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
        # From the same reader as the loop above: communicate() would read the pipe itself
        # and miss the lines that loop had already read ahead into its buffer.
        rest = writer.stdout.read()
        for line in rest.split():
            committed = int(line)  # printed before the kill: committed too
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        for pipe in (writer.stdout, writer.stderr):
            if pipe is not None:
                pipe.close()
    assert writer.returncode == -signal.SIGKILL
    assert committed >= 2500
    # The bank opens for writing (the kernel dropped the killed writer's lock; recovery
    # is LMDB's: nothing to repair) and reading.
    store = BankStore(path)
    counts = store.counts()
    store.close()
    # Whole transactions only: each commit wrote `batch` entries and one trial together.
    assert counts["entries"] % batch == 0
    assert counts["history"] == counts["entries"] // batch
    assert committed <= counts["entries"] <= committed + batch
    with open_bank(path, use_env=False) as bank:
        for i in range(counts["entries"]):
            raw, layer = bank.lookup_raw(_expected_key(i))
            assert raw is not None, i
            entry = bank_pb2.BankEntry.FromString(raw)
            assert entry.key == _expected_key(i).decode() and entry.winner.median_us == 1.0 + i
        assert bank.lookup(_expected_key(counts["entries"])) == (None, "")


# What an older aoed's writer does: plain LMDB, no writer lock, a map of its own size.
# It puts the entries listed in a file ("hex key" SPACE "hex value" per line).
OLD_WRITER = r"""
import sys, lmdb
path, items, map_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
env = lmdb.open(path, map_size=map_size, max_dbs=8)
entries = env.open_db(b"entries")
with env.begin(write=True, db=entries) as txn, open(items) as f:
    for line in f:
        k, v = line.split()
        txn.put(bytes.fromhex(k), bytes.fromhex(v))
print(env.info()["last_pgno"] + 1, flush=True)
env.close()
"""

# A reader where the address space is limited (ulimit -v): it cannot reserve the full
# map, so it maps what the file holds, and a writer growing the bank makes LMDB refuse
# its next read until it remaps. For each number n read from stdin it looks up keys
# below n and prints how many it missed and how much of the bank file it has mapped.
SMALL_READER = (
    ENTRIES
    + r"""
import json, os, re, resource, sys
from aoe.bank import open_bank

path = sys.argv[1]
vm = int(re.search(r"VmSize:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
bank = open_bank(path, use_env=False)

def mapped():
    data = os.path.realpath(os.path.join(path, "data.mdb"))
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(data):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            return hi - lo
    return 0

for line in sys.stdin:
    n = int(line)
    bad = [i for i in range(n) if (bank.lookup(key(i))[0] or bank_pb2.BankEntry()).winner.median_us != 1.0 + i]
    print(json.dumps({"mapped": mapped(), "bad": len(bad), "first_bad": bad[:3]}), flush=True)
"""
)


def test_another_process_growing_the_bank_past_our_map_is_followed(tmp_path: Path) -> None:
    """LMDB refuses the next transaction of a process whose map the bank outgrew
    (MapResizedError); the store and a reader adopt the new size between transactions,
    with lookups running in other threads all along, and nothing is lost."""
    import threading

    path, small, big = tmp_path / "bank", 256 << 10, 16 << 20
    ns: dict = {}
    exec(ENTRIES, ns)  # the same key(i) / entry(i) as the child processes
    key, entry = ns["key"], ns["entry"]
    stop, errors, lookups = threading.Event(), [], [0]
    store = BankStore(path, map_size=small)

    def look_up() -> None:
        i = 0
        while not stop.is_set():
            try:
                raw = store.get(key(i % 100))
                if (
                    raw is None
                    or bank_pb2.BankEntry.FromString(raw).winner.median_us != 1.0 + i % 100
                ):
                    errors.append(f"key {i % 100} wrong")
            except Exception as exc:  # any failure here is what the test looks for
                errors.append(repr(exc))
                return
            lookups[0] += 1
            i += 7
            time.sleep(0.0005)  # leave the other processes some CPU on a small machine

    threads = [threading.Thread(target=look_up) for _ in range(2)]
    reader = subprocess.Popen(
        [sys.executable, "-c", SMALL_READER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def ask(n: int) -> dict:
        assert reader.stdin is not None and reader.stdout is not None
        reader.stdin.write(f"{n}\n")
        reader.stdin.flush()
        line = reader.stdout.readline()
        assert line, reader.stderr.read() if reader.stderr else ""
        return json.loads(line)

    try:
        store.commit(entries=[(key(i), entry(i)) for i in range(100)])
        first = ask(100)
        assert first["bad"] == 0 and 0 < first["mapped"] <= small  # it could not map more
        for t in threads:
            t.start()
        # The older writer grows the bank to several times this process's map.
        items = tmp_path / "items.txt"
        items.write_text("".join(f"{key(i).hex()} {entry(i).hex()}\n" for i in range(100, 3000)))
        out = subprocess.run(
            [sys.executable, "-c", OLD_WRITER, str(path), str(items), str(big)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) * 4096 > 4 * small
        before = lookups[0]
        wait_for(  # lookups went on past the growth
            lambda: lookups[0] >= before + 50 or errors, 60, "50 more lookups", poll=0.01
        )
        assert store.get(key(2999)) == entry(2999)
        store.commit(entries=[(key(i), entry(i)) for i in range(3000, 3100)])
        assert store.counts()["entries"] == 3100
        assert store.env.info()["map_size"] >= big  # adopted the size the bank records
        second = ask(3100)
        assert second["bad"] == 0, second
        assert second["mapped"] > 4 * small
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join(timeout=10)
        store.close()
        reader.kill()
        reader.communicate(timeout=10)
    assert errors == []
    with open_bank(path, use_env=False) as bank:
        assert bank.stats()[0].entries == 3100
        for i in range(0, 3100, 31):
            assert bank.lookup(key(i))[0].winner.median_us == 1.0 + i

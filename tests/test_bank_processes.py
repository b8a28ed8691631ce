"""Many reader processes and one writer process on one bank, including a writer killed
with SIGKILL in the middle of its commits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from aoe.bank import open_bank
from aoe.v1 import bank_pb2
from aoed.bank.store import BankStore

# The writer commits BATCH entries plus one history trial per transaction, starting from
# a 64 KiB map so that the map grows many times while readers are reading; after each
# commit it prints the number of entries committed so far.
WRITER = r"""
import sys
from aoe.signature import bank_key, device_fingerprint
from aoed.bank.store import BankStore
from aoe.v1 import bank_pb2

path, total, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
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

store = BankStore(path, map_size=64 << 10)
done = 0
while total == 0 or done < total:
    items = []
    for i in range(done, done + batch):
        proto.key = key(i).decode()
        proto.signature.digest = f"{i:032x}{0:032x}"
        proto.winner.median_us = 1.0 + i
        items.append((key(i), proto.SerializeToString()))
    store.commit(entries=items, trials=[(key(done), {"batch": done})])
    done += batch
    print(done, flush=True)
store.close()
"""

# A reader looks up continuously until STOP exists: after it has seen n entries in one
# snapshot, every key below n must be found (and decode to itself) in any later one.
READER = r"""
import json, os, random, sys, time
from aoe.bank import open_bank
from aoe.signature import bank_key, device_fingerprint

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
print(json.dumps({"lookups": lookups, "seen": seen, "snapshots": len(growth), "errors": errors[:5]}))
"""


def _spawn(code: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _expected_key(i: int) -> bytes:
    from aoe.signature import bank_key, device_fingerprint

    return bank_key(f"{i:032x}{0:032x}", device_fingerprint("CPUExecutionProvider").digest, "exact")


def test_readers_see_consistent_snapshots_while_a_writer_commits(tmp_path: Path) -> None:
    path, stop = tmp_path / "bank", tmp_path / "stop"
    total, batch = 4000, 40
    # The bank exists before readers start: they open it, the writer keeps committing.
    BankStore(path, map_size=64 << 10).close()
    readers = [_spawn(READER, path, stop) for _ in range(3)]
    for r in readers:
        assert r.stdout is not None and r.stdout.readline() == "ready\n"
    writer = _spawn(WRITER, path, total, batch)
    try:
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
        assert out.split()[-1] == str(total)
        time.sleep(0.3)  # let every reader look at the final snapshot too
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
        assert res["snapshots"] > 2  # it read while the bank grew
        assert res["seen"] == total
    with open_bank(path, use_env=False) as bank:
        [st] = bank.stats()
        assert (st.entries, st.history) == (total, total // batch)
        assert st.map_size > 64 << 10  # the map grew under the readers
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
        os.kill(writer.pid, signal.SIGKILL)
        rest, _ = writer.communicate(timeout=30)
        for line in rest.split():
            committed = int(line)  # printed before the kill: committed too
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert writer.returncode == -signal.SIGKILL
    assert committed >= 2500
    # The bank opens for writing (recovery is LMDB's: nothing to repair) and reading.
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

"""Tests for the writable LMDB bank (aoed.bank.store) and its entry codec (aoed.bank._codec)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import lmdb
import pytest

from aoe.bankrecord import BankRecord, decode, encode
from aoe.errors import BankError
from aoe.signature import (
    SCHEMA_VERSION,
)
from aoe.v1 import bank_pb2
from aoed.bank.store import ENTRY, BankStore, Record, default_bank_path
from tests.bank_util import make_record
from tests.helpers import wait_for

# --------------------------------------------------------------------------- codec


@pytest.mark.parametrize("precision", ["exact", "int8", "fp16"])
def test_codec_round_trip_keeps_every_field(precision: str) -> None:
    record = make_record(precision)
    data = encode(record)
    back = decode(data)
    for f in dataclasses.fields(BankRecord):
        assert getattr(back, f.name) == getattr(record, f.name), f.name
    assert back == record
    assert encode(back) == data  # deterministic serialization
    msg = bank_pb2.BankEntry.FromString(data)
    assert msg.schema_version == SCHEMA_VERSION
    assert msg.key == record.key.decode()
    assert msg.provenance.onnxruntime_version == record.device.runtime_version


def test_codec_distinguishes_records() -> None:
    a, b = make_record(), make_record(strategy="fused_gemm")
    assert encode(a) != encode(b)
    assert decode(encode(b)).strategy == "fused_gemm"


# --------------------------------------------------------------------------- store


@pytest.fixture
def store(tmp_path: Path):
    s = BankStore(tmp_path / "bank")
    yield s
    s.close()


def test_entries_round_trip(store: BankStore) -> None:
    record = make_record()
    other = make_record(precision="int8")
    store.commit(entries=[(record.key, encode(record)), (other.key, encode(other))])
    assert decode(store.get(record.key)) == record
    assert decode(store.get(other.key)) == other
    assert store.get(b"v1/none/none/exact") is None
    assert store.counts() == {"entries": 2, "defaults": 0, "history": 0}
    # A second commit for a key replaces the entry.
    better = make_record(strategy="fused_gemm")
    store.commit(entries=[(record.key, encode(better))])
    assert decode(store.get(record.key)).strategy == "fused_gemm"
    assert store.counts()["entries"] == 2


def test_entries_survive_reopening(tmp_path: Path) -> None:
    record = make_record()
    s = BankStore(tmp_path / "bank")
    s.commit(entries=[(record.key, encode(record))])
    s.close()
    s = BankStore(tmp_path / "bank")
    try:
        assert decode(s.get(record.key)) == record
    finally:
        s.close()


def test_defaults_round_trip(store: BankStore) -> None:
    key = make_record().key
    doc = {"strategy": "default", "median_us": 10.5, "candidates": 4}
    store.commit(defaults=[(key, doc)])
    assert store.get_default(key) == doc
    assert store.get(key) is None
    assert store.get_default(b"v1/other/other/exact") is None
    assert store.counts()["defaults"] == 1


def test_entry_commit_removes_the_default_record(store: BankStore) -> None:
    record = make_record()
    keep = make_record(precision="int8").key
    store.commit(defaults=[(record.key, {"strategy": "default"}), (keep, {"strategy": "default"})])
    assert store.counts()["defaults"] == 2
    store.commit(entries=[(record.key, encode(record))])
    assert store.get_default(record.key) is None
    assert store.get_default(keep) == {"strategy": "default"}
    assert store.counts() == {"entries": 1, "defaults": 1, "history": 0}


def test_history_trials_are_counted(store: BankStore) -> None:
    key = make_record().key
    store.commit(trials=[(key, {"strategy": s, "median_us": 1.0 + i}) for i, s in enumerate("abc")])
    store.commit(trials=[(key, {"strategy": "d", "median_us": 9.0})])
    assert store.counts() == {"entries": 0, "defaults": 0, "history": 4}
    with store.env.begin(db=store._history) as txn:
        rows = [(k, json.loads(v)) for k, v in txn.cursor()]
    assert all(k.startswith(key + b"/") for k, _ in rows)
    assert sorted(doc["strategy"] for _, doc in rows) == ["a", "b", "c", "d"]


def test_decisions_by_run_are_forgotten_by_run_and_pruned(store: BankStore) -> None:
    key, other = make_record().key, make_record(precision="int8").key
    store.commit(trials=[(key, {"strategy": "a"})], decisions=[(b"run1/" + key, {"strategy": "a"})])
    store.commit(
        decisions=[(b"run1/" + other, {"strategy": "b"}), (b"run2/" + key, {"strategy": "c"})]
    )
    assert store.decisions(b"run1/") == [
        (b"run1/" + key, {"strategy": "a"}),
        (b"run1/" + other, {"strategy": "b"}),
    ]
    store.commit(forget=[b"run1/"])
    assert store.decisions(b"run1/") == [] and store.decisions(b"run2/") == [
        (b"run2/" + key, {"strategy": "c"})
    ]
    store.prune()
    assert store.decisions(b"") == [] and store.counts()["history"] == 0


def test_full_map_is_a_bank_error_that_writes_nothing(tmp_path: Path) -> None:
    """The map is fixed at open: a write that does not fit fails whole, with a message
    that names the bank and says what to do, and the store keeps working."""
    path = tmp_path / "bank"
    s = BankStore(path, map_size=256 << 10)
    try:
        assert s.env.info()["map_size"] == 256 << 10
        items = [
            (f"v1/{i:032x}/{'0' * 32}/exact".encode(), bytes([i % 251]) * 300) for i in range(2000)
        ]
        s.commit(entries=items[:100], trials=[(items[0][0], {"n": 1})])
        with pytest.raises(BankError) as err:
            s.commit(entries=items[100:], trials=[(items[1][0], {"n": 2})])
        msg = str(err.value)
        assert str(path) in msg and "full" in msg and "aoe bank prune" in msg and "\n" not in msg
        assert not isinstance(err.value.__cause__, lmdb.Error) and err.value.__suppress_context__
        assert s.env.info()["map_size"] == 256 << 10  # never grown behind the caller's back
        assert s.counts() == {"entries": 100, "defaults": 0, "history": 1}  # all or nothing
        assert s.get(items[150][0]) is None and s.get(items[50][0]) == items[50][1]
        s.commit(entries=items[100:110])  # what fits still goes in
        assert s.counts()["entries"] == 110
    finally:
        s.close()
    # The default map is the full address space a process may map: no resize ever due.
    s = BankStore(path)
    try:
        assert s.env.info()["map_size"] >= 1 << 30
        s.commit(entries=items[110:])
        assert s.counts()["entries"] == 2000
    finally:
        s.close()


def test_damaged_bank_is_a_bank_error_for_writer_and_readers(tmp_path: Path) -> None:
    from aoe.bank import open_bank

    path = tmp_path / "bank"
    s = BankStore(path)
    s.commit(entries=[(make_record().key, encode(make_record()))])
    s.close()
    (path / "data.mdb").write_bytes(b"\x00not lmdb" * 1000)
    for open_it in (lambda: BankStore(path), lambda: open_bank(path, use_env=False)):
        with pytest.raises(BankError) as err:
            open_it()
        assert (
            str(path) in str(err.value)
            and "damaged" in str(err.value)
            and "restore" in str(err.value)
        )
    # The refused store let go of the writer lock: a second attempt is refused for the
    # same reason, not as busy.
    with pytest.raises(BankError, match="damaged"):
        BankStore(path)


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_data_file_removed_or_replaced_while_open_refuses_every_write(
    tmp_path: Path, how: str
) -> None:
    """LMDB would go on writing into the unlinked file, and lose it all at close."""
    path = tmp_path / "bank"
    first, second = make_record(), make_record(precision="int8")
    s = BankStore(path)
    try:
        s.commit(entries=[(first.key, encode(first))])
        if how == "removed":
            shutil.rmtree(path)
        else:  # a backup restored over it: a copy renamed into place
            shutil.copy(path / "data.mdb", tmp_path / "backup.mdb")
            os.replace(tmp_path / "backup.mdb", path / "data.mdb")
        writes = {
            "commit": lambda: s.commit(entries=[(second.key, encode(second))]),
            "merge": lambda: s.merge(
                [Record(ENTRY, second.key, encode(second))], lambda old, new: True
            ),
            "prune": lambda: s.prune(),
        }
        for name, write in writes.items():
            with pytest.raises(BankError) as err:
                write()
            msg = str(err.value)
            assert (
                str(path) in msg and "removed or replaced while open" in msg and "restart" in msg
            ), (name, msg)
    finally:
        s.close()
    if how == "replaced":  # the file now there is the backup, untouched by the refused writes
        s = BankStore(path)
        try:
            assert decode(s.get(first.key)) == first and s.get(second.key) is None
        finally:
            s.close()


def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bank"
    path.mkdir()
    env = lmdb.open(str(path), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:
        txn.put(b"schema_version", str(SCHEMA_VERSION + 1).encode())
    env.close()
    with pytest.raises(BankError) as err:
        BankStore(path)
    msg = str(err.value)
    assert str(path) in msg
    assert f"schema version {SCHEMA_VERSION + 1}" in msg
    assert "upgrade aoed" in msg


def test_new_bank_records_its_schema_version(store: BankStore) -> None:
    with store.env.begin(db=store._meta) as txn:
        assert txn.get(b"schema_version") == str(SCHEMA_VERSION).encode()


def test_path_that_is_a_file_is_a_bank_error(tmp_path: Path) -> None:
    path = tmp_path / "not_a_dir"
    path.write_text("hello")
    with pytest.raises(BankError, match="not_a_dir"):
        BankStore(path)
    assert path.read_text() == "hello"


def test_bank_path_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNE_BANK_PATH", str(tmp_path / "custom"))
    assert default_bank_path() == tmp_path / "custom"
    monkeypatch.delenv("TUNE_BANK_PATH")
    fallback = default_bank_path()
    assert fallback != tmp_path / "custom"
    assert fallback.name == "bank"
    assert fallback.parent.name == "aoed"


def test_remap_waits_until_no_transaction_is_live(tmp_path: Path) -> None:
    """The gate's invariant: `set_mapsize` (a remap) never runs while a transaction of
    this process is live; a thread holding one cannot remap (it would wait for itself)."""
    import threading

    from aoe.lmdbenv import TxnGate

    env = lmdb.open(str(tmp_path / "env"), map_size=1 << 20)
    gate = TxnGate()
    inside, leave, remapped = threading.Event(), threading.Event(), threading.Event()
    live_at_remap: list[bool] = []

    class Env:  # what remap() calls on the environment, noting whether a transaction was live
        def set_mapsize(self, size: int) -> None:
            live_at_remap.append(inside.is_set())
            env.set_mapsize(size)

    def hold() -> None:
        with gate.transaction(env, tmp_path) as txn:
            inside.set()
            leave.wait(30)
            # Nested in the same thread while a remap waits: no deadlock, no remap.
            with gate.transaction(env, tmp_path) as again:
                assert again.get(b"x") is None
            assert gate.remap(env) is False
            assert txn.get(b"x") is None
            inside.clear()  # the last step inside: the transaction ends with the block

    def remap() -> None:
        assert gate.remap(Env()) is True  # type: ignore[arg-type]
        remapped.set()

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(30)
    remapper = threading.Thread(target=remap)
    remapper.start()
    # The remap is due (new transactions would wait for it) while the holder's is live.
    wait_for(lambda: gate._remapping or remapped.is_set(), 30, "the remap due", poll=0.005)
    leave.set()
    holder.join(30)
    assert remapped.wait(30)
    remapper.join(30)
    assert live_at_remap == [False], "the map changed while a transaction was live"
    with gate.transaction(env, tmp_path, write=True) as txn:  # the gate opens again
        txn.put(b"x", b"1")
    env.close()


def test_the_lock_file_is_allocated_before_lmdb_maps_it(tmp_path: Path) -> None:
    """LMDB writes its reader table through a shared map of lock.mdb; on a full disk a
    write into a page the filesystem has not allocated is SIGBUS (tests/test_faults.py
    fills a real disk). So the store creates it with every block allocated, at the size
    LMDB itself gives it, and a reader fills the holes of one left sparse."""
    from aoe.bank import open_bank
    from aoe.lmdbenv import LOCK_BYTES

    plain = lmdb.open(str(tmp_path / "plain"))  # the size LMDB gives it by itself
    plain.close()
    assert (tmp_path / "plain" / "lock.mdb").stat().st_size == LOCK_BYTES

    path = tmp_path / "bank"
    BankStore(path).close()
    st = (path / "lock.mdb").stat()
    assert st.st_size == LOCK_BYTES and st.st_blocks * 512 >= LOCK_BYTES

    with open(path / "lock.mdb", "wb") as f:  # all of it a hole now
        f.truncate(LOCK_BYTES)
    assert (path / "lock.mdb").stat().st_blocks * 512 < LOCK_BYTES
    with open_bank(path, use_env=False) as reader:
        assert reader.stats()
    st = (path / "lock.mdb").stat()
    assert st.st_size == LOCK_BYTES and st.st_blocks * 512 >= LOCK_BYTES

"""One bank across servers, with real daemon processes on unix sockets: three daemons
following each other, a follower killed mid-stream and restarted, conflicting decisions
converging, and `aoe bank sync`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from aoe.bank import open_bank
from aoe.bankrecord import encode
from aoe.signature import bank_key
from aoe.v1 import bank_pb2
from aoed.bank.store import BankStore

from .bank_util import foreign, here, make_entry
from .conftest import run_aoe
from .daemon_util import DaemonProcess, follow, log_state
from .helpers import wait_for

pytestmark = pytest.mark.slow


def _entry_pb(rec) -> bank_pb2.BankEntry:
    return bank_pb2.BankEntry.FromString(encode(rec))


def _import(
    d: DaemonProcess, *entries, policy=bank_pb2.MERGE_POLICY_OVERWRITE
) -> bank_pb2.ImportEntriesResponse:
    requests = [bank_pb2.ImportEntriesRequest(options=bank_pb2.ImportOptions(policy=policy))]
    requests += [bank_pb2.ImportEntriesRequest(entry=_entry_pb(e)) for e in entries]
    return d.bank_stub().ImportEntries(iter(requests), timeout=30)


def _lookup(d: DaemonProcess, key: bytes) -> bank_pb2.LookupEntryResponse:
    return d.bank_stub().LookupEntry(bank_pb2.LookupEntryRequest(key=key.decode()), timeout=10)


def _records(d: DaemonProcess) -> dict[tuple[str, str], str]:
    """Every record of the daemon's bank as (kind, key) -> its exchange JSON."""
    out = {}
    for msg in d.bank_stub().ExportEntries(bank_pb2.ExportEntriesRequest(), timeout=60):
        which = msg.WhichOneof("record")
        rec = getattr(msg, which)
        key = f"{rec.key}/{rec.time_ns:016x}" if which == "trial" else rec.key
        assert (which, key) not in out, f"{which} {key} exported twice"
        out[(which, key)] = str(rec)
    return out


def _quiet(daemons: list[DaemonProcess]) -> bool:
    """Every daemon has applied every write of every other one."""
    states = {f"unix://{d.socket}": log_state(d) for d in daemons}
    return all(
        peers.get(t) == states[t][0]
        for _, peers in states.values()
        for t in states
        if peers.get(t) is not None
    ) and all(len(peers) == len(daemons) - 1 for _, peers in states.values())


def _default_key(n: int) -> bytes:
    import hashlib

    return bank_key(hashlib.sha256(f"model {n}".encode()).hexdigest(), here().digest, "exact")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[DaemonProcess], dict]]:
    """Three daemons, each following the other two, whose banks held conflicting
    decisions for two keys before they started."""
    root = tmp_path_factory.mktemp("fleet")
    daemons = [DaemonProcess(root / name) for name in "abc"]
    k_entry = {  # one task, measured three times: gamma's and alpha's tie at 10 us
        "a": make_entry(1, 10.0, "alpha"),
        "b": make_entry(1, 12.0, "beta"),
        "c": make_entry(1, 10.0, "gamma"),
    }
    k2 = make_entry(2, 7.0, "beta")  # b: an entry at 7 us; c: the default stayed best at 9 us
    mk = _default_key(3)  # a model-level record: a and b reverted different tasks
    fills = {
        "a": {
            "entries": [k_entry["a"]],
            "defaults": [(mk, {"default_us": 50.0, "reverted": ["a" * 64]})],
        },
        "b": {
            "entries": [k_entry["b"], k2],
            "defaults": [(mk, {"default_us": 40.0, "reverted": ["b" * 64]})],
        },
        "c": {"entries": [k_entry["c"]], "defaults": [(k2.key, {"default_us": 9.0})]},
    }
    for name, d in zip("abc", daemons, strict=True):
        store = BankStore(d.bank)
        try:
            f = fills[name]
            store.commit(entries=[(r.key, encode(r)) for r in f["entries"]], defaults=f["defaults"])
        finally:
            store.close()
    for d in daemons:
        follow(d, [p for p in daemons if p is not d])
    try:
        for d in daemons:
            d.start()
        yield daemons, {"k": k_entry, "k2": k2, "mk": mk}
    finally:
        for d in daemons:
            d.close()


def test_a_record_written_by_one_daemon_is_served_by_the_other_two(fleet) -> None:
    daemons, _ = fleet
    a, b, c = daemons
    rec = make_entry(10, 3.0, "alpha")
    assert not _lookup(b, rec.key).found
    assert _import(a, rec).added == 1
    for d in (b, c):
        wait_for(
            lambda d=d: _lookup(d, rec.key).found,
            10,
            f"{d.root.name} serves the record written to a",
        )
        got = _lookup(d, rec.key).entry
        # provenance kept, byte for byte
        assert got.provenance.host == "alpha" and got == _entry_pb(rec)


def test_records_of_other_devices_are_kept_relayed_and_served_to_their_device_only(fleet) -> None:
    """A server with other hardware than a fleet's relays and backs up its bank: a record
    measured on another device is kept by import and by every follower alike, under its
    own key, served to that device and never to this one."""
    daemons, _ = fleet
    a, b, c = daemons
    there = make_entry(30, 4.0, "far", dev=foreign())
    r = _import(a, there, policy=bank_pb2.MERGE_POLICY_KEEP_FASTER)  # no allow_foreign
    assert (r.added, r.refused) == (1, 0), r.refused_entries
    for d in (b, c):
        wait_for(
            lambda d=d: _lookup(d, there.key).found,
            10,
            f"{d.root.name} keeps the record of another device",
        )
        assert _lookup(d, there.key).entry == _entry_pb(there)  # byte for byte
        digest = there.signature.digest
        # A lookup for this machine's device never meets it; one for its device does.
        mine = run_aoe("bank", "lookup", "--signature-digest", digest, "--bank", str(d.bank))
        assert mine.returncode == 1 and "no match" in mine.stdout, mine.stdout
        theirs = run_aoe(
            "bank",
            "lookup",
            "--signature-digest",
            digest,
            "--device-digest",
            foreign().digest,
            "--bank",
            str(d.bank),
            "--json",
        )
        assert (
            theirs.returncode == 0
            and json.loads(theirs.stdout)["entry"]["key"] == there.key.decode()
        )
        assert "refused" not in d.log_path.read_text()


def test_conflicting_decisions_converge_to_one_record_everywhere(fleet) -> None:
    daemons, keys = fleet
    k = keys["k"]
    # 10 us both: the smaller stored bytes, as the rule says
    want = min((k["a"], k["c"]), key=encode)

    def same() -> bool:
        found = [_lookup(d, k["a"].key) for d in daemons]
        return all(f.found and f.entry == _entry_pb(want) for f in found)

    wait_for(same, 20.0, "all three hold the same entry for the task measured three times")
    # An entry (7 us) against a default record (9 us) under one key: the entry everywhere.
    k2 = keys["k2"]
    wait_for(
        lambda: all(_lookup(d, k2.key).found for d in daemons),
        20.0,
        "the 7 us entry replaces the default record",
    )
    # The model-level records (the reverted tasks) converge too, to the faster: b's.
    mk = keys["mk"].decode()

    def reverted() -> list[list[str]]:
        out = []
        for d in daemons:
            recs = [
                m.default_record
                for m in d.bank_stub().ExportEntries(
                    bank_pb2.ExportEntriesRequest(no_history=True), timeout=30
                )
                if m.default_record.key == mk
            ]
            out.append([list(r.reverted) for r in recs])
        return out

    wait_for(
        lambda: reverted() == [[["b" * 64]]] * 3,
        20.0,
        "the model-level record with b's reversal everywhere",
    )
    # Nothing ping-pongs: once every write is applied everywhere, the banks stop writing.
    wait_for(lambda: _quiet(daemons), 20.0, "every daemon has applied every other one's writes")
    heads = [log_state(d)[0] for d in daemons]
    assert len({json.dumps(sorted(_records(d).items())) for d in daemons}) == 1
    assert [log_state(d)[0] for d in daemons] == heads


def _history_count(d: DaemonProcess) -> int:
    return d.bank_stub().GetBankStats(bank_pb2.GetBankStatsRequest(), timeout=10).history_trials


@pytest.mark.long
def test_a_follower_killed_mid_stream_loses_nothing_and_applies_nothing_twice(
    tmp_path: Path,
) -> None:
    leader, follower = DaemonProcess(tmp_path / "leader"), DaemonProcess(tmp_path / "follower")
    total = 10_000
    key = make_entry(1, 5.0, "alpha").key
    store = BankStore(leader.bank)
    try:  # a long history, so that catching up takes many messages
        store.commit(trials=[(key, {"n": i, "pad": "x" * 200}) for i in range(total)])
    finally:
        store.close()
    follow(follower, [leader])
    try:
        leader.start()
        follower.start()
        wait_for(lambda: _history_count(follower) > 0, 20.0, "the follower applies a first message")
        seen = _history_count(follower)
        follower.kill()  # mid-stream: it had applied part of the history
        assert 0 < seen < total, f"killed after {seen} of {total}: not mid-stream"
        extra = make_entry(2, 6.0, "alpha")
        _import(leader, extra)  # written while the follower is down
        follower.start()
        wait_for(
            lambda: _history_count(follower) == total,
            120,
            "the restarted follower has the whole history",
        )
        wait_for(
            lambda: _lookup(follower, extra.key).found,
            20.0,
            "and what was written while it was down",
        )
        assert _records(follower) == _records(leader)
    finally:
        follower.close()
        leader.close()
    # Each of the leader's writes was applied once: the follower's bank wrote each record
    # once (a second application would have been a no-op, but a lost position shows as
    # the follower starting over, which the position below rules out).
    with open_bank(follower.bank, use_env=False) as reader:
        assert reader.stats()[0].history == total
    store = BankStore(follower.bank)
    try:
        (pos,) = store.positions().values()
        assert pos.seq == total + 1
    finally:
        store.close()


def test_aoe_bank_sync_does_one_pass_into_a_daemon_or_a_bank(fleet, tmp_path: Path) -> None:
    daemons, _ = fleet
    a = daemons[0]
    rec = make_entry(20, 2.0, "alpha")
    _import(a, rec)
    lone = DaemonProcess(tmp_path / "lone")
    try:
        lone.start()
        assert not _lookup(lone, rec.key).found
        done = run_aoe("bank", "sync", f"unix://{a.socket}", "--socket", str(lone.socket))
        assert done.returncode == 0, done.stderr
        assert "synced from" in done.stdout and "entries" in done.stdout
        assert _lookup(lone, rec.key).found
        again = run_aoe("bank", "sync", f"unix://{a.socket}", "--socket", str(lone.socket))
        assert again.returncode == 0 and "added 0" in again.stdout  # nothing new: nothing applied
        elsewhere = run_aoe("bank", "sync", "dns:///192.0.2.1:7461", "--socket", str(lone.socket))
        assert elsewhere.returncode == 2 and "[bank] follow list" in elsewhere.stderr
    finally:
        lone.close()
    bank = tmp_path / "bank"
    done = run_aoe("bank", "sync", f"unix://{a.socket}", "--bank", str(bank))
    assert done.returncode == 0, done.stderr
    with open_bank(bank, use_env=False) as reader:
        entry, _ = reader.lookup(rec.key)
        assert entry is not None and entry.provenance.host == "alpha"
    missing = run_aoe("bank", "sync", "unix:///nonexistent/aoed.sock", "--bank", str(bank))
    assert missing.returncode != 0 and "nonexistent" in missing.stderr


def test_a_worse_decision_written_on_one_daemon_is_corrected_by_the_others(fleet) -> None:
    daemons, keys = fleet
    a = daemons[0]
    k = keys["k"]
    best = min((k["a"], k["c"]), key=encode)
    wait_for(
        lambda: all(_lookup(d, best.key).entry == _entry_pb(best) for d in daemons),
        20.0,
        "converged first",
    )
    wait_for(lambda: _quiet(daemons), 20.0, "every daemon has applied every other one's writes")
    slow = make_entry(1, 30.0, "delta")
    _import(a, slow)  # overwrite: a local write that makes a's record worse
    # The others keep theirs and send it back; a takes it again, and everyone agrees.
    wait_for(
        lambda: all(_lookup(d, best.key).entry == _entry_pb(best) for d in daemons),
        20.0,
        "a holds the better record again, as do the others",
    )


def test_a_peer_restored_from_an_older_copy_is_followed_from_its_start(tmp_path: Path) -> None:
    import shutil

    peer, follower = DaemonProcess(tmp_path / "peer"), DaemonProcess(tmp_path / "follower")
    first, later = make_entry(1, 5.0, "alpha"), [make_entry(n, 5.0, "alpha") for n in (2, 3)]
    store = BankStore(peer.bank)
    try:
        store.commit(entries=[(first.key, encode(first))])
    finally:
        store.close()
    backup = tmp_path / "backup"
    shutil.copytree(peer.bank, backup)  # the same bank, one write in
    store = BankStore(peer.bank)
    try:
        store.commit(entries=[(r.key, encode(r)) for r in later])
    finally:
        store.close()
    follow(follower, [peer])
    try:
        peer.start()
        follower.start()
        wait_for(
            lambda: all(_lookup(follower, r.key).found for r in later),
            20.0,
            "the follower applied writes 1-3",
        )
        peer.stop()
        shutil.rmtree(peer.bank)
        shutil.copytree(backup, peer.bank)  # restored: at write 1 of the same bank
        peer.start()
        fresh = make_entry(4, 5.0, "alpha")
        _import(peer, fresh)  # write 2 of the restored bank: a number the follower had passed
        wait_for(
            lambda: _lookup(follower, fresh.key).found,
            20.0,
            "the follower applied the restored peer's new write",
        )
    finally:
        follower.close()
        peer.close()

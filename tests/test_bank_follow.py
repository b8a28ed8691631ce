"""The bank's write log and the follow rules, in-process on real LMDB banks: sequence
numbers, what a follower is sent, how a peer's writes are applied with the position, and
that banks applying each other's writes in any order end with the same records."""

from __future__ import annotations

import contextlib
import itertools
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import lmdb
import pytest
import trio

from aoe.bankrecord import encode
from aoe.errors import ResourceExhaustedError
from aoed.api._bridge import Bridge
from aoed.bank.exchange import check_change, follow_replace
from aoed.bank.follow import feed
from aoed.bank.store import DEFAULT, ENTRY, TRIAL, BankStore, Change, Position, Record, history_key
from aoed.bank.writer import BankWrite, BankWriter

from .bank_util import foreign, make_entry


@pytest.fixture
def store(tmp_path: Path):
    s = BankStore(tmp_path / "bank")
    yield s
    s.close()


def _all(store: BankStore) -> list[Change]:
    changes, upto, head = store.changes(0, 1_000_000)
    assert upto == head
    return changes


def _records(store: BankStore) -> dict[tuple[str, bytes], bytes]:
    return {(c.kind, c.key): c.value for c in _all(store)}


def test_every_write_takes_the_next_number_and_the_log_keeps_the_latest(store: BankStore) -> None:
    a, b = make_entry(1, 5.0, "alpha"), make_entry(2, 6.0, "alpha")
    store.commit(entries=[(a.key, encode(a)), (b.key, encode(b))], trials=[(a.key, {"n": 1})])
    assert store.head() == 3
    assert [(c.seq, c.kind) for c in _all(store)] == [(1, ENTRY), (2, ENTRY), (3, TRIAL)]
    better = make_entry(1, 4.0, "alpha")
    store.commit(entries=[(better.key, encode(better))])
    got = _all(store)
    assert [(c.seq, c.key) for c in got] == [(2, b.key), (3, got[1].key), (4, a.key)]
    assert got[-1].value == encode(better)
    # What a follower at 3 is sent: only the write after it.
    changes, upto, head = store.changes(3, 100)
    assert [c.seq for c in changes] == [4] and upto == head == 4
    # A page that fills says how far it goes.
    changes, upto, head = store.changes(0, 1)
    assert [c.seq for c in changes] == [2] and (upto, head) == (2, 4)


def test_a_write_of_the_same_bytes_takes_no_number(store: BankStore) -> None:
    a = make_entry(1, 5.0, "alpha")
    store.commit(entries=[(a.key, encode(a))], defaults=[(b"v1/x/y/exact", {"default_us": 3.0})])
    head = store.head()
    store.commit(entries=[(a.key, encode(a))], defaults=[(b"v1/x/y/exact", {"default_us": 3.0})])
    assert store.head() == head


def test_an_entry_replacing_a_default_record_moves_the_key_in_the_log(store: BankStore) -> None:
    a = make_entry(1, 5.0, "alpha")
    store.commit(defaults=[(a.key, {"default_us": 9.0})])
    store.commit(entries=[(a.key, encode(a))])
    assert [(c.kind, c.key) for c in _all(store)] == [(ENTRY, a.key)]


def test_prune_takes_the_trials_out_of_the_log_and_numbers_never_go_back(store: BankStore) -> None:
    a = make_entry(1, 5.0, "alpha")
    store.commit(entries=[(a.key, encode(a))], trials=[(a.key, {"n": i}) for i in range(5)])
    assert store.head() == 6
    store.prune()
    assert [c.kind for c in _all(store)] == [ENTRY]
    store.commit(trials=[(a.key, {"n": 9})])
    assert store.head() == 7
    assert [c.seq for c in _all(store)] == [1, 7]


def test_a_bank_from_before_the_log_gets_numbers_and_an_id_on_open(tmp_path: Path) -> None:
    path = tmp_path / "bank"
    a, b = make_entry(1, 5.0, "alpha"), make_entry(2, 6.0, "alpha")
    store = BankStore(path)
    store.commit(
        entries=[(a.key, encode(a)), (b.key, encode(b))],
        defaults=[(b"v1/d/d/exact", {"default_us": 1.0})],
        trials=[(a.key, {"n": 1})],
    )
    first_id = store.bank_id
    store.close()
    # Make it a bank as an older aoed left it: no log, no counter, no id.
    env = lmdb.open(str(path), max_dbs=16)
    with env.begin(write=True) as txn:
        for name in (b"log", b"logidx"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
        meta = env.open_db(b"meta", txn=txn)
        txn.delete(b"seq", db=meta)
        txn.delete(b"bank_id", db=meta)
    env.close()
    store = BankStore(path)
    try:
        assert store.bank_id and store.bank_id != first_id
        assert store.head() == 4
        assert sorted(c.kind for c in _all(store)) == [DEFAULT, ENTRY, ENTRY, TRIAL]
    finally:
        store.close()


def test_apply_records_the_position_with_the_records_and_twice_writes_nothing(
    store: BankStore,
) -> None:
    a = make_entry(1, 5.0, "alpha")
    records = [Record(ENTRY, a.key, encode(a)), Record(TRIAL, history_key(a.key, 7), b'{"n":1}')]
    counts = store.apply("unix:///peer.sock", Position("peer-bank", 42), records, follow_replace)
    assert (counts[ENTRY].added, counts[TRIAL].added) == (1, 1)
    assert store.position("unix:///peer.sock") == Position("peer-bank", 42)
    head = store.head()
    again = store.apply("unix:///peer.sock", Position("peer-bank", 43), records, follow_replace)
    assert (again[ENTRY].kept, again[TRIAL].kept) == (1, 1)
    assert store.head() == head  # nothing written: the echo of a loop ends here
    assert store.positions() == {"unix:///peer.sock": Position("peer-bank", 43)}


def test_apply_writes_nothing_when_a_record_is_refused_by_the_store(store: BankStore) -> None:
    a = make_entry(1, 5.0, "alpha")
    with pytest.raises(ValueError, match="unknown record kind"):
        store.apply(
            "p",
            Position("b", 5),
            [Record(ENTRY, a.key, encode(a)), Record("gdat", b"k", b"v")],
            follow_replace,
        )
    assert store.position("p") is None and store.head() == 0


def test_a_kept_better_record_is_sent_again_to_followers(store: BankStore) -> None:
    fast, slow = make_entry(1, 4.0, "alpha"), make_entry(1, 8.0, "beta")
    store.commit(entries=[(fast.key, encode(fast))])
    before = store.head()
    counts = store.apply(
        "p", Position("b", 1), [Record(ENTRY, slow.key, encode(slow))], follow_replace
    )
    assert counts[ENTRY].kept == 1
    changes, _, head = store.changes(before, 10)
    assert head == before + 1 and [c.value for c in changes] == [encode(fast)]


def _candidates() -> list[Record]:
    """Conflicting records for one key: entries of different speed, an entry and a
    default record at the same time, two entries at one time that differ in bytes."""
    e10, e12 = make_entry(1, 10.0, "alpha"), make_entry(1, 12.0, "beta")
    e10b = make_entry(1, 10.0, "gamma")  # same time as alpha's, other provenance
    return [
        Record(ENTRY, e12.key, encode(e12)),
        Record(DEFAULT, e12.key, json.dumps({"default_us": 10.0}, sort_keys=True).encode()),
        Record(ENTRY, e10.key, encode(e10)),
        Record(ENTRY, e10b.key, encode(e10b)),
    ]


def test_the_follow_rule_is_a_total_order_so_every_arrival_order_converges(tmp_path: Path) -> None:
    records = _candidates()
    finals = set()
    for n, order in enumerate(itertools.permutations(records)):
        s = BankStore(tmp_path / f"b{n}")
        try:
            for i, r in enumerate(order):
                s.apply("p", Position("b", i + 1), [r], follow_replace)
            finals.add(tuple(sorted(_records(s).items())))
        finally:
            s.close()
    assert len(finals) == 1
    (((kind, _), value),) = finals.pop()
    winner = min(records[2:], key=lambda r: r.value)  # the two 10 us entries: the smaller bytes
    assert (kind, value) == (ENTRY, winner.value)


def test_a_changed_record_a_peer_sends_is_checked_like_an_import() -> None:
    good = make_entry(1, 5.0, "alpha")
    ok, why = check_change(Change(1, ENTRY, good.key, encode(good), 0))
    assert ok is not None and not why
    # Another device's record is kept under its own key (served to that device only).
    away = make_entry(2, 5.0, "alpha", dev=foreign())
    rec, why = check_change(Change(2, ENTRY, away.key, encode(away), 0))
    assert rec == Record(ENTRY, away.key, encode(away)) and not why
    rec, why = check_change(Change(3, ENTRY, good.key + b"x", encode(good), 0))
    assert rec is None and "another key" in why
    rec, why = check_change(Change(4, "gdat", b"k", b"v", 0))
    assert rec is None and "does not keep" in why
    rec, why = check_change(Change(5, DEFAULT, good.key, b"[1]", 0))
    assert rec is None and "not a stored default" in why


async def test_feed_sends_the_backlog_then_each_commit_as_it_comes(tmp_path: Path) -> None:
    writer = BankWriter(tmp_path / "bank", layers=[])
    a, b = make_entry(1, 5.0, "alpha"), make_entry(2, 6.0, "alpha")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            await writer.write(BankWrite(entries=(a,)))
            agen = feed(writer, 0)
            first = await agen.__anext__()
            assert [c.key for c in first.changes] == [a.key] and first.upto == first.head == 1
            with trio.fail_after(5):
                nursery.start_soon(writer.write, BankWrite(entries=(b,)))
                second = await agen.__anext__()
            assert [c.key for c in second.changes] == [b.key] and second.upto == 2
            # A follower of another bank (a replaced one) is sent everything again.
            async with contextlib.aclosing(feed(writer, 2, bank_id="some-other-bank")) as other:
                again = await other.__anext__()
            assert [c.seq for c in again.changes] == [1, 2]
            await agen.aclose()
            nursery.cancel_scope.cancel()
    finally:
        writer.close()


async def test_a_stream_reader_that_takes_nothing_is_cut_off_with_a_clear_status() -> None:
    """The bridge's stall rule FollowBank relies on: the producer stops when the client
    took nothing for a while, and the client, once it reads on, gets what was buffered
    and then RESOURCE_EXHAUSTED with the reason."""
    stopped = trio.Event()
    chunk = b"x" * (1 << 20)

    async def endless():
        try:
            while True:
                yield chunk
        finally:
            stopped.set()

    def handler(bridge: Bridge):
        def stream(request, context):
            stall = (0.3, ResourceExhaustedError("too slow: resume from your last position"))
            yield from bridge.stream(context, endless, buffer=2, stall=stall)

        return grpc.method_handlers_generic_handler(
            "t.T", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
        )

    folder = Path(tempfile.mkdtemp(prefix="stall-", dir="/tmp"))
    target = f"unix:{folder / 's'}"
    async with trio.open_nursery() as nursery:
        server = grpc.server(ThreadPoolExecutor(4))
        server.add_generic_rpc_handlers((handler(Bridge(nursery)),))
        server.add_insecure_port(target)
        server.start()
        try:
            with grpc.insecure_channel(target) as channel:
                call = channel.unary_stream("/t.T/Stream")(b"")
                assert await trio.to_thread.run_sync(lambda: next(call)) == chunk
                with trio.fail_after(30):
                    await stopped.wait()  # the reader took nothing: the producer was stopped

                def drain() -> int:
                    n = 0
                    for _ in call:
                        n += 1
                    return n

                with pytest.raises(grpc.RpcError) as err:
                    await trio.to_thread.run_sync(drain)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "resume from your last position" in err.value.details()
        finally:
            await trio.to_thread.run_sync(lambda: server.stop(0).wait())
            nursery.cancel_scope.cancel()


async def test_an_import_larger_than_a_transaction_is_merged_whole_through_the_writer(
    tmp_path: Path,
) -> None:
    from aoe.v1 import bank_pb2

    from .bank_service import serving

    key = make_entry(1, 5.0, "alpha").key.decode()
    n = 4500  # more than two of the writer's transactions
    requests = [
        bank_pb2.ImportEntriesRequest(
            trial=bank_pb2.TrialRecord(key=key, time_ns=i + 1, trial_json='{"n": 1}')
        )
        for i in range(n)
    ]
    async with serving(tmp_path) as d:
        reply = await d("ImportEntries", iter(requests), timeout=120)
        assert (reply.trials.added, reply.refused) == (n, 0)
        stats = await d("GetBankStats", bank_pb2.GetBankStatsRequest(), timeout=30)
        assert stats.history_trials == n

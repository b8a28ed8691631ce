"""BankService over gRPC: a real server on a unix socket, the real engine and bank behind
it, called from a grpc client in a thread."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import trio

from aoe.v1 import bank_pb2
from aoed.backends.ort.catalog import build_registry

from .bank_service import Daemon, serving
from .bank_util import default_key, fill_bank, foreign, here, make_bank, make_entry, rec
from .helpers import wait_until


async def _stats(d: Daemon) -> bank_pb2.GetBankStatsResponse:
    return await d("GetBankStats", bank_pb2.GetBankStatsRequest())


async def test_stats_and_lookups(tmp_path: Path) -> None:
    entries = fill_bank(tmp_path / "a" / "bank")
    local = next(e for e in entries if e.host == "alpha")
    async with serving(tmp_path) as d:
        st = await _stats(d)
        assert (st.entries, st.history_trials, dict(st.layer_entries)) == (5, 3, {"custom": 5})
        assert st.path == str(d.bank) and st.used_bytes > 0 and st.schema_version == 1

        r = await d("LookupEntry", bank_pb2.LookupEntryRequest(key=local.key.decode()))
        assert (r.found, r.layer, r.reason, r.entry.key) == (True, "custom", "", local.key.decode())
        assert (
            r.entry.provenance.host == "alpha"
            and r.entry.winner.median_us == local.winner.median_us
        )
        # By digests, on the daemon's device by default.
        digests = bank_pb2.EntryDigests(
            signature_digest=local.signature.digest, precision=bank_pb2.PRECISION_EXACT
        )
        r = await d("LookupEntry", bank_pb2.LookupEntryRequest(digests=digests))
        assert r.found and r.entry.key == local.key.decode()
        # A miss says why.
        digests.precision = bank_pb2.PRECISION_INT8
        r = await d("LookupEntry", bank_pb2.LookupEntryRequest(digests=digests))
        assert not r.found and not r.layer and not r.HasField("entry")
        assert "under precision exact, not int8" in r.reason
        r = await d("LookupEntry", bank_pb2.LookupEntryRequest(key=default_key(1).decode()))
        assert not r.found and "default strategy stayed fastest" in r.reason
        r = await d("LookupEntry", bank_pb2.LookupEntryRequest(key="nonsense"))
        assert not r.found and "is not a bank key" in r.reason
        with pytest.raises(grpc.RpcError) as err:
            await d("LookupEntry", bank_pb2.LookupEntryRequest())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_query_pages_return_every_entry_once(tmp_path: Path) -> None:
    entries = fill_bank(tmp_path / "a" / "bank", n_entries=24)
    async with serving(tmp_path) as d:
        keys, token, pages = [], "", 0
        while True:
            r = await d("QueryEntries", bank_pb2.QueryEntriesRequest(page_size=7, page_token=token))
            keys += [e.key for e in r.entries]
            pages += 1
            token = r.next_page_token
            if not token:
                break
        # 25 in key order, once each
        assert pages == 4 and keys == [e.key.decode() for e in entries]
        far = next(e for e in entries if e.host == "far")
        r = await d("QueryEntries", bank_pb2.QueryEntriesRequest(device_digest=far.device.digest))
        assert [e.key for e in r.entries] == [far.key.decode()] and not r.next_page_token
        r = await d(
            "QueryEntries",
            bank_pb2.QueryEntriesRequest(op_type="MatMul", precision=bank_pb2.PRECISION_INT8),
        )
        assert not r.entries
        r = await d("QueryEntries", bank_pb2.QueryEntriesRequest(op_type="MatMul"))
        assert len(r.entries) == 25
        with pytest.raises(grpc.RpcError) as err:
            await d("QueryEntries", bank_pb2.QueryEntriesRequest(page_token="bm90IGEga2V5"))
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "page_token" in err.value.details()
        )


def _import_stream(
    records: list[bank_pb2.ExportEntriesResponse], options: bank_pb2.ImportOptions | None = None
):
    if options is not None:
        yield bank_pb2.ImportEntriesRequest(options=options)
    for r in records:
        which = r.WhichOneof("record")
        yield bank_pb2.ImportEntriesRequest(**{which: getattr(r, which)})


async def test_export_then_import_into_another_daemon_round_trips(tmp_path: Path) -> None:
    fill_bank(tmp_path / "a" / "bank")
    make_bank(tmp_path / "b" / "bank")
    export = bank_pb2.ExportEntriesRequest()
    async with serving(tmp_path, "a") as a, serving(tmp_path, "b") as b:
        records = await a.stream("ExportEntries", export)
        kinds = [r.WhichOneof("record") for r in records]
        assert kinds == ["entry"] * 5 + ["default_record"] + ["trial"] * 3
        # The foreign device's entry is kept too, without asking (served to its device).
        r = await b("ImportEntries", _import_stream(records))
        assert (r.added, r.updated, r.kept, r.refused) == (9, 0, 0, 0)
        assert (r.entries.added, r.default_records.added, r.trials.added) == (5, 1, 3)
        assert await b.stream("ExportEntries", export) == records
        # Into the bank it came from: everything is there already.
        r = await a(
            "ImportEntries",
            _import_stream(records, bank_pb2.ImportOptions(allow_foreign_devices=True)),
        )
        assert (r.added, r.updated, r.kept, r.refused) == (0, 0, 9, 0)
        # Filters: entries only; the foreign device's records only.
        only = await a.stream("ExportEntries", bank_pb2.ExportEntriesRequest(entries_only=True))
        assert only == records[:5]
        far = await a.stream(
            "ExportEntries", bank_pb2.ExportEntriesRequest(device_digest=foreign().digest)
        )
        assert [r.entry.provenance.host for r in far] == ["far"]


async def test_bad_records_are_refused_and_nothing_is_written_before_all_are_checked(
    tmp_path: Path,
) -> None:
    fill_bank(tmp_path / "a" / "bank")
    fresh = bank_pb2.ExportEntriesResponse(
        entry=bank_pb2.BankEntry.FromString(_encoded(make_entry(50, 3.0, "new")))
    )
    forged = bank_pb2.ExportEntriesResponse()
    forged.entry.CopyFrom(fresh.entry)
    forged.entry.signature.canonical_json += " "
    bad_trial = bank_pb2.ExportEntriesResponse(
        trial=bank_pb2.TrialRecord(key="v1/xyz", time_ns=1, trial_json="{}")
    )
    async with serving(tmp_path) as d:
        before = await _stats(d)
        r = await d("ImportEntries", _import_stream([forged, bad_trial]))
        assert (r.added, r.updated, r.kept, r.refused) == (0, 0, 0, 2)
        reasons = {e.key: e.reason for e in r.refused_entries}
        assert reasons[forged.entry.key] == "signature digest does not match its canonical JSON"
        assert any("not a bank key" in why for why in reasons.values())
        assert await _stats(d) == before
        # A valid record, then a message that breaks the stream: the valid one is not
        # written either (the import is read and checked whole first).
        stream = [
            bank_pb2.ImportEntriesRequest(entry=fresh.entry),
            bank_pb2.ImportEntriesRequest(options=bank_pb2.ImportOptions()),
        ]
        with pytest.raises(grpc.RpcError) as err:
            await d("ImportEntries", iter(stream))
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "only the first" in err.value.details()
        )
        assert await _stats(d) == before
        r = await d("ImportEntries", iter(stream[:1]))
        assert r.entries.added == 1 and (await _stats(d)).entries == before.entries + 1


def _encoded(record) -> bytes:
    from aoe.bankrecord import encode

    return encode(record)


async def test_prune_dry_run_then_for_real(tmp_path: Path) -> None:
    fill_bank(tmp_path / "a" / "bank", n_trials=40)
    async with serving(tmp_path) as d:
        r = await d("PruneBank", bank_pb2.PruneBankRequest(dry_run=True))
        assert (r.trials_removed, r.entries_kept) == (
            40,
            5,
        ) and r.used_bytes_after == r.used_bytes_before
        assert (await _stats(d)).history_trials == 40
        r = await d("PruneBank", bank_pb2.PruneBankRequest())
        assert (r.trials_removed, r.entries_kept) == (
            40,
            5,
        ) and r.used_bytes_after < r.used_bytes_before
        st = await _stats(d)
        assert (st.history_trials, st.entries) == (0, 5)


async def test_a_prune_is_the_writers_and_waits_its_turn_in_the_queue(tmp_path: Path) -> None:
    """The daemon's prune is one more op on the writer's queue, never a write of its own
    from a worker thread: while the writer is not taking ops, it waits there and the
    history stays; once the writer runs, it is done."""
    from aoed.bank.daemonbank import DaemonBank
    from aoed.bank.writer import BankWriter

    fill_bank(tmp_path / "bank", n_trials=7)
    writer = BankWriter(tmp_path / "bank", layers=[])
    bank = DaemonBank(writer, here())
    pruned = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(pruned, bank.prune(False)))
            await wait_until(lambda: writer.queued >= 1, 30, "the prune queued behind the writer")
            assert not pruned and (await bank.stats())[0].history == 7
            await nursery.start(writer.run)
            await wait_until(lambda: pruned, 30, "the prune done")
            nursery.cancel_scope.cancel()
        assert pruned[0].trials_removed == 7 and (await bank.stats())[0].history == 0
    finally:
        writer.close()


async def _append(out: list, result) -> None:
    out.append(await result)


async def test_a_client_cancelling_an_export_midway_leaves_the_daemon_serving(
    tmp_path: Path,
) -> None:
    # ~8 MB: more than the transport buffers
    fill_bank(tmp_path / "a" / "bank", n_trials=4000, trial_bytes=2000)
    async with serving(tmp_path) as d:
        call = d.stub.ExportEntries(bank_pb2.ExportEntriesRequest())
        first = await trio.to_thread.run_sync(next, call)
        assert first.WhichOneof("record") == "entry"
        assert d.bridge_tasks.child_tasks  # the producer waits for the client
        call.cancel()
        await wait_until(
            lambda: not d.bridge_tasks.child_tasks, 10, "the producer cancelled on the trio side"
        )
        assert (await _stats(d)).history_trials == 4000
        records = await d.stream("ExportEntries", bank_pb2.ExportEntriesRequest(no_history=True))
        assert [r.WhichOneof("record") for r in records] == ["entry"] * 5 + ["default_record"]


async def test_verify_streams_a_verdict_per_entry_and_records_the_measurements(
    models: Path, tmp_path: Path
) -> None:
    from aoed.engine.assemble import tunable_tasks
    from aoed.engine.prep import prepare

    prep = prepare(models / "mlp.onnx", tmp_path / "prep")
    fused = next(
        t
        for t in tunable_tasks(prep.model, prep.ctx, build_registry(), "exact")
        if t.op_type == "MatMul+Add+Relu"
    )
    local = rec(sig=fused.signature, strategy="fused_gemm", family="matmul")
    elsewhere = rec(sig=fused.signature, dev=foreign(), strategy="fused_gemm", family="matmul")
    make_bank(tmp_path / "a" / "bank", [local, elsewhere])
    async with serving(tmp_path) as d:
        verdicts = await d.stream("VerifyEntries", bank_pb2.VerifyEntriesRequest())
        by_key = {v.key: v for v in verdicts}
        assert set(by_key) == {local.key.decode(), elsewhere.key.decode()}
        v = by_key[local.key.decode()]
        assert v.verdict in (
            bank_pb2.VERIFY_VERDICT_CONFIRMED,
            bank_pb2.VERIFY_VERDICT_REGRESSED,
            bank_pb2.VERIFY_VERDICT_INCONCLUSIVE,
        ), v
        assert (
            v.measured_winner.median_us > 0
            and v.measured_baseline.median_us > 0
            and v.op_type == "MatMul+Add+Relu"
        )
        v = by_key[elsewhere.key.decode()]
        assert v.verdict == bank_pb2.VERIFY_VERDICT_SKIPPED and "another device" in v.detail
        st = await _stats(d)
        assert st.history_trials == 2  # the default and the strategy, measured once each
        history = await d.stream("ExportEntries", bank_pb2.ExportEntriesRequest())
        trials = [
            json.loads(r.trial.trial_json) for r in history if r.WhichOneof("record") == "trial"
        ]
        assert {t["strategy"] for t in trials} == {"default", "fused_gemm"} and all(
            t["verify"] for t in trials
        )
        with pytest.raises(grpc.RpcError) as err:
            await d.stream("VerifyEntries", bank_pb2.VerifyEntriesRequest(device="cuda:0"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

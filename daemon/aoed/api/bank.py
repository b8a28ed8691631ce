"""BankService: the knowledge bank over gRPC, as `aoe bank` has it locally.

Methods are protobuf -> domain, one bridge call (or stream), domain -> protobuf, over
aoed.bank.daemonbank.DaemonBank (the engine's BankWriter, the daemon's one writer of the
bank) and, for VerifyEntries, the engine's device.

  LookupEntry    a key, or digests (this daemon's device by default): custom bank, then
                 the read-only layers; a miss says why, as `aoe bank lookup` does
  QueryEntries   the custom bank's entries in key order, filtered, one page at a time;
                 the page token is the last key looked at (base64url)
  ExportEntries  the custom bank's records (entries, default records, then the history,
                 each in key order), read a page per transaction
  ImportEntries  reads the whole stream in the handler's thread and checks every record
                 as `aoe bank import` does, each field against what this daemon's tuner
                 writes (bad ones are refused with their reason, and logged), then
                 merges the rest in one go: nothing is written before all is checked
  GetBankStats   counts per layer; sizes of the custom bank
  PruneBank      drops the custom bank's history, or counts what would go
  VerifyEntries  re-measures a sample of the custom bank's entries on the engine's
                 device (1 s each, as `aoe bank verify`), streams each verdict as it
                 comes and appends the measurements to the history
  FollowBank     the custom bank's writes after a sequence number, then each new one as
                 committed (aoed.bank.follow.feed); a reader that takes nothing for
                 FOLLOW_STALL_S while FOLLOW_BUFFER messages wait is cut off
  SyncBank       one pass of following a peer (aoed.bank.follow.Follower.sync)
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import random
from collections.abc import AsyncGenerator, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import grpc

from aoe.bank import Explanation, parse_key
from aoe.device import Device
from aoe.errors import OptionError, ResourceExhaustedError
from aoe.exchange import default_record, exported_trial, record_to_json
from aoe.keys import PRECISION_NAMES
from aoe.v1 import bank_pb2, bank_pb2_grpc
from aoe.wire import layer_stats_to_pb
from aoed.api._bridge import Bridge
from aoed.bank.daemonbank import DaemonBank, Keep, check_import
from aoed.bank.follow import Connect, FollowBatch, Follower, SyncReport, feed
from aoed.bank.store import MergeCounts
from aoed.engine.bankverify import Verdict, sample_entries, verify_entries
from aoed.vocabulary import tuner_vocabulary

if TYPE_CHECKING:
    from aoe.client import Client
    from aoed.engine.engine import Engine

__all__ = ["MAX_IMPORT_BYTES", "MAX_IMPORT_RECORDS", "BankServicer", "add_to_server"]

DEFAULT_PAGE, MAX_PAGE = 100, 1000
#: Records per transaction (and per thread hop) of an export.
EXPORT_PAGE = 256
#: One import holds its records in memory until they are all checked: these bound it.
MAX_IMPORT_RECORDS = 1_000_000
MAX_IMPORT_BYTES = 512 << 20
#: Refused records listed one by one in an import's answer; the rest are only counted.
SHOW_REFUSED = 1000
#: Device seconds per verified entry (`aoe bank verify`'s default).
VERIFY_BUDGET_S = 1.0
#: FollowBank messages (of up to aoed.bank.follow.FEED_PAGE records) that wait for a
#: slow reader, and how long it may take none of them before it is cut off.
FOLLOW_BUFFER = 64
FOLLOW_STALL_S = 30.0

_POLICY = {
    bank_pb2.MERGE_POLICY_UNSPECIFIED: "keep-faster",
    bank_pb2.MERGE_POLICY_KEEP_FASTER: "keep-faster",
    bank_pb2.MERGE_POLICY_OVERWRITE: "overwrite",
    bank_pb2.MERGE_POLICY_KEEP_EXISTING: "keep-existing",
}
_VERDICT = {
    "confirmed": bank_pb2.VERIFY_VERDICT_CONFIRMED,
    "regressed": bank_pb2.VERIFY_VERDICT_REGRESSED,
    "inaccurate": bank_pb2.VERIFY_VERDICT_INACCURATE,
    "skipped": bank_pb2.VERIFY_VERDICT_SKIPPED,
    "error": bank_pb2.VERIFY_VERDICT_ERROR,
    "inconclusive": bank_pb2.VERIFY_VERDICT_INCONCLUSIVE,
}


def add_to_server(
    server: grpc.Server,
    bridge: Bridge,
    engine: Engine,
    connect: Connect | None = None,
    peers: Sequence[str] = (),
) -> BankServicer:
    """Serve BankService on `server` over `engine`; returns the servicer. `connect`
    opens a client to a peer for SyncBank (default: aoe.client.Client, no TLS), which
    reaches unix sockets and the TCP `peers` only."""
    servicer = BankServicer(bridge, engine, connect, peers)
    bank_pb2_grpc.add_BankServiceServicer_to_server(servicer, server)
    return servicer


def _plain_client(target: str) -> Client:
    from aoe.client import Client

    return Client(target)


class BankServicer(bank_pb2_grpc.BankServiceServicer):
    def __init__(
        self,
        bridge: Bridge,
        engine: Engine,
        connect: Connect | None = None,
        peers: Sequence[str] = (),
    ):
        self._bridge, self._engine = bridge, engine
        self._bank = DaemonBank(engine.bank, engine.device.device.fingerprint())
        self._connect = connect or _plain_client
        self._peers = frozenset(peers)
        #: what this daemon's tuner writes: every record from outside is checked against it
        self._vocabulary = tuner_vocabulary(engine.registry)

    @property
    def bank(self) -> DaemonBank:
        """The bank this servicer serves (its lookup counts are metrics)."""
        return self._bank

    # -- unary

    def LookupEntry(
        self, request: bank_pb2.LookupEntryRequest, context: grpc.ServicerContext
    ) -> bank_pb2.LookupEntryResponse:
        ex, raw = self._bridge.call(context, self._lookup, request)
        return bank_pb2.LookupEntryResponse(
            found=ex.found,
            entry=bank_pb2.BankEntry.FromString(raw) if ex.found and raw is not None else None,
            layer=ex.layer if ex.found else "",
            reason=ex.reason,
        )

    async def _lookup(
        self, request: bank_pb2.LookupEntryRequest
    ) -> tuple[Explanation, bytes | None]:
        d = request.digests
        return await self._bank.lookup(
            request.key, d.signature_digest, d.device_digest, _precision(d.precision) or "exact"
        )

    def QueryEntries(
        self, request: bank_pb2.QueryEntriesRequest, context: grpc.ServicerContext
    ) -> bank_pb2.QueryEntriesResponse:
        items, after = self._bridge.call(context, self._query, request)
        return bank_pb2.QueryEntriesResponse(
            entries=[bank_pb2.BankEntry.FromString(v) for _, v in items],
            next_page_token=base64.urlsafe_b64encode(after).decode(),
        )

    async def _query(
        self, request: bank_pb2.QueryEntriesRequest
    ) -> tuple[list[tuple[bytes, bytes]], bytes]:
        keep = _keep("entries", request.op_type, request.device_digest, request.precision)
        size = min(request.page_size or DEFAULT_PAGE, MAX_PAGE)
        return await self._bank.page("entries", _after(request.page_token), size, keep)

    def ImportEntries(
        self,
        request_iterator: Iterator[bank_pb2.ImportEntriesRequest],
        context: grpc.ServicerContext,
    ) -> bank_pb2.ImportEntriesResponse:
        first = next(request_iterator, None)
        records: Iterable[bank_pb2.ImportEntriesRequest] = request_iterator
        if first is not None and first.WhichOneof("payload") == "options":
            options = first.options
        else:
            options = bank_pb2.ImportOptions()
            if first is not None:
                records = itertools.chain([first], request_iterator)
        if options.policy not in _POLICY:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ImportEntries: unknown merge policy {options.policy}",
            )
        checked = check_import(
            _lines(records, context),
            _POLICY[options.policy],
            self._vocabulary,
        )
        counts = self._bridge.call(context, self._bank.merge, checked)
        return _import_response(counts, checked.refused)

    def GetBankStats(
        self, request: bank_pb2.GetBankStatsRequest, context: grpc.ServicerContext
    ) -> bank_pb2.GetBankStatsResponse:
        layers = self._bridge.call(context, self._bank.stats)
        custom = layers[0]
        return bank_pb2.GetBankStatsResponse(
            entries=sum(s.entries for s in layers),
            history_trials=sum(s.history for s in layers),
            layer_entries={s.name: s.entries for s in layers},
            map_size_bytes=custom.map_size,
            used_bytes=custom.used_bytes,
            schema_version=custom.schema_version,
            path=custom.path,
            defaults=sum(s.defaults for s in layers),
            layers=[layer_stats_to_pb(s) for s in layers],
        )

    def SyncBank(
        self, request: bank_pb2.SyncBankRequest, context: grpc.ServicerContext
    ) -> bank_pb2.SyncBankResponse:
        report = self._bridge.call(context, self._sync, request.peer)
        return bank_pb2.SyncBankResponse(
            peer_bank_id=report.peer_bank_id,
            from_seq=report.from_seq,
            to_seq=report.to_seq,
            entries=_counts(report.counts["entry"]),
            default_records=_counts(report.counts["default"]),
            trials=_counts(report.counts["trial"]),
            refused=report.refused,
        )

    async def _sync(self, peer: str) -> SyncReport:
        if not peer:
            raise OptionError(
                "SyncBank: give the peer as a gRPC target (unix:///path.sock, dns:///host:7461)"
            )
        # A client must not make the daemon dial anywhere it likes with its credentials.
        if not peer.startswith("unix:") and peer not in self._peers:
            raise OptionError(
                f"SyncBank: {peer}: this daemon syncs over TCP only with the peers in its "
                "[bank] follow list; add it there, or sync into a bank folder with --bank"
            )
        return await Follower(self._engine.bank, peer, self._connect, self._vocabulary).sync()

    def PruneBank(
        self, request: bank_pb2.PruneBankRequest, context: grpc.ServicerContext
    ) -> bank_pb2.PruneBankResponse:
        r = self._bridge.call(context, self._bank.prune, request.dry_run)
        return bank_pb2.PruneBankResponse(
            trials_removed=r.trials_removed,
            entries_kept=r.entries_kept,
            used_bytes_before=r.used_bytes_before,
            used_bytes_after=r.used_bytes_after,
        )

    # -- server streams

    def ExportEntries(
        self, request: bank_pb2.ExportEntriesRequest, context: grpc.ServicerContext
    ) -> Iterator[bank_pb2.ExportEntriesResponse]:
        yield from self._bridge.stream(context, _export, self._bank, request)

    def FollowBank(
        self, request: bank_pb2.FollowBankRequest, context: grpc.ServicerContext
    ) -> Iterator[bank_pb2.FollowBankResponse]:
        stall = (
            FOLLOW_STALL_S,
            ResourceExhaustedError(
                f"FollowBank: this follower read nothing for {FOLLOW_STALL_S:g} s while {FOLLOW_BUFFER} messages "
                "waited; reconnect and resume from the last upto_seq applied"
            ),
        )
        for batch in self._bridge.stream(
            context,
            feed,
            self._engine.bank,
            request.after_seq,
            request.bank_id,
            buffer=FOLLOW_BUFFER,
            stall=stall,
        ):
            yield _batch(batch)

    def VerifyEntries(
        self, request: bank_pb2.VerifyEntriesRequest, context: grpc.ServicerContext
    ) -> Iterator[bank_pb2.VerifyEntriesResponse]:
        for v in self._bridge.stream(context, _verify, self._engine, self._bank, request, buffer=1):
            yield _verdict(v)


async def _export(
    bank: DaemonBank, request: bank_pb2.ExportEntriesRequest
) -> AsyncGenerator[bank_pb2.ExportEntriesResponse, None]:
    """The custom bank's records for an ExportEntriesRequest: entries, then default
    records, then the history, each in key order, read a page per transaction."""
    dbs = ["entries"]
    if not request.entries_only and not request.op_type:  # only entries have an op type
        dbs += ["defaults"] if request.no_history else ["defaults", "history"]
    for db in dbs:
        keep = _keep(db, request.op_type, request.device_digest, request.precision)
        after = b""
        while True:
            items, after = await bank.page(db, after, EXPORT_PAGE, keep)
            for key, value in items:
                yield _record(db, key, value)
            if not after:
                break


def _check_verify(engine: Engine, request: bank_pb2.VerifyEntriesRequest) -> None:
    if request.device and Device.parse(request.device).name != engine.device.device.name:
        raise OptionError(
            f"device {request.device!r}: this daemon measures on {engine.device.device}"
        )


async def _verify(
    engine: Engine, bank: DaemonBank, request: bank_pb2.VerifyEntriesRequest
) -> AsyncGenerator[Verdict, None]:
    """A verdict per sampled entry of the custom bank, each measured in turn; the
    measurements go to the history before the verdict is handed on."""
    _check_verify(engine, request)
    seed = request.seed or random.SystemRandom().randrange(1, 1 << 31)
    for entry in sample_entries(await bank.entries(), request.sample_size, seed, request.op_type):
        (verdict,), trials = await verify_entries(engine, [entry], VERIFY_BUDGET_S)
        if trials:
            await bank.record(trials)
        yield verdict


# --------------------------------------------------------------------------- conversions


def _precision(code: int) -> str:
    """The policy name of a Precision; "" for unspecified; OptionError when unknown."""
    if code == bank_pb2.PRECISION_UNSPECIFIED:
        return ""
    if code not in PRECISION_NAMES:
        raise OptionError(f"precision {code}: unknown")
    return PRECISION_NAMES[code]


def _after(token: str) -> bytes:
    if not token:
        return b""
    try:
        after = base64.urlsafe_b64decode(token.encode("ascii"))
        parse_key(after)
    except (ValueError, binascii.Error):
        raise OptionError("page_token: not a token this daemon gave out") from None
    return after


def _keep(db: str, op_type: str, device_digest: str, precision: int) -> Keep | None:
    """What a page of `db` keeps under a query's filters; None when it keeps everything."""
    prec = _precision(precision)
    if not (op_type or device_digest or prec):
        return None
    dev32 = device_digest.lower()[:32]

    def keep(key: bytes, value: bytes) -> bool:
        if db == "history":
            key = key.rpartition(b"/")[0]
        try:
            _, _, dev, p = parse_key(key)
        except ValueError:
            return False
        if (dev32 and not dev.startswith(dev32)) or (prec and p != prec):
            return False
        if op_type:  # an anchor op type ("MatMul") or a whole one ("MatMul+Add+Relu")
            have = bank_pb2.BankEntry.FromString(value).signature.op_type
            return op_type in (have, have.split("+")[0])
        return True

    return keep


def _record(db: str, key: bytes, value: bytes) -> bank_pb2.ExportEntriesResponse:
    """A stored record as the exchange format has it (as aoe.bank's `records()`)."""
    if db == "entries":
        return bank_pb2.ExportEntriesResponse(entry=bank_pb2.BankEntry.FromString(value))
    if db == "defaults":
        return bank_pb2.ExportEntriesResponse(default_record=default_record(key, json.loads(value)))
    return bank_pb2.ExportEntriesResponse(trial=exported_trial(key, value))


def _lines(
    requests: Iterable[bank_pb2.ImportEntriesRequest], context: grpc.ServicerContext
) -> Iterator[str]:
    """Each imported record as a line of the JSON Lines exchange, within the limits."""
    total = 0
    for n, msg in enumerate(requests, 1):
        which = msg.WhichOneof("payload")
        if which is None or which == "options":
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ImportEntries: record {n} carries {'nothing' if which is None else 'options'}; "
                "only the first message may carry options, every other one a record",
            )
        total += msg.ByteSize()
        if n > MAX_IMPORT_RECORDS or total > MAX_IMPORT_BYTES:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"ImportEntries: over this daemon's limit of {MAX_IMPORT_RECORDS} records or "
                f"{MAX_IMPORT_BYTES >> 20} MiB per import; split the import",
            )
        yield record_to_json(bank_pb2.ExportEntriesResponse(**{which: getattr(msg, which)}))


def _batch(b: FollowBatch) -> bank_pb2.FollowBankResponse:
    return bank_pb2.FollowBankResponse(
        bank_id=b.bank_id,
        upto_seq=b.upto,
        head_seq=b.head,
        changes=[
            bank_pb2.BankChange(
                seq=c.seq, kind=c.kind, key=c.key, value=c.value, committed_unix_ns=c.committed_ns
            )
            for c in b.changes
        ],
    )


def _counts(c: MergeCounts) -> bank_pb2.ImportCounts:
    return bank_pb2.ImportCounts(added=c.added, updated=c.updated, kept=c.kept)


def _import_response(
    counts: dict[str, MergeCounts], refused: list[tuple[str, str]]
) -> bank_pb2.ImportEntriesResponse:
    return bank_pb2.ImportEntriesResponse(
        added=sum(c.added for c in counts.values()),
        updated=sum(c.updated for c in counts.values()),
        kept=sum(c.kept for c in counts.values()),
        refused=len(refused),
        refused_entries=[
            bank_pb2.RefusedEntry(key=label, reason=why) for label, why in refused[:SHOW_REFUSED]
        ],
        entries=_counts(counts["entry"]),
        default_records=_counts(counts["default"]),
        trials=_counts(counts["trial"]),
    )


def _stats(m: Mapping[str, float]) -> bank_pb2.Stats:
    return bank_pb2.Stats(
        median_us=m.get("median_us", 0.0),
        spread=m.get("spread", 0.0),
        repeats=int(m.get("repeats", 0)),
        min_us=m.get("min_us", 0.0),
    )


def _verdict(v: Verdict) -> bank_pb2.VerifyEntriesResponse:
    w = v.winner
    return bank_pb2.VerifyEntriesResponse(
        key=v.key,
        op_type=v.op_type,
        verdict=_VERDICT.get(v.verdict, bank_pb2.VERIFY_VERDICT_UNSPECIFIED),
        measured_winner=_stats(v.winner),
        measured_baseline=_stats(v.baseline),
        accuracy=bank_pb2.Accuracy(
            max_abs_error=w.get("max_abs_error", 0.0),
            max_rel_error=w.get("max_rel_error", 0.0),
            cosine=w.get("cosine", 0.0),
        ),
        detail=v.detail,
    )

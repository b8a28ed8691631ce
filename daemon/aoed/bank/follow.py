"""One bank across servers: send this bank's writes to its followers, and follow peers.

Each daemon keeps its own LMDB bank (lookups stay local, in microseconds) and follows the
banks of the peers in `[bank] follow`. Every record write in a bank takes the next
sequence number, in the transaction that writes it (`aoed.bank.store`), so "what this
bank wrote after N" is a range of its log:

  feed()      what FollowBank streams: the records whose latest write came after the
              follower's sequence number, page by page (one read transaction each),
              then waits on the writer for the next commit (no polling) and goes on
  Follower    one per peer, an agent in the daemon's nursery: reads the peer's
              FollowBank stream and applies each message in one write transaction with
              the import checks and the follow rule (`aoed.bank.exchange`), together
              with how far it got (`BankStore.apply`), so a crash at any point neither
              applies a write twice nor skips one; reconnects with backoff after a
              disconnect, a restart of either side, or a cut-off
  Follower.sync()
              one pass by hand (`aoe bank sync PEER`, SyncBank): up to the peer's head
              when the pass began, then return

Invariants:
- A follower's position is (the peer's bank id, the last sequence number applied). A
  peer whose bank is another one than the position's (replaced), or the same one behind
  the position (restored from a copy), is followed from its start: its numbers mean
  nothing here any more. Starting over costs a pass of "kept" records, nothing else.
- Merging is idempotent: a record already held byte for byte is not written and takes no
  sequence number, so A following B following A ends the echo after one round.
- The gRPC stream is read in a worker thread one message at a time, under the follower's
  own capacity limiter (a stream waiting for news holds no token others need);
  cancelling the follower cancels the call, which ends that thread's read.
- A peer's records are untrusted: each is checked as an import checks it, field by field
  against what this tuner writes (`vocabulary`, aoe.recordcheck), and kept by import's
  rule (`exchange.check_change`): one that is not a record this tuner writes is refused,
  counted (`refused`) and logged once with its key and the field at fault; every other
  is kept, whatever device it was measured on. Its key names that device, so it is
  served to daemons and clients on that device (this bank's followers among them) and
  never used for this daemon's own, and a server with other hardware can relay or back
  up a fleet's bank.
- Protobuf stays in `_codec` (and api/): the follower sees (seq, kind, key, value) only,
  whatever the kind of record, so a new kind flows through unchanged; a kind this
  bank does not keep is refused and counted, and the position still moves past it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import trio

from aoe.errors import AoedError, OptionError
from aoe.recordcheck import Vocabulary
from aoed.bank._codec import batch_from_pb
from aoed.bank.exchange import check_change, follow_replace
from aoed.bank.store import KINDS, Change, MergeCounts, Position, Record
from aoed.bank.writer import BankMerge, BankWriter
from aoed.logs import cut

__all__ = ["FEED_PAGE", "FollowBatch", "Follower", "SyncReport", "feed"]

log = logging.getLogger(__name__)

#: Records per FollowBank message (one read transaction each; about 1 MiB at most).
FEED_PAGE = 256
#: Seconds between reconnection attempts: the first, and the most (doubling between).
BACKOFF_S = (0.2, 30.0)

#: What opens a client to a peer target (aoe.client.Client with the TLS settings).
Connect = Callable[[str], Any]


@dataclass(frozen=True)
class FollowBatch:
    """One message of a bank's feed: `changes` in sequence order, covering every write up
    to `upto`; `head`, the bank's last sequence number when it was read."""

    bank_id: str
    changes: tuple[Change, ...]
    upto: int
    head: int


async def feed(
    writer: BankWriter, after: int, bank_id: str = ""
) -> AsyncGenerator[FollowBatch, None]:
    """This bank's writes after sequence number `after` of the bank `bank_id` (from the
    start when that is not this bank), page by page, then each new commit as it comes;
    never ends by itself. The first batch comes at once, empty when there is nothing to
    send, so that a follower learns the bank id and head. Raises BankError."""
    own = await writer.bank_id()
    if bank_id and bank_id != own:
        after = 0
    first = True
    while True:
        changes, upto, head = await writer.changes(after, FEED_PAGE)
        if changes or first:
            yield FollowBatch(own, tuple(changes), upto, head)
            first = False
        after = upto
        if upto >= head:
            await writer.wait_beyond(after)


@dataclass
class SyncReport:
    """What applying a peer's writes did: the peer's bank id, the sequence numbers
    applied before and after, counts per kind of record, and how many were refused."""

    peer_bank_id: str = ""
    from_seq: int = 0
    to_seq: int = 0
    counts: dict[str, MergeCounts] = field(
        default_factory=lambda: {kind: MergeCounts() for kind in KINDS}
    )
    refused: int = 0

    def add(self, counts: dict[str, MergeCounts], refused: int) -> None:
        for kind, c in counts.items():
            old = self.counts.get(kind, MergeCounts())
            self.counts[kind] = MergeCounts(
                old.added + c.added, old.updated + c.updated, old.kept + c.kept
            )
        self.refused += refused


class Follower:
    """Follows the bank of the daemon at `peer` (a gRPC target) into `writer`'s bank,
    applying the records the tuner of `vocabulary` could have written, each under its
    own device's key. `connect` opens an aoe.client.Client to the
    peer. The public attributes are for metrics:
    `applied` (the peer's last sequence number applied here), `head` (the peer's last
    known), `lag_s` (from the peer's commit of the last record applied to its commit
    here; the two clocks' difference included), `connected`, `refused`, `errors`."""

    def __init__(
        self,
        writer: BankWriter,
        peer: str,
        connect: Connect,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        self.peer = peer
        self._vocabulary = vocabulary
        self._writer = writer
        self._connect = connect
        self._limiter = trio.CapacityLimiter(1)
        self.applied = 0
        self.head = 0
        self.lag_s = 0.0
        self.connected = False
        self.refused = 0
        self.errors = 0
        self._said: set[str] = set()
        self._progressed = False

    @property
    def behind(self) -> int:
        """How many of the peer's sequence numbers are not applied here yet."""
        return max(0, self.head - self.applied)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the peer until cancelled, reconnecting with backoff (BACKOFF_S) after
        every failure; each failure is logged once per kind, not once per retry."""
        task_status.started()
        pause = BACKOFF_S[0]
        while True:
            self._progressed = False
            try:
                await self._follow()
            except AoedError as exc:
                self.errors += 1
                self._warn(f"bank: following {self.peer}: {exc}; retrying")
                if isinstance(exc, OptionError):  # a configuration problem: retrying is slow
                    pause = BACKOFF_S[1]
            finally:
                self.connected = False
            # A stream that delivered something was a working connection: start over, and
            # say the next failure again.
            if self._progressed:
                pause = BACKOFF_S[0]
                self._said.clear()
            await trio.sleep(pause)
            pause = min(pause * 2, BACKOFF_S[1])

    def _warn(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.warning("%s", message)

    async def sync(self) -> SyncReport:
        """Apply the peer's writes up to its head when the pass began, then return what
        was done. Raises AoedError (DaemonUnavailableError when the peer is not there,
        BankError from either bank)."""
        report = SyncReport()
        await self._follow(report=report, until_caught_up=True)
        return report

    async def _follow(
        self, *, report: SyncReport | None = None, until_caught_up: bool = False
    ) -> None:
        own = await self._writer.bank_id()
        pos = await self._writer.position(self.peer)
        client = self._connect(self.peer)
        stream: Any = None  # the open aoe.client.Stream (connect gives an untyped client)
        try:
            target: int | None = None
            opened = False
            while True:
                if not opened:
                    if stream is not None:
                        stream.cancel()
                    stream = client.bank_follow(pos.seq if pos else 0, pos.bank_id if pos else "")
                    opened, first = True, True
                msg = await trio.to_thread.run_sync(
                    _next_or_none, stream, abandon_on_cancel=True, limiter=self._limiter
                )
                if msg is None:
                    raise AoedError(f"{self.peer} ended its bank stream")
                bank_id, raw, upto, head = batch_from_pb(msg)
                if bank_id == own:
                    raise OptionError(
                        f"[bank] follow: {self.peer} is this daemon's own bank; remove it from the list"
                    )
                if pos is None or pos.bank_id != bank_id:
                    if pos is not None:
                        log.info(
                            "bank: %s holds another bank now (%s, was %s): following it from its start",
                            self.peer,
                            bank_id,
                            pos.bank_id,
                        )
                    pos = Position(bank_id, 0)
                elif first and head < pos.seq:
                    # The same bank, but behind what was applied here (restored from a copy):
                    # its next writes would take numbers already passed. Start it over.
                    log.info(
                        "bank: %s is at write %d, behind the %d applied here (restored?): following it "
                        "from its start",
                        self.peer,
                        head,
                        pos.seq,
                    )
                    pos, opened = Position(bank_id, 0), False
                    continue
                first = False
                if report is not None and target is None:
                    report.peer_bank_id, report.from_seq, target = bank_id, pos.seq, head
                self.connected = True
                self.head = max(head, upto)
                changes = [Change(*c) for c in raw]
                if changes or upto != pos.seq:
                    pos = await self._apply(pos, changes, upto, report)
                self.applied = pos.seq
                self._progressed = True
                if until_caught_up and target is not None and upto >= target:
                    if report is not None:
                        report.to_seq = pos.seq
                    return
        finally:
            if stream is not None:
                stream.cancel()
            client.close()

    async def _apply(
        self, pos: Position, changes: list[Change], upto: int, report: SyncReport | None
    ) -> Position:
        records: list[Record] = []
        refused = 0
        for change in changes:
            rec, why = check_change(change, self._vocabulary)
            if rec is None:
                refused += 1
                log.warning(
                    "bank: following %s: refused %s %s (seq %d): %s",
                    self.peer,
                    cut(change.kind, 40),
                    cut(change.key.decode("utf-8", "replace")),
                    change.seq,
                    cut(why, 300),
                )
            else:
                records.append(rec)
        new = Position(pos.bank_id, upto)
        counts = await self._writer.merge(BankMerge(tuple(records), follow_replace, self.peer, new))
        if changes:
            self.lag_s = max(0.0, (time.time_ns() - changes[-1].committed_ns) / 1e9)
        self.refused += refused
        if refused:
            self._warn(
                f"bank: following {self.peer}: some records were refused as not written by this "
                "tuner (each logged); the rest is applied"
            )
        if report is not None:
            report.add(counts, refused)
        return new


def _next_or_none(stream: Iterator[Any]) -> Any:
    """The stream's next message; None once it has ended."""
    return next(stream, None)

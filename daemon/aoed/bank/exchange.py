"""Bank exchange: merge JSON Lines (as `aoe bank export` writes them) under a policy.
The lines' format, and its converters, are the light client's `aoe.exchange`; this
module decides what of them a bank keeps.

One line per record, each an `aoe.v1.ExportEntriesResponse` (proto field names, sorted
keys), so an export is readable, diffable and greppable, and carries everything a bank
knows: `{"entry": ...}` (a winner), `{"default_record": ...}` (tuned, the default
stayed best; a model-level one lists the tasks a verification reverted in that model's
context) and `{"trial": ...}` (one measurement of the history). A bare BankEntry line,
as older exports wrote, is read as an entry.

A key holds an entry or a default record. Where an incoming one meets an existing one
(of either kind) under a policy:

  keep-faster    the faster record wins (an entry's winner median, a default record's
                 default_us; ties keep the existing)
  overwrite      the incoming record replaces the existing one
  keep-existing  an existing record is never replaced

Keys include the device digest, so two records under one key were measured on the same
device fingerprint and their times compare. A trial is added when the history does not
hold it yet (its key and time stamp), so importing a file twice adds nothing.
Provenance is stored as it arrives.

Import and follow keep a record by one rule (`aoed.bank._codec`'s checks, which give
the record as it is stored and why it cannot be, or ""): it is kept when it is one this
tuner writes, whatever device it was measured on. The device decides where a record is
served, never whether it is kept: every key names its device's digest, so a lookup, a
compile or a tune for this machine's device never meets another device's record, while
a daemon on that device (following this bank, or looking up with its digest) finds it
here. So a server with other hardware can relay and back up a fleet's bank.

Every record from outside is untrusted: each field is checked against what this tuner
writes (aoe.recordcheck, with the strategy names of its registry: a `Vocabulary`), and
a record that is not one it could have written is refused whole, named in the report
and logged once with its key and the field at fault.

Following a peer (`aoed.bank.follow`) merges what the peer's log sends by the same
rule, and with one replacement rule that is a total order, so that banks
following each other converge to the same record under every key whatever the order
their writes arrive in (`follow_replace`): the faster record wins, as keep-faster says;
at equal times an entry wins over a default record, then the smaller stored bytes (the
same on every daemon, since each holds the bytes as measured). A bank that keeps its
own record against a worse one sends it back to its followers (`BankStore.apply`), so
a decision made worse by a local write elsewhere is corrected there too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from aoe.errors import OptionError
from aoe.recordcheck import Vocabulary
from aoed.bank._codec import check_stored, default_us, parse_line, winner_us
from aoed.bank.store import DEFAULT, ENTRY, KINDS, TRIAL, BankStore, Change, MergeCounts, Record
from aoed.logs import cut

__all__ = ["POLICIES", "ImportReport", "check_change", "follow_replace", "import_lines"]

log = logging.getLogger(__name__)

POLICIES = ("keep-faster", "overwrite", "keep-existing")
#: Refused records of one import logged one by one; the rest are counted in one line.
LOG_REFUSED = 1000


@dataclass
class ImportReport:
    """What an import did, per kind of record ("entry", "default", "trial")."""

    counts: dict[str, MergeCounts] = field(
        default_factory=lambda: {kind: MergeCounts() for kind in KINDS}
    )
    refused: list[tuple[str, str]] = field(default_factory=list)  # (key or line, reason)

    @property
    def added(self) -> int:
        return sum(c.added for c in self.counts.values())

    @property
    def updated(self) -> int:
        return sum(c.updated for c in self.counts.values())

    @property
    def kept(self) -> int:
        return sum(c.kept for c in self.counts.values())


def _time_us(rec: Record) -> float:
    return winner_us(rec.value) if rec.kind == ENTRY else default_us(rec.value)


def _replace(policy: str) -> Callable[[Record, Record], bool]:
    if policy == "overwrite":
        return lambda old, new: True
    if policy == "keep-existing":
        return lambda old, new: False
    if policy == "keep-faster":
        return lambda old, new: _time_us(new) < _time_us(old)
    raise OptionError(f"--policy {policy}: expected one of {', '.join(POLICIES)}")


def _label(rec: Record, n: int) -> str:
    if not rec.key:
        return f"line {n}"
    if rec.kind == TRIAL:
        return f"trial {rec.key.decode()}"
    return f"default record {rec.key.decode()}" if rec.kind == DEFAULT else rec.key.decode()


def import_lines(
    store: BankStore,
    lines: Iterable[str],
    policy: str = "keep-faster",
    vocabulary: Vocabulary | None = None,
) -> ImportReport:
    """Merge the JSON Lines `lines` into `store` under `policy`; returns what happened.

    Blank lines are skipped; a line that is not a record the tuner of `vocabulary`
    writes (aoe.recordcheck; without one, strategy names are checked for their shape
    and no GDAT knob is taken) is refused, reported and logged; every other record is
    kept, whatever device it was measured on.
    Raises OptionError for an unknown policy, BankError when the store fails.
    """
    replace = _replace(policy)
    report = ImportReport()
    invalid = 0

    def accepted() -> Iterator[Record]:
        nonlocal invalid
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            rec, why = parse_line(line, vocabulary)
            if why:
                _log_invalid("import", _label(rec, n), why, invalid)
                invalid += 1
                report.refused.append((_label(rec, n), why))
            else:
                yield rec

    report.counts = store.merge(accepted(), replace)
    if invalid > LOG_REFUSED:
        log.warning(
            "bank: import: %d more records refused as not written by this tuner (not logged)",
            invalid - LOG_REFUSED,
        )
    return report


def _log_invalid(source: str, label: str, why: str, n: int = 0) -> None:
    """Say once that a record from `source` was refused as one this tuner never writes
    (up to LOG_REFUSED per import; the logs' formatter escapes what the record named)."""
    if n < LOG_REFUSED:
        log.warning("bank: %s: refused %s: %s", source, cut(label), cut(why, 300))


def _rank(rec: Record) -> tuple[float, bool, bytes]:
    return _time_us(rec), rec.kind != ENTRY, rec.value


def follow_replace(old: Record, new: Record) -> bool:
    """Whether `new` replaces `old` under one key when banks follow each other: the
    total order of the module doc (smaller rank wins)."""
    return _rank(new) < _rank(old)


def check_change(change: Change, vocabulary: Vocabulary | None = None) -> tuple[Record | None, str]:
    """(the record to merge, "") for a change a followed peer sent, or (None, why it is
    not a record the tuner of `vocabulary` writes): the rule import applies."""
    why = check_stored(change.kind, change.key, change.value, vocabulary)
    # The change's own bytes under its own key: what the peer holds is what is kept.
    return (None, why) if why else (Record(change.kind, change.key, change.value), "")

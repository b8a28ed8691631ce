"""The checks of records from outside before they are merged: exchange lines (an
`aoe.v1.ExportEntriesResponse` as JSON, `aoe.exchange`) and records another bank stores
(what a followed peer sends); and the few reads of stored bytes the merge rules need.

Each check gives the record as this bank stores it (`aoed.bank.store.Record`) with why
it cannot be merged, or "" when it can: one shape for what is merged, whatever it came
from (the shapes of a bank record are told in `aoe.bankrecord`).

The only module (with api/) where protobuf types appear on the daemon side.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable

from google.protobuf.message import DecodeError

from aoe.bank import parse_key
from aoe.exchange import default_doc, default_record, record_from_json, trial_record
from aoe.keys import PRECISION_CODES, PRECISION_NAMES, SCHEMA_VERSION, bank_key, history_key
from aoe.recordcheck import (
    MAX_TRIAL_JSON,
    RecordError,
    Vocabulary,
    check_default,
    check_default_doc,
    check_entry,
    check_trial,
    loads,
)
from aoe.v1 import bank_pb2
from aoed.bank.store import DEFAULT, ENTRY, TRIAL, Record, encode_doc

__all__ = [
    "Checked",
    "batch_from_pb",
    "check_stored",
    "default_us",
    "parse_line",
    "winner_us",
]

#: A record from outside as this bank would store it (a trial under its history key),
#: and why it cannot be merged ("" when it can).
Checked = tuple[Record, str]

#: What an unreadable line stands for in a refusal: no kind, no key.
_NOTHING = Record("", b"", b"")

_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("ascii", "replace")).hexdigest()


def _key_problem(key: str) -> str:
    """Why `key` is not a key of this bank's schema, or ""."""
    try:
        schema, sig32, dev32, precision = parse_key(key)
    except ValueError as exc:
        return str(exc)
    if schema != SCHEMA_VERSION:
        return f"schema version {schema}, this bank uses {SCHEMA_VERSION}"
    if not (_HEX32.fullmatch(sig32) and _HEX32.fullmatch(dev32)):
        return "key digests are not 32 lowercase hex digits"
    if precision not in PRECISION_CODES:
        return f"unknown precision {precision!r}"
    return ""


def _then(problem: str, check: Callable[[], object]) -> str:
    """`problem`, or when there is none yet, `check()`'s RecordError ("" without one)."""
    if problem:
        return problem
    try:
        check()
    except RecordError as exc:
        return str(exc)
    return ""


def parse_line(line: str, vocabulary: Vocabulary | None = None) -> Checked:
    """Parse and check one JSON Lines record, each field against what the tuner of
    `vocabulary` writes (aoe.recordcheck): the record to store and why it cannot be
    imported ("" when it can; an unreadable line has no kind and no key)."""
    try:
        msg = record_from_json(line)
    except ValueError as exc:
        return _NOTHING, f"not a bank record ({exc})"
    which = msg.WhichOneof("record")
    if which == "default_record":
        return _default(msg.default_record)
    if which == "trial":
        return _trial(msg.trial)
    if which != "entry":
        return _NOTHING, "not a bank record (no entry, default_record or trial)"
    return _entry(msg.entry, vocabulary)


def _default(rec: bank_pb2.DefaultRecord) -> Checked:
    problem = _key_problem(rec.key)
    if not problem and not rec.default_us > 0:
        problem = "no default timing"
    if not problem and not all(_HEX64.fullmatch(d) for d in rec.reverted):
        problem = "a reverted task is not a 64-digit signature digest"
    stored = Record(DEFAULT, rec.key.encode(), encode_doc(default_doc(rec)))
    return stored, _then(problem, lambda: check_default(rec))


def _trial(rec: bank_pb2.TrialRecord) -> Checked:
    problem = _key_problem(rec.key)
    if not problem and not rec.time_ns:
        problem = "no time stamp"
    if not problem:
        try:
            if not isinstance(loads(rec.trial_json, "trial_json", MAX_TRIAL_JSON), dict):
                problem = "trial is not a JSON object"
        except RecordError as exc:
            problem = f"trial is not JSON ({exc.reason})"
    # Stored as it came: the exporting bank wrote it as encode_doc does.
    stored = Record(TRIAL, history_key(rec.key.encode(), rec.time_ns), rec.trial_json.encode())
    return stored, _then(problem, lambda: check_trial(rec))


def _entry(e: bank_pb2.BankEntry, vocabulary: Vocabulary | None = None) -> Checked:
    key = e.key.encode()
    problem = ""
    precision = PRECISION_NAMES.get(e.strategy.precision)
    if e.schema_version != SCHEMA_VERSION:
        problem = f"schema version {e.schema_version}, this bank uses {SCHEMA_VERSION}"
    elif precision is None:
        problem = "no precision"
    elif not e.strategy.name:
        problem = "strategy.name: no strategy"
    elif not e.winner.median_us > 0:
        problem = f"winner.median_us: {e.winner.median_us!r}, no winner timing"
    elif _sha256(e.signature.canonical_json) != e.signature.digest:
        problem = "signature digest does not match its canonical JSON"
    elif _sha256(e.device.canonical_json) != e.device.digest:
        problem = "device digest does not match its canonical JSON"
    elif key != bank_key(e.signature.digest, e.device.digest, precision):
        problem = "key does not match the entry's signature, device and precision"
    stored = Record(ENTRY, key, e.SerializeToString(deterministic=True))
    return stored, _then(problem, lambda: check_entry(e, vocabulary))


def check_stored(kind: str, key: bytes, value: bytes, vocabulary: Vocabulary | None = None) -> str:
    """Why a record as another bank stores it (`kind` "entry", "default" or "trial"; a
    trial under its history key) cannot be merged here, with the checks of an exchange
    line; "" when it can (as it is, byte for byte)."""
    try:
        if kind == ENTRY:
            stored, problem = _entry(bank_pb2.BankEntry.FromString(value), vocabulary)
            if not problem and stored.key != key:
                problem = "stored under another key than its own"
            return problem
        if kind == DEFAULT:
            doc = loads(value, "default record", MAX_TRIAL_JSON)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            check_default_doc(doc)
            return _default(default_record(key, doc))[1]
        if kind == TRIAL:
            return _trial(trial_record(key, value))[1]
    except (ValueError, TypeError, UnicodeDecodeError, DecodeError) as exc:
        return f"not a stored {kind} record ({exc})"
    return f"a kind of record this bank does not keep ({kind!r})"


def batch_from_pb(
    msg: bank_pb2.FollowBankResponse,
) -> tuple[str, list[tuple[int, str, bytes, bytes, int]], int, int]:
    """(bank id, changes as (seq, kind, key, value, committed ns), upto, head) of one
    FollowBank message (`aoed.bank.store.Change`'s fields, in order)."""
    changes = [(c.seq, c.kind, c.key, c.value, c.committed_unix_ns) for c in msg.changes]
    return msg.bank_id, changes, msg.upto_seq, msg.head_seq


def default_us(data: bytes) -> float:
    """Median time of the default of a stored default record (inf when it has none, so
    that any timed record is faster)."""
    try:
        doc = json.loads(data)
        value = float(doc.get("default_us") or 0.0) if isinstance(doc, dict) else 0.0
    except (ValueError, TypeError):
        value = 0.0
    return value if value > 0 else float("inf")


def winner_us(data: bytes) -> float:
    """Median time of the winner of a serialized entry."""
    return bank_pb2.BankEntry.FromString(data).winner.median_us

"""Translation between the engine's bank records and what the bank stores: `aoe.v1.BankEntry`
bytes for entries, JSON documents for default records and trials; and the checks of
exchange lines (`aoe.v1.ExportEntriesResponse` as JSON) before they are merged.

The only module (with api/) where protobuf types appear on the daemon side.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError

from aoe.bank import (
    default_doc,
    default_record,
    parse_key,
    record_from_json,
)
from aoe.keys import PRECISION_CODES, PRECISION_NAMES, SCHEMA_VERSION, bank_key
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

__all__ = [
    "Incoming",
    "batch_from_pb",
    "check_stored",
    "default_us",
    "encode_doc",
    "parse_line",
    "winner_us",
]


def encode_doc(doc: dict[str, Any]) -> bytes:
    """The stored form of a default record or a trial: JSON with sorted keys, so that
    equal documents store equal bytes."""
    return json.dumps(doc, sort_keys=True).encode()


# --------------------------------------------------------------------------- exchange


@dataclass(frozen=True)
class Incoming:
    """One exchange line, checked: the record to merge, or why it cannot be merged.

    `kind` is "entry", "default" or "trial" ("" when the line is unreadable); `data` is
    what the bank stores for it (entry bytes, default or trial JSON). `device_digest` is
    the entry's full device digest, or the device part (32 hex) of a default record's
    or trial's key; the device fields after it are known for entries only."""

    kind: str
    key: bytes
    data: bytes
    device_digest: str
    time_ns: int = 0  # trials: when recorded (their history key)
    time_us: float = 0.0  # entries: the winner median; default records: default_us
    execution_provider: str = ""
    device_options: dict[str, str] = field(default_factory=dict)
    hardware: str = ""
    runtime_version: str = ""
    problem: str = ""


_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("ascii", "replace")).hexdigest()


def _key_problem(key: str) -> tuple[str, str]:
    """(why `key` is not a key of this bank's schema or "", its device part)."""
    try:
        schema, sig32, dev32, precision = parse_key(key)
    except ValueError as exc:
        return str(exc), ""
    if schema != SCHEMA_VERSION:
        return f"schema version {schema}, this bank uses {SCHEMA_VERSION}", dev32
    if not (_HEX32.fullmatch(sig32) and _HEX32.fullmatch(dev32)):
        return "key digests are not 32 lowercase hex digits", dev32
    if precision not in PRECISION_CODES:
        return f"unknown precision {precision!r}", dev32
    return "", dev32


def parse_line(line: str, vocabulary: Vocabulary | None = None) -> Incoming:
    """Parse and check one JSON Lines record, each field against what the tuner of
    `vocabulary` writes (aoe.recordcheck); `problem` says why it cannot be imported."""
    try:
        msg = record_from_json(line)
    except ValueError as exc:
        return Incoming("", b"", b"", "", problem=f"not a bank record ({exc})")
    which = msg.WhichOneof("record")
    if which == "default_record":
        return _parse_default(msg.default_record)
    if which == "trial":
        return _parse_trial(msg.trial)
    if which != "entry":
        return Incoming(
            "", b"", b"", "", problem="not a bank record (no entry, default_record or trial)"
        )
    return _parse_entry(msg.entry, vocabulary)


def _checked(inc: Incoming, check: Callable[[], object]) -> Incoming:
    """`inc` with `check()`'s RecordError as its problem (when it has none yet)."""
    if inc.problem:
        return inc
    try:
        check()
    except RecordError as exc:
        return dataclasses.replace(inc, problem=str(exc))
    return inc


def _parse_default(rec: bank_pb2.DefaultRecord) -> Incoming:
    problem, dev32 = _key_problem(rec.key)
    if not problem and not rec.default_us > 0:
        problem = "no default timing"
    if not problem and not all(_HEX64.fullmatch(d) for d in rec.reverted):
        problem = "a reverted task is not a 64-digit signature digest"
    data = encode_doc(default_doc(rec))
    inc = Incoming(
        "default", rec.key.encode(), data, dev32, time_us=rec.default_us, problem=problem
    )
    return _checked(inc, lambda: check_default(rec))


def _parse_trial(rec: bank_pb2.TrialRecord) -> Incoming:
    problem, dev32 = _key_problem(rec.key)
    if not problem and not rec.time_ns:
        problem = "no time stamp"
    if not problem:
        try:
            if not isinstance(loads(rec.trial_json, "trial_json", MAX_TRIAL_JSON), dict):
                problem = "trial is not a JSON object"
        except RecordError as exc:
            problem = f"trial is not JSON ({exc.reason})"
    # Stored as it came: the exporting bank wrote it as encode_doc does.
    inc = Incoming(
        "trial",
        rec.key.encode(),
        rec.trial_json.encode(),
        dev32,
        time_ns=rec.time_ns,
        problem=problem,
    )
    return _checked(inc, lambda: check_trial(rec))


def _parse_entry(e: bank_pb2.BankEntry, vocabulary: Vocabulary | None = None) -> Incoming:
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
    if not problem:
        try:
            check_entry(e, vocabulary)
        except RecordError as exc:
            problem = str(exc)
    try:
        doc = json.loads(e.device.canonical_json) if not problem else {}
        options = doc.get("options", {}) if isinstance(doc, dict) else {}
    except ValueError:
        options = {}
    return Incoming(
        kind="entry",
        key=key,
        data=e.SerializeToString(deterministic=True),
        device_digest=e.device.digest,
        time_us=e.winner.median_us,
        execution_provider=e.device.execution_provider,
        device_options=options,
        hardware=e.device.hardware,
        runtime_version=e.device.runtime_version,
        problem=problem,
    )


def check_stored(
    kind: str, key: bytes, value: bytes, vocabulary: Vocabulary | None = None
) -> Incoming:
    """Check a record as another bank stores it (`kind` "entry", "default" or "trial";
    a trial under its history key) with the checks of an exchange line; `problem` says
    why it cannot be merged. `data` is `value`, kept byte for byte."""
    try:
        if kind == "entry":
            inc = _parse_entry(bank_pb2.BankEntry.FromString(value), vocabulary)
            if not inc.problem and inc.key != key:
                inc = dataclasses.replace(inc, problem="stored under another key than its own")
        elif kind == "default":
            doc = loads(value, "default record", MAX_TRIAL_JSON)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            check_default_doc(doc)
            inc = _parse_default(default_record(key, doc))
        elif kind == "trial":
            bank, _, stamp = key.decode("ascii").rpartition("/")
            inc = _parse_trial(
                bank_pb2.TrialRecord(key=bank, time_ns=int(stamp, 16), trial_json=value.decode())
            )
        else:
            return Incoming(
                "", key, value, "", problem=f"a kind of record this bank does not keep ({kind!r})"
            )
    except (ValueError, TypeError, UnicodeDecodeError, DecodeError) as exc:
        return Incoming(kind, key, value, "", problem=f"not a stored {kind} record ({exc})")
    return dataclasses.replace(inc, data=value)


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

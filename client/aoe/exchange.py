"""The bank's exchange format: JSON Lines of records, as `aoe bank export` writes them and
`aoe bank import`, ImportEntries and `aoed.bank.exchange` read them.

One line per record, each an `aoe.v1.ExportEntriesResponse` with proto field names and
sorted keys (`record_to_json` / `record_from_json`): `{"entry": {...}}` (a winner),
`{"default_record": {...}}` (tuned, the default stayed best) or `{"trial": {...}}` (one
measurement of the history). A bare BankEntry line, as exports before default records
and trials wrote, is read as an entry.

Beside the lines, the converters between a stored record and the message it is
exchanged as, where the two differ: a default record's stored JSON document and its
`DefaultRecord` (`default_record` / `default_doc`), a trial's history key and JSON and its
`TrialRecord` (`trial_record`). An entry is stored as its `BankEntry` bytes already.
Which shape of a record is for what is told once, in `aoe.bankrecord`.

Light: json, protobuf and `aoe.recordcheck` (which bounds a line's size and nesting
before it is parsed: a line is untrusted input); no lmdb, no onnx, no grpc, so the gRPC
client and the bank reader share it.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format

from aoe.keys import parse_history_key
from aoe.recordcheck import MAX_LINE, RecordError, loads
from aoe.v1 import bank_pb2

__all__ = [
    "RECORD_FIELDS",
    "default_doc",
    "default_record",
    "entry_from_json",
    "entry_to_json",
    "exported_trial",
    "record_from_json",
    "record_to_json",
    "trial_record",
]

#: The record kinds of the exchange format: the fields of ExportEntriesResponse's oneof.
RECORD_FIELDS = ("entry", "default_record", "trial")
_RECORD_KINDS = frozenset(RECORD_FIELDS)


def _line(msg: bank_pb2.BankEntry | bank_pb2.ExportEntriesResponse) -> str:
    doc = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def entry_to_json(entry: bank_pb2.BankEntry) -> str:
    """One line of JSON for `entry` (proto field names, sorted keys): the exchange format."""
    return _line(entry)


def entry_from_json(line: str) -> bank_pb2.BankEntry:
    """Parse one bare BankEntry line; raises ValueError with the parser's reason."""
    try:
        return json_format.Parse(line, bank_pb2.BankEntry())
    except json_format.ParseError as exc:
        raise ValueError(str(exc)) from None


def record_to_json(record: bank_pb2.ExportEntriesResponse) -> str:
    """One line of the exchange format: `{"entry": {...}}`, `{"default_record": {...}}`
    or `{"trial": {...}}` (proto field names, sorted keys)."""
    return _line(record)


def record_from_json(line: str) -> bank_pb2.ExportEntriesResponse:
    """Parse one exchange line into an ExportEntriesResponse; a bare BankEntry line (as
    exports before default records and trials wrote) comes back as its `entry`. The
    line's size and nesting are bounded before it is parsed. Raises ValueError with the
    parser's reason."""
    try:
        doc = loads(line, "line", MAX_LINE)
    except RecordError as exc:
        raise ValueError(exc.reason) from None
    if isinstance(doc, dict) and doc and doc.keys() <= _RECORD_KINDS:
        try:
            return json_format.ParseDict(doc, bank_pb2.ExportEntriesResponse())
        except json_format.ParseError as exc:
            raise ValueError(str(exc)) from None
    return bank_pb2.ExportEntriesResponse(entry=entry_from_json(line))


def default_record(key: bytes | str, doc: dict[str, Any]) -> bank_pb2.DefaultRecord:
    """The DefaultRecord of a "default stays best" document as the bank stores it:
    `{"default_us": 12.3, "job": "...", "reverted": [digests], "confirmed": "{...}"}`
    (all but default_us optional). Other fields of the document are not part of the record."""
    rec = bank_pb2.DefaultRecord(key=key.decode() if isinstance(key, bytes) else key)
    rec.default_us = float(doc.get("default_us") or 0.0)
    rec.reverted.extend(str(d) for d in doc.get("reverted") or ())
    rec.job_id = str(doc.get("job") or "")
    rec.confirmed = str(doc.get("confirmed") or "")
    return rec


def default_doc(rec: bank_pb2.DefaultRecord) -> dict[str, Any]:
    """The document the bank stores for `rec` (the inverse of `default_record`; an empty
    `reverted` list is left out, which readers take as none)."""
    doc: dict[str, Any] = {"default_us": rec.default_us}
    if rec.job_id:
        doc["job"] = rec.job_id
    if rec.reverted:
        doc["reverted"] = list(rec.reverted)
    if rec.confirmed:
        doc["confirmed"] = rec.confirmed
    return doc


def trial_record(key: bytes, value: bytes) -> bank_pb2.TrialRecord:
    """The TrialRecord of a trial the bank stores under its history key `key` (see
    `aoe.keys.history_key`) as the JSON `value`. Raises ValueError (UnicodeDecodeError
    among them) when `key` is not a history key or `value` is not text."""
    bank, time_ns = parse_history_key(key)
    return bank_pb2.TrialRecord(key=bank.decode(), time_ns=time_ns, trial_json=value.decode())


def exported_trial(key: bytes, value: bytes) -> bank_pb2.TrialRecord:
    """`trial_record`, as an export writes it: a key that is not a history key aoed wrote
    travels whole (with no time stamp), for the importing side to refuse, saying so."""
    try:
        return trial_record(key, value)
    except ValueError:
        return bank_pb2.TrialRecord(key=key.decode("ascii", "replace"), trial_json=value.decode())

"""`BankRecord`: the bank's main domain type (one task's decision on one device: its
strategy, the winner's and the default's statistics, accuracy, provenance), and its
stored form, `aoe.v1.BankEntry` bytes (`encode` / `decode`).

Public and light (protobuf only: no onnx, no lmdb): the daemon's bank writer and
engine, `aoe compile` and any reader of a bank use these; the bank's keys are
`aoe.keys.bank_key`.

The shapes of a bank record, each for one purpose, and where each conversion lives:

  BankRecord (here)            an entry as the engine decides it and the writer, the
                               compiler and bank rules read it: typed, no protobuf.
  BankEntry bytes              an entry as it is stored (the `entries` database) and
  (aoe.v1)                     sent (LookupEntry, QueryEntries): `encode` / `decode`
                               here; the reader (`aoe.bank`) hands out the message.
  JSON document                a default record or a trial as it is stored (the
                               `defaults` and `history` databases; written by
                               `aoed.bank.store.encode_doc`).
  JSON line of an              any record as it is exchanged (`aoe bank export` and
  ExportEntriesResponse        import, ExportEntries and ImportEntries): `aoe.exchange`,
                               which also converts a stored default record or trial to
                               its message and back (`default_record` / `default_doc`,
                               `trial_record`).
  Record (aoed.bank.store)     any record as the store merges it: kind, key (a trial's
                               history key), stored bytes. `aoed.bank._codec` turns an
                               exchange line (`parse_line`) or a peer's stored record
                               (`check_stored`) into one, with why it may not be merged.
  Change (aoed.bank.store)     a Record with its place in the bank's log (sequence
                               number, commit time): what FollowBank carries
                               (`_codec.batch_from_pb` at the wire).

A record from outside is checked field by field in `aoe.recordcheck` before it becomes
a Record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aoe.keys import (
    PRECISION_CODES,
    PRECISION_NAMES,
    SCHEMA_VERSION,
    DeviceFingerprint,
    TaskSignature,
)
from aoe.v1 import bank_pb2

__all__ = ["BankRecord", "Measured", "decode", "encode"]


@dataclass(frozen=True)
class Measured:
    median_us: float
    spread: float
    repeats: int
    min_us: float


@dataclass(frozen=True)
class BankRecord:
    key: bytes
    signature: TaskSignature
    device: DeviceFingerprint
    strategy: str
    family: str
    precision: str
    winner: Measured
    baseline: Measured
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    cosine: float = 1.0
    params: dict[str, str] = field(default_factory=dict)
    host: str = ""
    aoed_version: str = ""
    created_unix: float = 0.0
    job_id: str = ""
    model: str = ""


def _stats(msg: bank_pb2.Stats, m: Measured) -> None:
    msg.median_us = m.median_us
    msg.spread = m.spread
    msg.repeats = m.repeats
    msg.min_us = m.min_us


def encode(r: BankRecord) -> bytes:
    e = bank_pb2.BankEntry(schema_version=SCHEMA_VERSION, key=r.key.decode())
    e.signature.op_type = r.signature.op_type
    e.signature.domain = r.signature.domain
    e.signature.opset = r.signature.opset
    e.signature.canonical_json = r.signature.canonical_json
    e.signature.digest = r.signature.digest
    d = r.device
    e.device.execution_provider = d.execution_provider
    e.device.hardware = d.hardware
    e.device.isa_flags.extend(d.isa_flags)
    e.device.runtime_version = d.runtime_version
    e.device.canonical_json = d.canonical_json
    e.device.digest = d.digest
    e.strategy.name = r.strategy
    e.strategy.family = r.family
    e.strategy.precision = PRECISION_CODES[r.precision]
    e.strategy.params.update(r.params)
    _stats(e.winner, r.winner)
    _stats(e.baseline, r.baseline)
    e.accuracy.max_abs_error = r.max_abs_error
    e.accuracy.max_rel_error = r.max_rel_error
    e.accuracy.cosine = r.cosine
    p = e.provenance
    p.host = r.host
    p.aoed_version = r.aoed_version
    p.onnxruntime_version = d.runtime_version
    p.created.FromNanoseconds(int(r.created_unix * 1e9))
    p.job_id = r.job_id
    p.model = r.model
    return e.SerializeToString(deterministic=True)


def _measured(msg: bank_pb2.Stats) -> Measured:
    return Measured(msg.median_us, msg.spread, msg.repeats, msg.min_us)


def decode(data: bytes) -> BankRecord:
    """The record of stored entry bytes; ValueError (aoe.recordcheck.RecordError) when
    its device's canonical JSON is not a bounded JSON object."""
    from aoe.recordcheck import MAX_DEVICE_JSON, RecordError, loads

    e = bank_pb2.BankEntry.FromString(data)
    s, d = e.signature, e.device
    device = (
        loads(d.canonical_json, "device.canonical_json", MAX_DEVICE_JSON)
        if d.canonical_json
        else {}
    )
    if not isinstance(device, dict):
        raise RecordError("device.canonical_json", "not a JSON object")
    return BankRecord(
        key=e.key.encode(),
        signature=TaskSignature(s.op_type, s.domain, s.opset, s.canonical_json, s.digest),
        device=DeviceFingerprint(
            d.execution_provider,
            d.hardware,
            tuple(d.isa_flags),
            d.runtime_version,
            device.get("options", {}),
            d.canonical_json,
            d.digest,
            device.get("accelerator", {}),
        ),
        strategy=e.strategy.name,
        family=e.strategy.family,
        precision=PRECISION_NAMES.get(e.strategy.precision, "exact"),
        winner=_measured(e.winner),
        baseline=_measured(e.baseline),
        max_abs_error=e.accuracy.max_abs_error,
        max_rel_error=e.accuracy.max_rel_error,
        cosine=e.accuracy.cosine,
        params=dict(e.strategy.params),
        host=e.provenance.host,
        aoed_version=e.provenance.aoed_version,
        created_unix=e.provenance.created.ToNanoseconds() / 1e9,
        job_id=e.provenance.job_id,
        model=e.provenance.model,
    )

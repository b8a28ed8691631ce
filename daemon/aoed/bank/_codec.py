"""Translation between the engine's bank records and `aoe.v1.BankEntry` bytes.

The only module (with api/) where protobuf types appear on the daemon side.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from aoe.bank import entry_from_json
from aoe.signature import SCHEMA_VERSION, DeviceFingerprint, TaskSignature, bank_key
from aoe.v1 import bank_pb2

__all__ = ["BankRecord", "Incoming", "Measured", "decode", "encode", "parse_line", "winner_us"]

_PRECISION = {
    "exact": bank_pb2.PRECISION_EXACT,
    "int8": bank_pb2.PRECISION_INT8,
    "int4": bank_pb2.PRECISION_INT4,
    "fp16": bank_pb2.PRECISION_FP16,
    "bf16": bank_pb2.PRECISION_BF16,
}
_PRECISION_NAME = {v: k for k, v in _PRECISION.items()}


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
    e.strategy.precision = _PRECISION[r.precision]
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
    e = bank_pb2.BankEntry.FromString(data)
    s, d = e.signature, e.device
    return BankRecord(
        key=e.key.encode(),
        signature=TaskSignature(s.op_type, s.domain, s.opset, s.canonical_json, s.digest),
        device=DeviceFingerprint(
            d.execution_provider, d.hardware, tuple(d.isa_flags), d.runtime_version,
            json.loads(d.canonical_json).get("options", {}) if d.canonical_json else {},
            d.canonical_json, d.digest,
        ),
        strategy=e.strategy.name,
        family=e.strategy.family,
        precision=_PRECISION_NAME.get(e.strategy.precision, "exact"),
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


# --------------------------------------------------------------------------- exchange


@dataclass(frozen=True)
class Incoming:
    """One exchange line, checked: what a merge needs, or why it is refused."""

    key: bytes
    data: bytes  # deterministic serialization of the entry, provenance untouched
    device_digest: str
    execution_provider: str
    device_options: dict[str, str]
    hardware: str
    runtime_version: str
    problem: str = ""


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("ascii", "replace")).hexdigest()


def parse_line(line: str) -> Incoming:
    """Parse and check one JSON Lines entry; `problem` says why it cannot be imported."""
    try:
        e = entry_from_json(line)
    except ValueError as exc:
        return Incoming(b"", b"", "", "", {}, "", "", f"not a BankEntry ({exc})")
    key = e.key.encode()
    problem = ""
    precision = _PRECISION_NAME.get(e.strategy.precision)
    if e.schema_version != SCHEMA_VERSION:
        problem = f"schema version {e.schema_version}, this bank uses {SCHEMA_VERSION}"
    elif precision is None:
        problem = "no precision"
    elif not e.strategy.name:
        problem = "no strategy"
    elif not e.winner.median_us > 0:
        problem = "no winner timing"
    elif _sha256(e.signature.canonical_json) != e.signature.digest:
        problem = "signature digest does not match its canonical JSON"
    elif _sha256(e.device.canonical_json) != e.device.digest:
        problem = "device digest does not match its canonical JSON"
    elif key != bank_key(e.signature.digest, e.device.digest, precision):
        problem = "key does not match the entry's signature, device and precision"
    try:
        options = json.loads(e.device.canonical_json).get("options", {}) if e.device.canonical_json else {}
    except ValueError:
        options = {}
    return Incoming(
        key=key,
        data=e.SerializeToString(deterministic=True),
        device_digest=e.device.digest,
        execution_provider=e.device.execution_provider,
        device_options=options,
        hardware=e.device.hardware,
        runtime_version=e.device.runtime_version,
        problem=problem,
    )


def winner_us(data: bytes) -> float:
    """Median time of the winner of a serialized entry."""
    return bank_pb2.BankEntry.FromString(data).winner.median_us


"""What a bank key is made of, and the values stored under one: `bank_key`, the
`TaskSignature` and `DeviceFingerprint` it names, the one JSON spelling and digest both
are named by (`canonical_json`, `digest`), the precision policies' names and their codes
in `aoe.v1.Precision` (the one table: the bank's codec, its records, the record checks
and the API's edge all read it).

Light on purpose: the standard library, msgspec and protobuf's generated `aoe.v1.bank_pb2`
only (no onnx, no lmdb), so `aoe.bankrecord` and `aoe.recordcheck` stay as light as they
say. The values are msgspec Structs: they cross processes inside the engine's messages,
which refuse a field they do not know (aoed.engine.messages).
How a signature is computed is `aoe.signature`'s, a fingerprint `aoe.fingerprint`'s.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import msgspec

from aoe.v1 import bank_pb2

__all__ = [
    "PRECISION_CODES",
    "PRECISION_NAMES",
    "SCHEMA_VERSION",
    "DeviceFingerprint",
    "TaskSignature",
    "bank_key",
    "canonical_json",
    "digest",
    "history_key",
    "parse_history_key",
]

#: Version of the signature/key layout; part of every bank key.
SCHEMA_VERSION = 1

#: Precision policy names (a bank key's last part) and their code in aoe.v1.Precision.
#: A job's precisions (aoe.spec.Precision) are these but `lowrank`, a gradient precision.
PRECISION_CODES: Mapping[str, bank_pb2.Precision] = {
    "exact": bank_pb2.PRECISION_EXACT,
    "int8": bank_pb2.PRECISION_INT8,
    "int4": bank_pb2.PRECISION_INT4,
    "fp16": bank_pb2.PRECISION_FP16,
    "bf16": bank_pb2.PRECISION_BF16,
    "lowrank": bank_pb2.PRECISION_LOWRANK,
}
#: The code -> name direction of PRECISION_CODES.
PRECISION_NAMES: Mapping[int, str] = {code: name for name, code in PRECISION_CODES.items()}


def canonical_json(obj: object) -> str:
    """Return the one JSON spelling of `obj`: sorted keys, no spaces, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def digest(text: str) -> str:
    """The digest a signature or a fingerprint is named by: SHA-256 of its canonical JSON
    (ASCII), in hex."""
    return hashlib.sha256(text.encode("ascii")).hexdigest()


class TaskSignature(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op_type: str
    domain: str
    opset: int
    canonical_json: str
    digest: str


class DeviceFingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    execution_provider: str
    hardware: str
    isa_flags: tuple[str, ...]
    runtime_version: str
    options: Mapping[str, str] = {}
    canonical_json: str = ""
    digest: str = ""
    #: the GPU or NPU under the provider (empty for a CPU): see
    #: `aoe.fingerprint.device_fingerprint`
    accelerator: Mapping[str, str] = {}


def bank_key(signature_digest: str, device_digest: str, precision: str) -> bytes:
    """Return the LMDB key of a task on a device under a precision policy.

    Layout: schema version, 128 bits of each digest, the policy; readable ASCII so that
    `mdb_dump` and exports stay diffable.
    """
    return f"v{SCHEMA_VERSION}/{signature_digest[:32]}/{device_digest[:32]}/{precision}".encode()


def history_key(key: bytes, time_ns: int) -> bytes:
    """The history key of a trial of bank key `key` recorded at `time_ns`: the bank key,
    then the time in 16 hex digits, so a key's trials sort after it by time."""
    return key + b"/" + f"{time_ns:016x}".encode()


def parse_history_key(key: bytes) -> tuple[bytes, int]:
    """(bank key, time_ns) of a history key (the inverse of `history_key`); ValueError
    when `key` does not end in a hex time stamp."""
    bank, sep, stamp = key.rpartition(b"/")
    if not sep or not stamp:
        raise ValueError(f"{key.decode('ascii', 'replace')!r} is not a history key")
    return bank, int(stamp, 16)

"""What a bank key is made of, and the values stored under one: `bank_key`, the
`TaskSignature` and `DeviceFingerprint` it names, the precision policies' names and their
codes in `aoe.v1.Precision` (the one table: the bank's codec, its records, the record
checks and the API's edge all read it).

Light on purpose: the standard library, msgspec and protobuf's generated `aoe.v1.bank_pb2`
only (no onnx, no lmdb), so `aoe.bankrecord` and `aoe.recordcheck` stay as light as they
say. The values are msgspec Structs: they cross processes inside the engine's messages,
which refuse a field they do not know (aoed.engine.messages).
How a signature or a fingerprint is computed is `aoe.signature`'s.
"""

from __future__ import annotations

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
    #: `aoe.signature.device_fingerprint`
    accelerator: Mapping[str, str] = {}


def bank_key(signature_digest: str, device_digest: str, precision: str) -> bytes:
    """Return the LMDB key of a task on a device under a precision policy.

    Layout: schema version, 128 bits of each digest, the policy; readable ASCII so that
    `mdb_dump` and exports stay diffable.
    """
    return f"v{SCHEMA_VERSION}/{signature_digest[:32]}/{device_digest[:32]}/{precision}".encode()

"""Tests for the v1 protobuf API: generated code is current, and messages round-trip."""

from __future__ import annotations

import importlib
import importlib.resources
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GENERATED = ROOT / "client" / "aoe" / "v1"
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def _generated_files(directory: Path) -> dict[str, bytes]:
    """Map file name to contents for every generated file in ``directory``."""
    return {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name.endswith(SUFFIXES)
    }


def test_generated_code_is_current(tmp_path: Path) -> None:
    """Regenerating from protos/ reproduces client/aoe/v1/ byte for byte (`make protos`).
    protoc runs in a process of its own, as `make protos` runs it: run inside a test
    worker that had loaded torch, grpc_tools' protoc once died of a segmentation fault."""
    import subprocess
    import sys

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    sources = sorted(str(p) for p in (PROTOS / "aoe" / "v1").glob("*.proto"))
    assert sources, f"no .proto files under {PROTOS / 'aoe' / 'v1'}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTOS}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *sources,
            f"-I{well_known}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"protoc failed: {done.stderr}"

    fresh = _generated_files(tmp_path / "aoe" / "v1")
    committed = _generated_files(GENERATED)
    assert fresh, "protoc produced no files"
    hint = "run `make protos` and commit the result"
    missing = sorted(set(fresh) - set(committed))
    assert not missing, f"generated files missing from {GENERATED}: {missing}; {hint}"
    extra = sorted(set(committed) - set(fresh))
    assert not extra, f"files in {GENERATED} no longer generated: {extra}; {hint}"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files in {GENERATED}: {stale}; {hint}"


def test_modules_import() -> None:
    """The generated modules import as a package."""
    from aoe.v1 import bank_pb2, devices_pb2, tuning_pb2, tuning_pb2_grpc

    assert bank_pb2.DESCRIPTOR.package == "aoe.v1"
    assert devices_pb2.DESCRIPTOR.services_by_name["DeviceService"]
    assert tuning_pb2.DESCRIPTOR.services_by_name["TuningService"]
    assert hasattr(tuning_pb2_grpc, "TuningServiceStub")


@pytest.mark.parametrize("module", ["bank_pb2", "devices_pb2", "tuning_pb2"])
def test_enums_start_unspecified(module: str) -> None:
    """Every enum's zero value is its *_UNSPECIFIED member."""
    mod = importlib.import_module(f"aoe.v1.{module}")
    for enum in mod.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.full_name


def test_job_type_numbers_match_aoe() -> None:
    """JobType numbers are AOE's --job_type values."""
    from aoe.v1 import tuning_pb2

    assert tuning_pb2.JOB_TYPE_SGAT == 1
    assert tuning_pb2.JOB_TYPE_OPAT == 2


#: A BankEntry as schema version 1 wrote it (`_filled_entry()`, serialized
#: deterministically). Banks on disk and exported files hold such bytes, so a renumbered
#: field, a changed type or a field removed without `reserved` reads them differently:
#: fields are never renumbered, removed ones become `reserved`.
BANK_ENTRY_V1 = bytes.fromhex(
    "0801124976312f61616161616161616161616161616161616161616161616161616161616161612f6262626262626262"
    "6262626262626262626262626262626262626262626262622f696e74381a620a064d61744d756c181122147b226f705f"
    "74797065223a224d61744d756c227d2a4061616161616161616161616161616161616161616161616161616161616161"
    "6161616161616161616161616161616161616161616161616161616161616161612297010a1443505545786563757469"
    "6f6e50726f7669646572120b4578616d706c65204350551a04617678321a03666d612206312e32302e302a1d7b226570"
    "223a22435055457865637574696f6e50726f7669646572227d3240626262626262626262626262626262626262626262"
    "626262626262626262626262626262626262626262626262626262626262626262626262626262626262622a470a0d71"
    "75616e745f64796e616d696312087175616e74697a651a130a0b7065725f6368616e6e656c1204747275651a150a0c72"
    "65647563655f72616e6765120566616c73652002321d090000000000c0444011b81e85eb51b89e3f183221cdcccccccc"
    "0c44403a1d090000000000505840119a9999999999a93f1832210000000000c05740421b09fca9f1d24d62503f11fca9"
    "f1d24d62603f191ea7e8482effef3f4a310a0774756e65722d311205302e312e301a06312e32302e3022060880e2cfaa"
    "062a056a6f622d3132086d6c702e6f6e6e78"
)


def _filled_entry():
    """A BankEntry with every field set, nested messages, repeated and map fields included."""
    from aoe.v1 import bank_pb2

    entry = bank_pb2.BankEntry(
        schema_version=1,
        key="v1/" + "a" * 32 + "/" + "b" * 32 + "/int8",
        signature=bank_pb2.TaskSignature(
            op_type="MatMul",
            domain="",
            opset=17,
            canonical_json='{"op_type":"MatMul"}',
            digest="a" * 64,
        ),
        device=bank_pb2.DeviceFingerprint(
            execution_provider="CPUExecutionProvider",
            hardware="Example CPU",
            isa_flags=["avx2", "fma"],
            runtime_version="1.20.0",
            canonical_json='{"ep":"CPUExecutionProvider"}',
            digest="b" * 64,
        ),
        strategy=bank_pb2.Strategy(
            name="quant_dynamic",
            family="quantize",
            params={"per_channel": "true", "reduce_range": "false"},
            precision=bank_pb2.PRECISION_INT8,
        ),
        winner=bank_pb2.Stats(median_us=41.5, spread=0.03, repeats=50, min_us=40.1),
        baseline=bank_pb2.Stats(median_us=97.25, spread=0.05, repeats=50, min_us=95.0),
        accuracy=bank_pb2.Accuracy(max_abs_error=1e-3, max_rel_error=2e-3, cosine=0.9999),
        provenance=bank_pb2.Provenance(
            host="tuner-1",
            aoed_version="0.1.0",
            onnxruntime_version="1.20.0",
            job_id="job-1",
            model="mlp.onnx",
        ),
    )
    entry.provenance.created.FromSeconds(1_700_000_000)
    return entry


def test_bank_entry_wire_format_is_stable() -> None:
    """Bytes stored by schema version 1 read back as the same entry, field for field, and
    the same entry still serializes to those bytes."""
    from aoe.v1 import bank_pb2

    parsed = bank_pb2.BankEntry.FromString(BANK_ENTRY_V1)
    entry = _filled_entry()
    for f in bank_pb2.BankEntry.DESCRIPTOR.fields:
        assert getattr(parsed, f.name) == getattr(entry, f.name), f.name
    assert parsed.strategy.params["per_channel"] == "true"
    assert parsed.strategy.precision == bank_pb2.PRECISION_INT8
    assert parsed.provenance.created.seconds == 1_700_000_000
    assert entry.SerializeToString(deterministic=True) == BANK_ENTRY_V1

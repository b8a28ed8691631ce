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
    """Regenerating from protos/ reproduces client/aoe/v1/ byte for byte (`make protos`)."""
    from grpc_tools import protoc

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    sources = sorted(str(p) for p in (PROTOS / "aoe" / "v1").glob("*.proto"))
    assert sources, f"no .proto files under {PROTOS / 'aoe' / 'v1'}"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTOS}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *sources,
            f"-I{well_known}",
        ]
    )
    assert rc == 0, "protoc failed; see captured stderr"

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


def test_bank_entry_round_trip() -> None:
    """A fully filled BankEntry serializes and parses back equal."""
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

    data = entry.SerializeToString(deterministic=True)
    parsed = bank_pb2.BankEntry.FromString(data)
    assert parsed == entry
    assert parsed.strategy.params["per_channel"] == "true"
    assert parsed.provenance.created.seconds == 1_700_000_000
    assert parsed.SerializeToString(deterministic=True) == data

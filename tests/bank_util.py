"""Bank records and banks for tests: a task signature, records for this device or a
foreign one, numbered entries, and a bank on disk holding them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from aoe.bankrecord import BankRecord, Measured, encode
from aoe.signature import (
    DeviceFingerprint,
    ModelContext,
    TaskSignature,
    bank_key,
    canonical_json,
    device_fingerprint,
    task_signature,
)
from aoed.bank.store import BankStore

__all__ = [
    "default_key",
    "fill_bank",
    "foreign",
    "here",
    "make_bank",
    "make_entry",
    "make_record",
    "make_signature",
    "rec",
]


def make_signature() -> TaskSignature:
    w = numpy_helper.from_array(np.ones((8, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model = shape_inference.infer_shapes(model)
    onnx.checker.check_model(model)
    return task_signature([model.graph.node[0]], ModelContext(model))


def make_record(precision: str = "exact", **kw: object) -> BankRecord:
    sig = make_signature()
    dev = device_fingerprint("CPUExecutionProvider", {"threads": "4"})
    fields = dict(
        key=bank_key(sig.digest, dev.digest, precision),
        signature=sig,
        device=dev,
        strategy="gemm_pretransposed",
        family="matmul",
        precision=precision,
        winner=Measured(median_us=12.5, spread=0.03, repeats=40, min_us=11.75),
        baseline=Measured(median_us=20.25, spread=0.05, repeats=40, min_us=19.5),
        max_abs_error=1.5e-6,
        max_rel_error=2.5e-7,
        cosine=0.999999,
        params={"threads": "4", "layout": "nt"},
        host="bench-01",
        aoed_version="0.1.0",
        created_unix=1_700_000_000.5,
        job_id="job-42",
        model="mlp.onnx",
    )
    fields.update(kw)
    return BankRecord(**fields)  # type: ignore[arg-type]


def here() -> DeviceFingerprint:
    return device_fingerprint("CPUExecutionProvider")


def foreign(hardware: str = "Imaginary CPU 9000", runtime: str = "0.0.1") -> DeviceFingerprint:
    fp = here()
    doc = json.loads(fp.canonical_json)
    doc.update(hardware=hardware, runtime=runtime)
    text = canonical_json(doc)
    return DeviceFingerprint(
        fp.execution_provider,
        hardware,
        fp.isa_flags,
        runtime,
        {},
        text,
        hashlib.sha256(text.encode()).hexdigest(),
    )


def rec(sig=None, dev=None, precision: str = "exact", **kw) -> BankRecord:
    sig = sig or make_signature()
    dev = dev or here()
    return make_record(
        precision, key=bank_key(sig.digest, dev.digest, precision), signature=sig, device=dev, **kw
    )


def make_bank(path: Path, records=(), defaults=(), trials=()) -> Path:
    store = BankStore(path)
    try:
        store.commit(
            entries=[(r.key, encode(r)) for r in records], defaults=defaults, trials=trials
        )
    finally:
        store.close()
    return path


def make_entry(n: int, median: float, host: str, dev=None, precision: str = "exact"):
    """A record for task n; provenance says where it came from. Digests are checked on
    import, so the signature digest is the real one of its canonical JSON except task n."""
    import hashlib

    s = make_signature()
    text = s.canonical_json.replace('"v":1', f'"v":1,"task":{n}')
    sig = type(s)(s.op_type, s.domain, s.opset, text, hashlib.sha256(text.encode()).hexdigest())
    return rec(
        sig=sig,
        dev=dev,
        precision=precision,
        host=host,
        job_id=f"job-{host}-{n}",
        winner=Measured(median, 0.01, 30, median * 0.9),
        created_unix=1_700_000_000.0 + n,
    )


def default_key(n: int) -> bytes:
    return bank_key(hashlib.sha256(f"default {n}".encode()).hexdigest(), here().digest, "exact")


def fill_bank(bank: Path, n_entries: int = 4, n_trials: int = 3, trial_bytes: int = 0) -> list:
    """A bank of `n_entries` local entries and a foreign one, a default record and
    `n_trials` trials; returns the entries in key order."""
    entries = [make_entry(i, 10.0 + i, "alpha") for i in range(n_entries)] + [
        make_entry(99, 1.0, "far", dev=foreign())
    ]
    trials = [
        (entries[i % n_entries].key, {"n": i, "pad": "x" * trial_bytes}) for i in range(n_trials)
    ]
    make_bank(
        bank,
        entries,
        defaults=[(default_key(1), {"default_us": 12.0, "job": "job-d"})],
        trials=trials,
    )
    return sorted(entries, key=lambda e: e.key)

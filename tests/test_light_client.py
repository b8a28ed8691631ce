"""The light client: what a compiler imports to look tasks up, that it installs alone
(client/pyproject.toml, aoed-client) and looks a model up there, and that it finds, in the
model a user actually has, the tasks the tuner tuned."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from aoe.bank import CUSTOM, ModelTasks, open_bank
from aoe.fingerprint import device_fingerprint
from aoe.partition import partition
from aoed import samples
from aoed.engine.prep import prepare

from .bank_util import make_bank, rec

HEAVY = ("trio", "onnxruntime", "aoed", "grpc")
ROOT = Path(__file__).resolve().parent.parent


def test_lookups_import_neither_trio_nor_onnxruntime_nor_the_daemon(tmp_path: Path) -> None:
    model = samples.save(samples.cnn(), tmp_path / "cnn.onnx")
    bank = make_bank(tmp_path / "bank", [rec()])
    code = textwrap.dedent(f"""
        import sys, onnx
        from aoe.signature import ModelContext, task_signature
        from aoe.keys import bank_key
        from aoe.fingerprint import device_fingerprint
        from aoe.partition import ModelTasks, partition
        from aoe.bank import open_bank
        m = onnx.load({str(model)!r})
        tasks = ModelTasks(m)
        assert len(tasks) > 0
        ctx = ModelContext(tasks.model)
        assert partition(tasks.model, ctx)
        node = next(n for n in m.graph.node if n.op_type == "Conv")
        sig = tasks.signature(node)
        assert sig is not None and sig.digest == task_signature([n for n in tasks.model.graph.node
                                                                 if n.name in tasks.tasks[0].node_names], ctx).digest
        with open_bank({str(bank)!r}, use_env=False) as bank:
            bank.lookup(bank_key(sig.digest, device_fingerprint().digest, "exact"))
            bank.lookup_node(node, tasks)
        print(sorted({{m.split(".")[0] for m in sys.modules}} & {set(HEAVY)!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


_LIGHT_LOOKUP = """
import importlib.metadata, json, sys
import onnx
import aoe.bank
from aoe.bank import ModelTasks, open_bank
from aoe.fingerprint import device_fingerprint

model_path, bank_path, runtime = sys.argv[1:]
installed = []
for dist in ("trio", "onnxruntime", "onnxruntime-gpu", "grpcio", "torch", "aoed"):
    try:
        installed.append(f"{dist} {importlib.metadata.version(dist)}")
    except importlib.metadata.PackageNotFoundError:
        pass
model = onnx.load(model_path)  # what a compiler holds
tasks = ModelTasks(model)
found = {}
with open_bank(bank_path, use_env=False, device=device_fingerprint(runtime_version=runtime)) as bank:
    for node in model.graph.node:
        entry, layer = bank.lookup_node(node, tasks)
        if entry is not None:
            found[entry.signature.digest] = [entry.strategy.name, layer]
with open_bank(bank_path, use_env=False) as bank:  # this venv's own runtime: none
    own = [n.name for n in model.graph.node if bank.lookup_node(n, tasks)[0] is not None]
print(json.dumps({
    "installed": installed,
    "loaded": sorted({m.split(".")[0] for m in sys.modules}),
    "aoe": aoe.bank.__file__,
    "runtime": device_fingerprint().runtime_version,
    "target": device_fingerprint(runtime_version=runtime).digest,
    "found": found,
    "own": own,
}))
"""


@pytest.mark.long
def test_the_client_installs_alone_and_a_compiler_looks_a_model_up_there(tmp_path: Path) -> None:
    """`pip install ./client` into an empty venv brings the bank reader and nothing of the
    daemon's: no trio, onnxruntime, grpcio or torch installed, none imported. There, a
    compiler looks up the tasks of a model in a bank this venv's tuner code wrote, naming
    the onnxruntime release its models run on (none is installed to ask). The grpc extra
    then brings aoe.Client."""
    src = tmp_path / "src" / "client"  # a copy: pip builds in place (build/, *.egg-info)
    shutil.copytree(
        ROOT / "client", src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    _pip(python, str(src))

    model = samples.save(samples.cnn(), tmp_path / "cnn.onnx")
    prep = prepare(model, tmp_path / "prep", {})
    tuned = {
        t.signature.digest: t for rep in partition(prep.model, prep.ctx) for t in (rep, *rep.twins)
    }
    assert tuned, "the tuner found no task"
    records = [rec(sig=t.signature, strategy=f"s_{d[:8]}") for d, t in tuned.items()]
    bank = make_bank(tmp_path / "bank", records)
    here = device_fingerprint()

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "TUNE_BANK_PATH", "AOED_BANK_LAYERS")
    }

    def light(code: str, *args: str) -> str:
        """`code` run by the light venv's python, outside the tree; its stdout."""
        done = subprocess.run(
            [str(python), "-c", code, *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return done.stdout

    got = json.loads(light(_LIGHT_LOOKUP, str(model), str(bank), here.runtime_version))
    assert got["installed"] == [], got["installed"]
    assert not set(got["loaded"]) & {*HEAVY, "torch"}, got["loaded"]
    assert Path(got["aoe"]).is_relative_to(venv), got["aoe"]  # the installed copy, not the tree
    assert got["runtime"] == "unknown"
    assert got["target"] == here.digest  # the release named: this machine's own fingerprint
    assert got["found"] == {d: [f"s_{d[:8]}", CUSTOM] for d in tuned}
    assert got["own"] == []  # decisions for a runtime never answer "unknown"

    _pip(python, f"{src}[grpc]")
    out = light(
        "import sys, aoe.bank; print('grpc' in sys.modules); from aoe import Client; "
        "print(Client.__module__)"
    )
    assert out.split() == ["False", "aoe.client"]


def _exported_mlp() -> onnx.ModelProto:
    """An MLP as real exporters write them: unnamed nodes, a dynamic batch, opset 11, and
    weights that nodes compute (a transposed initializer, an Identity, an fp16 Cast)."""
    rng = np.random.default_rng(11)

    def init(name: str, shape: list[int], dtype=np.float32) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(dtype), name)

    nodes = [
        helper.make_node("Transpose", ["w1_t"], ["w1"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("Add", ["h1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("Identity", ["w2_shared"], ["w2"]),
        helper.make_node("MatMul", ["r1", "w2"], ["h2"]),
        helper.make_node("Add", ["b2", "h2"], ["a2"]),
        helper.make_node("Tanh", ["a2"], ["r2"]),
        helper.make_node("Cast", ["w3_half"], ["w3"], to=TensorProto.FLOAT),
        helper.make_node("Gemm", ["r2", "w3", "b3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "exported",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])],
        [
            init("w1_t", [128, 64]),
            init("b1", [128]),
            init("w2_shared", [128, 32]),
            init("b2", [32]),
            init("w3_half", [32, 10], np.float16),
            init("b3", [10]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    return model


def _unnamed(model: onnx.ModelProto) -> onnx.ModelProto:
    for node in model.graph.node:
        node.name = ""
    return model


CASES = {
    "exported_mlp": (_exported_mlp, {"x": (4, 64)}),
    "legacy_mlp": (samples.legacy_mlp, {}),  # opset 9, initializers listed as inputs
    "legacy_cnn": (samples.legacy_cnn, {}),  # a conv weight computed by nodes
    "cnn_unnamed": (lambda: _unnamed(samples.cnn()), {}),  # Conv + BatchNormalization + Relu
    "transformer": (samples.transformer, {}),
    "mlp_dynamic": (lambda: samples.mlp(dynamic_batch=True), {"input": (2, 256)}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_model_a_user_has_finds_the_tasks_the_tuner_tuned(tmp_path: Path, name: str) -> None:
    build, shapes = CASES[name]
    src = samples.save(build(), tmp_path / f"{name}.onnx")
    prep = prepare(src, tmp_path / "prep", shapes)  # what the tuner tunes
    tuned = [t for rep in partition(prep.model, prep.ctx) for t in (rep, *rep.twins)]
    assert tuned, "the tuner found no task"
    records = [rec(sig=t.signature, strategy=f"s_{t.signature.digest[:8]}") for t in tuned]
    bank = make_bank(tmp_path / "bank", records)

    original = onnx.load(str(src))  # what a compiler holds: not normalized, maybe unnamed
    index = ModelTasks(original, shapes)
    assert {t.signature.digest for t in index.tasks} == {t.signature.digest for t in tuned}
    by_output = {n.output[0]: n for n in original.graph.node if n.output}
    prep_nodes = {n.name: n for n in prep.model.graph.node}
    with open_bank(bank, use_env=False) as reader:
        for t in tuned:
            node = by_output[prep_nodes[t.node_names[0]].output[0]]
            entry, layer = reader.lookup_node(node, index)
            assert entry is not None and layer == CUSTOM, (name, t.id)
            assert entry.signature.digest == t.signature.digest


def test_without_its_shapes_a_dynamic_model_finds_nothing_and_says_nothing_wrong(
    tmp_path: Path,
) -> None:
    index = ModelTasks(samples.mlp(dynamic_batch=True))
    assert len(index) == 0  # no static shapes, no signatures: no false matches either
    assert len(ModelTasks(samples.mlp(dynamic_batch=True), {"input": (1, 256)})) == 3


def test_a_compiler_without_onnxruntime_names_the_release_its_models_run_on() -> None:
    """A key's device names the onnxruntime release; a reader that has none installed
    names it, and gets this machine's fingerprint for that release, no other."""
    here = device_fingerprint()
    assert device_fingerprint(runtime_version=here.runtime_version) == here
    other = device_fingerprint(runtime_version="0.0.1")
    assert other.runtime_version == "0.0.1" and other.digest != here.digest
    assert other.hardware == here.hardware and device_fingerprint() == here


def test_bank_records_need_protobuf_only() -> None:
    """aoe.bankrecord encodes and decodes a stored entry with protobuf alone: neither lmdb
    nor onnx (nor anything heavier) is imported for it."""
    code = textwrap.dedent("""
        import sys
        from aoe.bankrecord import BankRecord, Measured, decode, encode
        from aoe.keys import DeviceFingerprint, TaskSignature, bank_key
        sig = TaskSignature("Conv", "", 17, "{}", "a" * 64)
        dev = DeviceFingerprint("CPUExecutionProvider", "cpu", (), "1.0", {}, "{}", "b" * 64)
        m = Measured(10.0, 0.01, 5, 9.5)
        r = BankRecord(bank_key(sig.digest, dev.digest, "int8"), sig, dev, "s", "f", "int8", m, m)
        assert decode(encode(r)) == r
        print(sorted({n.split(".")[0] for n in sys.modules} & {"lmdb", "onnx", "numpy", *HEAVY}))
    """).replace("HEAVY", repr(HEAVY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_exchange_lines_and_fingerprints_need_no_lmdb_nor_onnx() -> None:
    """The export format's lines (aoe.exchange) and this machine's fingerprint
    (aoe.fingerprint) need protobuf and the standard library alone; the names they had
    in aoe.bank and aoe.signature are the same functions."""
    code = textwrap.dedent("""
        import sys
        from aoe.exchange import default_doc, default_record, record_from_json, record_to_json
        from aoe.fingerprint import device_fingerprint
        from aoe.v1 import bank_pb2
        key = "v1/" + "a" * 32 + "/" + device_fingerprint().digest[:32] + "/exact"
        rec = default_record(key, {"default_us": 12.5, "job": "j"})
        line = record_to_json(bank_pb2.ExportEntriesResponse(default_record=rec))
        assert default_doc(record_from_json(line).default_record) == {"default_us": 12.5, "job": "j"}
        print(sorted({n.split(".")[0] for n in sys.modules} & {"lmdb", "onnx", "numpy", *HEAVY}))
    """).replace("HEAVY", repr(HEAVY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout

    import aoe.bank
    import aoe.exchange
    import aoe.fingerprint
    import aoe.keys
    import aoe.signature

    for name in aoe.exchange.__all__:
        if name in aoe.bank.__all__:
            assert getattr(aoe.bank, name) is getattr(aoe.exchange, name), name
    assert {"entry_to_json", "record_from_json", "default_record"} <= set(aoe.bank.__all__)
    assert aoe.signature.device_fingerprint is aoe.fingerprint.device_fingerprint
    assert aoe.signature.canonical_json is aoe.keys.canonical_json

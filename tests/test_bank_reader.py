"""The read-only bank API (aoe.bank): layers, lookups, explanations, schema checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import onnx
import pytest

from aoe.bank import CUSTOM, LAYERS_ENV, ModelTasks, open_bank, parse_key
from aoe.bankrecord import encode
from aoe.errors import BankError
from aoe.exchange import entry_from_json, entry_to_json
from aoe.signature import (
    SCHEMA_VERSION,
    bank_key,
)
from aoed import samples
from aoed.bank.store import BankStore
from aoed.bank.writer import BankWriter

from .bank_util import foreign, here, make_bank, make_signature, rec

# --------------------------------------------------------------------------- lookups


def test_lookup_custom_first_then_layers_in_order(tmp_path: Path) -> None:
    mine = rec(strategy="fused_gemm", host="mine")
    team = rec(strategy="gemm_pretransposed", host="team")
    only_team = rec(precision="int8", host="team")
    only_sys = rec(precision="fp16", host="system")
    custom = make_bank(tmp_path / "custom", [mine])
    layer1 = make_bank(tmp_path / "team", [team, only_team])
    layer2 = make_bank(tmp_path / "system", [only_sys, rec(precision="int8", host="system")])
    with open_bank(custom, layers=[layer1, layer2], use_env=False) as bank:
        assert [n for n, _ in bank.layers] == [CUSTOM, str(layer1), str(layer2)]
        entry, layer = bank.lookup(mine.key)
        assert (entry.strategy.name, entry.provenance.host, layer) == ("fused_gemm", "mine", CUSTOM)
        entry, layer = bank.lookup(only_team.key.decode())  # str keys work too
        assert (entry.provenance.host, layer) == ("team", str(layer1))
        entry, layer = bank.lookup(only_sys.key)
        assert (entry.provenance.host, layer) == ("system", str(layer2))
        assert bank.lookup(b"v1/" + b"0" * 32 + b"/" + b"0" * 32 + b"/exact") == (None, "")
        assert bank.lookup_signature(mine.signature)[0].strategy.name == "fused_gemm"
        assert bank.lookup_signature(mine.signature.digest, "fp16")[1] == str(layer2)
        assert bank.key_for(mine.signature.digest) == mine.key
        raw, layer = bank.lookup_raw(mine.key)
        assert raw == encode(mine) and layer == CUSTOM


def test_layers_from_environment_and_duplicates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = rec(precision="int8")
    custom = make_bank(tmp_path / "custom")
    a = make_bank(tmp_path / "a")
    b = make_bank(tmp_path / "b", [r])
    monkeypatch.setenv(LAYERS_ENV, os.pathsep.join([str(a), "", str(b), str(custom)]))
    with open_bank(custom, layers=[a]) as bank:
        assert [n for n, _ in bank.layers] == [CUSTOM, str(a), str(b)]
        assert bank.lookup(r.key)[1] == str(b)
    with open_bank(custom, use_env=False) as bank:
        assert len(bank.layers) == 1


def test_missing_or_foreign_directories_are_bank_errors(tmp_path: Path) -> None:
    with pytest.raises(BankError, match="no bank here"):
        open_bank(tmp_path / "nothing", use_env=False)
    plain = tmp_path / "plain"
    plain.mkdir()
    env = lmdb.open(str(plain), max_dbs=2)
    env.close()
    with pytest.raises(BankError, match="not a bank written by aoed"):
        open_bank(plain, use_env=False)


def _set_schema(path: Path, version: int) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"schema_version", str(version).encode())
    env.close()


def test_newer_schema_is_refused_by_readers(tmp_path: Path) -> None:
    path = make_bank(tmp_path / "bank", [rec()])
    _set_schema(path, SCHEMA_VERSION + 1)
    with pytest.raises(BankError, match=f"schema version {SCHEMA_VERSION + 1} is newer") as err:
        open_bank(path, use_env=False)
    assert str(path) in str(err.value) and "upgrade" in str(err.value)


def test_older_schema_is_refused_with_a_message(tmp_path: Path) -> None:
    path = make_bank(tmp_path / "bank", [rec()])
    _set_schema(path, SCHEMA_VERSION - 1)
    with pytest.raises(BankError, match="is older") as err:
        open_bank(path, use_env=False)
    assert str(path) in str(err.value)
    with pytest.raises(BankError, match="cannot be migrated") as err:
        BankStore(path)
    assert "new bank" in str(err.value)
    # Refusing changed nothing: the version is still the old one.
    env = lmdb.open(str(path), max_dbs=8, readonly=True)
    with env.begin(db=env.open_db(b"meta", create=False)) as txn:
        assert txn.get(b"schema_version") == str(SCHEMA_VERSION - 1).encode()
    env.close()


def test_parse_key() -> None:
    r = rec()
    assert parse_key(r.key) == (
        SCHEMA_VERSION,
        r.signature.digest[:32],
        r.device.digest[:32],
        "exact",
    )
    with pytest.raises(ValueError, match="not a bank key"):
        parse_key("hello/world")


# --------------------------------------------------------------------------- explain


def test_explain_lists_other_devices_precisions_and_defaults(tmp_path: Path) -> None:
    sig = make_signature()
    there = foreign()
    other = rec(dev=there, strategy="fused_gemm")
    int8 = rec(precision="int8")
    custom = make_bank(tmp_path / "custom", [int8])
    team = make_bank(tmp_path / "team", [other])
    with open_bank(custom, layers=[team], use_env=False) as bank:
        ex = bank.lookup_explain(signature_digest=sig.digest)
        assert not ex.found and ex.layer == ""
        assert ex.key == bank_key(sig.digest, here().digest, "exact").decode()
        assert "precision int8, not exact" in ex.reason
        assert there.digest[:32] in ex.reason and "Imaginary CPU 9000" in ex.reason
        assert "never applied here" in ex.reason
        [seen] = [s for s in ex.seen if s.device_digest == there.digest[:32]]
        assert seen.layer == str(team) and seen.strategy == "fused_gemm"
        assert any(d.startswith("hardware") for d in seen.differs)
        assert any(d.startswith("runtime") for d in seen.differs)
        # The foreign entry is there, yet a lookup for this device never returns it.
        assert bank.lookup(bank.key_for(sig.digest)) == (None, "")
        found = bank.lookup_explain(int8.key)
        assert found.found and found.layer == CUSTOM and found.reason == ""
        nothing = bank.lookup_explain(signature_digest="ab" * 32)
        assert "no entry for signature" in nothing.reason and str(team) in nothing.reason
        assert "not a bank key" in bank.lookup_explain("garbage").reason


def test_explain_reports_a_recorded_default(tmp_path: Path) -> None:
    key = bank_key(make_signature().digest, here().digest, "exact")
    custom = make_bank(tmp_path / "custom", defaults=[(key, {"default_us": 12.0})])
    with open_bank(custom, use_env=False) as bank:
        assert bank.lookup_default(key) == ({"default_us": 12.0}, CUSTOM)
        ex = bank.lookup_explain(key)
        assert not ex.found and ex.default_layer == CUSTOM
        assert "default strategy stayed fastest" in ex.reason


# --------------------------------------------------------------------------- nodes


def test_lookup_node_finds_the_task_the_node_anchors(tmp_path: Path) -> None:
    from aoe.partition import partition
    from aoed.engine.prep import prepare

    prep = prepare(_save(samples.build("transformer"), tmp_path), tmp_path / "prep")
    tasks = partition(prep.model, prep.ctx)
    assert any(t.twins for t in tasks)  # twins are looked up through their own anchors
    records = [rec(sig=t.signature, strategy=f"s_{t.id}") for t in tasks]
    bank_path = make_bank(tmp_path / "bank", records)
    by_name = {n.name: n for n in prep.model.graph.node}
    index = ModelTasks(prep.model)
    assert len(index) == len(tasks)
    with open_bank(bank_path, use_env=False) as bank:
        for t in tasks:
            for tt in (t, *t.twins):
                entry, layer = bank.lookup_node(by_name[tt.node_names[0]], index)
                assert (entry.strategy.name, layer) == (f"s_{t.id}", CUSTOM)
        anchors = {n for t in tasks for tt in (t, *t.twins) for n in tt.node_names[:1]}
        others = [n for n in prep.model.graph.node if n.name not in anchors]
        assert others
        for node in others:
            assert bank.lookup_node(node, index) == (None, "")
        # Nodes without names (as many exporters write them) are found all the same.
        anon = onnx.ModelProto()
        anon.CopyFrom(prep.model)
        for node in anon.graph.node:
            node.name = ""
        anon_index = ModelTasks(anon)
        anchor = next(
            n for n in anon.graph.node if n.output[0] == by_name[tasks[0].node_names[0]].output[0]
        )
        assert bank.lookup_node(anchor, anon_index)[0].strategy.name == f"s_{tasks[0].id}"
        assert bank.lookup_node(anchor, index, precision="int8") == (None, "")


def _save(model: onnx.ModelProto, d: Path) -> Path:
    path = d / "model.onnx"
    samples.save(model, path)
    return path


# --------------------------------------------------------------------------- misc


def test_json_lines_round_trip_is_exact() -> None:
    from aoe.v1 import bank_pb2

    data = encode(rec())
    line = entry_to_json(bank_pb2.BankEntry.FromString(data))
    assert "\n" not in line and json.loads(line)["provenance"]["host"] == "bench-01"
    assert entry_from_json(line).SerializeToString(deterministic=True) == data
    with pytest.raises(ValueError):
        entry_from_json('{"no_such_field": 1}')


def test_stats_per_layer(tmp_path: Path) -> None:
    key = rec().key
    custom = make_bank(
        tmp_path / "custom", [rec(), rec(precision="int8")], trials=[(key, {"n": 1})] * 3
    )
    team = make_bank(tmp_path / "team", defaults=[(key, {"default_us": 1.0})])
    with open_bank(custom, layers=[team], use_env=False) as bank:
        a, b = bank.stats()
    assert (a.name, a.entries, a.defaults, a.history, a.schema_version) == (
        CUSTOM,
        2,
        0,
        3,
        SCHEMA_VERSION,
    )
    assert (b.name, b.entries, b.defaults, b.history) == (str(team), 0, 1, 0)
    assert a.map_size >= 1 << 20 and 0 < a.used_bytes <= a.map_size


def test_importing_aoe_bank_pulls_in_no_daemon_trio_or_onnxruntime() -> None:
    code = (
        "import sys, aoe.bank\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'onnxruntime', 'aoed', 'grpc'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


async def test_writer_consults_read_only_layers(tmp_path: Path) -> None:
    mine, theirs = rec(strategy="fused_gemm"), rec(precision="int8", strategy="gemm_as_matmul")
    dkey = bank_key("cd" * 32, here().digest, "exact")
    layer = make_bank(
        tmp_path / "team",
        [theirs, rec(strategy="shadowed")],
        defaults=[(dkey, {"default_us": 3.0})],
    )
    custom = make_bank(tmp_path / "custom", [mine])
    writer = BankWriter(custom, layers=[layer, custom])
    try:
        got, name = await writer.lookup_layered(mine.key)
        assert (got, name) == (mine, CUSTOM)
        got, name = await writer.lookup_layered(theirs.key)
        assert (got, name) == (theirs, str(layer))
        assert await writer.lookup(theirs.key) is None  # the plain lookup stays custom-only
        assert await writer.lookup_layered(b"v1/none/none/exact") == (None, "")
        assert await writer.known_default_layered(dkey) == ({"default_us": 3.0}, str(layer))
    finally:
        writer.close()


async def test_writer_layers_default_to_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = rec(precision="int8")
    layer = make_bank(tmp_path / "team", [theirs])
    monkeypatch.setenv(LAYERS_ENV, str(layer))
    writer = BankWriter(tmp_path / "custom")
    try:
        assert await writer.lookup_layered(theirs.key) == (theirs, str(layer))
    finally:
        writer.close()

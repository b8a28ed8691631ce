"""Bank exchange and maintenance: export/import with merge policies, lookup, stats, prune
through the real `aoe bank` command, and the merge rules in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aoe.bank import CUSTOM, open_bank
from aoe.bankrecord import encode
from aoe.exchange import default_record, entry_to_json, record_to_json
from aoe.keys import bank_key
from aoe.v1 import bank_pb2
from aoed.bank.exchange import import_lines
from aoed.bank.store import BankStore

from .bank_util import foreign, here, make_bank, make_entry, rec
from .conftest import run_aoe


def _stored(path: Path) -> dict[bytes, bytes]:
    with open_bank(path, use_env=False) as bank:
        return {e.key.encode(): e.SerializeToString(deterministic=True) for _, e in bank.entries()}


@pytest.fixture
def banks(tmp_path: Path):
    a = {
        "k1": make_entry(1, 5.0, "alpha"),  # faster than beta's
        "k2": make_entry(2, 20.0, "alpha"),  # slower than beta's
        "k3": make_entry(3, 7.0, "alpha"),  # alpha only
        "k5": make_entry(5, 1.0, "alpha", dev=foreign()),  # measured elsewhere
    }
    b = {
        "k1": make_entry(1, 10.0, "beta"),
        "k2": make_entry(2, 10.0, "beta"),
        "k4": make_entry(4, 3.0, "beta"),
    }
    make_bank(tmp_path / "alpha", a.values(), trials=[(a["k1"].key, {"n": 1})])
    return tmp_path, a, b


def test_export_then_import_keeps_the_faster_and_provenance(banks) -> None:
    tmp, a, b = banks
    dump = tmp / "alpha.jsonl"
    r = run_aoe("bank", "export", "--bank", str(tmp / "alpha"), "--output", str(dump))
    assert r.returncode == 0, r.stderr
    assert "exported 4 entries, 0 default records, 1 trials" in r.stderr
    docs = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [list(d) for d in docs] == [["entry"]] * 4 + [["trial"]]
    keys = [d["entry"]["key"] for d in docs[:4]]
    assert keys == sorted(keys)  # key order: diffable
    assert docs[4]["trial"]["key"] == a["k1"].key.decode() and json.loads(
        docs[4]["trial"]["trial_json"]
    ) == {"n": 1}
    for line in dump.read_text().splitlines():
        inner = next(iter(json.loads(line).values()))
        assert list(inner) == sorted(inner)

    make_bank(tmp / "beta", b.values())
    r = run_aoe("bank", "import", str(dump), "--bank", str(tmp / "beta"))
    assert r.returncode == 0, r.stderr
    assert "3 added, 1 updated, 1 kept, 0 refused (keep-faster)" in r.stdout
    assert "entries:         2 added, 1 updated, 1 kept" in r.stdout
    assert "trials:          1 added, 0 kept" in r.stdout
    got = _stored(tmp / "beta")
    assert got[a["k1"].key] == encode(a["k1"])  # faster incoming wins, byte for byte
    assert got[b["k2"].key] == encode(b["k2"])  # faster existing stays
    assert got[a["k3"].key] == encode(a["k3"])  # new key added as it was
    assert got[b["k4"].key] == encode(b["k4"])  # untouched
    assert got[a["k5"].key] == encode(a["k5"])  # another device's: kept, under its key
    e = bank_pb2.BankEntry.FromString(got[a["k1"].key])
    assert (e.provenance.host, e.provenance.job_id) == ("alpha", "job-alpha-1")
    assert e.provenance.created.seconds == 1_700_000_001

    # Older scripts' --allow-foreign is taken and changes nothing.
    r = run_aoe("bank", "import", str(dump), "--bank", str(tmp / "beta"), "--allow-foreign")
    assert r.returncode == 0, r.stderr
    assert "0 added, 0 updated, 5 kept, 0 refused" in r.stdout
    assert _stored(tmp / "beta")[a["k5"].key] == encode(a["k5"])


@pytest.mark.parametrize(
    ("policy", "k1", "k2", "counts"),
    [
        ("keep-faster", "alpha", "beta", (2, 1, 1)),
        ("overwrite", "alpha", "alpha", (2, 2, 0)),
        ("keep-existing", "beta", "beta", (2, 0, 2)),
    ],
)
def test_merge_policies(banks, policy: str, k1: str, k2: str, counts: tuple[int, int, int]) -> None:
    tmp, a, b = banks
    make_bank(tmp / "beta", b.values())
    lines = [entry_to_json(bank_pb2.BankEntry.FromString(encode(r))) for r in a.values()]
    store = BankStore(tmp / "beta")
    try:
        report = import_lines(store, lines, policy)
    finally:
        store.close()
    assert (report.added, report.updated, report.kept) == counts
    assert report.refused == []  # k5, of another device, is added
    got = _stored(tmp / "beta")
    want = {"alpha": a, "beta": b}
    assert got[a["k1"].key] == encode(want[k1]["k1"])
    assert got[a["k2"].key] == encode(want[k2]["k2"])
    assert got[a["k3"].key] == encode(a["k3"])


def test_import_refuses_broken_lines_and_writes_nothing_for_them(tmp_path: Path) -> None:
    good = make_entry(1, 5.0, "alpha")
    msg = bank_pb2.BankEntry.FromString(encode(good))
    wrong_key = bank_pb2.BankEntry()
    wrong_key.CopyFrom(msg)
    wrong_key.key = bank_key("f" * 64, here().digest, "exact").decode()
    tampered = bank_pb2.BankEntry()
    tampered.CopyFrom(msg)
    tampered.signature.canonical_json += " "
    future = bank_pb2.BankEntry()
    future.CopyFrom(msg)
    future.schema_version = 99
    lines = [
        "{not json",
        "",
        entry_to_json(wrong_key),
        entry_to_json(tampered),
        entry_to_json(future),
    ]
    store = BankStore(tmp_path / "bank")
    try:
        report = import_lines(store, lines)
        assert store.counts()["entries"] == 0
        again = import_lines(store, [entry_to_json(msg)] * 2)
    finally:
        store.close()
    reasons = [r for _, r in report.refused]
    assert len(reasons) == 4
    assert reasons[0].startswith("not a bank record") and report.refused[0][0] == "line 1"
    assert "key does not match" in reasons[1]
    assert "signature digest does not match" in reasons[2]
    assert "schema version 99" in reasons[3]
    assert (again.added, again.kept) == (1, 1)  # importing twice changes nothing


def _contents(path: Path) -> dict[str, dict[bytes, bytes]]:
    """Every record of the bank at `path`, raw, per named db."""
    store = BankStore(path)
    try:
        return {db: dict(store.items(db)) for db in ("entries", "defaults", "history")}
    finally:
        store.close()


def _export(path: Path, **kw) -> list[str]:
    with open_bank(path, use_env=False) as reader:
        return [record_to_json(r) for _, r in reader.records(**kw)]


def _key(n: int, dev=None) -> bytes:
    return bank_key(f"{n:032x}{0:032x}", (dev or here()).digest, "exact")


def test_export_and_import_carry_default_records_and_history(tmp_path: Path) -> None:
    """Everything a bank knows travels: entries, "default stays best" records (a
    model-level one with the tasks reverted in its context) and the history."""
    entries = [make_entry(1, 5.0, "alpha"), make_entry(2, 6.0, "alpha", precision="int8")]
    reverted = [f"{9:064x}", f"{8:064x}"]
    defaults = [
        (_key(3), {"default_us": 12.5, "job": "job-1"}),
        (_key(4), {"default_us": 997.75, "reverted": reverted}),  # model level
        (_key(5), {"default_us": 40.0, "reverted": []}),  # model level, nothing reverted
    ]
    trials = [
        (entries[0].key, {"strategy": "fused_gemm", "median_us": 5.0}),
        (_key(3), {"strategy": "default"}),
    ]
    make_bank(tmp_path / "a", entries, defaults=defaults, trials=trials)
    lines = _export(tmp_path / "a")
    assert [next(iter(json.loads(line))) for line in lines] == ["entry"] * 2 + [
        "default_record"
    ] * 3 + ["trial"] * 2
    model = json.loads(lines[3])["default_record"]
    assert model == {"key": _key(4).decode(), "default_us": 997.75, "reverted": reverted}

    store = BankStore(tmp_path / "b")
    try:
        report = import_lines(store, lines)
        again = import_lines(store, lines)
    finally:
        store.close()
    assert report.refused == []
    assert {k: (c.added, c.updated, c.kept) for k, c in report.counts.items()} == {
        "entry": (2, 0, 0),
        "default": (3, 0, 0),
        "trial": (2, 0, 0),
    }
    assert (again.added, again.updated, again.kept) == (0, 0, 7)  # importing twice adds nothing
    a, b = _contents(tmp_path / "a"), _contents(tmp_path / "b")
    assert b["entries"] == a["entries"] and b["history"] == a["history"]  # byte for byte
    # Default records keep every field readers use; an empty reverted list means none.
    assert {k: json.loads(v) for k, v in b["defaults"].items()} == {
        _key(3): {"default_us": 12.5, "job": "job-1"},
        _key(4): {"default_us": 997.75, "reverted": reverted},
        _key(5): {"default_us": 40.0},
    }
    assert _export(tmp_path / "b") == lines  # and it exports as it came
    assert _export(tmp_path / "a", entries_only=True) == lines[:2]
    assert _export(tmp_path / "a", history=False) == lines[:5]


@pytest.mark.parametrize(
    ("policy", "want"),
    [
        # keep-faster: the default record (8 us) beats the entry (10 us); the entry (7 us)
        # loses to the default record (5 us); 10 us beats 20 us; 4 us loses to 3 us.
        (
            "keep-faster",
            {1: ("default", 8.0), 2: ("default", 5.0), 3: ("default", 10.0), 4: ("entry", 3.0)},
        ),
        (
            "overwrite",
            {1: ("default", 8.0), 2: ("entry", 7.0), 3: ("default", 10.0), 4: ("entry", 4.0)},
        ),
        (
            "keep-existing",
            {1: ("entry", 10.0), 2: ("default", 5.0), 3: ("default", 20.0), 4: ("entry", 3.0)},
        ),
    ],
)
def test_merge_policies_compare_entries_and_default_records(
    tmp_path: Path, policy: str, want: dict
) -> None:
    def entry(n: int, us: float):
        return make_entry(n, us, "x")

    keys = {n: entry(n, 1.0).key for n in range(1, 5)}
    make_bank(
        tmp_path / "bank",
        [entry(1, 10.0), entry(4, 3.0)],
        defaults=[(keys[2], {"default_us": 5.0}), (keys[3], {"default_us": 20.0})],
    )
    incoming = [
        record_to_json(
            bank_pb2.ExportEntriesResponse(
                default_record=default_record(keys[1], {"default_us": 8.0})
            )
        ),
        # a bare entry line, as old exports
        entry_to_json(bank_pb2.BankEntry.FromString(encode(entry(2, 7.0)))),
        record_to_json(
            bank_pb2.ExportEntriesResponse(
                default_record=default_record(keys[3], {"default_us": 10.0})
            )
        ),
        entry_to_json(bank_pb2.BankEntry.FromString(encode(entry(4, 4.0)))),
    ]
    store = BankStore(tmp_path / "bank")
    try:
        report = import_lines(store, incoming, policy)
    finally:
        store.close()
    before = {1: ("entry", 10.0), 2: ("default", 5.0), 3: ("default", 20.0), 4: ("entry", 3.0)}
    assert report.refused == [] and report.added == 0
    assert report.updated == sum(want[n] != before[n] for n in want)
    assert report.kept == sum(want[n] == before[n] for n in want)
    got = _contents(tmp_path / "bank")
    for n, (kind, us) in want.items():
        key = keys[n]
        assert (key in got["entries"], key in got["defaults"]) == (
            kind == "entry",
            kind == "default",
        ), n
        if kind == "entry":
            assert bank_pb2.BankEntry.FromString(got["entries"][key]).winner.median_us == us
        else:
            assert json.loads(got["defaults"][key])["default_us"] == us


def test_broken_default_records_and_trials_are_refused_other_devices_kept(tmp_path: Path) -> None:
    def default_line(key: bytes | str, **doc) -> str:
        return record_to_json(
            bank_pb2.ExportEntriesResponse(default_record=default_record(key, doc))
        )

    def trial_line(key: bytes, time_ns: int, text: str) -> str:
        t = bank_pb2.TrialRecord(key=key.decode(), time_ns=time_ns, trial_json=text)
        return record_to_json(bank_pb2.ExportEntriesResponse(trial=t))

    away = _key(1, foreign())
    lines = [
        default_line(away, default_us=3.0),
        trial_line(away, 10, '{"n": 1}'),
        default_line(_key(2), default_us=0.0),
        default_line(_key(2), default_us=1.0, reverted=["not-a-digest"]),
        default_line("v1/short/key/exact", default_us=1.0),
        trial_line(_key(3), 0, '{"n": 1}'),
        trial_line(_key(3), 11, "[1, 2]"),
        '{"trial": {"no_such_field": 1}}',
    ]
    store = BankStore(tmp_path / "bank")
    try:
        report = import_lines(store, lines)
        # Another device's default record and trial are kept (its key names that device).
        assert store.counts() == {"entries": 0, "defaults": 1, "history": 1}
    finally:
        store.close()
    assert report.added == 2
    reasons = [r for _, r in report.refused]
    assert len(reasons) == len(lines) - 2
    assert "no default timing" in reasons[0] and "64-digit" in reasons[1]
    assert "digests are not 32" in reasons[2] and "no time stamp" in reasons[3]
    assert "not a JSON object" in reasons[4] and reasons[5].startswith("not a bank record")


def _aoe(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The `aoe` command line in this process (no interpreter start-up per call)."""
    from aoe.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_lookup_stats_and_prune_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = make_entry(1, 5.0, "alpha")
    theirs = make_entry(2, 5.0, "beta", dev=foreign())
    custom = make_bank(tmp_path / "custom", [mine], trials=[(mine.key, {"n": i}) for i in range(5)])
    team = make_bank(tmp_path / "team", [theirs])

    code, out, err = _aoe(
        capsys, "bank", "lookup", "--key", mine.key.decode(), "--bank", str(custom), "--json"
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["layer"] == CUSTOM and doc["entry"]["provenance"]["host"] == "alpha"

    code, out, _ = _aoe(
        capsys,
        "bank",
        "lookup",
        "--signature-digest",
        theirs.signature.digest,
        "--bank",
        str(custom),
        "--bank-layer",
        str(team),
    )
    assert code == 1
    assert "other device fingerprint" in out and theirs.device.digest[:32] in out
    assert "Imaginary CPU 9000" in out and str(team) in out

    code, out, err = _aoe(
        capsys, "bank", "stats", "--bank", str(custom), "--bank-layer", str(team), "--json"
    )
    assert code == 0, err
    layers = json.loads(out)["layers"]
    assert [(s["name"], s["entries"], s["history"]) for s in layers] == [
        (CUSTOM, 1, 5),
        (str(team), 1, 0),
    ]

    code, out, err = _aoe(capsys, "bank", "prune", "--bank", str(custom))
    assert code == 0, err
    assert "removed 5 history trials, kept 1 entries" in out
    with open_bank(custom, use_env=False) as bank:
        [st] = bank.stats()
        assert (st.entries, st.history) == (1, 0)
        assert bank.lookup(mine.key)[0].provenance.host == "alpha"

    code, _, err = _aoe(
        capsys, "bank", "lookup", "--key", mine.key.decode(), "--bank", str(tmp_path / "nowhere")
    )
    assert code == 4 and "no bank here" in err


@pytest.mark.slow
def test_a_bank_exported_and_imported_compiles_the_same_model(models: Path, tmp_path: Path) -> None:
    """A tuned bank, with a task reverted in the model's context, exported and imported
    into an empty bank: `aoe compile` makes the same model from both, and leaves the
    reverted task unchanged in both (an export of entries alone would not)."""
    import dataclasses

    import onnx

    from aoe.bankrecord import decode
    from aoe.fingerprint import device_fingerprint
    from aoed.backends.ort.catalog import build_registry
    from aoed.bankcompile import compile_model
    from aoed.engine.assemble import model_signature, tunable_tasks
    from aoed.engine.prep import prepare

    src, a, b = models / "cnn.onnx", tmp_path / "a", tmp_path / "b"
    r = run_aoe(
        "tune",
        str(src),
        "--bank",
        str(a),
        "--output",
        str(tmp_path / "out"),
        "--budget",
        "2",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    prep = prepare(src, tmp_path / "prep")
    tasks = tunable_tasks(prep.model, prep.ctx, build_registry(), "exact")
    here_digest = device_fingerprint("CPUExecutionProvider").digest
    model_key = bank_key(model_signature(prep.model).digest, here_digest, "exact")

    def key(t) -> bytes:
        return bank_key(t.signature.digest, here_digest, "exact")

    store = BankStore(a)
    try:
        won = [
            t
            for t in tasks
            if (raw := store.get(key(t))) is not None and decode(raw).strategy != "default"
        ]
        # Where this run's measurements crowned fewer than two winners, give Conv(+BN)+Relu
        # tasks the fused kernel, as a run on a quieter machine may: one task to revert
        # in context, one to apply.
        ids = {t.id for t in won}
        extra = [
            t
            for t in tasks
            if t.family == "conv" and t.op_type.endswith("+Relu") and t.id not in ids
        ][: max(0, 2 - len(won))]
        records = [rec(sig=t.signature, strategy="fused_conv", family=t.family) for t in extra]
        store.commit(entries=[(x.key, encode(x)) for x in records])
        victim, applied = (won + extra)[:2]
        # Force a reversal in context into the model-level record, whichever kind it is.
        raw = store.get(model_key)
        if raw is not None:
            m = decode(raw)
            assert m.family == "session"
            gone = {d for d in m.params.get("reverted", "").split(",") if d} | {
                victim.signature.digest
            }
            m = dataclasses.replace(m, params={**m.params, "reverted": ",".join(sorted(gone))})
            store.commit(entries=[(model_key, encode(m))])
        else:
            doc = store.get_default(model_key)
            assert doc is not None and "reverted" in doc, doc
            store.commit(
                defaults=[
                    (
                        model_key,
                        {**doc, "reverted": sorted({*doc["reverted"], victim.signature.digest})},
                    )
                ]
            )
        counts_a = store.counts()
    finally:
        store.close()

    dump = tmp_path / "a.jsonl"
    r = run_aoe("bank", "export", "--bank", str(a), "-o", str(dump))
    assert r.returncode == 0, r.stderr
    r = run_aoe("bank", "import", str(dump), "--bank", str(b))
    assert r.returncode == 0, r.stderr
    assert " 0 refused" in r.stdout.splitlines()[0]
    store = BankStore(b)
    try:
        assert store.counts() == counts_a
    finally:
        store.close()

    compiled = {}
    for name, bank in (("a", a), ("b", b)):
        out = tmp_path / f"{name}.onnx"
        r = run_aoe("compile", str(src), "-o", str(out), "--bank", str(bank), "--json")
        assert r.returncode == 0, r.stderr
        report = {t["task_id"]: t for t in json.loads(r.stdout)["tasks"]}
        assert (
            report[victim.id]["status"] == "reverted" and report[applied.id]["status"] == "hit"
        ), name
        compiled[name] = onnx.load(str(out))
    ma, mb = compiled["a"], compiled["b"]
    assert mb.graph == ma.graph  # nodes, names, wiring, initializers
    assert {p.key: p.value for p in mb.metadata_props} == {
        p.key: p.value for p in ma.metadata_props
    }
    names = [n.name for n in ma.graph.node]
    assert not any(n.startswith(f"aoe/{victim.id}/") for n in names)  # left unchanged
    assert any(n.startswith(f"aoe/{applied.id}/") for n in names)

    # What went wrong before: without the model-level record (a default record, which
    # exports left behind, or an entry) the reverted task comes back rewritten.
    lines = [line for line in dump.read_text().splitlines() if model_key.decode() not in line]
    store = BankStore(tmp_path / "c")
    try:
        import_lines(store, lines)
    finally:
        store.close()
    with open_bank(tmp_path / "c", use_env=False) as reader:
        compile_model(src, tmp_path / "c.onnx", reader)
    names = [n.name for n in onnx.load(str(tmp_path / "c.onnx")).graph.node]
    assert any(n.startswith(f"aoe/{victim.id}/") for n in names)

"""Bank exchange and maintenance: export/import with merge policies, lookup, stats, prune
through the real `aoe bank` command, and the merge rules in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aoe.bank import CUSTOM, entry_to_json, open_bank
from aoe.signature import bank_key
from aoe.v1 import bank_pb2
from aoed.bank._codec import Measured, encode
from aoed.bank.exchange import import_lines
from aoed.bank.store import BankStore

from .conftest import run_aoe
from .test_bank_reader import foreign, here, make_bank, rec
from .test_bank_store import _signature


def _entry(n: int, median: float, host: str, dev=None, precision: str = "exact"):
    """A record for task n; provenance says where it came from. Digests are checked on
    import, so the signature digest is the real one of its canonical JSON except task n."""
    import hashlib

    s = _signature()
    text = s.canonical_json.replace('"v":1', f'"v":1,"task":{n}')
    sig = type(s)(s.op_type, s.domain, s.opset, text, hashlib.sha256(text.encode()).hexdigest())
    return rec(
        sig=sig, dev=dev, precision=precision, host=host, job_id=f"job-{host}-{n}",
        winner=Measured(median, 0.01, 30, median * 0.9), created_unix=1_700_000_000.0 + n,
    )  # fmt: skip


def _stored(path: Path) -> dict[bytes, bytes]:
    with open_bank(path, use_env=False) as bank:
        return {e.key.encode(): e.SerializeToString(deterministic=True) for _, e in bank.entries()}


@pytest.fixture
def banks(tmp_path: Path):
    a = {
        "k1": _entry(1, 5.0, "alpha"),  # faster than beta's
        "k2": _entry(2, 20.0, "alpha"),  # slower than beta's
        "k3": _entry(3, 7.0, "alpha"),  # alpha only
        "k5": _entry(5, 1.0, "alpha", dev=foreign()),  # measured elsewhere
    }
    b = {
        "k1": _entry(1, 10.0, "beta"),
        "k2": _entry(2, 10.0, "beta"),
        "k4": _entry(4, 3.0, "beta"),
    }
    make_bank(tmp_path / "alpha", a.values(), trials=[(a["k1"].key, {"n": 1})])
    return tmp_path, a, b


def test_export_then_import_keeps_the_faster_and_provenance(banks) -> None:
    tmp, a, b = banks
    dump = tmp / "alpha.jsonl"
    r = run_aoe("bank", "export", "--bank", str(tmp / "alpha"), "--output", str(dump))
    assert r.returncode == 0, r.stderr
    lines = dump.read_text().splitlines()
    assert len(lines) == 4
    assert lines == sorted(lines, key=lambda s: json.loads(s)["key"])  # key order: diffable
    for line in lines:
        assert list(json.loads(line)) == sorted(json.loads(line))

    make_bank(tmp / "beta", b.values())
    r = run_aoe("bank", "import", str(dump), "--bank", str(tmp / "beta"))
    assert r.returncode == 0, r.stderr
    assert "1 added, 1 updated, 1 kept, 1 refused (keep-faster)" in r.stdout
    assert a["k5"].key.decode() in r.stdout and "another device" in r.stdout
    got = _stored(tmp / "beta")
    assert got[a["k1"].key] == encode(a["k1"])  # faster incoming wins, byte for byte
    assert got[b["k2"].key] == encode(b["k2"])  # faster existing stays
    assert got[a["k3"].key] == encode(a["k3"])  # new key added as it was
    assert got[b["k4"].key] == encode(b["k4"])  # untouched
    assert a["k5"].key not in got  # foreign refused
    e = bank_pb2.BankEntry.FromString(got[a["k1"].key])
    assert (e.provenance.host, e.provenance.job_id) == ("alpha", "job-alpha-1")
    assert e.provenance.created.seconds == 1_700_000_001

    r = run_aoe("bank", "import", str(dump), "--bank", str(tmp / "beta"), "--allow-foreign")
    assert r.returncode == 0, r.stderr
    assert "1 added, 0 updated, 3 kept, 0 refused" in r.stdout
    assert _stored(tmp / "beta")[a["k5"].key] == encode(a["k5"])


@pytest.mark.parametrize(
    ("policy", "k1", "k2", "counts"),
    [
        ("keep-faster", "alpha", "beta", (1, 1, 1)),
        ("overwrite", "alpha", "alpha", (1, 2, 0)),
        ("keep-existing", "beta", "beta", (1, 0, 2)),
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
    assert [k for k, _ in report.refused] == [a["k5"].key.decode()]
    got = _stored(tmp / "beta")
    want = {"alpha": a, "beta": b}
    assert got[a["k1"].key] == encode(want[k1]["k1"])
    assert got[a["k2"].key] == encode(want[k2]["k2"])
    assert got[a["k3"].key] == encode(a["k3"])


def test_import_refuses_broken_lines_and_writes_nothing_for_them(tmp_path: Path) -> None:
    good = _entry(1, 5.0, "alpha")
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
    lines = ["{not json", "", entry_to_json(wrong_key), entry_to_json(tampered), entry_to_json(future)]
    store = BankStore(tmp_path / "bank")
    try:
        report = import_lines(store, lines)
        assert store.counts()["entries"] == 0
        again = import_lines(store, [entry_to_json(msg)] * 2)
    finally:
        store.close()
    reasons = [r for _, r in report.refused]
    assert len(reasons) == 4
    assert reasons[0].startswith("not a BankEntry") and report.refused[0][0] == "line 1"
    assert "key does not match" in reasons[1]
    assert "signature digest does not match" in reasons[2]
    assert "schema version 99" in reasons[3]
    assert (again.added, again.kept) == (1, 1)  # importing twice changes nothing


def _aoe(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The `aoe` command line in this process (no interpreter start-up per call)."""
    from aoe.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_lookup_stats_and_prune_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = _entry(1, 5.0, "alpha")
    theirs = _entry(2, 5.0, "beta", dev=foreign())
    custom = make_bank(tmp_path / "custom", [mine], trials=[(mine.key, {"n": i}) for i in range(5)])
    team = make_bank(tmp_path / "team", [theirs])

    code, out, err = _aoe(capsys, "bank", "lookup", "--key", mine.key.decode(), "--bank", str(custom), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["layer"] == CUSTOM and doc["entry"]["provenance"]["host"] == "alpha"

    code, out, _ = _aoe(capsys, "bank", "lookup", "--signature-digest", theirs.signature.digest,
                        "--bank", str(custom), "--bank-layer", str(team))  # fmt: skip
    assert code == 1
    assert "other device fingerprint" in out and theirs.device.digest[:32] in out
    assert "Imaginary CPU 9000" in out and str(team) in out

    code, out, err = _aoe(capsys, "bank", "stats", "--bank", str(custom), "--bank-layer", str(team), "--json")
    assert code == 0, err
    layers = json.loads(out)["layers"]
    assert [(s["name"], s["entries"], s["history"]) for s in layers] == [(CUSTOM, 1, 5), (str(team), 1, 0)]

    code, out, err = _aoe(capsys, "bank", "prune", "--bank", str(custom))
    assert code == 0, err
    assert "removed 5 history trials, kept 1 entries" in out
    with open_bank(custom, use_env=False) as bank:
        [st] = bank.stats()
        assert (st.entries, st.history) == (1, 0)
        assert bank.lookup(mine.key)[0].provenance.host == "alpha"

    code, _, err = _aoe(capsys, "bank", "lookup", "--key", mine.key.decode(), "--bank", str(tmp_path / "nowhere"))
    assert code == 4 and "no bank here" in err

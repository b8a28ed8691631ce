"""One writer per bank across processes: a second writer is refused naming the first, or
waits for it (cancellably); a writer killed with SIGKILL frees the bank; readers never
wait. Writers here are real processes: a holder, `aoe bank ...`, `aoe tune`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from aoe.bank import open_bank
from aoe.bankrecord import encode
from aoe.errors import BankBusyError
from aoe.exchange import entry_to_json
from aoe.fingerprint import device_fingerprint
from aoe.keys import bank_key
from aoe.v1 import bank_pb2
from aoed.bank.lock import LOCK_NAME
from aoed.bank.store import BankStore
from aoed.bank.writer import BankWrite, BankWriter

from .bank_util import make_bank, make_entry, rec
from .helpers import wait_for, wait_until

#: A pause in which a waiter that had wrongly stopped waiting would show it.
PAUSE_S = 0.1

# Holds the bank's writer lock, as a BankStore does from open to close, until its stdin
# closes. (The lock alone: it starts in a tenth of the time a store's imports take. A
# real store killed mid-write is in test_bank_processes.py.)
HOLDER = r"""
import sys
from aoed.bank.lock import WriterLock

lock = WriterLock(sys.argv[1])
lock.acquire()
print("ready", flush=True)
sys.stdin.read()
lock.release()
"""


def _hold(bank: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(bank)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "ready\n", proc.stderr.read() if proc.stderr else ""
    return proc


def _let_go(proc: subprocess.Popen) -> None:
    """End the holder (closing its stdin) and reap it; idempotent."""
    if proc.returncode is None:
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode in (0, -9), err


def _aoe(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The `aoe` command line in this process (no interpreter start-up per call)."""
    from aoe.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_second_writer_is_refused_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = rec()
    bank = make_bank(tmp_path / "bank", [entry], trials=[(entry.key, {"n": 1})])
    dump = tmp_path / "one.jsonl"
    dump.write_text(
        entry_to_json(bank_pb2.BankEntry.FromString(encode(make_entry(7, 2.0, "x")))) + "\n"
    )
    holder = _hold(bank)
    try:
        with pytest.raises(BankBusyError) as err:
            BankStore(bank)
        assert f"pid {holder.pid} " in err.value.holder and "python -c" in err.value.holder
        assert err.value.holder in str(err.value) and "--wait" in str(err.value)
        for args in (("import", str(dump)), ("prune",), ("verify", "--sample", "0")):
            code, out, msg = _aoe(capsys, "bank", *args, "--bank", str(bank))
            assert code == 4, (args, out, msg)
            assert msg.count("\n") == 1 and msg.startswith(
                f"aoe: error: bank {bank}: being written by pid {holder.pid} ("
            )
            assert "--wait" in msg
        # Readers never take the writer's lock, and nothing was written.
        code, out, msg = _aoe(capsys, "bank", "stats", "--bank", str(bank), "--json")
        assert code == 0, msg
        [layer] = json.loads(out)["layers"]
        assert (layer["entries"], layer["history"]) == (1, 1)
    finally:
        _let_go(holder)
    code, out, msg = _aoe(capsys, "bank", "prune", "--bank", str(bank))
    assert code == 0 and "removed 1 history trials" in out, msg


#: A waiter does nothing a test can see while the holder holds the lock: only a quiet
#: period can show that it neither gives up nor says "waiting" again, nor writes.
WAITER_QUIET_S = 10 * PAUSE_S


def test_wait_reports_the_holder_once_and_gets_in_after_it(tmp_path: Path) -> None:
    bank = make_bank(tmp_path / "bank", [rec()], trials=[(rec().key, {"n": i}) for i in range(3)])
    holder = _hold(bank)
    try:
        prune = subprocess.Popen(
            [sys.executable, "-m", "aoe.cli", "bank", "prune", "--wait", "--bank", str(bank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert prune.stderr is not None
        said = prune.stderr.readline()
        assert (
            said.startswith(f"aoe: bank {bank}: being written by pid {holder.pid} (")
            and "waiting" in said
        )
        time.sleep(WAITER_QUIET_S)
        assert prune.poll() is None  # still waiting, not failed
    finally:
        _let_go(holder)
    out, err = prune.communicate(timeout=60)
    assert prune.returncode == 0, err
    assert err == ""  # said once only
    assert "removed 3 history trials" in out


def test_a_holder_killed_with_sigkill_frees_the_bank(tmp_path: Path) -> None:
    bank = make_bank(tmp_path / "bank", [rec()])
    holder = _hold(bank)
    try:
        with pytest.raises(BankBusyError, match=f"pid {holder.pid} "):
            BankStore(bank)
        holder.kill()  # SIGKILL: no cleanup runs in the holder
        holder.communicate(timeout=30)
        assert holder.returncode == -9
    finally:
        if holder.returncode is None:
            holder.kill()
        _let_go(holder)
    store = BankStore(bank)  # no stale lock: the kernel dropped it with the process
    try:
        assert store.counts()["entries"] == 1
        assert json.loads((bank / LOCK_NAME).read_text())["pid"] != holder.pid
    finally:
        store.close()


# --------------------------------------------------------------------------- BankWriter


async def test_bank_writer_waits_in_trio_saying_so_once(tmp_path: Path) -> None:
    entry = rec()
    bank = make_bank(tmp_path / "bank", [entry])
    holder = _hold(bank)
    said: list[str] = []
    writer = BankWriter(bank, layers=[], on_wait=said.append)
    got = []
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)

            async def write_and_look_up() -> None:
                await writer.write(BankWrite(trials=((entry.key, {"n": 1}),)))
                got.append(await writer.lookup(entry.key))

            nursery.start_soon(write_and_look_up)
            await wait_until(lambda: said, 30, "the writer saying it waits", poll=PAUSE_S / 2)
            await trio.sleep(WAITER_QUIET_S)  # the trio loop runs on while the writer waits
            assert got == [] and len(said) == 1
            assert said[0].startswith(f"bank {bank}: being written by pid {holder.pid} (")
            await trio.to_thread.run_sync(_let_go, holder)
            await wait_until(lambda: got, 30, "the lookup after the write", poll=PAUSE_S / 2)
            nursery.cancel_scope.cancel()
        assert got == [entry] and len(said) == 1
    finally:
        writer.close()
        _let_go(holder)
    with open_bank(bank, use_env=False) as reader:
        assert reader.stats()[0].history == 1


async def test_bank_writer_without_wait_fails_and_a_cancelled_wait_holds_nothing(
    tmp_path: Path,
) -> None:
    entry = rec()
    bank = make_bank(tmp_path / "bank", [entry])
    holder = _hold(bank)
    try:
        impatient = BankWriter(bank, layers=[], wait=False)
        with pytest.raises(BankBusyError, match=f"pid {holder.pid} "):
            await impatient.lookup(entry.key)
        impatient.close()
        patient = BankWriter(bank, layers=[])
        with trio.move_on_after(5 * PAUSE_S) as scope:
            await patient.lookup(entry.key)
        assert scope.cancelled_caught
    finally:
        _let_go(holder)
    # Neither left a lock or a thread behind that could take it: the bank is free.
    store = BankStore(bank)
    store.close()
    assert await patient.lookup(entry.key) == entry  # and the cancelled one can try again
    patient.close()


def test_an_unused_bank_writer_leaves_no_trace(tmp_path: Path) -> None:
    writer = BankWriter(tmp_path / "bank", layers=[])
    writer.close()
    assert not (tmp_path / "bank").exists()


# --------------------------------------------------------------------------- a real tune


@pytest.mark.slow
@pytest.mark.long
def test_import_and_prune_wait_for_a_tune_and_nothing_is_lost(models: Path, tmp_path: Path) -> None:
    from aoed.backends.ort.catalog import build_registry
    from aoed.engine.assemble import model_signature, tunable_tasks
    from aoed.engine.prep import prepare

    bank, out = tmp_path / "bank", tmp_path / "out"
    imported = [make_entry(n, 3.0 + n, "team") for n in range(1, 4)]
    dump = tmp_path / "team.jsonl"
    dump.write_text(
        "".join(entry_to_json(bank_pb2.BankEntry.FromString(encode(r))) + "\n" for r in imported)
    )
    tune = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aoe.cli",
            "tune",
            str(models / "mlp.onnx"),
            "--bank",
            str(bank),
            "--output",
            str(out),
            "--budget",
            "10",
            "--parallel",
            "1",
            "--no-progress",
            "--job-type",
            "opat",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    others: list[subprocess.Popen] = []
    try:

        def holding() -> bool:
            assert tune.poll() is None, tune.communicate()
            try:
                return json.loads((bank / LOCK_NAME).read_text())["pid"] == tune.pid
            except (OSError, ValueError):
                return False

        wait_for(holding, 120, "the tune holding the bank", poll=0.02)
        for args in (("import", str(dump)), ("prune",)):
            others.append(
                subprocess.Popen(
                    [sys.executable, "-m", "aoe.cli", "bank", *args, "--wait", "--bank", str(bank)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        _out, t_err = tune.communicate(timeout=300)
        assert tune.returncode == 0, t_err
        results = [p.communicate(timeout=120) for p in others]
    finally:
        for p in [tune, *others]:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, e) in zip(others, results, strict=True):
        assert p.returncode == 0, e
        assert (
            e.startswith(f"aoe: bank {bank}: being written by pid {tune.pid} (")
            and e.count("\n") == 1
        ), e
    assert "3 added" in results[0][0]

    [result] = out.glob("aoe_result_opat_*.json")
    doc = json.loads(result.read_text())
    summary = doc["OPAT"]["repo_summary"]
    prep = prepare(models / "mlp.onnx", tmp_path / "prep")
    sig = {
        t.id: t.signature for t in tunable_tasks(prep.model, prep.ctx, build_registry(), "exact")
    }
    here = device_fingerprint("CPUExecutionProvider").digest
    with open_bank(bank, use_env=False) as reader:
        [st] = reader.stats()
        for t in doc["tasks"]:
            key = bank_key(sig[t["task_id"]].digest, here, "exact")
            if t["update_mode"] in ("add", "update"):
                assert reader.lookup(key)[0].strategy.name == t["strategy"], t["task_id"]
            elif t["update_mode"] == "unsatisfied":
                assert reader.lookup_default(key)[0] is not None, t["task_id"]
        model_key = bank_key(model_signature(prep.model).digest, here, "exact")
        if doc["session_options"]:
            assert json.loads(reader.lookup(model_key)[0].strategy.name) == doc["session_options"]
        # The model-level record (session options, or "the defaults stayed best") is the
        # bank's, not a task decision: the tally counts tasks only (aoe.outcome).
        model_entry = reader.lookup(model_key)[0] is not None
        model_default = reader.lookup_default(model_key)[0] is not None
        for r in imported:
            assert reader.lookup(r.key)[0].SerializeToString(deterministic=True) == encode(r)
    assert st.entries == len(imported) + summary["repo_add_num"] + model_entry
    assert st.defaults == summary["repo_unsatisfied_num"] + model_default

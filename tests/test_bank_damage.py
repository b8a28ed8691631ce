"""A damaged bank is refused with an error naming its data file and what to do, never
a signal: LMDB maps data.mdb and trusts it, so a page the file lacks is SIGBUS and a
damaged page can be SIGABRT or SIGSEGV (aoe.lmdbcheck).

Banks here are written by the real store, then truncated or overwritten in place as a
failed copy or a failing disk would; whatever might die of a signal runs in a process
of its own (the `aoe` command, a daemon), whose exit status is checked. What LMDB does
when it gives up on a bank (MDB_PANIC) is caused in the test's own process by making
the write of a meta page fail, as a failing disk would.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import trio

from aoe.errors import BankDamagedError, BankError
from aoe.lmdbcheck import cover_last_page, find_damage
from aoe.lmdbenv import bank_error
from aoe.v1 import tuning_pb2
from aoed.bank.store import BankStore
from aoed.bank.writer import BankWrite, BankWriter
from tests.conftest import run_aoe
from tests.daemon_util import DaemonProcess, submit_sample
from tests.helpers import wait_for

S = tuning_pb2
EXIT_BANK = BankError.exit_code


def key(i: int) -> bytes:
    return f"v1/{i:032x}/{'0' * 32}/exact".encode()


def write_bank(path: Path, *, prune: bool = True) -> list[bytes]:
    """A bank of some 600 pages written by the store as aoed writes one: entries and
    their trials in a few commits; the roots of the last commit are its last pages.
    With `prune`, a large entry comes, the history is dropped (which frees most pages)
    and small commits follow, which take pages from the free list: the roots are then
    early in the file, and live pages remain at its end. Returns the entries' keys."""
    s = BankStore(path)
    try:
        for b in range(0, 2000, 500):
            s.commit(
                entries=[(key(i), bytes([i % 251]) * 200) for i in range(b, b + 500)],
                trials=[(key(i), {"n": i, "pad": "x" * 100}) for i in range(b, b + 500)],
            )
        if prune:
            s.commit(entries=[(key(7000), b"q" * 20000)])
            s.prune()
            for j in range(3):
                s.commit(entries=[(key(9000 + j), b"z" * 200)])
    finally:
        s.close()
    return [key(i) for i in (*range(2000), *((7000, 9000, 9001, 9002) if prune else ()))]


def truncate(path: Path, how: str) -> Path:
    """Cut the bank's data file as a copy or a restore cut short would; returns it."""
    data = path / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, {"half": size // 2, "tail": size - 8 * 4096, "meta": 100, "empty": 0}[how])
    return data


def zero_pages_holding(path: Path, needle: bytes) -> int:
    """Overwrite with zeros every page of the bank's data file that holds `needle` (a
    key: its leaf, its log lines and every older copy), as a disk returning zeroed
    blocks would; returns how many."""
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    n = 0
    for at in range(2 * 4096, len(raw), 4096):
        if needle in raw[at : at + 4096]:
            raw[at : at + 4096] = bytes(4096)
            n += 1
    data.write_bytes(raw)
    return n


def assert_refused(r: subprocess.CompletedProcess, data: Path) -> None:
    """A clean exit with BankError's status and one message that names the data file,
    says it is damaged and what to do; no signal, no traceback."""
    assert r.returncode == EXIT_BANK, (r.returncode, r.stdout, r.stderr)
    err = r.stderr
    assert f"its data file {data} is damaged" in err, err
    assert "aoe bank check" in err and "move" in err and "restore the bank from an export" in err
    assert "Traceback" not in err and "free disk space" not in err, err


# ---------------------------------------------------------------- a truncated bank


@pytest.mark.parametrize("how", ["half", "tail", "meta", "empty"])
def test_a_truncated_bank_is_refused_by_lookup_and_compile_not_sigbus(
    tmp_path: Path, models: Path, how: str
) -> None:
    """`tail` keeps every root page: only a walk of the pages finds that live ones are
    gone. `empty`: a writer would have taken it for a new bank, every record gone
    without a word."""
    bank = tmp_path / "bank"
    keys = write_bank(bank)
    data = truncate(bank, how)
    for args in (
        ("bank", "lookup", "--key", keys[1999].decode()),
        ("compile", str(models / "mlp.onnx"), "-o", str(tmp_path / "out.onnx")),
        ("bank", "export", "--output", str(tmp_path / "x.jsonl")),
    ):
        assert_refused(run_aoe(*args, "--bank", str(bank)), data)


@pytest.mark.slow
def test_embedded_tune_on_a_truncated_bank_is_refused_not_sigbus(
    tmp_path: Path, models: Path
) -> None:
    bank = tmp_path / "bank"
    write_bank(bank)
    data = truncate(bank, "half")
    before = data.read_bytes()
    r = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--bank",
        str(bank),
        "--output",
        str(tmp_path / "out"),
        "--budget",
        "1",
        "--parallel",
        "1",
        "--no-progress",
    )
    assert_refused(r, data)
    assert data.read_bytes() == before, "a refused bank is left as it was"


def test_a_bank_that_ends_in_pages_lmdb_never_wrote_is_whole(tmp_path: Path) -> None:
    """LMDB counts pages a transaction took from the end and gave back without writing
    them, so a healthy file can be shorter than its meta page says. Such a file is
    walked, found whole and opened (a check of its size alone would refuse it)."""
    path = tmp_path / "env"
    env = lmdb.open(str(path), map_size=1 << 32, max_dbs=2)
    try:
        db = env.open_db(b"x")
        rng = random.Random(2)
        for _ in range(100):  # puts, then deletes under a cursor, in each transaction
            with env.begin(write=True, db=db) as txn:
                keys = [rng.randbytes(8) for _ in range(rng.randint(1, 3000))]
                for k in keys:
                    txn.put(k, rng.randbytes(rng.choice([50, 300, 5000])))
                for k in keys[: int(len(keys) * rng.random())]:
                    txn.delete(k)
                if rng.random() < 0.2:
                    for k, _ in txn.cursor():
                        if rng.random() < 0.5:
                            txn.delete(k)
            needs = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            if (path / "data.mdb").stat().st_size < needs:
                break
        else:
            pytest.fail("LMDB wrote every page it counts in 100 transactions: find another case")
        assert find_damage(path) == []
        r = run_aoe("bank", "check", "--bank", str(path))
        assert r.returncode == 0 and f"bank {path}: whole" in r.stdout, (r.stdout, r.stderr)
        st = (path / "data.mdb").stat()
        cover_last_page(env, path / "data.mdb", (st.st_dev, st.st_ino))
        assert (path / "data.mdb").stat().st_size == needs
    finally:
        env.close()


def test_the_store_leaves_its_data_file_as_long_as_its_last_commit_counts(tmp_path: Path) -> None:
    """So that readers, which check only the size, never need to walk a healthy bank."""
    path = tmp_path / "bank"
    s = BankStore(path)
    try:
        rng = random.Random(3)  # (a sequence that leaves pages unwritten at the end)
        for i in range(4):
            n = rng.randint(1, 3000)
            size = rng.choice
            s.commit(
                decisions=[
                    (b"run/%d/%08d" % (i, j), {"s": "x" * size([50, 300, 5000])}) for j in range(n)
                ],
                trials=[(key(rng.randrange(5000)), {"n": 1}) for _ in range(rng.randint(0, 500))],
            )
            if rng.random() < 0.5:
                s.commit(forget=[b"run/%d/" % i])
            if rng.random() < 0.2:
                s.prune()
            needs = (s.env.info()["last_pgno"] + 1) * s.env.stat()["psize"]
            assert (path / "data.mdb").stat().st_size >= needs, i
    finally:
        s.close()


# ---------------------------------------------------------------- damage in place


def test_pages_damaged_in_place_are_refused_by_the_writer_before_lmdb_reads_them(
    tmp_path: Path, models: Path
) -> None:
    """Zeroed pages made LMDB fail an assertion (SIGABRT) or report a failed transaction
    with the advice for a full disk; the writer walks every page before LMDB maps one."""
    bank = tmp_path / "bank"
    keys = write_bank(bank)
    assert zero_pages_holding(bank, keys[1000]) >= 2
    data = bank / "data.mdb"
    export = tmp_path / "in.jsonl"
    export.write_text("")
    # The writer: what `aoe bank import` (and aoed, and `aoe tune`) opens.
    assert_refused(run_aoe("bank", "import", str(export), "--bank", str(bank)), data)
    r = run_aoe("bank", "check", "--bank", str(bank))
    assert r.returncode == EXIT_BANK and f"problems in {data}:" in r.stdout, (r.stdout, r.stderr)
    assert "stores mp_pgno 0" in r.stdout, r.stdout


def test_a_page_lmdb_finds_damaged_is_a_damaged_bank_error_for_a_reader(tmp_path: Path) -> None:
    """A reader only checks the size (a walk per command would cost too much): a page
    damaged in place is met by LMDB, whose error names the data file and the remedies."""
    bank = tmp_path / "bank"
    keys = write_bank(bank)
    zero_pages_holding(bank, keys[1000])
    r = run_aoe("bank", "lookup", "--key", keys[1000].decode(), "--bank", str(bank))
    assert_refused(r, bank / "data.mdb")
    assert "LMDB found" in r.stderr and "MDB_CORRUPTED" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "cls",
    [
        lmdb.CorruptedError,
        lmdb.PageNotFoundError,
        lmdb.BadTxnError,
        lmdb.PageFullError,
        lmdb.CursorFullError,
    ],
)
def test_lmdb_errors_that_mean_damage_say_damaged_not_full_disk(tmp_path: Path, cls) -> None:
    """MDB_BAD_TXN and MDB_PAGE_FULL came with "check free disk space and the
    permissions": a transaction LMDB failed inside its own calls met a damaged page."""
    err = bank_error(cls(f"mdb_del: {cls.__name__}"), tmp_path, "write")
    msg = str(err)
    assert isinstance(err, BankDamagedError), msg
    assert f"its data file {tmp_path / 'data.mdb'} is damaged: write failed" in msg, msg
    assert "aoe bank check" in msg and "free disk space" not in msg, msg


# ---------------------------------------------------------------- aoe bank check


def test_bank_check_passes_a_whole_bank_and_lists_what_a_truncated_one_lacks(
    tmp_path: Path,
) -> None:
    bank, layer = tmp_path / "bank", tmp_path / "layer"
    write_bank(bank)
    shutil.copytree(bank, layer)
    r = run_aoe("bank", "check", "--bank", str(bank), "--bank-layer", str(layer))
    assert r.returncode == 0, (r.stdout, r.stderr)
    for path in (bank, layer):
        assert f"bank {path}: whole: " in r.stdout and "records read in 8 databases" in r.stdout
    data = truncate(layer, "tail")
    r = run_aoe("bank", "check", "--bank", str(bank), "--bank-layer", str(layer))
    assert r.returncode == EXIT_BANK, (r.stdout, r.stderr)
    assert f"bank {bank}: whole" in r.stdout and f"problems in {data}:" in r.stdout, r.stdout
    assert "short of the" in r.stdout and "is beyond EOF" in r.stdout, r.stdout
    assert f"its data file {data} is damaged" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- the daemon


@pytest.mark.slow
def test_a_daemon_on_a_truncated_bank_serves_without_it_and_a_resumed_job_fails(
    tmp_path: Path,
) -> None:
    """It died of SIGBUS at the first use of the bank, resumed the job at its restart and
    died again. Now it says once that the bank is refused, fails the resumed job (and
    every job that needs the bank) with the error, serves the rest, and uses a bank put
    in its place at once."""
    d = DaemonProcess(tmp_path / "d")
    write_bank(d.bank, prune=False)  # its roots in the pages a truncation cuts first
    try:
        d.start()
        job_id = submit_sample(d, "mlp", budget=120)

        def tuning() -> bool:
            job = d.tuning().GetJob(S.GetJobRequest(job_id=job_id), timeout=10).job
            return job.state == S.JOB_STATE_TUNING

        wait_for(tuning, 120, "the job tunes")
        d.kill()
        data = truncate(d.bank, "half")

        d.start()  # the job resumes at once
        job = d.wait_job(job_id)
        assert job.state == S.JOB_STATE_FAILED and job.error_kind == "BankDamagedError", job
        assert f"its data file {data} is damaged" in job.error, job.error
        assert d.proc is not None and d.proc.poll() is None and d.serving()
        again = d.wait_job(submit_sample(d, "mlp", budget=1))
        assert again.state == S.JOB_STATE_FAILED and again.error == job.error, again
        said = [line for line in d.log().splitlines() if "the bank is not used" in line]
        assert len(said) == 1 and str(data) in said[0], said

        os.rename(d.bank, tmp_path / "bank.damaged")  # moved aside: a new bank starts
        fresh = d.wait_job(submit_sample(d, "mlp", budget=1))
        assert fresh.state == S.JOB_STATE_SUCCEEDED, fresh
        assert d.stop() == 0
    finally:
        d.close()


# ---------------------------------------------------------------- LMDB gives up


def _fail_meta_writes(data: Path) -> None:
    """Make the next commit's write of a meta page fail, as a failing disk's would: LMDB
    writes meta pages through a descriptor of their own (opened O_WRONLY|O_DSYNC), which
    is pointed here at a read-only open of the same file (EBADF)."""
    target = str(data.resolve())
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != target:
                continue
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY:
                continue
        except OSError:
            continue
        ro = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
        os.dup2(ro, fd)
        os.close(ro)
        return
    raise AssertionError(f"no descriptor of {data} opened for writing in this process")


async def test_a_bank_lmdb_gave_up_on_is_refused_and_the_writer_goes_on(tmp_path: Path) -> None:
    """After a failed write of a meta page LMDB answers every transaction with MDB_PANIC
    ("damaged or not LMDB's ... restore the bank", of a file that is whole). The writer
    reports that it gave up, refuses the bank from then on without touching it again,
    and keeps answering; reopened, the bank holds every commit before the failure."""
    path = tmp_path / "bank"
    writer = BankWriter(path, layers=[])
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        try:
            await writer.write(BankWrite(trials=((key(1), {"n": 1}),)))
            _fail_meta_writes(path / "data.mdb")
            with pytest.raises(BankError):  # the commit whose meta page was not written
                await writer.write(BankWrite(trials=((key(2), {"n": 2}),)))
            with pytest.raises(BankDamagedError) as err:
                await writer.write(BankWrite(trials=((key(3), {"n": 3}),)))
            msg = str(err.value)
            assert f"bank {path}: write failed: LMDB gave up on the bank" in msg, msg
            assert "MDB_PANIC" in msg and "aoe bank check" in msg, msg
            assert writer.refused == msg
            for call in (writer.store, writer.head, lambda: writer.changes(0, 10)):
                with pytest.raises(BankDamagedError, match="LMDB gave up"):
                    await call()
            with pytest.raises(BankDamagedError):  # the queue is still served
                await writer.write(BankWrite(trials=((key(4), {"n": 4}),)))
        finally:
            nursery.cancel_scope.cancel()
    writer.close()
    assert find_damage(path, walk=True) == []
    s = BankStore(path)
    try:
        assert s.counts()["history"] == 1
    finally:
        s.close()


def test_a_refused_bank_never_dies_of_a_signal_in_a_process_of_its_own(tmp_path: Path) -> None:
    """The store itself, in a process of its own, on every kind of truncation: a clean
    BankDamagedError, never a signal."""
    bank = tmp_path / "bank"
    write_bank(bank)
    pristine = tmp_path / "pristine"
    shutil.copytree(bank, pristine)
    code = (
        "import sys\n"
        "from aoe.errors import BankDamagedError\n"
        "from aoed.bank.store import BankStore\n"
        "try:\n"
        "    BankStore(sys.argv[1]).counts()\n"
        "except BankDamagedError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(4)\n"
    )
    for how in ("half", "tail", "meta", "empty"):
        shutil.rmtree(bank)
        shutil.copytree(pristine, bank)
        truncate(bank, how)
        r = subprocess.run(
            [sys.executable, "-c", code, str(bank)], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 4, (how, r.returncode, r.stderr)
        assert f"its data file {bank / 'data.mdb'} is damaged" in r.stdout, (how, r.stdout)

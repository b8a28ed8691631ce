"""The inbox watcher on real folders, real file notifications and a real job store.

No tuning engine runs here: the watcher meets the job manager only through `submit`,
`get`, `on_final`, `store` and `engine.device.device`, and `Jobs` below stands in for it
over the same real JobStore, so a test can end a job as it likes. The daemon's own tests
(test_daemon.py) drop a model into a real daemon's inbox end to end."""

from __future__ import annotations

import grp
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from aoe.config import load_config
from aoe.errors import AoedError, NotFoundError, OptionError, ResourceExhaustedError
from aoe.figures import Figures
from aoe.outcome import JobOutcome
from aoe.spec import JobSpec
from aoed.config import DaemonConfig, Inbox, load_daemon_config
from aoed.jobs.admission import Submission
from aoed.jobs.manager import JobManager
from aoed.jobs.states import JobState
from aoed.jobs.store import JobRow, JobStore
from aoed.watch import Watcher
from aoed.watch.watcher import CLAIM_TRIES
from tests.helpers import wait_until

MODEL = b"\x08\x07" + bytes(range(256)) * 40  # content only: the watcher never parses models


class Jobs:
    """The part of JobManager the watcher uses, over a real JobStore: submissions are
    recorded (with the bytes the model had when submitted) and end when `finish` says."""

    def __init__(self, store: JobStore):
        self.store = store
        self.on_final: list[Callable[[JobRow], None]] = []
        self.submitted: list[tuple[Submission, bytes, JobRow]] = []
        self.refuse: list[AoedError] = []
        self.attempts = 0

    async def submit(self, sub: Submission) -> tuple[JobRow, bool]:
        self.attempts += 1
        await trio.lowlevel.checkpoint()
        if self.refuse:
            raise self.refuse.pop(0)
        data = sub.model.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        row = JobRow(
            id=f"job-{len(self.submitted) + 1}",
            state=JobState.QUEUED,
            model_path=str(sub.model),
            model_name=sub.model.name,
            model_sha256=sha,
            dedup_key=sha,
            spec=sub.spec,
            output_dir="",
            source=sub.source,
        )
        self.store.insert(row)
        self.submitted.append((sub, data, row))
        return row, False

    def get(self, job_id: str) -> JobRow:
        row = self.store.get(job_id)
        if row is None:
            raise NotFoundError(f"no job {job_id!r}")
        return row

    def finish(
        self, job_id: str, state: str, outcome: JobOutcome | None = None, error: str = ""
    ) -> None:
        self.store.update(job_id, state=JobState(state), outcome=outcome, error=error)
        row = self.get(job_id)
        for fn in self.on_final:
            fn(row)

    # the manager's own claims (they go to `self.store`, as the manager's go to its store)
    claims = JobManager.claims
    claim_begin = JobManager.claim_begin
    claim_done = JobManager.claim_done
    claim_drop = JobManager.claim_drop

    def names(self) -> list[str]:
        return [sub.model.name for sub, _, _ in self.submitted]


def _config(tmp_path: Path, stable_s: float = 0.2, *names: str) -> DaemonConfig:
    inboxes = tuple(
        Inbox(tmp_path / n, tmp_path / f"{n}-outbox", tmp_path / f"{n}-failed", stable_s)
        for n in (names or ("inbox",))
    )
    return DaemonConfig(
        engine=load_config(env={}), state_dir=tmp_path / "state", socket=None, inboxes=inboxes
    )


@asynccontextmanager
async def _watching(cfg: DaemonConfig, jobs: Jobs, **attrs: float) -> AsyncIterator[Watcher]:
    watcher = Watcher(cfg, jobs)  # type: ignore[arg-type]  # Jobs stands in for JobManager
    for k, v in attrs.items():
        setattr(watcher, k, v)
    async with trio.open_nursery() as nursery:
        await nursery.start(watcher.run)
        yield watcher
        nursery.cancel_scope.cancel()


def _store(tmp_path: Path) -> JobStore:
    return JobStore(tmp_path / "state" / "jobs.sqlite3")


async def _fence(jobs: Jobs, inbox: Path, name: str = "fence.onnx") -> None:
    """Drop a model into `inbox` the ordinary way (it settles for the inbox's stable_s) and
    wait for its submission: a file the watcher was already settling is settled by then,
    so what was not submitted before the fence was not taken at all."""
    (inbox / name).write_bytes(MODEL)
    await wait_until(lambda: name in jobs.names(), 30, "name in jobs.names()")


@pytest.mark.long
async def test_a_file_written_slowly_is_submitted_once_and_only_complete(tmp_path: Path) -> None:
    cfg = _config(tmp_path, stable_s=2.0)
    jobs = Jobs(_store(tmp_path))
    chunks = [MODEL[i : i + 2000] for i in range(0, len(MODEL), 2000)][:6]
    async with _watching(cfg, jobs):
        with open(tmp_path / "inbox" / "slow.onnx", "wb") as f:  # noqa: ASYNC230 (a few KiB)
            # The writer pauses 0.3 s between writes: the writing spans several of the
            # watcher's 0.5 s looks, and each pause is far shorter than stable_s, so even a
            # stalled test process does not look like a finished file.
            for chunk in chunks:
                f.write(chunk)
                f.flush()
                await trio.sleep(0.3)
                assert not jobs.submitted, "taken while it was still being written"
        await wait_until(lambda: len(jobs.submitted) == 1, 5.0, "len(jobs.submitted) == 1")
        await _fence(jobs, tmp_path / "inbox")
    assert jobs.names() == ["slow.onnx", "fence.onnx"], "submitted once"
    assert jobs.submitted[0][1] == b"".join(chunks)
    assert not (tmp_path / "inbox" / "slow.onnx").exists()


async def test_a_file_renamed_from_a_part_name_is_taken_at_once(tmp_path: Path) -> None:
    # Settling would take an hour: only the rename makes the file complete within the test.
    cfg = _config(tmp_path, stable_s=3600.0)
    jobs = Jobs(_store(tmp_path))
    async with _watching(cfg, jobs):
        part = tmp_path / "inbox" / "x.onnx.part"
        part.write_bytes(MODEL)
        await trio.sleep(0.3)  # the writer finishes, then renames
        part.rename(tmp_path / "inbox" / "x.onnx")
        await wait_until(lambda: len(jobs.submitted) == 1, 60, "len(jobs.submitted) == 1")
    assert jobs.names() == ["x.onnx"] and jobs.submitted[0][1] == MODEL


async def test_ignored_names_are_never_submitted(tmp_path: Path) -> None:
    cfg = _config(tmp_path, stable_s=0.2)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    outside = tmp_path / "elsewhere.onnx"
    outside.write_bytes(MODEL)
    ignored = [".hidden.onnx", "a.onnx~", "b.onnx.part", "notes.txt", "model.onnx.bak"]
    (inbox / ignored[0]).write_bytes(MODEL)  # before the start: the scan must skip it too
    (inbox / "link.onnx").symlink_to(outside)
    (inbox / "dir.onnx").mkdir()
    (inbox / "sub").mkdir()
    (inbox / "aoed.toml").write_text("")
    jobs = Jobs(_store(tmp_path))
    async with _watching(cfg, jobs):
        for name in ignored[1:]:
            (inbox / name).write_bytes(MODEL)
        (inbox / "sub" / "c.onnx").write_bytes(MODEL)
        (inbox / "ok.onnx").write_bytes(MODEL)  # the control: the watcher was working
        await wait_until(lambda: len(jobs.submitted) == 1, 5.0, "len(jobs.submitted) == 1")
        await _fence(jobs, inbox)
    assert jobs.names() == ["ok.onnx", "fence.onnx"]
    assert all((inbox / name).exists() for name in ignored) and (inbox / "sub" / "c.onnx").exists()
    assert (inbox / "link.onnx").is_symlink() and outside.exists()


async def test_a_file_present_before_the_start_is_taken_by_the_initial_scan(tmp_path: Path) -> None:
    cfg = _config(tmp_path, stable_s=0.2)
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "early.onnx").write_bytes(MODEL)
    store = _store(tmp_path)
    jobs = Jobs(store)
    async with _watching(cfg, jobs):
        await wait_until(lambda: len(jobs.submitted) == 1, 3.0, "len(jobs.submitted) == 1")
    sub, data, row = jobs.submitted[0]
    assert data == MODEL and sub.model.is_relative_to(cfg.claims_dir)
    assert sub.source == f"inbox:{tmp_path / 'inbox'}"
    [claim] = store.claims()
    assert (claim.state, claim.job_id, claim.src) == (
        "claimed",
        row.id,
        str(tmp_path / "inbox" / "early.onnx"),
    )
    assert not (tmp_path / "inbox" / "early.onnx").exists()


async def test_crashes_at_each_step_of_a_claim_each_give_one_submission(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, stable_s=0.2)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    store = _store(tmp_path)
    # a: the claim was recorded, the rename never happened
    (inbox / "a.onnx").write_bytes(MODEL)
    store.claim_begin(str(inbox / "a.onnx"), str(cfg.claims_dir / "u1" / "a.onnx"), str(inbox))
    # b: the daemon's copy was made, the job was never recorded
    dst_b = cfg.claims_dir / "u2" / "b.onnx"
    dst_b.parent.mkdir(parents=True)
    dst_b.write_bytes(MODEL[::-1])
    store.claim_begin(str(inbox / "b.onnx"), str(dst_b), str(inbox))
    # c: the rename happened, the daemon's copy of the moved file was never made
    dst_c = cfg.claims_dir / "u4" / "c.onnx"
    dst_c.parent.mkdir(parents=True)
    (dst_c.parent / ".moved").write_bytes(MODEL[1:])
    store.claim_begin(str(inbox / "c.onnx"), str(dst_c), str(inbox))
    # d: the copy was made, the moved file was never removed
    dst_d = cfg.claims_dir / "u5" / "d.onnx"
    dst_d.parent.mkdir(parents=True)
    dst_d.write_bytes(MODEL[2:])
    (dst_d.parent / ".moved").write_bytes(b"the moved file, copied already")
    store.claim_begin(str(inbox / "d.onnx"), str(dst_d), str(inbox))
    # a claimed copy no claim refers to
    (cfg.claims_dir / "u3").mkdir()
    (cfg.claims_dir / "u3" / "junk.onnx").write_bytes(b"x")
    jobs = Jobs(store)
    async with _watching(cfg, jobs):
        await wait_until(lambda: len(jobs.submitted) == 4, 5.0, "len(jobs.submitted) == 4")
        await _fence(jobs, inbox)
    names = ["a.onnx", "b.onnx", "c.onnx", "d.onnx"]
    assert sorted(jobs.names()[:4]) == names and jobs.names()[4:] == ["fence.onnx"]
    by_name = {sub.model.name: (sub, data, row) for sub, data, row in jobs.submitted}
    assert [by_name[n][1] for n in names] == [MODEL, MODEL[::-1], MODEL[1:], MODEL[2:]]
    assert [by_name[n][0].model for n in names[1:]] == [dst_b, dst_c, dst_d]
    claims = {Path(c.src).name: c for c in store.claims()}
    assert {n: (c.state, c.job_id) for n, c in claims.items()} == {
        n: ("claimed", by_name[n][2].id) for n in [*names, "fence.onnx"]
    }
    assert not (cfg.claims_dir / "u3").exists() and not list(inbox.glob("*.onnx"))
    assert not list(cfg.claims_dir.glob("*/.moved")), "a moved file goes once it is copied"


def _rewrite(fd: int, data: bytes) -> None:
    """Rewrite the file of the read-only descriptor `fd` through a write descriptor of
    it, opened through /proc: the same file, wherever it has been renamed to."""
    with open(f"/proc/self/fd/{fd}", "r+b") as f:
        f.write(data)
        f.truncate()


async def test_writes_through_a_descriptor_of_the_dropped_file_never_reach_its_job(
    tmp_path: Path,
) -> None:
    """Whoever dropped a file may keep a descriptor of it (here a read-only one, which the
    writer check allows, opened for writing once the file is claimed: as a write
    descriptor kept open through a pause would be). The job gets the daemon's own copy,
    so what was hashed is what runs, whatever is written to the dropped file later."""
    cfg = _config(tmp_path, stable_s=0.2)
    inbox = cfg.inboxes[0].path
    inbox.mkdir()
    (inbox / "held.onnx").write_bytes(MODEL)
    kept = os.open(inbox / "held.onnx", os.O_RDONLY)
    try:
        jobs = Jobs(_store(tmp_path))
        async with _watching(cfg, jobs):
            await wait_until(lambda: len(jobs.submitted) == 1, 5.0, "len(jobs.submitted) == 1")
            [(sub, data, row)] = jobs.submitted
            _rewrite(kept, MODEL[::-1])
            assert os.pread(kept, len(MODEL), 0) == MODEL[::-1], "the control: the file changed"
            assert data == MODEL and sub.model.read_bytes() == MODEL, "the job's file changed"
            assert row.model_sha256 == hashlib.sha256(MODEL).hexdigest()
            st = os.stat(sub.model)
            assert st.st_ino != os.fstat(kept).st_ino and st.st_nlink == 1
            assert not st.st_mode & 0o022, "only the daemon may write its copy"
            assert not (sub.model.parent / ".moved").exists()
    finally:
        os.close(kept)


def _result_files(tmp_path: Path, tag: str) -> tuple[Path, Path]:
    out = tmp_path / f"job-out-{tag}"
    out.mkdir()
    tuned, result = out / "tuned.onnx", out / "aoe_result.json"
    tuned.write_bytes(b"tuned " + tag.encode())
    result.write_text(json.dumps({"tag": tag}))
    return tuned, result


def _result(tuned: Path, result: Path) -> JobOutcome:
    return JobOutcome(
        "job-1",
        "m.onnx",
        str(tuned),
        str(result),
        "exact",
        "opat",
        "cpu",
        1.0,
        Figures("faster", "tuned", 2.0, 0.25, (0.2, 0.3), 10),
        bank={
            "repo_hit_num": 1,
            "repo_add_num": 2,
            "repo_update_num": 0,
            "repo_not_tuned_num": 0,
            "total_num": 3,
        },
    )


async def test_a_succeeded_job_delivers_three_outbox_files_and_forgets_the_claim(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, stable_s=0.2)
    inbox, outbox = cfg.inboxes[0].path, cfg.inboxes[0].outbox
    store = _store(tmp_path)
    jobs = Jobs(store)
    async with _watching(cfg, jobs):
        for i, tag in enumerate(("first", "second")):
            (inbox / "m.onnx").write_bytes(MODEL)
            await wait_until(
                lambda i=i: len(jobs.submitted) == i + 1, 5.0, "len(jobs.submitted) == i + 1"
            )
            tuned, result = _result_files(tmp_path, tag)
            job_id = jobs.submitted[i][2].id
            jobs.finish(job_id, "succeeded", _result(tuned, result))
            report = outbox / ("m_report.txt" if i == 0 else "m_2_report.txt")
            await wait_until(report.exists, 5.0, "report.exists")
            # A delivery ends by dropping the claim, then the claimed copy.
            await wait_until(
                lambda: not store.claims() and not list(cfg.claims_dir.iterdir()),
                5.0,
                "not store.claims() and not list(cfg.claims_dir.iterdir())",
            )
    assert (outbox / "m_tuned.onnx").read_bytes() == b"tuned first"
    assert json.loads((outbox / "m_result.json").read_text()) == {"tag": "first"}
    assert (outbox / "m_2_tuned.onnx").read_bytes() == b"tuned second", (
        "an existing name is not overwritten"
    )
    assert json.loads((outbox / "m_2_result.json").read_text()) == {"tag": "second"}
    text = (outbox / "m_report.txt").read_text()
    for needle in (
        "job-1",
        "2.000 ms",
        "1.600 ms",
        "+25.0%",
        "+20.0%",
        "+30.0%",
        "faster",
        "shipped:      the tuned model",
        "add 2, hit 1",
    ):
        assert needle in text, (needle, text)
    assert "job-2" in (outbox / "m_2_report.txt").read_text()
    assert sorted(p.name for p in outbox.iterdir()) == sorted(
        f"m{s}{suffix}"
        for s in ("", "_2")
        for suffix in ("_tuned.onnx", "_result.json", "_report.txt")
    ), "no temporary files are left"
    assert not list(cfg.claims_dir.iterdir()), "the claimed copies are removed"


async def test_a_failed_job_moves_the_model_to_failed_with_the_error(tmp_path: Path) -> None:
    cfg = _config(tmp_path, stable_s=0.2)
    inbox, failed = cfg.inboxes[0].path, cfg.inboxes[0].failed
    store = _store(tmp_path)
    jobs = Jobs(store)
    async with _watching(cfg, jobs):
        (inbox / "bad.onnx").write_bytes(MODEL)
        await wait_until(lambda: len(jobs.submitted) == 1, 5.0, "len(jobs.submitted) == 1")
        jobs.finish("job-1", "failed", error="bad.onnx: the graph has no outputs")
        await wait_until(
            (failed / "bad.onnx.error.txt").exists, 5.0, '(failed / "bad.onnx.error.txt").exists'
        )
        # A delivery ends by dropping the claim, then the claimed copy.
        await wait_until(
            lambda: not store.claims() and not list(cfg.claims_dir.iterdir()),
            5.0,
            "not store.claims() and not list(cfg.claims_dir.iterdir())",
        )
    assert (failed / "bad.onnx").read_bytes() == MODEL
    text = (failed / "bad.onnx.error.txt").read_text()
    assert "job-1" in text and "failed" in text and "the graph has no outputs" in text
    assert not store.claims() and not list(cfg.claims_dir.iterdir())
    assert not list(cfg.inboxes[0].outbox.iterdir())


async def test_a_job_that_ended_while_the_watcher_was_down_is_delivered_at_start(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, stable_s=0.2)
    store = _store(tmp_path)
    jobs = Jobs(store)
    dst = cfg.claims_dir / "u1" / "m.onnx"
    dst.parent.mkdir(parents=True)
    dst.write_bytes(MODEL)
    src = cfg.inboxes[0].path / "m.onnx"
    store.claim_begin(str(src), str(dst), str(cfg.inboxes[0].path))
    row, _ = await jobs.submit(Submission(model=dst, spec=JobSpec(), source="inbox"))
    store.claim_done(str(src), row.id)
    tuned, result = _result_files(tmp_path, "early")
    store.update(row.id, state=JobState.SUCCEEDED, outcome=_result(tuned, result))
    async with _watching(cfg, jobs):
        await wait_until(
            (cfg.inboxes[0].outbox / "m_report.txt").exists,
            5.0,
            '(cfg.inboxes[0].outbox / "m_report.txt").exists',
        )
        await wait_until(lambda: not store.claims(), 5.0, "not store.claims()")
    assert (cfg.inboxes[0].outbox / "m_tuned.onnx").read_bytes() == b"tuned early"
    assert len(jobs.submitted) == 1, "a claimed file is not submitted again"


async def test_folder_options_reach_the_submission_and_a_bad_key_fails_the_model(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, stable_s=0.2)
    inbox, failed = cfg.inboxes[0].path, cfg.inboxes[0].failed
    inbox.mkdir()
    (inbox / "aoed.toml").write_text(
        'precision = "int8"\npriority = 3\nbudget_s = 1.5\nrepeat_tune = true\n[input_shapes]\nx = [2, 4]\n'
    )
    jobs = Jobs(_store(tmp_path))
    async with _watching(cfg, jobs):
        (inbox / "a.onnx").write_bytes(MODEL)
        await wait_until(lambda: len(jobs.submitted) == 1, 5.0, "len(jobs.submitted) == 1")
        spec = jobs.submitted[0][0].spec
        assert (
            spec.precision,
            spec.priority,
            spec.budget_s,
            spec.repeat_tune,
            spec.input_shapes,
        ) == ("int8", 3, 1.5, True, {"x": (2, 4)})
        # The file is read again for each model.
        (inbox / "aoed.toml").write_text('precision = "exact"\ncolour = "blue"\n')
        (inbox / "b.onnx").write_bytes(MODEL[::-1])
        await wait_until(
            (failed / "b.onnx.error.txt").exists, 5.0, '(failed / "b.onnx.error.txt").exists'
        )
    assert "colour" in (failed / "b.onnx.error.txt").read_text()
    assert (failed / "b.onnx").read_bytes() == MODEL[::-1]
    assert jobs.names() == ["a.onnx"]


async def test_a_full_queue_keeps_the_file_claimed_until_it_is_accepted(tmp_path: Path) -> None:
    cfg = _config(tmp_path, stable_s=0.2)
    store = _store(tmp_path)
    jobs = Jobs(store)
    jobs.refuse = [ResourceExhaustedError("64 jobs are queued") for _ in range(2)]
    async with _watching(cfg, jobs) as watcher:
        watcher.claims.retry_s = 0.1
        (cfg.inboxes[0].path / "q.onnx").write_bytes(MODEL)
        await wait_until(lambda: len(jobs.submitted) == 1, 5.0, "len(jobs.submitted) == 1")
    assert jobs.attempts == 3 and jobs.names() == ["q.onnx"]
    assert not list(cfg.inboxes[0].failed.iterdir())
    assert [c.state for c in store.claims()] == ["claimed"]


async def test_reload_watches_new_folders_and_stops_watching_removed_ones(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 0.2, "a")
    jobs = Jobs(_store(tmp_path))
    async with _watching(cfg, jobs) as watcher:
        assert (
            (tmp_path / "a").is_dir()
            and (tmp_path / "a-outbox").is_dir()
            and (tmp_path / "a-failed").is_dir()
        )
        watcher.reload(_config(tmp_path, 0.2, "b"))
        await wait_until((tmp_path / "b").is_dir, 5.0, '(tmp_path / "b").is_dir')
        # (A file dropped before the new watch runs is found by the scan that follows.)
        (tmp_path / "b" / "new.onnx").write_bytes(MODEL)
        (tmp_path / "a" / "old.onnx").write_bytes(MODEL)
        await wait_until(lambda: len(jobs.submitted) == 1, 5.0, "len(jobs.submitted) == 1")
        await _fence(jobs, tmp_path / "b")
    assert jobs.names() == ["new.onnx", "fence.onnx"]
    assert (tmp_path / "a" / "old.onnx").exists()


async def test_cancelling_the_watcher_ends_its_watch_threads_promptly(tmp_path: Path) -> None:
    # watchfiles' worker thread notices only its stop event (every 50 ms); without it,
    # cancellation would wait out the thread's own 5 s timeout, past this deadline.
    jobs = Jobs(_store(tmp_path))
    with trio.fail_after(3600) as stopping:
        async with _watching(_config(tmp_path, 0.2, "a", "b"), jobs):
            stopping.deadline = trio.current_time() + 4.5  # for the watcher's exit alone
    assert jobs.on_final == [], "the watcher unregisters its final-state callback"


# ---------------------------------------------------------------- hostile drops


async def test_a_file_that_cannot_be_claimed_goes_to_failed_after_a_few_tries(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, stable_s=0.1)
    inbox, failed = cfg.inboxes[0].path, cfg.inboxes[0].failed
    jobs = Jobs(_store(tmp_path))
    async with _watching(cfg, jobs, rescan_s=0.2):
        # No claim can be made: the claims folder is a file now.
        cfg.claims_dir.rmdir()
        cfg.claims_dir.write_text("in the way\n")
        (inbox / "m.onnx").write_bytes(MODEL)
        await wait_until(
            (failed / "m.onnx.error.txt").exists, 10.0, '(failed / "m.onnx.error.txt").exists'
        )
    text = (failed / "m.onnx.error.txt").read_text()
    assert (
        "state: rejected" in text
        and "could not be claimed" in text
        and f"({CLAIM_TRIES} tries)" in text
    ), text
    assert str(cfg.claims_dir) in text, "the reason names what was in the way"
    assert (failed / "m.onnx").read_bytes() == MODEL and not (inbox / "m.onnx").exists()
    assert jobs.submitted == []


async def test_a_file_that_cannot_be_claimed_nor_failed_is_logged_once_and_left(
    tmp_path: Path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="aoed.watch")
    cfg = _config(tmp_path, stable_s=0.1)
    inbox, failed = cfg.inboxes[0].path, cfg.inboxes[0].failed
    jobs = Jobs(_store(tmp_path))

    def given_up() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if "not tried again until it changes" in r.getMessage()
        ]

    def tries() -> int:
        return sum("m.onnx could not be claimed" in r.getMessage() for r in caplog.records)

    async with _watching(cfg, jobs, rescan_s=0.1):
        cfg.claims_dir.rmdir()
        cfg.claims_dir.write_text("in the way\n")
        failed.rmdir()
        failed.write_text("in the way too\n")
        (inbox / "m.onnx").write_bytes(MODEL)
        await wait_until(lambda: len(given_up()) == 1, 10.0, "len(given_up()) == 1")
        seen = tries()
        # The sign that scans went on meanwhile: a second file that cannot be claimed is
        # tried at CLAIM_TRIES scans, no two within rescan_s, and then given up too.
        (inbox / "sign.onnx").write_bytes(MODEL)
        await wait_until(
            lambda: any("sign.onnx" in line for line in given_up()), 10.0, "sign.onnx given up"
        )
        assert [line for line in given_up() if "m.onnx" in line] == given_up()[:1]
        assert tries() == seen, "a file given up on is not tried again"
        (inbox / "m.onnx").write_bytes(MODEL[::-1])  # it changed: a new file
        await wait_until(lambda: tries() > seen, 10.0, "tries() > seen")
    assert (inbox / "m.onnx").exists() and jobs.submitted == []


# Writes half the model, pauses (argv[2] seconds), then writes the rest.
_PAUSING_WRITER = """
import sys, time
data = open(sys.argv[3], "rb").read()
with open(sys.argv[1], "wb") as f:
    f.write(data[: len(data) // 2])
    f.flush()
    time.sleep(float(sys.argv[2]))
    f.write(data[len(data) // 2 :])
"""


async def test_a_writer_that_pauses_longer_than_stable_s_is_not_taken_half_written(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, stable_s=0.2)
    jobs = Jobs(_store(tmp_path))
    whole = tmp_path / "whole.bin"
    whole.write_bytes(MODEL)
    async with _watching(cfg, jobs):
        writer = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-c",
                _PAUSING_WRITER,
                str(cfg.inboxes[0].path / "slow.onnx"),
                "1.5",
                str(whole),
            ]
        )
        assert await writer.wait() == 0
        await wait_until(lambda: len(jobs.submitted) == 1, 5.0, "len(jobs.submitted) == 1")
    assert jobs.submitted[0][1] == MODEL, "the file was taken before its writer closed it"


#: Ten of the watcher's 0.1 s sweeps. A sweep that passes over an entry it already logged
#: leaves no trace at all, so only a quiet period can show that none logs it again.
TEN_SWEEPS_S = 1.0


async def test_entries_that_are_not_models_are_logged_once_each_and_left(
    tmp_path: Path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="aoed.watch")
    cfg = _config(tmp_path, stable_s=0.1)
    inbox = cfg.inboxes[0].path
    inbox.mkdir()
    outside = tmp_path / "outside.onnx"
    outside.write_bytes(MODEL)
    (inbox / "before.onnx").symlink_to(outside)  # present at the start: the first scan sees it
    jobs = Jobs(_store(tmp_path))
    kinds = {
        "before.onnx": "a symbolic link",
        "link.onnx": "a symbolic link",
        "dir.onnx": "a folder",
        "fifo.onnx": "a FIFO",
        "sock.onnx": "a socket",
        "notes.txt": "not an .onnx model (nor a .pt2 or a .tar)",
    }

    def logged(name: str) -> int:
        return sum(
            f": {name} is {kinds[name]}; left where it is" in r.getMessage() for r in caplog.records
        )

    async with _watching(cfg, jobs, rescan_s=0.1):
        (inbox / "link.onnx").symlink_to(outside)
        (inbox / "dir.onnx").mkdir()
        os.mkfifo(inbox / "fifo.onnx")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(inbox / "sock.onnx"))
            (inbox / "notes.txt").write_text("hello\n")
            await wait_until(
                lambda: all(logged(n) for n in kinds), 10.0, "all(logged(n) for n in kinds)"
            )
            await trio.sleep(TEN_SWEEPS_S)
            assert {n: logged(n) for n in kinds} == {n: 1 for n in kinds}, (
                "each is logged once, not at every sweep"
            )
            assert all(os.path.lexists(inbox / n) for n in kinds), "and left where it is"
    assert jobs.submitted == [] and outside.read_bytes() == MODEL


async def test_an_options_file_that_is_a_fifo_or_a_link_fails_the_model_and_blocks_nothing(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, stable_s=0.1)
    inbox, failed = cfg.inboxes[0].path, cfg.inboxes[0].failed
    inbox.mkdir()
    outside = tmp_path / "options-elsewhere.toml"
    outside.write_text('precision = "int8"\n')
    os.mkfifo(inbox / "aoed.toml")  # a read of it by name would wait for a writer forever
    jobs = Jobs(_store(tmp_path))
    async with _watching(cfg, jobs):
        (inbox / "a.onnx").write_bytes(MODEL)
        await wait_until(
            (failed / "a.onnx.error.txt").exists, 5.0, '(failed / "a.onnx.error.txt").exists'
        )
        (inbox / "aoed.toml").unlink()
        (inbox / "aoed.toml").symlink_to(outside)
        (inbox / "b.onnx").write_bytes(MODEL[::-1])
        await wait_until(
            (failed / "b.onnx.error.txt").exists, 5.0, '(failed / "b.onnx.error.txt").exists'
        )
    for name in ("a.onnx", "b.onnx"):
        text = (failed / f"{name}.error.txt").read_text()
        assert (
            f"{inbox / 'aoed.toml'}:" in text and "the options file must be a regular file" in text
        ), text
    assert jobs.names() == []


async def test_a_claim_that_turned_out_a_link_goes_to_failed_unread(tmp_path: Path) -> None:
    """A writer of the inbox can swap a link in between the watcher's look and the claim's
    rename, which then moves the link itself. Here the claim is left so by a crash right
    after that rename: the claimed entry is a link to a file from elsewhere."""
    cfg = _config(tmp_path, stable_s=0.2)
    inbox, failed = cfg.inboxes[0].path, cfg.inboxes[0].failed
    store = _store(tmp_path)
    secret = tmp_path / "secret.onnx"
    secret.write_bytes(MODEL)
    dst = cfg.claims_dir / "u1" / "s.onnx"
    dst.parent.mkdir(parents=True)
    dst.symlink_to(secret)
    store.claim_begin(str(inbox / "s.onnx"), str(dst), str(inbox))
    jobs = Jobs(store)
    async with _watching(cfg, jobs):
        await wait_until(
            (failed / "s.onnx.error.txt").exists, 5.0, '(failed / "s.onnx.error.txt").exists'
        )
    text = (failed / "s.onnx.error.txt").read_text()
    assert (
        "a symbolic link by the time it was claimed" in text
        and "nothing behind it was read" in text
    ), text
    assert (failed / "s.onnx").is_symlink() and secret.read_bytes() == MODEL
    assert jobs.attempts == 0, "the file behind the link reached a submission"


async def test_a_full_disk_holds_a_claim_back_without_counting_tries(
    tmp_path: Path, caplog
) -> None:
    """A claim that meets a full disk waits for room, however many scans that takes: the
    file is not moved to failed/ (without its reason, when failed/ is as full), and once
    there is room it is claimed and submitted as usual."""
    import subprocess

    caplog.set_level(logging.DEBUG, logger="aoed.watch")
    # (No [limits] min_free_mb: the filesystem here is far smaller than its default.)
    cfg = replace(_config(tmp_path, stable_s=0.1), min_free_bytes=0)
    inbox, failed = cfg.inboxes[0].path, cfg.inboxes[0].failed
    jobs = Jobs(_store(tmp_path))
    # The claims folder on a filesystem of three inodes: its root, and a claim's folder
    # and file (copied from the inbox's filesystem), once the filler has gone.
    cfg.claims_dir.mkdir(parents=True, exist_ok=True)
    r = await trio.run_process(
        ["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=3", "tmpfs", str(cfg.claims_dir)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    if r.returncode != 0:
        why = r.stderr.decode(errors="replace").strip()
        pytest.skip(f"cannot mount a small filesystem here (needs root): {why}")
    try:

        def waits() -> int:
            return sum(
                "m.onnx waits for room to be claimed" in r.getMessage() for r in caplog.records
            )

        async with _watching(cfg, jobs, rescan_s=0.1):
            (cfg.claims_dir / "filler").write_bytes(b"")  # (after the start, which clears strays)
            (inbox / "m.onnx").write_bytes(MODEL)
            await wait_until(lambda: waits() > CLAIM_TRIES + 2, 20.0, "waits() > CLAIM_TRIES + 2")
            assert (inbox / "m.onnx").read_bytes() == MODEL and not any(failed.iterdir())
            assert [r.levelno for r in caplog.records if "waits for room" in r.getMessage()][
                :2
            ] == [logging.WARNING, logging.DEBUG], "said once, then quietly"
            (cfg.claims_dir / "filler").unlink()
            await wait_until(lambda: bool(jobs.submitted), 20.0, "bool(jobs.submitted)")
        assert not (inbox / "m.onnx").exists() and not any(failed.iterdir())
    finally:
        # not awaited: this `finally` runs when the test is cancelled too
        subprocess.run(["umount", "-l", str(cfg.claims_dir)], check=False, capture_output=True)  # noqa: ASYNC221


def test_a_failure_that_cannot_write_its_reason_moves_nothing(tmp_path: Path) -> None:
    """failed/ full: the reason cannot be written, so the model stays where it was (to be
    delivered whole later), never in failed/ without its reason."""
    import subprocess

    from aoed.watch.delivery import write_failure

    fs = tmp_path / "fs"
    fs.mkdir()
    # Five inodes: its root, failed/, claimed/, the model and a filler. A rename within it
    # takes no inode; the reason would take one.
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=5", "tmpfs", str(fs)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here (needs root): {r.stderr.strip()}")
    try:
        failed, model = fs / "failed", fs / "claimed" / "m.onnx"
        failed.mkdir()
        model.parent.mkdir()
        model.write_bytes(MODEL)
        (fs / "filler").write_bytes(b"")
        with pytest.raises(OSError) as err:
            write_failure(failed, model, "m.onnx", "model: m.onnx\nerror: broken\n")
        assert err.value.errno == 28 and model.read_bytes() == MODEL and not any(failed.iterdir())
        (fs / "filler").unlink()
        write_failure(failed, model, "m.onnx", "model: m.onnx\nerror: broken\n")
        assert not model.exists() and (failed / "m.onnx").read_bytes() == MODEL
        assert (failed / "m.onnx.error.txt").read_text().endswith("error: broken\n")
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False, capture_output=True)


# ---------------------------------------------------------------- missing folders


def _group() -> tuple[str, int]:
    """A group to give the drop folders: nobody's (65534) as root, which the daemon's
    folders would never get by themselves; else our own."""
    gid = 65534 if os.geteuid() == 0 else os.getegid()
    try:
        return grp.getgrgid(gid).gr_name, gid
    except KeyError:
        pytest.skip(f"no group with gid {gid} here")


def _modes(*folders: Path) -> list[tuple[str, int]]:
    return [(oct(stat.S_IMODE(os.stat(f).st_mode)), os.stat(f).st_gid) for f in folders]


async def test_drop_folders_missing_at_start_or_removed_later_are_made_with_the_inbox_mode(
    tmp_path: Path, caplog
) -> None:
    """Made with the daemon's umask alone (0750, its own group) the folders would shut
    out the group that drops models, and nothing would say why."""
    caplog.set_level(logging.INFO, logger="aoed.watch")
    name, gid = _group()
    cfg = _config(tmp_path, stable_s=0.1)
    cfg = replace(cfg, inboxes=(replace(cfg.inboxes[0], group=name),))
    inbox = cfg.inboxes[0]
    folders = (inbox.path, inbox.outbox, inbox.failed)
    jobs = Jobs(_store(tmp_path))
    want = [(oct(0o2770), gid)] * 3

    def made(folder: Path) -> bool:
        return any(
            f"{folder} was missing; made it with mode 2770, group {name}" in r.getMessage()
            for r in caplog.records
        )

    async with _watching(cfg, jobs, rescan_s=0.1):
        assert _modes(*folders) == want and all(made(f) for f in folders)
        caplog.clear()
        for folder in folders:
            shutil.rmtree(folder)
        # the inbox, at the next sweep; the failed folder, when a model fails; the outbox,
        # when one succeeds
        await wait_until(lambda: made(inbox.path), 5.0, "made(inbox.path)")
        (inbox.path / "bad.onnx").write_bytes(MODEL)
        (inbox.path / "good.onnx").write_bytes(MODEL[::-1])
        await wait_until(lambda: len(jobs.submitted) == 2, 5.0, "len(jobs.submitted) == 2")
        by_name = {sub.model.name: row.id for sub, _, row in jobs.submitted}
        jobs.finish(by_name["bad.onnx"], "failed", error="broken")
        jobs.finish(by_name["good.onnx"], "succeeded", _result(*_result_files(tmp_path, "g")))
        await wait_until(
            lambda: (inbox.failed / "bad.onnx.error.txt").exists(),
            5.0,
            '(inbox.failed / "bad.onnx.error.txt").exists()',
        )
        await wait_until(
            lambda: (inbox.outbox / "good_report.txt").exists(),
            5.0,
            '(inbox.outbox / "good_report.txt").exists()',
        )
    assert _modes(*folders) == want and all(made(f) for f in folders)


def test_inbox_mode_and_group_settings_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "aoed.toml"
    good = '[[inbox]]\npath = "/srv/a"\nmode = "2750"\ngroup = "root"\n'
    bad = (
        '[[inbox]]\npath = "/srv/b"\nmode = "2777"\n'
        '[[inbox]]\npath = "/srv/c"\nmode = "rwx"\ngroup = "no-such-group-here"\n'
        '[[inbox]]\npath = "/srv/d"\nmode = "0570"\n'
    )
    path.write_text(good)
    [inbox] = load_daemon_config(path, env={}).inboxes
    assert (inbox.mode, inbox.group) == (0o2750, "root")
    path.write_text(good + bad)
    with pytest.raises(OptionError) as err:
        load_daemon_config(path, env={})
    said = str(err.value)
    assert said.startswith("4 problems"), said
    for where, what in (
        ("#2 mode = '2777'", "nothing for others"),
        ("#3 mode = 'rwx'", 'expected an octal mode like "2770"'),
        ("#3 group = 'no-such-group-here'", "no such group"),
        ("#4 mode = '0570'", "0700 for the daemon"),
    ):
        assert f"{path} [[inbox]] {where}: " in said and what in said, (where, what, said)

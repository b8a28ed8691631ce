"""The job store: every job, its options, state and event log, uploads and inbox claims,
in one SQLite database (WAL mode) in the state dir, apart from the bank.

Why SQLite and not a second LMDB: the daemon asks the store questions (jobs in these
states, newest first, a page after this one, the events of a job after sequence N,
uploads older than T) that are one indexed query each in SQL and hand-built indexes in
a key-value store; it has one writer (the daemon) and small rows; and WAL mode commits
a row without rewriting pages readers use, so a kill -9 loses at most the transaction in
flight and never a committed one. The bank stays in LMDB, which compilers read without
the daemon.

The layout has a version, kept in the file itself (SQLite's `user_version`). At open,
the migrations the store lacks run in order, each in its own transaction with the
version it writes, so a store cut short mid-migration opens at the version before it
and the next start goes on; a store a newer aoed wrote is refused, unchanged, with an
error naming the file and both versions.

All access happens in the trio thread: each statement is a short local write (tens of
microseconds with `synchronous=NORMAL` in WAL mode, which is durable against a killed
process, not against power loss between checkpoints) and never waits on another
process, so it is not worth a thread hop. Values a row holds as JSON (options, result,
progress, model file, event data) are plain JSON; nothing is pickled. A job's options,
and its outcome (in its row and in its result event), are stored as `JobSpec.to_dict`
and `JobOutcome.to_dict` write them and read back into those shapes here, the store's
one conversion: the rest of the daemon sees only the shapes.

A full disk: a write the store has no room for raises DiskFullError (naming the folder
and its free space) and changes nothing, and the same store writes again once there is
room; reads go on (sorting uses memory, never a temporary file). At open, SQLite
creates and sizes its WAL index, the `-shm` file, which a full disk refuses (after a
clean stop there is none); the store then opens in exclusive locking mode, where SQLite
keeps that index in the process's memory, so the daemon starts and serves all the same.
Until the next start, other processes cannot read the file then ("database is
locked"); in the usual mode a read-only connection can, e.g. an integrity check.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aoe.errors import AoedError, DiskFullError
from aoe.outcome import JobOutcome
from aoe.spec import JobSpec
from aoed import space
from aoed.jobs.states import ACTIVE, FINAL, RUNNING, JobState

__all__ = [
    "ACTIVE",
    "FINAL",
    "RESULT",
    "RUNNING",
    "Claim",
    "EventRow",
    "JobRow",
    "JobStore",
    "StoreError",
    "Upload",
]

log = logging.getLogger(__name__)

QUEUED, PREPARING, TUNING, VERIFYING, SUCCEEDED, FAILED, CANCELLED = JobState
#: The kind of the event that holds a finished job's outcome.
RESULT = "result"
#: The version of the store's layout this code writes, recorded in the store itself
#: (SQLite's `user_version`): the number of `_MIGRATIONS` applied to it.
SCHEMA_VERSION = 2

#: The first layout (jobs, events, uploads, claims), as stores before recorded versions
#: have it. Never changed: a change is a migration.
_TABLES = (
    """
    CREATE TABLE IF NOT EXISTS jobs (
        id TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        source TEXT NOT NULL DEFAULT 'rpc',
        model_path TEXT NOT NULL,
        model_name TEXT NOT NULL,
        model_sha256 TEXT NOT NULL,
        dedup_key TEXT NOT NULL,
        options TEXT NOT NULL,
        output_dir TEXT NOT NULL,
        created REAL NOT NULL,
        started REAL,
        finished REAL,
        error TEXT NOT NULL DEFAULT '',
        error_kind TEXT NOT NULL DEFAULT '',
        result TEXT,
        progress TEXT NOT NULL DEFAULT '{}',
        joined INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0
    )
    """,
    """
    CREATE INDEX IF NOT EXISTS jobs_by_created ON jobs (created DESC, id DESC)
    """,
    """
    CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state)
    """,
    """
    CREATE INDEX IF NOT EXISTS jobs_by_dedup ON jobs (dedup_key, state)
    """,
    """
    CREATE TABLE IF NOT EXISTS events (
        job_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        time REAL NOT NULL,
        kind TEXT NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (job_id, seq)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS uploads (
        id TEXT PRIMARY KEY,
        path TEXT NOT NULL,
        file_name TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        size INTEGER NOT NULL,
        created REAL NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS claims (
        src TEXT PRIMARY KEY,
        dst TEXT NOT NULL,
        inbox TEXT NOT NULL,
        state TEXT NOT NULL,
        job_id TEXT NOT NULL DEFAULT '',
        time REAL NOT NULL
    )
    """,
)


def _create_tables(db: sqlite3.Connection) -> None:
    for sql in _TABLES:
        db.execute(sql)


def _model_file_column(db: sqlite3.Connection) -> None:
    """The model file's [device, inode] at submit, kept in its own column: stores of
    version 1 kept it in the options JSON under "model_file". Options that do not parse
    stay as they are (their row is reported damaged when read, as before). JSON text,
    not two INTEGER columns: an inode number may exceed SQLite's signed 64 bits."""
    columns = {r[1] for r in db.execute("PRAGMA table_info(jobs)")}
    if "model_file" not in columns:
        db.execute("ALTER TABLE jobs ADD COLUMN model_file TEXT")
    for job_id, raw in db.execute("SELECT id, options FROM jobs").fetchall():
        try:
            options = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(options, dict) or "model_file" not in options:
            continue
        model_file = options.pop("model_file")
        db.execute(
            "UPDATE jobs SET options = ?, model_file = ? WHERE id = ?",
            (json.dumps(options), None if model_file is None else json.dumps(model_file), job_id),
        )


#: The store's migrations in order: `_MIGRATIONS[n]` takes a store of version n to n + 1
#: (a new store is version 0). Each runs in one transaction with the version it writes,
#: and does nothing to a store that already has what it adds.
_MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _create_tables,
    _model_file_column,
)
assert len(_MIGRATIONS) == SCHEMA_VERSION


class StoreError(AoedError):
    """The job store cannot be opened or written (for lack of space: DiskFullError)."""

    grpc_status = "INTERNAL"


#: Free bytes under which an I/O error of the store is taken for a full disk.
_NEARLY_FULL = 1 << 20


@dataclass
class JobRow:
    id: str
    state: JobState
    model_path: str
    model_name: str
    model_sha256: str
    dedup_key: str
    spec: JobSpec
    output_dir: str
    priority: int = 0
    source: str = "rpc"
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    error: str = ""
    error_kind: str = ""
    outcome: JobOutcome | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    joined: int = 0
    attempts: int = 0
    #: (device, inode) of the model file its submitter's checks passed
    model_file: tuple[int, int] | None = None

    @property
    def final(self) -> bool:
        return self.state in FINAL


@dataclass(frozen=True)
class EventRow:
    job_id: str
    seq: int
    time: float
    kind: str  # state | progress | task | log | result
    data: dict[str, Any]  # (a result's is empty: its outcome is the typed value below)
    #: a result event's outcome
    outcome: JobOutcome | None = None


@dataclass(frozen=True)
class Upload:
    id: str
    path: str
    file_name: str
    sha256: str
    size: int
    created: float


@dataclass(frozen=True)
class Claim:
    src: str
    dst: str
    inbox: str
    state: str  # claiming (rename may or may not have happened) | claimed (job recorded)
    job_id: str
    time: float


_JSON_COLUMNS = ("options", "result", "progress", "model_file")
#: Columns under another name than the row's field.
_COLUMN_OF = {"spec": "options", "outcome": "result"}
_COLUMNS = (
    "id",
    "state",
    "priority",
    "source",
    "model_path",
    "model_name",
    "model_sha256",
    "dedup_key",
    "options",
    "output_dir",
    "created",
    "started",
    "finished",
    "error",
    "error_kind",
    "result",
    "progress",
    "joined",
    "attempts",
    "model_file",
)


class JobStore:
    """The open store. Methods raise StoreError; a row that cannot be decoded is skipped
    with a warning (and reported by `damaged`), never fatal to the daemon."""

    def __init__(self, path: Path):
        self.path = path
        self.damaged: list[str] = []
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"job store {path}: {exc}") from None
        try:
            self._db = self._open(exclusive=False)
        except DiskFullError as exc:
            log.warning(
                "%s; opening it in exclusive mode, which needs no room (other processes cannot read it "
                "until aoed restarts)",
                exc,
            )
            self._db = self._open(exclusive=True)

    def _open(self, exclusive: bool) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"job store {self.path}: {exc}") from None
        try:
            if exclusive:  # before WAL mode is entered: SQLite keeps the WAL index in memory
                db.execute("PRAGMA locking_mode=EXCLUSIVE")
            db.execute("PRAGMA busy_timeout=5000")
            self._check_version(db)  # before anything is written
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA temp_store=MEMORY")
            self._migrate(db)
        except sqlite3.Error as exc:
            db.close()
            raise self._error(exc) from None
        except AoedError:
            db.close()
            raise
        return db

    def _check_version(self, db: sqlite3.Connection) -> int:
        """The store's version; StoreError for one newer than this code writes."""
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"job store {self.path}: schema version {version} is newer than this aoed's "
                f"({SCHEMA_VERSION}): a newer aoed wrote it. Run that aoed, or move the file "
                "aside (with its -wal file) to start this one with an empty job store"
            )
        return version

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Bring the store to SCHEMA_VERSION, one migration per transaction: a migration
        cut short (a kill, a full disk) leaves the store at the version before it."""
        while (version := self._check_version(db)) < SCHEMA_VERSION:
            db.execute("BEGIN IMMEDIATE")
            try:
                # Read again under the write lock: another process may have migrated.
                if self._check_version(db) == version:
                    _MIGRATIONS[version](db)
                    db.execute(f"PRAGMA user_version = {version + 1}")
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            if version:
                log.info("job store %s: migrated to schema version %d", self.path, version + 1)

    def close(self) -> None:
        self._db.close()

    def _error(self, exc: sqlite3.Error) -> AoedError:
        """The store's error for `exc`: DiskFullError when the disk (or quota) under the
        store had no room for a write, else StoreError; both name the store."""
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF  # the primary code of an extended one
        folder = self.path.parent
        # SQLite says SQLITE_FULL when it sees ENOSPC itself, and an I/O error when a
        # write the OS cut short did not say why: then the free space tells.
        if code == sqlite3.SQLITE_FULL or (
            code == sqlite3.SQLITE_IOERR and 0 <= space.free_bytes(folder) < _NEARLY_FULL
        ):
            return space.disk_full(folder, f"job store {self.path}")
        return StoreError(f"job store {self.path}: {exc}")

    def _exec(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        try:
            return self._db.execute(sql, args)
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    # ------------------------------------------------------------------ jobs

    def insert(self, row: JobRow) -> None:
        values = dict(_columns(vars(row)))
        self._exec(
            f"INSERT INTO jobs ({','.join(_COLUMNS)}) VALUES ({','.join('?' * len(_COLUMNS))})",
            [values[c] for c in _COLUMNS],
        )

    def update(self, job_id: str, **fields: Any) -> None:
        """Set the row's `fields` (JobRow's names)."""
        if "spec" in fields:
            raise ValueError("a job's spec is not changed once stored")
        cols = list(_columns(fields))
        sets = ", ".join(f"{c} = ?" for c, _ in cols)
        self._exec(f"UPDATE jobs SET {sets} WHERE id = ?", [*(v for _, v in cols), job_id])

    def _rows(self, cursor: Iterable[Sequence[Any]]) -> Iterator[JobRow]:
        for raw in cursor:
            try:
                d = dict(zip(_COLUMNS, raw, strict=True))
                for c in _JSON_COLUMNS:
                    d[c] = json.loads(d[c]) if d[c] is not None else None
                if not isinstance(d["options"], dict):
                    raise ValueError("options is not an object")
                options = d.pop("options")
                result = d.pop("result")
                d["progress"] = d["progress"] or {}
                d["state"] = JobState(d["state"])
                d["model_file"] = _model_file(d["model_file"])
                yield JobRow(
                    **d,
                    spec=JobSpec.from_dict(options),
                    outcome=JobOutcome.from_dict(result) if result else None,
                )
            except (ValueError, TypeError, KeyError, AoedError) as exc:
                job_id = str(raw[0])
                if job_id not in self.damaged:
                    self.damaged.append(job_id)
                    log.warning(
                        "job store: row for job %s is damaged and ignored (%s)", job_id, exc
                    )

    def get(self, job_id: str) -> JobRow | None:
        cur = self._exec(f"SELECT {','.join(_COLUMNS)} FROM jobs WHERE id = ?", (job_id,))
        return next(self._rows(cur), None)

    def jobs(
        self, states: Sequence[str] = (), limit: int = 1000, before: tuple[float, str] | None = None
    ) -> list[JobRow]:
        """Jobs newest first, optionally in `states`, strictly after the (created, id)
        cursor `before` in that order."""
        where: list[str] = []
        args: list[object] = []
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(states)
        if before is not None:
            where.append("(created < ? OR (created = ? AND id < ?))")
            args.extend([before[0], before[0], before[1]])
        sql = f"SELECT {','.join(_COLUMNS)} FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created DESC, id DESC LIMIT ?"
        return list(self._rows(self._exec(sql, [*args, limit])))

    def active_with_key(self, dedup_key: str) -> JobRow | None:
        cur = self._exec(
            f"SELECT {','.join(_COLUMNS)} FROM jobs WHERE dedup_key = ? AND state IN ({','.join('?' * len(ACTIVE))}) "
            "ORDER BY created LIMIT 1",
            (dedup_key, *ACTIVE),
        )
        return next(self._rows(cur), None)

    def count_active(self, source: str) -> int:
        """Jobs queued or running that came from `source`."""
        row = self._exec(
            f"SELECT COUNT(*) FROM jobs WHERE source = ? AND state IN ({','.join('?' * len(ACTIVE))})",
            (source, *ACTIVE),
        ).fetchone()
        return int(row[0])

    def delete(self, job_id: str) -> None:
        with self.transaction():
            self._exec("DELETE FROM events WHERE job_id = ?", (job_id,))
            self._exec("DELETE FROM jobs WHERE id = ?", (job_id,))

    def model_refs(self, model_path: str) -> int:
        """How many jobs refer to the model file at `model_path`."""
        return int(
            self._exec("SELECT COUNT(*) FROM jobs WHERE model_path = ?", (model_path,)).fetchone()[
                0
            ]
        )

    def model_paths(self) -> set[str]:
        """The model files jobs refer to."""
        return {str(r[0]) for r in self._exec("SELECT DISTINCT model_path FROM jobs")}

    def finished_before(self, when: float) -> list[JobRow]:
        cur = self._exec(
            f"SELECT {','.join(_COLUMNS)} FROM jobs WHERE state IN ({','.join('?' * len(FINAL))}) AND finished < ?",
            (*FINAL, when),
        )
        return list(self._rows(cur))

    # ---------------------------------------------------------------- events

    def append_event(self, event: EventRow) -> None:
        data = event.data if event.outcome is None else event.outcome.to_dict()
        self._exec(
            "INSERT INTO events (job_id, seq, time, kind, data) VALUES (?, ?, ?, ?, ?)",
            (event.job_id, event.seq, event.time, event.kind, json.dumps(data)),
        )

    def events(self, job_id: str, after_seq: int = 0) -> list[EventRow]:
        cur = self._exec(
            "SELECT job_id, seq, time, kind, data FROM events WHERE job_id = ? AND seq > ? ORDER BY seq",
            (job_id, after_seq),
        )
        out = []
        for job, seq, t, kind, data in cur:
            try:
                if kind == RESULT:
                    outcome = JobOutcome.from_dict(json.loads(data))
                    out.append(EventRow(job, int(seq), float(t), kind, {}, outcome))
                else:
                    out.append(EventRow(job, int(seq), float(t), kind, json.loads(data)))
            except (ValueError, TypeError, KeyError, AoedError):
                log.warning("job store: event %s of job %s is damaged and skipped", seq, job)
        return out

    def last_seq(self, job_id: str) -> int:
        row = self._exec("SELECT MAX(seq) FROM events WHERE job_id = ?", (job_id,)).fetchone()
        return int(row[0] or 0)

    # --------------------------------------------------------------- uploads

    def add_upload(self, up: Upload) -> None:
        self._exec(
            "INSERT INTO uploads (id, path, file_name, sha256, size, created) VALUES (?, ?, ?, ?, ?, ?)",
            (up.id, up.path, up.file_name, up.sha256, up.size, up.created),
        )

    def get_upload(self, upload_id: str) -> Upload | None:
        row = self._exec(
            "SELECT id, path, file_name, sha256, size, created FROM uploads WHERE id = ?",
            (upload_id,),
        ).fetchone()
        return Upload(*row) if row else None

    def delete_upload(self, upload_id: str) -> None:
        self._exec("DELETE FROM uploads WHERE id = ?", (upload_id,))

    def uploads_before(self, when: float) -> list[Upload]:
        cur = self._exec(
            "SELECT id, path, file_name, sha256, size, created FROM uploads WHERE created < ?",
            (when,),
        )
        return [Upload(*row) for row in cur]

    # ---------------------------------------------------------------- claims

    def claim_begin(self, src: str, dst: str, inbox: str) -> None:
        """Record the intent to move `src` to `dst` (before the rename)."""
        self._exec(
            "INSERT OR REPLACE INTO claims (src, dst, inbox, state, job_id, time) VALUES (?, ?, ?, ?, '', ?)",
            (src, dst, inbox, "claiming", time.time()),
        )

    def claim_done(self, src: str, job_id: str) -> None:
        """The file was moved and its job recorded: the claim is complete."""
        self._exec("UPDATE claims SET state = 'claimed', job_id = ? WHERE src = ?", (job_id, src))

    def claim_drop(self, src: str) -> None:
        self._exec("DELETE FROM claims WHERE src = ?", (src,))

    def claims(self, state: str | None = None) -> list[Claim]:
        sql = "SELECT src, dst, inbox, state, job_id, time FROM claims"
        cur = self._exec(sql + " WHERE state = ?", (state,)) if state else self._exec(sql)
        return [Claim(*row) for row in cur]

    # ----------------------------------------------------------- transactions

    def transaction(self) -> _Transaction:
        return _Transaction(self)


def _columns(fields: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(column, stored value) of a row's `fields`: the spec and the outcome as their
    `to_dict`, the model file as [device, inode], the JSON columns as JSON (None as NULL)."""
    for name, value in fields.items():
        column = _COLUMN_OF.get(name, name)
        if name == "spec":
            value = value.to_dict()
        elif name == "outcome" and value is not None:
            value = value.to_dict()
        elif name == "model_file" and value is not None:
            value = list(value)
        if column in _JSON_COLUMNS and not (column == "model_file" and value is None):
            value = json.dumps(value)
        yield column, value


def _model_file(value: Any) -> tuple[int, int] | None:
    """A stored model file: None, or [device, inode]; ValueError for anything else."""
    if value is None:
        return None
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in value)
    ):
        raise ValueError(f"model_file is not [device, inode]: {value!r}")
    return value[0], value[1]


class _Transaction:
    def __init__(self, store: JobStore):
        self._store = store

    def __enter__(self) -> None:
        self._store._exec("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self._store._exec("ROLLBACK")
            return
        try:
            self._store._exec("COMMIT")
        except AoedError:
            # A COMMIT that failed (a full disk) leaves the transaction open: end it, so
            # that the store's next statement is not inside it.
            if self._store._db.in_transaction:
                self._store._exec("ROLLBACK")
            raise

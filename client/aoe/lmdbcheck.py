"""A bank's data file checked with plain reads before LMDB maps it.

LMDB reads a bank through a map of its data file (data.mdb) and trusts every byte it
finds there. A page the file no longer holds (a copy or a restore cut short, a disk
that filled up meanwhile, a filesystem repair) is SIGBUS at the first touch, and a
damaged page can make LMDB fail an assertion (SIGABRT) or read through a wild offset
(SIGSEGV): the process ends without a word, and a daemon restarted by its supervisor
meets the same page again. No signal handler can turn that back into an error, so the
file is checked before LMDB is given it:

- `find_damage(path)`, at every open (readers, the writer, every `aoe` command): the
  two meta pages, read with pread, are what LMDB reads first. The committed one (the
  larger txnid) counts `mm_last_pg + 1` pages of `psize` bytes. A file that long is
  whole. A shorter one is truncated, or merely ends in free pages LMDB never wrote
  (a page a transaction took from the end and gave back is counted, not written):
  the writer lengthens the file after each commit so that this stays rare
  (`cover_last_page`), and a short file is walked (below) to tell the two apart.
- `find_damage(path, walk=True)`, at the writer's open and by `aoe bank check`: every
  page reachable from the committed meta is walked with py-lmdb's offline verifier
  (`lmdb.verify`: plain reads, never a map), which finds what would make LMDB fault
  (a page out of the file, a wrong page type, a node out of its page, keys out of
  order, a page reachable twice or lost). The writer pays this once per open (about a
  second per 170 MB of bank on one core) because it is the long-lived process: a bank
  damaged at rest must not crash-loop the daemon. Readers pay only the size check, so
  a page damaged in place (not a truncation) may still crash a reader;
  `aoe bank check` finds it.

What is found is a BankDamagedError naming the data file and what to do (`damaged`).
A walk is only meaningful on a file at rest: it is repeated while another process
commits meanwhile (the meta's txnid moved), and a bank that never holds still long
enough is reported as such, not as damaged.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import lmdb
import lmdb.verify

from aoe.errors import BankDamagedError, BankError

__all__ = ["DataFile", "cover_last_page", "damaged", "find_damage", "read_data_file"]

# The meta page, as LMDB 0.9's mdb.c lays it out on a 64-bit host (native byte order):
# a page header (MDB_page: mp_pgno u64, mp_pad u16, mp_flags u16, lower/upper u16 each),
# then MDB_meta: mm_magic u32, mm_version u32, mm_address ptr, mm_mapsize u64, mm_dbs[2]
# (the free and main databases, MDB_db of 48 bytes each: md_pad u32 (in the free db: the
# page size, mm_psize), md_flags u16, md_depth u16, four u64 counters, md_root u64),
# mm_last_pg u64, mm_txnid u64. LMDB 1.0 keeps MDB_meta but has a 24-byte page header,
# so the header size is told by where the magic is, as lmdb.verify does.
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = {16: 1, 24: 3}  # page header size -> data format version (0.9, 1.0)
_P_META = 0x08
#: MDB_meta from mm_magic: magic, version, (address), mapsize, psize (the free db's
#: md_pad), (the rest of both dbs), last_pg, txnid.
_META = struct.Struct("=II8xQI92xQQ")
_U32, _U64 = struct.Struct("=I"), struct.Struct("=Q")
_FREE_ROOT, _MAIN_ROOT = 24 + 40, 24 + 48 + 40  # md_root of each db, from mm_magic
_NO_PAGE = (1 << 64) - 1  # P_INVALID: the root of an empty database
#: Walks tried while the file keeps changing under them (another process committing).
_WALKS = 3
#: Problems of a walk named in a message; `aoe bank check` lists them all.
_NAMED = 3


@dataclass(frozen=True)
class DataFile:
    """What the committed meta page of a data file says, and the file's size."""

    psize: int  # bytes per page
    map_size: int  # the map the writer set (mm_mapsize)
    last_pg: int  # the last page the committed transaction counts
    txnid: int  # the committed transaction
    roots: tuple[int, ...]  # root pages of the free and main databases (not empty ones)
    size: int  # bytes in the file, read after the meta pages

    @property
    def needs(self) -> int:
        """Bytes the committed transaction counts: pages 0 .. last_pg."""
        return (self.last_pg + 1) * self.psize


class _Broken(Exception):
    """What is wrong with a data file, in words (`find_damage` returns it)."""


def _meta(fd: int, offset: int, hdr: int | None) -> tuple[int, int, int, int, int, tuple[int, ...]]:
    """(page header size, psize, map size, last_pg, txnid, roots) of the meta page at `offset`,
    checked as mdb_env_read_header checks it. Raises _Broken."""
    raw = os.pread(fd, 24 + _META.size, offset)
    which = "first" if offset == 0 else "second"
    if hdr is None:  # the first meta page tells the header size by where the magic is
        hdr = next(
            (
                h
                for h in _DATA_VERSION
                if len(raw) >= h + 4 and _U32.unpack_from(raw, h)[0] == _MAGIC
            ),
            None,
        )
        if hdr is None:
            raise _Broken(
                "no LMDB meta page at its start (not an LMDB file, or that page is damaged)"
            )
    if len(raw) < hdr + _META.size:
        raise _Broken(f"it ends inside its {which} meta page")
    (flags,) = struct.unpack_from("=H", raw, hdr - 6)  # mp_flags
    magic, version, map_size, psize, last_pg, txnid = _META.unpack_from(raw, hdr)
    if not flags & _P_META or magic != _MAGIC:
        raise _Broken(f"its {which} meta page is damaged")
    if version != _DATA_VERSION[hdr]:
        raise _Broken(f"its {which} meta page says data format {version}, not {_DATA_VERSION[hdr]}")
    roots = tuple(
        r
        for r in (_U64.unpack_from(raw, hdr + at)[0] for at in (_FREE_ROOT, _MAIN_ROOT))
        if r != _NO_PAGE
    )
    return hdr, psize, map_size, last_pg, txnid, roots


def _read(data: Path) -> DataFile | None:
    """What the committed meta page of the file `data` says, and its size; None when
    there is no such file or it cannot be opened (LMDB's own open says why). Raises
    _Broken."""
    try:
        fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size == 0:
            raise _Broken("it is empty (0 bytes): what the bank held is gone")
        first = _meta(fd, 0, None)
        hdr, psize = first[0], first[1]
        if psize < 256 or psize & (psize - 1) or psize > 1 << 16:
            raise _Broken(f"its first meta page is damaged (page size {psize})")
        second = _meta(fd, psize, hdr)
        psize2 = second[1]
        if psize2 != psize:
            raise _Broken(f"its meta pages disagree on the page size ({psize}, {psize2})")
        # mdb_env_pick_meta: the meta with the larger txnid is the committed one.
        map_size, last_pg, txnid, roots = (second if second[4] > first[4] else first)[2:]
        # The size is read after the metas: a commit writes its pages before its meta
        # page, so a meta read first never counts pages that a size read later lacks.
        return DataFile(psize, map_size, last_pg, txnid, roots, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def read_data_file(data: Path) -> DataFile | None:
    """What the committed meta page of the data file `data` says, and its size; None
    when there is no such file, it cannot be read, or it is damaged (`find_damage`
    says how)."""
    try:
        return _read(data)
    except (_Broken, OSError):
        return None


def _walk(data: Path) -> list[str] | None:
    """lmdb.verify's problems with `data` ([]: none) from a walk that no commit
    overlapped; None when a commit overlapped every walk (the file would not hold
    still). A walk of a file that changes under it may find what is not there."""
    for _ in range(_WALKS):
        before = _read(data)
        try:
            problems = lmdb.verify.verify(str(data), subdir=False)
        except lmdb.verify.VerifyError as exc:
            problems = [str(exc)]
        after = _read(data)
        if before is None or after is None or before.txnid == after.txnid:
            return problems
    return None


def find_damage(path: Path, *, walk: bool = False) -> list[str]:
    """What is wrong with the data file of the bank at `path`, one line per problem:
    [] when nothing is, or when there is no data file (a new bank: LMDB makes it).
    With `walk`, every page reachable from the committed meta is checked (see the
    module doc); a file shorter than its meta counts is walked anyway. Raises
    BankError when another process committed during every walk."""
    data = path / "data.mdb"
    try:
        f = _read(data)
    except _Broken as exc:
        return [str(exc)]
    except OSError as exc:  # (a read that failed: the disk under the bank)
        return [f"it cannot be read ({exc.strerror or exc})"]
    if f is None:
        return []
    short = []
    if f.size < f.needs:
        short = [
            f"it is {f.size} bytes, short of the {f.needs} bytes ({f.last_pg + 1} pages of "
            f"{f.psize}) its last commit counts"
        ]
        gone = [r for r in f.roots if (r + 1) * f.psize > f.size]
        if gone:  # a root past its end: truncated, no walk needed to know
            return [f"{short[0]}, and its root page {gone[0]} is beyond its end"]
        walk = True  # free pages never written, or a truncation: the walk tells
    if not walk:
        return []
    try:
        found = _walk(data)
    except OSError as exc:
        return [*short, f"it cannot be read ({exc.strerror or exc})"]
    if found is None:
        raise BankError(
            f"bank {path}: another process committed to it during each of {_WALKS} checks; "
            "check it again while nothing writes it (stop aoed, or let the tune finish)"
        )
    return [*short, *found] if found else []


def damaged(path: Path, problems: list[str]) -> BankDamagedError:
    """The error for the bank at `path` whose data file has `problems` (`find_damage`'s,
    or an lmdb error's words): it names the file, what is wrong and what to do."""
    what = "; ".join(problems[:_NAMED])
    if len(problems) > _NAMED:
        what += f"; and {len(problems) - _NAMED} more"
    return BankDamagedError(
        f"bank {path}: its data file {path / 'data.mdb'} is damaged: {what}. "
        f"`aoe bank check --bank {path}` lists what is wrong; to go on, move {path} aside, "
        f"then restore the bank from an export (aoe bank import FILE --bank {path}) or let "
        "a new bank start there"
    )


def cover_last_page(env: lmdb.Environment, data: Path, data_id: tuple[int, int] | None) -> None:
    """Lengthen `data`, the data file `env` has open (its (st_dev, st_ino) is
    `data_id`), to the pages the last commit counts, so that a healthy bank passes
    `find_damage` without a walk: a transaction that took pages from the end and gave
    them back leaves them counted but never written. Called after each commit by the
    process holding the bank's writer lock. The new tail is a sparse hole: LMDB writes
    those pages with pwrite once it uses them, and a full disk then is an error it
    reports.

    The size is read and the file truncated inside a write transaction of `env`, so
    that no commit of this process writes past the old end in between (the truncate
    would cut it). Best effort, after a commit that succeeded: nothing is raised, and
    the file stays short where this fails (a later open walks it) or where it is no
    longer the file `env` has open."""
    try:
        with env.begin(write=True):
            needs = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            fd = os.open(data, os.O_WRONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == data_id and st.st_size < needs:
                    os.ftruncate(fd, needs)
            finally:
                os.close(fd)
    except (lmdb.Error, OSError):
        pass

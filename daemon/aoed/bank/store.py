"""The writable LMDB bank: the only place that opens LMDB for writing.

One environment holds named databases:
  meta      schema version of the layout
  entries   bank key -> aoe.v1.BankEntry (the best known strategy per key: what serves)
  defaults  bank key -> JSON: tuned, and the default stayed best (not an entry, but no
            reason to measure again unless REPEAT_TUNE)
  history   bank key + "/" + 16 hex digits of ns time -> JSON of one measured trial

Every method runs one whole transaction and returns; callers on trio run them in a
worker thread. A full map grows (doubles) and the write is retried, so a growing bank
never fails a job. A crash mid-write loses at most the transaction in flight: LMDB
commits are atomic.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb

from aoe.errors import BankError
from aoe.signature import SCHEMA_VERSION

__all__ = ["BankStore", "default_bank_path"]

_INITIAL_MAP = 64 << 20
_MAX_MAP = 1 << 40


def default_bank_path() -> Path:
    """TUNE_BANK_PATH if set, else the user's data dir (e.g. ~/.local/share/aoed/bank)."""
    env = os.environ.get("TUNE_BANK_PATH")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_data_dir("aoed")) / "bank"


class BankStore:
    def __init__(self, path: str | os.PathLike[str], map_size: int = _INITIAL_MAP):
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if not os.access(self.path, os.W_OK):
                raise BankError(f"bank {self.path}: directory is not writable")
            self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=8, subdir=True)
            self._meta = self.env.open_db(b"meta")
            self._entries = self.env.open_db(b"entries")
            self._defaults = self.env.open_db(b"defaults")
            self._history = self.env.open_db(b"history")
        except lmdb.Error as exc:
            raise BankError(f"bank {self.path}: cannot open ({exc})") from None
        except OSError as exc:
            raise BankError(f"bank {self.path}: {exc.strerror or exc}") from None
        self._check_schema()

    def _check_schema(self) -> None:
        with self.env.begin(write=True, db=self._meta) as txn:
            raw = txn.get(b"schema_version")
            if raw is None:
                txn.put(b"schema_version", str(SCHEMA_VERSION).encode())
                return
        version = int(raw)
        if version > SCHEMA_VERSION:
            raise BankError(
                f"bank {self.path}: schema version {version} is newer than this aoed "
                f"understands ({SCHEMA_VERSION}); upgrade aoed or use another bank"
            )

    def get(self, key: bytes) -> bytes | None:
        with self.env.begin(db=self._entries) as txn:
            return txn.get(key)

    def get_default(self, key: bytes) -> dict[str, Any] | None:
        with self.env.begin(db=self._defaults) as txn:
            raw = txn.get(key)
        return json.loads(raw) if raw is not None else None

    def commit(
        self,
        entries: Iterable[tuple[bytes, bytes]] = (),
        defaults: Iterable[tuple[bytes, dict[str, Any]]] = (),
        trials: Iterable[tuple[bytes, dict[str, Any]]] = (),
    ) -> None:
        """Write everything given in one transaction (all or nothing)."""
        entries, defaults, trials = list(entries), list(defaults), list(trials)
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for key, value in entries:
                        txn.put(key, value, db=self._entries)
                        txn.delete(key, db=self._defaults)
                    for key, doc in defaults:
                        txn.put(key, json.dumps(doc, sort_keys=True).encode(), db=self._defaults)
                    for i, (key, doc) in enumerate(trials):
                        hkey = key + b"/" + f"{time.time_ns() + i:016x}".encode()
                        txn.put(hkey, json.dumps(doc, sort_keys=True).encode(), db=self._history)
                return
            except lmdb.MapFullError:
                self._grow()
            except lmdb.Error as exc:
                raise BankError(f"bank {self.path}: write failed ({exc})") from None

    def _grow(self) -> None:
        size = self.env.info()["map_size"] * 2
        if size > _MAX_MAP:
            raise BankError(f"bank {self.path}: map would exceed {_MAX_MAP >> 30} GiB")
        self.env.set_mapsize(size)

    def counts(self) -> dict[str, int]:
        with self.env.begin() as txn:
            return {
                "entries": txn.stat(self._entries)["entries"],
                "defaults": txn.stat(self._defaults)["entries"],
                "history": txn.stat(self._history)["entries"],
            }

    def close(self) -> None:
        self.env.close()

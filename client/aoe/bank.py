"""Read the knowledge bank without the daemon: what compilers and serving processes import.

    bank = aoe.bank.open_bank("/var/lib/aoed/bank")          # once per process
    entry, layer = bank.lookup(key)                           # microseconds
    tasks = aoe.bank.ModelTasks(model)                        # once per model
    entry, layer = bank.lookup_node(node, tasks)              # the node's task, this device

A bank is a stack of layers: the custom bank first (the one aoed writes), then read-only
layers in order (a system bank, team banks: `layers=`, the AOED_BANK_LAYERS environment
variable, `--bank-layer DIR`). The first layer that holds a key answers, and every
result names it. Each layer's LMDB environment is opened once, read-only but with
LMDB's reader lock, so a reader sees a consistent snapshot per call while aoed commits
in another process; nothing a reader does can block or corrupt the writer. Readers
never take the writer's lock. Every lmdb error leaves as a BankError naming the bank.

Entries are keyed by schema version, signature digest and device digest (see
`aoe.keys.bank_key`), so an entry measured on another device never answers a
lookup made for this one; `lookup_explain()` says why a lookup found nothing.

`aoe.compile.apply_bank(model, output, bank)` writes the tuned model the bank describes
(what `aoe compile` does). `records()` yields what `aoe bank export` writes; the lines'
format is `aoe.exchange`'s (its names are re-exported here).

Importing this module pulls in lmdb, protobuf, onnx and numpy only: no trio, no
onnxruntime, no daemon. `ModelTasks` (from `aoe.partition`) normalizes and splits a
model as the tuner does, in pure onnx. A `BankReader` may be shared by threads, but must
not cross a fork: open it in the process that uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import lmdb
import onnx

from aoe.errors import BankError

# The exchange format is aoe.exchange's; re-exported here, where compilers and tools
# have always imported it from.
from aoe.exchange import (
    default_doc,
    default_record,
    entry_from_json,
    entry_to_json,
    exported_trial,
    record_from_json,
    record_to_json,
)
from aoe.fingerprint import device_fingerprint
from aoe.keys import PRECISION_CODES, SCHEMA_VERSION, DeviceFingerprint, TaskSignature, bank_key
from aoe.lmdbcheck import damaged, find_damage, read_data_file
from aoe.lmdbenv import FULL_MAP, MAP_SIZES, TxnGate, bank_error, lmdb_errors, reserve_lock_file
from aoe.partition import ModelTasks
from aoe.v1 import bank_pb2

__all__ = [
    "CUSTOM",
    "LAYERS_ENV",
    "BankReader",
    "Explanation",
    "Layer",
    "LayerStats",
    "ModelTasks",
    "SeenEntry",
    "default_bank_path",
    "default_doc",
    "default_record",
    "entry_from_json",
    "entry_to_json",
    "layer_paths_from_env",
    "open_bank",
    "parse_key",
    "record_from_json",
    "record_to_json",
]

#: Environment variable naming read-only layers, separated by os.pathsep.
LAYERS_ENV = "AOED_BANK_LAYERS"
#: Name of the writable (first) layer in results.
CUSTOM = "custom"

#: Named databases of a bank environment (written by aoed.bank.store).
DB_NAMES = (b"meta", b"entries", b"defaults", b"history")
MAX_DBS = 16  # the writer keeps 8 (aoed.bank.store); room for more kinds of record
#: The map readers (and the writer, aoed.bank.store) open a bank with where they may.
READER_MAP = FULL_MAP

_PRECISIONS = set(PRECISION_CODES)


def default_bank_path() -> Path:
    """The configured custom bank: TUNE_BANK_PATH, the config file's, or the user data
    dir (see aoe.config, which reads the environment)."""
    from aoe.config import bank_from_env

    return bank_from_env()


def layer_paths_from_env() -> list[Path]:
    """The read-only layers named in AOED_BANK_LAYERS, in order (see aoe.config)."""
    from aoe.config import layers_from_env

    return list(layers_from_env())


def parse_key(key: str | bytes) -> tuple[int, str, str, str]:
    """Split a bank key into (schema version, signature digest[:32], device digest[:32],
    precision). Raises ValueError when `key` is not shaped like one."""
    text = key.decode("ascii", "replace") if isinstance(key, bytes) else key
    parts = text.split("/")
    if len(parts) != 4 or not parts[0].startswith("v") or not parts[0][1:].isdigit():
        raise ValueError(
            f"{text!r} is not a bank key (expected v{SCHEMA_VERSION}/<signature>/<device>/<precision>)"
        )
    return int(parts[0][1:]), parts[1], parts[2], parts[3]


def parse_schema(path: Path, raw: bytes) -> int:
    """The schema version in a bank's meta db; BankError when unreadable or newer than
    this code understands (readers and the writer share this check)."""
    try:
        version = int(raw)
    except ValueError:
        raise BankError(f"bank {path}: unreadable schema version {raw!r}") from None
    if version > SCHEMA_VERSION:
        raise BankError(
            f"bank {path}: schema version {version} is newer than this aoe understands "
            f"({SCHEMA_VERSION}); upgrade aoed (which brings aoe) or use another bank"
        )
    return version


def check_schema(path: Path, raw: bytes | None) -> int:
    """The schema version stored in a bank's meta db; BankError unless it is ours."""
    if raw is None:
        raise BankError(f"bank {path}: no schema version recorded; not a bank written by aoed")
    version = parse_schema(path, raw)
    if version < SCHEMA_VERSION:
        raise BankError(
            f"bank {path}: schema version {version} is older than this aoe's ({SCHEMA_VERSION}); "
            f"open it once with the aoed that writes it (aoe tune --bank {path}) to migrate it"
        )
    return version


# --------------------------------------------------------------------------- layers


class Layer(Protocol):
    """What a BankReader reads a layer through: `_Layer` (a read-only environment) or
    the daemon's view of its own store (aoed.bank.daemonbank.StoreLayer). The named
    databases are LMDB handles; `schema` is the layout version its meta db records."""

    name: str
    path: Path
    env: lmdb.Environment
    meta: Any
    entries: Any
    defaults: Any
    history: Any
    schema: int

    def read(
        self, db: Any, doing: str = "lookup"
    ) -> contextlib.AbstractContextManager[lmdb.Transaction[bytes]]: ...
    def get(self, key: bytes, db: Any = None) -> bytes | None: ...
    def close(self) -> None: ...


class _Layer:
    """One read-only LMDB environment and its named databases."""

    __slots__ = (
        "defaults",
        "entries",
        "env",
        "full",
        "gate",
        "history",
        "meta",
        "name",
        "path",
        "schema",
    )

    def __init__(self, name: str, path: Path):
        self.name = name
        self.path = path
        self.gate = TxnGate()
        self.full = False
        if not (path / "data.mdb").is_file():
            raise BankError(
                f"bank {path}: no bank here (no data.mdb); tune a model into it first "
                f"(aoe tune MODEL --bank {path}) or check the path"
            )
        # A page the file lacks would be SIGBUS when LMDB reads it (aoe.lmdbcheck).
        problems = find_damage(path)
        if problems:
            raise damaged(path, problems)
        # LMDB writes this reader's slot into lock.mdb through a map: allocated first.
        reserve_lock_file(path)
        try:
            self.env = self._open(lock=True)
        except lmdb.Error as exc:
            # No write access to lock.mdb: LMDB's reader lock is out of reach. Readers
            # without it are only safe while nobody writes, which is what a shared team
            # or system layer is; a bank a daemon writes needs lock.mdb writable by its
            # readers (e.g. group-writable).
            if "ermission" not in str(exc) and "ead-only" not in str(exc):
                raise bank_error(exc, path, "open") from None
            try:
                self.env = self._open(lock=False)
            except lmdb.Error as exc2:
                raise bank_error(exc2, path, "open") from None
        try:
            with lmdb_errors(path, "open", self.env):
                try:
                    self.meta = self.env.open_db(b"meta", create=False)
                    self.entries = self.env.open_db(b"entries", create=False)
                    self.defaults = self.env.open_db(b"defaults", create=False)
                    self.history = self.env.open_db(b"history", create=False)
                except lmdb.NotFoundError:
                    raise BankError(
                        f"bank {path}: not a bank written by aoed (named databases missing)"
                    ) from None
            with self.read(self.meta, "open") as txn:
                raw = txn.get(b"schema_version")
            self.schema = check_schema(path, raw)
        except BaseException:
            self.env.close()
            raise

    def _open(self, lock: bool) -> lmdb.Environment:
        # Map as much as the address space allows (address space only, read-only), so
        # that a growing bank rarely needs a remap (see `read`).
        for size in MAP_SIZES:
            try:
                env = lmdb.open(
                    str(self.path),
                    readonly=True,
                    lock=lock,
                    max_dbs=MAX_DBS,
                    subdir=True,
                    create=False,
                    readahead=False,
                    map_size=size,
                )
                self.full = size == FULL_MAP
                return env
            except lmdb.MemoryError:
                continue  # address space limited (ulimit -v): try a smaller map
        raise BankError(
            f"bank {self.path}: cannot map the bank into memory; raise the address space limit (ulimit -v)"
        )

    @contextlib.contextmanager
    def read(self, db: Any, doing: str = "lookup") -> Iterator[lmdb.Transaction[bytes]]:
        """A read transaction on `db`, ended when the block ends. A writer that grew the
        bank past our map (where the full map could not be reserved, or a writer that
        mapped more) is followed by a remap under the layer's gate; lmdb errors leave
        as BankError.

        With the full map reserved (the usual case) no writer can outgrow it, so there
        is never a remap to guard against, and the gate is skipped: a lookup costs one
        plain read transaction."""
        if self.full:
            with lmdb_errors(self.path, doing, self.env):
                txn = self.env.begin(db=db)
                try:
                    yield txn
                finally:
                    txn.abort()
            return
        with (
            lmdb_errors(self.path, doing, self.env),
            self.gate.transaction(self.env, self.path, db=db) as txn,
        ):
            yield txn

    def get(self, key: bytes, db: Any = None) -> bytes | None:
        if self.full:  # the hot path of every lookup: no context managers
            try:
                txn = self.env.begin(db=self.entries if db is None else db)
                try:
                    return txn.get(key)
                finally:
                    txn.abort()
            except lmdb.Error as exc:
                raise bank_error(exc, self.path, "lookup") from None
        with self.read(self.entries if db is None else db) as txn:
            return txn.get(key)

    def close(self) -> None:
        self.env.close()


@dataclass(frozen=True)
class SeenEntry:
    """An entry found for a signature while explaining a miss."""

    layer: str
    key: str
    device_digest: str
    hardware: str
    runtime_version: str
    precision: str
    strategy: str
    differs: tuple[str, ...]  # fingerprint fields that differ from the asked device


@dataclass(frozen=True)
class Explanation:
    """Why a lookup found what it found: `reason` is empty when `found`."""

    key: str
    found: bool
    layer: str
    reason: str
    seen: tuple[SeenEntry, ...] = ()
    default_layer: str = ""  # a layer recording that the default strategy stayed best


@dataclass(frozen=True)
class LayerStats:
    name: str
    path: str
    entries: int
    defaults: int
    history: int
    map_size: int
    used_bytes: int
    schema_version: int


def _fingerprint_diff(a_json: str, b_json: str) -> tuple[str, ...]:
    try:
        a, b = json.loads(a_json), json.loads(b_json)
    except ValueError:
        return ("fingerprint",)
    out = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            if isinstance(a.get(k), str) and isinstance(b.get(k), str):
                out.append(f"{k} ({a[k]} here, {b[k]} there)")
            else:
                out.append(k)
    return tuple(out)


class BankReader:
    """Layered, read-only view of one or more banks; see the module docstring."""

    def __init__(self, layers: Sequence[Layer], device: DeviceFingerprint | None = None):
        self._layers = tuple(layers)
        self.device = device or device_fingerprint()
        self._dev32 = self.device.digest[:32]

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> BankReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every layer's environment; the reader is unusable afterwards."""
        for layer in self._layers:
            layer.close()
        self._layers = ()

    @property
    def layers(self) -> list[tuple[str, Path]]:
        """(name, path) of every layer in lookup order."""
        return [(layer.name, layer.path) for layer in self._layers]

    def under(self, first: Layer, device: DeviceFingerprint | None = None) -> BankReader:
        """A reader for `device` (default: this reader's) that consults the layer `first`
        (a layer object, such as the daemon's view of its own store), then this reader's
        layers, which it borrows: do not close it (that would close them); close this one."""
        return BankReader([first, *self._layers], device or self.device)

    # ------------------------------------------------------------------ lookups

    def lookup(self, key: bytes | str) -> tuple[bank_pb2.BankEntry | None, str]:
        """The entry stored under `key` in the first layer that has one, and that layer's
        name; (None, "") when no layer has it. One read transaction per layer visited."""
        if isinstance(key, str):
            key = key.encode()
        for layer in self._layers:
            raw = layer.get(key)
            if raw is not None:
                return bank_pb2.BankEntry.FromString(raw), layer.name
        return None, ""

    def lookup_raw(self, key: bytes) -> tuple[bytes | None, str]:
        """Like `lookup` but returns the serialized entry (no decoding)."""
        for layer in self._layers:
            raw = layer.get(key)
            if raw is not None:
                return raw, layer.name
        return None, ""

    def key_for(
        self, signature_digest: str, precision: str = "exact", device_digest: str | None = None
    ) -> bytes:
        """The bank key of a task on this reader's device (or `device_digest`)."""
        return bank_key(signature_digest, device_digest or self.device.digest, precision)

    def lookup_signature(
        self, signature: TaskSignature | str, precision: str = "exact"
    ) -> tuple[bank_pb2.BankEntry | None, str]:
        """Lookup of a task signature (or its digest) on this reader's device."""
        digest = signature if isinstance(signature, str) else signature.digest
        return self.lookup(bank_key(digest, self.device.digest, precision))

    def lookup_node(
        self, node: onnx.NodeProto, tasks: ModelTasks, precision: str = "exact"
    ) -> tuple[bank_pb2.BankEntry | None, str]:
        """The entry for the task `node` anchors in its model (`tasks`), on this device;
        (None, "") when the node anchors no task or nothing is stored for it."""
        sig = tasks.signature(node)
        if sig is None:
            return None, ""
        return self.lookup(bank_key(sig.digest, self.device.digest, precision))

    def lookup_default(self, key: bytes | str) -> tuple[dict[str, Any] | None, str]:
        """The "tuned, the default stayed best" record for `key` and its layer."""
        if isinstance(key, str):
            key = key.encode()
        for layer in self._layers:
            raw = layer.get(key, layer.defaults)
            if raw is not None:
                return _stored_doc(layer.path, key, raw), layer.name
        return None, ""

    def lookup_explain(
        self,
        key: bytes | str | None = None,
        *,
        signature_digest: str | None = None,
        device_digest: str | None = None,
        precision: str = "exact",
    ) -> Explanation:
        """Look up `key` (or the key of the digests, this device by default) and say why
        it matched or did not: entries for the same signature on other devices or under
        other precisions, a recorded "default stays best", or nothing at all."""
        if key is None:
            if not signature_digest:
                raise ValueError("lookup_explain() needs a key or a signature digest")
            key = bank_key(signature_digest, device_digest or self.device.digest, precision)
        text = key.decode() if isinstance(key, bytes) else key
        try:
            schema, sig32, dev32, prec = parse_key(text)
        except ValueError as exc:
            return Explanation(text, False, "", str(exc))
        entry, layer = self.lookup(text)
        if entry is not None:
            if entry.device.digest[:32] != dev32:
                return Explanation(
                    text,
                    False,
                    layer,
                    f"entry in layer {layer} was measured on device "
                    f"{entry.device.digest[:32]}, not {dev32}: never applied",
                )
            return Explanation(text, True, layer, "")
        names = ", ".join(layer.name for layer in self._layers) or "none"
        if schema != SCHEMA_VERSION:
            return Explanation(
                text,
                False,
                "",
                f"key has schema version {schema}; these banks use {SCHEMA_VERSION}",
            )
        if prec not in _PRECISIONS:
            return Explanation(
                text,
                False,
                "",
                f"unknown precision {prec!r} (one of {', '.join(sorted(_PRECISIONS))})",
            )
        ask_json = self.device.canonical_json if dev32 == self._dev32 else ""
        seen = tuple(self._entries_for_signature(sig32, ask_json))
        default, default_layer = self.lookup_default(text)
        reasons = []
        if default is not None:
            reasons.append(
                f"tuned on this device (layer {default_layer}) and the default strategy stayed "
                "fastest: nothing to apply, no need to tune again"
            )
        same_dev = [s for s in seen if s.device_digest == dev32]
        other_dev = [s for s in seen if s.device_digest != dev32]
        if same_dev:
            precs = sorted({s.precision for s in same_dev})
            reasons.append(
                f"entries for this device exist under precision {', '.join(precs)}, not {prec}"
            )
        if other_dev:
            devs = []
            for s in other_dev:
                diff = f"; differs in {', '.join(s.differs)}" if s.differs else ""
                devs.append(
                    f"{s.device_digest} ({s.hardware}, onnxruntime {s.runtime_version}, "
                    f"{s.precision}, layer {s.layer}{diff})"
                )
            reasons.append(
                f"signature {sig32} was tuned on {len(other_dev)} other device fingerprint(s), "
                f"never applied here (this device is {dev32}): " + "; ".join(devs)
            )
        if not reasons:
            reasons.append(
                f"no entry for signature {sig32} in any layer ({names}); tune a model with this task"
            )
        return Explanation(text, False, "", "; ".join(reasons), seen, default_layer)

    def _entries_for_signature(self, sig32: str, ask_json: str) -> Iterator[SeenEntry]:
        # Keys sort by signature first, so one range scan finds every device and precision.
        prefix = f"v{SCHEMA_VERSION}/{sig32}/".encode()
        for layer in self._layers:
            with layer.read(layer.entries) as txn:
                cur = txn.cursor()
                if not cur.set_range(prefix):
                    continue
                for k, v in cur:
                    if not k.startswith(prefix):
                        break
                    e = bank_pb2.BankEntry.FromString(v)
                    yield SeenEntry(
                        layer=layer.name,
                        key=k.decode(),
                        device_digest=e.device.digest[:32],
                        hardware=e.device.hardware,
                        runtime_version=e.device.runtime_version,
                        precision=k.decode().rsplit("/", 1)[-1],
                        strategy=e.strategy.name,
                        differs=_fingerprint_diff(ask_json, e.device.canonical_json)
                        if ask_json
                        else (),
                    )

    # ------------------------------------------------------------------ whole-bank reads

    def entries(self, layer: str | None = None) -> Iterator[tuple[str, bank_pb2.BankEntry]]:
        """(layer name, entry) for every entry of one layer (default: all, in order), in
        key order; one read snapshot per layer."""
        for lay in self._layers:
            if layer is not None and lay.name != layer:
                continue
            with lay.read(lay.entries, "read") as txn:
                for _k, v in txn.cursor():
                    yield lay.name, bank_pb2.BankEntry.FromString(v)

    def records(
        self, layer: str | None = None, *, entries_only: bool = False, history: bool = True
    ) -> Iterator[tuple[str, bank_pb2.ExportEntriesResponse]]:
        """(layer name, record) for every record of one layer (default: all, in order):
        its entries, then its default records, then its history (unless `entries_only`,
        or not `history`), each in key order, all from one read snapshot per layer.
        This is what `aoe bank export` writes, one `record_to_json` line each."""
        for lay in self._layers:
            if layer is not None and lay.name != layer:
                continue
            with lay.read(lay.entries, "export") as txn:
                for _k, v in txn.cursor():
                    yield (
                        lay.name,
                        bank_pb2.ExportEntriesResponse(entry=bank_pb2.BankEntry.FromString(v)),
                    )
                if entries_only:
                    continue
                for k, v in txn.cursor(db=lay.defaults):
                    rec = default_record(k, _stored_doc(lay.path, k, v))
                    yield lay.name, bank_pb2.ExportEntriesResponse(default_record=rec)
                if not history:
                    continue
                for k, v in txn.cursor(db=lay.history):
                    trial = exported_trial(k, v)
                    yield lay.name, bank_pb2.ExportEntriesResponse(trial=trial)

    def stats(self) -> list[LayerStats]:
        """Counts and sizes of every layer, in lookup order."""
        out = []
        for lay in self._layers:
            with lay.read(lay.entries, "stats") as txn:
                counts = {
                    n: txn.stat(db)["entries"]
                    for n, db in (
                        ("entries", lay.entries),
                        ("defaults", lay.defaults),
                        ("history", lay.history),
                    )
                }
                used = used_bytes(lay.env, txn, (lay.meta, lay.entries, lay.defaults, lay.history))
            out.append(
                LayerStats(
                    lay.name,
                    str(lay.path),
                    counts["entries"],
                    counts["defaults"],
                    counts["history"],
                    _stored_map_size(lay.path),
                    used,
                    lay.schema,
                )
            )
        return out


def _stored_doc(path: Path, key: bytes, raw: bytes) -> dict[str, Any]:
    """A default record's document as the bank stores it, parsed with bounded nesting
    (aoe.recordcheck.loads); BankError naming the bank and key when it is no object."""
    from aoe.recordcheck import RecordError, loads

    try:
        doc = loads(raw, "default record", 1 << 20)
    except RecordError as exc:
        doc = exc
    if not isinstance(doc, dict):
        raise BankError(
            f"bank {path}: default record {key.decode('ascii', 'replace')}: not a document "
            f"aoed writes ({doc}); drop the bank's copy of it or restore the bank"
        )
    return doc


def _stored_map_size(path: Path) -> int:
    """The map size the writer set for the bank at `path`, from the newer of LMDB's two
    meta pages (our own mapping is larger on purpose, and the file only grows as pages
    are used)."""
    data = path / "data.mdb"
    meta = read_data_file(data)
    return meta.map_size if meta is not None else data.stat().st_size


def used_bytes(env: lmdb.Environment, txn: lmdb.Transaction[bytes], dbs: Sequence[Any]) -> int:
    """Bytes the pages of `dbs` (and the main db) occupy in `txn`'s snapshot."""
    total = 0
    for st in [env.stat(), *(txn.stat(db) for db in dbs)]:
        total += (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"]
    return total


def open_bank(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    *,
    layers: Sequence[str | os.PathLike[str]] = (),
    use_env: bool = True,
    device: DeviceFingerprint | None = None,
    custom: bool = True,
) -> BankReader:
    """Open a layered bank reader.

    `paths`: the custom bank (named "custom"), or a sequence whose first item is the
    custom bank and the rest read-only layers; None means `default_bank_path()`. Then
    come `layers`, then (with `use_env`) those in AOED_BANK_LAYERS; a path listed twice
    is opened once. Read-only layers are named by their path. `device` is the device
    lookups are made for (default: this machine's CPU provider). With `custom=False`
    every path is a read-only layer named by its path (how aoed opens its layers).

    Raises BankError when a path holds no bank, cannot be opened, or has another schema.
    """
    if paths is None:
        items: list[Path] = [default_bank_path()]
    elif isinstance(paths, (str, os.PathLike)):
        items = [Path(paths)]
    else:
        items = [Path(p) for p in paths]
    items += [Path(p) for p in layers]
    if use_env:
        items += layer_paths_from_env()
    opened: list[_Layer] = []
    seen: set[Path] = set()
    try:
        for i, p in enumerate(items):
            real = p.resolve()
            if real in seen:
                continue
            seen.add(real)
            opened.append(_Layer(CUSTOM if i == 0 and custom else str(p), p))
    except BaseException:
        for lay in opened:
            lay.close()
        raise
    return BankReader(opened, device)

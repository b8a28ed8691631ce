"""The upload quotas: what uploads not yet submitted hold, in all and per client.

An upload is kept until a job consumes it or `upload_ttl_h` passes, so without a bound
any client could fill the state dir with uploads it never submits. The ledger counts
the bytes and the number of uploads kept or still arriving, in all (`[limits]
max_uploads_mb`, `max_uploads`) and per client (`max_client_uploads_mb`,
`max_client_uploads`), and refuses a reservation that would pass one of them before
the bytes are written: UploadModel reserves the size its header declares, and then
each chunk beyond what it reserved, before writing it.

A client is what the transport tells (`api.tuning.client_of`): a TLS subject, a TCP
address, or, on the unix socket, "local": grpcio gives a server neither the peer's uid
nor its pid there (`context.peer()` is "unix:", the auth context names only the
transport), so every caller on the socket shares one client quota, which is then no
tighter than the total one. The per-client counts live in memory: uploads kept from
before a restart count in the totals only.

Thread-safe: UploadModel handlers (gRPC threads) reserve as they receive; the job
manager (trio thread) releases what a job consumed or what expired.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from aoe.errors import ResourceExhaustedError
from aoed.config import DaemonConfig
from aoed.jobs.store import Upload
from aoed.space import size_text

__all__ = ["UploadLedger"]

#: the client of uploads kept from before a restart (counted in the totals only)
_UNKNOWN = ""


class UploadLedger:
    def __init__(self, kept: Iterable[Upload] = ()):
        self._lock = threading.Lock()
        self._held: dict[str, tuple[str, int]] = {up.id: (_UNKNOWN, up.size) for up in kept}

    def usage(self, client: str | None = None) -> tuple[int, int]:
        """(bytes, uploads) held by `client`, or by everyone when None."""
        with self._lock:
            return self._usage(client)

    def _usage(self, client: str | None) -> tuple[int, int]:
        held = [n for c, n in self._held.values() if client is None or c == client]
        return sum(held), len(held)

    def reserve(self, upload_id: str, client: str, nbytes: int, cfg: DaemonConfig) -> None:
        """Hold `nbytes` in all for the upload `upload_id` of `client` (a first call
        also counts one upload). Raises ResourceExhaustedError naming the limit it would
        pass, holding what it held before."""
        with self._lock:
            _, before = self._held.get(upload_id, (client, 0))
            new = upload_id not in self._held
            grow = max(0, nbytes - before)
            total, count = self._usage(None)
            mine, my_count = self._usage(client)
            if new and count + 1 > cfg.max_uploads:
                raise _refused(
                    f"{count} uploads are kept and not yet submitted (the limit is {cfg.max_uploads}, "
                    "[limits] max_uploads)"
                )
            if new and my_count + 1 > cfg.max_client_uploads:
                raise _refused(
                    f"client {client} has {my_count} uploads kept and not yet submitted (the limit per "
                    f"client is {cfg.max_client_uploads}, [limits] max_client_uploads)"
                )
            if total + grow > cfg.max_uploads_bytes:
                raise _refused(
                    f"uploads not yet submitted would hold {size_text(total + grow)}, over the limit of "
                    f"{size_text(cfg.max_uploads_bytes)} for all clients ([limits] max_uploads_mb)"
                )
            if mine + grow > cfg.max_client_uploads_bytes:
                raise _refused(
                    f"client {client}'s uploads not yet submitted would hold {size_text(mine + grow)}, "
                    f"over the limit of {size_text(cfg.max_client_uploads_bytes)} per client "
                    "([limits] max_client_uploads_mb)"
                )
            self._held[upload_id] = (client, before + grow)

    def release(self, upload_id: str) -> None:
        """The upload is gone (consumed, expired or refused): it holds nothing any more."""
        with self._lock:
            self._held.pop(upload_id, None)


def _refused(why: str) -> ResourceExhaustedError:
    return ResourceExhaustedError(
        f"UploadModel: {why}; submit the uploads you made, or wait until unused ones "
        "expire ([limits] upload_ttl_h)"
    )

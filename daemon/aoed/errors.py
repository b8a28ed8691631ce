"""Daemon errors that carry their own gRPC status (by name: no grpc import needed).

The shared hierarchy is `aoe.errors`; these are the service's additions, raised by the
job manager and the servicers and mapped to statuses by `api/_bridge.py`.
"""

from __future__ import annotations

from aoe.errors import AoedError

__all__ = ["NotFoundError", "PermissionDeniedError", "RpcError"]


class RpcError(AoedError):
    """An error with an explicit status, e.g. RpcError("RESOURCE_EXHAUSTED", "...")."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.grpc_status = status


class NotFoundError(RpcError):
    """No such job, upload or file."""

    def __init__(self, message: str):
        super().__init__("NOT_FOUND", message)


class PermissionDeniedError(RpcError):
    """A daemon-side path outside the allowed directories, or a model file there with
    several hard links (which may be a file from elsewhere)."""

    def __init__(self, message: str):
        super().__init__("PERMISSION_DENIED", message)

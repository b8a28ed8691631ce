"""The gRPC servicers; `Bridge` is the one crossing from grpc threads into trio."""

from __future__ import annotations

from aoed.api._bridge import Bridge

__all__ = ["Bridge"]

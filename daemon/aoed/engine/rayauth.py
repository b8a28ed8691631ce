"""Who may use the Ray cluster the engine drives: Ray's token authentication.

A Ray cluster runs whatever code its callers send, as the user its nodes run as, and
its driver (this process) unpickles what actors return. With RAY_AUTH_MODE=token in
the environment of every node's `ray start`, Ray (2.52 and later; the cluster extra
needs 2.60) lets in only calls that carry the cluster's token: calls to the GCS, the
raylets and object managers, every worker's and driver's own server, the client server,
the dashboard and the runtime-env agent (each checked against a real cluster by
tests/test_cluster_auth.py or by hand: the gRPC ones answer UNAUTHENTICATED, the HTTP
ones 401). Ray finds the token in RAY_AUTH_TOKEN, else in the file RAY_AUTH_TOKEN_PATH
names. Without token mode, anyone who can reach any of those ports runs code as the
nodes' user and in the driver.

So the engine, before it connects:

- reads the token only from the file `[cluster] token_file` names, and only when its
  own user owns it and nobody else may read or change it (`read_token`). Ray is given
  the file's path in this process's environment, never the token itself, and a token in
  RAY_AUTH_TOKEN is dropped (Ray would prefer it to the file) (`use_token`);
- asks the head twice (`check_head`): without the token, which the head must refuse
  (one that answers runs anyone's code, and is refused unless `[cluster]
  allow_unauthenticated = true`, then logged as a warning at every start), and with the
  token, which it must let in (else the file holds another cluster's token).

Not covered here: the cluster's traffic, the token included, is not encrypted (keep it
on a network that only the cluster's machines share), and Ray's GCS, raylets and workers
listen on every address of their machines whatever `--node-ip-address` says (a
firewall decides who reaches them; the token decides what they may do).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import grpc

from aoe.config import Config
from aoe.errors import DeviceError, OptionError, PermissionDeniedError

__all__ = ["MIN_TOKEN_CHARS", "check_head", "read_token", "use_token"]

log = logging.getLogger(__name__)

#: Characters a token needs at least: 128 bits written in hex. `ray get-auth-token
#: --generate` and deploy/README.md's recipe make 64.
MIN_TOKEN_CHARS = 32
#: Bytes of a token file read at most: a token is one short word.
_MAX_TOKEN_BYTES = 4096
#: The call asked of the head to learn whether it wants a token: the first one every Ray
#: client makes (its cluster's id), harmless, and answered to anyone the head lets in.
_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"
#: Seconds a probe may take. grpc's own deadline, so that a thread abandoned by a
#: cancelled caller ends too.
_PROBE_TIMEOUT_S = 30.0
#: What a token file must not allow anyone but its owner: reading, writing, running.
_OTHERS = 0o077


def read_token(path: Path, where: str = "[cluster] token_file") -> str:
    """The token in the file at `path`, without the whitespace around it (Ray drops it
    too). OptionError naming `where` and the file when it cannot be read, is not a
    regular file, belongs to another user, lets anyone else read or change it, or does
    not hold one word of MIN_TOKEN_CHARS or more."""
    try:
        # O_NONBLOCK: a FIFO planted at the path opens at once, and is then refused.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise OptionError(f"{where} {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)  # the file read, not whatever the path names by then
        if not stat.S_ISREG(st.st_mode):
            raise OptionError(f"{where} {path}: not a regular file")
        if st.st_uid != os.geteuid():
            raise OptionError(
                f"{where} {path}: belongs to uid {st.st_uid}, not to the user reading it (uid "
                f"{os.geteuid()}); its owner can read the token or change it: make it this "
                "user's, mode 0600"
            )
        if st.st_mode & _OTHERS:
            raise OptionError(
                f"{where} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users at it, and "
                "whoever reads the token runs code on every node of the cluster as the user the "
                f"nodes run as: chmod 600 {path}"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(_MAX_TOKEN_BYTES + 1)
    finally:
        os.close(fd)
    words = raw.split()
    if not words:
        raise OptionError(f"{where} {path}: empty; write the cluster's token into it")
    if len(words) > 1 or len(raw) > _MAX_TOKEN_BYTES or not words[0].isascii():
        raise OptionError(f"{where} {path}: expected one word, the cluster's token")
    if len(words[0]) < MIN_TOKEN_CHARS:
        raise OptionError(
            f"{where} {path}: a token of {len(words[0])} characters is too easy to guess; use "
            f"{MIN_TOKEN_CHARS} or more (python3 -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return words[0].decode("ascii")


def use_token(token_file: Path | None) -> None:
    """Have Ray, in this process, send the token in `token_file` with every call (None:
    send none). Ray reads RAY_AUTH_MODE once, when it is imported: call this before the
    first `import ray`. Only the file's path goes into the environment."""
    os.environ.pop("RAY_AUTH_TOKEN", None)  # Ray would take it over the file
    if token_file is None:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    else:
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(token_file)


def _ask(address: str, token: str | None) -> grpc.StatusCode:
    """The status the head at `address` answers the probe with, sent with `token`."""
    # No proxy: the token goes to the head and nowhere else.
    with grpc.insecure_channel(address, options=(("grpc.enable_http_proxy", 0),)) as channel:
        probe = channel.unary_unary(_PROBE, request_serializer=bytes, response_deserializer=bytes)
        metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
        try:
            probe(b"", timeout=_PROBE_TIMEOUT_S, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def check_head(config: Config, token: str | None) -> None:
    """Return when the Ray head at `config.ray_address` (HOST:PORT) refuses a caller
    without a token and lets in one with `token`, or asks no token while the
    configuration allows that (then logged as a warning). Raises PermissionDeniedError
    when it asks no token and that is not allowed, asks one that `token` is not (or
    there is none), and DeviceError when it answers neither way. Blocks (a thread's
    work) for up to twice _PROBE_TIMEOUT_S."""
    where = f"[cluster] address {config.ray_address}"
    bare = _ask(config.ray_address, None)
    if bare == grpc.StatusCode.OK:
        if not config.ray_allow_unauthenticated:
            raise PermissionDeniedError(
                f"{where}: the Ray head there asks no token, so anyone who can reach the "
                "cluster runs code as the user its nodes run as: start every node with "
                "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (deploy/README.md), or set "
                "[cluster] allow_unauthenticated = true for a cluster nobody else can reach"
            )
        log.warning(
            "ray executor: the Ray head at %s asks no token ([cluster] allow_unauthenticated "
            "= true): anyone who can reach the cluster's ports runs code as its nodes' user, "
            "and in this process",
            config.ray_address,
        )
        return
    if bare != grpc.StatusCode.UNAUTHENTICATED:
        raise DeviceError(
            f"{where}: cannot tell whether the Ray head asks a token: it answered "
            f"{bare.name} (is it Ray 2.60 or later, and plain gRPC, not TLS?)"
        )
    if token is None:
        raise PermissionDeniedError(
            f"{where}: the Ray head asks a token: name the file that holds it in "
            "[cluster] token_file"
        )
    answer = _ask(config.ray_address, token)
    if answer == grpc.StatusCode.UNAUTHENTICATED:
        raise PermissionDeniedError(
            f"{where}: the Ray head refuses the token in [cluster] token_file "
            f"{config.ray_token_file}: it is not this cluster's"
        )
    if answer != grpc.StatusCode.OK:
        raise DeviceError(f"{where}: the Ray head answered {answer.name} to a call with the token")

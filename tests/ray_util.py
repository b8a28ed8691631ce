"""Ray clusters for the tests, started with deploy/README.md's own `ray start` commands:
the same environment (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH) and flags, with this
machine's paths, ports and sizes put in. Every node is a `ray start --block` process in
a session of its own, stopped by a signal to it; never `ray stop`, which stops every
Ray process on the machine, other tests' clusters included."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tests.helpers import wait_for

README = Path(__file__).resolve().parent.parent / "deploy" / "README.md"
#: Ray's floor for a node's object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES)
OBJECT_STORE_MIN = 75 * 1024 * 1024
#: The environment variables Ray's authentication reads
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@dataclass(frozen=True)
class RayCommand:
    """One `ray` command of the README, as written: who runs it (`sudo -u USER`), the
    environment it sets, the program, and its arguments (`--flag=value` or `--flag`)."""

    user: str
    env: dict[str, str]
    program: str
    args: tuple[str, ...]

    @property
    def verb(self) -> str:
        return self.args[0]

    @property
    def flags(self) -> dict[str, str | None]:
        """Each `--flag=value` of the command as flag -> value (None for a bare flag)."""
        out: dict[str, str | None] = {}
        for arg in self.args[1:]:
            name, eq, value = arg.partition("=")
            out[name] = value if eq else None
        return out


def readme_section() -> str:
    """deploy/README.md's "Measuring on a Ray cluster" section."""
    text = README.read_text(encoding="utf-8")
    start = text.index("## Measuring on a Ray cluster\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def readme_commands() -> list[RayCommand]:
    """Every command of the section's code blocks that runs `ray`, parsed as a shell
    would (comments dropped, continued lines joined)."""
    code = [line for line in readme_section().splitlines() if line.startswith("       ")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(code))
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        user = ""
        if words[:2] == ["sudo", "-u"]:
            user, words = words[2], words[3:]
        if words[:1] == ["env"]:
            words = words[1:]
        env = {}
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words and Path(words[0]).name == "ray":
            commands.append(RayCommand(user, env, words[0], tuple(words[1:])))
    return commands


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayNode:
    proc: subprocess.Popen
    log: Path

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to `ray start --block` (it drains the node and ends its processes),
        then SIGKILL to whatever of its session is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def leave(self, timeout: float = 30) -> None:
        """Take the node out as `ray.cluster_utils.Cluster.remove_node` does: SIGTERM to
        its raylet alone (which tells the GCS it is gone), then SIGKILL to the rest.
        (SIGTERM to `ray start` drains the node instead, serving its actors meanwhile.)"""
        raylets = [pid for pid, argv in self._processes() if argv.endswith(b"/raylet/raylet")]
        for pid in raylets:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(pid in dict(self._processes()) for pid in raylets):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.kill()

    def _processes(self) -> list[tuple[int, bytes]]:
        """(pid, program) of each live process of the node's session."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if os.getsid(int(proc.name)) == self.proc.pid:
                    argv = (proc / "cmdline").read_bytes().split(b"\0")[0]
                    state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append((int(proc.name), argv))
            except (OSError, IndexError):
                pass
        return found

    def kill(self) -> None:
        """SIGKILL to every process of the node's session: the node is lost, not stopped."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@dataclass
class RayCluster:
    """A head and nodes on this machine, started as the README starts them, with the
    token in `token_file` (None: a cluster that asks no token, RAY_AUTH_MODE=disabled).
    `root` holds the sessions, in a folder only this user may enter (as the README's
    /var/lib/aoed-ray)."""

    root: Path
    token_file: Path | None
    port: int = field(default_factory=free_port)
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _command(self, head: bool) -> RayCommand:
        (cmd,) = [
            c for c in readme_commands() if c.verb == "start" and ("--head" in c.args) == head
        ]
        return cmd

    def _start(self, cmd: RayCommand, changes: dict[str, str | None]) -> RayNode:
        """Run the README's `cmd` with the flags in `changes` put in (None: dropped),
        as this user, with the README's environment but this cluster's token file."""
        flags = {**cmd.flags, **changes}
        args = [cmd.verb]
        for name, value in flags.items():
            if name in changes and changes[name] is None:
                continue
            args.append(name if value is None else f"{name}={value}")
        env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
        if self.token_file is not None:
            env.update(cmd.env)
            if "RAY_AUTH_TOKEN_PATH" in env:  # only where the README names it: given a
                env["RAY_AUTH_TOKEN_PATH"] = str(self.token_file)  # token, ray start
                # --head turns token mode on by itself, and would hide a README without it
        else:
            env["RAY_AUTH_MODE"] = "disabled"
        sessions = self.root / "ray"
        sessions.mkdir(mode=0o700, parents=True, exist_ok=True)
        log = self.root / f"node-{len(self.nodes)}.log"
        program = str(Path(sys.executable).parent / "ray")
        with log.open("ab") as out:  # the child keeps its own copy
            proc = subprocess.Popen(
                [program, *args, "--block"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        node = RayNode(proc, log)
        self.nodes.append(node)
        return node

    def start_head(self, *, num_cpus: int = 1, resources: str | None = None) -> RayNode:
        changes: dict[str, str | None] = {
            "--node-ip-address": "127.0.0.1",
            "--port": str(self.port),
            "--num-cpus": str(num_cpus),
            "--temp-dir": str(self.root / "ray" / "tmp"),
            # Not the default 10001, which another cluster on this machine may hold.
            "--ray-client-server-port": str(free_port()),
            "--object-store-memory": str(OBJECT_STORE_MIN),
        }
        if resources is not None:
            changes["--resources"] = resources
        node = self._start(self._command(head=True), changes)
        self.wait_for_nodes(1)
        return node

    def add_node(self, *, num_cpus: int = 1, resources: str = "{}") -> RayNode:
        changes: dict[str, str | None] = {
            "--address": self.address,
            "--node-ip-address": "127.0.0.1",
            "--num-cpus": str(num_cpus),
            "--resources": resources,
            "--temp-dir": str(self.root / "ray" / "tmp"),
            "--object-store-memory": str(OBJECT_STORE_MIN),
        }
        node = self._start(self._command(head=False), changes)
        # One at a time: three started at once on two busy cores overran Ray's own 30 s
        # start-up wait.
        self.wait_for_nodes(len(self.nodes))
        return node

    def alive(self) -> list[dict[str, float]]:
        """The resources of each live node, asked of the head's GCS with the token."""
        from ray.core.generated import gcs_pb2, gcs_service_pb2

        metadata = None
        if self.token_file is not None:
            metadata = (("authorization", f"Bearer {self.token_file.read_text().strip()}"),)
        with grpc.insecure_channel(self.address) as channel:
            call = channel.unary_unary(
                "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
                request_serializer=gcs_service_pb2.GetAllNodeInfoRequest.SerializeToString,
                response_deserializer=gcs_service_pb2.GetAllNodeInfoReply.FromString,
            )
            reply = call(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=10, metadata=metadata)
        return [
            dict(n.resources_total)
            for n in reply.node_info_list
            if n.state == gcs_pb2.GcsNodeInfo.ALIVE
        ]

    def wait_for_nodes(self, count: int, timeout: float = 120) -> None:
        """Wait until `count` nodes are alive; fail with the nodes' logs after `timeout`."""

        def logs() -> str:
            return "\n".join(n.log.read_text(errors="replace")[-2000:] for n in self.nodes)

        def alive() -> bool:
            assert all(n.proc.poll() is None for n in self.nodes), f"a Ray node exited:\n{logs()}"
            try:
                return len(self.alive()) >= count
            except grpc.RpcError:
                return False  # the head's GCS is not listening yet

        wait_for(alive, timeout, f"{count} Ray nodes alive", poll=0.5, detail=logs)

    def remove_node(self, node: RayNode) -> None:
        node.leave()
        self.nodes.remove(node)

    def shutdown(self) -> None:
        """Stop every node, the head last."""
        for node in reversed(self.nodes):
            node.stop()
        self.nodes.clear()

    def kill(self) -> None:
        """Lose every node at once, the head with them (as a machine that went away)."""
        for node in self.nodes:
            node.kill()
        self.nodes.clear()

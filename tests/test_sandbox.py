"""The processes that load user programs are confined by the kernel (aoed.sandbox).

Each confinement test runs a real child process that confines itself and then tries
what it may not do; what the kernel answered comes back on its stdout, and the test
checks the world outside too (no file appeared, the listening socket the test opened on
loopback received no connection). Then a loader bug itself: a hostile archive, handed
straight to torch.export.load in a confined process (the archive check bypassed), runs
its payload, and the payload can neither write outside the workspace nor connect. Then
real rank processes (a world of 2 on gloo), confined and measuring; a kernel (here: a
seccomp filter around the process, as systemd's SystemCallFilter would be) that refuses
Landlock, which fails a GDAT job unless running unconfined is allowed; and the setting.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aoe.errors import OptionError
from aoed import sandbox
from aoed.config import load_daemon_config

ABI, WHY = sandbox.landlock_abi()
needs_landlock = pytest.mark.skipif(not ABI, reason=f"no Landlock here: {WHY}")


def _child(code: str, *args: str, timeout: float = 120) -> dict:
    """Run `code` (python -c) with `args`; the JSON it prints last."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _listener() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.setblocking(False)
    return s


def _no_connection(listener: socket.socket) -> bool:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


_CONFINED = """
    import errno, json, os, socket, sys
    from aoed import sandbox

    ws, outside, secret, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    # A connection made before the network closes, as a rank's gloo mesh is.
    early = socket.create_connection(("127.0.0.1", port))
    early.sendall(b"before|")
    made = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # made, not yet connected
    said = sandbox.confine(sandbox.Policy(write=(ws,), keep_network=True))
    out = {"said": said.describe()}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except OSError as e:
            out[name] = e.errno

    attempt("write_inside", lambda: open(os.path.join(ws, "f"), "w").write("x"))
    attempt("write_outside", lambda: open(outside, "w").write("x"))
    attempt("read_outside", lambda: open(secret).read())
    attempt("exec", lambda: os.execv("/bin/true", ["true"]))
    attempt("signal_parent", lambda: os.kill(os.getppid(), 0))
    sandbox.close_network()
    attempt("new_socket", lambda: socket.create_connection(("127.0.0.1", port), 5))
    attempt("made_socket", lambda: made.connect(("127.0.0.1", port)))
    attempt("unix_socket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    attempt("old_connection", lambda: early.sendall(b"after"))
    early.close()
    print(json.dumps(out))
"""


@needs_landlock
def test_a_confined_process_writes_only_its_workspace_and_makes_no_connection(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    outside, secret = tmp_path / "outside.txt", tmp_path / "secret.txt"
    secret.write_text("not yours")
    listener = _listener()
    with listener:
        out = _child(_CONFINED, str(ws), str(outside), str(secret), str(listener.getsockname()[1]))
        assert out["said"].startswith(f"confined (Landlock ABI {ABI}: files"), out
        assert out["write_inside"] == "ok" and (ws / "f").read_text() == "x"
        assert out["write_outside"] == errno.EACCES and not outside.exists()
        assert out["read_outside"] == errno.EACCES
        assert out["exec"] == errno.EACCES
        if ABI >= 6:  # Landlock's signal scope: not even to the parent
            assert out["signal_parent"] == errno.EPERM
        # No new connection, TCP or unix; the one made before keeps working.
        assert out["new_socket"] == errno.EPERM and out["unix_socket"] == errno.EPERM
        assert out["made_socket"] in (errno.EPERM, errno.EACCES)
        assert out["old_connection"] == "ok"
        listener.setblocking(True)
        early, _ = listener.accept()
        with early:
            assert early.makefile("rb").read() == b"before|after"
        listener.setblocking(False)
        assert _no_connection(listener)


@needs_landlock
def test_confining_a_process_that_already_has_threads_is_refused(tmp_path: Path) -> None:
    out = _child(
        """
        import json, threading
        from aoed import sandbox

        stop = threading.Event()
        threading.Thread(target=stop.wait).start()
        try:
            sandbox.confine(sandbox.Policy())
            said = "confined"
        except RuntimeError as exc:
            said = str(exc)
        stop.set()
        print(json.dumps({"said": said}))
        """
    )
    assert "2 threads" in out["said"], out


_LOADER_BUG = """
    import json, os, sys
    from aoed import sandbox

    archive, ws = sys.argv[1], sys.argv[2]
    said = sandbox.confine(sandbox.Policy(read=(archive,), write=(ws,)))
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    import torch

    try:  # straight to torch's loader: no archive check
        torch.export.load(archive)
        loaded = "loaded"
    except Exception as exc:
        loaded = type(exc).__name__
    print(json.dumps({"said": said.describe(), "loaded": loaded}))
"""


@needs_landlock
def test_a_loader_bug_runs_but_can_neither_write_outside_nor_connect(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="GDAT needs torch: pip install '.[gdat]'")
    from .hostile_pt2 import KINDS, tiny_program

    ws = tmp_path / "ws"
    ws.mkdir()
    marker = ws / "probe.json"  # the payload reports here, inside the workspace
    evil = KINDS["opaque_object_probe"].build(
        tiny_program(tmp_path / "tiny.pt2"), tmp_path / "evil.pt2", marker
    )
    listener = _listener()
    with listener:
        (ws / "probe.json.port").write_text(str(listener.getsockname()[1]))
        out = _child(_LOADER_BUG, str(evil), str(ws))
        assert out["said"].startswith("confined"), out
        probe = json.loads(marker.read_text())  # the payload ran, in torch's loader
        assert probe == {"outside": errno.EACCES, "connect": errno.EPERM}, probe
        assert not (tmp_path / "outside.txt").exists()
        assert _no_connection(listener)


def _status(pid: str) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


@needs_landlock
async def test_the_ranks_of_a_world_are_confined_and_still_measure(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="GDAT needs torch: pip install '.[gdat]'")
    from aoe.gdat import DDPConfig
    from aoed.engine.rankmessages import RankMeasureRequest
    from aoed.engine.world import World, WorldSpec

    from .hostile_pt2 import tiny_program

    model = tiny_program(tmp_path / "tiny.pt2")
    world = World(
        WorldSpec({"kind": "pt2", "path": str(model)}, 2, "gloo"), tmp_path / "w", tmp_path / "rt"
    )
    try:
        layout = await world.start()
        assert layout["sandbox"].startswith(f"confined (Landlock ABI {ABI}"), layout
        ours = int(_status("self")["Seccomp_filters"])  # a container may add its own
        for pid in world.pids:
            status = _status(str(pid))
            # No new privileges; two seccomp filters more than ours: io_uring from the
            # start, the network once the world formed (synchronized to every thread).
            assert status["NoNewPrivs"] == "1", status
            assert status["Seccomp"] == "2" and int(status["Seccomp_filters"]) == ours + 2
        replies = await world.call(
            RankMeasureRequest(
                configs={"defaults": DDPConfig().to_params()}, order=["defaults"], steps=2
            ),
            120,
        )
        for reply in replies:
            turn = reply["results"]["defaults"]
            assert not turn.get("error") and len(turn["step_us"]) == 2, turn
    finally:
        await world.aclose()
        world.close_locks()


#: `aoe tune` in a process whose seccomp filter refuses Landlock's system calls (as
#: systemd's SystemCallFilter=@system-service does, systemd 252): every rank it starts
#: inherits the filter.
_NO_LANDLOCK = """
    import runpy, sys
    from aoed import sandbox

    sandbox._no_new_privs()
    sandbox._seccomp([444, 445, 446], all_threads=False)  # landlock_*: EPERM
    sys.argv = ["aoe", *sys.argv[1:]]
    runpy.run_module("aoe.cli", run_name="__main__")
"""


@pytest.mark.slow
def test_without_landlock_a_gdat_job_fails_unless_running_unconfined_is_allowed(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch", reason="GDAT needs torch: pip install '.[gdat]'")
    if not ABI:
        pytest.skip(f"no Landlock here: {WHY}")
    from .hostile_pt2 import tiny_program

    model = tiny_program(tmp_path / "tiny.pt2")
    argv = [sys.executable, "-c", textwrap.dedent(_NO_LANDLOCK), "tune", str(model)]
    argv += ["--job-type", "gdat", "--world-size", "2", "--budget", "2", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != sandbox.UNCONFINED_ENV}
    env["TUNE_BANK_PATH"] = str(tmp_path / "bank")
    r = subprocess.run(
        [*argv, "--output", str(tmp_path / "refused")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == OptionError.exit_code, r.stderr
    assert "refuses Landlock's system calls" in r.stderr and sandbox.UNCONFINED_ENV in r.stderr

    r = subprocess.run(
        [*argv, "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**env, sandbox.UNCONFINED_ENV: "1"},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (report,) = (tmp_path / "out").glob("aoe_result_gdat_*.json")
    notes = json.loads(report.read_text())["notes"]
    assert any("loaded unconfined: a seccomp filter" in n for n in notes), notes


def test_allow_unconfined_gdat_is_a_daemon_setting_read_strictly(tmp_path: Path) -> None:
    config = tmp_path / "aoed.toml"
    assert not load_daemon_config(None, env={}).allow_unconfined_gdat
    config.write_text("[daemon]\nallow_unconfined_gdat = true\n")
    assert load_daemon_config(config, env={}).allow_unconfined_gdat
    config.write_text('[daemon]\nallow_unconfined_gdat = "yes"\n')
    with pytest.raises(OptionError, match=r"\[daemon\] allow_unconfined_gdat = 'yes': expected"):
        load_daemon_config(config, env={})


def test_a_rank_started_without_a_policy_loads_no_program(tmp_path: Path) -> None:
    """A rank that was not given a policy (a mistake in who starts it) refuses a .pt2."""
    pytest.importorskip("torch", reason="GDAT needs torch: pip install '.[gdat]'")
    from .hostile_pt2 import tiny_program

    model = tiny_program(tmp_path / "tiny.pt2")
    request = {
        "id": 1,
        "request": {
            "op": "rank-inspect",
            "source": {"kind": "pt2", "path": str(model)},
            "backend": "gloo",
            "world_size": 2,
        },
    }
    r = subprocess.run(
        [sys.executable, "-m", "aoed.backends.torch.rank"],
        input=json.dumps(request) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    answer = json.loads(r.stdout)
    assert not answer["ok"] and "without a sandbox policy" in answer["error"], answer
    assert answer["error_class"] == "OptionError"

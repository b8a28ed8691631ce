"""The systemd deployment in deploy/: the unit verifies and keeps its exposure score, the
scores the docs state are the ones systemd computes, the unit, the default config, the
sysusers and tmpfiles entries agree on every path, and install.sh lays the files out
idempotently and removes them again.

The unit checks need systemd-analyze (systemd 252 here) and skip without it: install the
distribution's `systemd` package to run them. The scores are systemd's offline
assessment (`systemd-analyze security --offline=true`), which reads unit files only.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from aoed.config import DaemonConfig, load_daemon_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "aoed.service"
DROPINS = DEPLOY / "systemd" / "aoed.service.d"
INSTALL = DEPLOY / "install.sh"
EXEC_START = "/opt/aoed/venv/bin/aoed --config /etc/aoed/aoed.toml"
#: The most `systemd-analyze security` may rate the default unit.
MAX_EXPOSURE = 1.5

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze not found: install the distribution's systemd package"
)


def _directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for each assignment in a unit file, in order (keys repeat)."""
    out, section = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def _values(text: str, key: str) -> list[str]:
    return [v for _, k, v in _directives(text) if k == key]


def _runnable_unit(tmp_path: Path, dropins: tuple[str, ...] = ()) -> Path:
    """A copy of the unit whose ExecStart names a binary that exists here (verify insists
    on it; install.sh puts the real one in /opt/aoed), with `dropins` installed beside it
    as aoed.service.d/NAME.conf, where systemd-analyze looks for drop-ins."""
    aoed = Path(sys.executable).with_name("aoed")
    assert aoed.is_file(), (
        f"{aoed}: the project is not installed into this interpreter's environment"
    )
    text = UNIT.read_text()
    assert f"ExecStart={EXEC_START}\n" in text
    unit = tmp_path / "aoed.service"
    unit.write_text(
        text.replace(f"ExecStart={EXEC_START}", f"ExecStart={aoed} --config /etc/aoed/aoed.toml")
    )
    if dropins:
        d = tmp_path / "aoed.service.d"
        d.mkdir()
        for name in dropins:
            shutil.copy(DROPINS / f"{name}.conf.example", d / f"{name}.conf")
    return unit


def _analyze(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    env = {**os.environ, "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": ""}
    return subprocess.run(
        [ANALYZE, *args], check=False, capture_output=True, text=True, env=env, cwd=cwd, timeout=60
    )


def _exposure(unit: Path) -> float:
    done = _analyze("security", "--offline=true", "--no-pager", str(unit))
    assert done.returncode == 0, done.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert m, f"no overall exposure level in:\n{done.stdout}"
    return float(m.group(1))


def _documented(path: Path) -> float:
    """The score a unit or drop-in states in its header ("rates the unit 1.0")."""
    m = re.search(r"rates (?:the|this) unit (\d+\.\d)", re.sub(r"\n#\s*", " ", path.read_text()))
    assert m, f"{path.name} does not state its exposure score"
    return float(m.group(1))


def _readme_scores() -> dict[str, float]:
    text = (DEPLOY / "README.md").read_text()
    scores = {
        name: float(v)
        for name, v in re.findall(r"^\| with `(\w+)\.conf` \| (\d+\.\d+) \|$", text, re.MULTILINE)
    }
    m = re.search(r"^\| default \(CPU\) \| (\d+\.\d+) \|$", text, re.MULTILINE)
    assert m, "README.md: no score for the default unit"
    scores["default"] = float(m.group(1))
    return scores


# --------------------------------------------------------------------------- the unit


@needs_analyze
def test_shipped_unit_fails_verify_only_for_its_missing_binary(tmp_path: Path):
    # Why the other checks verify a copy: the shipped unit names /opt/aoed/venv/bin/aoed,
    # which only install.sh creates. That must be all verify has against it.
    shutil.copy(UNIT, tmp_path / "aoed.service")
    done = _analyze("verify", "--man=no", str(tmp_path / "aoed.service"), cwd=tmp_path)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode != 0
    assert complaints and all("/opt/aoed/venv/bin/aoed" in line for line in complaints), complaints


@needs_analyze
@pytest.mark.parametrize(
    "dropins", [(), ("nvidia",), ("ascend",), ("tcp",)], ids=lambda d: "+".join(d) or "default"
)
def test_unit_verifies_cleanly(tmp_path: Path, dropins: tuple[str, ...]):
    # verify exits 0 even for unknown keys and unparsable values (it warns and ignores
    # them), so a clean result is no output at all. User=aoed need not exist here:
    # systemd resolves the user when it starts the service, and verify does not try
    # (test_sysusers_and_tmpfiles_make_what_the_unit_expects creates it).
    unit = _runnable_unit(tmp_path, dropins)
    done = _analyze("verify", "--man=no", str(unit), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (done.stdout + done.stderr).strip() == ""


@needs_analyze
def test_default_unit_exposure_is_low_and_documented(tmp_path: Path):
    score = _exposure(_runnable_unit(tmp_path))
    assert score <= MAX_EXPOSURE
    assert score == pytest.approx(_documented(UNIT), abs=0.1)
    assert score == pytest.approx(_readme_scores()["default"], abs=0.1)


@needs_analyze
@pytest.mark.parametrize("name", ["nvidia", "ascend", "tcp"])
def test_dropin_exposure_is_documented(tmp_path: Path, name: str):
    (tmp_path / "dropin").mkdir()
    (tmp_path / "merged").mkdir()
    score = _exposure(_runnable_unit(tmp_path / "dropin", (name,)))
    # The unit and the drop-in as one file (the same assignments in the same order) rate
    # the same: the drop-in is really read.
    merged = _runnable_unit(tmp_path / "merged")
    merged.write_text(merged.read_text() + "\n" + (DROPINS / f"{name}.conf.example").read_text())
    assert _exposure(merged) == score
    assert score == pytest.approx(_documented(DROPINS / f"{name}.conf.example"), abs=0.1)
    assert score == pytest.approx(_readme_scores()[name], abs=0.1)


def test_unit_config_and_folders_agree():
    unit = UNIT.read_text()

    def one(key: str) -> str:
        values = _values(unit, key)
        assert len(values) == 1, f"aoed.service sets {key}= {len(values)} times"
        return values[0]

    assert (one("Type"), one("NotifyAccess"), one("KillMode")) == ("notify", "main", "mixed")
    assert one("ExecStart") == EXEC_START
    # ProcSubset=pid would hide /proc/cpuinfo, which the device fingerprint reads.
    assert not _values(unit, "ProcSubset") and not _values(unit, "DynamicUser")
    user, group = one("User"), one("Group")

    cfg = load_daemon_config(DEPLOY / "aoed.toml", env={})
    state = Path("/var/lib") / one("StateDirectory")
    runtime = Path("/run") / one("RuntimeDirectory")
    assert EXEC_START.endswith(f"--config /etc/{one('ConfigurationDirectory')}/aoed.toml")
    assert cfg.state_dir == state and cfg.engine.bank.parent == state
    assert (
        cfg.socket is not None
        and cfg.socket.parent == runtime
        and cfg.engine.runtime_dir == runtime
    )
    assert cfg.socket_group == group
    # The unit must outwait the daemon's own grace, as configured and by default.
    stop_s = int(one("TimeoutStopSec").removesuffix("s"))
    assert stop_s > cfg.shutdown_grace_s and stop_s > DaemonConfig.shutdown_grace_s

    # tmpfiles makes the state dir as the unit declares it and the drop folders the
    # config names, group-writable and setgid; sysusers makes the unit's user and group.
    lines = [
        ln.split()
        for ln in (DEPLOY / "tmpfiles.d" / "aoed.conf").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    made = {Path(path): (mode, user, group) for _, path, mode, user, group, *_ in lines}
    assert made[state] == (one("StateDirectoryMode"), user, group)
    drop_folders = {p for i in cfg.inboxes for p in (i.path, i.outbox, i.failed)}
    assert drop_folders == set(made) - {state}
    assert all(made[p] == ("2770", user, group) for p in drop_folders)
    # ... and the daemon makes one that is missing again the same way (`group = ""` is
    # the daemon's own group, the unit's Group=).
    assert all((f"{i.mode:o}", i.group or group) == made[i.path][::2] for i in cfg.inboxes)
    users = (DEPLOY / "sysusers.d" / "aoed.conf").read_text()
    assert re.search(rf'^u {user} - "[^"]+" {state} -$', users, re.MULTILINE)


def test_default_config_passes_check_config():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AOED_", "TUNE_", "ASCEND_"))}
    done = subprocess.run(
        [sys.executable, "-m", "aoed", "--check-config", "--config", str(DEPLOY / "aoed.toml")],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "is valid" in done.stdout and "unix:///run/aoed/aoed.sock" in done.stdout


# --------------------------------------------------------------------------- install.sh


def _install(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["sh", str(INSTALL), *args], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done


def _manifest(root: Path) -> dict[str, tuple[str, str]]:
    """Every path under `root`: its mode (setgid and sticky bits included) and, for a
    file, the sha256 of its content."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
        out[str(p.relative_to(root))] = (
            stat.filemode(st.st_mode) + oct(stat.S_IMODE(st.st_mode)),
            digest,
        )
    return out


def test_install_lays_out_files_idempotently(tmp_path: Path):
    dest = tmp_path / "root"
    _install("--destdir", str(dest), "--no-venv")
    first = _manifest(dest)
    _install("--destdir", str(dest), "--no-venv")
    assert _manifest(dest) == first

    unit = dest / "usr/lib/systemd/system/aoed.service"
    assert _values(unit.read_text(), "ExecStart") == [EXEC_START]
    assert (dest / "usr/lib/sysusers.d/aoed.conf").read_bytes() == (
        DEPLOY / "sysusers.d/aoed.conf"
    ).read_bytes()
    assert (dest / "usr/lib/tmpfiles.d/aoed.conf").read_bytes() == (
        DEPLOY / "tmpfiles.d/aoed.conf"
    ).read_bytes()
    assert (dest / "etc/aoed/aoed.toml").read_bytes() == (DEPLOY / "aoed.toml").read_bytes()
    for name in ("aoed.toml", "nvidia.conf.example", "ascend.conf.example", "tcp.conf.example"):
        assert (dest / "opt/aoed/share/aoed" / name).is_file()
    assert (dest / "opt/aoed/share/doc/aoed/README.md").is_file()
    assert (dest / "opt/aoed/share/doc/aoed/grafana-dashboard.json").is_file()
    assert first["var/lib/aoed"][0] == "drwxr-x---0o750"
    for d in ("inbox", "outbox", "failed"):
        assert first[f"var/lib/aoed/{d}"][0] == "drwxrws---0o2770"
    assert not (dest / "opt/aoed/venv").exists()  # --no-venv skips that and only that

    # An operator's configuration survives a reinstall.
    (dest / "etc/aoed/aoed.toml").write_text("# mine\n")
    _install("--destdir", str(dest), "--no-venv")
    assert (dest / "etc/aoed/aoed.toml").read_text() == "# mine\n"


def test_install_prefix_rewrites_the_unit(tmp_path: Path):
    _install("--destdir", str(tmp_path), "--no-venv", "--prefix", "/srv/tools/aoed")
    text = (tmp_path / "usr/lib/systemd/system/aoed.service").read_text()
    assert _values(text, "ExecStart") == [
        "/srv/tools/aoed/venv/bin/aoed --config /etc/aoed/aoed.toml"
    ]
    assert "/opt/aoed" not in text
    assert (tmp_path / "srv/tools/aoed/share/aoed/aoed.toml").is_file()


def test_uninstall_keeps_state_and_purge_removes_it(tmp_path: Path):
    _install("--destdir", str(tmp_path), "--no-venv")
    (tmp_path / "var/lib/aoed/bank").mkdir()
    (tmp_path / "var/lib/aoed/bank/data.mdb").write_bytes(b"bank")

    _install("--destdir", str(tmp_path), "--uninstall")
    for gone in (
        "usr/lib/systemd/system/aoed.service",
        "usr/lib/sysusers.d/aoed.conf",
        "usr/lib/tmpfiles.d/aoed.conf",
        "opt/aoed",
    ):
        assert not (tmp_path / gone).exists(), gone
    assert (tmp_path / "var/lib/aoed/bank/data.mdb").read_bytes() == b"bank"
    assert (tmp_path / "var/lib/aoed/inbox").is_dir()
    assert (tmp_path / "etc/aoed/aoed.toml").is_file()

    _install("--destdir", str(tmp_path), "--uninstall", "--purge")
    assert not (tmp_path / "var/lib/aoed").exists()
    assert not (tmp_path / "etc/aoed").exists()


@pytest.mark.skipif(
    os.geteuid() != 0, reason="systemd-tmpfiles gives the folders to aoed: needs root"
)
@pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
    reason="systemd-sysusers/systemd-tmpfiles not found: install the systemd package",
)
def test_sysusers_and_tmpfiles_make_what_the_unit_expects(tmp_path: Path):
    # What install.sh runs on a live system, here against the staged tree (--root): the
    # user and group aoed, and /var/lib/aoed with its drop folders owned by them.
    _install("--destdir", str(tmp_path), "--no-venv")
    for tool, conf in (
        ("systemd-sysusers", "usr/lib/sysusers.d/aoed.conf"),
        ("systemd-tmpfiles", "usr/lib/tmpfiles.d/aoed.conf"),
    ):
        args = [tool, f"--root={tmp_path}"] + (["--create"] if tool == "systemd-tmpfiles" else [])
        done = subprocess.run(
            [*args, str(tmp_path / conf)], check=False, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
    passwd = {
        ln.split(":")[0]: ln.split(":") for ln in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    group = {
        ln.split(":")[0]: ln.split(":") for ln in (tmp_path / "etc/group").read_text().splitlines()
    }
    uid, gid, home = int(passwd["aoed"][2]), int(passwd["aoed"][3]), passwd["aoed"][5]
    assert int(group["aoed"][2]) == gid and home == "/var/lib/aoed"
    for d, mode in (("", 0o750), ("inbox", 0o2770), ("outbox", 0o2770), ("failed", 0o2770)):
        st = (tmp_path / "var/lib/aoed" / d).stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, mode), d


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/run/systemd/system").is_dir() or os.geteuid() != 0,
    reason="systemd is not PID 1 here (or not root): the unit is not started for real",
)
def test_the_installed_unit_starts_and_tunes_a_job(
    tmp_path: Path,
):  # pragma: no cover - needs systemd as PID 1
    from aoed import samples

    subprocess.run(["sh", str(INSTALL)], check=True, timeout=900)
    try:
        subprocess.run(["systemctl", "restart", "aoed"], check=True, timeout=120)
        active = subprocess.run(
            ["systemctl", "is-active", "aoed"], capture_output=True, text=True
        ).stdout.strip()
        assert active == "active"
        samples.save(samples.build("mlp"), tmp_path / "m.onnx")
        r = subprocess.run(
            [
                "/opt/aoed/venv/bin/aoe",
                "submit",
                str(tmp_path / "m.onnx"),
                "--budget",
                "2",
                "--watch",
                "--socket",
                "/run/aoed/aoed.sock",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert "state verifying -> succeeded" in r.stdout
    finally:
        subprocess.run(["systemctl", "stop", "aoed"], timeout=120)

"""safefs on real folders: links planted where the daemon writes are never followed,
names fit NAME_MAX in bytes, and a read lease tells an open writer without ever letting
its break signal end the process."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aoed import safefs
from tests.helpers import wait_for


def _target(tmp_path: Path) -> Path:
    t = tmp_path / "target"
    t.write_bytes(b"precious\n")
    return t


def test_write_file_replaces_a_link_at_its_name_and_never_writes_through_it(tmp_path: Path) -> None:
    target = _target(tmp_path)
    d = tmp_path / "shared"
    d.mkdir()
    (d / "out.txt").symlink_to(target)
    with safefs.opened_dir(d) as fd:
        safefs.write_file("out.txt", lambda f: f.write(b"mine\n"), dir_fd=fd)
    assert target.read_bytes() == b"precious\n"
    assert not (d / "out.txt").is_symlink() and (d / "out.txt").read_bytes() == b"mine\n"
    assert sorted(p.name for p in d.iterdir()) == ["out.txt"], "no temporary is left"


def test_a_failed_write_leaves_the_name_as_it_was_and_no_temporary(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    (d / "out.txt").write_bytes(b"old\n")

    def fill(f) -> None:
        f.write(b"half")
        raise RuntimeError("the sender went away")

    with safefs.opened_dir(d) as fd, pytest.raises(RuntimeError):
        safefs.write_file("out.txt", fill, dir_fd=fd)
    assert (d / "out.txt").read_bytes() == b"old\n" and sorted(p.name for p in d.iterdir()) == [
        "out.txt"
    ]


def test_folders_and_reserved_names_refuse_links(tmp_path: Path) -> None:
    target = _target(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    d = tmp_path / "shared"
    d.mkdir()
    (d / "ws").symlink_to(elsewhere, target_is_directory=True)
    (d / "r.json").symlink_to(target)
    (d / "dangling.json").symlink_to(tmp_path / "would-be-created")
    with safefs.opened_dir(d) as fd:
        with pytest.raises(safefs.LinkRefusedError, match="symbolic link"):
            safefs.make_dir("ws", dir_fd=fd)
        assert not safefs.reserve("r.json", dir_fd=fd) and not safefs.reserve(
            "dangling.json", dir_fd=fd
        )
        assert safefs.taken("dangling.json", dir_fd=fd) and not safefs.taken("free.json", dir_fd=fd)
        assert safefs.reserve("free.json", dir_fd=fd)
        with pytest.raises(safefs.LinkRefusedError):
            safefs.open_file("r.json", dir_fd=fd)
    with pytest.raises(safefs.LinkRefusedError):
        safefs.open_dir(d / "ws")
    assert list(elsewhere.iterdir()) == [] and target.read_bytes() == b"precious\n"
    assert not (tmp_path / "would-be-created").exists() and (d / "free.json").read_bytes() == b""


def test_move_takes_the_entry_itself_and_replaces_a_link_at_the_destination(tmp_path: Path) -> None:
    target = _target(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "m.onnx").write_bytes(b"model")
    (b / "m.onnx").symlink_to(target)
    safefs.move_path(a / "m.onnx", b / "m.onnx")
    assert (b / "m.onnx").read_bytes() == b"model" and not (b / "m.onnx").is_symlink()
    assert target.read_bytes() == b"precious\n" and not (a / "m.onnx").exists()


def test_copy_fd_copies_from_each_offset_on_one_file_system_and_across_two(
    tmp_path: Path,
) -> None:
    data = os.urandom(3 << 20) + b"tail"
    src = tmp_path / "src"
    src.write_bytes(data)
    # /dev/shm, where there is one, is another file system (tmpfs): between two kinds of
    # file system copy_file_range says EXDEV, and sendfile copies instead.
    folders = [tmp_path] + [Path(p) for p in ("/dev/shm",) if os.access(p, os.W_OK)]
    for folder in folders:
        dst = folder / f"aoed-copy-{os.getpid()}"
        dst.write_bytes(b"head:")
        s, d = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY)
        try:
            os.lseek(s, 5, os.SEEK_SET)
            os.lseek(d, 0, os.SEEK_END)
            assert safefs.copy_fd(s, d) == len(data) - 5
        finally:
            os.close(s)
            os.close(d)
        try:
            assert dst.read_bytes() == b"head:" + data[5:], folder
        finally:
            dst.unlink()


@pytest.mark.parametrize("stem", ["m" * 250, "模型" * 60, "a" * 100])
def test_fit_keeps_names_within_name_max_in_bytes(stem: str) -> None:
    fitted = safefs.fit(stem, len("_99999.onnx.error.txt"))
    assert len((fitted + "_99999.onnx.error.txt").encode()) <= safefs.NAME_MAX
    if len(stem.encode()) + len("_99999.onnx.error.txt") <= safefs.NAME_MAX:
        assert fitted == stem
    else:
        assert fitted.startswith(stem[:20]) and "~" in fitted
        assert safefs.fit(stem + "x", len("_99999.onnx.error.txt")) != fitted, (
            "different names stay different"
        )
    fitted.encode("utf-8")  # cut at a character boundary: still valid UTF-8


# A writer that opens the file for writing, says so, and writes once more when told.
_WRITER = """
import sys
with open(sys.argv[1], "ab") as f:
    print("open", flush=True)
    sys.stdin.readline()
    f.write(b"more")
"""


def test_has_writers_sees_a_writer_that_holds_the_file_open(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"half")
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "open\n"
        fd = safefs.open_file(path)
        try:
            assert safefs.has_writers(fd) is True
            writer.communicate("go\n", timeout=30)
            assert safefs.has_writers(fd) is False
        finally:
            os.close(fd)
    finally:
        writer.kill()
        writer.wait()
    assert path.read_bytes() == b"halfmore"


def test_a_lease_broken_by_a_writer_does_not_end_the_process(tmp_path: Path) -> None:
    """The kernel signals a lease holder when someone opens the file for writing (SIGIO
    by default, which ends a process). Held here while a writer opens the file: this
    process lives on, and the writer gets in once the lease is released."""
    path = tmp_path / "m.onnx"
    path.write_bytes(b"whole")
    fd = safefs.open_file(path)
    try:
        with safefs.read_lease(fd) as held:
            assert held is True
            opener = subprocess.Popen(
                [sys.executable, "-c", f"open({str(path)!r}, 'ab').write(b'!')"]
            )

            def breaking() -> bool:  # once the lease reads as being given up
                assert opener.poll() is None, "the writer got in while the lease was held"
                return fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_UNLCK

            wait_for(breaking, 30, "the writer's open breaking the lease", poll=0.01)
        assert opener.wait(timeout=30) == 0
    finally:
        os.close(fd)
    assert path.read_bytes() == b"whole!"

"""Taking an exclusive flock(2), the one way both of the daemon's file locks do it: the
bank's writer lock (aoed.bank.lock) and the device locks (aoed.engine.devlock).

`try_lock(fd)` never blocks. `lock(fd)` blocks the calling thread until the holder lets
go: for a thread of its own (a Ray actor) or a command's main thread, where ^C still
ends the wait (CPython runs the signal's handler when flock is interrupted, and the
KeyboardInterrupt it raises ends the call).

`wait_lock(fd)` is the wait for trio code, and nothing in it polls: a child process that
inherits `fd` makes the blocking call. A flock belongs to the open file description,
which the child shares, so the lock it takes is the caller's once it exits. Not a
blocking call in a worker thread: a cancelled wait would leave that thread in the
kernel, to take the lock whenever the holder let go, in the middle of someone else's
turn. Cancelling kills the child, and its wait ends with it. The child may have taken
the lock in the instant before it died, so a wait that does not return lets go of the
lock (`LOCK_UN`) on the caller's description, which holds nothing otherwise.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys

import trio

__all__ = ["lock", "try_lock", "unlock", "wait_lock"]

#: What the child runs: the blocking flock on the descriptor it inherited (its number in
#: argv), then exit, which leaves the lock with the description the caller still has.
_CHILD = "import fcntl, sys; fcntl.flock(int(sys.argv[1]), fcntl.LOCK_EX)"


def try_lock(fd: int) -> bool:
    """Take the exclusive lock on `fd` if nobody else holds it; never blocks. Raises
    OSError for a descriptor flock cannot lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock(fd: int) -> None:
    """Take the exclusive lock on `fd`, blocking the calling thread while another holds
    it. A signal whose handler raises (^C) ends the wait, holding nothing."""
    fcntl.flock(fd, fcntl.LOCK_EX)


def unlock(fd: int) -> None:
    """Let go of the lock `fd`'s description holds (nothing when it holds none)."""
    fcntl.flock(fd, fcntl.LOCK_UN)


async def wait_lock(fd: int) -> None:
    """Take the exclusive lock on `fd`, waiting while another holds it (see the module
    doc). Cancellable at any moment; cancelled, or failing, it holds nothing. Raises
    OSError when the waiting child cannot run or cannot lock `fd`."""
    try:
        result = await trio.run_process(
            [sys.executable, "-I", "-S", "-c", _CHILD, str(fd)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        if result.returncode != 0:
            why = result.stderr.decode("utf-8", "replace").strip().splitlines()
            raise OSError(f"flock: {why[-1] if why else f'exit status {result.returncode}'}")
    except BaseException:
        unlock(fd)
        raise

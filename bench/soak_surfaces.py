"""Soak: every surface others can reach, attacked at once; the daemon never wedges and loses nothing.

    python bench/soak_surfaces.py [--minutes 10] [--stalled 400] [--seed 1] [--keep]
                                  [--no-write] [--out bench/RESULTS.md]

Two real daemons, started as the tests start them: a peer, and the daemon under test,
which follows the peer's bank (`[bank] follow`) and serves metrics on loopback. Before
they start, the peer's bank is given hostile records as they are (a peer that is itself
hostile: a session option that names a file, an unknown strategy, an infinite timing, a
trial nested 100,000 deep). For --minutes, four threads:

- drops: programs into the daemon's GDAT drop folder (`job_type = "gdat"`, a world of
  two), good ones and hostile ones (tests/hostile_pt2.py: each way torch's own loader
  runs code from a file); ONNX models into the peer's drop folder, good ones and the
  hostile corpus (tests/hostile.py);
- bank: `aoe bank import --socket` into either daemon, each file good records (new
  ones every time) and the hostile lines of tests/test_bank_untrusted.py (a file named
  in a session option and through a link, Infinity, NaN and 1e-320 timings, a 7 MB
  strategy, trials nested 100,000 deep); and ONNX jobs uploaded to the daemon;
- metrics: an attacker that keeps up to --stalled connections to the metrics port open,
  each having sent half a request, opening new ones as the daemon drops them, while a
  scraper scrapes every 2 s;
- a watchdog that asks the daemon's health every second.

Checked: neither daemon exits; the daemon's health answers within 10 s every time (a
longer wait is a wedge); every call answers OK or a refusal its kind allows; each import
adds its good records and refuses every hostile one; the files the hostile records and
programs aim at are never written; the follower refuses the peer's hostile records and
takes its good ones, the good records imported into the peer during the run included.
At the end: every dropped file came out (outbox or failed/), the daemon's descriptors
are back near where they started and nothing is left in CLOSE-WAIT on the metrics port;
what is committed (finished jobs, their events, the bank's records) before the end, at
the end and after a SIGTERM and a restart holds everything the snapshot before it held.
Prints its figures and writes them into bench/RESULTS.md (its own section); exit status
1 when a check failed (the daemons' files are kept then, and with --keep).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from aoe.bank import open_bank  # noqa: E402
from aoe.v1 import tuning_pb2  # noqa: E402
from aoed import samples  # noqa: E402
from bench_bank import publish  # noqa: E402
from machine import Machine  # noqa: E402
from soak_disk import ACTIVE, Snapshot, all_jobs, delivered, snapshot  # noqa: E402
from tests.bank_util import make_entry  # noqa: E402
from tests.daemon_util import DaemonProcess, follow, log_state, upload  # noqa: E402  # noqa: E402
from tests.hostile import KINDS as ONNX_KINDS  # noqa: E402
from tests.hostile_pt2 import KINDS as PT2_KINDS  # noqa: E402
from tests.hostile_pt2 import tiny_program  # noqa: E402
from tests.metrics_util import HALF_A_REQUEST, open_fds, server_side, url_port  # noqa: E402
from tests.test_bank_untrusted import (  # noqa: E402
    FILE_KEY,
    SENTINEL,
    _hostile_lines,
    _line,
    _seed,
    _session,
)

RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- soak-surfaces:begin -->", "<!-- soak-surfaces:end -->"
#: programs whose payload torch's loader runs: each must be refused before any load
PT2_HOSTILE = ("opaque_object", "sympy_expression", "guard", "node_target", "pickled_constant")
#: hostile ONNX models bigger than this are left out (the corpus has a 33 MB one)
HOSTILE_MAX_BYTES = 1 << 20
#: a health answer slower than this is a wedge
WEDGE_S = 10.0
#: no new job while this many are queued or running on a daemon
MAX_ACTIVE = 4
GDAT_INBOX = 'job_type = "gdat"\nworld_size = 2\nbudget_s = 3.0\n'
CLOSE_WAIT = "08"
AOE = str(Path(sys.executable).with_name("aoe"))


class Soak:
    """The two daemons, the attacks and what each saw."""

    def __init__(self, root: Path, stalled: int, seed: int) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.stalled = stalled
        self.stop = threading.Event()
        self.problems: list[str] = []
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.dropped: dict[str, list[str]] = {"d": [], "peer": []}
        self.health_s: list[float] = []
        self.scrapes: Counter[str] = Counter()
        self.held_max = 0
        self.imported: dict[str, set[str]] = {"d": set(), "peer": set()}
        self.refused_imports = 0
        self._n = 0
        self._lock = threading.Lock()
        # What the hostile records and programs aim at: none may ever change.
        self.sentinel = root / "jobs.sqlite3"
        self.other = root / "other.db"
        self.link = root / "link"
        self.marker = root / "payload-ran"
        self.sentinel.write_bytes(SENTINEL)
        self.other.write_bytes(SENTINEL)
        self.link.symlink_to(self.other)
        self.peer = DaemonProcess(root / "peer")
        self.d = DaemonProcess(
            root / "d", '[metrics]\nlisten = "127.0.0.1:0"\nmax_connections = 16\ntimeout_s = 10\n'
        )
        follow(self.d, [self.peer])

    # ------------------------------------------------------------------ set-up

    def prepare(self) -> None:
        d, peer = self.d, self.peer
        for x in (d, peer):
            x.inbox.mkdir(parents=True, exist_ok=True)
        (d.inbox / "aoed.toml").write_text(GDAT_INBOX)
        (peer.inbox / "aoed.toml").write_text("budget_s = 1.0\n")
        self.models = [
            samples.save(samples.mlp(hidden=24 + 8 * i), d.models / f"mlp{i}.onnx")
            for i in range(4)
        ]
        self.programs = self.root / "programs"
        self.programs.mkdir()
        base = tiny_program(self.programs / "tiny.pt2")
        self.good_pt2 = [base]
        self.bad_pt2 = [
            PT2_KINDS[k].build(base, self.programs / f"{k}.pt2", self.marker) for k in PT2_HOSTILE
        ]
        corpus = self.root / "corpus"
        self.bad_onnx = []
        for kind in ONNX_KINDS.values():
            if kind.by_path or kind.cli_only:
                continue
            case = kind.build(corpus / kind.name)
            if case.model.is_file() and case.model.stat().st_size <= HOSTILE_MAX_BYTES:
                self.bad_onnx.append(case.model)
        # The peer's bank holds hostile records as they are before it starts, and good
        # ones: the follower must take these and refuse those.
        self.peer_good = [make_entry(n, 5.0 + n, "alpha") for n in range(3)]
        self.peer_bad = [
            _session(50, {"config": {FILE_KEY: str(self.sentinel)}}),
            _session(51, {"config": {FILE_KEY: str(self.link)}}),
            dataclasses.replace(make_entry(52, 1.0, "x"), strategy="no_such_strategy"),
            make_entry(53, math.inf, "x"),
        ]
        deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
        _seed(peer.bank, [*self.peer_good, *self.peer_bad], [(self.peer_good[0].key, deep)])
        # Every hostile line but the one that is no record at all: over a socket, the
        # client refuses a file holding it whole, before anything is sent.
        self.hostile_lines = [
            line
            for name, (line, _) in _hostile_lines(self.sentinel, self.link).items()
            if name != "line nested 100k deep"
        ]

    # ------------------------------------------------------------------ checks

    def untouched(self) -> list[str]:
        out = []
        if self.sentinel.read_bytes() != SENTINEL or self.other.read_bytes() != SENTINEL:
            out.append("a file a hostile record names was written")
        if not self.link.is_symlink() or self.link.resolve() != self.other.resolve():
            out.append("the link a hostile record names was replaced")
        if self.marker.exists():
            out.append("a hostile program's payload ran")
        return out

    def alive(self) -> bool:
        for name, x in (("the daemon", self.d), ("the peer", self.peer)):
            if x.proc is None or x.proc.poll() is not None:
                self.note(f"{name} exited ({x.proc.returncode if x.proc else '?'})")
                return False
        return True

    def note(self, problem: str) -> None:
        with self._lock:
            if problem not in self.problems:
                self.problems.append(problem)

    def count(self, what: str, got: str) -> None:
        with self._lock:
            self.outcomes[what, got] += 1

    # ------------------------------------------------------------------ load

    def _drop(self, daemon: DaemonProcess, key: str, src: Path, what: str) -> None:
        with self._lock:
            self._n += 1
            n = self._n
        name = f"drop-{n:04d}-{what}{src.suffix}"
        part = daemon.inbox / f".{name}.part"
        shutil.copyfile(src, part)
        part.rename(daemon.inbox / name)
        self.dropped[key].append(name)

    def _import(self, daemon: DaemonProcess, key: str, what: str) -> None:
        """One `aoe bank import --socket` of new good records and every hostile line."""
        with self._lock:
            self._n += 1
            n = self._n
        good = [make_entry(1000 + 10 * n + i, 3.0 + i, "alpha") for i in range(2)]
        lines = [_line(good[0]), *self.hostile_lines, _line(good[1])]
        dump = self.root / f"import-{n}.jsonl"
        dump.write_text("\n".join(lines) + "\n")
        r = subprocess.run(
            [AOE, "bank", "import", str(dump), "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        dump.unlink()
        want = f"2 added, 0 updated, 0 kept, {len(self.hostile_lines)} refused"
        if r.returncode != 0 or want not in r.stdout:
            self.note(f"import into {key}: exit {r.returncode}: {(r.stdout + r.stderr)[-400:]}")
            self.count(what, "unexpected")
            return
        with self._lock:
            self.imported[key].update(g.key.decode() for g in good)
            self.refused_imports += len(self.hostile_lines)
        self.count(what, "OK")

    def _submit(self) -> None:
        stub = self.d.tuning()
        model_id = upload(stub, self.rng.choice(self.models))
        stub.SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_id=model_id, options=tuning_pb2.JobOptions(budget_s=1.0)
            ),
            timeout=60,
        )

    def load(self) -> None:
        """Drops, imports and jobs, one at a time, until stopped."""
        weights = {
            "drop gdat": 1,
            "drop gdat hostile": 2,
            "drop onnx": 2,
            "drop onnx hostile": 2,
            "import": 2,
            "import peer": 1,
            "submit": 2,
        }
        while not self.stop.is_set():
            what = self.rng.choices(list(weights), list(weights.values()))[0]
            try:
                busy = {
                    k: len(all_jobs(x.tuning(), ACTIVE))
                    for k, x in (("d", self.d), ("peer", self.peer))
                }
                if what in ("drop gdat", "submit") and busy["d"] >= MAX_ACTIVE:
                    what = "import"
                if what == "drop onnx" and busy["peer"] >= MAX_ACTIVE:
                    what = "import peer"
                if what == "drop gdat":
                    self._drop(self.d, "d", self.rng.choice(self.good_pt2), "good")
                elif what == "drop gdat hostile":
                    src = self.rng.choice(self.bad_pt2)
                    self._drop(self.d, "d", src, f"hostile-{src.stem}")
                elif what == "drop onnx":
                    self._drop(self.peer, "peer", self.rng.choice(self.models), "good")
                elif what == "drop onnx hostile":
                    src = self.rng.choice(self.bad_onnx)
                    self._drop(self.peer, "peer", src, f"hostile-{src.parent.name}")
                elif what == "import":
                    self._import(self.d, "d", what)
                    continue
                elif what == "import peer":
                    self._import(self.peer, "peer", what)
                    continue
                else:
                    self._submit()
                self.count(what, "OK")
            except grpc.RpcError as exc:
                self.count(what, exc.code().name)
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.note(f"{what}: {exc.code().name}: {exc.details()}")
            except (OSError, subprocess.SubprocessError) as exc:
                self.count(what, type(exc).__name__)
                self.note(f"{what}: {exc}")
            self.stop.wait(self.rng.uniform(0.5, 2.0))

    def attack_metrics(self, url: str) -> None:
        """Keep up to `stalled` half-sent requests open on the metrics port."""
        port = url_port(url)
        held: list[socket.socket] = []
        try:
            while not self.stop.is_set():
                # Drop the ones the daemon closed (a read gives b"" or an error).
                alive = []
                for s in held:
                    try:
                        s.setblocking(False)
                        if s.recv(1) == b"":
                            s.close()
                            continue
                    except BlockingIOError:
                        alive.append(s)
                        continue
                    except OSError:
                        s.close()
                        continue
                    alive.append(s)
                held = alive
                while len(held) < self.stalled and not self.stop.is_set():
                    try:
                        s = socket.create_connection(("127.0.0.1", port), timeout=5)
                        s.sendall(HALF_A_REQUEST)
                    except OSError:
                        break
                    held.append(s)
                self.held_max = max(self.held_max, len(held))
                self.stop.wait(0.5)
        finally:
            for s in held:
                s.close()

    def scrape(self, url: str) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=30) as reply:
                    reply.read()
                got = "answered"
            except (ConnectionError, urllib.error.URLError, OSError) as exc:
                got = "refused" if time.monotonic() - t < WEDGE_S else f"slow ({exc})"
            with self._lock:
                self.scrapes[got] += 1
            self.stop.wait(2.0)

    def watch(self) -> None:
        while not self.stop.is_set():
            if not self.alive():
                return
            t = time.monotonic()
            ok = self.d.serving()
            took = time.monotonic() - t
            with self._lock:
                self.health_s.append(took)
            if not ok or took > WEDGE_S:
                self.note(f"health: {'not SERVING' if not ok else f'{took:.1f} s'}")
            self.stop.wait(1.0)


def _address(d: DaemonProcess) -> str:
    found = re.search(r"metrics on (http://\S+/metrics)", d.log())
    if not found:
        raise RuntimeError(f"the daemon serves no metrics:\n{d.log()[-2000:]}")
    return found.group(1)


def _as_onnx(name: str) -> str:
    """The name `delivered` looks for: a dropped program's results are named as a
    model's are, after its stem."""
    return Path(name).stem + ".onnx"


def _keys(bank: Path) -> set[str]:
    with open_bank(bank, use_env=False) as reader:
        return {e.key for _, e in reader.entries()}


def run(root: Path, minutes: float, stalled: int, seed: int) -> tuple[bool, list[str]]:
    s = Soak(root, stalled, seed)
    s.prepare()
    d, peer = s.d, s.peer
    snaps: list[Snapshot] = []
    fds: dict[str, int] = {}
    threads: list[threading.Thread] = []
    t0 = time.monotonic()

    def take(when: str) -> None:
        snaps.append(snapshot(d, when))
        if len(snaps) > 1:
            for p in snaps[-1].lost_since(snaps[-2]):
                s.note(p)
        x = snaps[-1]
        print(
            f"{time.monotonic() - t0:6.0f} s  {when}: {len(x.jobs)} finished jobs, "
            f"{sum(map(len, x.events.values()))} events, {len(x.bank)} bank records",
            flush=True,
        )

    try:
        peer.start()
        d.start()
        url = _address(d)
        pid = d.proc.pid  # type: ignore[union-attr]
        fds["start"] = open_fds(pid)
        for target, name in (
            (s.load, "load"),
            (lambda: s.attack_metrics(url), "attack"),
            (lambda: s.scrape(url), "scrape"),
            (s.watch, "watch"),
        ):
            threads.append(threading.Thread(target=target, name=name, daemon=True))
            threads[-1].start()
        half = minutes * 30
        while time.monotonic() - t0 < half and s.alive():
            time.sleep(1)
        if s.alive():
            take("half way")
            fds["under attack"] = open_fds(pid)
        while time.monotonic() - t0 < minutes * 60 and s.alive():
            time.sleep(1)
        s.stop.set()
        for t in threads:
            t.join(300)
        # Drain: what is queued runs, what was dropped comes out.
        deadline = time.monotonic() + 900
        while s.alive() and time.monotonic() < deadline:
            active = all_jobs(d.tuning(), ACTIVE) + all_jobs(peer.tuning(), ACTIVE)
            if not active and all(
                delivered(x, n)
                for x, k in ((d, "d"), (peer, "peer"))
                for n in (_as_onnx(m) for m in s.dropped[k])
            ):
                break
            time.sleep(2)
        if s.alive():
            take("at the end")
            for k, x in (("d", d), ("peer", peer)):
                left = [n for n in s.dropped[k] if not delivered(x, _as_onnx(n))]
                if left:
                    s.note(f"{len(left)} files dropped into {k}'s inbox never came out: {left[:5]}")
            # The follower holds the peer's good records (those imported into the peer
            # during the run included) and none of its hostile ones.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if log_state(d)[1].get(f"unix://{peer.socket}") == log_state(peer)[0]:
                    break
                time.sleep(1)
            held = _keys(d.bank)
            want = {g.key.decode() for g in s.peer_good} | s.imported["peer"] | s.imported["d"]
            if missing := want - held:
                s.note(f"{len(missing)} good records missing in the daemon's bank")
            if bad := {b.key.decode() for b in s.peer_bad} & held:
                s.note(f"{len(bad)} hostile records of the peer were taken")
            if "refused" not in d.log():
                s.note("the follower logged no refusal")
            fds["after"] = open_fds(pid)
            port = url_port(url)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and CLOSE_WAIT in server_side(port):
                time.sleep(1)
            if CLOSE_WAIT in server_side(port):
                s.note("connections left in CLOSE-WAIT on the metrics port")
            if fds["after"] > fds["start"] + 16:
                s.note(f"descriptors: {fds['start']} at the start, {fds['after']} after the attack")
            code = d.stop()
            if code != 0:
                s.note(f"SIGTERM: exit status {code}")
            d.start()
            take("after a restart")
        for p in s.untouched():
            s.note(p)
    finally:
        s.stop.set()
        for x in (d, peer):
            x.close()

    # ------------------------------------------------------------------ figures
    out = s.outcomes
    calls = "; ".join(
        f"{what} " + ", ".join(f"{n} {got}" for (w, got), n in sorted(out.items()) if w == what)
        for what in sorted({w for w, _ in out})
    )
    health = sorted(s.health_s)
    lost = [p for p in s.problems if " -> " in p]
    dropped = s.dropped["d"] + s.dropped["peer"]
    rows = [
        "| daemon exits | "
        + str(sum("exited" in p for p in s.problems))
        + " (each daemon the same process until the planned SIGTERM) |",
        f"| health (every second) | {len(health)} answers, median {1000 * health[len(health) // 2]:.0f} ms, "
        f"slowest {health[-1]:.2f} s; a wedge is any answer over {WEDGE_S:.0f} s: "
        f"{sum(h > WEDGE_S for h in health)} |"
        if health
        else "| health | no answer |",
        f"| calls (by outcome) | {calls} |",
        f"| drops | {len(dropped)}: {sum('-hostile-' in n for n in s.dropped['d'])} hostile programs, "
        f"{sum('-good' in n for n in s.dropped['d'])} good programs into the GDAT folder; "
        f"{sum('-hostile-' in n for n in s.dropped['peer'])} hostile and "
        f"{sum('-good' in n for n in s.dropped['peer'])} good ONNX models into the peer's; every one out in "
        "outbox/ or failed/ at the end"
        + ("" if not any("never came out" in p for p in s.problems) else ": NO")
        + " |",
        f"| bank | {len(s.imported['d']) + len(s.imported['peer'])} good records imported and "
        f"{s.refused_imports} hostile ones refused; the follower "
        + (
            "did NOT take every good record or refuse every hostile one"
            if any("good records missing" in p or "were taken" in p for p in s.problems)
            else f"took the peer's {len(s.peer_good)} good records (and those imported into it) "
            f"and refused its {len(s.peer_bad)} hostile ones and its 100,000-deep trial"
        )
        + "; files the records name: "
        + (
            "untouched"
            if not any("written" in p or "replaced" in p for p in s.problems)
            else "WRITTEN"
        )
        + " |",
        f"| metrics under attack | up to {s.held_max} stalled connections held at once; scrapes: "
        + ", ".join(f"{n} {k}" for k, n in sorted(s.scrapes.items()))
        + f"; descriptors {fds.get('start', '?')} at the start, {fds.get('under attack', '?')} under "
        f"attack, {fds.get('after', '?')} after |",
        "| committed records compared, snapshot to snapshot | "
        + "; ".join(
            f"{x.when}: {len(x.jobs)} jobs, {sum(map(len, x.events.values()))} events, "
            f"{len(x.bank)} bank records"
            for x in snaps
        )
        + f": {len(lost)} lost |",
    ]
    for p in s.problems:
        print("problem:", p, flush=True)
    return not s.problems, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the run (default 10)")
    ap.add_argument(
        "--stalled",
        type=int,
        default=400,
        help="stalled connections the attacker keeps open on the metrics port (default 400)",
    )
    ap.add_argument("--seed", type=int, default=1, help="seed of the load's choices (default 1)")
    ap.add_argument("--keep", action="store_true", help="keep the daemons' files")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    args = ap.parse_args(argv)

    host = Machine()
    root = Path(tempfile.mkdtemp(prefix="aoed-soak-surfaces-"))
    t0 = time.monotonic()
    ok, rows = run(root, args.minutes, args.stalled, args.seed)
    took = time.monotonic() - t0
    host.finish()
    short = "" if args.minutes >= 10 else " (a short run: `make soak` runs 10 minutes)"
    text = "\n".join(
        [
            "## The surfaces others reach, attacked at once (`python bench/soak_surfaces.py`)",
            "",
            f"Machine: {host.describe('onnxruntime', 'lmdb', 'grpcio', 'torch')}.",
            "",
            f"Run: {args.minutes:g} minutes{short}, {took / 60:.1f} minutes with the set-up, the "
            f"drain and the restart; {time.strftime('%Y-%m-%d')}. A daemon that follows a peer "
            "whose bank holds hostile records; GDAT drops (good and hostile programs) into the "
            "daemon, ONNX drops (good and the hostile corpus) into the peer, bank imports of good "
            f"and hostile records into both, jobs uploaded to the daemon; {args.stalled} stalled "
            "connections kept on its metrics port while it is scraped every 2 s (seed "
            f"{args.seed}). Models and programs are synthetic.",
            "",
            "| figure | value |",
            "|---|---|",
            *rows,
            "",
            f"Result: {'PASS' if ok else 'FAIL'}.",
        ]
    )
    publish(text, args.out, BEGIN, END, write=not args.no_write)
    if not ok or args.keep:
        print(f"the daemons' files: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

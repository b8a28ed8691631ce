"""Latency as a user deploys a model: one onnxruntime session per process, processes in turn.

    python bench/deployed.py WORKDIR [--models a,b] [--rounds 5]

Two onnxruntime sessions in one process disturb each other on a 2-core machine: the
idle intra-op threads of one steal the cores of the other, and with spinning turned off
to stop that, every parallel kernel pays a thread wake-up (held-out exact SGAT read
0.94x interleaved in one process, 1.15x with one session per process). A server runs one
model in one process with onnxruntime's defaults, so every speedup the bench reports is
measured that way here (`latencies`):

- one worker process per variant (this file, `--serve`), started one after another, each
  holding one session of its model: onnxruntime's default options (intra-op spinning on)
  or, for a model aoe tuned, the options its job stored (`aoe.session`);
- rounds: in each, every worker takes its turn, in an order that rotates from round to
  round, after a short pause that lets the last worker's threads go idle; a turn is one
  untimed run, then timed samples of a batch of runs each (about 2 ms a sample), while
  every other worker waits on its pipe; a round the budget cuts short is dropped, so
  every kept round has every variant in it, and the ratio of two variants within a round
  is free of the machine's slow drift (bench/measure.py's `ratio`);
- the parent holds the machine-wide device lock the whole time (bench/run.py's
  `holding_device`), so no tuner measures meanwhile.

Workers read their inputs from an .npz file (no pickle) and answer in JSON lines.

Run as a script on a bench_sgat.py workdir, it prints, for each transformer there, its
quantize_dynamic peer against the model aoe's SGAT+OPAT int8 job shipped, measured this
way with spinning on (deployed) and off (as the tuner measures): `measure_model`.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import measure  # the parent's only: a worker starts without it

#: Seconds a worker runs its model before it reports the time of one run (its batch is
#: sized from that).
WARM_S = 0.2
#: Pause before each turn: the last worker's spinning threads go idle within it.
#: onnxruntime's intra-op threads spin on for about 25 ms after a run (read with the
#: process CPU clock every millisecond on the sample models: 25.0 to 26.2 ms, once 41.9 ms).
SETTLE_S = 0.05
#: A timed sample lasts about this long (as the tuner's procedure sizes its batches).
SAMPLE_S = 0.002
START_TIMEOUT_S = 300.0
SPIN_KEY = "session.intra_op.allow_spinning"


@dataclass(frozen=True)
class Model:
    """One variant to time: its file, whether aoe tuned it (its stored session options
    apply), and the intra-op spinning to force ("" keeps the default: on)."""

    path: Path
    tuned: bool = False
    spin: str = ""


# ------------------------------------------------------------------ worker


def _session(path: str, tuned: bool, spin: str):
    import onnxruntime as ort

    config = {SPIN_KEY: spin} if spin else {}
    if tuned and path.endswith(".xml"):  # an OpenVINO IR aoe shipped, with its compile config
        import aoe

        return aoe.session(path)
    if tuned:
        import aoe

        stored = aoe.session_options_of(path)
        return aoe.session(path, config={**stored.get("config", {}), **config})
    so = ort.SessionOptions()
    so.log_severity_level = 3
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def serve(path: str, tuned: bool, spin: str, inputs: str) -> int:
    """The worker: load one session, report one run's time after warming up, then answer
    each `turn SAMPLES BATCH` line on stdin with the samples' seconds per run."""
    sess = _session(path, tuned, spin)
    names = {i.name for i in sess.get_inputs()}
    with np.load(inputs, allow_pickle=False) as data:
        feeds = {k: data[k] for k in data.files if k in names}
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < WARM_S:
        sess.run(None, feeds)
        n += 1
    print(json.dumps({"per_run_s": (time.perf_counter() - t0) / n}), flush=True)
    for line in sys.stdin:
        word, samples, batch = line.split()
        if word != "turn":
            raise SystemExit(f"deployed.py: unknown command {line!r}")
        sess.run(None, feeds)  # untimed: a cold cache stays out of the samples
        got = []
        for _ in range(int(samples)):
            t = time.perf_counter()
            for _ in range(int(batch)):
                sess.run(None, feeds)
            got.append((time.perf_counter() - t) / int(batch))
        print(json.dumps({"samples_s": got}), flush=True)
    return 0


# ------------------------------------------------------------------ parent


class _Worker:
    def __init__(self, name: str, model: Model, inputs: Path):
        self.name = name
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--serve",
            str(model.path),
            "--inputs",
            str(inputs),
        ]
        if model.tuned:
            cmd.append("--tuned")
        if model.spin:
            cmd += ["--spin", model.spin]
        # stderr to a file: a worker that logs a lot must never block on a full pipe.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True
        )
        self.per_run_s = float(self._reply()["per_run_s"])

    def _reply(self) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            lines = [ln for ln in self.stderr.read().strip().splitlines() if ln.strip()]
            raise RuntimeError(f"its process ended: {lines[-1] if lines else 'no message'}")
        return json.loads(line)

    def turn(self, samples: int, batch: int) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"turn {samples} {batch}\n")
        self.proc.stdin.flush()
        return [float(s) for s in self._reply()["samples_s"]]

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def latencies(
    models: Mapping[str, Model],
    feed: Mapping[str, np.ndarray],
    *,
    rounds: int,
    budget_s: float,
    samples: int,
) -> tuple[dict[str, measure.Latency], dict[str, str]]:
    """Every model in `models` timed on `feed` with one session per process, in `rounds`
    rounds (fewer when `budget_s`, starting the workers excluded, runs out first:
    `Latency.rounds` says how many); and why each model left out could not be timed.
    RuntimeError when none could."""
    with tempfile.TemporaryDirectory(prefix="aoe-deployed-") as tmp:
        inputs = Path(tmp) / "inputs.npz"
        np.savez(inputs, **dict(feed))
        workers: dict[str, _Worker] = {}
        errors: dict[str, str] = {}
        try:
            for name, model in models.items():  # one at a time: warm-ups must not overlap
                try:
                    workers[name] = _Worker(name, model, inputs)
                except (RuntimeError, OSError, ValueError) as exc:
                    errors[name] = str(exc)
            if not workers:
                raise RuntimeError(f"no variant could be timed: {errors}")
            return _rounds(workers, rounds=rounds, budget_s=budget_s, samples=samples), errors
        finally:
            for w in workers.values():
                w.close()


def _rounds(
    workers: dict[str, _Worker], *, rounds: int, budget_s: float, samples: int
) -> dict[str, measure.Latency]:
    import measure

    names = list(workers)
    batch = {
        n: max(1, min(1000, math.ceil(SAMPLE_S / max(workers[n].per_run_s, 1e-7)))) for n in names
    }
    # Fewer samples per turn when the rounds would not fit in the budget (one at least).
    turn_s = sum(SETTLE_S + workers[n].per_run_s * (1 + samples * batch[n]) for n in names)
    if turn_s * rounds > budget_s:
        one = sum(workers[n].per_run_s * batch[n] for n in names) or 1e-9
        fixed = sum(SETTLE_S + workers[n].per_run_s for n in names)
        samples = max(1, min(samples, int((budget_s / rounds - fixed) / one)))
    collected: dict[str, list[float]] = {n: [] for n in names}
    per_round: dict[str, list[float]] = {n: [] for n in names}
    deadline = time.perf_counter() + budget_s
    for rnd in range(rounds):
        k = rnd % len(names)
        turn: dict[str, list[float]] = {}
        for name in names[k:] + names[:k]:
            if rnd > 0 and time.perf_counter() > deadline:
                break  # the budget is spent: this round would be partial
            time.sleep(SETTLE_S)
            turn[name] = workers[name].turn(samples, batch[name])
        if len(turn) < len(names):
            break
        for name, got in turn.items():
            collected[name].extend(got)
            per_round[name].append(float(np.median(got)) * 1e6)
        if time.perf_counter() > deadline:
            break
    out = {}
    for name in names:
        a = np.asarray(collected[name]) * 1e6
        q25, med, q75 = np.percentile(a, [25, 50, 75])
        out[name] = measure.Latency(
            float(med) / 1e3,
            float((q75 - q25) / med) if med > 0 else 0.0,
            tuple(per_round[name]),
            batch[name],
        )
    return out


# ------------------------------------------------------------------ quantize_dynamic vs aoe


@dataclass
class Regime:
    """One regime's figures: qdyn's and aoe's median per round, in microseconds."""

    name: str  # "spinning on" (deployed) or "spinning off"
    qdyn_us: list[float]
    aoe_us: list[float]

    def ratios(self) -> np.ndarray:
        return np.array(self.qdyn_us) / np.array(self.aoe_us)

    def text(self) -> str:
        r = self.ratios()
        return (
            f"qdyn {np.median(self.qdyn_us):.0f} us, aoe {np.median(self.aoe_us):.0f} us, "
            f"{np.median(r):.2f}x ({r.min():.2f}-{r.max():.2f})"
        )


@dataclass
class Deployed:
    """A model's figures in both regimes, or why there are none."""

    name: str
    options: dict = field(default_factory=dict)  # the session options aoe's job stored
    regimes: list[Regime] = field(default_factory=list)
    skipped: str = ""


def _token_feeds(path: str) -> dict[str, np.ndarray]:
    """Token ids in [1, 100) for every input, an attention mask of ones; TypeError for
    a model with other inputs."""
    s = _session(path, tuned=False, spin="0")
    rng = np.random.default_rng(0)
    feeds = {}
    for i in s.get_inputs():
        if i.type != "tensor(int64)":
            raise TypeError(f"input {i.name} is {i.type}, not token ids")
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        feeds[i.name] = (
            np.ones(shape, np.int64)
            if i.name == "attention_mask"
            else rng.integers(1, 100, shape).astype(np.int64)
        )
    return feeds


def measure_model(root: Path, rounds: int, budget_s: float = 60.0, samples: int = 20) -> Deployed:
    """quantize_dynamic and aoe's SGAT+OPAT int8 model of the bench workdir `root`, one
    session per process, `rounds` rounds in each regime (spinning on first)."""
    results = glob.glob(str(root / "aoe" / "sgat_opat_int8" / "out" / "aoe_result_*.json"))
    if not results:
        return Deployed(root.name, skipped="no SGAT+OPAT int8 result")
    tuned = json.loads(Path(results[0]).read_text()).get("tuned_model")
    qdyn = str(root / "peers" / "qdyn.onnx")
    if not tuned or not Path(qdyn).exists():
        return Deployed(root.name, skipped="no tuned model or no quantize_dynamic peer")
    try:
        feeds = _token_feeds(qdyn)
    except TypeError as e:
        return Deployed(root.name, skipped=str(e))
    import aoe

    out = Deployed(root.name, options=aoe.session_options_of(tuned))
    for spin, regime in (("1", "spinning on"), ("0", "spinning off")):
        got, errors = latencies(
            {"qdyn": Model(Path(qdyn), False, spin), "aoe": Model(Path(tuned), True, spin)},
            feeds,
            rounds=rounds,
            budget_s=budget_s,
            samples=samples,
        )
        if errors:
            return Deployed(root.name, skipped="; ".join(f"{k}: {v}" for k, v in errors.items()))
        out.regimes.append(Regime(regime, list(got["qdyn"].rounds_us), list(got["aoe"].rounds_us)))
    return out


def measure_text(root: Path, rounds: int) -> str:
    """`measure_model` as one line of text."""
    d = measure_model(root, rounds)
    if d.skipped:
        return f"{d.name}: skipped, {d.skipped}"
    return " | ".join(
        [d.name, json.dumps(d.options), *(f"{r.name}: {r.text()}" for r in d.regimes)]
    )


def main() -> int:
    if "--serve" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--serve", required=True)
        ap.add_argument("--inputs", required=True)
        ap.add_argument("--tuned", action="store_true")
        ap.add_argument("--spin", default="")
        a = ap.parse_args()
        return serve(a.serve, a.tuned, a.spin, a.inputs)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--models", help="comma-separated subset of the workdir's models")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    names = (
        args.models.split(",")
        if args.models
        else sorted(p.parent.parent.name for p in args.workdir.glob("*/peers/qdyn.onnx"))
    )
    for name in names:
        print(measure_text(args.workdir / name, args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())

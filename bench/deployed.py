"""aoe's int8 models against quantize_dynamic as one deployed session runs them.

    python bench/deployed.py WORKDIR [--models a,b] [--rounds 5]

WORKDIR is what `bench/bench_sgat.py --workdir WORKDIR` kept. For each transformer there,
its `peers/qdyn.onnx` and the model that aoe's SGAT+OPAT int8 job shipped (the result
JSON's `tuned_model`) are measured the way a server runs one model: one session at a time
in this process (made, warmed with 15 runs, timed over 40, then dropped before the next
is made), with onnxruntime's defaults, intra-op spinning included. aoe's model gets the
session options its job stored (`aoe.session`). This is the regime bench_sgat.py cannot
use: it keeps many sessions alive and interleaves them, so it turns spinning off (see its
docstring), and on a 2-core machine spinning-off sessions pay a thread wake-up in every
parallel kernel, which favours models with fewer kernels.

Both regimes are printed: spinning on (deployed) and off (as bench_sgat.py and the tuner
measure). Each round measures every variant in turn; the ratio is qdyn's median over
aoe's within a round, and the line gives the median and range of those per-round ratios.
Prints only; writes nothing.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

import aoe

WARM = 15
TIMED = 40


def _session(path: str, tuned: bool, spin: str) -> ort.InferenceSession:
    config = {"session.intra_op.allow_spinning": spin}
    if tuned:
        stored = aoe.session_options_of(path)
        return aoe.session(path, config={**stored.get("config", {}), **config})
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _feeds(path: str) -> dict[str, np.ndarray]:
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


def _time(path: str, tuned: bool, spin: str, feeds) -> float:
    s = _session(path, tuned, spin)
    for _ in range(WARM):
        s.run(None, feeds)
    times = []
    for _ in range(TIMED):
        t = time.perf_counter()
        s.run(None, feeds)
        times.append(time.perf_counter() - t)
    del s
    gc.collect()
    time.sleep(0.05)
    return float(np.median(times) * 1e6)


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
        return (f"qdyn {np.median(self.qdyn_us):.0f} us, aoe {np.median(self.aoe_us):.0f} us, "
                f"{np.median(r):.2f}x ({r.min():.2f}-{r.max():.2f})")  # fmt: skip


@dataclass
class Deployed:
    """A model's figures in both regimes, or why there are none."""

    name: str
    options: dict = field(default_factory=dict)  # the session options aoe's job stored
    regimes: list[Regime] = field(default_factory=list)
    skipped: str = ""


def measure_model(root: Path, rounds: int) -> Deployed:
    """qdyn and aoe's SGAT+OPAT int8 model of the bench workdir `root`, one session at a
    time, `rounds` rounds in each regime (spinning on first)."""
    results = glob.glob(str(root / "aoe" / "sgat_opat_int8" / "out" / "aoe_result_*.json"))
    if not results:
        return Deployed(root.name, skipped="no SGAT+OPAT int8 result")
    tuned = json.loads(Path(results[0]).read_text()).get("tuned_model")
    qdyn = str(root / "peers" / "qdyn.onnx")
    if not tuned or not Path(qdyn).exists():
        return Deployed(root.name, skipped="no tuned model or no quantize_dynamic peer")
    try:
        feeds = _feeds(qdyn)
    except TypeError as e:
        return Deployed(root.name, skipped=str(e))
    out = Deployed(root.name, options=aoe.session_options_of(tuned))
    for spin, regime in (("1", "spinning on"), ("0", "spinning off")):
        q, a = [], []
        for _ in range(rounds):
            q.append(_time(qdyn, False, spin, feeds))
            a.append(_time(tuned, True, spin, feeds))
        out.regimes.append(Regime(regime, q, a))
    return out


def measure(root: Path, rounds: int) -> str:
    """`measure_model` as one line of text."""
    d = measure_model(root, rounds)
    if d.skipped:
        return f"{d.name}: skipped, {d.skipped}"
    return " | ".join([d.name, json.dumps(d.options), *(f"{r.name}: {r.text()}" for r in d.regimes)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--models", help="comma-separated subset of the workdir's models")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    names = args.models.split(",") if args.models else sorted(
        p.parent.parent.name for p in args.workdir.glob("*/peers/qdyn.onnx")
    )
    for name in names:
        print(measure(args.workdir / name, args.rounds), flush=True)


if __name__ == "__main__":
    main()

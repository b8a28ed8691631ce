"""How fast a cancelled job lets go of the device, written into bench/RESULTS.md.

    python bench/bench_cancel.py [--quick] [--no-write] [--out bench/RESULTS.md]

One engine (its compile workers and measurement runner, as `aoe tune` starts them) runs
a job on the sample CNN with a large budget; once its tasks are being measured, the job
is cancelled through its JobHandle. Two times are taken per try: from the cancel to the
job raising JobCancelledError (its queued requests dropped, the measurement in flight
abandoned and its runner killed), and from the cancel to the next job's first
measurement being answered (by a fresh runner). The cancel comes a different time into
the measurements on each try.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import trio

from machine import Machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- cancel:begin -->", "<!-- cancel:end -->"


async def measure(tries: int) -> tuple[list[float], list[float]]:
    import numpy as np

    from aoe.config import load_config
    from aoe.errors import JobCancelledError
    from aoe.spec import JobSpec
    from aoed import samples
    from aoed.backends.ort.runtime import ORT
    from aoed.engine.engine import open_engine
    from aoed.engine.job import JobHandle, JobRun
    from aoed.engine.messages import Candidate, MeasurePlan, MeasureRequest

    tmp = Path(tempfile.mkdtemp(prefix="bench-cancel-"))
    model = samples.save(samples.build("cnn"), tmp / "cnn.onnx")
    np.savez(tmp / "in.npz", image=np.zeros((1, 3, 32, 32), np.float32))
    config = load_config(env={}).replace(bank=tmp / "bank", parallel=1)
    cancel_s, next_s = [], []
    async with open_engine(config, ORT, tmp / "logs") as engine:
        for i in range(tries):
            handle, stages, t = JobHandle(), [], {}

            async def canceller(
                i: int = i, handle: JobHandle = handle, stages: list = stages, t: dict = t
            ) -> None:
                # `stages` fills from the engine's event callback, which sets no event
                while not any(s.startswith("tuning") for s in stages):  # noqa: ASYNC110
                    await trio.sleep(0.02)
                await trio.sleep(0.3 + 0.2 * i)
                t["cancel"] = time.monotonic()
                handle.cancel("bench")

            opts = JobRun(model, tmp / f"out{i}", JobSpec(budget_s=120.0, repeat_tune=True))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(canceller)
                try:
                    await engine.run_job(
                        opts,
                        lambda e, stages=stages: (
                            stages.append(e.message) if e.kind == "stage" else None
                        ),
                        handle,
                    )
                except JobCancelledError:
                    cancel_s.append(time.monotonic() - t["cancel"])
            req = MeasureRequest(
                (Candidate("a", model),),
                tmp / "in.npz",
                None,
                config.device,
                MeasurePlan(0.05, 1, 1, 1),
            )
            await engine.device.call(req)
            next_s.append(time.monotonic() - t["cancel"])
    return cancel_s, next_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tries")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    args = ap.parse_args(argv)
    from aoed.engine.stats import median

    host = Machine()
    cancel_s, next_s = trio.run(measure, 3 if args.quick else 8)
    host.finish()
    lines = [
        "## Cancelling a job",
        "",
        f"Machine: {host.describe('onnxruntime', 'trio')}.",
        "",
        "A job on the sample CNN (random weights, synthetic input) cancelled while its tasks are measured, "
        f"{len(cancel_s)} times at different moments (bench/bench_cancel.py):",
        "",
        "| what | median | lowest | highest |",
        "|---|---|---|---|",
        f"| cancel -> the job raises JobCancelledError | {median(cancel_s) * 1000:.0f} ms | "
        f"{min(cancel_s) * 1000:.0f} ms | {max(cancel_s) * 1000:.0f} ms |",
        f"| cancel -> the next job's first measurement answered (fresh runner) | {median(next_s):.2f} s | "
        f"{min(next_s):.2f} s | {max(next_s):.2f} s |",
        "",
        "The second row includes starting a new runner process (the one measuring was killed), "
        "which loads onnxruntime.",
    ]
    text = "\n".join(lines)
    from bench_bank import publish

    publish(text, args.out, BEGIN, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())

"""The matrix products of the bench transformers, one kernel at a time, side by side.

    python bench/bench_kernels.py [--quick] [--out bench/RESULTS.md] [--no-write]

What an int8 or int4 policy can win on a transformer is bounded by how much faster this
machine's int8 kernels are than its float ones. This measures, for every product shape
of the bench's `bert` and `gpt` samples (batch 1, sequence 128: the Q/K/V, output and
FFN projections, and the packed Q/K/V product aoe's SGAT strategies use), one model per
kernel holding that product alone:

- fp32: `MatMul` over the float weight (what the fp32 model runs);
- int8: `com.microsoft.DynamicQuantizeMatMul` over the weight in int8, per tensor (what
  `quantize_dynamic` writes, and aoe's `int8_dynamic`);
- int4: `com.microsoft.MatMulNBits`, 4-bit weights in blocks of 32, the product in int8
  (accuracy_level 4; aoe's `int4_int8_compute`).

Each variant runs in its own session with intra-op spinning off, timed by the tuner's own
interleaved procedure (bench/measure.py) while this process holds the device lock; a cell
is the variant's time over fp32's, the median of per-round ratios with its 95% interval.
Inputs and weights are random (the kernels' speed does not depend on the values).
Writes the section between `<!-- kernels:begin -->` and `<!-- kernels:end -->`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import measure
import numpy as np
from machine import Machine
from onnx import TensorProto, helper, numpy_helper
from run import Log, side_by_side

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- kernels:begin -->", "<!-- kernels:end -->"
TITLE = "## Kernels: int8 and int4 products against float on this machine"
VARIANTS = ("fp32", "int8", "int4")
PACKAGES = ("onnxruntime", "numpy")
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


@dataclass(frozen=True)
class Mode:
    name: str
    rounds: int
    measure_s: float
    samples: int


FULL = Mode("full", 30, 20.0, 20)
QUICK = Mode("quick", 10, 4.0, 10)


def shapes() -> list[tuple[str, int, int, int]]:
    """(what, M, K, N) of every distinct product with a constant 2-D weight in the bench's
    bert and gpt samples, plus the packed Q/K/V product over three hidden-size weights."""
    from aoed import samples

    seen: dict[tuple[int, int, int], list[str]] = {}
    for name in ("bert", "gpt"):
        model = samples.build(name)
        consts = {t.name: t.dims for t in model.graph.initializer}
        hidden = next(d[0] for n in model.graph.node if n.op_type == "MatMul" and len(d := consts.get(n.input[1], ())) == 2)
        for n in model.graph.node:
            dims = consts.get(n.input[1]) if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 else None
            if dims is not None and len(dims) == 2:
                seen.setdefault((128, int(dims[0]), int(dims[1])), []).append(name)
        seen.setdefault((128, hidden, 3 * hidden), []).append(f"{name} packed Q/K/V")
    return [(", ".join(sorted(set(w))), m, k, n) for (m, k, n), w in sorted(seen.items())]


def _model(kind: str, m: int, k: int, n: int, rng: np.random.Generator) -> bytes:
    from aoed.backends.ort.quant import pack_int4

    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    inits = []
    if kind == "fp32":
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        inits = [numpy_helper.from_array(w, "w")]
    elif kind == "int8":
        scale = np.float32(np.abs(w).max() / 127)
        node = helper.make_node("DynamicQuantizeMatMul", ["x", "wq", "ws"], ["y"], domain="com.microsoft")
        inits = [numpy_helper.from_array(np.round(w / scale).astype(np.int8), "wq"),
                 numpy_helper.from_array(np.array(scale, np.float32), "ws")]  # fmt: skip
    else:
        packed, scales = pack_int4(w)
        node = helper.make_node("MatMulNBits", ["x", "wq", "ws"], ["y"], domain="com.microsoft",
                                K=k, N=n, bits=4, block_size=32, accuracy_level=4)  # fmt: skip
        inits = [numpy_helper.from_array(packed, "wq"), numpy_helper.from_array(scales, "ws")]
    g = helper.make_graph([node], kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], inits)  # fmt: skip
    ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(g, opset_imports=ops).SerializeToString()


def measure_shape(m: int, k: int, n: int, mode: Mode, log: Log, work: Path) -> dict[str, measure.Latency]:
    rng = np.random.default_rng(m * 7 + k * 13 + n)
    sessions = {}
    for kind in VARIANTS:
        path = work / f"{kind}_{m}x{k}x{n}.onnx"
        path.write_bytes(_model(kind, m, k, n, rng))
        sessions[kind] = measure.quiet_session(path, tuned=False)
    x = rng.standard_normal((m, k)).astype(np.float32)
    return side_by_side(sessions, {"x": x}, mode, log)


def _flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    words = set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())
    return ", ".join(f"{f} {'yes' if f in words else 'no'}" for f in FLAGS)


def section(rows: list[tuple[str, int, int, int, dict[str, measure.Latency]]], mode: Mode, host: Machine,
            command: str, started: float, elapsed_s: float) -> str:  # fmt: skip
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    lines = [
        TITLE, "",
        f"Machine: {host.describe(*PACKAGES)}. CPU flags: {_flags()}.", "",
        (f"`{command}` ({mode.name} mode) on {when}, {elapsed_s / 60:.1f} min. Each row is one product "
         f"shape of the bench's bert and gpt samples (M x K times K x N), each variant a model of that "
         f"product alone, timed side by side over up to {mode.rounds} interleaved rounds, spinning off. "
         "A cell is the variant's time over fp32's: the median of per-round ratios and its 95% interval, "
         "below 1.00x is faster than float. Random inputs and weights."),
        "",
        "| product | M x K x N | fp32 median | int8 (DynamicQuantizeMatMul) / fp32 | int4 (MatMulNBits, int8 compute) / fp32 |",
        "|---|---|--:|--:|--:|",
    ]  # fmt: skip
    for what, m, k, n, lat in rows:
        ref = lat.get("fp32")
        cells = []
        for kind in ("int8", "int4"):
            r = measure.ratio(lat.get(kind), ref)  # variant / fp32 per round
            cells.append("n/a" if r is None else r.text())
        fp = "n/a" if ref is None else f"{ref.median_ms * 1e3:.0f} us"
        lines.append(f"| {what} | {m} x {k} x {n} | {fp} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args(argv)
    mode = QUICK if args.quick else FULL
    log, host, started = Log(), Machine(), time.time()
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="aoe-bench-kernels-") as tmp:
        for what, m, k, n in shapes():
            log(f"{what}: {m} x {k} x {n}")
            rows.append((what, m, k, n, measure_shape(m, k, n, mode, log, Path(tmp))))
    host.finish()
    command = "python bench/bench_kernels.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    text = section(rows, mode, host, command, started, time.perf_counter() - log.t0)
    print(text)
    if not args.no_write:
        from bench_bank import write_section

        write_section(text, args.out, BEGIN, END)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())

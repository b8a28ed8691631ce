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

and, for the 3x3 convolutions of each stage of the `resnet` sample (ResNet-18 at 224x224),
fp32 `Conv` against the same Conv between QuantizeLinear/DequantizeLinear pairs (uint8
activations, int8 weights per channel), which onnxruntime runs as one QLinearConv: what
`quantize_static` writes, and what aoe's int8 conv strategies and regions build on.

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
TITLE = "## Kernels: int8 and int4 products and convolutions against float on this machine"
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


#: (what, channels, height = width) of the resnet sample's 3x3 stage convolutions
CONVS = (("resnet stage 1 conv3x3", 64, 56), ("resnet stage 2 conv3x3", 128, 28),
         ("resnet stage 3 conv3x3", 256, 14), ("resnet stage 4 conv3x3", 512, 7))  # fmt: skip


def _conv_model(kind: str, c: int, hw: int, rng: np.random.Generator) -> bytes:
    w = (rng.standard_normal((c, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    if kind == "fp32":
        nodes = [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)]
        inits = [numpy_helper.from_array(w, "w")]
    else:
        ws = (np.abs(w).reshape(c, -1).max(axis=1) / 127).astype(np.float32)
        wq = np.round(w / ws[:, None, None, None]).astype(np.int8)
        nodes = [
            helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
            helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
            helper.make_node("Conv", ["xd", "wd"], ["yf"], **attrs),
            helper.make_node("QuantizeLinear", ["yf", "ys", "xz"], ["yq"]),
            helper.make_node("DequantizeLinear", ["yq", "ys", "xz"], ["y"]),
        ]
        inits = [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"),
                 numpy_helper.from_array(np.zeros(c, np.int8), "wz"),
                 numpy_helper.from_array(np.array(8.0 / 255, np.float32), "xs"),
                 numpy_helper.from_array(np.array(128, np.uint8), "xz"),
                 numpy_helper.from_array(np.array(16.0 / 255, np.float32), "ys")]  # fmt: skip
    shape = [1, c, hw, hw]
    g = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)  # fmt: skip
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def measure_conv(c: int, hw: int, mode: Mode, log: Log, work: Path) -> dict[str, measure.Latency]:
    rng = np.random.default_rng(c * 31 + hw)
    sessions = {}
    for kind in ("fp32", "int8"):
        path = work / f"conv_{kind}_{c}x{hw}.onnx"
        path.write_bytes(_conv_model(kind, c, hw, rng))
        sessions[kind] = measure.quiet_session(path, tuned=False)
    x = rng.standard_normal((1, c, hw, hw)).astype(np.float32)
    return side_by_side(sessions, {"x": x}, mode, log)


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


def section(rows: list[tuple[str, int, int, int, dict[str, measure.Latency]]],
            convs: list[tuple[str, int, int, dict[str, measure.Latency]]], mode: Mode, host: Machine,
            command: str, started: float, elapsed_s: float) -> str:  # fmt: skip
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    lines = [
        TITLE, "",
        f"Machine: {host.describe(*PACKAGES)}. CPU flags: {_flags()}.", "",
        (f"`{command}` ({mode.name} mode) on {when}, {elapsed_s / 60:.1f} min. Each row is one product "
         f"shape of the bench's bert and gpt samples (M x K times K x N), each variant a model of that "
         f"product alone, timed side by side over up to {mode.rounds} interleaved rounds, spinning off. "
         "A cell is the variant's time over fp32's: the median of per-round ratios and its 95% interval, "
         "below 1.00x is faster than float. Random inputs and weights. A lone int8 convolution also pays "
         "its quantize, dequantize and the two NHWC transposes onnxruntime puts around QLinearConv; in an "
         "int8 region those are paid once per region, not per convolution."),
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
    lines += ["", "| convolution | input, 3x3 kernel | fp32 median | int8 (QDQ, run as QLinearConv) / fp32 |",
              "|---|---|--:|--:|"]  # fmt: skip
    for what, c, hw, lat in convs:
        ref = lat.get("fp32")
        r = measure.ratio(lat.get("int8"), ref)
        fp = "n/a" if ref is None else f"{ref.median_ms * 1e3:.0f} us"
        lines.append(f"| {what} | {c} x {hw} x {hw}, {c} out | {fp} | {'n/a' if r is None else r.text()} |")
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
        convs = []
        for what, c, hw in CONVS:
            log(f"{what}: {c} x {hw} x {hw}")
            convs.append((what, c, hw, measure_conv(c, hw, mode, log, Path(tmp))))
    host.finish()
    command = "python bench/bench_kernels.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    text = section(rows, convs, mode, host, command, started, time.perf_counter() - log.t0)
    print(text)
    if not args.no_write:
        from bench_bank import write_section

        write_section(text, args.out, BEGIN, END)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())

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
`quantize_static` writes, and what aoe's int8 conv strategies and regions build on;
and two float operators aoe's subgraph strategies rewrite: erf GELU with its bias
(BiasGelu) against FastGelu's tanh form (`tanh_gelu`), and a residual Add before
LayerNormalization, which onnxruntime's default session fuses into SkipLayerNormalization,
against the same residual as Sum, which it leaves apart (`residual_as_sum`); and a pre-norm
residual whose sum is read on, Add + LayerNormalization against the SkipLayerNormalization
that would return that sum as its 4th output (a form aoe does not write; this row says why).

Each variant runs as a user deploys a model (bench/deployed.py): in a process of its own
holding one session with onnxruntime's defaults (intra-op spinning on), the processes
taking turns in paired rounds while this process holds the device lock; a cell is the
variant's time over fp32's, the median of per-round ratios with its 95% interval.
Inputs and weights are random (the kernels' speed does not depend on the values).
Writes the section between `<!-- kernels:begin -->` and `<!-- kernels:end -->`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import deployed
import measure
from bench_bank import publish
from machine import Machine
from run import Log, as_deployed

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- kernels:begin -->", "<!-- kernels:end -->"
TITLE = "## Kernels: int8 and int4 products and convolutions against float, and the float operators aoe rewrites"
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
        hidden = next(
            d[0]
            for n in model.graph.node
            if n.op_type == "MatMul" and len(d := consts.get(n.input[1], ())) == 2
        )
        for n in model.graph.node:
            dims = (
                consts.get(n.input[1])
                if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1
                else None
            )
            if dims is not None and len(dims) == 2:
                seen.setdefault((128, int(dims[0]), int(dims[1])), []).append(name)
        seen.setdefault((128, hidden, 3 * hidden), []).append(f"{name} packed Q/K/V")
    return [(", ".join(sorted(set(w))), m, k, n) for (m, k, n), w in sorted(seen.items())]


#: (what, channels, height = width) of the resnet sample's 3x3 stage convolutions
CONVS = (
    ("resnet stage 1 conv3x3", 64, 56),
    ("resnet stage 2 conv3x3", 128, 28),
    ("resnet stage 3 conv3x3", 256, 14),
    ("resnet stage 4 conv3x3", 512, 7),
)


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
        inits = [
            numpy_helper.from_array(wq, "wq"),
            numpy_helper.from_array(ws, "ws"),
            numpy_helper.from_array(np.zeros(c, np.int8), "wz"),
            numpy_helper.from_array(np.array(8.0 / 255, np.float32), "xs"),
            numpy_helper.from_array(np.array(128, np.uint8), "xz"),
            numpy_helper.from_array(np.array(16.0 / 255, np.float32), "ys"),
        ]
    shape = [1, c, hw, hw]
    g = helper.make_graph(
        nodes,
        kind,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _product_model(kind: str, m: int, k: int, n: int, rng: np.random.Generator) -> bytes:
    from aoed.backends.ort.quant import pack_int4

    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    inits = []
    if kind == "fp32":
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        inits = [numpy_helper.from_array(w, "w")]
    elif kind == "int8":
        scale = np.float32(np.abs(w).max() / 127)
        node = helper.make_node(
            "DynamicQuantizeMatMul", ["x", "wq", "ws"], ["y"], domain="com.microsoft"
        )
        inits = [
            numpy_helper.from_array(np.round(w / scale).astype(np.int8), "wq"),
            numpy_helper.from_array(np.array(scale, np.float32), "ws"),
        ]
    else:
        packed, scales = pack_int4(w)
        node = helper.make_node(
            "MatMulNBits",
            ["x", "wq", "ws"],
            ["y"],
            domain="com.microsoft",
            K=k,
            N=n,
            bits=4,
            block_size=32,
            accuracy_level=4,
        )
        inits = [numpy_helper.from_array(packed, "wq"), numpy_helper.from_array(scales, "ws")]
    g = helper.make_graph(
        [node],
        kind,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        inits,
    )
    ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(g, opset_imports=ops).SerializeToString()


def timed(
    models: dict[str, bytes],
    feed: dict[str, np.ndarray],
    mode: Mode,
    log: Log,
    work: Path,
    stem: str,
) -> dict[str, measure.Latency]:
    """Each of `models` (variant -> serialized model) in a process of its own, timed side
    by side on `feed`; the reference variant is named fp32. RuntimeError names a variant
    that could not be timed."""
    paths = {}
    for kind, data in models.items():
        paths[kind] = work / f"{stem}_{kind}.onnx"
        paths[kind].write_bytes(data)
    got, errors = as_deployed({k: deployed.Model(p) for k, p in paths.items()}, feed, mode, log)
    if errors:
        raise RuntimeError("; ".join(f"{k}: {why}" for k, why in errors.items()))
    return got


def _operator(key: str) -> tuple[dict[str, bytes], dict[str, np.ndarray]]:
    """The two forms of one operator comparison as models, and a feed: fp32 is what the
    model (or onnxruntime's default session) runs, alt the rewritten form: what aoe's
    strategy writes, or for "prenorm" the fused form it does not write."""
    rng = np.random.default_rng(11)
    outputs = ["y"]
    if key == "gelu":
        shape, inputs = [1, 128, 1024], ["x"]
        inits = [numpy_helper.from_array(rng.standard_normal(1024).astype(np.float32), "b")]
        nodes = {
            k: [helper.make_node(op, ["x", "b"], ["y"], domain="com.microsoft")]
            for k, op in (("fp32", "BiasGelu"), ("alt", "FastGelu"))
        }
    else:
        shape, inputs = [1, 128, 256], ["x", "s"]
        inits = [
            numpy_helper.from_array(np.ones(256, np.float32), "g"),
            numpy_helper.from_array(np.zeros(256, np.float32), "b"),
        ]
        add_ln = [
            helper.make_node("Add", ["x", "s"], ["a"]),
            helper.make_node("LayerNormalization", ["a", "g", "b"], ["y"], axis=-1),
        ]
        if key == "layernorm":
            nodes = {"fp32": add_ln, "alt": [helper.make_node("Sum", ["x", "s"], ["a"]), add_ln[1]]}
        else:  # pre-norm: the sum is an output too, so the default session leaves Add + LayerNormalization apart
            outputs = ["y", "a"]
            nodes = {
                "fp32": add_ln,
                "alt": [
                    helper.make_node(
                        "SkipLayerNormalization",
                        ["x", "s", "g", "b"],
                        ["y", "", "", "a"],
                        domain="com.microsoft",
                    )
                ],
            }
    ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    models = {}
    for kind, graph_nodes in nodes.items():
        g = helper.make_graph(
            graph_nodes,
            kind,
            [helper.make_tensor_value_info(i, TensorProto.FLOAT, shape) for i in inputs],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, shape) for o in outputs],
            inits,
        )
        models[kind] = helper.make_model(g, opset_imports=ops).SerializeToString()
    return models, {i: rng.standard_normal(shape).astype(np.float32) for i in inputs}


#: (key, what is compared, input shape) of the operator rows
OPERATORS = (
    ("gelu", "erf GELU with bias: BiasGelu; tanh_gelu writes FastGelu", "1 x 128 x 1024"),
    (
        "layernorm",
        "residual + LayerNorm: Add, which the default session fuses into SkipLayerNormalization; "
        "residual_as_sum writes Sum, which it leaves apart",
        "1 x 128 x 256, twice",
    ),
    (
        "prenorm",
        "pre-norm residual + LayerNorm, the sum read on too: Add + LayerNormalization; "
        "SkipLayerNormalization with the sum as its 4th output (not built: why GPT's pre-norm "
        "LayerNorms stay unmatched)",
        "1 x 128 x 256, twice",
    ),
)


def _flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    words = set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())
    return ", ".join(f"{f} {'yes' if f in words else 'no'}" for f in FLAGS)


def section(
    rows: list[tuple[str, int, int, int, dict[str, measure.Latency]]],
    convs: list[tuple[str, int, int, dict[str, measure.Latency]]],
    operators: list[tuple[str, str, dict[str, measure.Latency]]],
    mode: Mode,
    host: Machine,
    command: str,
    started: float,
    elapsed_s: float,
) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    lines = [
        TITLE,
        "",
        f"Machine: {host.describe(*PACKAGES)}. CPU flags: {_flags()}.",
        "",
        (
            f"`{command}` ({mode.name} mode) on {when}, {elapsed_s / 60:.1f} min. Each row is one product "
            f"shape of the bench's bert and gpt samples (M x K times K x N), each variant a model of that "
            f"product alone, timed side by side over up to {mode.rounds} paired rounds, one session per process "
            "(onnxruntime's defaults, spinning on), as a model is deployed. "
            "A cell is the variant's time over fp32's: the median of per-round ratios and its 95% interval, "
            "below 1.00x is faster than float. Random inputs and weights. A lone int8 convolution also pays "
            "its quantize, dequantize and the two NHWC transposes onnxruntime puts around QLinearConv; in an "
            "int8 region those are paid once per region, not per convolution."
        ),
        "",
        "| product | M x K x N | fp32 median | int8 (DynamicQuantizeMatMul) / fp32 | int4 (MatMulNBits, int8 compute) / fp32 |",
        "|---|---|--:|--:|--:|",
    ]
    for what, m, k, n, lat in rows:
        ref = lat.get("fp32")
        cells = []
        for kind in ("int8", "int4"):
            r = measure.ratio(lat.get(kind), ref)  # variant / fp32 per round
            cells.append("n/a" if r is None else r.text())
        fp = "n/a" if ref is None else f"{ref.median_ms * 1e3:.0f} us"
        lines.append(f"| {what} | {m} x {k} x {n} | {fp} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        "| convolution | input, 3x3 kernel | fp32 median | int8 (QDQ, run as QLinearConv) / fp32 |",
        "|---|---|--:|--:|",
    ]
    for what, c, hw, lat in convs:
        ref = lat.get("fp32")
        r = measure.ratio(lat.get("int8"), ref)
        fp = "n/a" if ref is None else f"{ref.median_ms * 1e3:.0f} us"
        lines.append(
            f"| {what} | {c} x {hw} x {hw}, {c} out | {fp} | {'n/a' if r is None else r.text()} |"
        )
    lines += [
        "",
        "Float operators aoe rewrites (and one fused form it does not write), the model's (or the "
        "default session's) form against the rewritten one, each session at onnxruntime's default "
        "optimization level:",
        "",
        "| operator | input | model's form, median | rewritten form / model's form |",
        "|---|---|--:|--:|",
    ]
    for what, shape, lat in operators:
        ref = lat.get("fp32")
        r = measure.ratio(lat.get("alt"), ref)
        fp = "n/a" if ref is None else f"{ref.median_ms * 1e3:.1f} us"
        lines.append(f"| {what} | {shape} | {fp} | {'n/a' if r is None else r.text()} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args(argv)
    mode = QUICK if args.quick else FULL
    log, host, started = Log(), Machine(), time.time()
    rows, convs, operators = [], [], []
    with tempfile.TemporaryDirectory(prefix="aoe-bench-kernels-") as tmp:
        work = Path(tmp)
        for what, m, k, n in shapes():
            log(f"{what}: {m} x {k} x {n}")
            rng = np.random.default_rng(m * 7 + k * 13 + n)
            models = {kind: _product_model(kind, m, k, n, rng) for kind in VARIANTS}
            x = rng.standard_normal((m, k)).astype(np.float32)
            rows.append((what, m, k, n, timed(models, {"x": x}, mode, log, work, f"mm{m}x{k}x{n}")))
        for what, c, hw in CONVS:
            log(f"{what}: {c} x {hw} x {hw}")
            rng = np.random.default_rng(c * 31 + hw)
            models = {kind: _conv_model(kind, c, hw, rng) for kind in ("fp32", "int8")}
            x = rng.standard_normal((1, c, hw, hw)).astype(np.float32)
            convs.append((what, c, hw, timed(models, {"x": x}, mode, log, work, f"conv{c}x{hw}")))
        for key, what, shape in OPERATORS:
            log(what)
            models, feed = _operator(key)
            operators.append((what, shape, timed(models, feed, mode, log, work, key)))
    host.finish()
    command = "python bench/bench_kernels.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    text = section(
        rows, convs, operators, mode, host, command, started, time.perf_counter() - log.t0
    )
    publish(text, args.out, BEGIN, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())

"""Small, deterministic ONNX sample models built in code.

Every model here is produced with ``onnx.helper`` and numpy alone, from a fixed
random seed, so building the same sample twice yields byte-identical
protobufs. The samples cover the shapes of graph the tuner meets in practice:

* ``mlp``: MatMul + Add + Relu layers (optionally with a dynamic batch).
* ``cnn``: a small residual CNN with BatchNormalization and a 1x1 conv.
* ``transformer``: one encoder block (attention, LayerNormalization, an
  Erf-decomposed Gelu FFN).
* ``legacy_mlp``: an opset 9 / IR 3 model that lists its initializers among
  the graph inputs, as older exporters did.
* ``legacy_cnn``: an opset 11 / IR 6 conv net whose first conv weight is
  computed by nodes, so constant folding has something to do.
* ``outlier_mlp``: an MLP whose activations defeat per-tensor int8 quantization.

Larger, realistic models for benchmarks:

* ``resnet``: a ResNet-18-style CNN (basic blocks, BN, 1x1 downsample convs) at
  224x224.
* ``bert``: a BERT-style post-norm encoder over int64 token ids, sequence 128.
* ``gpt``: a GPT-style pre-norm decoder block stack with a constant causal mask.
* ``encoder``: a small BERT-style encoder with dynamic ``batch`` and ``seq`` axes, as
  exporters write it: positions by Range over the input's shape into a position table
  of ``max_positions`` rows, Reshape targets that copy dimensions (0) and infer one (-1).

One more needs torch (the ``gdat`` extra), since it is exported the way users export a
decoder: ``kv_decoder`` (`kv_decoder()`), one decode step of a GPT-style decoder with a KV
cache, by torch.onnx's exporter with the past length dynamic.

Usage from the command line::

    python -m aoed.samples mlp cnn -o models/
    python -m aoed.samples --list
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "SAMPLES",
    "bert",
    "build",
    "cnn",
    "encoder",
    "gpt",
    "legacy_cnn",
    "legacy_mlp",
    "main",
    "mlp",
    "outlier_mlp",
    "resnet",
    "save",
    "transformer",
]

DEFAULT_OPSET = 17
DEFAULT_IR_VERSION = 8
PRODUCER = "aoed.samples"


class _GraphBuilder:
    """Collects nodes and initializers, keeping node and tensor names unique."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._node_names: set[str] = set()
        self._tensor_names: set[str] = set()

    def _claim_tensor(self, name: str) -> str:
        if name in self._tensor_names:
            raise ValueError(f"duplicate tensor name {name!r}")
        self._tensor_names.add(name)
        return name

    def claim_input(self, name: str) -> str:
        return self._claim_tensor(name)

    def const(self, name: str, array: np.ndarray) -> str:
        """Adds an initializer and returns its name."""
        self._claim_tensor(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def scalar(self, name: str, value: float) -> str:
        return self.const(name, np.array(value, dtype=np.float32))

    def shape(self, name: str, dims: Sequence[int]) -> str:
        return self.const(name, np.array(list(dims), dtype=np.int64))

    def normal(self, name: str, shape: Sequence[int], std: float) -> str:
        data = self.rng.standard_normal(tuple(shape)).astype(np.float32) * np.float32(std)
        return self.const(name, data.astype(np.float32))

    def uniform(self, name: str, shape: Sequence[int], low: float, high: float) -> str:
        data = self.rng.uniform(low, high, size=tuple(shape)).astype(np.float32)
        return self.const(name, data)

    def node(
        self,
        op_type: str,
        inputs: Sequence[str],
        name: str,
        output: str | None = None,
        **attrs: Any,
    ) -> str:
        """Adds a single-output node and returns the name of its output."""
        if name in self._node_names:
            raise ValueError(f"duplicate node name {name!r}")
        self._node_names.add(name)
        out = self._claim_tensor(output if output is not None else f"{name}_out")
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name, **attrs))
        return out

    def model(
        self,
        graph_name: str,
        inputs: Sequence[onnx.ValueInfoProto],
        outputs: Sequence[onnx.ValueInfoProto],
        *,
        doc: str,
        opset: int = DEFAULT_OPSET,
        ir_version: int = DEFAULT_IR_VERSION,
        initializers_as_inputs: bool = False,
    ) -> onnx.ModelProto:
        graph_inputs = list(inputs)
        if initializers_as_inputs:
            graph_inputs += [
                helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                for t in self.initializers
            ]
        graph = helper.make_graph(
            self.nodes,
            graph_name,
            graph_inputs,
            list(outputs),
            initializer=self.initializers,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset)],
            producer_name=PRODUCER,
            doc_string=doc,
        )
        model.ir_version = ir_version
        return model


def _positive(**values: int) -> None:
    for key, value in values.items():
        if int(value) != value or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")


def _batch_norm(
    g: _GraphBuilder, x: str, prefix: str, channels: int, gamma: tuple[float, float] = (0.8, 1.2)
) -> str:
    """Inference-mode BatchNormalization with plausible running statistics."""
    scale = g.uniform(f"{prefix}.weight", [channels], *gamma)
    bias = g.normal(f"{prefix}.bias", [channels], 0.05)
    mean = g.normal(f"{prefix}.running_mean", [channels], 0.05)
    var = g.uniform(f"{prefix}.running_var", [channels], 0.8, 1.2)
    return g.node("BatchNormalization", [x, scale, bias, mean, var], prefix, epsilon=1e-5)


def _conv(
    g: _GraphBuilder,
    x: str,
    name: str,
    c_in: int,
    c_out: int,
    kernel: int,
    *,
    stride: int = 1,
    bias: bool = False,
) -> str:
    """Conv with He-initialised weights and 'same' padding for odd kernels."""
    std = math.sqrt(2.0 / (c_in * kernel * kernel))
    w = g.normal(f"{name}.weight", [c_out, c_in, kernel, kernel], std)
    inputs = [x, w]
    if bias:
        inputs.append(g.normal(f"{name}.bias", [c_out], 0.01))
    pad = kernel // 2
    return g.node(
        "Conv",
        inputs,
        name,
        kernel_shape=[kernel, kernel],
        strides=[stride, stride],
        pads=[pad, pad, pad, pad],
    )


def mlp(
    batch: int = 1,
    features: int = 256,
    hidden: int = 512,
    classes: int = 16,
    layers: int = 3,
    dynamic_batch: bool = False,
) -> onnx.ModelProto:
    """A multi-layer perceptron: ``layers`` x (MatMul + Add [+ Relu]).

    Input ``input`` is float32 [batch, features] (the batch dimension is the
    symbolic ``batch`` when ``dynamic_batch``); output ``logits`` is
    [batch, classes]. The last layer has no Relu.
    """
    _positive(batch=batch, features=features, hidden=hidden, classes=classes, layers=layers)
    g = _GraphBuilder(seed=1001)
    x = g.claim_input("input")
    widths = [features] + [hidden] * (layers - 1) + [classes]
    for i in range(layers):
        prefix = f"fc{i + 1}"
        last = i == layers - 1
        fan_in, fan_out = widths[i], widths[i + 1]
        std = math.sqrt((1.0 if last else 2.0) / fan_in)
        w = g.normal(f"{prefix}.weight", [fan_in, fan_out], std)
        b = g.normal(f"{prefix}.bias", [fan_out], 0.01)
        x = g.node("MatMul", [x, w], f"{prefix}/MatMul")
        x = g.node("Add", [x, b], f"{prefix}/Add", output="logits" if last else None)
        if not last:
            x = g.node("Relu", [x], f"{prefix}/Relu")
    batch_dim: int | str = "batch" if dynamic_batch else batch
    return g.model(
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch_dim, features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch_dim, classes])],
        doc=f"MLP {features}->{hidden}x{layers - 1}->{classes}",
    )


def cnn(batch: int = 1, size: int = 32, width: int = 32, blocks: int = 2) -> onnx.ModelProto:
    """A small residual CNN classifying 3-channel images into 10 classes.

    Stem Conv3x3-BN-Relu, ``blocks`` residual blocks (Conv3x3-BN-Relu-Conv3x3-BN
    + skip Add + Relu), a 1x1 transition conv doubling the width, then
    GlobalAveragePool, Flatten and Gemm. Input ``image`` is float32
    [batch, 3, size, size]; output ``logits`` is [batch, 10].
    """
    _positive(batch=batch, size=size, width=width, blocks=blocks)
    classes = 10
    g = _GraphBuilder(seed=2002)
    x = g.claim_input("image")

    x = _conv(g, x, "stem/conv", 3, width, 3)
    x = _batch_norm(g, x, "stem/bn", width)
    x = g.node("Relu", [x], "stem/relu")

    for i in range(blocks):
        p = f"block{i + 1}"
        skip = x
        y = _conv(g, x, f"{p}/conv1", width, width, 3)
        y = _batch_norm(g, y, f"{p}/bn1", width)
        y = g.node("Relu", [y], f"{p}/relu1")
        y = _conv(g, y, f"{p}/conv2", width, width, 3)
        y = _batch_norm(g, y, f"{p}/bn2", width, gamma=(0.3, 0.6))
        y = g.node("Add", [y, skip], f"{p}/add")
        x = g.node("Relu", [y], f"{p}/relu2")

    x = _conv(g, x, "transition/conv", width, 2 * width, 1)
    x = _batch_norm(g, x, "transition/bn", 2 * width)
    x = g.node("Relu", [x], "transition/relu")

    x = g.node("GlobalAveragePool", [x], "head/pool")
    x = g.node("Flatten", [x], "head/flatten", axis=1)
    w = g.normal("head/fc.weight", [classes, 2 * width], math.sqrt(1.0 / (2 * width)))
    b = g.normal("head/fc.bias", [classes], 0.01)
    g.node("Gemm", [x, w, b], "head/fc", output="logits", transB=1)

    return g.model(
        "cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])],
        doc=f"residual CNN, width {width}, {blocks} blocks, {size}x{size} input",
    )


def _linear(g: _GraphBuilder, x: str, prefix: str, fan_in: int, fan_out: int) -> str:
    w = g.normal(f"{prefix}.weight", [fan_in, fan_out], math.sqrt(1.0 / fan_in))
    b = g.normal(f"{prefix}.bias", [fan_out], 0.01)
    x = g.node("MatMul", [x, w], f"{prefix}/MatMul")
    return g.node("Add", [x, b], f"{prefix}/Add")


def _layer_norm(g: _GraphBuilder, x: str, prefix: str, hidden: int, output: str | None) -> str:
    scale = g.uniform(f"{prefix}.weight", [hidden], 0.9, 1.1)
    bias = g.normal(f"{prefix}.bias", [hidden], 0.02)
    return g.node(
        "LayerNormalization",
        [x, scale, bias],
        f"{prefix}/LayerNormalization",
        output=output,
        axis=-1,
        epsilon=1e-5,
    )


def transformer(
    batch: int = 1, seq: int = 32, hidden: int = 64, heads: int = 4, ffn: int = 256
) -> onnx.ModelProto:
    """One post-norm transformer encoder block.

    Multi-head self-attention (Q/K/V MatMul + Add, scaled dot product,
    Softmax), output projection, residual Add and LayerNormalization, then an
    FFN with Gelu written out as ``x * 0.5 * (1 + Erf(x / sqrt(2)))``, another
    residual Add and LayerNormalization. Input ``hidden_states`` and output
    ``output`` are float32 [batch, seq, hidden].
    """
    _positive(batch=batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn)
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    head_dim = hidden // heads
    g = _GraphBuilder(seed=3003)
    x = g.claim_input("hidden_states")

    split_shape = g.shape("attn/split_heads_shape", [batch, seq, heads, head_dim])
    merge_shape = g.shape("attn/merge_heads_shape", [batch, seq, hidden])

    def heads_of(name: str, perm: list[int]) -> str:
        y = _linear(g, x, f"attn/{name}", hidden, hidden)
        y = g.node("Reshape", [y, split_shape], f"attn/{name}/Reshape")
        return g.node("Transpose", [y], f"attn/{name}/Transpose", perm=perm)

    q = heads_of("q", [0, 2, 1, 3])  # [batch, heads, seq, head_dim]
    k_t = heads_of("k", [0, 2, 3, 1])  # [batch, heads, head_dim, seq]
    v = heads_of("v", [0, 2, 1, 3])  # [batch, heads, seq, head_dim]

    scores = g.node("MatMul", [q, k_t], "attn/scores/MatMul")
    scale = g.scalar("attn/scale", 1.0 / math.sqrt(head_dim))
    scores = g.node("Mul", [scores, scale], "attn/scores/Mul")
    probs = g.node("Softmax", [scores], "attn/Softmax", axis=-1)
    ctx = g.node("MatMul", [probs, v], "attn/context/MatMul")
    ctx = g.node("Transpose", [ctx], "attn/context/Transpose", perm=[0, 2, 1, 3])
    ctx = g.node("Reshape", [ctx, merge_shape], "attn/context/Reshape")
    attn = _linear(g, ctx, "attn/out", hidden, hidden)

    h = g.node("Add", [attn, x], "attn/residual/Add")
    h = _layer_norm(g, h, "attn/norm", hidden, None)

    f = _linear(g, h, "ffn/fc1", hidden, ffn)
    sqrt2 = g.scalar("ffn/gelu/sqrt2", math.sqrt(2.0))
    one = g.scalar("ffn/gelu/one", 1.0)
    half = g.scalar("ffn/gelu/half", 0.5)
    e = g.node("Div", [f, sqrt2], "ffn/gelu/Div")
    e = g.node("Erf", [e], "ffn/gelu/Erf")
    e = g.node("Add", [e, one], "ffn/gelu/Add")
    e = g.node("Mul", [f, e], "ffn/gelu/Mul")
    f = g.node("Mul", [e, half], "ffn/gelu/Mul_half")
    f = _linear(g, f, "ffn/fc2", ffn, hidden)

    y = g.node("Add", [f, h], "ffn/residual/Add")
    _layer_norm(g, y, "ffn/norm", hidden, "output")

    shape = [batch, seq, hidden]
    return g.model(
        "transformer",
        [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)],
        doc=f"encoder block, hidden {hidden}, {heads} heads, ffn {ffn}, seq {seq}",
    )


def legacy_mlp() -> onnx.ModelProto:
    """An MLP as an older exporter wrote it: opset 9, IR version 3.

    Gemm (transB=1) + Relu layers, with every initializer also listed in
    ``graph.input``. Input ``input`` is float32 [1, 128]; output ``logits`` is
    [1, 10].
    """
    batch, features, hidden, classes = 1, 128, 256, 10
    g = _GraphBuilder(seed=4004)
    x = g.claim_input("input")
    widths = [features, hidden, hidden, classes]
    for i in range(len(widths) - 1):
        prefix = f"fc{i + 1}"
        last = i == len(widths) - 2
        fan_in, fan_out = widths[i], widths[i + 1]
        std = math.sqrt((1.0 if last else 2.0) / fan_in)
        w = g.normal(f"{prefix}.weight", [fan_out, fan_in], std)
        b = g.normal(f"{prefix}.bias", [fan_out], 0.01)
        x = g.node("Gemm", [x, w, b], f"{prefix}/Gemm", output="logits" if last else None, transB=1)
        if not last:
            x = g.node("Relu", [x], f"{prefix}/Relu")
    return g.model(
        "legacy_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])],
        doc="MLP in the style of an older exporter (opset 9, initializers as inputs)",
        opset=9,
        ir_version=3,
        initializers_as_inputs=True,
    )


def legacy_cnn() -> onnx.ModelProto:
    """A conv net at opset 11 / IR version 6 that needs constant folding.

    The first Conv's weight is not an initializer: it is a Constant node's
    flat tensor, Reshaped and scaled per output channel by Mul; its bias comes
    from ConstantOfShape plus an initializer. Then BatchNormalization, Relu,
    a strided conv, GlobalAveragePool, Flatten and Gemm. Input ``image`` is
    float32 [1, 3, 32, 32]; output ``logits`` is [1, 10].
    """
    batch, size, c1, c2, classes = 1, 32, 16, 32, 10
    g = _GraphBuilder(seed=5005)
    x = g.claim_input("image")

    # conv1 weight = Reshape(Constant(flat), shape) * per-channel scale
    fan_in = 3 * 3 * 3
    flat = g.rng.standard_normal(c1 * fan_in).astype(np.float32)
    flat *= np.float32(math.sqrt(2.0 / fan_in))
    raw = g.node(
        "Constant",
        [],
        "conv1/weight/Constant",
        value=numpy_helper.from_array(flat.astype(np.float32), "conv1/weight/Constant_value"),
    )
    w_shape = g.shape("conv1/weight/shape", [c1, 3, 3, 3])
    w = g.node("Reshape", [raw, w_shape], "conv1/weight/Reshape")
    w_scale = g.uniform("conv1/weight/scale", [c1, 1, 1, 1], 0.8, 1.2)
    w = g.node("Mul", [w, w_scale], "conv1/weight/Mul")

    # conv1 bias = ConstantOfShape([c1], 0.01) + initializer
    b_shape = g.shape("conv1/bias/shape", [c1])
    b = g.node(
        "ConstantOfShape",
        [b_shape],
        "conv1/bias/ConstantOfShape",
        value=numpy_helper.from_array(np.array([0.01], dtype=np.float32), "value"),
    )
    b_delta = g.normal("conv1/bias/delta", [c1], 0.01)
    b = g.node("Add", [b, b_delta], "conv1/bias/Add")

    x = g.node("Conv", [x, w, b], "conv1", kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    x = _batch_norm(g, x, "bn1", c1)
    x = g.node("Relu", [x], "relu1")
    x = _conv(g, x, "conv2", c1, c2, 3, stride=2, bias=True)
    x = g.node("Relu", [x], "relu2")
    x = g.node("GlobalAveragePool", [x], "pool")
    x = g.node("Flatten", [x], "flatten", axis=1)
    fc_w = g.normal("fc.weight", [classes, c2], math.sqrt(1.0 / c2))
    fc_b = g.normal("fc.bias", [classes], 0.01)
    g.node("Gemm", [x, fc_w, fc_b], "fc", output="logits", transB=1)

    return g.model(
        "legacy_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])],
        doc="conv net with a computed conv weight (opset 11)",
        opset=11,
        ir_version=6,
    )


def outlier_mlp(
    features: int = 128, hidden: int = 512, classes: int = 16, outliers: int = 4
) -> onnx.ModelProto:
    """An MLP built to collapse under per-tensor int8 quantization of its activations.

    A few hidden channels carry values about 1e4 times larger than the rest, and the
    next layer weighs them down by the same factor, so in fp32 they barely matter. A
    quantizer that spreads 256 levels over the whole range rounds every ordinary channel
    to zero, and the output loses what carried it. Layer 1 itself quantizes fine.
    """
    _positive(features=features, hidden=hidden, classes=classes, outliers=outliers)
    g = _GraphBuilder(seed=1006)
    x = g.claim_input("input")
    w1 = g.rng.standard_normal((features, hidden)).astype(np.float32) * math.sqrt(2.0 / features)
    w1[:, :outliers] *= 1e4
    w2 = g.rng.standard_normal((hidden, classes)).astype(np.float32) * math.sqrt(1.0 / hidden)
    w2[:outliers, :] *= 1e-4
    x = g.node("MatMul", [x, g.const("fc1.weight", w1)], "fc1/MatMul")
    x = g.node("Add", [x, g.normal("fc1.bias", [hidden], 0.01)], "fc1/Add")
    x = g.node("Relu", [x], "fc1/Relu")
    x = g.node("MatMul", [x, g.const("fc2.weight", w2)], "fc2/MatMul")
    x = g.node("Add", [x, g.normal("fc2.bias", [classes], 0.01)], "fc2/Add", output="logits")
    return g.model(
        "outlier_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])],
        doc="MLP whose hidden activations have a few channels 1e4 times larger than the rest",
    )


def _basic_block(g: _GraphBuilder, x: str, prefix: str, c_in: int, c_out: int, stride: int) -> str:
    """ResNet basic block: 3x3-BN-Relu-3x3-BN + (identity or 1x1 stride-s conv + BN), Relu."""
    y = _conv(g, x, f"{prefix}/conv1", c_in, c_out, 3, stride=stride)
    y = _batch_norm(g, y, f"{prefix}/bn1", c_out)
    y = g.node("Relu", [y], f"{prefix}/relu1")
    y = _conv(g, y, f"{prefix}/conv2", c_out, c_out, 3)
    # A small last-BN gamma keeps the residual stream from growing block after block.
    y = _batch_norm(g, y, f"{prefix}/bn2", c_out, gamma=(0.2, 0.4))
    skip = x
    if stride != 1 or c_in != c_out:
        skip = _conv(g, x, f"{prefix}/downsample/conv", c_in, c_out, 1, stride=stride)
        skip = _batch_norm(g, skip, f"{prefix}/downsample/bn", c_out)
    y = g.node("Add", [y, skip], f"{prefix}/add")
    return g.node("Relu", [y], f"{prefix}/relu2")


def resnet(
    batch: int = 1,
    size: int = 224,
    width: int = 64,
    stages: Sequence[int] = (2, 2, 2, 2),
    classes: int = 1000,
) -> onnx.ModelProto:
    """A ResNet-18-style image classifier (basic blocks) at ``size`` x ``size``.

    Stem Conv7x7/2-BN-Relu and MaxPool3x3/2, then four stages of ``stages[i]`` basic
    blocks with widths ``width * (1, 2, 4, 8)``; the first block of stages 2-4 halves
    the resolution and projects its skip with a 1x1 stride-2 conv + BN. Head:
    GlobalAveragePool, Flatten, Gemm. The defaults are ResNet-18's own layout (about
    1.8 GFLOPs at 224x224).
    Input ``image`` is float32 [batch, 3, size, size]; output ``logits`` is
    [batch, classes].
    """
    _positive(batch=batch, size=size, width=width, classes=classes, stages=len(stages))
    g = _GraphBuilder(seed=6006)
    x = g.claim_input("image")
    x = _conv(g, x, "stem/conv", 3, width, 7, stride=2)
    x = _batch_norm(g, x, "stem/bn", width)
    x = g.node("Relu", [x], "stem/relu")
    x = g.node(
        "MaxPool", [x], "stem/maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]
    )
    c_in = width
    for s, blocks in enumerate(stages):
        _positive(blocks=blocks)
        c_out = width * 2**s
        for b in range(blocks):
            stride = 2 if s > 0 and b == 0 else 1
            x = _basic_block(g, x, f"layer{s + 1}/block{b + 1}", c_in, c_out, stride)
            c_in = c_out
    x = g.node("GlobalAveragePool", [x], "head/pool")
    x = g.node("Flatten", [x], "head/flatten", axis=1)
    w = g.normal("head/fc.weight", [classes, c_in], math.sqrt(1.0 / c_in))
    b = g.normal("head/fc.bias", [classes], 0.01)
    g.node("Gemm", [x, w, b], "head/fc", output="logits", transB=1)
    return g.model(
        "resnet",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])],
        doc=f"ResNet-style CNN, width {width}, stages {list(stages)}, {size}x{size} input",
    )


def _token_embedding(
    g: _GraphBuilder, ids: str, prefix: str, vocab: int, seq: int, hidden: int
) -> str:
    """Gather over a token table plus a learned position table for positions 0..seq-1."""
    table = g.normal(f"{prefix}/word_embeddings.weight", [vocab, hidden], 0.5)
    x = g.node("Gather", [table, ids], f"{prefix}/word_embeddings/Gather", axis=0)
    pos = g.normal(f"{prefix}/position_embeddings.weight", [1, seq, hidden], 0.2)
    return g.node("Add", [x, pos], f"{prefix}/position_embeddings/Add")


def _gelu_erf(g: _GraphBuilder, x: str, prefix: str) -> str:
    """Exact Gelu as exporters write it: ``x * 0.5 * (1 + Erf(x / sqrt(2)))``."""
    sqrt2 = g.scalar(f"{prefix}/sqrt2", math.sqrt(2.0))
    one = g.scalar(f"{prefix}/one", 1.0)
    half = g.scalar(f"{prefix}/half", 0.5)
    e = g.node("Div", [x, sqrt2], f"{prefix}/Div")
    e = g.node("Erf", [e], f"{prefix}/Erf")
    e = g.node("Add", [e, one], f"{prefix}/Add")
    e = g.node("Mul", [x, e], f"{prefix}/Mul")
    return g.node("Mul", [e, half], f"{prefix}/Mul_half")


def _self_attention(
    g: _GraphBuilder,
    x: str,
    prefix: str,
    *,
    batch: int,
    seq: int,
    hidden: int,
    heads: int,
    mask: str | None = None,
    out_std: float | None = None,
) -> str:
    """Multi-head self-attention; ``mask`` is an additive [1, 1, seq, seq] constant."""
    head_dim = hidden // heads
    split = g.shape(f"{prefix}/split_heads_shape", [batch, seq, heads, head_dim])
    merge = g.shape(f"{prefix}/merge_heads_shape", [batch, seq, hidden])

    def heads_of(name: str, perm: list[int]) -> str:
        y = _linear(g, x, f"{prefix}/{name}", hidden, hidden)
        y = g.node("Reshape", [y, split], f"{prefix}/{name}/Reshape")
        return g.node("Transpose", [y], f"{prefix}/{name}/Transpose", perm=perm)

    q = heads_of("q", [0, 2, 1, 3])
    k_t = heads_of("k", [0, 2, 3, 1])
    v = heads_of("v", [0, 2, 1, 3])
    scores = g.node("MatMul", [q, k_t], f"{prefix}/scores/MatMul")
    scale = g.scalar(f"{prefix}/scale", 1.0 / math.sqrt(head_dim))
    scores = g.node("Mul", [scores, scale], f"{prefix}/scores/Mul")
    if mask is not None:
        scores = g.node("Add", [scores, mask], f"{prefix}/scores/mask/Add")
    probs = g.node("Softmax", [scores], f"{prefix}/Softmax", axis=-1)
    ctx = g.node("MatMul", [probs, v], f"{prefix}/context/MatMul")
    ctx = g.node("Transpose", [ctx], f"{prefix}/context/Transpose", perm=[0, 2, 1, 3])
    ctx = g.node("Reshape", [ctx, merge], f"{prefix}/context/Reshape")
    if out_std is None:
        return _linear(g, ctx, f"{prefix}/out", hidden, hidden)
    w = g.normal(f"{prefix}/out.weight", [hidden, hidden], out_std)
    b = g.normal(f"{prefix}/out.bias", [hidden], 0.01)
    y = g.node("MatMul", [ctx, w], f"{prefix}/out/MatMul")
    return g.node("Add", [y, b], f"{prefix}/out/Add")


def _check_text_model(
    batch: int, seq: int, hidden: int, heads: int, ffn: int, layers: int, vocab: int
) -> None:
    _positive(batch=batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn, layers=layers, vocab=vocab)
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")


def bert(
    batch: int = 1,
    seq: int = 128,
    hidden: int = 256,
    heads: int = 4,
    ffn: int = 1024,
    layers: int = 4,
    vocab: int = 8192,
) -> onnx.ModelProto:
    """A BERT-style post-norm encoder over token ids.

    Token Gather + position embedding + LayerNormalization, then ``layers`` encoder
    layers (self-attention, residual Add, LayerNormalization, FFN with Erf Gelu,
    residual Add, LayerNormalization). Input ``input_ids`` is int64 [batch, seq]
    (values below ``vocab``); output ``last_hidden_state`` is float32
    [batch, seq, hidden].
    """
    _check_text_model(batch, seq, hidden, heads, ffn, layers, vocab)
    g = _GraphBuilder(seed=7007)
    ids = g.claim_input("input_ids")
    x = _token_embedding(g, ids, "embeddings", vocab, seq, hidden)
    x = _layer_norm(g, x, "embeddings/norm", hidden, None)
    for i in range(layers):
        p = f"layer{i}"
        last = i == layers - 1
        a = _self_attention(g, x, f"{p}/attn", batch=batch, seq=seq, hidden=hidden, heads=heads)
        h = g.node("Add", [a, x], f"{p}/attn/residual/Add")
        h = _layer_norm(g, h, f"{p}/attn/norm", hidden, None)
        f = _linear(g, h, f"{p}/ffn/fc1", hidden, ffn)
        f = _gelu_erf(g, f, f"{p}/ffn/gelu")
        f = _linear(g, f, f"{p}/ffn/fc2", ffn, hidden)
        y = g.node("Add", [f, h], f"{p}/ffn/residual/Add")
        x = _layer_norm(g, y, f"{p}/ffn/norm", hidden, "last_hidden_state" if last else None)
    shape = [batch, seq, hidden]
    return g.model(
        "bert",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, shape)],
        doc=f"BERT-style encoder, {layers} layers, hidden {hidden}, {heads} heads, "
        f"ffn {ffn}, seq {seq}",
    )


def gpt(
    batch: int = 1,
    seq: int = 128,
    hidden: int = 256,
    heads: int = 4,
    ffn: int = 1024,
    layers: int = 4,
    vocab: int = 8192,
) -> onnx.ModelProto:
    """A GPT-style pre-norm decoder block stack with a causal mask.

    Token Gather + position embedding, then ``layers`` blocks of
    ``x + attn(LN(x))`` and ``x + mlp(LN(x))`` (Erf Gelu); the causal mask is a
    constant additive [1, 1, seq, seq] tensor (0 on and below the diagonal, -1e4
    above), and residual projections are scaled by 1/sqrt(2 * layers) as GPT-2 does.
    A final LayerNormalization gives output ``hidden_states``, float32
    [batch, seq, hidden], from input ``input_ids``, int64 [batch, seq].
    """
    _check_text_model(batch, seq, hidden, heads, ffn, layers, vocab)
    g = _GraphBuilder(seed=8008)
    ids = g.claim_input("input_ids")
    x = _token_embedding(g, ids, "wte", vocab, seq, hidden)
    causal = np.triu(np.full((seq, seq), -1e4, dtype=np.float32), k=1)[None, None]
    mask = g.const("attn/causal_mask", causal)
    proj_scale = 1.0 / math.sqrt(2 * layers)
    for i in range(layers):
        p = f"h{i}"
        a = _layer_norm(g, x, f"{p}/ln_1", hidden, None)
        a = _self_attention(
            g,
            a,
            f"{p}/attn",
            batch=batch,
            seq=seq,
            hidden=hidden,
            heads=heads,
            mask=mask,
            out_std=proj_scale * math.sqrt(1.0 / hidden),
        )
        x = g.node("Add", [x, a], f"{p}/attn/residual/Add")
        m = _layer_norm(g, x, f"{p}/ln_2", hidden, None)
        m = _linear(g, m, f"{p}/mlp/fc", hidden, ffn)
        m = _gelu_erf(g, m, f"{p}/mlp/gelu")
        w = g.normal(f"{p}/mlp/proj.weight", [ffn, hidden], proj_scale * math.sqrt(1.0 / ffn))
        b = g.normal(f"{p}/mlp/proj.bias", [hidden], 0.01)
        m = g.node("MatMul", [m, w], f"{p}/mlp/proj/MatMul")
        m = g.node("Add", [m, b], f"{p}/mlp/proj/Add")
        x = g.node("Add", [x, m], f"{p}/mlp/residual/Add")
    _layer_norm(g, x, "ln_f", hidden, "hidden_states")
    return g.model(
        "gpt",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [batch, seq, hidden])],
        doc=f"GPT-style decoder stack, {layers} blocks, hidden {hidden}, {heads} heads, seq {seq}",
    )


def _int_scalar(g: _GraphBuilder, name: str, value: int) -> str:
    """An int64 scalar initializer (`const` keeps arrays at least 1-D)."""
    g.initializers.append(numpy_helper.from_array(np.array(value, np.int64), g.claim_input(name)))
    return name


def encoder(
    hidden: int = 64,
    heads: int = 4,
    ffn: int = 128,
    layers: int = 2,
    vocab: int = 256,
    max_positions: int = 64,
) -> onnx.ModelProto:
    """A BERT-style post-norm encoder with dynamic ``batch`` and ``seq`` axes.

    Input ``input_ids`` is int64 [batch, seq] (values below ``vocab``, seq at most
    ``max_positions``); output ``last_hidden_state`` is float32 [batch, seq, hidden].
    Position ids are ``Range(0, seq)`` over the input's shape, gathered from a
    [max_positions, hidden] table; the attention's Reshapes copy the batch and sequence
    dimensions (0) from their input, so one graph serves every shape.
    """
    _check_text_model(1, max_positions, hidden, heads, ffn, layers, vocab)
    g = _GraphBuilder(seed=9009)
    ids = g.claim_input("input_ids")
    table = g.normal("embeddings/word_embeddings.weight", [vocab, hidden], 0.5)
    x = g.node("Gather", [table, ids], "embeddings/word_embeddings/Gather", axis=0)
    shape = g.node("Shape", [ids], "embeddings/Shape")
    one = _int_scalar(g, "embeddings/one_i", 1)
    seq_len = g.node("Gather", [shape, one], "embeddings/seq/Gather", axis=0)
    axes0 = g.const("embeddings/axes0", np.array([0], np.int64))
    zero = _int_scalar(g, "embeddings/zero_i", 0)
    step = _int_scalar(g, "embeddings/step_i", 1)
    positions = g.node("Range", [zero, seq_len, step], "embeddings/positions/Range")
    # [1, seq] position ids, as exporters write them (a bare Range feeding the Gather
    # is rewritten by onnxruntime into a Slice that refuses the scalar bounds)
    positions = g.node("Unsqueeze", [positions, axes0], "embeddings/positions/Unsqueeze")
    pos_table = g.normal("embeddings/position_embeddings.weight", [max_positions, hidden], 0.2)
    pos = g.node("Gather", [pos_table, positions], "embeddings/position_embeddings/Gather", axis=0)
    x = g.node("Add", [x, pos], "embeddings/position_embeddings/Add")
    x = _layer_norm(g, x, "embeddings/norm", hidden, None)
    head_dim = hidden // heads
    for i in range(layers):
        p = f"layer{i}"
        last = i == layers - 1
        split = g.shape(f"{p}/attn/split_heads_shape", [0, 0, heads, head_dim])
        merge = g.shape(f"{p}/attn/merge_heads_shape", [0, 0, hidden])

        def heads_of(name: str, perm: list[int], x: str = x, p: str = p, split: str = split) -> str:
            y = _linear(g, x, f"{p}/attn/{name}", hidden, hidden)
            y = g.node("Reshape", [y, split], f"{p}/attn/{name}/Reshape")
            return g.node("Transpose", [y], f"{p}/attn/{name}/Transpose", perm=perm)

        q = heads_of("q", [0, 2, 1, 3])
        k_t = heads_of("k", [0, 2, 3, 1])
        v = heads_of("v", [0, 2, 1, 3])
        scores = g.node("MatMul", [q, k_t], f"{p}/attn/scores/MatMul")
        scale = g.scalar(f"{p}/attn/scale", 1.0 / math.sqrt(head_dim))
        scores = g.node("Mul", [scores, scale], f"{p}/attn/scores/Mul")
        probs = g.node("Softmax", [scores], f"{p}/attn/Softmax", axis=-1)
        c = g.node("MatMul", [probs, v], f"{p}/attn/context/MatMul")
        c = g.node("Transpose", [c], f"{p}/attn/context/Transpose", perm=[0, 2, 1, 3])
        c = g.node("Reshape", [c, merge], f"{p}/attn/context/Reshape")
        a = _linear(g, c, f"{p}/attn/out", hidden, hidden)
        h = g.node("Add", [a, x], f"{p}/attn/residual/Add")
        h = _layer_norm(g, h, f"{p}/attn/norm", hidden, None)
        f = _linear(g, h, f"{p}/ffn/fc1", hidden, ffn)
        f = _gelu_erf(g, f, f"{p}/ffn/gelu")
        f = _linear(g, f, f"{p}/ffn/fc2", ffn, hidden)
        y = g.node("Add", [f, h], f"{p}/ffn/residual/Add")
        x = _layer_norm(g, y, f"{p}/ffn/norm", hidden, "last_hidden_state" if last else None)
    return g.model(
        "encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [
            helper.make_tensor_value_info(
                "last_hidden_state", TensorProto.FLOAT, ["batch", "seq", hidden]
            )
        ],
        doc=f"BERT-style encoder with dynamic batch and seq, {layers} layers, hidden {hidden}, "
        f"{heads} heads, ffn {ffn}, {max_positions} positions",
    )


def kv_decoder(
    hidden: int = 128,
    heads: int = 4,
    layers: int = 2,
    vocab: int = 1000,
    max_positions: int = 256,
) -> onnx.ModelProto:
    """One decode step of a pre-norm GPT-style decoder with a KV cache, as a generation
    loop runs it: ``input_ids`` int64 [1, 1] and, per layer L, ``past_key_L`` and
    ``past_value_L`` float [1, heads, past, hidden/heads] in; ``logits`` [1, 1, vocab]
    and ``present_key_L``/``present_value_L`` (the past with this step's keys and values
    appended) out. The position is ``past``, looked up in a table of ``max_positions``
    rows. Exported by torch.onnx's exporter (dynamo) with ``past`` dynamic, up to
    ``max_positions - 2``. Random weights from a fixed seed; needs torch."""
    import tempfile
    import warnings

    import torch
    from torch import nn

    _check_text_model(1, max_positions, hidden, heads, 4 * hidden, layers, vocab)
    head_dim = hidden // heads

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x: Any, past_k: Any, past_v: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, heads, head_dim).transpose(1, 2) for z in (q, k, v))
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(head_dim), dim=-1) @ v
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(nn.functional.gelu(self.up(self.ln2(x)))), k, v

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, hidden)
            self.positions = nn.Embedding(max_positions, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

        def forward(self, input_ids: Any, *past: Any) -> Any:
            start = past[0].shape[2]
            pos = torch.arange(start, start + input_ids.shape[1]).unsqueeze(0)
            x = self.tokens(input_ids) + self.positions(pos)
            present = []
            for i, block in enumerate(self.blocks):
                x, k, v = block(x, past[2 * i], past[2 * i + 1])
                present += [k, v]
            return (self.head(self.ln(x)), *present)

    torch.manual_seed(4242)
    names = [f"{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    past = tuple(torch.randn(1, heads, 8, head_dim) for _ in names)
    length = torch.export.Dim("past", max=max_positions - 2)
    with warnings.catch_warnings():  # torch's deprecations inside its own exporter
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            Decoder().eval(),
            (torch.tensor([[1]]), *past),
            dynamo=True,
            dynamic_shapes=(None, tuple({2: length} for _ in names)),
            input_names=["input_ids", *(f"past_{n}" for n in names)],
            output_names=["logits", *(f"present_{n}" for n in names)],
            verbose=False,
        )
        with tempfile.TemporaryDirectory() as tmp:
            program.save(f"{tmp}/kv_decoder.onnx")
            model = onnx.load(f"{tmp}/kv_decoder.onnx")
    model.doc_string = (
        f"GPT-style decoder step with a KV cache, {layers} layers, hidden {hidden}, {heads} "
        f"heads, vocab {vocab}, positions {max_positions}; random weights (seed 4242)"
    )
    return model


SAMPLES: dict[str, Callable[..., onnx.ModelProto]] = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
    "legacy_mlp": legacy_mlp,
    "legacy_cnn": legacy_cnn,
    "outlier_mlp": outlier_mlp,
    "resnet": resnet,
    "bert": bert,
    "gpt": gpt,
    "encoder": encoder,
}


def _unknown(name: str) -> str:
    return f"unknown sample {name!r} (choose from: {', '.join(SAMPLES)})"


def build(name: str, **kw: Any) -> onnx.ModelProto:
    """Builds the sample called ``name``, passing ``kw`` to its builder."""
    try:
        builder = SAMPLES[name]
    except KeyError:
        raise ValueError(_unknown(name)) from None
    return builder(**kw)


def save(model: onnx.ModelProto, path: str | Path) -> Path:
    """Writes ``model`` to ``path`` (creating parent folders) and returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aoed.samples",
        description="Write deterministic sample ONNX models to DIR/NAME.onnx.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="samples to write")
    parser.add_argument(
        "-o", "--output-dir", default=".", metavar="DIR", help="output folder (default: .)"
    )
    parser.add_argument("--list", action="store_true", help="print the sample names and exit")
    args = parser.parse_args(argv)

    if args.list:
        for name in SAMPLES:
            print(name)
        return 0
    if not args.names:
        print(
            f"{parser.prog}: error: no sample named (choose from: {', '.join(SAMPLES)})",
            file=sys.stderr,
        )
        return 2
    for name in args.names:
        if name not in SAMPLES:
            print(f"{parser.prog}: error: {_unknown(name)}", file=sys.stderr)
            return 2
    out_dir = Path(args.output_dir)
    for name in args.names:
        print(save(build(name), out_dir / f"{name}.onnx"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

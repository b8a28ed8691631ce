"""A classifier with trained weights and real data: scikit-learn's handwritten digits.

    python bench/digits.py -o DIR

Every other bench model has random weights and synthetic inputs; this one shows the int8
calibration path on real inputs. The data are the 1797 8x8 digit images that scikit-learn
ships inside its package (`sklearn.datasets.load_digits`, no download). A fixed share is
held out for testing; on the rest, a 64-256-128-10 MLP is trained with numpy alone by
plain minibatch SGD for a fixed number of epochs from fixed seeds, so the same files come
out on every run on a given machine. Writes:

  DIR/digits.onnx        input `pixels` [32, 64] float32, raw intensities 0..16 (the
                         1/16 scaling used in training is folded into the first weights);
                         output `logits` [32, 10]; MatMul + Add + Relu, opset 13
  DIR/calibration/*.npz  training images, 32 per file, keyed `pixels`: the format
                         `aoe tune --calibration DIR/calibration` reads
  DIR/test.npz           the held-out images, `pixels` [N, 64] and `labels` [N], N a
                         multiple of the batch
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["BATCH", "INPUT", "Digits", "build", "held_out"]

BATCH = 32
INPUT = "pixels"
OUTPUT = "logits"
HIDDEN = (256, 128)
TEST_BATCHES = 12  # 384 held-out images
CALIBRATION_FILES = 10  # the tuner calibrates on all but the last two, judges on those
EPOCHS = 40
LEARNING_RATE = 0.05
SEED = 0
SCALE = 16.0  # the images' intensities run 0..16
OPSET = 13
IR_VERSION = 8


@dataclass(frozen=True)
class Digits:
    model: Path
    calibration: Path
    test: Path
    train_images: int
    test_images: int
    epochs: int
    numpy_test_accuracy: float  # of the trained float64 weights, before export

    @property
    def description(self) -> str:
        sizes = "-".join(str(n) for n in (64, *HIDDEN, 10))
        return (
            f"MLP {sizes} trained on scikit-learn's handwritten digits "
            f"({self.train_images} training images, {self.epochs} epochs of minibatch SGD), "
            f"batch {BATCH}"
        )


def _split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = np.asarray(data.data, dtype=np.float64)
    y = np.asarray(data.target, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = TEST_BATCHES * BATCH
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _forward(params: list[np.ndarray], x: np.ndarray) -> list[np.ndarray]:
    """Activations of every layer; the last entry is the logits."""
    acts = [x]
    for i in range(0, len(params), 2):
        z = acts[-1] @ params[i] + params[i + 1]
        acts.append(np.maximum(z, 0.0) if i + 2 < len(params) else z)
    return acts


def train(x: np.ndarray, y: np.ndarray, *, epochs: int, seed: int) -> list[np.ndarray]:
    """Weights and biases, alternating, of an MLP trained on x/SCALE by plain minibatch
    SGD on softmax cross-entropy (He-initialized from `seed`)."""
    rng = np.random.default_rng(seed + 1)
    sizes = (x.shape[1], *HIDDEN, 10)
    params: list[np.ndarray] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        params.append(rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in))
        params.append(np.zeros(fan_out))
    xs = x / SCALE
    for _ in range(epochs):
        order = rng.permutation(len(xs))
        for start in range(0, len(order), BATCH):
            idx = order[start : start + BATCH]
            acts = _forward(params, xs[idx])
            logits = acts[-1]
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(idx)), y[idx]] -= 1.0
            grad = p / len(idx)
            for i in range(len(params) - 2, -1, -2):
                gw, gb = acts[i // 2].T @ grad, grad.sum(axis=0)
                if i > 0:
                    grad = (grad @ params[i].T) * (acts[i // 2] > 0)
                params[i] -= LEARNING_RATE * gw
                params[i + 1] -= LEARNING_RATE * gb
    return params


def to_onnx(params: list[np.ndarray], doc: str) -> onnx.ModelProto:
    """MatMul + Add (+ Relu) per layer; the input scaling is folded into the first weights
    so the model takes raw intensities."""
    weights = [p.astype(np.float32) for p in params]
    weights[0] = (params[0] / SCALE).astype(np.float32)
    nodes, inits = [], []
    x = INPUT
    layers = len(weights) // 2
    for k in range(layers):
        w, b = f"fc{k + 1}.weight", f"fc{k + 1}.bias"
        inits += [numpy_helper.from_array(weights[2 * k], w)]
        inits += [numpy_helper.from_array(weights[2 * k + 1], b)]
        mm, out = f"fc{k + 1}/matmul", f"fc{k + 1}/add"
        nodes.append(helper.make_node("MatMul", [x, w], [mm], name=mm))
        last = k == layers - 1
        nodes.append(helper.make_node("Add", [mm, b], [OUTPUT if last else out], name=out))
        if not last:
            relu = f"fc{k + 1}/relu"
            nodes.append(helper.make_node("Relu", [out], [relu], name=relu))
            x = relu
    graph = helper.make_graph(
        nodes,
        "digits",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [BATCH, 64])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [BATCH, 10])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="bench/digits.py"
    )
    model.ir_version = IR_VERSION
    model.doc_string = doc
    onnx.checker.check_model(model, full_check=True)
    return model


def build(out: Path, *, epochs: int = EPOCHS, seed: int = SEED) -> Digits:
    """Trains, exports and writes the files listed in the module doc under `out`."""
    x_train, y_train, x_test, y_test = _split(seed)
    params = train(x_train, y_train, epochs=epochs, seed=seed)
    acc = float((_forward(params, x_test / SCALE)[-1].argmax(axis=1) == y_test).mean())
    out.mkdir(parents=True, exist_ok=True)
    calib = out / "calibration"
    calib.mkdir(exist_ok=True)
    for old in calib.glob("*.npz"):
        old.unlink()
    for i in range(CALIBRATION_FILES):
        batch = x_train[i * BATCH : (i + 1) * BATCH].astype(np.float32)
        np.savez(calib / f"{i:03d}.npz", **{INPUT: batch})
    test = out / "test.npz"
    np.savez(test, **{INPUT: x_test.astype(np.float32), "labels": y_test})
    info = Digits(out / "digits.onnx", calib, test, len(x_train), len(x_test), epochs, acc)
    onnx.save(to_onnx(params, info.description), str(info.model))
    return info


def held_out(test: Path) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """The held-out set as model feeds of one batch each, and their labels in order."""
    with np.load(test) as data:
        pixels, labels = data[INPUT], data["labels"]
    feeds = [{INPUT: pixels[i : i + BATCH]} for i in range(0, len(pixels), BATCH)]
    return feeds, labels


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", type=Path, required=True, help="folder to write into")
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    args = ap.parse_args(argv)
    try:
        info = build(args.out, epochs=args.epochs)
    except ImportError:
        raise SystemExit(
            "bench/digits.py: scikit-learn is missing; install the bench extra "
            "(pip install -e '.[bench]'; make bench does it)"
        ) from None
    print(
        f"{info.model}: {info.description}; numpy test accuracy "
        f"{info.numpy_test_accuracy:.1%} on {info.test_images} held-out images"
    )
    print(f"{info.calibration}: {CALIBRATION_FILES} files of {BATCH} training images")
    print(f"{info.test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

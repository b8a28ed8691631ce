"""Models exported from PyTorch for the benches (bench_sgat.py, bench_decode.py), one per
process.

    python bench/torch_models.py NAME -o DIR

Run in a child process by the benchmark, so that torch (and its threads) never share a
process with the latency measurements, and a failing export is one model's result, not
the run's end. Writes DIR/NAME.onnx and DIR/info.json (what was built, from what); exits
non-zero with the reason on stderr when the export fails.

  hf_bert, hf_bert_dynamo    transformers' BertModel, small config (4 layers, hidden 256,
                             4 heads, ffn 1024, vocab 8192), random weights, no pooler;
                             inputs `input_ids` and `attention_mask` int64 [1, 128], output
                             `last_hidden_state` [1, 128, 256]
  hf_gpt2, hf_gpt2_dynamo    transformers' GPT2Model, the same sizes, use_cache off
  hf_llama, hf_llama_dynamo  transformers' LlamaModel (RMSNorm, rotary attention, SwiGLU
                             MLP), the same sizes but an MLP of 688 (LLaMA's 8/3 of the
                             hidden size, rounded to 16), 4 key/value heads, use_cache off
  hf_llama_gqa, hf_llama_gqa_dynamo
                             the same LlamaModel with 2 key/value heads for its 4 query
                             heads (grouped-query attention, as Llama 3 and Mistral use)
  hf_vit                     transformers' ViTModel, the same sizes, 64x64 images in 8x8
                             patches (65 tokens), random weights, no pooler; input
                             `pixel_values` float32 [1, 3, 64, 64], output
                             `last_hidden_state` [1, 65, 256]
  digits_cnn                 a small conv net TRAINED here on scikit-learn's digits (the
                             split of bench/digits.py); input `pixels` float32
                             [32, 1, 8, 8] raw intensities 0..16 (the 1/16 scaling is
                             folded into the first conv), output `logits` [32, 10]; also
                             writes DIR/calibration/*.npz (training images, 32 per file, the
                             format `aoe tune --calibration` reads) and DIR/test.npz
  hf_qwen2_kv                transformers' Qwen2ForCausalLM (grouped-query attention: 8
                             query heads, 2 key/value heads; rotary positions; RMSNorm;
                             SwiGLU MLP), QWEN2 below, random weights, saved with
                             `save_pretrained` into DIR/checkpoint (what onnxruntime-genai's
                             model builder reads), and ONE decode step with a KV cache
                             exported by the dynamo exporter: inputs `input_ids` and
                             `position_ids` int64 [1, seq], `attention_mask` int64
                             [1, past + seq], `past_key_L`/`past_value_L` float32
                             [1, 2, past, 64]; outputs `logits` [1, seq, vocab] and
                             `present_key_L`/`present_value_L` [1, 2, past + seq, 64]

`*_dynamo` use `torch.onnx.export(..., dynamo=True)`, the others the TorchScript exporter
(`dynamo=False`); all ask for opset 17 and fixed shapes, except `hf_gpt2_dynamo`: asked
for 17, the dynamo exporter writes GPT-2's Split with `num_outputs`, an opset-18
attribute, and onnxruntime refuses the model, so that one asks for 18 (the exporter's
default), as `hf_qwen2_kv` does (dynamo too, with `seq` and `past` dynamic). The
transformers get
transformers' default attention implementation (sdpa), what a user exporting them gets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

OPSET = 17
#: exports that ask for another opset, and why (the module doc)
OPSET_OF = {"hf_gpt2_dynamo": 18, "hf_qwen2_kv": 18}
SEQ = 128
VOCAB = 8192
HIDDEN = 256
HEADS = 4
LAYERS = 4
FFN = 1024
LLAMA_FFN = 688
GQA_KV_HEADS = 2
SEED = 0

CNN_EPOCHS = 30
CNN_LR = 1e-3
CNN_CALIBRATION_FILES = 10  # as bench/digits.py: aoe calibrates on half, judges on half

TEXT = (
    "hf_bert",
    "hf_bert_dynamo",
    "hf_gpt2",
    "hf_gpt2_dynamo",
    "hf_llama",
    "hf_llama_dynamo",
    "hf_llama_gqa",
    "hf_llama_gqa_dynamo",
)
NAMES = (*TEXT, "hf_vit", "digits_cnn", "hf_qwen2_kv")
#: hf_qwen2_kv's config: Qwen2-0.5B's shape of attention (head 64, 4 query heads per
#: key/value head) at a bench's size
QWEN2 = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
#: hf_vit: image side and patch; 64 / 8 = 8 x 8 = 64 patches and a class token
VIT_IMAGE = 64
VIT_PATCH = 8


def _export(
    module,
    args: tuple,
    path: Path,
    inputs: list[str],
    outputs: list[str],
    dynamo: bool,
    opset: int = OPSET,
):
    import torch

    kw = {"dynamo": dynamo, "opset_version": opset, "input_names": inputs, "output_names": outputs}
    if dynamo:
        kw["external_data"] = False  # one file, as the TorchScript exporter writes
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")  # tracer warnings about Python control flow
        torch.onnx.export(module, args, str(path), **kw)


def text_model(name: str, out: Path) -> dict:
    import torch
    import transformers

    torch.manual_seed(SEED)
    if name.startswith("hf_bert"):
        cfg = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=FFN,
            max_position_embeddings=512,
        )
        model = transformers.BertModel(cfg, add_pooling_layer=False)
        arch = "transformers BertModel (no pooler)"
        ffn = FFN
    elif name.startswith("hf_llama"):
        kv = GQA_KV_HEADS if name.startswith("hf_llama_gqa") else HEADS
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=kv,
            intermediate_size=LLAMA_FFN,
            max_position_embeddings=512,
            use_cache=False,
        )
        model = transformers.LlamaModel(cfg)
        arch = "transformers LlamaModel" + (
            f" with {kv} key/value heads (grouped-query)" if kv != HEADS else ""
        )
        ffn = LLAMA_FFN
    else:
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_inner=FFN,
            n_positions=512,
            use_cache=False,
        )
        model = transformers.GPT2Model(cfg)
        arch = "transformers GPT2Model"
        ffn = FFN
    model.eval()

    class LastHidden(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
            return out.last_hidden_state

    dynamo = name.endswith("_dynamo")
    ids = torch.randint(0, VOCAB, (1, SEQ), dtype=torch.int64)
    mask = torch.ones(1, SEQ, dtype=torch.int64)
    path = out / f"{name}.onnx"
    with torch.no_grad():
        _export(
            LastHidden(model),
            (ids, mask),
            path,
            ["input_ids", "attention_mask"],
            ["last_hidden_state"],
            dynamo,
            OPSET_OF.get(name, OPSET),
        )
    exporter = "dynamo" if dynamo else "TorchScript"
    attn = getattr(model.config, "_attn_implementation", None) or "default"
    return {
        "model": str(path),
        "description": (
            f"{arch}, {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, ffn {ffn}, vocab {VOCAB}, "
            f"seq {SEQ}, {attn} attention; torch.onnx {exporter} exporter, opset {OPSET_OF.get(name, OPSET)}; "
            f"torch {torch.__version__}, transformers {transformers.__version__}"
        ),
        "weights": "random",
        # LLaMA: onnxruntime's own llama/convert_to_onnx.py optimizes with model_type gpt2
        "model_type": "bert" if name.startswith("hf_bert") else "gpt2",
        "num_heads": HEADS,
        "hidden_size": HIDDEN,
        "vocab": VOCAB,
    }


def digits_cnn(out: Path) -> dict:
    import torch

    import digits

    torch.manual_seed(SEED)
    x_train, y_train, x_test, y_test = digits._split(SEED)
    batch = digits.BATCH

    def images(x: np.ndarray) -> np.ndarray:
        return x.reshape(-1, 1, 8, 8).astype(np.float32)

    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 4 * 4, 10),
    )
    xt = torch.from_numpy(images(x_train) / digits.SCALE)
    yt = torch.from_numpy(y_train)
    opt = torch.optim.Adam(net.parameters(), lr=CNN_LR)
    gen = torch.Generator().manual_seed(SEED)
    net.train()
    for _ in range(CNN_EPOCHS):
        order = torch.randperm(len(xt), generator=gen)
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        pred = net(torch.from_numpy(images(x_test) / digits.SCALE)).argmax(dim=1).numpy()
        acc = float((pred == y_test).mean())
        net[0].weight /= digits.SCALE  # the model takes raw intensities 0..16
    path = out / "digits_cnn.onnx"
    with torch.no_grad():
        sample = torch.from_numpy(images(x_train[:batch]))
        _export(net, (sample,), path, [digits.INPUT], ["logits"], dynamo=False)
    calib = out / "calibration"
    calib.mkdir(exist_ok=True)
    for old in calib.glob("*.npz"):
        old.unlink()
    for i in range(CNN_CALIBRATION_FILES):
        np.savez(
            calib / f"{i:03d}.npz", **{digits.INPUT: images(x_train[i * batch : (i + 1) * batch])}
        )
    test = out / "test.npz"
    np.savez(test, **{digits.INPUT: images(x_test), "labels": y_test})
    return {
        "model": str(path),
        "description": (
            f"conv net Conv3x3(32)-Relu-Conv3x3(64)-Relu-MaxPool2-Linear(10) trained with torch "
            f"on scikit-learn's handwritten digits ({len(x_train)} training images, {CNN_EPOCHS} "
            f"epochs of Adam), batch {batch}; torch.onnx TorchScript exporter, opset {OPSET}; "
            f"torch {torch.__version__}"
        ),
        "weights": "trained",
        "calibration": str(calib),
        "calibration_files": CNN_CALIBRATION_FILES,
        "test": str(test),
        "test_images": len(x_test),
        "train_images": len(x_train),
        "torch_test_accuracy": acc,
    }


def vit_model(out: Path) -> dict:
    """transformers' ViTModel, the text models' sizes, images of VIT_IMAGE pixels square."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    cfg = transformers.ViTConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        image_size=VIT_IMAGE,
        patch_size=VIT_PATCH,
    )
    model = transformers.ViTModel(cfg, add_pooling_layer=False).eval()

    class LastHidden(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            return self.inner(pixel_values=pixel_values, return_dict=True).last_hidden_state

    path = out / "hf_vit.onnx"
    with torch.no_grad():
        _export(
            LastHidden(model),
            (torch.randn(1, 3, VIT_IMAGE, VIT_IMAGE),),
            path,
            ["pixel_values"],
            ["last_hidden_state"],
            False,
        )
    attn = getattr(model.config, "_attn_implementation", None) or "default"
    tokens = (VIT_IMAGE // VIT_PATCH) ** 2 + 1
    return {
        "model": str(path),
        "description": (
            f"transformers ViTModel (no pooler), {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, "
            f"ffn {FFN}, {VIT_IMAGE}x{VIT_IMAGE} images in {VIT_PATCH}x{VIT_PATCH} patches ({tokens} "
            f"tokens), {attn} attention; torch.onnx TorchScript exporter, opset {OPSET}; torch "
            f"{torch.__version__}, transformers {transformers.__version__}"
        ),
        "weights": "random",
        "model_type": "vit",
        "num_heads": HEADS,
        "hidden_size": HIDDEN,
        "vocab": 0,
    }


def qwen2_decoder(out: Path) -> dict:
    """hf_qwen2_kv: the checkpoint and its decode step (the module doc)."""
    import onnxruntime as ort
    import torch
    import transformers
    from transformers import DynamicCache

    torch.manual_seed(SEED)
    cfg = transformers.Qwen2Config(
        **QWEN2, tie_word_embeddings=False, torch_dtype="float32", use_cache=True
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    ckpt = out / "checkpoint"
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the info alone
        model.save_pretrained(ckpt)
    layers = QWEN2["num_hidden_layers"]
    kv_heads = QWEN2["num_key_value_heads"]
    head = QWEN2["hidden_size"] // QWEN2["num_attention_heads"]

    class Step(torch.nn.Module):
        """Flat past tensors in, flat presents out: transformers keeps its cache in a
        Cache object, which no exporter takes as an input."""

        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(
                ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(layers)],
                config=self.inner.config,
            )
            got = self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            present = []
            for layer in got.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (got.logits, *present)

    names = [f"{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    past_len, seq_len = 8, 3  # past 0 or 1, or one token, would be specialised
    past = tuple(torch.randn(1, kv_heads, past_len, head) for _ in names)
    ids = torch.randint(0, QWEN2["vocab_size"], (1, seq_len))
    mask = torch.ones(1, past_len + seq_len, dtype=torch.int64)
    pos = torch.arange(past_len, past_len + seq_len).unsqueeze(0)
    top = QWEN2["max_position_embeddings"]
    seq, length = torch.export.Dim("seq", max=top), torch.export.Dim("past", max=top - 1)
    # torch.export cannot say that the mask is past + seq long (a dim is never the sum of
    # two others): it gets a dim of its own, renamed below
    total = torch.export.Dim("total", max=2 * top)
    step = Step(model).eval()
    path = out / "hf_qwen2_kv.onnx"
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        reference = [t.numpy() for t in step(ids, mask, pos, *past)]
        program = torch.onnx.export(
            step,
            (ids, mask, pos, *past),
            dynamo=True,
            dynamic_shapes=({1: seq}, {1: total}, {1: seq}, tuple({2: length} for _ in names)),
            input_names=["input_ids", "attention_mask", "position_ids"]
            + [f"past_{n}" for n in names],
            output_names=["logits", *(f"present_{n}" for n in names)],
            opset_version=OPSET_OF["hf_qwen2_kv"],
        )
        program.save(str(path), external_data=False)
    import onnx

    onnx_model = onnx.load(str(path))
    # The mask's length by the name the exporter gives the presents' (and Optimum's
    # exports give the mask): `aoe tune` derives it as the sum of the two at each point.
    for vi in onnx_model.graph.input:
        if vi.name == "attention_mask":
            vi.type.tensor_type.shape.dim[1].dim_param = "past + seq"
    onnx.save(onnx_model, str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": pos.numpy()}
    feed.update({f"past_{n}": t.numpy() for n, t in zip(names, past, strict=True)})
    got = sess.run(None, feed)
    drift = max(float(np.max(np.abs(a - b))) for a, b in zip(reference, got, strict=True))
    return {
        "model": str(path),
        "checkpoint": str(ckpt),
        "description": (
            f"transformers Qwen2ForCausalLM, {layers} layers, hidden {QWEN2['hidden_size']}, "
            f"{QWEN2['num_attention_heads']} query heads and {kv_heads} key/value heads of "
            f"{head}, MLP {QWEN2['intermediate_size']}, vocab {QWEN2['vocab_size']}, "
            f"positions {top}, {model.config._attn_implementation} attention; one decode step "
            f"with a KV cache (seq and past dynamic), torch.onnx dynamo exporter, opset 18; "
            f"torch {torch.__version__}, transformers {transformers.__version__}"
        ),
        "weights": "random",
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head,
        "vocab": QWEN2["vocab_size"],
        "max_positions": top,
        "export_max_abs_error": drift,
    }


def build(name: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if name == "hf_qwen2_kv":
        info = qwen2_decoder(out)
    elif name == "digits_cnn":
        info = digits_cnn(out)
    elif name == "hf_vit":
        info = vit_model(out)
    else:
        info = text_model(name, out)
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=NAMES)
    ap.add_argument("-o", "--out", type=Path, required=True, help="folder to write into")
    args = ap.parse_args(argv)
    try:
        info = build(args.name, args.out)
    except ImportError as exc:
        print(
            f"bench/torch_models.py: {exc.name} is missing; install the bench extra "
            "(pip install -e '.[bench]'; make bench does it)",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())

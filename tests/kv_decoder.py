"""A small KV-cache decoder as generation loops run it, exported the way users export one:
torch.onnx's exporter (dynamo) with the past length dynamic.

    path = export_decoder(folder / "dec.onnx")
    tokens, logits = greedy(session, steps=32)

One decode step: `input_ids` [1, 1] and, per layer, `past_key_L`/`past_value_L`
[1, heads, past, head_dim] -> `logits` [1, 1, vocab] and `present_key_L`/
`present_value_L` [1, heads, past + 1, head_dim] (the past with this step's keys and
values appended); positions come from a table of MAX_POSITIONS, indexed at `past`.
Random weights (seeded): a **synthetic** model.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = ["HEADS", "HEAD_DIM", "LAYERS", "MAX_POSITIONS", "VOCAB", "export_decoder", "greedy"]

VOCAB, HIDDEN, HEADS, LAYERS, MAX_POSITIONS = 1000, 128, 4, 2, 256
HEAD_DIM = HIDDEN // HEADS


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x, past_k, past_v):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for z in (q, k, v))
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM), dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x)))), k, v


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = (
            nn.Embedding(VOCAB, HIDDEN),
            nn.Embedding(MAX_POSITIONS, HIDDEN),
        )
        self.blocks = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, past_key_0, past_value_0, past_key_1, past_value_1):
        past = (past_key_0, past_value_0, past_key_1, past_value_1)  # LAYERS of them
        start = past[0].shape[2]
        pos = torch.arange(start, start + input_ids.shape[1]).unsqueeze(0)
        x = self.tokens(input_ids) + self.positions(pos)
        present = []
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, past[2 * i], past[2 * i + 1])
            present += [k, v]
        return (self.head(self.ln(x)), *present)


def _names(prefix: str) -> list[str]:
    return [f"{prefix}_{kind}_{i}" for i in range(LAYERS) for kind in ("key", "value")]


def export_decoder(path: Path) -> Path:
    torch.manual_seed(0)
    model = _Decoder().eval()
    past = [torch.randn(1, HEADS, 8, HEAD_DIM) for _ in range(2 * LAYERS)]
    length = torch.export.Dim("past", max=MAX_POSITIONS - 2)
    inputs = ["input_ids", *_names("past")]
    dynamic = {"input_ids": None, **{n: {2: length} for n in _names("past")}}
    with warnings.catch_warnings():  # torch's own deprecations, inside the exporter
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            (torch.tensor([[1]]), *past),
            dynamo=True,
            dynamic_shapes=dynamic,
            input_names=inputs,
            output_names=["logits", *_names("present")],
            verbose=False,
        )
    program.save(str(path))
    return path


def greedy(session, steps: int, first: int = 1) -> tuple[list[int], list[np.ndarray]]:
    """`steps` decode steps from token `first` and an empty past, each feeding back the
    most likely token and the present as the next past: (tokens, each step's logits)."""
    past = {n: np.zeros((1, HEADS, 0, HEAD_DIM), np.float32) for n in _names("past")}
    token, tokens, logits = first, [], []
    for _ in range(steps):
        out = session.run(None, {"input_ids": np.array([[token]], np.int64), **past})
        logits.append(out[0][0, -1])
        token = int(out[0][0, -1].argmax())
        tokens.append(token)
        past = dict(zip(_names("past"), out[1:], strict=True))
    return tokens, logits

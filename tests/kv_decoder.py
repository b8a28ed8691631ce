"""Running a KV-cache decoder (aoed.samples.kv_decoder) as a generation loop does.

tokens, logits = greedy(session, steps=32)
"""

from __future__ import annotations

import numpy as np

__all__ = ["greedy"]


def greedy(session, steps: int, first: int = 1) -> tuple[list[int], list[np.ndarray]]:
    """`steps` decode steps from token `first` and an empty past, each feeding back the
    most likely token and the present as the next past: (tokens, each step's logits)."""
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_")]
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
    token, tokens, logits = first, [], []
    for _ in range(steps):
        out = session.run(None, {"input_ids": np.array([[token]], np.int64), **past})
        logits.append(out[0][0, -1])
        token = int(out[0][0, -1].argmax())
        tokens.append(token)
        past = dict(zip(past, out[1:], strict=True))
    return tokens, logits

"""Strategy plugins that tests load into `aoe` and its worker processes.

    env = lowrank_env(tmp_path)  # then run_aoe("tune", ..., env=env)

`LOWRANK` is a rank-8 product in place of a matmul's constant weight (no bias, no
activation, both sides at least 64): many times faster than the full product of a wide
weight, and as accurate as the weight is close to rank 8. It registers as an int8
strategy, so lossy jobs see it and exact ones do not.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

__all__ = ["LOWRANK", "LOWRANK_SOURCE", "lowrank_env"]

#: The plugin's module name (AOED_PLUGINS).
LOWRANK = "aoed_lowrank_plugin"

LOWRANK_SOURCE = textwrap.dedent(
    """
    import hashlib
    import os

    import numpy as np
    from onnx import helper
    from aoed.backends.ort._rewrite import init, matmul_parts
    from aoed.engine.registry import Strategy
    from aoed.engine.tasks import Rewrite

    # A job builds a candidate several times (measured, checked at each point of a shape
    # profile, assembled alone and with the others): one SVD per weight and process.
    _factors = {}

    def _rank8(w):
        key = hashlib.sha256(w.tobytes()).hexdigest() + str(w.shape)
        if key not in _factors:
            u, s, vt = np.linalg.svd(w.astype(np.float64), full_matrices=False)
            _factors[key] = ((u[:, :8] * s[:8]).astype(np.float32), vt[:8].astype(np.float32))
        return _factors[key]

    def _lowrank(view):
        parts = matmul_parts(view)
        if parts is None:
            return None
        a, w, bias, act, _rank = parts  # A of any rank: MatMul broadcasts its leading axes
        if bias is not None or act is not None or min(w.shape) < 64:
            return None
        u, vt = _rank8(w)
        left = init(view, "left", u)
        right = init(view, "right", vt)
        mid = view.name("mid")
        return Rewrite((helper.make_node("MatMul", [a, left.name], [mid], name=view.name("L")),
                        helper.make_node("MatMul", [mid, right.name], [view.output], name=view.name("R"))),
                       (left, right))

    def register(registry):
        registry.register(Strategy("lowrank8", "matmul", "int8", _lowrank))
        if os.environ.get("AOED_LOWRANK_ALONE"):
            # the only lossy form of a matmul: nothing for a refused choice to step to
            # (a test's registry; the registry has no way to take a strategy out)
            for key in [k for k, v in registry._by_key.items()
                        if k[0] == "matmul" and v.precision == "int8" and k[1] != "lowrank8"]:
                del registry._by_key[key]
    """
)


def lowrank_env(folder: Path, alone: bool = False) -> dict[str, str]:
    """The environment under which `aoe` (and every worker it starts) loads `LOWRANK`,
    its source written into `folder`; `alone`: the only lossy form of a matmul (the
    built-in int8 ones taken out of the registry)."""
    (folder / f"{LOWRANK}.py").write_text(LOWRANK_SOURCE)
    env = {
        "PYTHONPATH": os.pathsep.join([str(folder), *filter(None, sys.path)]),
        "AOED_PLUGINS": LOWRANK,
    }
    if alone:
        env["AOED_LOWRANK_ALONE"] = "1"
    return env

"""The built-in comm hooks in a real world of two gloo ranks: fp16_scaled keeps the
gradients that torch's fp16 hook loses, far below fp16's normal range and far above its
largest value, within the gate's bound."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from aoe.gdat import fp16_scale  # noqa: E402
from aoed.gdat.gate import BOUNDS  # noqa: E402

from .procs import run_ranks  # noqa: E402

# Each rank: the same weights, its own batch; DDP built by the helper's own `wrap` with
# no hook (exact all-reduce), then each hook; the worst per-tensor relative error of the
# reduced gradients against exact, for gradients scaled by each factor.
_RANK = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from aoe.gdat import DDPConfig, wrap
    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    def grads(hook, factor):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        model = wrap(module, DDPConfig(hook=hook))
        torch.manual_seed(1 + rank)
        (model(torch.randn(16, 64)).pow(2).mean() * factor).backward()
        return [p.grad.double().clone() for p in model.module.parameters()]
    out = {}
    for factor in (1e-8, 1.0, 1e8):
        exact = grads("", factor)
        for hook in ("fp16", "fp16_scaled"):
            got = grads(hook, factor)
            out[f"{hook}@{factor:g}"] = max(
                float((g - e).norm() / e.norm()) for g, e in zip(got, exact)
            )
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()
    """
)


def test_fp16_scaled_keeps_tiny_and_huge_gradients_within_the_gate_where_fp16_does_not(
    tmp_path: Path,
) -> None:
    outs = run_ranks(_RANK, str(tmp_path / "store"))
    err = {k: float(v) for k, v in json.loads(outs[0][0]).items()}
    bound = BOUNDS["fp16"]
    # Ordinary gradients: both hooks within the bound.
    assert err["fp16@1"] <= bound and err["fp16_scaled@1"] <= bound, err
    # Gradients of 1e-8 scale are fp16 subnormals or zero: torch's hook loses them...
    assert err["fp16@1e-08"] > bound, err
    # ... and gradients of 1e8 scale overflow it (inf, or nan: never within a bound).
    assert not err["fp16@1e+08"] <= bound, err
    # The scaled hook keeps both as well as ordinary ones.
    assert err["fp16_scaled@1e-08"] <= bound and err["fp16_scaled@1e+08"] <= bound, err


@pytest.mark.parametrize("peak", [1e-30, 3e-7, 0.5, 1.0, 65504.0, 1e30])
def test_the_scale_is_a_power_of_two_that_brings_the_peak_just_under_2_15(peak: float) -> None:
    s = fp16_scale(peak)
    assert math.log2(s) == int(math.log2(s))
    assert 2.0**14 < peak * s <= 2.0**15


@pytest.mark.parametrize("peak", [0.0, math.inf, math.nan])
def test_a_peak_with_nothing_to_keep_is_not_scaled(peak: float) -> None:
    assert fp16_scale(peak) == 1.0

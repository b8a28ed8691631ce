"""A lossy candidate's accuracy judged where it runs: in the model.

The task gate compares a task's own outputs with fp32. That is the right first check,
but it can be stricter than the model needs: an attention block's output is added to a
residual stream several times its size, and its int8 error, 0.2% of the block's output,
is a far smaller share of the sum the next layer reads. A lossy candidate that clearly
beats the exact choice and fails the task gate only on its own outputs gets one more look:
the model with that candidate alone applied (every other task as in the input) is compared
with the input on the held-back samples, and must meet the same per-task limits on the
model's outputs. The end-to-end gate then judges all choices together, and backs off the
one with the least gain per error first (verify.hold_to_budget), with the error as
measured here.
"""

from __future__ import annotations

import trio

from aoe.errors import AoedError, DeviceError
from aoe.partition import Task
from aoed.engine.context import JobContext
from aoed.engine.messages import Accuracy, Build, CompareRequest

__all__ = ["model_accuracy", "verdict"]


async def model_accuracy(ctx: JobContext, task: Task, strategy: str) -> Accuracy | str:
    """The model's outputs with `strategy` applied to `task` alone, against the input's,
    over the held-back samples; or why that could not be measured."""
    out = ctx.workspace.scratch / "in_context" / f"{task.id}.{strategy.replace(':', '_')}.onnx"
    await trio.to_thread.run_sync(lambda: out.parent.mkdir(parents=True, exist_ok=True))
    try:
        await ctx.assemble([Build(out, {task.id: strategy})])
        req = CompareRequest(ctx.run.model, out, ctx.held_back, ctx.device.device)
        acc: Accuracy = await ctx.device.call(req, ctx.ledger, category="search")
        return acc
    except DeviceError as exc:
        return f"the model with it could not be measured ({exc})"
    except AoedError as exc:  # a build that fails is this candidate's answer
        return f"the model with it could not be built ({exc})"
    finally:
        await trio.to_thread.run_sync(lambda: out.unlink(missing_ok=True))


def verdict(ctx: JobContext, got: Accuracy | str) -> tuple[bool, str]:
    """Whether `got` passes the task's limits on the model's outputs, and a clause saying
    so, built from the figures it quotes (the caller names the candidate)."""
    if isinstance(got, str):
        return False, f"outside the task budget on its own outputs, and {got}"
    ok = ctx.policy.task_ok(got.as_dict())
    where = "within" if ok else "outside"
    return ok, (
        f"outside the task budget on its own outputs; the model with it alone reached cosine "
        f"{got.cosine:.6f} and max rel error {got.max_rel_error:.3g} over {got.samples} held-back samples, "
        f"{where} the task budget of cosine >= {ctx.policy.task_min_cosine} and max rel error <= "
        f"{ctx.policy.task_max_rel_error}"
    )

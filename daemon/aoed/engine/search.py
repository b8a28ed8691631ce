"""The search: profile the model, set the budget, and tune each task the bank did not
answer with a task agent of its own.

While the device profiles the prepared model (each task's share of its time, and how
fast a session loads), a worker writes the task models out. The budget is the one the
job gives, else one fitted to the tasks' costs and their strategies (budget.py), less
what the comparison with another runtime's builds will need where one competes (asked
of a worker while the device profiles); it is
sliced over the tasks, most expensive first, and a task its slice does not reach is
left untuned ("skipped", saying so). Then one task agent per task (taskagent.py) runs,
all at once, sharing the pool and the device; the progress events count the tasks
decided, with those the bank, an interrupted run or the budget decided first.
"""

from __future__ import annotations

import trio

from aoe.bankrecord import BankRecord
from aoe.errors import DeviceError, ModelError
from aoe.partition import Task
from aoe.spec import Stage
from aoed.engine.budget import PREPARE_S_PER_MIB, Budget, default_budget, model_mib
from aoed.engine.context import JobContext
from aoed.engine.estimates import say_estimate
from aoed.engine.job import TaskResult
from aoed.engine.messages import ExtractRequest, ProfileReply, ProfileRequest
from aoed.engine.pool import model_step
from aoed.engine.runtimestage import comparison_s, competes, offer
from aoed.engine.taskagent import TaskAgent, TaskDecision

__all__ = ["search_tasks", "search_words"]


async def search_tasks(
    ctx: JobContext,
    tasks: list[Task],
    to_tune: list[Task],
    results: dict[str, TaskResult],
    hits: dict[str, BankRecord],
) -> tuple[Budget, list[TaskDecision]]:
    """Profile the model, set the budget, extract the tasks to tune and run one agent per
    task within its slice of the budget, most expensive first; returns the budget and
    the agents' decisions in the order they came."""
    total = len(tasks)  # every row of the job's table (aoe.outcome): decided ones are done
    ctx.emit("progress", "tasks", total - len(to_tune), total)
    opts = ctx.spec
    if not to_tune:
        return Budget(opts.budget_s or 5.0, ctx.ledger, opts.budget_s is not None), []
    assert ctx.prep is not None
    prep = ctx.prep
    ctx.ledger.enter("profile")
    # Profiling loads the whole model while a worker writes its tasks out: about what
    # preparing it costs (0.6-0.9 of it on MLPs of 48 and 192 MiB).
    say_estimate(
        ctx,
        "profile",
        ctx.ledger.model_mb * PREPARE_S_PER_MIB,
        "profiling and extracting tasks: about {:.1f} s, outside the budget (as long as preparing "
        "the model should take)",
    )
    await ctx.stage(Stage.PROFILE, f"profiling baseline, extracting {len(to_tune)} tasks")
    share: dict[str, float] = {}
    task_us: dict[str, float] = {}
    model_us = 0.0
    load_rate: float | None = None  # seconds per MiB to load a session, as profiled

    async def profile() -> None:
        nonlocal model_us, load_rate
        try:
            prof: ProfileReply = await ctx.device.call(
                ProfileRequest(
                    prep.prepared, ctx.held_back[0], ctx.workspace.scratch, ctx.device.device
                ),
                ctx.ledger,
                category="profile",
            )
        except DeviceError as exc:  # unranked, the tasks still get tuned
            ctx.notes.append(
                f"profiling failed ({exc}); tasks tuned in graph order with equal shares"
            )
            share.update({t.id: 1.0 / len(tasks) for t in tasks})
            return
        model_us = prof.total_us
        mib = model_mib([prep.prepared])
        if prof.load_s > 0 and mib > 0:
            load_rate = prof.load_s / mib
        node_sum = sum(prof.nodes.values()) or 1.0
        for t in tasks:
            us = sum(prof.nodes.get(n, 0.0) for tt in (t, *t.twins) for n in tt.node_names)
            share[t.id], task_us[t.id] = us / node_sum, us / max(1, t.instances)
            results[t.id].share = share[t.id]

    async def ask_runtime() -> None:  # the answer stays in ctx (runtimestage.offer)
        try:
            await offer(ctx)
        except ModelError:
            pass  # the runtime stage says so when it comes

    # The device profiles while a worker writes the task models and another says what
    # OpenVINO is there (where it may compete): none waits for the others.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(profile)
        if competes(ctx):
            nursery.start_soon(ask_runtime)
        nursery.start_soon(
            model_step,
            ctx.pool,
            ExtractRequest(
                prep.prepared, tuple(to_tune), ctx.held_back[0], ctx.workspace.scratch / "tasks"
            ),
            ctx.ledger,
            ctx.run.model,
            "extracting tasks",
        )
    # The comparison with another runtime's builds: its seconds are kept from the start.
    runtime_s = await comparison_s(ctx, load_rate)
    if opts.budget_s is not None:
        budget = Budget(opts.budget_s, ctx.ledger, True, load_rate)
    else:
        counts = {
            t.id: sum(
                1
                for _ in ctx.registry.strategies_for(
                    t.family, opts.precision, ctx.device.device.kind
                )
            )
            for t in to_tune
        }
        budget = Budget(
            default_budget(
                {t.id: task_us.get(t.id, 100.0) for t in to_tune}, counts, model_us, runtime_s
            ),
            ctx.ledger,
            False,
            load_rate,
        )
    budget.reserve_runtime(runtime_s)
    ctx.model_us = model_us
    to_tune = sorted(to_tune, key=lambda t: -share.get(t.id, 0.0))
    slices = budget.for_tasks(share, [t.id for t in to_tune])
    for t in to_tune:
        if t.id not in slices:
            r = results[t.id]
            r.update_mode, r.error = (
                "skipped",
                f"not tuned: the budget of {budget.total_s:g} s went to costlier tasks",
            )
    to_tune = [t for t in to_tune if t.id in slices]
    left = total - len(to_tune)  # the bank's, the restored and the untuned ones
    ctx.emit("progress", "tasks", left, total)
    ctx.ledger.enter("search")
    await ctx.stage(Stage.SEARCH, search_words(len(to_tune), total))
    decided: list[TaskDecision] = []

    async def one(t: Task) -> None:
        d = await TaskAgent(ctx, t, results[t.id], hits.get(t.id), slices[t.id], budget).run()
        d.decided_at = ctx.ledger.elapsed_s
        decided.append(d)
        ctx.notes.extend(d.notes)
        ctx.emit("progress", "tasks", left + len(decided), total)

    async with trio.open_nursery() as nursery:
        for t in to_tune:
            nursery.start_soon(one, t)
    return budget, decided


def search_words(searched: int, total: int) -> str:
    """The search stage's words: "tuning 3 of 5 tasks (2 decided already: the bank, an
    interrupted run, or left untuned by the budget)"; the counts are those the progress
    events carry (aoe.outcome says what a task is)."""
    if searched == total:
        return f"tuning {total} tasks"
    return (
        f"tuning {searched} of {total} tasks ({total - searched} decided without a search: "
        "from the bank, an interrupted run, or left untuned by the budget)"
    )

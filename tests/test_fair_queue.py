"""The agents' request queue serves jobs fairly: by weight, never one job's backlog first."""

from __future__ import annotations

from dataclasses import dataclass

import trio
import trio.testing

from aoed.engine import _pending


@dataclass
class Job:
    job_id: str
    weight: int = 1


async def _served_order(jobs: dict[str, tuple[Job, int]], capacity: int = 64) -> list[str]:
    queue: _pending.RequestQueue[str] = _pending.RequestQueue(capacity)
    order: list[str] = []

    async def submit_all(job: Job, n: int) -> None:
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(queue.submit, f"{job.job_id}-{i}", job)
                await trio.lowlevel.checkpoint()  # in order within the job

    async with trio.open_nursery() as nursery:
        for job, n in jobs.values():  # each job's requests all queued before the next job's
            nursery.start_soon(submit_all, job, n)
            await trio.testing.wait_all_tasks_blocked()
        total = sum(n for _, n in jobs.values())
        async with queue.receiver() as requests:
            async for pending in requests:
                order.append(pending.job.job_id)
                pending.reply("done")
                if len(order) == total:
                    break
    return order


async def test_a_backlog_does_not_starve_a_later_job() -> None:
    long, short = Job("long"), Job("short")
    order = await _served_order({"long": (long, 40), "short": (short, 4)})
    # The short job's 4 requests are served within its first 8 turns, not after 40.
    assert [i for i, j in enumerate(order) if j == "short"][-1] < 8


async def test_weight_gives_a_proportional_share() -> None:
    order = await _served_order({"a": (Job("a", weight=2), 30), "b": (Job("b", weight=1), 30)})
    first = order[:30]
    assert 18 <= first.count("a") <= 22, first  # 2:1 while both have work


async def test_requests_of_one_job_keep_their_order() -> None:
    queue: _pending.RequestQueue[int] = _pending.RequestQueue(8)
    job = Job("x")
    got: list[int] = []
    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(queue.submit, i, job)
            await trio.testing.wait_all_tasks_blocked()
        for _ in range(5):
            p = await queue.get()
            got.append(p.request)
            p.reply(None)
    assert got == [0, 1, 2, 3, 4]

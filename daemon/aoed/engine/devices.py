"""The device set: every device agent of the engine, and which one serves a request.

One `DeviceAgent` per configured device (`[tuning] devices`), each with its own runner
and its own machine-wide lock, each measuring one request at a time. This module only
chooses between them; the agents are unchanged by there being several.

A decision is valid on every device with the same fingerprint (bank keys carry the
fingerprint, never the device's index or its cores), so a job may measure on any of
them. A job gets a home device when it starts (`home()`: of those with its fingerprint,
the one with the fewest jobs at home, the device it named on a tie), and each task's
search goes to whichever of them has the least work queued when it asks (`call()`), so
one job spreads over every idle device of its kind (idle ones take turns) and two jobs
share them.

Invariant (comparisons on one device): a time is only ever compared with times from the
same device. Within a task this holds by construction, since a task's candidates are
measured interleaved in ONE MeasureRequest, and a request is served by one agent. The
stages that compare across requests (profile, session options, verification, the
confirming A/B) measure on the job's home agent only: `JobContext.device` is that agent,
and only `JobContext.measure(..., spread=True)` (one task's search) comes here.
A device whose runner could not be started (a Ray node gone) is passed over while
another of its kind is left; a task's search that it could not answer because it went
away is measured again on another (`call()`).
Fair share between jobs is each agent's own (its queue serves jobs by weight).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from aoe.device import Device
from aoe.errors import DeviceError, OptionError
from aoed.engine.device import DeviceAgent
from aoed.engine.ledger import JobLedger
from aoed.engine.messages import Request

__all__ = ["DeviceSet"]


class DeviceSet:
    def __init__(self, agents: Sequence[DeviceAgent]):
        if not agents:
            raise ValueError("a device set needs at least one device")
        self.agents = list(agents)
        self._digests = {id(a): a.device.fingerprint().digest for a in self.agents}
        self._homed: dict[int, int] = {id(a): 0 for a in self.agents}
        self._turns = 0
        # the turn each was last picked
        self._last: dict[int, int] = {id(a): 0 for a in self.agents}

    @property
    def first(self) -> DeviceAgent:
        """The first configured device's agent (the one-device engine's only one)."""
        return self.agents[0]

    def __iter__(self) -> Iterator[DeviceAgent]:
        return iter(self.agents)

    def __len__(self) -> int:
        return len(self.agents)

    def peers(self, agent: DeviceAgent) -> list[DeviceAgent]:
        """The agents whose decisions are `agent`'s too (same fingerprint), itself included."""
        digest = self._digests[id(agent)]
        return [a for a in self.agents if self._digests[id(a)] == digest]

    def _matching(self, device: Device) -> list[DeviceAgent]:
        named = [a for a in self.agents if a.device == device]
        if named:
            return self.peers(named[0])
        digest = device.fingerprint().digest
        return [a for a in self.agents if self._digests[id(a)] == digest]

    @contextlib.contextmanager
    def home(self, device: Device) -> Iterator[DeviceAgent]:
        """The agent a job for `device` calls home for the block: of the devices with its
        fingerprint, the one with the fewest jobs at home (`device` itself on a tie), one
        that could not start its runner only when no other is left.
        OptionError when no configured device has that fingerprint."""
        matching = self._matching(device)
        if not matching:
            have = ", ".join(a.device.name for a in self.agents)
            raise OptionError(
                f"--device {device}: this engine measures on {have}, none of them a {device}"
            )
        agent = min(
            matching, key=lambda a: (bool(a.unusable), self._homed[id(a)], a.device != device)
        )
        self._homed[id(agent)] += 1
        try:
            yield agent
        finally:
            self._homed[id(agent)] -= 1

    async def call(
        self,
        home: DeviceAgent,
        request: Request,
        job: JobLedger | None = None,
        category: str = "other",
    ) -> Any:
        """`request` served by whichever agent with `home`'s fingerprint has the least
        queued or in flight (on a tie, the one picked longest ago: idle devices take turns,
        so a device another process holds is not the only one tried), and one that could
        not start its runner (a remote device whose node is gone: `DeviceAgent.unusable`)
        only when no other is left; the request names that agent's device.
        When the device goes away during the request (it is `unusable` after), the request
        is served again by another of the kind, if one is usable.
        Returns and raises what `DeviceAgent.call` does. Only for a request whose reply
        is compared with no other request's (see the module's invariant)."""
        tried: set[int] = set()
        while True:
            left = [a for a in self.peers(home) if id(a) not in tried]
            agent = min(left, key=lambda a: (bool(a.unusable), a.outstanding, self._last[id(a)]))
            self._turns += 1
            self._last[id(agent)] = self._turns
            sent = request
            if agent is not home and isinstance(getattr(request, "device", None), Device):
                sent = msgspec.structs.replace(request, device=agent.device)
            try:
                return await agent.call(sent, job, category=category)
            except DeviceError:
                # The device went away under the request (a Ray node left): it says nothing
                # of the request, which is measured again on another of its kind, if any.
                tried.add(id(agent))
                if not agent.unusable or not any(
                    not a.unusable for a in self.peers(home) if id(a) not in tried
                ):
                    raise

    def snapshot(self) -> dict[str, tuple[float, int]]:
        """Per device name: (busy seconds, requests answered) since the engine started."""
        return {a.device.name: (a.busy_s, a.requests) for a in self.agents}

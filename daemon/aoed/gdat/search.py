"""The GDAT search: a short list of named stages over the space (space.py), then the
confirming A/B against DDP's defaults.

  ladder   DDP's defaults and the bucket ladder (plus the bank's configuration, when
           REPEAT_TUNE re-tunes a layout the bank knows)
  refine   caps around the best rung, first-bucket caps
  flags    gradient_as_bucket_view, static_graph
  hooks    only under a lossy gradient precision: each hook gated (gate.py), the ones
           that pass raced
  rebucket when the hooks stage adopted a hook: the bucket ladder again with it (the
           hook changes what each bucket costs to send, so the best cap moves)
  world    the backend's knobs, each in a fresh world
  confirm  fresh interleaved rounds of the proposal, DDP's defaults and a second
           instance of the defaults (the noise floor of these rounds); what the job
           reports and ships is decided here, as OPAT's confirm.py decides

Each stage races its configurations against the incumbent (the best so far) and moves
the incumbent only to one that `decisions.best` calls clearly faster on their paired
rounds. A candidate that looks faster but is not yet clearly so is a close call: it and
the incumbent alone get more rounds, up to EXTRA_ROUNDS times the stage's (`close_calls`).
A stage starts only while the device budget lasts; what it skipped is noted.
The proposal ships only if the confirming rounds call it faster than both instances
of the defaults (95% intervals of the median round ratio entirely below 1); otherwise
DDP's defaults ship: "no significant change" (or "slower") ships the defaults.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aoe.gdat import DDPConfig, hook_class
from aoe.gradlayout import GradientLayout
from aoed.engine import stats
from aoed.engine.confirm import verdict_of
from aoed.engine.decisions import MIN_GAIN, best, clearly_faster, paired_ratio
from aoed.engine.messages import Request
from aoed.engine.rankmessages import RankGateRequest
from aoed.engine.world import World, WorldError, WorldSpec
from aoed.gdat import gate, space
from aoed.gdat.race import Entrant, Meter, RaceFigures, race

__all__ = ["CONFIRM_ROUNDS", "EXTRA_ROUNDS", "RACE_ROUNDS", "ConfirmingAB", "Search", "close_calls"]

log = logging.getLogger(__name__)

#: Rounds of a search stage (racing drops the clearly slower after MIN_ROUNDS).
RACE_ROUNDS = 6
#: Rounds of the confirming A/B: a 95% interval of the median from ranks 3..13.
CONFIRM_ROUNDS = 15
#: A stage's close calls (see close_calls) get rounds up to this many times `rounds`.
EXTRA_ROUNDS = 2
DEFAULT = "default"
DEFAULT_2 = "default (second instance)"


def close_calls(figs: dict[str, RaceFigures], incumbent: str) -> set[str]:
    """The configurations a stage's race should measure further: the incumbent and those
    whose median round ratio to it promises a win (below 1 - MIN_GAIN) that its interval
    does not yet show; none when one already wins clearly or the incumbent failed."""
    measured = {k: f.measurement() for k, f in figs.items()}
    base = measured[incumbent]
    if not base.ok:
        return set()
    pool = [k for k, m in measured.items() if k != incumbent and m.ok and not m.dropped]
    if any(clearly_faster(measured[k], base) for k in pool):
        return set()
    close = {k for k in pool if paired_ratio(measured[k], base)[0] < 1.0 - MIN_GAIN}
    return {incumbent, *close} if close else set()


@dataclass
class ConfirmingAB:
    """The confirming A/B: the figures every output quotes."""

    verdict: str  # faster | no significant change | slower (the proposal vs the defaults)
    shipped: DDPConfig
    proposal: DDPConfig
    baseline_ms: float
    result_ms: float
    baseline_tail_ms: float
    result_tail_ms: float
    improvement: float
    improvement_ci95: tuple[float, float]
    rounds: int
    notes: list[str] = field(default_factory=list)
    figures: dict[str, RaceFigures] = field(default_factory=dict)
    #: when a proposal was measured and the defaults shipped: the comparison that kept it
    #: out (aoe.figures.Comparison's fields)
    decided_by: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "shipped": "tuned" if not self.shipped.is_default else "defaults",
            "shipped_config": self.shipped.label,
            "proposal": self.proposal.label,
            "baseline_ms": self.baseline_ms,
            "result_ms": self.result_ms,
            "baseline_tail_ms": self.baseline_tail_ms,
            "result_tail_ms": self.result_tail_ms,
            "improvement": self.improvement,
            "improvement_ci95": list(self.improvement_ci95),
            "rounds": self.rounds,
            "decided_by": self.decided_by,
        }


@dataclass
class Search:
    layout: GradientLayout
    precision: str
    spec: WorldSpec
    meter: Meter
    #: the world factory: (key, environment) -> a World (the main world's key is "")
    open_world: Callable[[str, tuple[tuple[str, str], ...]], World]
    first_bucket: bool = True
    plugins: Sequence[str] = ()
    banked: DDPConfig | None = None
    world_knobs: tuple[tuple[tuple[str, str], ...], ...] = ()
    rounds: int = RACE_ROUNDS
    confirm_rounds: int = CONFIRM_ROUNDS
    figures: list[RaceFigures] = field(default_factory=list)
    gates: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)
    #: the configuration each stage kept
    kept: dict[str, str] = field(default_factory=dict)
    #: what an interrupted run of this job finished, by stage (and "gates"): taken as it
    #: was, not measured again (`checkpoint` made each record)
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: called with (stage, its record) as each stage ends, to keep it for a resume
    checkpoint: Callable[[str, dict[str, Any]], Awaitable[None]] | None = None
    #: the stages (and "gates") taken from an interrupted run
    resumed: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ stages

    async def _stage(
        self,
        stage: str,
        incumbent: DDPConfig,
        configs: Sequence[DDPConfig],
        category: str = "search",
        worlds: dict[str, str] | None = None,
    ) -> DDPConfig:
        """Race `configs` against `incumbent`; the new incumbent."""
        worlds = worlds or {}
        entrants = [Entrant(c.label, c, worlds.get(c.label, "")) for c in [incumbent, *configs]]
        entrants = list({e.name: e for e in entrants}.values())
        if len(entrants) < 2:
            return incumbent
        if stage in self.done:
            return self._restore(stage, self.done[stage])
        if self.meter.remaining_s() <= 0 and self.stages:
            self.notes.append(f"{stage}: not run, the device budget was spent")
            return incumbent
        self.stages.append(stage)
        self.meter.emit("stage", f"{stage}: {len(entrants)} configurations", 0, 0)
        figs = await race(
            self.meter,
            stage,
            entrants,
            self.rounds,
            category=category,
            protect=frozenset({incumbent.label, DEFAULT}),
            settle=lambda figs: close_calls(figs, incumbent.label),
            max_rounds=self.rounds * EXTRA_ROUNDS,
        )
        self.figures += figs.values()
        measured = {k: f.measurement() for k, f in figs.items()}
        if not measured[incumbent.label].ok:
            ok = {k: m for k, m in measured.items() if m.ok}
            if not ok:
                self.notes.append(
                    f"{stage}: nothing could be measured; the incumbent {incumbent.label} stays"
                )
                await self._keep(stage, incumbent, figs.values())
                return incumbent
            # The incumbent failed in this stage's rounds: the fastest that ran takes over.
            pick = min(ok, key=lambda k: ok[k].median_us)
        else:
            pick = best(measured, incumbent.label, lambda m: True)
        self.kept[stage] = pick
        await self._keep(stage, figs[pick].config, figs.values())
        log.info("%s: %s", stage, pick)
        return figs[pick].config

    async def _keep(self, stage: str, config: DDPConfig, figs: Iterable[RaceFigures]) -> None:
        """Hand the stage's outcome to `checkpoint`, for a resume of this job."""
        if self.checkpoint is not None:
            await self.checkpoint(
                stage,
                {
                    "config": config.to_params(),
                    "kept": self.kept.get(stage, ""),
                    "figures": [f.to_json() for f in figs],
                },
            )

    def _restore(self, stage: str, rec: dict[str, Any]) -> DDPConfig:
        """A stage an interrupted run of this job finished: its figures and choice as
        they were."""
        self.figures += [RaceFigures.from_json(f) for f in rec.get("figures", [])]
        self.stages.append(stage)
        self.resumed.append(stage)
        if rec.get("kept"):
            self.kept[stage] = str(rec["kept"])
        config = DDPConfig.from_params(rec["config"])
        log.info("%s: %s (from the interrupted run: not measured again)", stage, config.label)
        return config

    async def _hooks(self, incumbent: DDPConfig) -> DDPConfig:
        for why in space.skipped_hooks(self.precision, self.spec.backend, self.plugins):
            self.notes.append(f"hook {why}")
        rec = self.done.get("gates")
        if rec is not None:  # gated by the interrupted run: not again
            self.gates += rec.get("gates", [])
            self.resumed.append("gates")
            passing = [DDPConfig.from_params(p) for p in rec.get("passing", [])]
        else:
            passing = await self._gate(incumbent)
        if not passing:
            return incumbent
        return await self._stage("hooks", incumbent, passing)

    async def _gate(self, incumbent: DDPConfig) -> list[DDPConfig]:
        """Each hook the precision allows on `incumbent` through its gate; the ones that
        passed."""
        passing, gates = [], []
        for config in space.hooks(incumbent, self.precision, self.spec.backend, self.plugins):
            cls = hook_class(config.hook)
            request = RankGateRequest(config=config.to_params(), steps=gate.LOSS_STEPS)
            try:
                replies = await self._call("", request, "verify")
            except WorldError as exc:
                gates.append(
                    {"config": config.label, "class": cls, "passed": False, "why": str(exc)}
                )
                continue
            worst = max(
                replies, key=lambda r: float(r.get("max_rel_error", r.get("loss_gap", 0.0)) or 0.0)
            )
            ok, words = gate.judge(cls, worst)
            gates.append(
                {
                    "config": config.label,
                    "class": cls,
                    "passed": ok,
                    "why": words,
                    **{k: v for k, v in worst.items() if k not in ("ok", "id", "maxrss_kb")},
                }
            )
            if ok:
                passing.append(config)
        self.gates += gates
        if self.checkpoint is not None:
            await self.checkpoint(
                "gates", {"gates": gates, "passing": [c.to_params() for c in passing]}
            )
        return passing

    async def _world(self, incumbent: DDPConfig) -> DDPConfig:
        """Each backend knob setting in a fresh world, the incumbent in each, against the
        incumbent in the main world, their rounds interleaved."""
        for knobs in self.world_knobs:
            if self.meter.remaining_s() <= 0:
                self.notes.append("world: not run, the device budget was spent")
                break
            cand = incumbent.replace(world=tuple(sorted(knobs)))
            key = ",".join(f"{k}={v}" for k, v in cand.world)
            if key not in self.meter.worlds:
                self.open_world(key, cand.world)
            before = incumbent
            incumbent = await self._stage(
                f"world {key}", incumbent, [cand], category="session", worlds={cand.label: key}
            )
            if incumbent == before:
                await self.meter.worlds[key].aclose()
        return incumbent

    async def _call(self, world: str, request: Request, category: str) -> list[dict[str, Any]]:
        started = time.monotonic()
        try:
            return await self.meter.worlds[world].call(request, self.meter.limit_s(2))
        finally:
            self.meter.charge(time.monotonic() - started, category)

    async def run(self) -> DDPConfig:
        """The proposal: the best configuration the stages found (DDP's defaults when
        none was clearly faster)."""
        incumbent = DDPConfig()
        first = space.ladder(self.layout)
        if self.banked is not None and self.banked.label not in {c.label for c in first}:
            first.append(self.banked)
        incumbent = await self._stage("ladder", incumbent, first[1:])
        seen = [incumbent, *(f.config for f in self.figures)]
        incumbent = await self._stage(
            "refine", incumbent, space.refine(self.layout, incumbent, self.first_bucket, seen)
        )
        incumbent = await self._stage("flags", incumbent, space.flags(incumbent))
        if self.precision != "exact":
            before = incumbent
            incumbent = await self._hooks(incumbent)
            if incumbent.hook and incumbent.hook != before.hook:
                seen = [f.config for f in self.figures]
                incumbent = await self._stage(
                    "rebucket", incumbent, space.rebucket(self.layout, incumbent, seen)
                )
        if self.world_knobs:
            incumbent = await self._world(incumbent)
        return incumbent

    async def confirm(self, proposal: DDPConfig, banked: DDPConfig | None = None) -> ConfirmingAB:
        """The confirming A/B (see the module doc). Raises DeviceError when the worlds
        keep breaking."""
        world = ",".join(f"{k}={v}" for k, v in proposal.world)
        entrants = [Entrant(DEFAULT, DDPConfig()), Entrant(DEFAULT_2, DDPConfig())]
        if not proposal.is_default:
            entrants.append(Entrant(proposal.label, proposal, world))
        if banked is not None and banked.label not in {e.name for e in entrants}:
            entrants.append(
                Entrant(banked.label, banked, ",".join(f"{k}={v}" for k, v in banked.world))
            )
        self.meter.emit("stage", f"confirm: {proposal.label} against DDP's defaults", 0, 0)
        figs = await race(
            self.meter,
            "confirm",
            entrants,
            self.confirm_rounds,
            category="confirm",
            drop=False,
            min_rounds=self.confirm_rounds,
        )
        base, copy = figs[DEFAULT], figs[DEFAULT_2]
        notes: list[str] = []
        shipped, verdict, cand = DDPConfig(), "no significant change", base
        decided: dict[str, Any] | None = None
        if not base.measurement().ok:
            notes.append(
                f"DDP's defaults could not be measured in the confirming rounds ({base.error or 'no rounds'})"
            )
        elif not proposal.is_default:
            prop = figs[proposal.label]
            ratios = stats.paired_ratios(prop.rounds_us, base.rounds_us)
            if len(ratios) >= 3:
                verdict, med, ci = verdict_of(ratios)
                c_ratios = stats.paired_ratios(prop.rounds_us, copy.rounds_us)
                c_verdict, c_med, c_ci = (
                    verdict_of(c_ratios)
                    if len(c_ratios) >= 3
                    else ("not measured", 1.0, (1.0, 1.0))
                )
                imp, imp_ci = 1 / med - 1, (1 / ci[1] - 1, 1 / ci[0] - 1)
                if verdict == "faster" and c_verdict != "faster":
                    verdict = "no significant change"
                    decided = {
                        "subject": "tuned",
                        "against": "second session",
                        "improvement": 1 / c_med - 1,
                        "improvement_ci95": [1 / c_ci[1] - 1, 1 / c_ci[0] - 1],
                    }
                    notes.append(
                        f"{proposal.label} not shipped: faster than DDP's defaults ({imp:+.1%}) but not than "
                        f"their second instance in the same rounds (ratio {c_med:.3f}, 95% interval "
                        f"[{c_ci[0]:.3f}, {c_ci[1]:.3f}]): within the noise of these rounds"
                    )
                elif verdict == "faster":
                    shipped, cand = proposal, prop
                else:
                    decided = {
                        "subject": "tuned",
                        "against": "input",
                        "improvement": imp,
                        "improvement_ci95": list(imp_ci),
                    }
                    notes.append(
                        f"{proposal.label} not shipped: improvement {imp:+.1%}, 95% interval "
                        f"[{imp_ci[0]:+.1%}, {imp_ci[1]:+.1%}]: {verdict}"
                    )
            else:
                notes.append(
                    f"{proposal.label} could not be measured in the confirming rounds "
                    f"({prop.error or 'too few rounds'}); DDP's defaults ship"
                )
        ratios = (
            stats.paired_ratios(cand.rounds_us, base.rounds_us)
            if cand is not base
            else stats.paired_ratios(copy.rounds_us, base.rounds_us)
        )
        if cand is base:
            # The defaults ship: their figure is their own; the interval says how far two
            # instances of them lay apart in these rounds.
            _v, med, ci = verdict_of(ratios) if len(ratios) >= 3 else ("", 1.0, (1.0, 1.0))
            imp, imp_ci = 0.0, (1 / ci[1] - 1, 1 / ci[0] - 1)
        else:
            _v, med, ci = verdict_of(ratios)
            imp, imp_ci = 1 / med - 1, (1 / ci[1] - 1, 1 / ci[0] - 1)
        b, r = base.measurement(), cand.measurement()
        return ConfirmingAB(
            verdict=verdict,
            shipped=shipped,
            proposal=proposal,
            baseline_ms=b.median_us / 1e3 if b.ok else 0.0,
            result_ms=r.median_us / 1e3 if r.ok else 0.0,
            baseline_tail_ms=base.tail_us / 1e3,
            result_tail_ms=cand.tail_us / 1e3,
            improvement=imp,
            improvement_ci95=imp_ci,
            rounds=len(ratios),
            notes=notes,
            figures=figs,
            decided_by=decided,
        )

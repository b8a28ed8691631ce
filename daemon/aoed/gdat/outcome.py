"""What a GDAT job produced, and the documents it writes: AOE-shaped.

    {output}/aoe_result_gdat_{ts}_{pid}.json
        basic{tuning_name, tuning_time(s), job_id, precision, device}
        GDAT{model_baseline_performance(ms), model_result_performance(ms),
             model_performance_improvement, model_performance_improvement_ci95,
             model_performance_verdict, gdat_tuning_result, baseline_tail(ms),
             result_tail(ms), shipped, ddp_config, repo_summary{...}}
        figures{...}, bank{...}, budget{...}, resources{...}, notes: as every job's
             (aoe.outcome.JobOutcome: the figures are the confirming A/B's)
        details{...}: what only GDAT has
          confirmation{...}: the A/B the GDAT figures come from (search.ConfirmingAB)
          configurations[...]: every configuration measured, per stage: its step and
             tail (the world's, and per rank), rounds, DDP's buckets, and what became of
             it (chosen, lost and why, dropped by racing, failed, rejected by the gate)
          gates[...], broken_turns[...] (turns whose world broke), layout{...}, the
          shipped ddp_config, the tails, the world
    {workspace}/tunespace/result/ddp_config.json
        the shipped configuration: DDP's keyword arguments, the comm hook, the process
        group's options, the bank key it is stored under; what `aoe.gdat.ddp()` applies

Step and tail times are in milliseconds: a step is the slowest rank's, the median of
the confirming rounds' medians.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aoe.figures import Comparison, Figures, Shipped
from aoe.gdat import DDPConfig
from aoe.gradlayout import GradientLayout
from aoe.outcome import BudgetReport, GdatDetails, JobOutcome, details_to_dict
from aoe.spec import JobType, Precision
from aoed.engine import stats
from aoed.engine.decisions import clearly_faster, paired_ratio, why_not_faster
from aoed.gdat.race import RaceFigures
from aoed.gdat.search import DEFAULT, DEFAULT_2

__all__ = ["GdatResult", "configurations", "ddp_config_doc", "result_doc", "to_outcome"]


@dataclass
class GdatResult:
    job_id: str
    model: str
    precision: str
    backend: str
    world_size: int
    layout: GradientLayout
    key: str
    shipped: DDPConfig
    verdict: str
    baseline_ms: float
    result_ms: float
    baseline_tail_ms: float
    result_tail_ms: float
    improvement: float
    improvement_ci95: tuple[float, float]
    tuning_time_s: float
    update_mode: str  # add | update | reserved | unsatisfied | hit
    bank_layer: str = ""
    from_bank: str = ""  # the job whose record answered, when the bank did
    confirmation: dict[str, Any] = field(default_factory=dict)
    configurations: list[dict[str, Any]] = field(default_factory=list)
    gates: list[dict[str, Any]] = field(default_factory=list)
    broken_turns: list[dict[str, Any]] = field(default_factory=list)
    budget: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    result_json: str = ""
    ddp_config: str = ""
    workspace: str = ""

    @property
    def bank(self) -> dict[str, int]:
        from aoe.outcome import bank_tally

        return bank_tally([self.update_mode])


def _why_lost(f: RaceFigures, winner: RaceFigures | None) -> str:
    if winner is None or f is winner:
        return ""
    mine, theirs = f.measurement(), winner.measurement()
    if clearly_faster(theirs, mine):
        med, lo, hi = paired_ratio(theirs, mine)
        return (
            f"{winner.name} clearly faster ({theirs.median_us / 1e3:.4f} ms vs {mine.median_us / 1e3:.4f} ms; "
            f"median round ratio {med:.3f}, 90% interval [{lo:.3f}, {hi:.3f}])"
        )
    return why_not_faster(mine, theirs, winner.name)


def configurations(
    figures: list[RaceFigures], chosen: dict[str, str], gates: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every configuration measured, stage by stage, with what became of it; `chosen`
    maps each stage to the configuration it kept."""
    out = []
    by_stage: dict[str, dict[str, RaceFigures]] = {}
    for f in figures:
        by_stage.setdefault(f.stage, {})[f.name] = f
    for f in figures:
        m = f.measurement()
        keep = chosen.get(f.stage, "")
        winner = by_stage[f.stage].get(keep)
        if f.error:
            status, why = "failed", f.error
        elif f.dropped:
            status, why = "dropped", f.dropped
        elif f.name == keep:
            status, why = "chosen", ""
        elif f.stage == "confirm" and f.name == DEFAULT_2:
            status, why = (
                "reference",
                "a second instance of DDP's defaults: the noise floor of the confirming rounds",
            )
        elif f.stage == "confirm" and f.name == DEFAULT:
            status, why = "baseline", "DDP's defaults, the baseline of the confirming rounds"
        else:
            status, why = "lost", _why_lost(f, winner)
        tails = [t for t in f.tails_us if t is not None]
        out.append(
            {
                "stage": f.stage,
                "name": f.name,
                "world": f.world or "main",
                "params": f.config.to_params(),
                "step_ms": round(m.median_us / 1e3, 4) if m.ok else None,
                "tail_ms": round(stats.median(tails) / 1e3, 4) if tails else None,
                "rounds_ms": [round(v / 1e3, 4) if v else None for v in f.rounds_us],
                "per_rank": f.per_rank(),
                "buckets": f.buckets,
                "status": status,
                "why": why,
            }
        )
    for g in gates:
        if not g.get("passed"):
            out.append(
                {
                    "stage": "hooks",
                    "name": g["config"],
                    "status": "rejected",
                    "why": f"gate: {g['why']}",
                }
            )
    return out


def ddp_config_doc(result: GdatResult) -> dict[str, Any]:
    """`ddp_config.json`: the shipped configuration, where it is stored, how to use it."""
    cfg = result.shipped
    return {
        **cfg.to_json(),
        "params": cfg.to_params(),
        "bank_key": result.key,
        "precision": result.precision,
        "layout": {
            "signature": result.layout.signature().digest,
            "gradients": len(result.layout.params),
            "grad_mb": round(result.layout.grad_bytes / (1 << 20), 3),
            "world_size": result.world_size,
            "backend": result.backend,
        },
        "step_ms": {
            "defaults": round(result.baseline_ms, 4),
            "shipped": round(result.result_ms, 4),
        },
        "job_id": result.job_id,
        "usage": "model = aoe.gdat.ddp(model)  # after init_process_group; or DistributedDataParallel(model, "
        "**ddp_kwargs) and register_comm_hook as comm_hook says",
    }


def _details(result: GdatResult) -> GdatDetails:
    return GdatDetails(
        gradient_precision=result.precision,
        backend=result.backend,
        world_size=result.world_size,
        baseline_tail_ms=round(result.baseline_tail_ms, 6),
        result_tail_ms=round(result.result_tail_ms, 6),
        ddp_config=result.shipped.to_json(),
        ddp_config_file=result.ddp_config,
        update_mode=result.update_mode,
        bank_layer=result.bank_layer,
        confirmation=result.confirmation,
        configurations=result.configurations,
        gates=result.gates,
        broken_turns=result.broken_turns,
        layout={
            "signature": result.layout.signature().digest,
            "bank_key": result.key,
            "gradients": len(result.layout.params),
            "grad_mb": round(result.layout.grad_bytes / (1 << 20), 3),
            "world_size": result.world_size,
            "backend": result.backend,
        },
    )


def _figures(result: GdatResult) -> Figures:
    """The confirming A/B's figures under aoe.figures' rule: the defaults are the input."""
    rounds = int(result.confirmation.get("rounds") or 0)
    if result.shipped.is_default:
        decided = result.confirmation.get("decided_by")
        return Figures.unchanged(
            result.verdict,
            result.baseline_ms,
            rounds,
            Comparison.from_dict(decided) if isinstance(decided, dict) else None,
            confirmed_by=result.from_bank,
        )
    lo, hi = result.improvement_ci95
    return Figures(
        "faster",
        Shipped.TUNED,
        result.baseline_ms,
        result.improvement,
        (lo, hi),
        rounds,
        result.from_bank,
    )


def to_outcome(result: GdatResult) -> JobOutcome:
    """The job's result in the shape every job's has; the GDAT-only parts in `details`.
    Its `tuned_model` is the ddp_config.json (what a training script applies)."""
    b = dict(result.budget)
    budget = BudgetReport(
        budget_s=float(b.get("budget_s") or 0.0),
        given=bool(b.get("given")),
        spent_s=float(b.get("spent_s") or 0.0),
        search_s=float(b.get("search_s") or 0.0),
        confirm_s=float(b.get("confirm_s") or 0.0),
        elapsed_s=result.tuning_time_s,
    )
    return JobOutcome(
        job_id=result.job_id,
        model=result.model,
        tuned_model=result.ddp_config,
        result_json=result.result_json,
        precision=Precision.EXACT,
        job_type=JobType.GDAT,
        device=f"{result.backend} world of {result.world_size}",
        tuning_time_s=result.tuning_time_s,
        figures=_figures(result),
        bank=result.bank,
        resources={k: float(v) for k, v in result.resources.items() if isinstance(v, int | float)},
        budget=budget,
        notes=tuple(result.notes),
        workspace=result.workspace,
        details=_details(result),
    )


def result_doc(result: GdatResult) -> dict[str, Any]:
    """The AOE-shaped result document of a finished GDAT job."""
    tuned = "from the bank" if result.from_bank else "tuning successful"
    outcome = to_outcome(result)
    return {
        "basic": {
            "tuning_name": Path(result.model).stem,
            "tuning_time(s)": round(result.tuning_time_s, 3),
            "job_id": result.job_id,
            "precision": result.precision,
            "device": f"{result.backend} world of {result.world_size}",
        },
        "GDAT": {
            "model_baseline_performance(ms)": round(result.baseline_ms, 6),
            "model_result_performance(ms)": round(result.result_ms, 6),
            "model_performance_improvement": round(result.improvement, 4),
            "model_performance_improvement_ci95": [round(v, 4) for v in result.improvement_ci95],
            "model_performance_verdict": result.verdict,
            "gdat_tuning_result": tuned,
            "baseline_tail(ms)": round(result.baseline_tail_ms, 6),
            "result_tail(ms)": round(result.result_tail_ms, 6),
            "shipped": "defaults" if result.shipped.is_default else "tuned",
            "ddp_config": result.shipped.to_json(),
            "update_mode": result.update_mode,
            "bank_layer": result.bank_layer,
            "repo_summary": result.bank,
        },
        "figures": outcome.figures.to_dict(),
        "bank": dict(outcome.bank),
        "budget": result.budget,
        "resources": result.resources,
        "workspace": result.workspace,
        "notes": result.notes,
        "details": details_to_dict(outcome.details),
    }

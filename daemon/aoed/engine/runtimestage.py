"""Runtimes as a model-level strategy: another runtime's build of the model competes
with onnxruntime's proposal, as deployed.

After verification has proposed what onnxruntime would ship (the tuned model, options
only, or the input), a compile worker builds the input model for OpenVINO in the
variants the job's precision policy allows (`VARIANTS`: f32 under every policy; bf16 or
f16 under the reduced-float policies and int8, where the CPU computes in them; NNCF
post-training int8 under int8 alone, its float rest in f32 and, where the CPU has it, in
bf16, and for a model with attention by NNCF's general preset too) and one deployed measurement times them in the same rounds as the input on
onnxruntime's defaults (the fp32 reference every output is compared with) and
onnxruntime's proposal, each in a process of its own.

A variant can win only if its outputs pass the job's end-to-end accuracy gate on the
measurement's inputs and on every held-back sample, and it is clearly faster
(decisions.clearly_faster) than onnxruntime's proposal (`--runtime openvino`: not
clearly slower); of those, the fastest wins. `--runtime onnxruntime` (or the config's
`[tuning] runtime` for a job that says auto) skips the stage: OpenVINO is never
started; `auto` where OpenVINO is not installed says so once in the notes, and
`openvino` there fails the job naming the option.
`exact` allows float rounding only, so there only f32 competes. What wins goes to the
confirming A/B, which measures it against the input on onnxruntime's defaults like any
proposal and names the runtime in every figure; where the A/B does not confirm it,
onnxruntime's proposal is confirmed next, as if no other runtime had competed.

The stage's device time counts in the job's budget (budget.py): it is what verification
left, at most `MEASURE_S` (plus loading the sessions), kept for it from the start where
OpenVINO is there (`comparison_s`: search.py asks a worker while the device profiles),
and with less than
`MIN_COMPARE_S` left the builds are not made (the notes say so), unless the job asked
for OpenVINO by name. Building takes seconds on the sample models (NNCF's statistics on
the calibration samples) and is compile work, not device time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aoe.errors import DeviceError, ModelError, OptionError
from aoe.ovartifact import RuntimeDecision
from aoe.spec import Runtime, Stage
from aoed.engine import decisions
from aoed.engine.assemble import tuned_metadata
from aoed.engine.budget import Budget, loading_s, model_mib
from aoed.engine.context import JobContext
from aoed.engine.messages import (
    Accuracy,
    Build,
    Candidate,
    CompareRequest,
    Measurement,
    MeasurePlan,
    RuntimeBuildReply,
    RuntimeBuildRequest,
)
from aoed.engine.pool import model_step
from aoed.engine.verify import Verified

__all__ = [
    "MEASURE_S",
    "MIN_COMPARE_S",
    "VARIANTS",
    "RuntimeChoice",
    "comparison_s",
    "compete",
    "competes",
    "offer",
]

#: Device seconds of the competing measurement's rounds (its sessions' loading apart).
MEASURE_S = 2.0
#: Fewer device seconds than this left in the budget: no builds, no comparison (five
#: rounds of a few sessions as deployed, on the sample models).
MIN_COMPARE_S = 1.0
#: The comparison's wall-clock limit beyond its rounds: loading every build (OpenVINO
#: compiles each for the device; a model it cannot compile must not hold the job: one
#: hostile If graph kept OpenVINO 2026.4's CPU plugin compiling for minutes), plus this
#: much per MiB of model per build.
COMPARE_LIMIT_S = 15.0
COMPARE_LIMIT_S_PER_MIB = 0.2
#: The variants each precision policy lets OpenVINO compete with, in order of
#: preference on a tie (the most exact first).
VARIANTS: dict[str, tuple[str, ...]] = {
    "exact": ("f32",),
    "bf16": ("f32", "bf16"),
    "fp16": ("f32", "f16", "bf16"),
    "int8": ("f32", "bf16", "int8", "int8_bf16", "int8_general"),
    "int4": ("f32", "bf16"),
}
_VARIANT_WORDS = {
    "f32": "float32 compute",
    "bf16": "bfloat16 compute",
    "f16": "float16 compute",
    "int8": "NNCF post-training int8",
    "int8_bf16": "NNCF post-training int8, bfloat16 for the rest",
    "int8_general": "NNCF post-training int8 by its general preset, bfloat16 for the rest",
}
#: The runtimes that compete at the model level, and what their candidates are called.
OTHER = "openvino"


@dataclass(frozen=True)
class RuntimeChoice:
    """What the competition chose: onnxruntime's proposal (`runtime` onnxruntime, no
    model), or another runtime's artifact with the options it runs with; `table` is
    every candidate measured, for the result."""

    runtime: str = "onnxruntime"
    variant: str = ""
    model: Path | None = None
    options: dict[str, Any] = field(default_factory=dict)
    table: list[dict[str, Any]] = field(default_factory=list)
    #: its accuracy over the held-back samples (Accuracy.report), when another won
    accuracy: dict[str, Any] = field(default_factory=dict)
    #: rebuilt as the bank's model-level record says (no competition measured)
    from_bank: bool = False
    #: the OpenVINO that built and measured it (aoe.ovdevices.Offer.to_dict), when it ran
    offer: dict[str, Any] = field(default_factory=dict)

    @property
    def other(self) -> bool:
        return self.runtime != "onnxruntime"

    def decision(self) -> RuntimeDecision:
        """What the bank keeps of it (aoe.ovartifact.RuntimeDecision)."""
        return RuntimeDecision(
            self.runtime, self.variant, dict(self.options), str(self.offer.get("version", ""))
        )


def _asked(ctx: JobContext) -> Runtime:
    asked = ctx.spec.runtime
    return Runtime(ctx.config.runtime) if asked == Runtime.AUTO else asked


def _variants(ctx: JobContext) -> tuple[str, ...]:
    return VARIANTS.get(str(ctx.spec.precision), ("f32",))


def competes(ctx: JobContext) -> bool:
    """Whether this job lets another runtime compete: it (or, for auto, the
    configuration) does not settle on onnxruntime, and its device is a CPU."""
    return _asked(ctx) != Runtime.ONNXRUNTIME and ctx.device.device.is_cpu


async def offer(ctx: JobContext) -> RuntimeBuildReply:
    """What OpenVINO is where the job's workers run (its `offer`: the version, or
    `why_not`), asked of a compile worker once per job. ModelError when the worker
    fails."""
    if ctx.runtime_offer is None:
        ctx.runtime_offer = await model_step(
            ctx.pool,
            RuntimeBuildRequest(OTHER, ctx.run.model, ctx.workspace.scratch / "openvino", (), ()),
            ctx.ledger,
            ctx.run.model,
            "asking for OpenVINO",
        )
    reply: RuntimeBuildReply = ctx.runtime_offer
    return reply


async def comparison_s(ctx: JobContext, load_s_per_mib: float | None) -> float:
    """The device seconds the comparison would take on this job (its rounds and its
    sessions' loading at `load_s_per_mib`, as profiled), to keep for it from the start
    (budget.py); 0 where nothing
    competes: onnxruntime settled, another device, or no OpenVINO there."""
    if not competes(ctx):
        return 0.0
    try:
        if (await offer(ctx)).offer.get("why_not"):
            return 0.0
    except ModelError:
        return 0.0
    return MEASURE_S + loading_s(load_s_per_mib, _sessions(ctx))


def _sessions(ctx: JobContext) -> list[Path]:
    """The model files the comparison loads a session of: the input, onnxruntime's
    proposal and each variant's build, each about the input model's size."""
    return [ctx.run.model] * (2 + len(_variants(ctx)))


async def compete(
    ctx: JobContext,
    v: Verified,
    calibrate: tuple[Path, ...],
    budget: Budget,
    banked: RuntimeDecision | None = None,
) -> RuntimeChoice:
    """OpenVINO's variants against onnxruntime's proposal `v` (module doc); the choice.
    `banked`: the build the bank's confirmation of exactly these choices shipped, which
    is rebuilt and taken without measuring (the confirmation is the bank's too). A
    failed build or device costs the competition (said in the notes), never the job."""
    asked = _asked(ctx)
    if not competes(ctx):
        return RuntimeChoice()
    assert ctx.prep is not None
    ctx.ledger.enter("runtime")  # a stage of the result's budget table only when it runs
    variants = _variants(ctx)
    if banked is not None and banked.variant in variants:
        got = await _from_bank(ctx, banked, calibrate)
        if got is not None:
            return got
    # What OpenVINO is here, if any, before anything is built: where there is none, the
    # notes (or, asked for by name, the job's error) say so whatever the budget left.
    try:
        probe = await offer(ctx)
    except ModelError as exc:
        ctx.notes.append(f"OpenVINO not compared: {exc}")
        return RuntimeChoice()
    if probe.offer.get("why_not"):
        if asked == Runtime.OPENVINO:
            raise OptionError(
                f"--runtime openvino: {probe.offer['why_not']} where the job runs; "
                "install it there, or use --runtime auto"
            )
        ctx.notes.extend(probe.notes)
        return RuntimeChoice()
    # MEASURE_S of rounds once the sessions are loaded: the loading comes on top of them,
    # never out of them, as long as the budget has the seconds.
    sessions = _sessions(ctx)
    seconds, _load = budget.measurable(
        min(MEASURE_S + budget.load_estimate(sessions), budget.for_runtime()), sessions
    )
    if seconds < MIN_COMPARE_S and asked != Runtime.OPENVINO:
        ctx.notes.append(
            f"runtimes: OpenVINO not compared, the budget is spent ({budget.remaining_s:.1f} s "
            f"left; the comparison needs {MIN_COMPARE_S:.0f} s and its sessions' loading)"
        )
        return RuntimeChoice()
    await ctx.stage(
        Stage.RUNTIME,
        f"runtimes: OpenVINO ({', '.join(variants)}) against onnxruntime's proposal, a process per model",
    )
    out = ctx.workspace.scratch / "openvino"
    try:
        built: RuntimeBuildReply = await model_step(
            ctx.pool,
            RuntimeBuildRequest(OTHER, ctx.run.model, out, variants, calibrate),
            ctx.ledger,
            ctx.run.model,
            "building OpenVINO candidates",
        )
    except ModelError as exc:  # the worker raised, crashed or overran: this stage's loss
        ctx.notes.append(f"OpenVINO not compared: its build failed ({exc})")
        return RuntimeChoice()
    if asked == Runtime.OPENVINO and built.offer.get("why_not"):
        raise OptionError(
            f"--runtime openvino: {built.offer['why_not']} where the job runs; "
            "install it there, or use --runtime auto"
        )
    ctx.notes.extend(built.notes)
    if not built.artifacts:
        return RuntimeChoice()
    cands = [Candidate("input", ctx.run.model)]
    if v.outcome != "reverted to input":
        ort = ctx.workspace.scratch / "runtime_onnxruntime.onnx"
        meta = tuned_metadata(
            v.options, ctx.spec.precision, ctx.fingerprint.digest, ctx.device.device
        )
        source = ctx.prep.prepared if v.source != "input" else ctx.run.model
        await ctx.assemble([Build(ort, dict(v.choices), meta)], source=source)
        cands.append(Candidate("onnxruntime", ort, v.options))
    artifacts = {f"{OTHER}_{a.name}": a for a in built.artifacts}
    table: list[dict[str, Any]] = [
        {"name": n, "runtime": a.runtime, "options": dict(a.options), "error": a.error}
        for n, a in artifacts.items()
        if a.error or a.model is None
    ]
    for n, a in artifacts.items():
        if a.model is not None and not a.error:
            cands.append(Candidate(n, a.model, dict(a.options), runtime=a.runtime))
    try:
        measured = await ctx.measure(
            cands,
            "input",
            max(seconds, MIN_COMPARE_S),
            limit_s=COMPARE_LIMIT_S
            + 3 * max(seconds, MIN_COMPARE_S)
            + COMPARE_LIMIT_S_PER_MIB * model_mib([ctx.run.model]) * len(cands),
            plan=MeasurePlan(min_rounds=5, max_rounds=10, deployed=True),
            category="runtime",
        )
    except DeviceError as exc:
        ctx.notes.append(f"OpenVINO not compared: the measurement failed ({exc})")
        return RuntimeChoice(table=table, offer=built.offer)
    incumbent = (
        "onnxruntime" if "onnxruntime" in measured and measured["onnxruntime"].ok else "input"
    )
    passed: list[str] = []
    for c in cands:
        m = measured[c.id]
        row = _row(c, m)
        if c.runtime != "onnxruntime" and m.ok:
            row["gate"] = _gate(ctx, m, measured[incumbent], incumbent, asked == Runtime.OPENVINO)
            if row["gate"] == "passed":
                passed.append(c.id)
        table.append(row)
    for name in sorted(passed, key=lambda n: measured[n].median_us):
        a = artifacts[name]
        assert a.model is not None
        acc = await _held_back(ctx, a.model, a.options)
        row = next(r for r in table if r["name"] == name)
        if acc is None or not ctx.policy.e2e_ok(acc.as_dict()):
            row["gate"] = (
                "not compared on the held-back samples"
                if acc is None
                else f"outside the accuracy budget on the held-back samples ({_acc_text(acc.as_dict())})"
            )
            continue
        row["held_back"] = acc.report()
        ctx.notes.append(
            f"runtime: OpenVINO {a.name} ({_VARIANT_WORDS[a.name]}) was "
            f"{'not clearly slower' if asked == Runtime.OPENVINO else 'clearly faster'} than onnxruntime's "
            f"{'proposal' if incumbent == 'onnxruntime' else 'input'} as deployed "
            f"({measured[name].median_us / 1000:.4f} ms against {measured[incumbent].median_us / 1000:.4f} ms) "
            "and within the accuracy budget: it goes to the confirming A/B"
        )
        return RuntimeChoice(
            a.runtime, a.name, a.model, dict(a.options), table, acc.report(), offer=built.offer
        )
    return RuntimeChoice(table=table, offer=built.offer)


async def _from_bank(
    ctx: JobContext, banked: RuntimeDecision, calibrate: tuple[Path, ...]
) -> RuntimeChoice | None:
    """The bank's build rebuilt (None, said in the notes, when it cannot be)."""
    await ctx.stage(Stage.RUNTIME, f"runtimes: OpenVINO {banked.variant}, from the bank")
    try:
        built: RuntimeBuildReply = await model_step(
            ctx.pool,
            RuntimeBuildRequest(
                OTHER,
                ctx.run.model,
                ctx.workspace.scratch / "openvino",
                (banked.variant,),
                calibrate,
            ),
            ctx.ledger,
            ctx.run.model,
            "building the bank's OpenVINO model",
        )
    except ModelError as exc:
        ctx.notes.append(f"the bank's OpenVINO {banked.variant} model could not be built ({exc})")
        return None
    if built.offer.get("why_not"):
        return None  # the competition says why, once
    if banked.version and banked.version != built.offer.get("version"):
        ctx.notes.append(
            f"the bank's OpenVINO {banked.variant} model was measured on OpenVINO {banked.version}, "
            f"this is {built.offer.get('version')}: measured again"
        )
        return None
    for a in built.artifacts:
        if a.name == banked.variant and a.model is not None and not a.error:
            ctx.notes.append(
                f"runtime: OpenVINO {a.name} ({_VARIANT_WORDS[a.name]}), as the bank's "
                "confirmation of these choices shipped it"
            )
            return RuntimeChoice(
                a.runtime, a.name, a.model, dict(banked.options), from_bank=True, offer=built.offer
            )
    why = "; ".join([*built.notes, *(a.error for a in built.artifacts if a.error)]) or "not built"
    ctx.notes.append(f"the bank's OpenVINO {banked.variant} model was not used: {why}")
    return None


def _row(c: Candidate, m: Measurement) -> dict[str, Any]:
    return {
        "name": c.id,
        "runtime": c.runtime,
        "options": dict(c.options),
        "median_ms": round(m.median_us / 1000, 6) if m.ok else None,
        "accuracy": m.accuracy() if m.ok else {},
        "error": m.error,
    }


def _acc_text(acc: dict[str, float]) -> str:
    return f"cosine {acc['cosine']:.6f}, max relative error {acc['max_rel_error']:.3g}"


def _gate(ctx: JobContext, m: Measurement, incumbent: Measurement, name: str, prefer: bool) -> str:
    """ "passed", or why `m` cannot win against `incumbent` (named `name`): it must pass
    the accuracy gate and be clearly faster, or (`prefer`: --runtime openvino) not
    clearly slower."""
    if not ctx.policy.e2e_ok(m.accuracy()):
        return f"outside the {ctx.policy.name} accuracy budget ({_acc_text(m.accuracy())})"
    if prefer and not decisions.clearly_slower(m, incumbent):
        return "passed"
    if not decisions.clearly_faster(m, incumbent):
        med, lo, hi = decisions.paired_ratio(m, incumbent)
        return f"not clearly faster than {name} (time ratio {med:.3f}, 90% interval {lo:.3f}..{hi:.3f})"
    return "passed"


async def _held_back(ctx: JobContext, model: Path, options: dict[str, Any]) -> Accuracy | None:
    """Accuracy of `model` on OpenVINO against the input on onnxruntime over every
    held-back sample (None when the device could not say)."""
    try:
        reply: Accuracy = await ctx.device.call(
            CompareRequest(
                ctx.run.model,
                model,
                tuple(ctx.held_back),
                ctx.device.device,
                dict(options),
                runtime=OTHER,
            ),
            ctx.ledger,
            category="runtime",
        )
    except DeviceError as exc:
        ctx.notes.append(f"OpenVINO candidate {model.name}: accuracy not compared ({exc})")
        return None
    return reply

"""What came out of a tuning job: `JobOutcome`, the one shape of a job's result.

The engine builds it once, when a job ends; every surface reads it: the CLI's summary
(`summary_lines`, for `aoe tune` embedded and on a daemon alike), the daemon's job store
(`to_dict`/`from_dict`), the API's JobResult message (aoe.wire), the drop folder's
report (aoed.watch.report) and the result JSON (aoed.engine.outputs). Its whole-model figures
are `aoe.figures.Figures`, under the one rule that module states.

Two counts every surface takes from here, never forms on its own:
- A *task* is one row of the job's per-task table (`JobOutcome.tasks`): one operator or
  subgraph of the model, where identical ones (one signature) are one task, tuned once
  (its `instances` say how many). The summary's "tasks", the progress bar and the
  progress events' total, the result JSON's `tasks` and `total_num` all count these.
- The *bank tally* (`bank_tally`) is AOE's repo summary over those rows: one decision
  per task. The model-level record (session options, the confirmation) is the model's,
  not a task's, and is not counted in it. The daemon's `aoed_bank_lookups_total` moves
  by the same tally when a job's result is written.

What only one kind of job has is its `details`: a tagged union of msgspec Structs
(`OnnxDetails` | `GdatDetails`), told apart by the outcome's job type. They travel as
the result JSON's `details` object, which holds their fields and not the tag (the
outcome's `job_type` says it): `details_to_dict` / `details_from_dict`. Each kind of
details also says the words its job's figures are said in (`aoe.figures.Words`).

Light on purpose: no onnx, no grpc.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from aoe import figures
from aoe.figures import Figures, Words
from aoe.plain import from_plain, to_plain
from aoe.spec import JobType, Precision, Stage

__all__ = [
    "GDAT_WORDS",
    "BudgetReport",
    "Details",
    "GdatDetails",
    "JobOutcome",
    "OnnxDetails",
    "StageTime",
    "TaskOutcome",
    "UpdateMode",
    "bank_tally",
    "details_from_dict",
    "details_to_dict",
    "summary_lines",
]


class UpdateMode(enum.StrEnum):
    """What a task's decision did to the bank (AOE's words, and ours for the rest)."""

    ADD = "add"
    UPDATE = "update"
    RESERVED = "reserved"
    HIT = "hit"
    UNSATISFIED = "unsatisfied"
    FAILED = "failed"  # its measurement failed
    SKIPPED = "skipped"  # the budget left it untuned
    NONE = ""  # not decided

    @property
    def measured(self) -> bool:
        """Whether this job measured the task to decide it."""
        return self in (
            UpdateMode.ADD,
            UpdateMode.UPDATE,
            UpdateMode.RESERVED,
            UpdateMode.UNSATISFIED,
        )

    @property
    def known(self) -> bool:
        """Whether the bank knew the task (AOE's "hit": answered from it, or tuned again
        over its entry under REPEAT_TUNE)."""
        return self in (UpdateMode.HIT, UpdateMode.RESERVED, UpdateMode.UPDATE)


def bank_tally(modes: Iterable[str]) -> dict[str, int]:
    """The bank tally of a job's tasks, from each task's update mode: AOE's repo_summary
    counts. `repo_hit_num` counts every task the bank knew (`UpdateMode.known`), so hit +
    add + unsatisfied + not tuned = total = the number of tasks; `repo_not_tuned_num`
    (ours) counts the tasks the budget left untuned or whose measurement failed."""
    ms = [UpdateMode(m) for m in modes]
    return {
        "repo_not_tuned_num": sum(m in (UpdateMode.SKIPPED, UpdateMode.FAILED) for m in ms),
        "repo_add_num": ms.count(UpdateMode.ADD),
        "repo_hit_num": sum(m.known for m in ms),
        "repo_reserved_num": ms.count(UpdateMode.RESERVED),
        "repo_unsatisfied_num": ms.count(UpdateMode.UNSATISFIED),
        "repo_update_num": ms.count(UpdateMode.UPDATE),
        "total_num": len(ms),
    }


@dataclass(frozen=True)
class TaskOutcome:
    """One task's row of the per-task table."""

    task_id: str
    op_name: str
    op_type: str
    family: str = ""
    instances: int = 1
    share: float = 0.0  # of the model's profiled latency
    strategy: str = "default"
    before_us: float = 0.0
    after_us: float = 0.0
    update_mode: UpdateMode = UpdateMode.NONE
    bank_layer: str = ""
    accuracy: Mapping[str, float] = field(default_factory=dict)
    error: str = ""
    rejected: tuple[str, ...] = ()  # lossy candidates not taken, and why
    applied: bool = True  # False when verification or the confirming A/B left it out
    attempt: int = 0  # the run of the job that measured it; 0: the bank answered

    def __post_init__(self) -> None:
        object.__setattr__(self, "update_mode", UpdateMode(self.update_mode))
        object.__setattr__(self, "rejected", tuple(self.rejected))

    @property
    def improvement(self) -> float:
        """The task's own figure, from the search that chose it: before / after - 1."""
        return (
            (self.before_us / self.after_us - 1.0)
            if self.after_us > 0 and self.before_us > 0
            else 0.0
        )

    @property
    def chosen(self) -> bool:
        return self.strategy != "default"

    @property
    def changed(self) -> bool:
        """Chosen, and in what shipped."""
        return self.chosen and self.applied


@dataclass(frozen=True)
class StageTime:
    """One stage of the budget table: device seconds it kept of the budget (`given_s`; 0
    for what the budget does not cover) and spent beyond them (`over_s`), wall seconds it
    took (`spent_s`), device seconds spent while it ran, the estimate made before it
    (aoed.engine.budget says what given and over are)."""

    given_s: float = 0.0
    spent_s: float = 0.0
    over_s: float = 0.0
    counted: bool = False
    device_s: float | None = None
    estimate_s: float | None = None


@dataclass(frozen=True)
class BudgetReport:
    """The job's device budget and where its time went (aoed.engine.budget)."""

    budget_s: float = 0.0
    given: bool = False  # set by the user rather than fitted
    spent_s: float = 0.0  # device seconds the budget counts
    search_s: float = 0.0
    session_s: float = 0.0
    verify_s: float = 0.0
    profile_s: float = 0.0
    confirm_s: float = 0.0
    load_s_per_mib: float | None = None
    elapsed_s: float = 0.0
    over_s: float = 0.0
    #: every stage, in the order run
    stages: Mapping[Stage, StageTime] = field(default_factory=dict)

    @property
    def outside_s(self) -> float:
        """Wall seconds of the stages the budget does not cover: outside it, not over it."""
        return sum(st.spent_s for st in self.stages.values() if not st.counted)

    def to_dict(self) -> dict[str, Any]:
        """The result JSON's `budget` section: the fields as plain data (aoe.plain), with
        `outside_s` (derived) before the stages, and each stage without its unset (None)
        fields; `from_dict` reads it back."""
        d = to_plain(self)
        stages = d.pop("stages")
        d["outside_s"] = round(self.outside_s, 3)
        d["stages"] = {
            name: {k: v for k, v in st.items() if v is not None} for name, st in stages.items()
        }
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BudgetReport:
        """From `to_dict`'s object, or Budget.report()'s (`outside_s` is derived, not
        read; a field it lacks takes its default)."""
        return from_plain(cls, d)


#: aoe.figures' words as a GDAT job says them: its input is DDP's defaults, its output a
#: DDP configuration.
GDAT_WORDS = Words(
    input="DDP's defaults",
    unchanged="DDP's defaults, unchanged",
    tuned="the tuned configuration",
    second="a second instance of DDP's defaults in the same rounds",
    nothing_passed="no configuration beat DDP's defaults in the search",
)


class OnnxDetails(msgspec.Struct, frozen=True, tag="onnx", tag_field="kind"):
    """An ONNX job's details: none beyond the outcome's own fields (its result JSON's
    other sections are written beside them: aoed.engine.outputs)."""

    words: ClassVar[Words] = figures.ONNX_WORDS


class GdatDetails(msgspec.Struct, frozen=True, tag="gdat", tag_field="kind"):
    """What only a GDAT job has (aoed.gdat.outcome): its world, the DDP configuration it
    shipped, the tails, the search's configurations and gates. The nested documents are
    the result JSON's own (docs/gdat.md)."""

    words: ClassVar[Words] = GDAT_WORDS

    gradient_precision: str = "exact"
    backend: str = "gloo"
    world_size: int = 0
    #: the slowest rank's tail (its step past the others'), in ms
    baseline_tail_ms: float = 0.0
    result_tail_ms: float = 0.0
    #: the shipped configuration (aoe.gdat.DDPConfig.to_json) and the file it is in
    ddp_config: dict[str, Any] = {}
    ddp_config_file: str = ""
    update_mode: str = ""
    bank_layer: str = ""
    #: the confirming A/B the figures come from
    confirmation: dict[str, Any] = {}
    #: every configuration measured, per stage, with what became of it
    configurations: list[dict[str, Any]] = []
    #: the lossy comm hooks' gates: config, passed, why, max_rel_error
    gates: list[dict[str, Any]] = []
    #: turns whose world broke
    broken_turns: list[dict[str, Any]] = []
    layout: dict[str, Any] = {}


#: What only one kind of job has, told apart by its job type.
Details = OnnxDetails | GdatDetails


def details_to_dict(details: Details) -> dict[str, Any]:
    """`details`' fields as JSON types, without the tag (the outcome's job type is it):
    the result JSON's `details`; `details_from_dict` reads it back."""
    return msgspec.to_builtins(msgspec.structs.asdict(details))


def details_from_dict(job_type: JobType | str, d: Mapping[str, Any]) -> Details:
    """The details of a job of `job_type` from `details_to_dict`'s object (a field it
    lacks takes its default; one it does not know is left out). ValueError naming the
    field whose value has the wrong type."""
    kind = "gdat" if JobType(job_type) == JobType.GDAT else "onnx"
    try:
        return msgspec.convert({**d, "kind": kind}, Details)
    except msgspec.ValidationError as exc:
        raise ValueError(f"details of a {kind} job: {exc}") from None


@dataclass(frozen=True)
class JobOutcome:
    """A finished job: what it measured (`figures`), what shipped, the per-task table,
    what it did to the bank, what it cost, and where its outputs are."""

    job_id: str
    model: str  # the model file the job read
    tuned_model: str
    result_json: str
    precision: Precision
    job_type: JobType
    device: str
    tuning_time_s: float
    figures: Figures
    tasks: tuple[TaskOutcome, ...] = ()
    #: AOE's repo summary (repo_add_num, ..., total_num)
    bank: Mapping[str, int] = field(default_factory=dict)
    #: scalars of what the job cost: device_s, duty_cycle, trials, failed_candidates, ...
    resources: Mapping[str, float] = field(default_factory=dict)
    budget: BudgetReport = field(default_factory=BudgetReport)
    session_options: Mapping[str, Any] = field(default_factory=dict)
    #: end to end, on the held-back samples
    accuracy: Mapping[str, float] = field(default_factory=dict)
    accuracy_budget: Mapping[str, float] = field(default_factory=dict)
    calibration: str = ""
    verified: str = ""  # what verification proposed (tuned | options only | reverted to input)
    #: the runtime `tuned_model` runs on (onnxruntime, or openvino: an IR whose compile
    #: config, `runtime_options`, is beside it; aoe.ovartifact), as `aoe.session` opens it
    runtime: str = "onnxruntime"
    runtime_options: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    workspace: str = ""
    #: what only one job type has (GDAT: the world, the shipped DDP options, the gates,
    #: the tails); the kind its job type names
    details: Details = field(default_factory=OnnxDetails)

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision(self.precision))
        object.__setattr__(self, "job_type", JobType(self.job_type))
        if (self.job_type == JobType.GDAT) != isinstance(self.details, GdatDetails):
            raise ValueError(
                f"a {self.job_type} job's details are not {type(self.details).__name__}"
            )
        object.__setattr__(self, "tasks", tuple(self.tasks))
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def improvement(self) -> float:
        """From the confirming A/B (aoe.figures); 0 when the input shipped."""
        return self.figures.improvement

    @property
    def duty_cycle(self) -> float:
        return float(self.resources.get("duty_cycle", 0.0))

    @property
    def unshipped(self) -> int:
        """Tasks the search chose that are not in what shipped."""
        return sum(t.chosen and not t.applied for t in self.tasks)

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (aoe.plain), but for the three sections with a layout
        of their own: the figures (`Figures.to_dict`), the budget (`BudgetReport.to_dict`)
        and the details (their fields without the tag); `from_dict` reads it back."""
        return {
            **to_plain(self),
            "figures": self.figures.to_dict(),
            "budget": self.budget.to_dict(),
            "details": details_to_dict(self.details),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobOutcome:
        """From `to_dict`'s keys. A result stored before outcomes had their own shape
        (the figures at the top level, `repo`, fewer task fields) reads too."""
        if "figures" not in d:  # stored by an older daemon
            return cls._from_old(d)
        return cls(
            job_id=d["job_id"],
            model=d["model"],
            tuned_model=d["tuned_model"],
            result_json=d["result_json"],
            precision=d["precision"],
            job_type=d["job_type"],
            device=d["device"],
            tuning_time_s=d["tuning_time_s"],
            figures=Figures.from_dict(d["figures"]),
            tasks=from_plain(tuple[TaskOutcome, ...], d.get("tasks", ())),
            bank=d.get("bank", {}),
            resources=d.get("resources", {}),
            budget=BudgetReport.from_dict(d.get("budget") or {}),
            session_options=d.get("session_options", {}),
            accuracy=d.get("accuracy", {}),
            accuracy_budget=d.get("accuracy_budget", {}),
            calibration=d.get("calibration", ""),
            verified=d.get("verified", ""),
            runtime=d.get("runtime", "onnxruntime"),
            runtime_options=d.get("runtime_options", {}),
            notes=tuple(d.get("notes", ())),
            workspace=d.get("workspace", ""),
            details=details_from_dict(d["job_type"], d.get("details") or {}),
        )

    @classmethod
    def _from_old(cls, d: Mapping[str, Any]) -> JobOutcome:
        tasks = tuple(
            TaskOutcome(
                t.get("task_id", ""),
                t.get("op_name", ""),
                t.get("op_type", ""),
                strategy=t.get("strategy", "default"),
                before_us=t.get("before_us", 0.0),
                after_us=t.get("after_us", 0.0),
                update_mode=t.get("update_mode", ""),
                bank_layer=t.get("bank_layer", ""),
                accuracy=t.get("accuracy", {}),
                error=t.get("error", ""),
                applied=not (t.get("strategy", "default") != "default" and t.get("error")),
            )
            for t in d.get("tasks", ())
        )
        return cls(
            job_id="",
            model="",
            tuned_model=d.get("tuned_model", ""),
            result_json=d.get("result_json", ""),
            precision=Precision.EXACT,
            job_type=JobType.OPAT,
            device="",
            tuning_time_s=d.get("tuning_time_s", 0.0),
            figures=Figures.from_dict(d),
            tasks=tasks,
            bank=d.get("repo", {}),
            resources=d.get("resources", {}),
        )


# --------------------------------------------------------------------------- the CLI's summary

#: How the budget line names a result's stages.
_STAGE_WORDS = {
    Stage.PREPARE: "preparing",
    Stage.BANK: "bank lookups",
    Stage.PROFILE: "profiling",
    Stage.SEARCH: "search",
    Stage.ASSEMBLE: "assembling",
    Stage.ACCURACY: "accuracy",
    Stage.SESSION: "session options",
    Stage.VERIFY: "verifying",
    Stage.RUNTIME: "runtimes",
    Stage.CONFIRM: "confirming",
    Stage.OUTPUTS: "outputs",
    Stage.CALIBRATE: "calibrating",
}


def budget_line(b: BudgetReport) -> str | None:
    """The budget in one line, in docs/tuning.md's words: the device seconds given and
    spent (and over, only when the counted stages passed the budget), what the job took,
    the part outside the budget, and each stage (under 0.05 s left out): a counted one
    with the device seconds it was given, one outside with its estimate. None without
    stages."""
    if not b.stages:
        return None
    parts = []
    for name, st in b.stages.items():
        if st.spent_s < 0.05:
            continue
        extra = [f"{st.given_s:.1f} s of device time given"] if st.counted else []
        if st.counted and st.over_s >= 0.05:
            extra.append(f"{st.over_s:.1f} s over")
        if st.estimate_s is not None:
            extra.append(f"estimated {st.estimate_s:.1f}")
        parts.append(
            f"{_STAGE_WORDS.get(name, name)} {st.spent_s:.1f} s"
            + (f" ({', '.join(extra)})" if extra else "")
        )
    head = f"{b.budget_s:g} s given, {b.spent_s:.1f} s spent"
    if b.over_s >= 0.05:
        head += f" ({b.over_s:.1f} s over)"
    head += f"; the job took {b.elapsed_s:.1f} s, {b.outside_s:.1f} s of it outside the budget"
    return head + (": " + ", ".join(parts) if parts else "")


def summary_lines(
    o: JobOutcome,
    *,
    where: str = "",
    took_s: float | None = None,
    files: tuple[Path | None, Path | None] = (None, None),
) -> list[str]:
    """The CLI's summary of a finished job, as lines. `where`: " on the daemon" and the
    like; `took_s`: the wall time to report (default: the job's tuning time); `files`:
    the tuned model and result JSON where they were written locally (else the outcome's
    paths, said to be on the daemon's host when `where` is given)."""
    if o.job_type == JobType.GDAT:
        return _gdat_lines(o, where, took_s, files)
    f, res, b = o.figures, o.resources, o.budget
    measured = sum(t.update_mode.measured for t in o.tasks)
    hits = sum(t.update_mode == UpdateMode.HIT for t in o.tasks)
    failed = sum(t.update_mode == UpdateMode.FAILED for t in o.tasks)
    skipped = sum(t.update_mode == UpdateMode.SKIPPED for t in o.tasks)
    chosen = [t for t in o.tasks if t.chosen]
    changed = [t for t in chosen if t.applied]
    took = o.tuning_time_s if took_s is None else took_s
    job = f"job {o.job_id}; " if where and o.job_id else ""
    out = [
        f"aoe: tuned {Path(o.model).name}{where} in {took:.1f} s ({job}{o.precision} on {o.device or '-'})"
    ]
    said = (
        f"from the bank: confirmed by {f.confirmed_by}"
        if f.confirmed_by
        else f"confirming A/B, {f.rounds} rounds, a process per model as deployed"
    )
    out.append(f"  baseline     {f.baseline_ms:.4f} ms   ({said})")
    out.append(f"  result       {figures.result_text(f)}")
    out.append(f"  verdict      {figures.verdict_text(f)}")
    if o.runtime != "onnxruntime":
        props = ", ".join(f"{k}={v}" for k, v in o.runtime_options.items())
        out.append(
            f"  runtime      {o.runtime} ({props}): its build ships, measured against the input "
            "on onnxruntime"
        )
    out.append(
        f"  tasks        {len(o.tasks)}: {measured} measured, {hits} from the bank"
        + (f", {failed} failed" if failed else "")
        + (f", {skipped} not tuned (budget)" if skipped else "")
        + f"; {figures.changed_text(len(changed), len(chosen), f.shipped)}"
    )
    out.append(
        f"  device       {res.get('trials', 0):g} trials, {res.get('failed_candidates', 0):g} failed candidates; "
        f"{b.spent_s:.1f} s of a {b.budget_s:g} s budget, plus {b.profile_s + b.confirm_s:.1f} s profiling "
        f"and confirming; busy {o.duty_cycle:.0%} of the job"
    )
    line = budget_line(b)
    if line:
        out.append(f"  budget       {line}")
    if changed:
        out.append("  changed      (each task's own figure, from the search that chose it)")
    out += [
        f"    {t.op_name:<40} {t.op_type:<14} {t.strategy:<22} {figures.pct(t.improvement)}"
        for t in changed
    ]
    if o.session_options:
        out.append(f"  session      {dict(o.session_options)}")
    lossy = o.precision != Precision.EXACT
    if lossy and f.shipped == "input":
        out.append("  accuracy     the input model ships: its outputs are the reference")
        out.append(f"  calibration  {o.calibration}")
    elif lossy and not o.accuracy:
        out.append("  accuracy     as the bank's confirmation of this model measured it")
    elif lossy:
        acc, top1 = o.accuracy, o.accuracy.get("top1_agreement")
        out.append(
            f"  accuracy     over {acc.get('samples', 1):g} held-back samples: cosine min "
            f"{acc.get('cosine', 0):.5f}, 5th percentile {acc.get('cosine_p5', acc.get('cosine', 0)):.5f}, "
            f"max rel error {acc.get('max_rel_error', 0):.3g}"
            + (f", top-1 agreement {top1:.1%}" if top1 is not None else "")
            + f" (budget: cosine >= {o.accuracy_budget.get('min_cosine')}, max rel error <= "
            f"{o.accuracy_budget.get('max_rel_error')})"
        )
        out.append(f"  calibration  {o.calibration}")
    if lossy:
        out += [
            f"    {t.op_name:<40} kept {t.strategy}: {t.rejected[0]}"
            for t in o.tasks
            if t.rejected and not t.strategy.startswith("int8")
        ]
    out.append(f"  bank         {figures.bank_text(o.bank, len(chosen) - len(changed))}")
    out += [f"  note         {note}" for note in o.notes]
    remote = " (on the daemon host)" if where else ""
    out.append(f"  tuned model  {files[0] or o.tuned_model + remote}")
    out.append(f"  report       {files[1] or o.result_json + remote}")
    return out


def ddp_text(details: GdatDetails) -> str:
    """The DDP configuration a GDAT job shipped (its `details`), in a few words: its label,
    DDP's keyword arguments and the comm hook."""
    ddp = details.ddp_config
    hook = (ddp.get("comm_hook") or {}).get("name")
    return f"{ddp.get('label', 'default')}: {ddp.get('ddp_kwargs') or 'no options'}" + (
        f", comm hook {hook}" if hook else ""
    )


def _gdat_lines(
    o: JobOutcome, where: str, took_s: float | None, files: tuple[Path | None, Path | None]
) -> list[str]:
    """summary_lines for a GDAT job: step times of the world instead of a model's, the
    DDP options that ship instead of tasks, and the gates of lossy hooks."""
    f, b, d = o.figures, o.budget, o.details
    assert isinstance(d, GdatDetails)  # (JobOutcome holds it: a gdat job's details)
    took = o.tuning_time_s if took_s is None else took_s
    job = f"job {o.job_id}; " if where and o.job_id else ""
    out = [
        f"aoe: tuned {Path(o.model).name}{where} in {took:.1f} s ({job}gdat, {d.gradient_precision} "
        f"gradients, {o.device})"
    ]
    said = (
        f"from the bank: confirmed by {f.confirmed_by}"
        if f.confirmed_by
        else f"confirming A/B, {f.rounds} interleaved rounds of the world"
    )
    out.append(
        f"  baseline     {f.baseline_ms:.4f} ms per step, tail {d.baseline_tail_ms:.4f} ms   "
        f"(DDP's defaults; {said})"
    )
    tail = f"; tail {d.result_tail_ms:.4f} ms" if f.changed else ""
    out.append(f"  result       {figures.result_text(f, words=d.words)}{tail}")
    out.append(f"  verdict      {figures.verdict_text(f, d.words)}")
    out.append(f"  ddp          {ddp_text(d)}")
    if not f.confirmed_by:
        confs = d.configurations
        measured = {c["name"] for c in confs if c.get("step_ms") is not None}
        failed = sum(c.get("status") == "failed" for c in confs)
        rejected = sum(c.get("status") == "rejected" for c in confs)
        broken = len(d.broken_turns)
        out.append(
            f"  search       {len(measured)} configurations in {o.resources.get('worlds', 1):g} world(s)"
            + (f", {failed} failed" if failed else "")
            + (f", {rejected} rejected by the gradient gate" if rejected else "")
            + (f", {broken} broken turns" if broken else "")
            + f"; {b.spent_s:.1f} s of a {b.budget_s:g} s budget, plus {b.confirm_s:.1f} s confirming"
        )
    out += [
        f"  gate         {g['config']}: {'passed' if g.get('passed') else 'rejected'}: {g.get('why', '')}"
        for g in d.gates
    ]
    out.append(f"  bank         {figures.bank_text(o.bank)}")
    out += [f"  note         {note}" for note in o.notes]
    remote = " (on the daemon host)" if where else ""
    out.append(f"  ddp config   {files[0] or o.tuned_model + remote}")
    out.append(f"  report       {files[1] or o.result_json + remote}")
    return out

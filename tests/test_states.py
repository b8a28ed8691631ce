"""The job state machine (aoed.jobs.states): every transition it has, every one it has
not, and a state that follows the engine's typed stages, never the words of its messages."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from aoe.spec import JobSpec, Stage
from aoed.engine.messages import JobEvent
from aoed.jobs import states
from aoed.jobs.manager import JobManager
from aoed.jobs.states import FINAL, STAGE_STATE, TRANSITIONS, JobState, TransitionError, apply
from aoed.jobs.store import JobRow, JobStore

Q, P, T, V = JobState.QUEUED, JobState.PREPARING, JobState.TUNING, JobState.VERIFYING
S, F, C = JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED

#: Every (state, event) -> state the machine has.
ALLOWED = [
    (Q, states.Start(), P),
    (Q, states.Cancel(), C),
    # a queued job that may no longer start (over a limit, interrupted too often)
    (Q, states.Fail(), F),
    *[
        (s, e, t)
        for s in (P, T, V)
        for e, t in (
            (states.Succeed(), S),
            (states.Fail(), F),
            (states.Cancel(), C),
            (states.Requeue(), Q),
        )
    ],
    (P, states.Entered(Stage.PROFILE), T),
    (P, states.Entered(Stage.VERIFY), V),
    (T, states.Entered(Stage.CONFIRM), V),
    # a stage of the state the job is in leaves it there
    (P, states.Entered(Stage.CALIBRATE), P),
    (T, states.Entered(Stage.SESSION), T),
    (V, states.Entered(Stage.OUTPUTS), V),
]

EVENTS = [
    states.Start(),
    states.Succeed(),
    states.Fail(),
    states.Cancel(),
    states.Requeue(),
    *(states.Entered(s) for s in Stage),
]


@pytest.mark.parametrize(
    ("state", "event", "after"), ALLOWED, ids=[f"{s}-{e}" for s, e, _ in ALLOWED]
)
def test_each_transition_the_machine_has(
    state: JobState, event: states.Event, after: JobState
) -> None:
    assert apply(state, event) == after
    assert after == state or after in TRANSITIONS[state]


def test_every_other_event_is_refused_loudly() -> None:
    """Of every (state, event) pair, `apply` takes exactly those the table has (and a
    stage of the state the job is in); every other raises TransitionError naming the
    state. A final state takes nothing; the state never moves back."""
    taken = set()
    for state, event in itertools.product(JobState, EVENTS):
        try:
            after = apply(state, event)
        except TransitionError as exc:
            assert str(state) in str(exc)
            continue
        assert after == state or after in TRANSITIONS[state], (state, event, after)
        taken.add((state, type(event), after))
    assert {s for s, _, _ in taken}.isdisjoint(FINAL)
    assert (T, states.Entered, P) not in taken and (V, states.Entered, T) not in taken
    assert (Q, states.Succeed, S) not in taken  # a job that never ran did not succeed
    assert {(s, type(e), t) for s, e, t in ALLOWED} <= taken


def test_the_stages_run_through_the_states_in_order() -> None:
    """The engine's stages, in the order they run, never move a job's state back."""
    state = P
    for stage in Stage:
        state = apply(state, states.Entered(stage))
    assert state == V
    assert [STAGE_STATE[s] for s in Stage] == sorted(
        (STAGE_STATE[s] for s in Stage), key=[P, T, V].index
    )


def _manager(tmp_path: Path) -> tuple[JobManager, JobStore, JobRow]:
    store = JobStore(tmp_path / "jobs.sqlite")
    # The manager's event handling touches only its store: no engine, no config needed.
    jobs = JobManager(None, store, None)  # type: ignore[arg-type]
    row = JobRow(
        id="job-1",
        state=P,
        model_path="/m.onnx",
        model_name="m.onnx",
        model_sha256="",
        dedup_key="",
        spec=JobSpec(),
        output_dir="/o",
    )
    store.insert(row)
    return jobs, store, row


@pytest.mark.parametrize(
    "words", ["preparing m.onnx", "checking accuracy end to end", "anything at all", ""]
)
def test_the_state_follows_the_stage_not_the_words(tmp_path: Path, words: str) -> None:
    """Whatever a stage's message says, the same stages give the same states: renaming a
    log line changes nothing."""
    jobs, store, row = _manager(tmp_path)
    seen = []
    for stage in (
        Stage.PREPARE,
        Stage.PROFILE,
        Stage.SEARCH,
        Stage.ACCURACY,
        Stage.SESSION,
        Stage.VERIFY,
    ):
        jobs._on_engine_event(row, JobEvent("stage", words, stage=stage))
        seen.append(row.state)
    assert seen == [P, T, T, T, T, V]
    stored = [e.data["state"] for e in store.events("job-1") if e.kind == "state"]
    assert stored == ["tuning", "verifying"], stored
    assert store.get("job-1").state == V
    # A stage event without a stage (text only) moves nothing.
    jobs._on_engine_event(row, JobEvent("stage", "tuning 3 tasks"))
    assert row.state == V


def test_a_stage_out_of_order_fails_loudly(tmp_path: Path) -> None:
    jobs, _, row = _manager(tmp_path)
    jobs._on_engine_event(row, JobEvent("stage", "", stage=Stage.CONFIRM))
    with pytest.raises(TransitionError, match="verifying"):
        jobs._on_engine_event(row, JobEvent("stage", "", stage=Stage.PREPARE))


@pytest.mark.slow
def test_an_embedded_job_announces_typed_stages_the_machine_takes(
    models: Path, tmp_path: Path
) -> None:
    """The engine, run through the embedded door, names a Stage on every stage event, in
    an order the state machine takes from PREPARING to VERIFYING; and the door returns
    the job's outcome."""
    from aoe.config import load_config
    from aoed import embedded

    events: list[JobEvent] = []
    config = load_config(env={}).replace(
        bank=tmp_path / "bank", parallel=1, runtime_dir=tmp_path / "run"
    )
    outcome = embedded.tune(
        models / "mlp.onnx",
        JobSpec(job_type="opat", budget_s=0.5),
        tmp_path / "out",
        config=config,
        progress=events.append,
    )
    stages = [e.stage for e in events if e.kind == "stage"]
    assert all(isinstance(s, Stage) for s in stages), stages
    assert stages[0] == Stage.PREPARE and stages[-1] == Stage.CONFIRM, stages
    state = P
    for stage in stages:
        state = apply(state, states.Entered(stage))
    assert state == V
    assert (
        outcome.job_type == "opat"
        and Path(outcome.result_json).is_file()
        and outcome.figures.baseline_ms > 0
    )

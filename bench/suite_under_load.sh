#!/usr/bin/env bash
# The test suite under load: busy loops beside it, run after run.
#
#     bench/suite_under_load.sh [RUNS] [PYTEST ARGS...]      (make test-load)
#
# Starts LOOPS busy loops (default 2: `python3 -c 'while True: pass'`, one core each),
# runs the suite as `make test` does RUNS times (default 5), one after the other, and
# prints each run's result (pass/FAIL, pytest's summary line) and wall time, then the
# count of green runs. Extra arguments go to pytest instead of the default selection,
# e.g. `bench/suite_under_load.sh 3 tests/test_watch.py`. Each run's output is kept in
# a log folder (printed) for a look at a failure. Exit status 0 only when every run
# passed. The loops are stopped on exit, however the script ends.
set -uo pipefail
cd "$(dirname "$0")/.."

RUNS=${1:-5}
shift $(( $# > 0 ? 1 : 0 ))
LOOPS=${LOOPS:-2}
PYTHON=${PYTHON:-.venv/bin/python}
if [ $# -eq 0 ]; then
    # what `make test` runs
    set -- -q -n "${WORKERS:-3}" --dist worksteal -m "not soak and not cluster and not long"
fi
LOGS=$(mktemp -d /tmp/suite-under-load.XXXXXX)
# Device lock files of their own, so a run never waits for another user's measurement.
export AOED_RUNTIME_DIR=${AOED_RUNTIME_DIR:-$LOGS/runtime}

loops=()
stop_loops() {
    for pid in "${loops[@]}"; do
        kill "$pid" 2>/dev/null
    done
    for pid in "${loops[@]}"; do
        wait "$pid" 2>/dev/null
    done
}
trap stop_loops EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$LOOPS"); do
    python3 -c 'while True: pass' &
    loops+=("$!")
done

echo "suite under load: $LOOPS busy loops, $RUNS runs of pytest $*; logs in $LOGS ($(nproc) cores)"
green=0
for i in $(seq "$RUNS"); do
    start=$(date +%s%N)
    "$PYTHON" -m pytest "$@" >"$LOGS/run-$i.log" 2>&1
    rc=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    summary=$(grep -E '[0-9]+ (passed|failed|errors?|deselected)' "$LOGS/run-$i.log" | tail -1)
    if [ "$rc" -eq 0 ]; then
        green=$((green + 1))
        verdict=pass
    else
        verdict=FAIL
    fi
    printf 'run %d: %-4s rc=%d wall %d.%01d s  %s\n' "$i" "$verdict" "$rc" $((ms / 1000)) $((ms % 1000 / 100)) "$summary"
done
echo "$green of $RUNS runs green"
[ "$green" -eq "$RUNS" ]

#!/usr/bin/env bash
# `make test`: two pytest processes side by side. The integration tests leave a fifth or more of a
# 2-core machine idle (a vLLM server starts its processes one after another, on one core; leases
# and timers run out; the modules that leave the most run first: IDLE_FIRST in
# tests/integration/conftest.py), and the side fills it: first the integration modules light enough to
# share the machine's memory with any other (SIDE_MODULES: a few GiB each, no shared deployment),
# then the unit tests at a lower priority (nice), so that they take the integration tests' idle
# CPU rather than slow them down. The side writes to a log that is shown when the integration
# tests end (and kept only if it failed); the run fails when either part fails, and an
# interrupted run stops both. Arguments go to every pytest command.
set -u
cd "$(dirname "$0")/.."

python="${VENV:-.venv}/bin/python"
side_log="$(mktemp -t fleetrl-side-tests.XXXXXX)"
SIDE_MODULES=(tests/integration/test_trainer_ranks.py tests/integration/test_sft.py
              tests/integration/test_cli_inference.py)

# No cache plugin on this side: two sessions writing .pytest_cache at once would race.
run_side() {
    local child modules unit
    trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM
    "$python" -m pytest "${SIDE_MODULES[@]}" -p no:cacheprovider "$@" & child=$!
    wait "$child"; modules=$?
    nice -n 10 "$python" -m pytest tests/unit -p no:cacheprovider "$@" & child=$!
    wait "$child"; unit=$?
    echo "make test: exit status $modules for the light integration modules, $unit for the unit tests"
    [ "$modules" -eq 0 ] && [ "$unit" -eq 0 ]
}
run_side "$@" > "$side_log" 2>&1 &
side=$!
trap 'kill -TERM "$side" 2>/dev/null' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
echo "make test: the unit tests and ${#SIDE_MODULES[@]} light integration modules run beside the others; their output: $side_log"

"$python" -m pytest tests/integration "${SIDE_MODULES[@]/#/--ignore=}" --durations=40 "$@"
integration_status=$?
wait "$side"
side_status=$?
trap - EXIT

echo
echo "=============== the tests run beside ($side_log) ==============="
cat "$side_log"
echo "make test: exit status $side_status beside, $integration_status for the other integration tests"
[ "$side_status" -eq 0 ] && rm -f "$side_log"
[ "$side_status" -eq 0 ] && [ "$integration_status" -eq 0 ]

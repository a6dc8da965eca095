#!/usr/bin/env bash
# `make test`: the unit tests beside the integration tests, as two pytest processes. The
# integration tests leave about a fifth of a 2-core machine idle (a vLLM server starts its
# three processes one after another, on one core), and the unit tests fill it, so the suite
# ends minutes sooner than one pytest running both in turn. The unit tests write to a log that
# is shown when the integration tests end (and kept only if they failed); the run fails when
# either part fails, and an interrupted run stops both. Arguments go to both pytest commands.
set -u
cd "$(dirname "$0")/.."

python="${VENV:-.venv}/bin/python"
unit_log="$(mktemp -t fleetrl-unit-tests.XXXXXX)"

# No cache plugin on this side: two sessions writing .pytest_cache at once would race.
"$python" -m pytest tests/unit -p no:cacheprovider "$@" > "$unit_log" 2>&1 &
unit=$!
trap 'kill -TERM "$unit" 2>/dev/null' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
echo "make test: the unit tests run beside the integration tests; their output: $unit_log"

"$python" -m pytest tests/integration --durations=40 "$@"
integration_status=$?
wait "$unit"
unit_status=$?
trap - EXIT

echo
echo "=============== the unit tests, run beside the integration tests ($unit_log) ==============="
cat "$unit_log"
echo "make test: unit tests exit status $unit_status, integration tests exit status $integration_status"
[ "$unit_status" -eq 0 ] && rm -f "$unit_log"
[ "$unit_status" -eq 0 ] && [ "$integration_status" -eq 0 ]

#!/usr/bin/env bash
# `make test`: two pytest processes side by side. The integration tests leave a fifth or more of a
# 2-core machine idle (a vLLM server starts its three processes one after another, on one core),
# and the side fills it: the unit tests, then the integration modules light enough to share the
# machine's memory with any other (SIDE_MODULES: a few GiB each, no shared deployment). The side
# writes to a log that is shown when the integration tests end (and kept only if it failed); the
# run fails when either part fails, and an interrupted run stops both. Arguments go to both
# pytest commands.
set -u
cd "$(dirname "$0")/.."

python="${VENV:-.venv}/bin/python"
side_log="$(mktemp -t fleetrl-side-tests.XXXXXX)"
SIDE_MODULES=(tests/integration/test_trainer_ranks.py tests/integration/test_sft.py
              tests/integration/test_cli_inference.py)

# No cache plugin on this side: two sessions writing .pytest_cache at once would race.
"$python" -m pytest tests/unit "${SIDE_MODULES[@]}" -p no:cacheprovider "$@" > "$side_log" 2>&1 &
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

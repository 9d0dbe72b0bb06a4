#!/usr/bin/env bash
# The full fuzz runs: first the structure-aware GRAPH_COMPUTE fuzzer of issue 17 item 5
# (scripts/fuzz_graphs.py against a fleetd subprocess, FLEETD_GRAPH_FUZZ_SECONDS, default an
# hour; its table and findings go to FLEETD_GRAPH_FUZZ_JSON), then issue 11's
# tests/test_fuzz.py properties with 100000 examples each (CI runs 150). Random seeds unless
# FLEETD_FUZZ_RANDOM= is set empty; extra args go to pytest.
#   scripts/fuzz.sh                 # ~hours on 2 cores
#   FLEETD_GRAPH_FUZZ_SECONDS=0 FLEETD_FUZZ_EXAMPLES=5000 scripts/fuzz.sh -k interactive
#   FLEETD_GRAPH_FUZZ_SECONDS=600 FLEETD_GRAPH_FUZZ_SEED=123456 scripts/fuzz.sh -k nothing
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export FLEETD_FUZZ_EXAMPLES=${FLEETD_FUZZ_EXAMPLES:-100000}
export FLEETD_FUZZ_RANDOM=${FLEETD_FUZZ_RANDOM-1}
GRAPH_SECONDS=${FLEETD_GRAPH_FUZZ_SECONDS:-3600}
graph_rc=0
if [ "$GRAPH_SECONDS" != 0 ]; then
    if [ -n "${FLEETD_GRAPH_FUZZ_SEED:-}" ]; then seed=$FLEETD_GRAPH_FUZZ_SEED
    elif [ -n "$FLEETD_FUZZ_RANDOM" ]; then seed=$(( (RANDOM << 15 | RANDOM) * 100 ))
    else seed=0; fi
    echo "graph fuzzer: seed $seed, ${GRAPH_SECONDS}s (replay a finding: scripts/fuzz_graphs.py --case SEED -v)"
    "$PY" scripts/fuzz_graphs.py --seed "$seed" --cases 100000000 --seconds "$GRAPH_SECONDS" \
        --json "${FLEETD_GRAPH_FUZZ_JSON:-/tmp/fleetd-graph-fuzz.json}" || graph_rc=$?
fi
# No per-test timeout: one property runs for hours; every read inside is bounded (READ_BOUND_S).
"$PY" -m pytest -q -x --timeout=0 tests/test_fuzz.py "$@" || exit $?
exit "$graph_rc"

#!/usr/bin/env bash
# The full fuzz run of issue 11: tests/test_fuzz.py's properties with 100000 examples each
# (CI runs 150). Random seeds unless FLEETD_FUZZ_RANDOM= is set empty; extra args go to pytest.
#   scripts/fuzz.sh                 # ~hours on 2 cores
#   FLEETD_FUZZ_EXAMPLES=5000 scripts/fuzz.sh -k interactive
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export FLEETD_FUZZ_EXAMPLES=${FLEETD_FUZZ_EXAMPLES:-100000}
export FLEETD_FUZZ_RANDOM=${FLEETD_FUZZ_RANDOM-1}
# No per-test timeout: one property runs for hours; every read inside is bounded (READ_BOUND_S).
exec "$PY" -m pytest -q -x --timeout=0 tests/test_fuzz.py "$@"

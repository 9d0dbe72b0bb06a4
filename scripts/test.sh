#!/usr/bin/env bash
# The test command: bootstrap (idempotent, cached), then the CI test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"

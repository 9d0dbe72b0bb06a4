#!/usr/bin/env bash
# Everything CI runs, then every test-backend-ops case of the supported ops against fleetd
# (scripts/backend_ops.py, about 22 min on two busy cores on the ggml device, 60 with --device numpy),
# which rewrites docs/op-coverage.md. Extra arguments go to backend_ops.py
# (e.g. --servers fleetd,stock for the stock column as well).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m pytest -q
exec .venv/bin/python scripts/backend_ops.py --json benchmarks/results/op-coverage.json "$@"

#!/usr/bin/env bash
# Everything, including the tests marked slow (the full test-backend-ops set of the supported
# ops, the whole model matrix): about an hour on two cores. CI runs scripts/test.sh instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"

#!/usr/bin/env bash
# The main job on an embedded default: a local fleet on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/fleetctl demo "$@"

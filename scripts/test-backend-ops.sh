#!/usr/bin/env bash
# llama.cpp's test-backend-ops, unmodified (relinked so -b RPC0 reaches an RPC server), with the
# 31 ops LLM graphs use, in ONE process through fleetd and then through the stock server, as a
# user runs it: a per-op table (pass / fail / not supported / not reached), fleetd beside stock,
# in docs/backend-ops-one-process.md. Exit 1 if fleetd passes fewer cases than stock or cuts.
#   scripts/test-backend-ops.sh                 # ~25-40 min on 2 cores (each server)
#   OPS=GET_ROWS,SET_ROWS,MUL_MAT_ID scripts/test-backend-ops.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OPS=${OPS:-ADD,ADD_ID,SUB,MUL,DIV,SCALE,RMS_NORM,NORM,L2_NORM,MUL_MAT,MUL_MAT_ID,ROPE,SOFT_MAX,FLASH_ATTN_EXT,GET_ROWS,SET_ROWS,CPY,CONT,DUP,SUM_ROWS,MEAN,ARGMAX,ARGSORT,TOP_K,CLAMP,CONCAT,PAD,SWIGLU,GEGLU,SILU,GELU}
exec "$PY" scripts/backend_ops.py --one-process --servers fleetd,stock -o "$OPS" \
    --out "${OUT:-docs/backend-ops-one-process.md}" --json "${JSON:-/tmp/fleetd-backend-ops-one-process.json}" "$@"

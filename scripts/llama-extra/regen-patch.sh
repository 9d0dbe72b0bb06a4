#!/usr/bin/env bash
# Regenerate ggml-rpc-p2p.patch from an edited $PREFIX/src-p2p/ggml/src/ggml-rpc/ggml-rpc.cpp
# against the pristine pinned file (for whoever works on the client half).
set -euo pipefail
VERSION="${FLEETD_LLAMA_VERSION:-0.3.36}"
PREFIX="${FLEETD_LLAMA_CACHE:-$HOME/.cache/fleetd}/llama.cpp-$VERSION"
HERE="$(cd "$(dirname "$0")" && pwd)"
F=ggml/src/ggml-rpc/ggml-rpc.cpp
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/a/$(dirname $F)" "$TMP/b/$(dirname $F)"
cp "$PREFIX/src/$F" "$TMP/a/$F"
cp "$PREFIX/src-p2p/$F" "$TMP/b/$F"
(cd "$TMP" && diff -u "a/$F" "b/$F" | sed '1,2s/\t.*//') >"$HERE/ggml-rpc-p2p.patch" || true
wc -l "$HERE/ggml-rpc-p2p.patch"

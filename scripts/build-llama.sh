#!/usr/bin/env bash
# Build the pinned llama.cpp tools (stock ggml-rpc-server and the real clients) into a cache
# directory outside the repo, keyed by version. Reuses the cache when the tools are present.
#
#   scripts/build-llama.sh            # build or reuse; prints the bin directory
#
# FLEETD_LLAMA_CACHE overrides the cache root (default ~/.cache/fleetd).
set -euo pipefail

VERSION="${FLEETD_LLAMA_VERSION:-0.3.36}"          # llama-cpp-python sdist that vendors llama.cpp
CACHE_ROOT="${FLEETD_LLAMA_CACHE:-$HOME/.cache/fleetd}"
PREFIX="$CACHE_ROOT/llama.cpp-$VERSION"
TOOLS=(ggml-rpc-server llama-completion llama-perplexity llama-bench test-backend-ops)
JOBS="${JOBS:-$(nproc)}"
HERE="$(cd "$(dirname "$0")" && pwd)"

have_all() {
    for t in "${TOOLS[@]}"; do [ -x "$PREFIX/bin/$t" ] || return 1; done
}

if have_all; then
    echo "$PREFIX/bin"
    exit 0
fi

mkdir -p "$PREFIX"
SRC="$PREFIX/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    echo "fetching llama-cpp-python==$VERSION sdist" >&2
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp" >&2
    tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
    rm -rf "$SRC"
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
fi

# test-backend-ops learns about an RPC server through a static initializer of ours
# (FLEETD_RPC_ENDPOINT), linked into the test target: the upstream file stays untouched.
cp "$HERE/llama-extra/rpc_register.cpp" "$SRC/tests/fleetd_rpc_register.cpp"
if ! grep -q fleetd_rpc_register "$SRC/tests/CMakeLists.txt"; then
    cat >> "$SRC/tests/CMakeLists.txt" <<'CM'
# fleetd: register an RPC server as a backend device from FLEETD_RPC_ENDPOINT
target_sources(test-backend-ops PRIVATE fleetd_rpc_register.cpp)
target_include_directories(test-backend-ops PRIVATE ${CMAKE_SOURCE_DIR}/ggml/include)
CM
fi

# The compiler's output goes to a log in the cache; it is shown only when the build fails.
LOG="$PREFIX/build.log"
echo "building llama.cpp ($VERSION) in $PREFIX/build, log in $LOG (10-25 min on 2 cores)" >&2
if ! { cmake -S "$SRC" -B "$PREFIX/build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_RPC=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=ON \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF \
     && cmake --build "$PREFIX/build" -j "$JOBS" --target "${TOOLS[@]}"; } >"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    echo "llama.cpp build failed; full log: $LOG" >&2
    exit 1
fi

mkdir -p "$PREFIX/bin"
for t in "${TOOLS[@]}"; do
    cp "$(find "$PREFIX/build/bin" -maxdepth 1 -name "$t" -type f | head -1)" "$PREFIX/bin/$t"
done
have_all
echo "$PREFIX/bin"

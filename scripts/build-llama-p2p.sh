#!/usr/bin/env bash
# Build the client half: the pinned llama.cpp with scripts/llama-extra/ggml-rpc-p2p.patch applied
# to its RPC client, as shared libraries (libggml-rpc.so is the drop-in) plus the tools linked to
# them, into a directory of its own. The stock build (scripts/build-llama.sh) stays untouched.
#
#   scripts/build-llama-p2p.sh        # build or reuse; prints the bin directory
#
# Output: $PREFIX/p2p/bin/{llama-server,llama-cli,llama-completion,llama-bench,llama-batched-bench}
#         $PREFIX/p2p/lib/lib{ggml,ggml-base,ggml-cpu,ggml-rpc,llama,...}.so (the tools find them
#         through RPATH $ORIGIN/../lib). Keyed by the patch's sha256: a changed patch rebuilds.
set -euo pipefail

VERSION="${FLEETD_LLAMA_VERSION:-0.3.36}"
CACHE_ROOT="${FLEETD_LLAMA_CACHE:-$HOME/.cache/fleetd}"
PREFIX="$CACHE_ROOT/llama.cpp-$VERSION"
OUT="$PREFIX/p2p"
TOOLS=(llama-server llama-cli llama-completion llama-bench llama-batched-bench)
JOBS="${JOBS:-$(nproc)}"
HERE="$(cd "$(dirname "$0")" && pwd)"
PATCH="$HERE/llama-extra/ggml-rpc-p2p.patch"
SHA="$(sha256sum "$PATCH" | cut -c1-16)"

have_all() {
    [ "$(cat "$OUT/.patch-sha" 2>/dev/null)" = "$SHA" ] || return 1
    for t in "${TOOLS[@]}"; do [ -x "$OUT/bin/$t" ] || return 1; done
    [ -f "$OUT/lib/libggml-rpc.so" ]
}

if have_all; then
    echo "$OUT/bin"
    exit 0
fi

# The pinned source comes from the stock build's fetch.
[ -f "$PREFIX/src/CMakeLists.txt" ] || bash "$HERE/build-llama.sh" >/dev/null
SRC="$PREFIX/src-p2p"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    rm -rf "$SRC.tmp"
    cp -a "$PREFIX/src" "$SRC.tmp"
    mv "$SRC.tmp" "$SRC"
fi
# Always patch a pristine copy of the one file the patch touches.
RPC_CPP=ggml/src/ggml-rpc/ggml-rpc.cpp
cp "$PREFIX/src/$RPC_CPP" "$SRC/$RPC_CPP"
(cd "$SRC" && patch -s -p1 <"$PATCH")

LOG="$PREFIX/build-p2p.log"
echo "building patched llama.cpp client ($VERSION) in $PREFIX/build-p2p, log in $LOG (10-20 min on 2 cores)" >&2
if ! { cmake -S "$SRC" -B "$PREFIX/build-p2p" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_RPC=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=ON \
        -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN/../lib' \
     && cmake --build "$PREFIX/build-p2p" -j "$JOBS" --target "${TOOLS[@]}"; } >"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    echo "patched llama.cpp build failed; full log: $LOG" >&2
    exit 1
fi

rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp/bin" "$OUT.tmp/lib"
for t in "${TOOLS[@]}"; do
    cp "$(find "$PREFIX/build-p2p/bin" -maxdepth 1 -name "$t" -type f | head -1)" "$OUT.tmp/bin/$t"
done
find "$PREFIX/build-p2p" -name 'lib*.so*' \( -type f -o -type l \) -exec cp -a {} "$OUT.tmp/lib/" \;
echo "$SHA" >"$OUT.tmp/.patch-sha"
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
have_all
echo "$OUT/bin"

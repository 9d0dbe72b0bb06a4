#!/usr/bin/env bash
# Build the pinned llama.cpp tools (stock ggml-rpc-server and the real clients) and the shared
# ggml libraries that fleetd's `cpu` device loads, into a cache directory outside the repo, keyed
# by version. Reuses the cache when the tools / libraries are present.
#
#   scripts/build-llama.sh            # tools and libraries; prints the bin directory
#   scripts/build-llama.sh tools      # only the stock tools ($PREFIX/bin)
#   scripts/build-llama.sh ggml       # only the ggml library, libggml-fleetd.so ($PREFIX/lib),
#                                     # and fleetd's own libfleetd-native.so beside it
#
# FLEETD_LLAMA_CACHE overrides the cache root (default ~/.cache/fleetd).
# The default library build uses the stock tools' flags (Release, GGML_NATIVE=ON), so fleetd's
# kernels are the stock server's, and links them as the stock server has them: ggml-base and
# ggml-cpu built as static archives (position-independent, no semantic interposition) and linked
# whole into one shared library whose calls bind inside it (-Bsymbolic). As two ordinary shared
# libraries (-fPIC, every call to an exported function through the PLT, every cross-library one
# too) the same kernels ran a pipeline node's graph 13-44% longer than the static stock server
# (docs/DESIGN.md "One ggml library"). FLEETD_GGML_PORTABLE=1 builds them for deploy
# instead: GGML_BACKEND_DL with every CPU variant (libggml-cpu-<isa>.so, no -march=native; fleetd
# loads the one the node's CPU scores best) into $PREFIX/lib-portable; FLEETD_GGML_VARIANTS="x64
# haswell" limits the set (x64 + haswell: 9 min on two busy cores; there are 14 x86 variants).
set -euo pipefail

VERSION="${FLEETD_LLAMA_VERSION:-0.3.36}"          # llama-cpp-python sdist that vendors llama.cpp
CACHE_ROOT="${FLEETD_LLAMA_CACHE:-$HOME/.cache/fleetd}"
PREFIX="$CACHE_ROOT/llama.cpp-$VERSION"
TOOLS=(ggml-rpc-server llama-completion llama-perplexity llama-bench test-backend-ops)
JOBS="${JOBS:-$(nproc)}"
HERE="$(cd "$(dirname "$0")" && pwd)"
WHAT="${1:-all}"
case "$WHAT" in all|tools|ggml) ;; *) echo "usage: $0 [all|tools|ggml]" >&2; exit 2;; esac

have_all() {
    for t in "${TOOLS[@]}"; do [ -x "$PREFIX/bin/$t" ] || return 1; done
}

if [ "${FLEETD_GGML_PORTABLE:-0}" = 1 ]; then
    GGML_LIB="$PREFIX/lib-portable"
    GGML_BUILD="$PREFIX/build-ggml-portable"
    # no OpenMP: libgomp.so.1 comes with a compiler, which deploy's nodes need not have. The
    # variants must stay libraries of their own over one libggml-base, but each binds its own
    # calls inside it (as the native build's one library does; DESIGN.md "One ggml library").
    GGML_FLAGS=(-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_OPENMP=OFF
        "-DCMAKE_C_FLAGS=-fno-semantic-interposition -fno-plt"
        "-DCMAKE_CXX_FLAGS=-fno-semantic-interposition -fno-plt"
        -DCMAKE_SHARED_LINKER_FLAGS=-Wl,-Bsymbolic -DCMAKE_MODULE_LINKER_FLAGS=-Wl,-Bsymbolic)
else
    GGML_LIB="$PREFIX/lib"
    GGML_BUILD="$PREFIX/build-ggml-one"
    GGML_FLAGS=(-DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON
        "-DCMAKE_C_FLAGS=-fno-semantic-interposition -fno-plt"
        "-DCMAKE_CXX_FLAGS=-fno-semantic-interposition -fno-plt")
fi
ONE_LIB="$GGML_LIB/libggml-fleetd.so"

have_ggml() {
    if [ "${FLEETD_GGML_PORTABLE:-0}" = 1 ]; then  # .bound: built with the flags above
        [ -f "$GGML_LIB/libggml-base.so" ] && ls "$GGML_LIB"/libggml-cpu*.so >/dev/null 2>&1 \
            && [ -f "$GGML_LIB/.bound" ]
    else
        [ -f "$ONE_LIB" ]
    fi
}

# fleetd's own helpers (FNV-1a for the cache directory, the session's fast path for whole
# SET_TENSOR/GET_TENSOR requests and GRAPH_RECOMPUTE, the compute worker's loop, the
# asynchronous peer copy's staging): the C files next to fleetd/compute/native/__init__.py, rebuilt
# when missing or older than any source, without touching ggml. Plain -O2, no -march: they ship
# with the portable libs.
NATIVE_SRCS=(
    "$HERE/../fleetd/compute/native/fnv1a.c"
    "$HERE/../fleetd/compute/native/fastpath.c"
    "$HERE/../fleetd/compute/native/worker_loop.c"
    "$HERE/../fleetd/compute/native/peer_stage.c"
)
NATIVE_HEADERS=("$HERE/../fleetd/compute/native/peer_stage.h")
NATIVE_LIB="$GGML_LIB/libfleetd-native.so"
have_native() {
    [ -f "$NATIVE_LIB" ] || return 1
    local src
    for src in "${NATIVE_SRCS[@]}" "${NATIVE_HEADERS[@]}"; do
        [ "$src" -nt "$NATIVE_LIB" ] && return 1
    done
    return 0
}
build_native() {
    mkdir -p "$GGML_LIB"
    "${CC:-cc}" -O2 -std=c99 -Wall -Werror -shared -fPIC -pthread -o "$NATIVE_LIB.tmp" "${NATIVE_SRCS[@]}"
    mv "$NATIVE_LIB.tmp" "$NATIVE_LIB"
}

need_tools=0; need_ggml=0; need_native=0
if [ "$WHAT" != ggml ] && ! have_all; then need_tools=1; fi
if [ "$WHAT" != tools ] && ! have_ggml; then need_ggml=1; fi
if [ "$WHAT" != tools ] && ! have_native; then need_native=1; fi
if [ $need_tools = 0 ] && [ $need_ggml = 0 ] && [ $need_native = 1 ]; then
    build_native
    need_native=0
fi
if [ $need_tools = 0 ] && [ $need_ggml = 0 ]; then
    [ "$WHAT" = ggml ] && echo "$GGML_LIB" || echo "$PREFIX/bin"
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

if [ $need_tools = 1 ]; then  # (body not indented: the stock tools' steps, unchanged)
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
fi

# Both archives whole into one library whose own calls bind inside it (the native build).
link_one_lib() {
    "${CXX:-c++}" -shared -o "$ONE_LIB.tmp" -Wl,-soname,libggml-fleetd.so -Wl,-Bsymbolic \
        -Wl,--whole-archive "$GGML_BUILD/ggml/src/libggml-cpu.a" "$GGML_BUILD/ggml/src/libggml-base.a" \
        -Wl,--no-whole-archive -fopenmp -lm -pthread
    mv "$ONE_LIB.tmp" "$ONE_LIB"
}

# The ggml library for fleetd's `cpu` device: a separate build dir (the stock tools stay static
# and untouched), only the two ggml targets (no tools: a CI run compiles ggml-cpu, ~minutes).
if [ $need_ggml = 1 ]; then
    GLOG="$GGML_BUILD.log"
    echo "building libggml-base/libggml-cpu in $GGML_BUILD, log in $GLOG" >&2
    # A portable build has one target per CPU variant (ggml-cpu-haswell, ...): ask cmake.
    # FLEETD_GGML_VARIANTS="x64 haswell" builds only those (a fleet's CPUs are known).
    cpu_targets() {
        if [ -n "${FLEETD_GGML_VARIANTS:-}" ]; then
            printf 'ggml-cpu-%s ' $FLEETD_GGML_VARIANTS
        else
            cmake --build "$GGML_BUILD" --target help | sed -n 's/^\.\.\. \(ggml-cpu[a-z0-9_-]*\)$/\1/p' \
                | grep -v -- '-feats$'
        fi
    }
    if ! { cmake -S "$SRC" -B "$GGML_BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
            "${GGML_FLAGS[@]}" -DGGML_RPC=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
         && cmake --build "$GGML_BUILD" -j "$JOBS" --target ggml-base $(cpu_targets); } >"$GLOG" 2>&1; then
        tail -n 40 "$GLOG" >&2
        echo "ggml library build failed; full log: $GLOG" >&2
        exit 1
    fi
    mkdir -p "$GGML_LIB"
    if [ "${FLEETD_GGML_PORTABLE:-0}" = 1 ]; then
        # cp -P keeps the soname symlinks (libggml-base.so -> libggml-base.so.0 -> ...)
        find "$GGML_BUILD/bin" -maxdepth 1 \( -name 'libggml-base.so*' -o -name 'libggml-cpu*.so*' \) \
            -exec cp -P {} "$GGML_LIB/" \;
        touch "$GGML_LIB/.bound"
    else
        if ! link_one_lib >>"$GLOG" 2>&1; then
            tail -n 20 "$GLOG" >&2
            echo "linking $ONE_LIB failed; full log: $GLOG" >&2
            exit 1
        fi
        rm -f "$GGML_LIB"/libggml-base.so* "$GGML_LIB"/libggml-cpu.so*  # an older build's pair
    fi
    have_ggml || { echo "ggml libraries missing after the build in $GGML_BUILD" >&2; exit 1; }
fi
if [ $need_native = 1 ]; then build_native; fi
[ "$WHAT" = ggml ] && echo "$GGML_LIB" || echo "$PREFIX/bin"

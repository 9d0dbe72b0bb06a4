"""libfleetd-native (fleetd/compute/native): the C FNV-1a of the cache directory.

- `scripts/build-llama.sh ggml` with the ggml libraries present builds only the helper, into the
  same directory (native and portable layouts), and rebuilds it when its source is newer.
- The C hash equals the pure Python reference (fleetd.wire.hashing) and the FNV test vectors on
  random data of many lengths, at unaligned starts, over every buffer type the server hands it.
- Without the library, the fallback gives the same answers.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO

from fleetd.compute import native
from fleetd.tools import LLAMA_VERSION
from fleetd.wire import hashing

# The FNV reference suite's FNV-1a 64 values (fnv_test_str).
VECTORS = {
    b"": 0xCBF29CE484222325,
    b"a": 0xAF63DC4C8601EC8C,
    b"b": 0xAF63DF4C8601F1A5,
    b"c": 0xAF63DE4C8601EFF2,
    b"fo": 0x08985907B541D342,
    b"foo": 0xDCB27518FED9D577,
    b"foob": 0xDD120E790C2512AF,
    b"fooba": 0xCAC165AFA2FEF40A,
    b"foobar": 0x85944171F73967E8,
}
LENGTHS = [0, 1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 4095, 4096, 4097, (1 << 20) + 3]


def fake_cache(root: Path, portable: bool) -> Path:
    """A build cache whose tools and ggml libraries are present (empty stand-ins: the script
    only checks that they exist), so `build-llama.sh` has only the helper to build."""
    prefix = root / f"llama.cpp-{LLAMA_VERSION}"
    (prefix / "bin").mkdir(parents=True)
    for tool in (
        "ggml-rpc-server",
        "llama-completion",
        "llama-perplexity",
        "llama-bench",
        "test-backend-ops",
    ):
        (prefix / "bin" / tool).write_text("#!/bin/sh\n")
        (prefix / "bin" / tool).chmod(0o755)
    lib = prefix / ("lib-portable" if portable else "lib")
    lib.mkdir()
    for name in stand_ins(portable):
        (lib / name).touch()
    if portable:
        (lib / ".bound").touch()  # built with the flags that bind each library's calls inside it
    return lib


def stand_ins(portable: bool) -> tuple[str, ...]:
    """The ggml libraries a build leaves: the portable pair, or the native build's one library."""
    return ("libggml-base.so", "libggml-cpu-x64.so") if portable else ("libggml-fleetd.so",)


def build(root: Path, portable: bool, what: str = "ggml") -> str:
    env = dict(os.environ, FLEETD_LLAMA_CACHE=str(root), FLEETD_GGML_PORTABLE="1" if portable else "0")
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-llama.sh"), what],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def built_lib(tmp_path_factory) -> Path:
    """The helper as the build script makes it, in a cache of its own."""
    lib = fake_cache(tmp_path_factory.mktemp("cache"), portable=False)
    assert build(lib.parent.parent, portable=False) == str(lib)
    return lib


@pytest.fixture
def use_lib(monkeypatch):
    """Point the binding at a directory and forget what it loaded before."""

    def point(directory: Path) -> None:
        monkeypatch.setenv("FLEETD_GGML_LIB_DIR", str(directory))
        monkeypatch.setattr(native, "_loaded", [])

    yield point
    monkeypatch.setattr(native, "_loaded", [])


def test_build_script_builds_only_the_helper_beside_the_ggml_libs(tmp_path):
    for portable in (False, True):
        root = tmp_path / ("portable" if portable else "native")
        lib = fake_cache(root, portable)
        build(root, portable)
        so = lib / native.LIBRARY
        assert so.stat().st_size > 0
        for name in stand_ins(portable):  # ggml was not rebuilt over the stand-ins
            assert (lib / name).stat().st_size == 0
        before = so.stat().st_mtime_ns
        build(root, portable)
        assert so.stat().st_mtime_ns == before  # present and current: nothing to do
        build(root, portable, "tools")  # the helper belongs to the ggml step
        assert so.stat().st_mtime_ns == before
        os.utime(so, (0, 0))  # older than its source: rebuilt
        build(root, portable)
        assert so.stat().st_mtime_ns > 0


def test_native_matches_vectors_and_reference(built_lib, use_lib):
    use_lib(built_lib)
    assert native.native_available()
    for data, want in VECTORS.items():
        assert native.fnv1a_64(data) == want == hashing.fnv1a_64(data), data
    rng = np.random.default_rng(5)
    pool = rng.integers(0, 256, max(LENGTHS) + 16, dtype=np.uint8)
    for n in LENGTHS:
        for start in (0, 1, 3):  # unaligned starts, as tensor regions inside a buffer are
            view = memoryview(pool)[start : start + n]
            want = hashing.fnv1a_64(view)
            assert native.fnv1a_64(view) == want, (n, start)
            assert native.fnv1a_64(bytes(view)) == want
            assert native.fnv1a_64(bytearray(view)) == want
            assert native.fnv1a_64(pool[start : start + n]) == want
    floats = rng.standard_normal(1000).astype("<f4")  # a typed buffer hashes as its bytes
    assert (
        native.fnv1a_64(floats) == native.fnv1a_64(memoryview(floats)) == hashing.fnv1a_64(floats.tobytes())
    )
    big = rng.integers(0, 256, 64 << 20, dtype=np.uint8)  # a weight tensor above the 10 MiB threshold
    assert native.fnv1a_64(big) == native.fnv1a_64(big[: 32 << 20].tobytes() + big[32 << 20 :].tobytes())
    assert native.fnv1a_64(big) != native.fnv1a_64(big[1:])
    # a hash continues over chunks, as the cache directory hashes a file it wrote
    head, tail = pool[:4097], pool[4097:9000]
    want = hashing.fnv1a_64(pool[:9000])
    assert (
        native.fnv1a_64(tail, native.fnv1a_64(head)) == want == hashing.fnv1a_64(tail, hashing.fnv1a_64(head))
    )


def test_non_contiguous_buffers_are_refused_by_both(built_lib, use_lib):
    strided = np.arange(64, dtype=np.uint8)[::2]
    use_lib(built_lib)
    with pytest.raises(TypeError):
        native.fnv1a_64(strided)
    with pytest.raises(TypeError):
        hashing.fnv1a_64(strided)


def test_without_the_library_the_fallback_answers_the_same(tmp_path, use_lib, caplog):
    use_lib(tmp_path)  # no libfleetd-native.so here
    assert not native.native_available()
    assert "libfleetd-native.so not found" in caplog.text
    data = np.random.default_rng(2).integers(0, 256, 5000, dtype=np.uint8)
    assert native.fnv1a_64(data) == hashing.fnv1a_64(data)
    assert native.fnv1a_64(b"foobar") == VECTORS[b"foobar"]

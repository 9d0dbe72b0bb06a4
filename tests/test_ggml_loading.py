"""Which device computes: the ggml libraries load (the portable build's best variant included),
the numpy device stands in when they do not, and status says which kind computes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleetd.compute.device import Device, make_device
from fleetd.compute.ggml.lib import ONE_LIBRARY, load
from fleetd.tools import portable_ggml_dir

try:
    from fleetd.compute.ggml.device import load_device

    load_device()
except OSError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"ggml libraries: {exc}", allow_module_level=True)


def test_numpy_device_still_there_and_cpu_falls_back(monkeypatch, tmp_path, caplog):
    assert type(make_device("numpy")).__name__ == "NumpyDevice"
    monkeypatch.setenv("FLEETD_GGML_LIB_DIR", str(tmp_path))  # no libraries there
    with caplog.at_level("WARNING", logger="fleetd"):
        dev = make_device("cpu")
    assert type(dev).__name__ == "NumpyDevice"
    assert [r.message for r in caplog.records if "numpy device" in r.message]


def test_both_devices_have_what_the_server_calls():
    # Device is a Protocol: each implements every member (the ggml device without importing it)
    assert isinstance(make_device("numpy"), Device)
    assert isinstance(load_device(), Device)


def test_buffers_are_aligned_for_ggml():
    dev = load_device()
    for size in (1, 33, 4097, 1 << 20):
        assert dev.alloc(size).ctypes.data % 32 == 0


def test_the_native_build_is_one_library_whose_calls_bind_inside_it():
    # Two -fPIC libraries (every call to an exported function through the PLT, ggml-cpu's into
    # ggml-base across libraries) ran a pipeline node's graph 13-44% longer than the static stock
    # server; scripts/build-llama.sh links both archives into one, bound with -Bsymbolic.
    path = load().cpu_path
    assert path.name == ONE_LIBRARY, path
    dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    assert "SYMBOLIC" in dynamic and "libggml" not in dynamic.split("SONAME")[0], dynamic
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True, check=True
    )
    assert not [line for line in undefined.stdout.splitlines() if " ggml_" in line or " gguf_" in line]


PORTABLE = portable_ggml_dir()


@pytest.mark.skipif(
    not list(PORTABLE.glob("libggml-cpu-*.so")),
    reason="no portable build (FLEETD_GGML_PORTABLE=1 scripts/build-llama.sh ggml)",
)
def test_portable_build_loads_the_variant_this_cpu_scores_best():
    # A process of its own: this one already holds the native libggml-base.
    code = """if 1:
        import numpy as np
        from fleetd.client.graph import GraphBuilder
        from fleetd.compute.buffers import BufferRegistry
        from fleetd.compute.device import make_device
        from fleetd.wire import GgmlType
        dev, reg = make_device("cpu"), BufferRegistry()
        buf = reg.alloc(0, dev, 4096, owner=1)
        g = GraphBuilder()
        w = g.tensor(GgmlType.F32, (8, 4), buf.handle, buf.base)
        x = g.tensor(GgmlType.F32, (8, 3), buf.handle, buf.base + 256)
        y = g.place(g.mul_mat(w, x), buf.handle, buf.base + 512)
        buf.array[:128] = np.arange(32, dtype=np.float32).view(np.uint8)
        buf.array[256:352] = np.ones(24, np.float32).view(np.uint8)
        dev.build_plan(g.serialize([y]), reg).run()
        got = buf.array[512:560].view(np.float32).reshape(3, 4)
        assert (got == np.arange(32, dtype=np.float32).reshape(4, 8).sum(1)).all(), got
        print(type(dev).__name__, dev.lib.cpu_path.name)
    """
    env = dict(os.environ, FLEETD_GGML_LIB_DIR=str(PORTABLE))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    kind, lib_name = out.stdout.split()
    assert kind == "GgmlCpuDevice" and lib_name.startswith("libggml-cpu-"), out.stdout + out.stderr


@pytest.mark.skipif(
    not list(PORTABLE.glob("libggml-cpu-*.so")),
    reason="no portable build (FLEETD_GGML_PORTABLE=1 scripts/build-llama.sh ggml)",
)
def test_each_library_of_the_portable_build_binds_its_own_calls_inside_it():
    # What deploy ships: the variants stay libraries of their own over one libggml-base, but
    # none calls its own functions through the PLT (scripts/build-llama.sh, -Bsymbolic).
    for lib in [PORTABLE / "libggml-base.so", *PORTABLE.glob("libggml-cpu-*.so")]:
        dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True)
        assert "SYMBOLIC" in dynamic.stdout, (lib, dynamic.stdout)


@pytest.mark.skipif(
    not list(PORTABLE.glob("libggml-cpu-*.so")),
    reason="no portable build (FLEETD_GGML_PORTABLE=1 scripts/build-llama.sh ggml)",
)
def test_a_shipped_portable_dir_loads_its_own_base_and_the_best_variant_that_loads(tmp_path):
    # As fleetctl deploy ships it into fleetd/compute/ggml/_lib: the *.so files only (no soname
    # links: the variants' libggml-base.so.0 is not there), plus here a variant that does not
    # load, sorted first. Only this directory's libggml-base may end up mapped.
    shipped = tmp_path / "_lib"
    shipped.mkdir()
    for f in PORTABLE.glob("*.so"):
        shutil.copyfile(f, shipped / f.name)
    (shipped / "libggml-cpu-alderlake.so").write_bytes(b"not an ELF file")
    code = """if 1:
        from fleetd.compute.device import make_device
        dev = make_device("cpu")
        maps = open("/proc/self/maps").read().splitlines()
        print(type(dev).__name__, dev.library, *sorted({l.split()[-1] for l in maps if "/libggml" in l}))
    """
    env = dict(os.environ, FLEETD_GGML_LIB_DIR=str(shipped))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    kind, library, *mapped = out.stdout.split()
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    haswell = (shipped / "libggml-cpu-haswell.so").exists() and {"avx2", "fma", "f16c", "bmi2"} <= set(
        flags.split()
    )
    assert kind == "GgmlCpuDevice", out.stdout + out.stderr
    if (shipped / "libggml-cpu-x64.so").exists():  # the two variants bootstrap builds
        assert Path(library).name == ("libggml-cpu-haswell.so" if haswell else "libggml-cpu-x64.so")
    assert mapped and all(m.startswith(str(shipped)) for m in mapped), mapped
    assert str(shipped / "libggml-base.so") in mapped


def test_status_says_which_device_kind_computes(fleetd_server, monkeypatch, tmp_path):
    import json
    import urllib.request

    def devices_of(srv) -> list[dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.control.port}/v1/status", timeout=10) as r:
            return json.load(r)["devices"]

    (ggml_dev,) = devices_of(fleetd_server(control_port=0, devices=["cpu"]))
    assert ggml_dev["kind"] == "ggml" and ggml_dev["fallback"] is None
    assert Path(ggml_dev["library"]).name == ONE_LIBRARY  # scripts/build-llama.sh's native build
    (numpy_dev,) = devices_of(fleetd_server(control_port=0, devices=["numpy"]))
    assert numpy_dev["kind"] == "numpy" and numpy_dev["fallback"] is None and numpy_dev["library"] is None
    # cpu where the library does not load: numpy, and the daemon says why
    monkeypatch.setenv("FLEETD_GGML_LIB_DIR", str(tmp_path))
    (fell_back,) = devices_of(fleetd_server(control_port=0, devices=["cpu"]))
    assert fell_back["kind"] == "numpy" and fell_back["library"] is None
    assert (
        fell_back["fallback"] == "device cpu: ggml libraries not found (run scripts/build-llama.sh ggml): "
        f"{tmp_path}: no libggml-base.so"
    )

"""benchmarks/load.py runs end to end on the smallest model whose weights take the cache path
(fleetd.models "hash": three f16 FFN matrices above the client's 10 MiB SET_TENSOR_HASH
threshold): both servers load it without a cache directory, cold and warm, the JSON has every
number, and both servers wrote the same cache files (the stock client's hash, fleetd's C FNV-1a
and the stock server's agree) which the warm load only read. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, needs_tool


@needs_tool("llama-completion", "ggml-rpc-server")
def test_load_benchmark_runs_and_both_servers_cache_the_same_files(tmp_path):
    out = tmp_path / "load.json"
    work = tmp_path / "work"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "load.py"),
            "--models",
            "llama-f16-hash",
            "--rounds",
            "1",
            "--models-dir",
            str(tmp_path / "models"),
            "--workdir",
            str(work),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "model load" in proc.stdout and "warning" not in proc.stdout
    doc = json.loads(out.read_text())
    (row,) = doc["results"]
    for arm in ("stock", "cpu"):
        for mode in ("none", "cold", "warm"):
            got = row[arm][mode]
            assert got["load_s"] > 0 and got["wall_s"] >= got["load_s"] and got["peak_rss_mib"] > 0, (
                arm,
                mode,
            )
    assert row["files"] == {"stock": 3, "cpu": 3} and row["same_names"]
    assert row["warm_misses"] == {"stock": 0, "cpu": 0}
    stock_files = sorted(p.name for p in (work / "cache-stock" / "rpc").iterdir())
    fleetd_files = sorted(p.name for p in (work / "cache-cpu").iterdir())
    assert stock_files == fleetd_files and len(stock_files) == 3


def test_benchmark_model_names_are_the_generated_file_names(tmp_path):
    from fleetd.models import generate, generate_named

    assert generate_named("llama-f32", tmp_path) == generate("llama", "f32", tmp_path)
    assert generate_named("llama-f32", tmp_path).name == "llama-f32.gguf"
    for bad in ("llama", "llama-f32-huge", "llama-nope"):
        with pytest.raises(ValueError):
            generate_named(bad, tmp_path)

"""`llama-completion --temp 0 -n 64` prints byte-identical text through fleetd's ggml device and
the stock server for every family and weight type of tests/test_llama_e2e.py, flash attention on
and off."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import PROMPT, TEST_ARCHS, TEST_TYPES, endpoint, needs_tool, run_client

from fleetd.tools import find_tool

try:
    from fleetd.compute.ggml.device import load_device

    load_device()
except OSError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"ggml libraries: {exc}", allow_module_level=True)


def complete(model: Path, server: str, fa: str) -> bytes:
    args = [
        str(find_tool("llama-completion")),
        "-m",
        str(model),
        "--rpc",
        server,
        "-ngl",
        "99",
        "-p",
        PROMPT,
        "-n",
        "64",
        "--temp",
        "0",
        "-t",
        "1",
        "-no-cnv",
        "-fa",
        fa,
        "--seed",
        "1",
    ]
    return run_client(args).stdout


@needs_tool("llama-completion", "ggml-rpc-server")
@pytest.mark.parametrize("type_name", TEST_TYPES)
@pytest.mark.parametrize("arch", TEST_ARCHS)
def test_completion_byte_identical_to_stock(models, stock_server, ggml_server, arch, type_name):
    model = models / f"{arch}-{type_name}.gguf"
    stock = stock_server()
    for fa in ("off", "on"):
        want = complete(model, stock, fa)
        got = complete(model, endpoint(ggml_server), fa)
        assert len(want) > len(PROMPT)  # some models end early with [end of text]
        assert got == want, f"{arch}-{type_name} -fa {fa}:\n stock {want!r}\nfleetd {got!r}"

"""The real llama.cpp clients run small models on fleetd and print what the stock server makes
them print.

Models come from fleetd.models (llama, qwen3, qwen3moe, gemma3 in F32, F16, Q8_0 and
Q4_K). For each: `llama-completion --rpc <server> -ngl 99 --temp 0 -n 32`, flash attention on
and off, must print the same text through fleetd as through the stock ggml-rpc-server, and
`llama-perplexity` must agree within 0.5%.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import PROMPT, TEST_ARCHS, TEST_TYPES, endpoint, needs_tool, run_client

from fleetd.tools import tools_dir

pytestmark = needs_tool("llama-completion", "llama-perplexity", "ggml-rpc-server")

COMPLETION = tools_dir() / "llama-completion"
PERPLEXITY = tools_dir() / "llama-perplexity"
TEXT = " ".join(["the first time was one of the new ones and they had all been there"] * 40)


@pytest.fixture
def servers(stock_server, fleetd_server):
    """(stock endpoint, fleetd endpoint)."""
    return stock_server(), endpoint(fleetd_server())


def complete(model: Path, server: str, fa: str, *extra: str) -> bytes:
    args = [
        str(COMPLETION),
        "-m",
        str(model),
        "--rpc",
        server,
        "-ngl",
        "99",
        "-p",
        PROMPT,
        "-n",
        "32",
        "--temp",
        "0",
        "-t",
        "1",
        "-no-cnv",
        "-fa",
        fa,
        "--seed",
        "1",
        *extra,
    ]
    return run_client(args).stdout


@pytest.mark.parametrize("type_name", TEST_TYPES)
@pytest.mark.parametrize("arch", TEST_ARCHS)
def test_completion_matches_stock(models, servers, arch, type_name):
    model = models / f"{arch}-{type_name}.gguf"
    stock, ours = servers
    for fa in ("off", "on"):
        want = complete(model, stock, fa)
        got = complete(model, ours, fa)
        assert len(want) > len(PROMPT)
        assert got == want, f"{arch}-{type_name} -fa {fa}:\n stock {want!r}\nfleetd {got!r}"


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_quantized_kv_cache_matches_stock(models, servers, cache_type):
    # SET_ROWS quantizes the new K/V rows; FLASH_ATTN_EXT reads them back.
    model = models / "qwen3-q8_0.gguf"
    stock, ours = servers
    extra = ("-ctk", cache_type, "-ctv", cache_type)
    want = complete(model, stock, "on", *extra)
    assert complete(model, ours, "on", *extra) == want


def perplexity(model: Path, server: str, text_file: Path) -> float:
    args = [
        str(PERPLEXITY),
        "-m",
        str(model),
        "--rpc",
        server,
        "-ngl",
        "99",
        "-f",
        str(text_file),
        "-c",
        "128",
        "-b",
        "128",
        "-t",
        "1",
    ]
    final = re.compile(rb"Final estimate: PPL = ([0-9.]+)")
    proc = run_client(args, lambda out, err: final.search(out + err))
    out, err = proc.stdout, proc.stderr
    m = final.search(out + err)
    assert m, (out + err)[-2000:].decode(errors="replace")
    return float(m.group(1))


@pytest.mark.parametrize("arch", TEST_ARCHS)
def test_perplexity_agrees_with_stock(models, servers, tmp_path, arch):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    model = models / f"{arch}-q8_0.gguf"
    stock, ours = servers
    want = perplexity(model, stock, text_file)
    got = perplexity(model, ours, text_file)
    assert abs(got - want) <= 0.005 * want, f"{arch}: stock PPL {want}, fleetd PPL {got}"

"""fleetctl ab --model: the patched llama.cpp tools through a fleet, hub vs direct.

- On a local fleet of fleetd: the same greedy text in both arms, one COPY_TENSOR_TO per decode
  step at the one RPC-to-RPC boundary (counted by the nodes), one GET_TENSOR and one SET_TENSOR
  fewer at the coordinator; the --json document's shape; a PNG chart.
- A mixed fleet (a stock ggml-rpc-server as the second stage): the same text, and a verdict
  that says the direct path never ran and why, never a green one.
- Bad numbers: one line, exit 2, before anything runs.
- The shapes (--shapes all): prompt in micro-batches, 4 and 8 sequences, llama-server under
  closed-loop clients, decode; the load generator stops at its count and at its time limit, and
  a llama-server that cannot start is one line, not a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import needs_tool

from fleetd.ctl.main import main
from fleetd.errors import FleetError
from fleetd.fleet.chart import png_bytes
from fleetd.fleet.local import LocalFleet
from fleetd.fleet.model_ab import (
    METRICS,
    SHAPES,
    parse_batched_table,
    parse_shapes,
    run_model_ab,
    text_mismatches,
)
from fleetd.fleet.node import Fleet, Node
from fleetd.fleet.nodes_file import NodeSpec
from fleetd.fleet.server_load import SERVER_PROMPTS, LlamaServer, LoadLimits, run_load
from fleetd.models import generate
from fleetd.tools import find_tool
from fleetd.transport import free_port, wait_listening

SMALL = ["--rounds", "1", "--n-prompt", "16", "--n-gen", "6"]
# Every shape, tiny: 4 micro-batches of 4 prompt tokens, 2 server clients with 2 requests each.
ALL_SHAPES = ["--shapes", "all", "--server-clients", "2", "--server-requests", "2"]


# What `fleetctl ab --model` runs (fleetd.fleet.model_ab): the patched client half.
needs_patched_tools = needs_tool("p2p/llama-bench", "p2p/llama-batched-bench", "p2p/llama-completion")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return generate("llama", "f16", tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "m.gguf", "--rounds", "0"], "--rounds 0: must be in 1..50"),
        (["--model", "m.gguf", "--n-gen", "1"], "--n-gen 1: must be in 2..1024"),
        (["--model", "m.gguf", "--n-prompt", "-3"], "--n-prompt -3: must be in 1..4096"),
        (["--steps", "1"], "--steps 1: must be at least 2"),
        (["--workload", "model"], "--workload model needs --model"),
        (["--timeout", "0"], "--timeout 0: must be above 0"),
        (["--model", "/nonexistent.gguf"], "--model /nonexistent.gguf: no such file"),
        (["--model", "m.gguf", "--shapes", "pp,warp"], "--shapes 'pp,warp': unknown warp (choose from"),
        (["--model", "m.gguf", "--shapes", ","], "--shapes ',': empty"),
        (["--model", "m.gguf", "--micro-batches", "1"], "--micro-batches 1: must be in 2..64"),
        (["--model", "m.gguf", "--server-clients", "0"], "--server-clients 0: must be in 1..64"),
        (["--model", "m.gguf", "--server-requests", "0"], "--server-requests 0: must be in 1..1000"),
        (["--model", "m.gguf", "--server-seconds", "0"], "--server-seconds 0: must be above 0"),
        (
            ["--model", "m.gguf", "--n-prompt", "8", "--micro-batches", "16"],
            "--n-prompt 8 < --micro-batches 16: each micro-batch needs a prompt token",
        ),
    ],
)
def test_bad_numbers_exit_2_with_one_line(capsys, argv, message):
    assert main(["ab", "nodes.txt", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fleetctl ab: error:") and message in err and "\n" not in err


def test_batched_table_parse():
    text = (
        "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"  # noqa: E501 (the tool's own table)
        "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
        "|    16 |      6 |    4 |     88 |    0.512 |   125.00 |    0.300 |    80.00 |    0.812 |   108.37 |\n"  # noqa: E501
    )
    (row,) = parse_batched_table(text)
    assert row["b"] == 4 and row["s"] == 108.37 and row["s_pp"] == 125.0


def test_shapes_parse_in_run_order():
    assert parse_shapes("decode, server,pp") == ("pp", "server", "decode")
    assert parse_shapes("all") == SHAPES
    assert METRICS[-1] == "tg_tps"  # decode last, as the shapes
    with pytest.raises(ValueError, match="unknown bogus"):
        parse_shapes("pp,bogus")


def test_text_mismatches_name_the_tool_the_prompt_and_the_cells():
    def cell(arm, md5, texts):
        return {"arm": arm, "md5": md5, "server": {"texts": texts}}

    same = [{"round": 1, "cells": [cell("hub", "a", {"p": ["x"]}), cell("direct", "a", {"p": ["x"]})]}]
    assert text_mismatches(same) == []
    differ = [{"round": 1, "cells": [cell("hub", "a", {"p": ["x"]}), cell("direct", "b", {"p": ["y"]})]}]
    completion, server = text_mismatches(differ)
    assert completion.startswith("the greedy text differs between cells (round 1 hub a, round 1 direct b")
    assert server.startswith("llama-server's greedy text for 'p' differs (round 1 hub ")
    within = [{"round": 1, "cells": [cell("hub", "a", {"p": ["x", "y"]}), cell("direct", "a", {"q": ["z"]})]}]
    (only,) = text_mismatches(within)  # two texts for one prompt in one cell; q is fine
    assert "for 'p' differs" in only and "round 1 direct -" in only


def test_png_is_a_png():
    import numpy as np

    data = png_bytes(np.zeros((3, 5, 3), np.uint8))
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(b"IEND\xaeB`\x82")


@needs_patched_tools
@pytest.mark.timeout(600)
def test_model_ab_local_fleet_direct_copies_and_same_text(tmp_path, model, capsys):
    with LocalFleet(2, tmp_path, server_args=["--threads", "1"]) as local:
        chart = tmp_path / "ab.png"
        code = main(
            [
                "ab",
                str(local.nodes_file),
                "--model",
                str(model),
                *SMALL,
                *ALL_SHAPES,
                "--json",
                "--chart",
                str(chart),
            ]
        )
        out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["ok"] and doc["direct_ran"]
    assert set(doc["arms"]) == {"hub", "direct"}
    hub, direct = doc["arms"]["hub"], doc["arms"]["direct"]
    assert hub["md5"] == direct["md5"]
    for arm in (hub, direct):
        assert list(arm["median"]) == list(arm["spread"]) == list(METRICS)  # every shape, in order
        assert all(
            lo <= arm["median"][k] <= hi and arm["median"][k] > 0 for k, (lo, hi) in arm["spread"].items()
        )
    s = doc["settings"]
    assert s["shapes"] == list(SHAPES) and s["micro_batches"] == 4 and s["ubatch"] == 4
    assert s["batched_sequences"] == [4, 8] and s["server_clients"] == 2 and s["server_requests"] == 4
    # llama-server: every request answered, each prompt one greedy text, the same in both arms
    assert hub["server_md5"] == direct["server_md5"] != ""
    servers = [c["server"] for c in doc["rounds"][0]["cells"]]
    assert [(v["requests"], v["tokens"], v["stopped_by"]) for v in servers] == [(4, 24, "count")] * 2
    assert servers[0]["texts"] == servers[1]["texts"]
    assert all(len(texts) == 1 for texts in servers[0]["texts"].values())
    assert sorted(servers[0]["texts"]) == sorted(SERVER_PROMPTS)
    assert [r["b"] for r in doc["rounds"][0]["cells"][0]["batched"]] == [4, 8]
    # per decode step: one boundary (RPC0 -> RPC1), one asynchronous push and its gate at the
    # destination, none on the hub path
    assert direct["per_step"]["nodes"]["COPY_TENSOR_TO_ASYNC"] == 1
    assert direct["per_step"]["nodes"]["PEER_GATE"] == 1
    assert direct["per_step"]["client"]["PEER_GATE"]["count"] == 1
    assert hub["per_step"]["nodes"].get("COPY_TENSOR_TO_ASYNC", 0) == 0
    assert direct["copies_ok"] > 0 and hub["copies_ok"] == 0
    hub_client, direct_client = hub["per_step"]["client"], direct["per_step"]["client"]
    assert hub_client["GET_TENSOR"]["count"] - direct_client["GET_TENSOR"]["count"] == 1
    assert hub_client["SET_TENSOR"]["count"] - direct_client["SET_TENSOR"]["count"] == 1
    assert direct["per_step"]["coordinator_bytes"] < hub["per_step"]["coordinator_bytes"]
    (rnd,) = doc["rounds"]
    assert rnd["order"] == ["hub", "direct"] and [c["arm"] for c in rnd["cells"]] == ["hub", "direct"]
    assert chart.read_bytes().startswith(b"\x89PNG") and doc["chart"] == str(chart)
    # one round has no spread to be beyond; a loopback fleet is told its link is not the point
    assert "one round: no spread to compare" in doc["verdict"] and "beyond the spread" not in doc["verdict"]
    assert "on loopback, where the link is not the bottleneck" in doc["verdict"]


@needs_patched_tools
@needs_tool("ggml-rpc-server")
@pytest.mark.timeout(600)
def test_model_ab_mixed_fleet_says_direct_never_ran(tmp_path, model):
    port = free_port()
    stock = subprocess.Popen(
        [str(find_tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_listening(port, 30)
        with LocalFleet(1, tmp_path, server_args=["--threads", "1"]) as local:
            # the stock server has no control API: its control port is one nothing listens on
            stock_node = Node(NodeSpec("localhost", rpc_port=port, control_port=free_port(), name="stock"))
            fleet = Fleet([*local.fleet, stock_node])
            seen = []
            result = run_model_ab(
                fleet,
                model,
                rounds=1,
                n_prompt=16,
                n_gen=6,
                progress=lambda step, fraction: seen.append((step, fraction)),
            )
    finally:
        stock.terminate()
        stock.wait(10)
    assert result.ok  # the same text in both arms
    assert result.arms["hub"].md5 == result.arms["direct"].md5
    assert not result.direct_ran and result.arms["direct"].copies_ok == 0
    assert "never ran" in result.verdict and "identical" not in result.verdict
    assert any("stock" in why and "no control API" in why for why in result.why_not_direct), (
        result.why_not_direct
    )
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    json.dumps(result.as_dict())  # the --json document is JSON


def test_model_ab_refuses_before_running_when_the_direct_path_cannot_copy(tmp_path, capsys):
    """P2P off on one node, then an allow-list that refuses the next node: nothing runs, exit 1,
    one line naming the node and what to do (no tools needed: it stops before them)."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with LocalFleet(2, tmp_path / "a", server_args=["--threads", "1"]) as local:
        assert local.fleet.select(["local-1"]).map(lambda n: n.set_p2p(False)).ok
        assert main(["ab", str(local.nodes_file), "--model", str(model), *SMALL]) == 1
        err = capsys.readouterr().err
        assert "the direct path cannot copy on this fleet: P2P is off on local-1" in err
        assert "Nothing was run" in err and "--anyway" in err
    with LocalFleet(
        2, tmp_path / "b", server_args=["--threads", "1", "--peer-allow", "10.9.0.0/16"]
    ) as local:
        assert main(["ab", str(local.nodes_file), "--model", str(model), *SMALL]) == 1
        err = capsys.readouterr().err
        assert "local-0's peer allow-list (10.9.0.0/16) refuses local-1 (127.0.0.1)" in err


@needs_patched_tools
@pytest.mark.timeout(600)
def test_model_ab_anyway_runs_says_so_first_and_claims_no_win(tmp_path, model, capsys):
    with LocalFleet(2, tmp_path, server_args=["--threads", "1"]) as local:
        assert local.fleet.map(lambda n: n.set_p2p(False)).ok
        code = main(
            [
                "ab",
                str(local.nodes_file),
                "--model",
                str(model),
                *SMALL,
                "--anyway",
                "--json",
                "--chart",
                str(tmp_path / "ab.png"),
            ]
        )
        out, err = capsys.readouterr()
    assert code == 1
    assert err.index("WARNING: the direct arm will not copy") < err.index("never ran")
    doc = json.loads(out)
    assert doc["ok"] and not doc["direct_ran"] and "never ran" in doc["verdict"]


@needs_patched_tools
@pytest.mark.timeout(600)
def test_model_ab_p2p_off_on_the_nodes_is_no_success(tmp_path, model):
    with LocalFleet(2, tmp_path, server_args=["--threads", "1"]) as local:
        assert local.fleet.map(lambda n: n.set_p2p(False)).ok
        result = run_model_ab(local.fleet, model, rounds=1, n_prompt=16, n_gen=4)
    assert result.ok and not result.direct_ran
    assert result.arms["direct"].per_step["client"].get("COPY_TENSOR_TO", {}).get("count", 0) == 0
    assert "never ran" in result.verdict
    assert any("P2P is off on local-0" in why for why in result.why_not_direct), result.why_not_direct


@pytest.mark.parametrize("columns", [80, 120])
def test_terminal_bars_fit_the_console_and_keep_the_ratio(columns):
    from rich.console import Console

    from fleetd.fleet.render import model_ab_bars

    arms = {"hub": (3287.63, 2833.54, 3702.60), "direct": (3528.29, 3081.47, 4131.26)}
    doc = {
        "arms": {
            arm: {
                "median": {k: med for k in METRICS},
                "spread": {k: [lo, hi] for k in METRICS},
            }
            for arm, (med, lo, hi) in arms.items()
        }
    }
    console = Console(width=columns, record=True, color_system=None)
    console.print(model_ab_bars(doc, console.width))
    lines = console.export_text().splitlines()
    assert all(len(line) <= columns and "…" not in line for line in lines)
    hub, direct = (next(line.count("█") for line in lines if f" {arm} " in f" {line} ") for arm in arms)
    assert 0 < hub < direct  # the longer median keeps the longer bar


# -- llama-server and the load generator (fleetd.fleet.server_load) ----------------------------

needs_server = needs_tool("p2p/llama-server")


def _server(model: Path, start_timeout: float = 120) -> LlamaServer:
    """The patched llama-server on this host's CPU, no fleet: what the load tests need."""
    from fleetd.tools import find_p2p_tool

    args = ["-m", str(model), "-t", "1", "-np", "2", "-c", "512", "--no-webui"]
    return LlamaServer(find_p2p_tool("llama-server"), args, os.environ, "test", start_timeout)


@pytest.fixture(scope="module")
def server(model):
    with _server(model) as srv:
        yield srv


@needs_server
def test_load_stops_at_its_count(server):
    load = run_load(server.port, 3, SERVER_PROMPTS, 4, LoadLimits(requests=5, seconds=60))
    assert (load.requests, load.tokens, load.stopped_by, load.errors) == (5, 20, "count", [])
    assert load.tokens_per_s > 0 and load.requests_per_s > 0
    assert sum(map(len, load.texts.values())) == len(SERVER_PROMPTS)  # one greedy text a prompt


@needs_server
def test_load_stops_at_its_time_limit(server):
    started = time.monotonic()
    load = run_load(server.port, 2, SERVER_PROMPTS, 8, LoadLimits(requests=1_000_000, seconds=1.0))
    took = time.monotonic() - started
    assert load.stopped_by == "time" and 0 < load.requests < 1_000_000 and not load.errors
    # no request starts after 1 s; the ones in flight then end within a request's time
    assert 1.0 <= took < 1.0 + 10 and load.seconds <= took


@needs_server
def test_a_server_that_cannot_start_is_one_line_and_is_stopped(tmp_path, model):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    started = time.monotonic()
    srv = _server(bad)
    with pytest.raises(FleetError) as exc, srv:
        pass
    message = str(exc.value)
    assert message.startswith("llama-server (test) exited ") and "before it was ready: " in message
    assert "\n" not in message and time.monotonic() - started < 60
    assert srv.pid and not Path(f"/proc/{srv.pid}").exists()  # reaped
    # a server that does not get ready in time: stopped, one line (no time at all here)
    slow = _server(model, start_timeout=0)
    with pytest.raises(FleetError, match=r"^llama-server \(test\) not ready within 0s: ") as exc, slow:
        pass
    assert "\n" not in str(exc.value) and not Path(f"/proc/{slow.pid}").exists()

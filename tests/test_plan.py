"""fleetctl plan (#21 item 1): the GGUF sizes, the optimiser on made-up fleets, the whole command
over a local fleet with a memory-limited node, and the prediction against what llama.cpp reports.

The optimiser tests build `NodeFacts` by hand (they are the probe's output, plain data); the
rest runs real fleetd processes, the real `gguf` reader and, where built, llama-completion.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
from helpers import needs_tool

from fleetd.fleet.local import LocalFleet
from fleetd.fleet.plan import (
    COMPUTE_TOLERANCE,
    DoesNotFit,
    Fleet,
    Link,
    NodeFacts,
    Workload,
    decode_seconds,
    fixed_seconds,
    full_speed,
    kv_bytes_per_layer,
    kv_cells,
    layers_from_split,
    optimise,
    padded,
    predict,
    read_model,
    step_input_bytes,
    tensor_split,
    usable_memory,
)
from fleetd.fleet.plan_probe import _median_pass
from fleetd.models import Dims, write_model
from fleetd.tools import find_tool

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
# 7 layers of ~6 MiB (f16, n_embd 512, n_ff 1536): small enough to generate in seconds, big
# enough that a --max-memory of a few tens of MiB decides how many layers a node can take.
PLAN_DIMS = Dims(n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_ff=1536, n_layer=7)
CTX = 512


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan-models") / "llama-f16-plan.gguf"
    write_model(path, "llama", "f16", PLAN_DIMS)
    return path


@pytest.fixture(scope="module")
def model(model_path):
    return read_model(model_path)


# -- made-up fleets for the optimiser --------------------------------------------------------------

FAST_LINK = Link(latency_s=50e-6, bytes_per_s=1e9)


def node(name: str, free: int, layer_ms: float = 1.0, link: Link = FAST_LINK) -> NodeFacts:
    return NodeFacts(
        name=name,
        endpoint=f"{name}:50052",
        free=free,
        total=free,
        kind="cpu (ggml)",
        alignment=32,
        peer_copy=False,
        decode_layer_s=layer_ms / 1e3,
        prompt_token_s=layer_ms / 1e3 / 20,
        output_decode_s=layer_ms / 1e3,
        output_prompt_s=layer_ms / 1e3 / 20,
        upload=link,
        download=link,
    )


def room_for(model, layers: int, last: bool = False) -> int:
    """Free memory that holds exactly `layers` layers (and not one more) with the plan's margin."""
    from fleetd.fleet.plan import MEMORY_MARGIN, MEMORY_MARGIN_BYTES, compute_buffer_bytes

    work = Workload(ctx=CTX)
    per_layer = model.layer_bytes(0) + kv_bytes_per_layer(model, work.cells)
    need = layers * per_layer + compute_buffer_bytes(model, work.cells, last) + model.output_bytes()
    need += per_layer // 2  # half a layer more: not a whole one
    return int((need + MEMORY_MARGIN_BYTES) / (1 - MEMORY_MARGIN)) + 1


def counts_by_name(plan) -> dict[str, int]:
    return {s.name: s.layers for s in plan.stages}


def test_a_slow_node_gets_fewer_layers(model):
    # Each node holds at most 5 of the 7 layers: both are needed; the slow one takes the rest.
    fleet = Fleet((node("fast", room_for(model, 5)), node("slow", room_for(model, 5), layer_ms=4.0)))
    plan = optimise(model, fleet, Workload(ctx=CTX))
    assert counts_by_name(plan) == {"fast": 5, "slow": 2}


def test_with_room_to_spare_a_slow_node_is_left_out(model):
    fleet = Fleet((node("fast", 1 << 34), node("slow", 1 << 34, layer_ms=4.0)))
    plan = optimise(model, fleet, Workload(ctx=CTX))
    assert counts_by_name(plan) == {"fast": 7} and plan.unused == ("slow",)


def test_a_memory_limited_node_gets_no_more_than_it_holds(model):
    # The fastest node holds 2 layers: it gets 2, not the 7 its speed would earn.
    fleet = Fleet((node("small", room_for(model, 2), layer_ms=0.5), node("big", 1 << 34, layer_ms=1.0)))
    plan = optimise(model, fleet, Workload(ctx=CTX))
    assert counts_by_name(plan)["small"] <= 2
    assert sum(s.layers for s in plan.stages) == model.n_layer
    for s in plan.stages:
        assert s.memory.total <= usable_memory(s.memory.free), s


def test_a_node_behind_a_slow_link_sits_where_fewest_boundaries_cross_it(model):
    # Hub path (no peer copy): a middle node's hidden state crosses its link four times per
    # step, an end node's twice. Each node holds 3 layers at most: all three are needed.
    slow = Link(latency_s=2e-3, bytes_per_s=2e6)
    nodes = (
        node("a", room_for(model, 3)),
        node("b", room_for(model, 3)),
        node("behind-slow-link", room_for(model, 3), link=slow),
    )
    plan = optimise(model, Fleet(nodes), Workload(ctx=CTX))
    order = [s.name for s in plan.stages]
    assert len(order) == 3 and order.index("behind-slow-link") in (0, 2), order


def _measured(name: str, gate: bool) -> NodeFacts:
    """A node whose decode step (its commands, ending in one 0.5 ms round trip) was measured."""
    link = Link(latency_s=0.5e-3, bytes_per_s=100e6)
    return replace(node(name, 1 << 34, link=link), step_s=1.2e-3, peer_copy=True, peer_gate=gate)


@pytest.mark.parametrize("gate", [True, False])
def test_the_client_waits_where_a_result_must_come_back(model, gate):
    """One decode step's fixed time, by hand: each node's step less its round trip, the waits
    where the client has them (the logits; per boundary the hub's GET, the synchronous copy's
    answer, nothing for a gated push but its half of the peer round trip)."""
    nodes = tuple(_measured(n, gate) for n in ("a", "b", "c"))
    peer = Link(latency_s=1.4e-3, bytes_per_s=250e6)  # as timed from the client: includes its 0.5 ms
    fleet = Fleet(nodes, {(0, 1): peer, (1, 2): peer})
    hidden, logits = model.hidden_bytes, model.n_vocab * 4
    inputs = 3 * (step_input_bytes(1) / 100e6) + hidden / 100e6
    commands = 3 * (1.2e-3 - 0.5e-3)
    wait = nodes[2].output_decode_s + 0.5e-3 + logits / 100e6  # the output matrix, then the GET
    direct = (1.4e-3 - 0.5e-3) / 2 + hidden / 250e6 if gate else 1.4e-3 + hidden / 250e6
    hub = 0.5e-3 + hidden / 100e6 + hidden / 100e6
    for is_direct, boundary in ((True, direct), (False, hub)):
        expect = commands + inputs + 2 * boundary + wait
        assert fixed_seconds(model, fleet, [0, 1, 2], 1, is_direct) == pytest.approx(expect, rel=1e-9)
    # a stock node (nothing measured beyond its round trip) costs one wait per boundary on the hub
    stock = Fleet(tuple(replace(n, step_s=0.0) for n in nodes))
    expect = inputs + 2 * hub + wait
    assert fixed_seconds(model, stock, [0, 1, 2], 1, False) == pytest.approx(expect, rel=1e-9)


def _quota(name: str, free: int) -> NodeFacts:
    """A node with a quarter of a core: 1 ms a layer's matrices in a short burst, 4 ms back to
    back; its other ops 0.4 ms a layer back to back."""
    profile = ((1, 1.0e-3), (2, 2.2e-3), (4, 16e-3))
    return replace(
        node(name, free, layer_ms=4.4), decode_matmul_s=4e-3, decode_profile=profile, output_decode_s=2e-3
    )


def test_full_speed_and_share_come_from_the_burst_profile():
    n = _quota("q", 1 << 30)
    assert full_speed(n) == pytest.approx((1.0e-3, 0.25))
    assert decode_seconds(n, 0) == 0
    assert decode_seconds(n, 3) == pytest.approx(3 * (1.0e-3 + 0.4e-3 * 0.25))
    # a burst slower than back to back (a noisy profile) is not full speed: back to back is
    slow = replace(n, decode_profile=((1, 9e-3), (2, 18e-3)))
    assert full_speed(slow) == pytest.approx((4e-3, 1.0))
    # without a profile, linear in the layers at decode_layer_s
    assert decode_seconds(node("plain", 1 << 30, layer_ms=2.0), 5) == pytest.approx(10e-3)


def test_the_last_layer_of_a_prompt_runs_its_feed_forward_for_the_outputs_alone(model):
    """llama.cpp keeps only the output rows after the last layer's attention: a slow node is
    cheaper last than first by its feed-forward matrices over the batch's other rows."""
    # f16 weights: ffn_up, ffn_gate, ffn_down 512 x 1536; attn_q, attn_output 512 x 512 (8 heads
    # of 64); attn_k, attn_v 512 x 128 (2 KV heads)
    ffn = 3 * 512 * 1536
    attn = 2 * 512 * 512 + 2 * 512 * 128
    assert model.ffn_fraction == pytest.approx(ffn / (ffn + attn))
    fast = replace(node("fast", 1 << 30, layer_ms=1.0), prompt_matmul_s=0.04e-3)
    slow = replace(node("slow", 1 << 30, layer_ms=8.0), prompt_matmul_s=0.32e-3)
    fleet = Fleet((fast, slow))
    work = Workload(ctx=CTX, ubatch=256)
    n = model.n_layer
    slow_last = work.prompt_tokens / predict(model, fleet, (0, 1), (n - 1, 1), work).prompt_hub
    slow_first = work.prompt_tokens / predict(model, fleet, (1, 0), (1, n - 1), work).prompt_hub
    # the orders differ by the boundary's direction too (the links are symmetric here) and by
    # which node multiplies the last token's row by the output matrix
    saved = (slow.prompt_matmul_s - fast.prompt_matmul_s) * model.ffn_fraction * (work.prompt_tokens - 1)
    output = slow.output_decode_s - fast.output_decode_s
    assert slow_first - slow_last == pytest.approx(saved - output, rel=0.02)
    # decode computes every layer for its one row: the orders differ by the output row alone
    step_last = 1 / predict(model, fleet, (0, 1), (n - 1, 1), work).decode_hub
    step_first = 1 / predict(model, fleet, (1, 0), (1, n - 1), work).decode_hub
    assert step_last - step_first == pytest.approx(output, rel=0.02)


def test_the_layer_matrices_count_at_their_median_pass():
    """A node's matrices timed in several passes over the fleet: the median pass counts, each
    of decode and prompt on its own, and a layer's other ops stay as first timed."""
    first = replace(node("n", 1 << 30, layer_ms=1.5), decode_matmul_s=1.2e-3, prompt_token_s=0.2e-3)
    first = replace(first, prompt_matmul_s=0.17e-3)
    passes = [(1.2e-3, 0.17e-3), (0.7e-3, 0.13e-3), (0.9e-3, 0.21e-3)]
    got = _median_pass(first, passes)
    assert got.decode_matmul_s == pytest.approx(0.9e-3)
    assert got.prompt_matmul_s == pytest.approx(0.17e-3)
    assert got.decode_layer_s == pytest.approx(0.9e-3 + 0.3e-3)
    assert got.prompt_token_s == pytest.approx(0.17e-3 + 0.03e-3)
    assert replace(got, decode_matmul_s=0, prompt_matmul_s=0, decode_layer_s=0, prompt_token_s=0) == replace(
        first, decode_matmul_s=0, prompt_matmul_s=0, decode_layer_s=0, prompt_token_s=0
    )


def test_a_node_computes_at_most_its_share_of_the_step(model):
    """A quarter-core node holding 6 layers is busy 6.6 ms a token at full speed: the step is at
    least 4x that, longer than the pipeline's sum; with 1 layer the sum decides."""
    fleet = Fleet((_quota("q", 1 << 34), node("fast", 1 << 34)))
    work = Workload(ctx=CTX)
    bound = 6 * (1.0e-3 + 0.1e-3) / 0.25
    assert 1 / predict(model, fleet, [0, 1], [6, 1], work).decode_direct == pytest.approx(bound)
    short = predict(model, fleet, [0, 1], [1, 6], work).decode_direct
    assert 1 / short == pytest.approx(
        decode_seconds(fleet.nodes[0], 1) + 6e-3 + fixed_seconds(model, fleet, [0, 1], 1, True)
    )
    # the last node's output matrix is in its share too (at full speed: 2 ms x 0.25)
    last = predict(model, fleet, [1, 0], [1, 6], work).decode_direct
    assert 1 / last == pytest.approx((6 * 1.1e-3 + 0.5e-3) / 0.25)


def test_a_model_that_does_not_fit_names_the_node_and_the_shortfall(model):
    fleet = Fleet((node("roomy", room_for(model, 5)), node("tiny", 24 * MIB)))
    with pytest.raises(DoesNotFit) as info:
        optimise(model, fleet, Workload(ctx=CTX))
    assert "tiny" in info.value.shortfalls and info.value.shortfalls["tiny"] > 0
    assert "does not fit" in str(info.value) and "tiny short by" in str(info.value)


@pytest.mark.parametrize("counts", [[7], [3, 4], [5, 2], [1, 1, 5], [2, 3, 2], [1, 1, 1, 4], [10, 30, 40]])
def test_the_printed_tensor_split_gives_exactly_the_planned_counts(counts):
    """llama.cpp's load_tensors cut (cumulative share > il / (n_layer + 1)), applied to our split."""
    split = [float(x) for x in tensor_split(counts).split(",")]
    assert layers_from_split(split, sum(counts)) == counts


def test_kv_cells_pad_as_llama_context_does():
    assert kv_cells(512, 1) == 512
    assert kv_cells(1000, 1) == 1024
    assert kv_cells(2048, 2) == 2048  # two sequences of 1024
    assert kv_cells(2048, 4) == 2048  # four of 512
    assert kv_cells(1024, 3) == 3 * 512  # 1024 / 3 = 341, padded to 256 per sequence


# -- the GGUF --------------------------------------------------------------------------------------


def test_layer_sizes_match_the_tensor_table_of_the_file(model_path, model):
    """Per layer, the bytes of its tensors as the file lays them out: from ne and the type's block
    size (gguf's GGML_QUANT_SIZES), independent of the reader's n_bytes."""
    reader = gguf.GGUFReader(str(model_path))
    per_layer = [0] * PLAN_DIMS.n_layer
    for t in reader.tensors:
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        nbytes = int(t.n_elements) // block * size
        if t.name.startswith("blk."):
            per_layer[int(t.name.split(".")[1])] += nbytes
    assert [sum(b) for b in model.layer_tensors] == per_layer
    assert model.n_layer == 7 and model.n_embd == 512 and model.n_head_kv == 2
    assert {m.name for m in model.layer_matrices} == {
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    }
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert model.input_bytes == int(embd.n_bytes)
    # f16 KV: K and V of n_head_kv x head_dim per cell
    assert kv_bytes_per_layer(model, 512) == 2 * 512 * 2 * 64 * 2


# -- the command over a local fleet ----------------------------------------------------------------

# --max-memory per node: "big" holds 3 of the 7 layers, "small" only 1 (compute buffer ~19 MiB,
# a layer ~6 MiB with its KV at -c 512): the plan must use all three, the small one least.
BIG, SMALL = "48M", "34M"


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory):
    work = tmp_path_factory.mktemp("plan-fleet")
    args = ["--threads", "1"]
    (work / "big").mkdir()
    (work / "small").mkdir()
    with (
        LocalFleet(2, work / "big", server_args=[*args, "--max-memory", BIG]) as big,
        LocalFleet(1, work / "small", server_args=[*args, "--max-memory", SMALL]) as small,
    ):
        lines = [
            line.replace("name=local-", f"name={kind}-")
            for kind, lf in (("big", big), ("small", small))
            for line in lf.nodes_file.read_text().splitlines()
            if line and not line.startswith("#")
        ]
        path = work / "nodes.txt"
        path.write_text("\n".join(lines) + "\n")
        yield path


def fleetctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from fleetd.ctl import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def plan_doc(model_path, fleet_file) -> dict:
    p = fleetctl("plan", str(model_path), str(fleet_file), "--ctx", str(CTX), "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_plan_gives_the_memory_limited_node_fewer_layers(plan_doc):
    doc = plan_doc
    assert doc["version"] == 1 and doc["fits"] is True
    counts = {s["name"]: s["layer_count"] for s in doc["stages"]}
    assert sum(counts.values()) == 7 and set(counts) == {"big-0", "big-1", "small-0"}, counts
    assert counts["small-0"] < min(counts["big-0"], counts["big-1"]), counts
    for s in doc["stages"]:
        assert s["memory"]["total"] <= s["memory"]["usable"], s
    assert layers_from_split([float(x) for x in doc["tensor_split"].split(",")], 7) == [
        s["layer_count"] for s in doc["stages"]
    ]
    assert doc["llama_args"][:2] == ["--rpc", doc["rpc"]]
    measured = doc["measured"]
    assert len(measured["nodes"]) == 3 and all(n["decode_layer_s"] > 0 for n in measured["nodes"])
    assert all(x["link"] is not None for x in measured["peers"]), measured["peers"]  # fleetd copies
    assert all(v > 0 for v in doc["predicted"].values())


def test_plan_prints_tables(model_path, fleet_file):
    p = fleetctl("plan", str(model_path), str(fleet_file), "--ctx", str(CTX))
    assert p.returncode == 0, p.stderr
    for text in ("--tensor-split", "expected tokens/s", "small-0", "decode t/s"):
        assert text in p.stdout, p.stdout


def test_a_model_that_does_not_fit_exits_1_naming_the_nodes(model_path, fleet_file):
    p = fleetctl("plan", str(model_path), str(fleet_file), "--ctx", "65536")
    assert p.returncode == 1
    line = p.stderr.strip()
    assert "does not fit" in line and "short by" in line and "small-0" in line, line
    j = fleetctl("plan", str(model_path), str(fleet_file), "--ctx", "65536", "--json")
    assert j.returncode == 1 and json.loads(j.stdout)["fits"] is False


def test_usage_errors_exit_2(fleet_file, tmp_path):
    assert fleetctl("plan", str(tmp_path / "missing.gguf"), str(fleet_file)).returncode == 2
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"not a gguf")
    p = fleetctl("plan", str(notgguf), str(fleet_file))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) <= 2, p.stderr
    assert fleetctl("plan", str(notgguf), str(fleet_file), "--parallel", "0").returncode == 2


# -- the prediction against llama.cpp --------------------------------------------------------------

BUFFER = re.compile(r"RPC\d*\[([^\]]+)\] (model|KV|compute) buffer size =\s+([\d.]+) MiB")


def reported_buffers(model_path, plan_doc) -> dict[tuple[str, str], float]:
    """Run the plan's flags: the model, KV and compute buffer per endpoint llama-completion logs."""
    args = [str(find_tool("llama-completion")), "-m", str(model_path), *plan_doc["llama_args"]]
    args += ["-p", "the time", "-n", "2", "--temp", "0", "-no-cnv", "--no-warmup", "-t", "1", "-v"]
    p = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    log = p.stderr + p.stdout
    log = log[log.rindex("load_tensors: offloading") :]  # the load itself, not the fit's dry run
    return {(endpoint, kind): float(mib) * MIB for endpoint, kind, mib in BUFFER.findall(log)}


def assert_memory_as_predicted(plan_doc, reported, compute_tolerance: float) -> None:
    for s in plan_doc["stages"]:
        ep, mem = s["endpoint"], s["memory"]
        got = {kind: reported[(ep, kind)] for kind in ("model", "KV", "compute")}
        assert abs(got["model"] - mem["weights"]) <= 0.01 * MIB, (s["name"], got, mem)
        assert abs(got["KV"] - mem["kv"]) <= 0.01 * MIB, (s["name"], got, mem)
        assert got["compute"] <= mem["compute"] <= got["compute"] * (1 + compute_tolerance), (
            s["name"],
            got,
            mem,
        )


@needs_tool("llama-completion")
def test_predicted_memory_matches_what_llama_completion_reports(model_path, plan_doc):
    """The plan's flags, run: each node's model and KV buffers as predicted (to the rounding of
    the log's two decimals) and its compute buffer at or at most COMPUTE_TOLERANCE above."""
    assert len(plan_doc["stages"]) >= 2  # the pipelined formula
    assert_memory_as_predicted(plan_doc, reported_buffers(model_path, plan_doc), COMPUTE_TOLERANCE)


@needs_tool("llama-completion")
def test_one_node_is_sized_as_one_device_not_as_a_pipeline(model_path, tmp_path):
    """A node alone is not pipelined: llama.cpp reserves far less compute for it (the formula
    of 2+ devices put about twice what it uses), and the plan says what it will use."""
    with LocalFleet(1, tmp_path, server_args=["--threads", "1"]) as one:
        p = fleetctl("plan", str(model_path), str(one.nodes_file), "--ctx", str(CTX), "--json")
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert len(doc["stages"]) == 1 and doc["stages"][0]["layer_count"] == PLAN_DIMS.n_layer
        assert_memory_as_predicted(doc, reported_buffers(model_path, doc), COMPUTE_TOLERANCE)


def test_padded():
    assert padded(1, 32) == 32 and padded(64, 32) == 64 and padded(0, 32) == 0


def test_a_split_given_by_hand_is_described_and_checked(model):
    from fleetd.fleet.plan import PlanError, split_plan

    fleet = Fleet((node("a", 1 << 34), node("b", 1 << 34)))
    plan = split_plan(model, fleet, Workload(ctx=CTX), (1, 0), [3, 4])
    assert [(s.name, s.first_layer, s.layers, s.output) for s in plan.stages] == [
        ("b", 0, 3, False),
        ("a", 3, 4, True),
    ]
    assert plan.stages[0].memory.compute < plan.stages[1].memory.compute  # the logits on the last
    alone = split_plan(model, fleet, Workload(ctx=CTX), (0,), [7])
    assert alone.stages[0].memory.compute < plan.stages[1].memory.compute  # not pipelined
    for order, counts in (((0, 1), [3, 3]), ((0, 0), [3, 4]), ((0, 2), [3, 4]), ((0, 1), [0, 7]), ((), [])):
        with pytest.raises(PlanError):
            split_plan(model, fleet, Workload(ctx=CTX), order, counts)

"""A/B on a real model: the patched llama.cpp tools (scripts/build-llama-p2p.sh) through the
fleet's RPC endpoints, `-sm layer -ngl 99`, with GGML_RPC_P2P=0 (hub: every hidden state goes
through the coordinator) and GGML_RPC_P2P=1 (direct: server to server, COPY_TENSOR_TO_ASYNC and
PEER_GATE where both ends have them, else the synchronous COPY_TENSOR_TO).

    result = run_model_ab(fleet, Path("m.gguf"), rounds=3, n_prompt=128, n_gen=32)
    result.ok, result.verdict, result.arms["direct"].median["pp_tps"], result.as_dict()

One cell is one arm in one round, and runs the shapes asked for (`Workload.shapes`), each tool
as its own process:
  pp, decode   llama-bench -p n_prompt -n n_gen -o json: prompt tok/s (one micro-batch of the
               default -ub 512 up to 512 tokens) and decode tok/s (pp_tps, tg_tps)
  ubatch       llama-bench -p n_prompt -n 0 -b n_prompt -ub n_prompt/micro_batches: the prompt
               as >= micro_batches micro-batches in one batch, what pipeline parallelism
               overlaps across nodes (ubatch_pp_tps)
  batched4/8   llama-batched-bench -npl 4,8: 4 and 8 concurrent sequences, total tok/s
               (batched4_tps, batched8_tps)
  server       llama-server -np N over the fleet and N closed-loop clients of ours
               (fleetd.fleet.server_load): generated tok/s and requests/s (server_tps,
               server_rps), each prompt's greedy text
and always
  llama-completion --temp 0    greedy text, -n 1 and -n n_gen: the md5 of the n_gen text, and
                               the difference of the two runs' counters over the n_gen - 1
                               decode steps between them is the per-step accounting (the
                               model load, the same in both, cancels out)
Rounds alternate the order (hub, direct), (direct, hub), ...: ABBA, since the first cell of a
round tends to run fastest. Counters come from both ends: the nodes' /v1/stats (deltas around
each run, nobody's counters reset) and the client's own GGML_RPC_STATS=1 table (what crossed
the coordinator's links).

The run is not ok when the greedy text differs between any two cells (llama-completion's, or
llama-server's for one prompt), and the verdict never calls a direct arm that copied nothing a
success: it says why the copies did not happen.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import socket
import statistics
import subprocess
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fleetd.errors import FleetError
from fleetd.fleet.node import Fleet
from fleetd.fleet.server_load import SERVER_PROMPTS, LlamaServer, LoadLimits, LoadResult, run_load
from fleetd.tools import find_p2p_tool
from fleetd.wire.commands import Feature

ARMS = ("hub", "direct")
P2P_ENV = {"hub": "0", "direct": "1"}
# The shapes a cell can run, in the order it runs them, and the metrics each one reports.
SHAPE_METRICS = {
    "pp": ("pp_tps",),
    "ubatch": ("ubatch_pp_tps",),
    "batched4": ("batched4_tps",),
    "batched8": ("batched8_tps",),
    "server": ("server_tps", "server_rps"),
    "decode": ("tg_tps",),
}
SHAPES = tuple(SHAPE_METRICS)
DEFAULT_SHAPES = ("pp", "ubatch", "batched4", "decode")  # the server and 8 sequences take longest
BATCHED_SEQUENCES = {"batched4": 4, "batched8": 8}
METRICS = tuple(m for shape in SHAPES for m in SHAPE_METRICS[shape])
METRIC_LABELS = {
    "pp_tps": "prompt tok/s",
    "ubatch_pp_tps": "micro-batched prompt tok/s",
    "batched4_tps": "4-sequence batched tok/s",
    "batched8_tps": "8-sequence batched tok/s",
    "server_tps": "server tok/s",
    "server_rps": "server requests/s",
    "tg_tps": "decode tok/s",
}
PROMPT = "the time of their first new"
TOOL_TIMEOUT_S = 900.0
# The per-step table: what one decode step costs, commands the hub and direct paths differ in.
STEP_COMMANDS = (
    "COPY_TENSOR_TO",
    "PEER_BARRIER",
    "COPY_TENSOR_TO_ASYNC",
    "PEER_GATE",
    "GET_TENSOR",
    "SET_TENSOR",
    "GRAPH_COMPUTE",
    "GRAPH_RECOMPUTE",
)

_CLIENT_LINE = re.compile(r"^(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$", re.M)
# | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
_BATCHED_ROW = re.compile(
    r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6, re.M
)

Progress = Callable[[str, float], None]


def parse_shapes(text: str) -> tuple[str, ...]:
    """ "pp,decode" or "all" -> the shapes in SHAPES order; a ValueError naming a bad one."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["all"]:
        return SHAPES
    unknown = [n for n in names if n not in SHAPE_METRICS]
    if unknown or not names:
        raise ValueError(
            f"--shapes {text!r}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'} "
            f"(choose from {', '.join(SHAPES)}, or all)"
        )
    return tuple(s for s in SHAPES if s in names)


@dataclass(frozen=True)
class Workload:
    """What every cell runs: the shapes and their sizes (see the module docstring)."""

    n_prompt: int = 128
    n_gen: int = 32
    shapes: tuple[str, ...] = DEFAULT_SHAPES
    micro_batches: int = 4
    server_clients: int = 4
    server_requests: int = 4  # per client: the load stops after clients x this many
    server_seconds: float = 120.0  # no request starts later, none may take longer

    @property
    def ubatch(self) -> int:
        """-ub of the ubatch shape: the prompt in at least `micro_batches` micro-batches."""
        return max(1, self.n_prompt // self.micro_batches)

    @property
    def batched_sequences(self) -> list[int]:
        return [BATCHED_SEQUENCES[s] for s in self.shapes if s in BATCHED_SEQUENCES]

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(m for s in self.shapes for m in SHAPE_METRICS[s])

    @property
    def server_limits(self) -> LoadLimits:
        return LoadLimits(self.server_clients * self.server_requests, self.server_seconds)

    def as_dict(self) -> dict:
        return {
            "n_prompt": self.n_prompt,
            "n_gen": self.n_gen,
            "shapes": list(self.shapes),
            "metrics": list(self.metrics),
            "micro_batches": -(-self.n_prompt // self.ubatch),
            "ubatch": self.ubatch,
            "batched_sequences": self.batched_sequences,
            "server_clients": self.server_clients,
            "server_requests": self.server_clients * self.server_requests,
            "server_seconds": self.server_seconds,
        }


@dataclass
class ArmSummary:
    """One arm over all rounds: median and (min, max) of each metric, the greedy text's md5
    (llama-completion's; llama-server's texts by prompt), what one decode step cost (client and
    nodes), and the peer copies the nodes counted."""

    arm: str
    median: dict[str, float]
    spread: dict[str, tuple[float, float]]
    md5: str
    per_step: dict = field(default_factory=dict)
    copies_ok: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    rounds: int = 1
    server_md5: str = ""  # llama-server's texts by prompt, when the server shape ran

    def as_dict(self) -> dict:
        return {
            "arm": self.arm,
            "median": self.median,
            "spread": {k: list(v) for k, v in self.spread.items()},
            "md5": self.md5,
            "server_md5": self.server_md5,
            "per_step": self.per_step,
            "copies_ok": self.copies_ok,
            "fallbacks": self.fallbacks,
        }


@dataclass
class ModelAbResult:
    """A whole model A/B: the settings, every round's cells, each arm's summary and the verdict."""

    model: str
    stages: int
    settings: dict
    rounds: list[dict]
    arms: dict[str, ArmSummary]
    ok: bool
    direct_ran: bool
    verdict: str
    why_not_direct: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "stages": self.stages,
            "settings": self.settings,
            "ok": self.ok,
            "direct_ran": self.direct_ran,
            "verdict": self.verdict,
            "why_not_direct": self.why_not_direct,
            "arms": {k: a.as_dict() for k, a in self.arms.items()},
            "rounds": self.rounds,
        }


# -- the nodes' counters -----------------------------------------------------------------------


def _snapshot(fleet: Fleet) -> dict[str, object]:
    """{node name: NodeStats or the exception}: a node without a control API is no error here."""
    return {n.name: v for n, v in fleet.map(lambda n: n.stats()).items()}


def _delta(before: Mapping, after: Mapping) -> dict:
    """Per node that answered both times: command counts and bytes, copies and fallbacks."""
    out = {}
    for name, a in after.items():
        b = before.get(name)
        if isinstance(a, Exception) or b is None or isinstance(b, Exception):
            continue
        commands = {}
        for cmd, c in a.total.commands.items():
            old = b.total.commands.get(cmd)
            count = c.count - (old.count if old else 0)
            if count:
                commands[cmd] = {
                    "count": count,
                    "bytes": c.request_bytes
                    + c.response_bytes
                    - ((old.request_bytes + old.response_bytes) if old else 0),
                }
        out[name] = {
            "commands": commands,
            "copies_ok": a.peer.copies_ok - b.peer.copies_ok,
            "bytes_pushed": a.peer.bytes_pushed - b.peer.bytes_pushed,
            "fallbacks": {
                r: n - b.peer.fallbacks.get(r, 0)
                for r, n in a.peer.fallbacks.items()
                if n - b.peer.fallbacks.get(r, 0)
            },
        }
    return out


def _node_commands(delta: Mapping) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in delta.values():
        for cmd, c in d["commands"].items():
            total[cmd] = total.get(cmd, 0) + c["count"]
    return total


# -- the tools ---------------------------------------------------------------------------------


def _run(tool: str, args: list[str], arm: str, timeout: float) -> subprocess.CompletedProcess:
    return run_p2p_tool(tool, args, P2P_ENV[arm], arm, timeout)


def run_p2p_tool(
    tool: str, args: list[str], p2p: str, arm: str, timeout: float
) -> subprocess.CompletedProcess:
    """One patched llama.cpp tool with GGML_RPC_P2P=`p2p` and GGML_RPC_STATS=1; a FleetError
    with its last line of output when it fails or runs past `timeout`."""
    exe = find_p2p_tool(tool)
    env = dict(os.environ, GGML_RPC_P2P=p2p, GGML_RPC_STATS="1")
    try:
        p = subprocess.run(
            [str(exe), *args],
            capture_output=True,
            text=True,
            errors="replace",
            env=env,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise FleetError(f"{tool} ({arm}): no result within {timeout:g}s") from None
    if p.returncode != 0:
        tail = [line for line in p.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
        raise FleetError(f"{tool} ({arm}) exited {p.returncode}: {tail[0]}")
    return p


def client_stats(stderr: str, tool: str = "tool") -> dict[str, dict[str, int]]:
    """The patched client's GGML_RPC_STATS=1 table: command -> count, request/response bytes."""
    at = stderr.rfind("GGML_RPC_STATS client")
    if at < 0:
        raise FleetError(
            f"{tool} printed no GGML_RPC_STATS table: not the patched client "
            "(scripts/build-llama-p2p.sh builds it)"
        )
    return {
        m.group(1): {
            "count": int(m.group(2)),
            "request_bytes": int(m.group(3)),
            "response_bytes": int(m.group(4)),
        }
        for m in _CLIENT_LINE.finditer(stderr[at:])
        if m.group(1) != "command"
    }


def parse_bench_json(stdout: str, expect: Collection[str] = ("pp_tps", "tg_tps")) -> dict[str, float]:
    """llama-bench -o json: tok/s of the pp test (n_prompt > 0) and the tg test (n_gen > 0);
    a FleetError unless it holds exactly the `expect`ed ones."""
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise FleetError(f"llama-bench: output is not JSON ({exc})") from None
    out = {}
    for t in tests:
        key = "pp_tps" if t.get("n_prompt") else "tg_tps" if t.get("n_gen") else None
        if key:
            out[key] = float(t["avg_ts"])
    if set(out) != set(expect):
        raise FleetError(f"llama-bench: expected {sorted(expect)} in its JSON, got {sorted(out)}")
    return out


def parse_batched_table(text: str) -> list[dict[str, float]]:
    """llama-batched-bench's markdown table, one dict per row."""
    keys = ("pp", "tg", "b", "n_kv", "t_pp", "s_pp", "t_tg", "s_tg", "t", "s")
    return [dict(zip(keys, map(float, m.groups()), strict=True)) for m in _BATCHED_ROW.finditer(text)]


def _rpc_args(model: Path, rpc: str) -> list[str]:
    return ["-m", str(model), "--rpc", rpc, "-sm", "layer", "-ngl", "99", "-t", "1"]


def _bench(model: Path, rpc: str, arm: str, work: Workload, timeout: float) -> dict:
    """pp and/or decode: one llama-bench run, the default -b/-ub (one micro-batch up to 512)."""
    n_prompt = work.n_prompt if "pp" in work.shapes else 0
    n_gen = work.n_gen if "decode" in work.shapes else 0
    args = [*_rpc_args(model, rpc), "-p", str(n_prompt), "-n", str(n_gen), "-r", "1", "-o", "json"]
    expect = [k for k, n in (("pp_tps", n_prompt), ("tg_tps", n_gen)) if n]
    return parse_bench_json(_run("llama-bench", args, arm, timeout).stdout, expect)


def _ubatch(model: Path, rpc: str, arm: str, work: Workload, timeout: float) -> dict:
    """The prompt as one batch of several micro-batches (-b n_prompt, -ub n_prompt/K)."""
    args = [
        *_rpc_args(model, rpc),
        *("-p", str(work.n_prompt), "-n", "0", "-b", str(work.n_prompt), "-ub", str(work.ubatch)),
        *("-r", "1", "-o", "json"),
    ]
    bench = parse_bench_json(_run("llama-bench", args, arm, timeout).stdout, ["pp_tps"])
    return {"ubatch_pp_tps": bench["pp_tps"]}


def _batched(model: Path, rpc: str, arm: str, work: Workload, timeout: float) -> dict:
    """llama-batched-bench with every sequence count asked for, in one run: a row each."""
    sequences = work.batched_sequences
    args = [
        *_rpc_args(model, rpc),
        *("-c", str(max(sequences) * (work.n_prompt + work.n_gen) + 16)),
        *("-npp", str(work.n_prompt), "-ntg", str(work.n_gen)),
        *("-npl", ",".join(map(str, sequences))),
    ]
    # The table goes through llama.cpp's asynchronous log thread, which can drop it at exit on
    # a busy machine (as llama-completion's tail, below): rerun, at most twice.
    for _ in range(3):
        p = _run("llama-batched-bench", args, arm, timeout)
        rows = {int(r["b"]): r for r in parse_batched_table(p.stdout + "\n" + p.stderr)}
        if set(sequences) <= set(rows):
            break
    else:
        raise FleetError(f"llama-batched-bench: no result row for -npl {sequences} in its output (3 runs)")
    return {
        **{f"batched{b}_tps": rows[b]["s"] for b in sequences},
        "batched": [rows[b] for b in sequences],
    }


def server_args(model: Path, rpc: str, work: Workload) -> list[str]:
    """llama-server over the fleet with a slot per client, each slot's context room enough for
    a prompt of SERVER_PROMPTS and n_gen tokens (the host and port come from LlamaServer)."""
    per_slot = 64 + work.n_gen
    return [
        *_rpc_args(model, rpc),
        *("-np", str(work.server_clients), "-c", str(work.server_clients * per_slot)),
        "--no-webui",
    ]


def _server(model: Path, rpc: str, arm: str, work: Workload, timeout: float) -> dict:
    """llama-server under `server_clients` closed-loop clients: tok/s, requests/s, texts."""
    env = dict(os.environ, GGML_RPC_P2P=P2P_ENV[arm])
    exe = find_p2p_tool("llama-server")
    with LlamaServer(exe, server_args(model, rpc, work), env, arm, start_timeout=timeout) as server:
        load = run_load(server.port, work.server_clients, SERVER_PROMPTS, work.n_gen, work.server_limits)
    if load.errors:
        raise FleetError(f"llama-server ({arm}): {len(load.errors)} failed request(s): {load.errors[0]}")
    if not load.requests:
        raise FleetError(f"llama-server ({arm}): no request answered within {work.server_seconds:g}s")
    return {
        "server_tps": load.tokens_per_s,
        "server_rps": load.requests_per_s,
        "server": _load_doc(load),
    }


def _load_doc(load: LoadResult) -> dict:
    return {
        "clients": load.clients,
        "requests": load.requests,
        "tokens": load.tokens,
        "seconds": load.seconds,
        "stopped_by": load.stopped_by,
        "texts": load.texts,
    }


def _complete(
    fleet: Fleet, model: Path, rpc: str, arm: str, n: int, timeout: float
) -> tuple[str, dict, dict]:
    """Greedy text: (stdout, the client's GGML_RPC_STATS, the nodes' counter deltas)."""
    args = [
        *_rpc_args(model, rpc),
        "-p",
        PROMPT,
        "-n",
        str(n),
        "--temp",
        "0",
        "--seed",
        "1",
        "-no-cnv",
        "--no-warmup",
    ]
    # llama.cpp logs through an asynchronous thread that can drop the tail of the output at
    # exit on a busy machine; a complete run ends with a blank line, so rerun (at most twice).
    # The counters are those of the last run alone.
    for _ in range(3):
        before = _snapshot(fleet)
        p = _run("llama-completion", args, arm, timeout)
        delta = _delta(before, _snapshot(fleet))
        if p.stdout.endswith("\n\n"):
            break
    return p.stdout, client_stats(p.stderr, "llama-completion"), delta


def _per_step(short: tuple[dict, dict], long: tuple[dict, dict], steps: int) -> dict:
    """Commands and bytes per decode step: (run with n_gen) - (run with 1), over n_gen - 1 steps.
    Client side (the coordinator's links) from GGML_RPC_STATS, node side from /v1/stats."""
    (c1, n1), (cn, nn) = short, long
    client = {}
    for cmd, c in cn.items():
        old = c1.get(cmd, {"count": 0, "request_bytes": 0, "response_bytes": 0})
        if cmd == "total":
            continue
        count = (c["count"] - old["count"]) / steps
        if count:
            client[cmd] = {
                "count": count,
                "bytes": (
                    c["request_bytes"] + c["response_bytes"] - old["request_bytes"] - old["response_bytes"]
                )
                / steps,
            }
    nodes_long, nodes_short = _node_commands(nn), _node_commands(n1)
    nodes = {
        cmd: (nodes_long.get(cmd, 0) - nodes_short.get(cmd, 0)) / steps
        for cmd in sorted(set(nodes_long) | set(nodes_short))
    }
    return {
        "client": client,
        "nodes": {k: v for k, v in nodes.items() if v},
        "coordinator_bytes": sum(c["bytes"] for c in client.values()),
        "peer_bytes": sum(d["bytes_pushed"] for d in nn.values()) / steps
        - sum(d["bytes_pushed"] for d in n1.values()) / steps,
    }


# -- the run -----------------------------------------------------------------------------------


def check_settings(rounds: int, work: Workload) -> None:
    """One line per bad number or shape (fleetctl turns it into exit 2)."""
    for name, value, low, high in (
        ("rounds", rounds, 1, 50),
        ("n_prompt", work.n_prompt, 1, 4096),
        ("n_gen", work.n_gen, 2, 1024),
        ("micro_batches", work.micro_batches, 2, 64),
        ("server_clients", work.server_clients, 1, 64),
        ("server_requests", work.server_requests, 1, 1000),
    ):
        if not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} {value!r}: must be a whole number in {low}..{high}")
    if not 0 < work.server_seconds <= 3600:
        raise ValueError(f"server_seconds {work.server_seconds!r}: must be above 0 and at most 3600")
    parse_shapes(",".join(work.shapes) or ",")  # the same error as --shapes
    if "ubatch" in work.shapes and work.n_prompt < work.micro_batches:
        raise ValueError(
            f"n_prompt {work.n_prompt} < micro_batches {work.micro_batches}: "
            "each micro-batch needs a prompt token"
        )


# What a cell runs before llama-completion: (progress label, whether the workload asks for it,
# the run, which returns the cell's metrics and details).
_TOOL_RUNS: tuple[tuple[str, Callable[[Workload], bool], Callable[..., dict]], ...] = (
    ("llama-bench", lambda w: "pp" in w.shapes or "decode" in w.shapes, _bench),
    ("llama-bench micro-batches", lambda w: "ubatch" in w.shapes, _ubatch),
    ("llama-batched-bench", lambda w: bool(w.batched_sequences), _batched),
    ("llama-server", lambda w: "server" in w.shapes, _server),
)


def _tool_runs(work: Workload) -> list[tuple[str, Callable[..., dict]]]:
    return [(label, run) for label, wanted, run in _TOOL_RUNS if wanted(work)]


def _cell(
    fleet: Fleet,
    model: Path,
    rpc: str,
    arm: str,
    work: Workload,
    timeout: float,
    step: Callable[[str], None],
) -> dict:
    before = _snapshot(fleet)
    cell: dict = {"arm": arm}
    for label, run in _tool_runs(work):
        step(f"{arm}: {label}")
        cell.update(run(model, rpc, arm, work, timeout))
    step(f"{arm}: llama-completion")
    _, short_client, short_nodes = _complete(fleet, model, rpc, arm, 1, timeout)
    text, long_client, long_nodes = _complete(fleet, model, rpc, arm, work.n_gen, timeout)
    after = _snapshot(fleet)
    cell["md5"] = hashlib.md5(text.encode()).hexdigest()
    cell["text_chars"] = len(text)
    cell["per_step"] = _per_step((short_client, short_nodes), (long_client, long_nodes), work.n_gen - 1)
    cell["nodes"] = _delta(before, after)  # the whole cell: copies and fallbacks by reason
    cell["nodes_without_counters"] = sorted(
        name
        for name, v in after.items()
        if isinstance(v, Exception) or isinstance(before.get(name), Exception)
    )
    return cell


def _server_md5(cell: dict) -> str:
    """md5 of llama-server's texts by prompt in one cell; "" when the cell ran no server."""
    if "server" not in cell:
        return ""
    return hashlib.md5(json.dumps(cell["server"]["texts"], sort_keys=True).encode()).hexdigest()


def _summarise(arm: str, cells: list[dict]) -> ArmSummary:
    metrics = [m for m in METRICS if m in cells[0]]
    median = {m: statistics.median(c[m] for c in cells) for m in metrics}
    spread = {m: (min(c[m] for c in cells), max(c[m] for c in cells)) for m in metrics}
    fallbacks: dict[str, int] = {}
    copies = 0
    for c in cells:
        for d in c["nodes"].values():
            copies += d["copies_ok"]
            for r, n in d["fallbacks"].items():
                fallbacks[r] = fallbacks.get(r, 0) + n
    return ArmSummary(
        arm,
        median,
        spread,
        cells[0]["md5"],
        cells[0]["per_step"],
        copies,
        fallbacks,
        len(cells),
        _server_md5(cells[0]),
    )


def _md5_list(texts: list[str]) -> str:
    return "/".join(hashlib.md5(t.encode()).hexdigest()[:8] for t in texts) or "-"


def text_mismatches(round_docs: list[dict]) -> list[str]:
    """Where greedy texts differ: llama-completion's between any two cells, llama-server's for
    one prompt between or within cells; [] when every text agrees."""
    cells = [(rd["round"], c) for rd in round_docs for c in rd["cells"]]
    out = []
    if len({c["md5"] for _, c in cells}) > 1:
        diff = ", ".join(f"round {r} {c['arm']} {c['md5'][:12]}" for r, c in cells)
        out.append(f"the greedy text differs between cells ({diff})")
    served = [(r, c["arm"], c["server"]["texts"]) for r, c in cells if "server" in c]
    for prompt in sorted({p for _, _, texts in served for p in texts}):
        if len({t for _, _, texts in served for t in texts.get(prompt, [])}) > 1:
            diff = ", ".join(
                f"round {r} {arm} {_md5_list(texts.get(prompt, []))}" for r, arm, texts in served
            )
            out.append(f"llama-server's greedy text for {prompt!r} differs ({diff})")
    return out


def _why_no_copies(fleet: Fleet, direct: list[dict], summary: ArmSummary) -> list[str]:
    """What the nodes say about a direct arm that never copied, most specific first."""
    why = [f"{n} fallbacks: {reason}" for reason, n in sorted(summary.fallbacks.items())]
    silent = sorted({name for c in direct for name in c["nodes_without_counters"]})
    if silent:
        why.append(f"no counters from {', '.join(silent)}: no control API (a stock ggml-rpc-server?)")
    for node, status in fleet.map(lambda n: n.status()).items():
        if isinstance(status, Exception):
            continue
        if not status.p2p.served:
            why.append(f"{node.name} does not serve COPY_TENSOR_TO")
        elif not status.p2p.enabled:
            why.append(f"P2P is off on {node.name} (fleetctl p2p on)")
        elif not status.features & Feature.PEER_COPY:
            why.append(f"{node.name} does not advertise the peer-copy feature")
    sent = sum(
        c["per_step"]["client"].get(cmd, {}).get("count", 0)
        for c in direct
        for cmd in ("COPY_TENSOR_TO", "COPY_TENSOR_TO_ASYNC")
    )
    if not why:
        why.append(
            "the client sent no COPY_TENSOR_TO(_ASYNC)"
            if not sent
            else "the client sent peer copies but no node counted one"
        )
    return why


def direct_path_problems(fleet: Fleet) -> list[str]:
    """Why the direct arm could not copy on this fleet, asked before the run is spent: a node
    whose P2P is off or not served, a control API that does not answer, a node whose allow-list
    refuses the next node of the split (a layer split pushes from each node to the next)."""
    problems = []
    statuses = fleet.map(lambda n: n.status())
    nodes = list(fleet)
    for i, node in enumerate(nodes):
        status = statuses.get(node)
        if isinstance(status, BaseException) or status is None:
            problems.append(
                f"{node.name}: no control API answer ({status}): cannot check P2P "
                "(a stock ggml-rpc-server never copies)"
            )
            continue
        if not status.p2p.served:
            problems.append(f"{node.name} does not serve COPY_TENSOR_TO")
        elif not status.p2p.enabled:
            problems.append(f"P2P is off on {node.name} (fleetctl p2p on NODES)")
        elif not status.features & Feature.PEER_COPY:
            problems.append(f"{node.name} does not advertise the peer-copy feature")
        if i + 1 < len(nodes):
            nxt = nodes[i + 1]
            try:
                ip = socket.getaddrinfo(nxt.spec.host, None, type=socket.SOCK_STREAM)[0][4][0]
            except OSError:
                continue  # the node resolves it, not us: no verdict from here
            if status.p2p.allows(ip) is False:
                problems.append(
                    f"{node.name}'s peer allow-list ({', '.join(status.p2p.peer_allow or ())}) "
                    f"refuses {nxt.name} ({ip}): redeploy with it in --peer-allow"
                )
    return problems


def on_loopback(fleet: Fleet) -> bool:
    """Every node on this host's loopback (a demo or LocalFleet, not a lab's namespaces)."""

    def loopback(host: str) -> bool:
        try:
            return host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    return all(loopback(n.spec.host) and not n.spec.via_netns for n in fleet)


def _beyond_spread(hub: ArmSummary, direct: ArmSummary, metric: str) -> str:
    """Whether the two arms' min..max ranges over rounds overlap; one round has no spread."""
    if hub.rounds < 2 or direct.rounds < 2:
        return "one round: no spread to compare"
    (h_lo, h_hi), (d_lo, d_hi) = hub.spread[metric], direct.spread[metric]
    if d_lo > h_hi:
        return "faster beyond the spread"
    if d_hi < h_lo:
        return "slower beyond the spread"
    return "within the spread"


def _check_inputs(fleet: Fleet, model: Path, work: Workload) -> None:
    if not model.is_file():
        raise FleetError(f"model {model}: no such file")
    if not fleet:
        raise FleetError("the fleet has no nodes")
    tools = {"llama-completion", *(label.split()[0] for label, _ in _tool_runs(work))}
    for tool in sorted(tools):
        try:
            find_p2p_tool(tool)
        except FileNotFoundError as exc:  # names the build script
            raise FleetError(str(exc)) from None


def _verdict(fleet: Fleet, arms: dict[str, ArmSummary], mismatches: list[str], why: list[str]) -> str:
    if mismatches:
        return "FAILED: " + "; ".join(mismatches)
    if why:
        return "same text, but the direct path never ran: " + "; ".join(why)
    hub, direct = arms["hub"], arms["direct"]
    gains = ", ".join(
        f"{METRIC_LABELS[m]} x{direct.median[m] / hub.median[m]:.2f} ({_beyond_spread(hub, direct, m)})"
        for m in hub.median
        if hub.median[m]
    )
    verdict = (
        f"same text in every cell (md5 {hub.md5[:12]}); direct vs hub: {gains}; "
        f"{direct.copies_ok} peer copies"
    )
    if on_loopback(fleet):
        verdict += (
            "; every node is on loopback, where the link is not the bottleneck: the "
            "direct path pays off where the coordinator's link is slow (fleetctl lab)"
        )
    return verdict


def run_model_ab(
    fleet: Fleet,
    model: Path,
    *,
    rounds: int = 3,
    n_prompt: int = 128,
    n_gen: int = 32,
    shapes: tuple[str, ...] = DEFAULT_SHAPES,
    micro_batches: int = 4,
    server_clients: int = 4,
    server_requests: int = 4,
    server_seconds: float = 120.0,
    progress: Progress | None = None,
    timeout: float = TOOL_TIMEOUT_S,
) -> ModelAbResult:
    """Both arms over `rounds` rounds, each cell running `shapes` (SHAPES; the sizes are
    Workload's); see the module docstring. Raises ValueError for bad numbers or shapes and
    FleetError when a tool is missing or fails; a text mismatch is `ok=False`."""
    work = Workload(
        n_prompt, n_gen, tuple(shapes), micro_batches, server_clients, server_requests, server_seconds
    )
    check_settings(rounds, work)
    model = Path(model)
    _check_inputs(fleet, model, work)
    rpc = ",".join(n.spec.rpc_endpoint for n in fleet)
    total_steps, done = rounds * len(ARMS) * (len(_tool_runs(work)) + 1), 0

    def step(what: str) -> None:
        nonlocal done
        if progress is not None:
            progress(what, done / total_steps)
        done += 1

    round_docs = []
    for r in range(rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        cells = [
            _cell(
                fleet,
                model,
                rpc,
                arm,
                work,
                timeout,
                lambda what, r=r: step(f"round {r + 1}/{rounds} {what}"),
            )
            for arm in order
        ]
        round_docs.append({"round": r + 1, "order": list(order), "cells": cells})
    if progress is not None:
        progress("done", 1.0)

    by_arm = {arm: [c for rd in round_docs for c in rd["cells"] if c["arm"] == arm] for arm in ARMS}
    arms = {arm: _summarise(arm, cells) for arm, cells in by_arm.items()}
    mismatches = text_mismatches(round_docs)
    direct_ran = arms["direct"].copies_ok > 0
    why = [] if direct_ran else _why_no_copies(fleet, by_arm["direct"], arms["direct"])
    verdict = _verdict(fleet, arms, mismatches, why)
    settings = {"rounds": rounds, **work.as_dict(), "rpc": rpc, "prompt": PROMPT}
    return ModelAbResult(
        str(model), len(fleet), settings, round_docs, arms, not mismatches, direct_ran, verdict, why
    )

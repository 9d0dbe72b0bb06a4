"""A/B on a real model: the patched llama.cpp tools (scripts/build-llama-p2p.sh) through the
fleet's RPC endpoints, `-sm layer -ngl 99`, with GGML_RPC_P2P=0 (hub: every hidden state goes
through the coordinator) and GGML_RPC_P2P=1 (direct: server to server, COPY_TENSOR_TO_ASYNC and
PEER_GATE where both ends have them, else the synchronous COPY_TENSOR_TO).

    result = run_model_ab(fleet, Path("m.gguf"), rounds=3, n_prompt=128, n_gen=32)
    result.ok, result.verdict, result.arms["direct"].median["pp_tps"], result.as_dict()

One cell is one arm in one round, and runs, each as its own process:
  llama-bench -o json          prompt processing and decode tok/s (pp_tps, tg_tps)
  llama-batched-bench          BATCH_SEQUENCES concurrent sequences, total tok/s (batched_tps)
  llama-completion --temp 0    greedy text, -n 1 and -n n_gen: the md5 of the n_gen text, and
                               the difference of the two runs' counters over the n_gen - 1
                               decode steps between them is the per-step accounting (the
                               model load, the same in both, cancels out)
Rounds alternate the order (hub, direct), (direct, hub), ...: ABBA, since the first cell of a
round tends to run fastest. Counters come from both ends: the nodes' /v1/stats (deltas around
each run, nobody's counters reset) and the client's own GGML_RPC_STATS=1 table (what crossed
the coordinator's links).

The run is not ok when the greedy text differs between any two cells, and the verdict never
calls a direct arm that copied nothing a success: it says why the copies did not happen.
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fleetd.errors import FleetError
from fleetd.fleet.node import Fleet
from fleetd.tools import find_p2p_tool
from fleetd.wire.commands import Feature

ARMS = ("hub", "direct")
P2P_ENV = {"hub": "0", "direct": "1"}
METRICS = ("pp_tps", "tg_tps", "batched_tps")
METRIC_LABELS = {"pp_tps": "prompt tok/s", "tg_tps": "decode tok/s", "batched_tps": "batched tok/s"}
BATCH_SEQUENCES = 4
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


@dataclass
class ArmSummary:
    """One arm over all rounds: median and (min, max) of each metric, the greedy text's md5,
    what one decode step cost (client and nodes), and the peer copies the nodes counted."""

    arm: str
    median: dict[str, float]
    spread: dict[str, tuple[float, float]]
    md5: str
    per_step: dict = field(default_factory=dict)
    copies_ok: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    rounds: int = 1

    def as_dict(self) -> dict:
        return {
            "arm": self.arm,
            "median": self.median,
            "spread": {k: list(v) for k, v in self.spread.items()},
            "md5": self.md5,
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


def parse_bench_json(stdout: str) -> dict[str, float]:
    """llama-bench -o json: tok/s of the pp test (n_prompt > 0) and the tg test (n_gen > 0)."""
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise FleetError(f"llama-bench: output is not JSON ({exc})") from None
    out = {}
    for t in tests:
        key = "pp_tps" if t.get("n_prompt") else "tg_tps" if t.get("n_gen") else None
        if key:
            out[key] = float(t["avg_ts"])
    if set(out) != {"pp_tps", "tg_tps"}:
        raise FleetError(f"llama-bench: expected a pp and a tg test in its JSON, got {sorted(out)}")
    return out


def parse_batched_table(text: str) -> list[dict[str, float]]:
    """llama-batched-bench's markdown table, one dict per row."""
    keys = ("pp", "tg", "b", "n_kv", "t_pp", "s_pp", "t_tg", "s_tg", "t", "s")
    return [dict(zip(keys, map(float, m.groups()), strict=True)) for m in _BATCHED_ROW.finditer(text)]


def _rpc_args(model: Path, rpc: str) -> list[str]:
    return ["-m", str(model), "--rpc", rpc, "-sm", "layer", "-ngl", "99", "-t", "1"]


def _bench(model: Path, rpc: str, arm: str, n_prompt: int, n_gen: int, timeout: float) -> dict:
    p = _run(
        "llama-bench",
        [*_rpc_args(model, rpc), "-p", str(n_prompt), "-n", str(n_gen), "-r", "1", "-o", "json"],
        arm,
        timeout,
    )
    return parse_bench_json(p.stdout)


def _batched(model: Path, rpc: str, arm: str, n_prompt: int, n_gen: int, timeout: float) -> dict:
    ctx = BATCH_SEQUENCES * (n_prompt + n_gen) + 16
    args = [
        *_rpc_args(model, rpc),
        "-c",
        str(ctx),
        "-npp",
        str(n_prompt),
        "-ntg",
        str(n_gen),
        "-npl",
        str(BATCH_SEQUENCES),
    ]
    # The table goes through llama.cpp's asynchronous log thread, which can drop it at exit on
    # a busy machine (as llama-completion's tail, below): rerun, at most twice.
    for _ in range(3):
        p = _run("llama-batched-bench", args, arm, timeout)
        rows = parse_batched_table(p.stdout + "\n" + p.stderr)
        if rows:
            break
    else:
        raise FleetError("llama-batched-bench: no result table in its output (3 runs)")
    return {"batched_tps": rows[-1]["s"], "batched": rows}


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


def check_settings(rounds: int, n_prompt: int, n_gen: int) -> None:
    """One line per bad number (fleetctl turns it into exit 2)."""
    for name, value, low, high in (
        ("rounds", rounds, 1, 50),
        ("n_prompt", n_prompt, 1, 4096),
        ("n_gen", n_gen, 2, 1024),
    ):
        if not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} {value!r}: must be a whole number in {low}..{high}")


def _cell(
    fleet: Fleet,
    model: Path,
    rpc: str,
    arm: str,
    n_prompt: int,
    n_gen: int,
    timeout: float,
    step: Callable[[str], None],
) -> dict:
    step(f"{arm}: llama-bench")
    before = _snapshot(fleet)
    cell: dict = {"arm": arm, **_bench(model, rpc, arm, n_prompt, n_gen, timeout)}
    step(f"{arm}: llama-batched-bench")
    cell.update(_batched(model, rpc, arm, n_prompt, n_gen, timeout))
    step(f"{arm}: llama-completion")
    _, short_client, short_nodes = _complete(fleet, model, rpc, arm, 1, timeout)
    text, long_client, long_nodes = _complete(fleet, model, rpc, arm, n_gen, timeout)
    after = _snapshot(fleet)
    cell["md5"] = hashlib.md5(text.encode()).hexdigest()
    cell["text_chars"] = len(text)
    cell["per_step"] = _per_step((short_client, short_nodes), (long_client, long_nodes), n_gen - 1)
    cell["nodes"] = _delta(before, after)  # the whole cell: copies and fallbacks by reason
    cell["nodes_without_counters"] = sorted(
        name
        for name, v in after.items()
        if isinstance(v, Exception) or isinstance(before.get(name), Exception)
    )
    return cell


def _summarise(arm: str, cells: list[dict]) -> ArmSummary:
    median = {m: statistics.median(c[m] for c in cells) for m in METRICS}
    spread = {m: (min(c[m] for c in cells), max(c[m] for c in cells)) for m in METRICS}
    fallbacks: dict[str, int] = {}
    copies = 0
    for c in cells:
        for d in c["nodes"].values():
            copies += d["copies_ok"]
            for r, n in d["fallbacks"].items():
                fallbacks[r] = fallbacks.get(r, 0) + n
    return ArmSummary(
        arm, median, spread, cells[0]["md5"], cells[0]["per_step"], copies, fallbacks, len(cells)
    )


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


def run_model_ab(
    fleet: Fleet,
    model: Path,
    *,
    rounds: int = 3,
    n_prompt: int = 128,
    n_gen: int = 32,
    progress: Progress | None = None,
    timeout: float = TOOL_TIMEOUT_S,
) -> ModelAbResult:
    """Both arms over `rounds` rounds; see the module docstring. Raises ValueError for bad
    numbers and FleetError when a tool is missing or fails; a text mismatch is `ok=False`."""
    check_settings(rounds, n_prompt, n_gen)
    model = Path(model)
    if not model.is_file():
        raise FleetError(f"model {model}: no such file")
    if not fleet:
        raise FleetError("the fleet has no nodes")
    for tool in ("llama-bench", "llama-batched-bench", "llama-completion"):
        try:
            find_p2p_tool(tool)
        except FileNotFoundError as exc:  # names the build script
            raise FleetError(str(exc)) from None
    rpc = ",".join(n.spec.rpc_endpoint for n in fleet)
    total_steps, done = rounds * len(ARMS) * 3, 0

    def step(what: str) -> None:
        nonlocal done
        if progress is not None:
            progress(what, done / total_steps)
        done += 1

    round_docs = []
    for r in range(rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        cells = []
        for arm in order:
            cells.append(
                _cell(
                    fleet,
                    model,
                    rpc,
                    arm,
                    n_prompt,
                    n_gen,
                    timeout,
                    lambda what, r=r: step(f"round {r + 1}/{rounds} {what}"),
                )
            )
        round_docs.append({"round": r + 1, "order": list(order), "cells": cells})
    if progress is not None:
        progress("done", 1.0)

    by_arm = {arm: [c for rd in round_docs for c in rd["cells"] if c["arm"] == arm] for arm in ARMS}
    arms = {arm: _summarise(arm, cells) for arm, cells in by_arm.items()}
    md5s = {(rd["round"], c["arm"]): c["md5"] for rd in round_docs for c in rd["cells"]}
    direct_ran = arms["direct"].copies_ok > 0
    why = [] if direct_ran else _why_no_copies(fleet, by_arm["direct"], arms["direct"])
    ok = len(set(md5s.values())) == 1
    if not ok:
        diff = ", ".join(f"round {r} {arm} {m[:12]}" for (r, arm), m in md5s.items())
        verdict = f"FAILED: the greedy text differs between cells ({diff})"
    elif not direct_ran:
        verdict = "same text, but the direct path never ran: " + "; ".join(why)
    else:
        gains = ", ".join(
            f"{METRIC_LABELS[m]} x{arms['direct'].median[m] / arms['hub'].median[m]:.2f} "
            f"({_beyond_spread(arms['hub'], arms['direct'], m)})"
            for m in METRICS
            if arms["hub"].median[m]
        )
        verdict = (
            f"same text in every cell (md5 {arms['hub'].md5[:12]}); direct vs hub: {gains}; "
            f"{arms['direct'].copies_ok} peer copies"
        )
        if on_loopback(fleet):
            verdict += (
                "; every node is on loopback, where the link is not the bottleneck: the "
                "direct path pays off where the coordinator's link is slow (fleetctl lab)"
            )
    settings = {
        "rounds": rounds,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "batch_sequences": BATCH_SEQUENCES,
        "rpc": rpc,
        "prompt": PROMPT,
    }
    return ModelAbResult(str(model), len(fleet), settings, round_docs, arms, ok, direct_ran, verdict, why)

"""Where a decode token's time goes on each node: tok/s and the CPU each node's processes spend
per generated token, a fleet of stock `ggml-rpc-server` against fleetd on the hub path and on
the asynchronous direct path, in the lab (issue 20: "decode on the hub path >= a stock fleet").

    .venv/bin/python benchmarks/lab_cpu.py --nodes 3 --coordinator-link 1gbit --rounds 3 --pin-nodes

Per cell: the patched llama-bench `-p 0 -n N -r 3` (decode only) over the arm's fleet, then
the same with `-n 32`, and each node's CPU time over each, exact: every process of the node
(fleetd's daemon, fork server and compute workers, or the stock server) in a cpuacct cgroup of
its own (NodeCpu; /proc's tick samples where there is no cpuacct hierarchy). CPU per token is
the difference of the two runs over the difference of their tokens (llama-bench's warm-up run
included), so the load each run starts with (every weight sent again, the first graphs) cancels
out. Rounds run the arms in order and then reversed (ABBA); the table gives medians and min..max. Needs root.
About 1 min per round on 3 nodes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, show, steal_ns, stop_processes  # noqa: E402
from lab_arms import (  # noqa: E402
    abba_rounds,
    add_lab_options,
    arm_endpoints,
    one_core_each,
    parse_arms,
    parse_links,
    start_stock,
)

from fleetd.errors import FleetError  # noqa: E402
from fleetd.fleet.lab import Lab  # noqa: E402
from fleetd.fleet.model_ab import parse_bench_json, run_p2p_tool  # noqa: E402
from fleetd.fleet.procs import children_of, process_tree  # noqa: E402
from fleetd.models import generate_named  # noqa: E402

ARMS = ("stock", "hub", "async")
P2P_ENV = {"stock": "0", "hub": "0", "async": "1"}
BENCH_RUNS = 4  # llama-bench -r 3 and its warm-up run
SHORT_GEN = 32  # the run whose CPU is taken off: a run's fixed costs
TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")
TOOL_TIMEOUT_S = 600


def tree_cpu_ns(root: int) -> float:
    """CPU time of `root`'s tree so far from /proc: each process's utime + stime (every thread,
    ended ones too) + cutime + cstime (its children that ended and were waited for). Samples at
    the 10 ms tick: the fallback where no cpuacct group can be made."""
    total = 0.0
    for pid in process_tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) * TICK_NS
        except (OSError, IndexError, ValueError):
            pass
    return total


class NodeCpu:
    """Each node's CPU time so far, exact: its processes (and all they fork later) in a cgroup v1
    cpuacct group of their own, whose cpuacct.usage is the ns every thread of them ran, ended
    ones included. /proc's utime and stime are samples at the 10 ms tick (a kernel without
    VIRT_CPU_ACCOUNTING, as this one): a node that runs 50 us at a time wins or loses whole
    ticks, and a daemon with a worker beside it wakes in a pattern other than a stock server's.
    Without the cpuacct hierarchy it falls back to tree_cpu_ns."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self, name: str, roots: list[int]) -> None:
        self.roots, self.groups = roots, []
        if not (self.ROOT / "cpuacct.usage").exists():
            print("lab_cpu: no cpuacct hierarchy: CPU from /proc's 10 ms ticks", file=sys.stderr)
            return
        for j, root in enumerate(roots):
            group = self.ROOT / f"fleetd-lab-cpu-{os.getpid()}-{name}-{j}"
            group.mkdir(exist_ok=True)
            self.groups.append(group)
            for pid in process_tree(root):
                try:
                    (group / "cgroup.procs").write_text(str(pid))
                except OSError:  # ended meanwhile
                    pass

    def parts_ns(self) -> dict[str, list[float]]:
        """used_ns as bench_cpu reads every account: a stock server is one part, its total."""
        return {"total": self.used_ns()}

    def used_ns(self) -> list[float]:
        if not self.groups:
            return [tree_cpu_ns(r) for r in self.roots]
        return [float((g / "cpuacct.usage").read_text()) for g in self.groups]

    def remove(self) -> None:
        """Give back the groups (their processes, if any are left, to the hierarchy's root)."""
        for group in self.groups:
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    (self.ROOT / "cgroup.procs").write_text(pid)
                group.rmdir()
            except OSError as exc:
                print(f"lab_cpu: {group} not removed: {exc}", file=sys.stderr)


class FleetdCpu:
    """fleetd's nodes, split: each daemon in a group of its own, and its fork server with every
    compute worker it forks (they inherit the group) in another, so a token's CPU shows as the
    session's side (socket, checks, hand-off) and the worker's (the graph, its side of the
    hand-off). Without the cpuacct hierarchy only the total is known."""

    def __init__(self, daemons: list[int]) -> None:
        self.daemon = NodeCpu("fleetd", daemons)
        forks = [children_of(d) for d in daemons]
        self.workers = NodeCpu("fleetd-workers", [f[0] for f in forks if f]) if all(forks) else None
        self.split = bool(self.daemon.groups and self.workers is not None and self.workers.groups)

    def parts_ns(self) -> dict[str, list[float]]:
        if not self.split:
            return {"total": self.daemon.used_ns()}
        daemon, workers = self.daemon.used_ns(), self.workers.used_ns()
        return {"total": [a + b for a, b in zip(daemon, workers)], "daemon": daemon, "workers": workers}

    def remove(self) -> None:
        if self.workers is not None:
            self.workers.remove()
        self.daemon.remove()


def bench_cpu(
    model: Path, rpc: str, arm: str, cpu: NodeCpu | FleetdCpu, n_gen: int
) -> tuple[float, dict[str, list[float]]]:
    """One llama-bench decode run: (its tg tok/s, each node's CPU ns over the whole run: the
    total, and for fleetd its daemon's and its workers' when they are split)."""
    args = ["-m", str(model), "--rpc", rpc, "-sm", "layer", "-ngl", "99", "-t", "1"]
    args += ["-p", "0", "-n", str(n_gen), "-r", str(BENCH_RUNS - 1), "-o", "json"]
    before = cpu.parts_ns()
    out = run_p2p_tool("llama-bench", args, P2P_ENV[arm], arm, TOOL_TIMEOUT_S)
    after = cpu.parts_ns()
    used = {k: [a - b for a, b in zip(after[k], before[k], strict=True)] for k in after}
    return parse_bench_json(out.stdout, ("tg_tps",))["tg_tps"], used


def cell(model: Path, rpc: str, arm: str, cpu: NodeCpu | FleetdCpu, n_gen: int) -> dict:
    """tok/s of a tg`n_gen` run, and the CPU per token: the difference between it and a
    tg`SHORT_GEN` run over the tokens between them, so that what a run costs once (the load:
    every weight's SET_TENSOR, the context, the first graphs) cancels out."""
    stolen = steal_ns()
    tg, long_ns = bench_cpu(model, rpc, arm, cpu, n_gen)
    _, short_ns = bench_cpu(model, rpc, arm, cpu, SHORT_GEN)
    tokens = (n_gen - SHORT_GEN) * BENCH_RUNS
    per_token = {
        k: [(a - b) / tokens / 1e3 for a, b in zip(long_ns[k], short_ns[k], strict=True)] for k in long_ns
    }
    steal_ms = (steal_ns() - stolen) / 1e6
    out = {"arm": arm, "tg_tps": tg, "cpu_us_per_token": per_token["total"], "steal_ms": steal_ms}
    if "daemon" in per_token:
        out["daemon_us_per_token"] = per_token["daemon"]
        out["workers_us_per_token"] = per_token["workers"]
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}..{max(values):.0f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_lab_options(ap, coordinator_link="1gbit")
    ap.add_argument("--n-gen", type=int, default=256, help="tokens per llama-bench run (default 256)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--pin-nodes", action="store_true", help="node j on core j mod the cores (lab_arms.py's)")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/lab_cpu.json)")
    a = ap.parse_args()
    arms = parse_arms(ap, a.arms, ARMS)
    if not 1 <= a.rounds <= 20 or not SHORT_GEN * 2 <= a.n_gen <= 4096:
        ap.error(f"--rounds must be in 1..20 and --n-gen in {SHORT_GEN * 2}..4096")
    coord, peer = parse_links(ap, a)
    work = Path(tempfile.mkdtemp(prefix="lab-cpu-"))
    model = generate_named(a.model, work)
    lab = Lab(work / "lab")
    stock = []
    accounts: list[FleetdCpu | NodeCpu] = []
    node_cpus = one_core_each(a.nodes) if a.pin_nodes else None
    try:
        lab_nodes = lab.up(a.nodes, coord, peer, node_cpus=node_cpus)
        stock = start_stock(lab_nodes, 1, work, node_cpus=node_cpus)
        rpc = arm_endpoints(lab_nodes, ARMS)
        fleetd_cpu = FleetdCpu(lab.state["pids"])
        stock_cpu = NodeCpu("stock", [p.pid for p in stock])
        accounts += [fleetd_cpu, stock_cpu]
        cpus = {"stock": stock_cpu, "hub": fleetd_cpu, "async": fleetd_cpu}
        rounds = abba_rounds(arms, a.rounds, lambda arm: cell(model, rpc[arm], arm, cpus[arm], a.n_gen))
    except FleetError as exc:
        print(f"lab_cpu: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_processes(stock)
        lab.down()
        for account in accounts:
            account.remove()

    cells = {arm: [c for rd in rounds for c in rd if c["arm"] == arm] for arm in arms}
    summary = {}
    for arm, cs in cells.items():
        totals = [sum(c["cpu_us_per_token"]) for c in cs]
        summary[arm] = {
            "tg_tps": [c["tg_tps"] for c in cs],
            "cpu_us_per_token": totals,
            "cpu_us_per_token_by_node": [
                statistics.median(c["cpu_us_per_token"][j] for c in cs) for j in range(a.nodes)
            ],
        }
        for part in ("daemon", "workers"):
            if all(f"{part}_us_per_token" in c for c in cs):
                summary[arm][f"{part}_us_per_token_by_node"] = [
                    statistics.median(c[f"{part}_us_per_token"][j] for c in cs) for j in range(a.nodes)
                ]
    ref = summary.get("stock")
    rows = []
    for arm, s in summary.items():
        vs = "-"
        if ref and arm != "stock":
            tg = statistics.median(s["tg_tps"]) / statistics.median(ref["tg_tps"])
            cpu = statistics.median(s["cpu_us_per_token"]) / statistics.median(ref["cpu_us_per_token"])
            vs = f"{tg:.2f} / {cpu:.2f}"
        by_node = ", ".join(f"{x:.0f}" for x in s["cpu_us_per_token_by_node"])
        if "daemon_us_per_token_by_node" in s:  # each node's daemon + workers
            by_node += (
                " ("
                + ", ".join(
                    f"{d:.0f}+{w:.0f}"
                    for d, w in zip(s["daemon_us_per_token_by_node"], s["workers_us_per_token_by_node"])
                )
                + ")"
            )
        steal = spread([c["steal_ms"] for c in cells[arm]])
        rows.append([arm, spread(s["tg_tps"]), spread(s["cpu_us_per_token"]), by_node, vs, steal])
    pinned = ", each on one core" if a.pin_nodes else ""
    show(
        f"{a.nodes} nodes{pinned}, coordinator links {a.coordinator_link}, {model.name}, decode "
        f"tg{a.n_gen}, {a.rounds} rounds (ABBA)",
        [
            "arm",
            "tok/s",
            "server CPU µs/token",
            "per node (fleetd: daemon+workers)",
            "x stock: tok/s / CPU",
            "steal ms",
        ],
        rows,
    )
    doc = {
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "cpu_source": "cpuacct" if accounts and accounts[0].daemon.groups else "proc ticks",
        "model": model.name,
        "summary": summary,
        "rounds": rounds,
    }
    print(f"wrote {save('lab_cpu', doc, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

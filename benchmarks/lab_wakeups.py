"""How often each node's threads wake, and the CPU they use, per decode token: a fleet of stock
`ggml-rpc-server` against fleetd on the hub path and on the asynchronous direct path, in the lab.

    .venv/bin/python benchmarks/lab_wakeups.py --nodes 3 --coordinator-link 1gbit --rounds 2 --pin-nodes

On this VM a thread's wake-up costs tens of microseconds of CPU, so the count says where a
token's time goes beside the kernels: the stock client writes a command as three `send()`s and a
paced link cuts a hidden state into segments, and a reader that wakes per segment pays for each
(docs/DESIGN.md, "A request's parts wake its reader once"). Per arm, the patched llama-bench
decodes (`-p 0 -n 4096 -r 1`) in the background; after WARM_S, every thread of each node's
processes (a stock server; fleetd's daemon, fork server and compute workers) is read twice,
WINDOW_S apart: `voluntary_ctxt_switches` (each wake-up after a blocking call) and the run time
in `schedstat`. Per token is over llama-bench's t/s times the window (its average over the run:
an estimate, the same for every arm). Rounds run the arms in order, then reversed. Needs root.
About 1.5 min a round on 3 nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, show, stop_processes  # noqa: E402
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
from fleetd.fleet.model_ab import find_p2p_tool  # noqa: E402
from fleetd.fleet.procs import process_tree  # noqa: E402
from fleetd.models import generate_named  # noqa: E402

ARMS = ("stock", "hub", "async")
P2P_ENV = {"stock": "0", "hub": "0", "async": "1"}
WARM_S = 4.0  # the load and the first graphs are over
WINDOW_S = 5.0
N_GEN = 4096  # with llama-bench's warm-up run, ~25 s at 350 tok/s: it outlasts the window
TOOL_TIMEOUT_S = 600


def node_threads(root: int) -> dict[str, tuple[int, int]]:
    """'daemon' (the root process) and 'workers' (its descendants): summed voluntary switches
    and run time (ns) of every thread alive now."""
    sums = {"daemon": [0, 0], "workers": [0, 0]}
    for pid in process_tree(root):
        part = sums["daemon" if pid == root else "workers"]
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # ended meanwhile
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    switches = next(int(x.split()[1]) for x in f if x.startswith("voluntary_ctxt_switches:"))
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ran_ns = int(f.read().split()[0])
            except (OSError, StopIteration, ValueError):
                continue
            part[0] += switches
            part[1] += ran_ns
    return {k: (v[0], v[1]) for k, v in sums.items()}


def cell(model: Path, rpc: str, arm: str, roots: list[int]) -> dict:
    """One decode run of `arm`, read over the window: per node, wake-ups and CPU us a token."""
    args = [str(find_p2p_tool("llama-bench")), "-m", str(model), "--rpc", rpc, "-sm", "layer"]
    args += ["-ngl", "99", "-t", "1", "-p", "0", "-n", str(N_GEN), "-r", "1", "-o", "json"]
    env = dict(os.environ, GGML_RPC_P2P=P2P_ENV[arm])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        time.sleep(WARM_S)
        before = [node_threads(r) for r in roots]
        t0 = time.monotonic()
        time.sleep(WINDOW_S)
        after = [node_threads(r) for r in roots]
        window = time.monotonic() - t0
        if proc.poll() is not None:  # its sessions (and their workers) ended inside the window
            raise FleetError(
                f"llama-bench ({arm}) ended within the window: a faster fleet needs a longer N_GEN"
            )
        out, _ = proc.communicate(timeout=TOOL_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise FleetError(f"llama-bench ({arm}) exited {proc.returncode}")
    tps = float(json.loads(out)[0]["avg_ts"])
    tokens = tps * window
    nodes = []
    for b, a in zip(before, after, strict=True):
        per = {
            part: {
                "wakeups": (a[part][0] - b[part][0]) / tokens,
                "cpu_us": (a[part][1] - b[part][1]) / tokens / 1e3,
            }
            for part in a
        }
        nodes.append(per)
    return {"arm": arm, "tg_tps": tps, "nodes": nodes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_lab_options(ap, coordinator_link="1gbit")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--pin-nodes", action="store_true", help="node j on core j mod the cores (lab_arms.py's)")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/lab_wakeups.json)")
    a = ap.parse_args()
    arms = parse_arms(ap, a.arms, ARMS)
    if not 1 <= a.rounds <= 20:
        ap.error("--rounds must be in 1..20")
    coord, peer = parse_links(ap, a)
    work = Path(tempfile.mkdtemp(prefix="lab-wakeups-"))
    model = generate_named(a.model, work)
    lab = Lab(work / "lab")
    stock = []
    node_cpus = one_core_each(a.nodes) if a.pin_nodes else None
    try:
        lab_nodes = lab.up(a.nodes, coord, peer, node_cpus=node_cpus)
        stock = start_stock(lab_nodes, 1, work, node_cpus=node_cpus)
        rpc = arm_endpoints(lab_nodes, ARMS)
        roots = {"stock": [p.pid for p in stock], "hub": lab.state["pids"], "async": lab.state["pids"]}
        by_round = abba_rounds(arms, a.rounds, lambda arm: cell(model, rpc[arm], arm, roots[arm]))
        cells = [c for done in by_round for c in done]
    except FleetError as exc:
        print(f"lab_wakeups: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_processes(stock)
        lab.down()

    rows = []
    for arm in arms:
        cs = [c for c in cells if c["arm"] == arm]

        def med(j: int, part: str, what: str, cs=cs) -> float:
            return statistics.median(c["nodes"][j][part][what] for c in cs)

        for j in range(a.nodes):
            total_w = med(j, "daemon", "wakeups") + med(j, "workers", "wakeups")
            total_c = med(j, "daemon", "cpu_us") + med(j, "workers", "cpu_us")
            split = (
                "-"
                if arm == "stock"
                else f"{med(j, 'daemon', 'wakeups'):.1f} + {med(j, 'workers', 'wakeups'):.1f}"
            )
            rows.append([arm, f"node {j}", f"{total_w:.1f}", split, f"{total_c:.0f}"])
        rows.append([arm, "tok/s", f"{statistics.median(c['tg_tps'] for c in cs):.0f}", "", ""])
    pinned = ", each on one core" if a.pin_nodes else ""
    show(
        f"{a.nodes} nodes{pinned}, coordinator links {a.coordinator_link}, {model.name}, decode, "
        f"{a.rounds} rounds: medians a token",
        ["arm", "node", "wake-ups", "daemon + workers", "CPU µs"],
        rows,
    )
    out = save(
        "lab_wakeups",
        {"args": vars(a), "warm_s": WARM_S, "window_s": WINDOW_S, "n_gen": N_GEN, "cells": cells},
        a.out,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The seed's accounting table from a real model: the patched llama-completion over N fleetd nodes
(-sm layer), hub (GGML_RPC_P2P=0) against direct (1), per decode step as the client counted it
(GGML_RPC_STATS=1) and as the nodes counted it.

    .venv/bin/python benchmarks/p2p_model.py --nodes 3 --model llama-q8_0-bench -n 64

Per step = per graph the last node computed (one forward pass). Prints the table (from each
arm's first run) and llama's decode time per token, hub and direct alternating over --rounds
runs on the same nodes; writes benchmarks/results/p2p_model.json. The md5 of the text must be
equal between all runs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, show  # noqa: E402

from fleetd.fleet.local import LocalFleet  # noqa: E402
from fleetd.models import generate_named  # noqa: E402
from fleetd.tools import find_p2p_tool  # noqa: E402

STATS_LINE = re.compile(r"^(\w+)\s+(\d+)\s+(\d+)\s+(\d+)$", re.M)
# llama's own decode timing: "common_perf_print:        eval time =  133.31 ms /  15 runs ..."
EVAL_LINE = re.compile(r"perf_print:\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs")


def client_table(stderr: str) -> dict[str, tuple[int, int, int]]:
    table = stderr[stderr.rindex("GGML_RPC_STATS client") :]
    return {
        m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4))) for m in STATS_LINE.finditer(table)
    }


def run_arm(model: Path, fleet: LocalFleet, p2p: str, n: int) -> dict:
    before = [node.stats() for node in fleet.fleet]
    args = [
        str(find_p2p_tool("llama-completion")),
        "-m",
        str(model),
        "--rpc",
        ",".join(fleet.endpoints),
        "-ngl",
        "99",
        "-sm",
        "layer",
        "-p",
        "the time of their first new",
        "-n",
        str(n),
        "--temp",
        "0",
        "-t",
        "1",
        "-no-cnv",
        "--seed",
        "1",
    ]
    proc = subprocess.run(
        args,
        capture_output=True,
        timeout=1800,
        check=False,
        env=dict(os.environ, GGML_RPC_P2P=p2p, GGML_RPC_STATS="1"),
    )
    stderr = proc.stderr.decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"llama-completion failed ({proc.returncode}): {stderr[-2000:]}")
    after = [node.stats() for node in fleet.fleet]
    last_before, last_after = before[-1].doc["total"]["commands"], after[-1].doc["total"]["commands"]
    steps = sum(
        last_after[c]["count"] - last_before[c]["count"] for c in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE")
    )
    copies = sum(
        a.doc["total"]["commands"]["COPY_TENSOR_TO"]["count"]
        - b.doc["total"]["commands"]["COPY_TENSOR_TO"]["count"]
        for a, b in zip(after, before)
    )
    evals = EVAL_LINE.findall(stderr)
    ms_per_token = float(evals[-1][0]) / int(evals[-1][1]) if evals and int(evals[-1][1]) else None
    return {
        "md5": hashlib.md5(proc.stdout).hexdigest(),
        "steps": steps,
        "node_copies": copies,
        "client": client_table(stderr),
        "ms_per_token": ms_per_token,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--model", default="llama-q8_0-bench", help="<arch>-<type>[-<size>] from fleetd.models")
    ap.add_argument("--models-dir", default=str(Path.home() / ".cache" / "fleetd" / "models"))
    ap.add_argument("-n", type=int, default=64, help="tokens to generate")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs per arm, alternating hub and direct (the order flips every round)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.nodes < 2 or args.n < 1 or args.rounds < 1:
        ap.error("--nodes must be >= 2, -n and --rounds >= 1")
    model = generate_named(args.model, Path(args.models_dir))
    runs: dict[str, list[dict]] = {"hub": [], "direct": []}
    with LocalFleet(args.nodes) as fleet:
        for r in range(args.rounds):
            for arm in ("hub", "direct") if r % 2 == 0 else ("direct", "hub"):
                runs[arm].append(run_arm(model, fleet, "0" if arm == "hub" else "1", args.n))
    md5s = {run["md5"] for arm_runs in runs.values() for run in arm_runs}
    if len(md5s) != 1:
        raise SystemExit(f"the runs printed different text: {sorted(md5s)}")
    hub, direct = runs["hub"][0], runs["direct"][0]
    rows = []
    names = sorted(set(hub["client"]) | set(direct["client"]), key=lambda c: (c == "total", c))
    for name in names:
        if name in (
            "HELLO",
            "ALLOC_BUFFER",
            "GET_ALIGNMENT",
            "GET_MAX_SIZE",
            "BUFFER_GET_BASE",
            "DEVICE_COUNT",
            "GET_DEVICE_MEMORY",
            "GET_ALLOC_SIZE",
            "FREE_BUFFER",
            "BUFFER_CLEAR",
            "INIT_TENSOR",
        ):
            continue  # set-up, not per step
        h, d = hub["client"].get(name, (0, 0, 0)), direct["client"].get(name, (0, 0, 0))
        rows.append(
            [
                name,
                f"{h[0] / hub['steps']:.2f}",
                f"{d[0] / direct['steps']:.2f}",
                f"{h[1] / hub['steps']:,.0f}",
                f"{d[1] / direct['steps']:,.0f}",
                f"{h[2] / hub['steps']:,.0f}",
                f"{d[2] / direct['steps']:,.0f}",
            ]
        )
    show(
        f"{args.model} over {args.nodes} fleetd nodes, per step (hub {hub['steps']} steps, direct "
        f"{direct['steps']}; {direct['node_copies']} copies counted by the nodes; md5 equal)",
        ["command", "hub", "direct", "req B hub", "req B direct", "resp B hub", "resp B direct"],
        rows,
    )
    timing = {}
    ms = {arm: [run["ms_per_token"] for run in arm_runs] for arm, arm_runs in runs.items()}
    if all(x is not None for xs in ms.values() for x in xs):
        per_round = [d / h for d, h in zip(ms["direct"], ms["hub"])]
        timing = {
            "ms_per_token": ms,
            "direct_over_hub_rounds": per_round,
            "direct_over_hub": statistics.median(per_round),
        }
        print(
            f"decode ms per token (llama's eval time, median of {args.rounds}): "
            f"hub {statistics.median(ms['hub']):.3f}, direct {statistics.median(ms['direct']):.3f}; "
            f"direct / hub median {timing['direct_over_hub']:.3f} "
            f"(rounds {min(per_round):.3f} .. {max(per_round):.3f})"
        )
    out = save(
        "p2p_model",
        {
            "model": args.model,
            "nodes": args.nodes,
            "n": args.n,
            "hub": hub,
            "direct": direct,
            "timing": timing,
        },
        args.json,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

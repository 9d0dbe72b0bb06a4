"""The seed's accounting table from a real model: the patched llama-completion over N fleetd nodes
(-sm layer), hub (GGML_RPC_P2P=0) against direct (1), per decode step as the client counted it
(GGML_RPC_STATS=1) and as the nodes counted it.

    .venv/bin/python benchmarks/p2p_model.py --nodes 3 --model llama-q8_0-bench -n 64

Per step = per graph the last node computed (one forward pass). Prints the table, writes
benchmarks/results/p2p_model.json. The md5 of the text must be equal between the arms.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, show  # noqa: E402

from fleetd.fleet.local import LocalFleet  # noqa: E402
from fleetd.models import SIZES, generate  # noqa: E402
from fleetd.tools import find_p2p_tool  # noqa: E402

STATS_LINE = re.compile(r"^(\w+)\s+(\d+)\s+(\d+)\s+(\d+)$", re.M)


def client_table(stderr: str) -> dict[str, tuple[int, int, int]]:
    table = stderr[stderr.rindex("GGML_RPC_STATS client"):]
    return {m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4))) for m in STATS_LINE.finditer(table)}


def run_arm(model: Path, fleet: LocalFleet, p2p: str, n: int) -> dict:
    before = [node.stats() for node in fleet.fleet]
    args = [str(find_p2p_tool("llama-completion")), "-m", str(model), "--rpc", ",".join(fleet.endpoints),
            "-ngl", "99", "-sm", "layer", "-p", "the time of their first new", "-n", str(n), "--temp", "0",
            "-t", "1", "-no-cnv", "--seed", "1"]
    proc = subprocess.run(args, capture_output=True, timeout=1800, check=False,
                          env=dict(os.environ, GGML_RPC_P2P=p2p, GGML_RPC_STATS="1"))
    stderr = proc.stderr.decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"llama-completion failed ({proc.returncode}): {stderr[-2000:]}")
    after = [node.stats() for node in fleet.fleet]
    last_before, last_after = before[-1].doc["total"]["commands"], after[-1].doc["total"]["commands"]
    steps = sum(last_after[c]["count"] - last_before[c]["count"] for c in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE"))
    copies = sum(a.doc["total"]["commands"]["COPY_TENSOR_TO"]["count"] - b.doc["total"]["commands"]["COPY_TENSOR_TO"]["count"]
                 for a, b in zip(after, before))
    return {"md5": hashlib.md5(proc.stdout).hexdigest(), "steps": steps, "node_copies": copies,
            "client": client_table(stderr)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--model", default="llama-q8_0-bench", help="<arch>-<type>[-<size>] from fleetd.models")
    ap.add_argument("--models-dir", default=str(Path.home() / ".cache" / "fleetd" / "models"))
    ap.add_argument("-n", type=int, default=64, help="tokens to generate")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.nodes < 2 or args.n < 1:
        ap.error("--nodes must be >= 2 and -n >= 1")
    parts = args.model.split("-")
    size = parts.pop() if parts[-1] in SIZES else "tiny"
    model = generate(parts[0], parts[1], Path(args.models_dir), size)
    with LocalFleet(args.nodes) as fleet:
        hub = run_arm(model, fleet, "0", args.n)
        direct = run_arm(model, fleet, "1", args.n)
    if hub["md5"] != direct["md5"]:
        raise SystemExit(f"the arms printed different text: hub {hub['md5']} direct {direct['md5']}")
    rows = []
    names = sorted(set(hub["client"]) | set(direct["client"]), key=lambda c: (c == "total", c))
    for name in names:
        if name in ("HELLO", "ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "DEVICE_COUNT",
                    "GET_DEVICE_MEMORY", "GET_ALLOC_SIZE", "FREE_BUFFER", "BUFFER_CLEAR", "INIT_TENSOR"):
            continue  # set-up, not per step
        h, d = hub["client"].get(name, (0, 0, 0)), direct["client"].get(name, (0, 0, 0))
        rows.append([name, f"{h[0] / hub['steps']:.2f}", f"{d[0] / direct['steps']:.2f}",
                     f"{h[1] / hub['steps']:,.0f}", f"{d[1] / direct['steps']:,.0f}",
                     f"{h[2] / hub['steps']:,.0f}", f"{d[2] / direct['steps']:,.0f}"])
    show(f"{args.model} over {args.nodes} fleetd nodes, per step (hub {hub['steps']} steps, direct "
         f"{direct['steps']}; {direct['node_copies']} copies counted by the nodes; md5 equal)",
         ["command", "hub", "direct", "req B hub", "req B direct", "resp B hub", "resp B direct"], rows)
    out = save("p2p_model", {"model": args.model, "nodes": args.nodes, "n": args.n, "hub": hub, "direct": direct},
               args.json)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

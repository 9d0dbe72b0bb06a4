"""Hub vs direct stage boundaries on a local fleet: per-step commands, coordinator bytes and
wall time, with the stock ggml-rpc-server's hub path side by side when it is built.

    .venv/bin/python benchmarks/p2p.py                       # seed shape: 3 stages, 32 x 5120
    .venv/bin/python benchmarks/p2p.py --rows 4 --n-embd 256 --steps 5 --json-out /tmp/p2p.json

Servers run on loopback (fleetd and stock alike as processes), so wall times say
little about a real network; the command and byte columns are exact either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from fleetd.pipeline import Pipeline, per_step, step_table
from fleetd.fleet.local import LocalFleet
from fleetd.tools import find_tool, have_tool
from fleetd.transport import wait_listening


def start_stock(n: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, eps = [], []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(subprocess.Popen(
            [str(find_tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_listening(port)
        # The probe connection above was a whole "client" to the stock server; let it go.
        time.sleep(0.2)
        eps.append(f"127.0.0.1:{port}")
    return procs, eps


def run(endpoints: list[str], args, p2p: bool) -> dict:
    with Pipeline(endpoints, args.layers or args.stages, args.rows, args.n_embd,
                  local_last=args.local_last, p2p=p2p, stats=False) as p:
        p.step()  # GRAPH_COMPUTE; not in the window
        t0 = time.perf_counter()
        results = p.run(args.steps)
        seconds = (time.perf_counter() - t0) / args.steps
    out = per_step(results)
    out["seconds_per_step"] = seconds
    out["md5"] = hashlib.md5(b"".join(r.output for r in results)).hexdigest()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--local-last", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--n-embd", type=int, default=5120)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-stock", action="store_true", help="skip the stock server column")
    ap.add_argument("--json-out", type=Path, default=Path("benchmarks/results/p2p.json"))
    args = ap.parse_args()
    remote = args.stages - int(args.local_last)

    with LocalFleet(remote, control=False) as local:
        cols = {"hub": run(local.endpoints, args, False), "direct": run(local.endpoints, args, True)}
    if not args.no_stock and have_tool("ggml-rpc-server"):
        procs, stock_eps = start_stock(remote)
        try:
            cols["hub (stock)"] = run(stock_eps, args, True)  # never advertises the bit
        finally:
            for p in procs:
                p.kill()
                p.wait()

    print(f"{args.stages} stages, hidden state {args.rows} x {args.n_embd} f32, "
          f"{args.steps} steps after the first")
    print(step_table(cols))
    print("seconds per step (loopback)  " + "  ".join(f"{c['seconds_per_step']:.4f}" for c in cols.values()))
    for arm, c in cols.items():
        print(f"md5 {arm}: {c['md5']}")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "arms": cols}, indent=2))
    print(f"wrote {args.json_out}")
    return 0 if cols["hub"]["md5"] == cols["direct"]["md5"] else 1


if __name__ == "__main__":
    sys.exit(main())

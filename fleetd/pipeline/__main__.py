"""`python -m fleetd.pipeline`: run the synthetic layer split, hub and direct arms, print the
per-step table (the seed's) and the md5 of each arm's outputs; `--json` for the data.

Without --endpoints it starts its own fleetd servers on loopback in this process (the seed's
shape by default: two remote stages and the coordinator's device, RPC0,RPC1,LOCAL).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

from fleetd.pipeline.coordinator import Pipeline
from fleetd.pipeline.report import per_step, step_table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m fleetd.pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoints", help="comma-separated host:port of the remote stages, in order")
    ap.add_argument("--stages", type=int, default=3, help="stages when no --endpoints (default 3)")
    ap.add_argument("--local-last", action=argparse.BooleanOptionalAction, default=True,
                    help="the coordinator's own device is the last stage (default on)")
    ap.add_argument("--layers", type=int, default=None, help="layers in total (default: one per stage)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--n-embd", type=int, default=5120)
    ap.add_argument("--steps", type=int, default=4, help="steps per arm; the first (GRAPH_COMPUTE) "
                    "is left out of the per-step means")
    ap.add_argument("--arm", choices=("both", "hub", "direct"), default="both")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return ap.parse_args(argv)


def start_local_servers(n: int) -> tuple[list, list[str]]:
    from fleetd.server import Server, ServerConfig

    servers = []
    for _ in range(n):
        srv = Server(ServerConfig(host="127.0.0.1", port=0, control_port=None))
        srv.start()
        servers.append(srv)
    return servers, [f"127.0.0.1:{s.address[1]}" for s in servers]


def run_arm(endpoints: list[str], args, p2p: bool, layers: int) -> dict:
    with Pipeline(endpoints, layers, args.rows, args.n_embd, local_last=args.local_last,
                  p2p=p2p, stats=False) as p:
        results = p.run(args.steps)
    window = results[1:] or results
    return {
        "per_step": per_step(window),
        "md5": hashlib.md5(b"".join(r.output for r in results)).hexdigest(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    servers: list = []
    if args.endpoints:
        endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    else:
        servers, endpoints = start_local_servers(args.stages - int(args.local_last))
    stages = len(endpoints) + int(args.local_last)
    layers = args.layers or stages
    arms = {"both": ("hub", "direct"), "hub": ("hub",), "direct": ("direct",)}[args.arm]
    try:
        out = {arm: run_arm(endpoints, args, arm == "direct", layers) for arm in arms}
    finally:
        for s in servers:
            s.stop()
    report = {
        "stages": stages, "local_last": args.local_last, "layers": layers, "rows": args.rows,
        "n_embd": args.n_embd, "hidden_bytes": args.rows * args.n_embd * 4, "steps": args.steps,
        "arms": out,
    }
    if len(out) == 2:
        hub, direct = (out[a]["per_step"] for a in ("hub", "direct"))
        before = hub["request_bytes"] + hub["response_bytes"]
        after = direct["request_bytes"] + direct["response_bytes"]
        report["coordinator_bytes_saved_per_step"] = before - after
        report["coordinator_bytes_reduction"] = (before - after) / before if before else 0.0
        report["outputs_identical"] = out["hub"]["md5"] == out["direct"]["md5"]
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    kinds = ["remote"] * len(endpoints) + ["local"] * int(args.local_last)
    print(f"{stages} stages ({', '.join(kinds)}), {layers} layers, hidden state {args.rows} x {args.n_embd} f32 = "
          f"{report['hidden_bytes']:,} B, per step over steps 2..{args.steps}")
    print(step_table({arm: out[arm]["per_step"] for arm in out}))
    for arm in out:
        print(f"md5 {arm}: {out[arm]['md5']}")
    if "coordinator_bytes_saved_per_step" in report:
        print(f"coordinator bytes per step: {report['coordinator_bytes_saved_per_step']:,.0f} fewer "
              f"({100 * report['coordinator_bytes_reduction']:.1f} %), outputs identical: "
              f"{report['outputs_identical']}")
    return 0 if report.get("outputs_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())

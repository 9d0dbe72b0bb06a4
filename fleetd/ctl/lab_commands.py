"""fleetctl lab up|down: an emulated network of fleetd nodes on this machine (fleetd.fleet.lab)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fleetd.fleet.lab import (
    MAX_NODES,
    MAX_RESTART_S,
    MIN_NODE_CORES,
    RESTART_BURST,
    RESTART_INTERVAL_S,
    Lab,
    fmt_rate,
    parse_rate,
    parse_rates,
)

LAB_HELP = "an emulated network on this machine: fleetd in network namespaces, tc-rated links"
DEFAULT_DIR = Path("/tmp/fleetd-lab")


def configure_lab(p) -> None:
    """The flags of `fleetctl lab up` and `fleetctl lab down`."""
    sub = p.add_subparsers(dest="lab_command", metavar="up|down", required=True)
    up = sub.add_parser("up", help="build the namespaces and links, start fleetd in each, write a nodes file")
    up.add_argument("--nodes", type=int, default=3, help=f"fleetd nodes, 1..{MAX_NODES} (default 3)")
    up.add_argument(
        "--coordinator-link",
        default="200mbit",
        metavar="RATE",
        help="rate of each node's link to the coordinator, both ways (default 200mbit); a comma "
        "list gives one rate per node, in order (1gbit,1gbit,100mbit)",
    )
    up.add_argument(
        "--peer-link",
        default="2gbit",
        metavar="RATE",
        help="rate of each node's link to the others, both ways (default 2gbit)",
    )
    up.add_argument("--threads", type=int, default=1, help="threads per fleetd (default 1)")
    up.add_argument(
        "--restart",
        type=float,
        default=None,
        metavar="SECONDS",
        help="run each fleetd under a supervisor that starts it again SECONDS after it dies, "
        f"however it ended, at most {RESTART_BURST} starts in {RESTART_INTERVAL_S:g}s (as the "
        "deploy's systemd unit: Restart=always, RestartSec=2); each restart is a line in the "
        "node's log, fleetd's pid is in DIR/NODE.pid (default: unsupervised, a fleetd that dies "
        "stays down)",
    )
    up.add_argument(
        "--node-cores",
        type=float,
        default=None,
        metavar="CORES",
        help="CPU time each node may use, in cores (a CFS quota on its fleetd, fork server and "
        "workers): nodes that stand for machines of their own, so that a node added adds compute "
        "(default: none, every node shares all of this machine's cores)",
    )
    down = sub.add_parser("down", help="stop the lab's fleetd and remove its namespaces and links")
    for q in (up, down):
        q.add_argument(
            "--dir",
            type=Path,
            default=DEFAULT_DIR,
            help=f"the lab's state, nodes file and logs (default {DEFAULT_DIR})",
        )


def _usage_error(message: str) -> int:
    print(f"fleetctl lab: error: {message}", file=sys.stderr)
    return 2


def cmd_lab(args) -> int:
    """fleetctl lab up (check the numbers and rates, build the lab, print its nodes) or lab down."""
    lab = Lab(args.dir)
    if args.lab_command == "down":
        removed = lab.down()
        print(f"lab in {args.dir}: " + (f"removed {', '.join(removed)}" if removed else "nothing to remove"))
        return 0
    if not 1 <= args.nodes <= MAX_NODES:
        return _usage_error(f"--nodes {args.nodes}: must be in 1..{MAX_NODES}")
    if not 1 <= args.threads <= 64:
        return _usage_error(f"--threads {args.threads}: must be in 1..64")
    if args.restart is not None and not 0 <= args.restart <= MAX_RESTART_S:
        return _usage_error(f"--restart {args.restart:g}: must be in 0..{MAX_RESTART_S:g}")
    cores = os.cpu_count() or 1
    if args.node_cores is not None and not MIN_NODE_CORES <= args.node_cores <= cores:
        return _usage_error(f"--node-cores {args.node_cores:g}: must be in {MIN_NODE_CORES:g}..{cores}")
    try:
        coord = parse_rates(args.coordinator_link, args.nodes)
        peer = parse_rate(args.peer_link)
    except ValueError as exc:
        return _usage_error(str(exc))
    nodes = lab.up(args.nodes, coord, peer, args.threads, restart_s=args.restart, node_cores=args.node_cores)
    links = fmt_rate(coord[0]) if len(set(coord)) == 1 else ",".join(map(fmt_rate, coord))
    print(f"lab up: {len(nodes)} nodes, coordinator links {links}, peer links {fmt_rate(peer)}")
    if args.restart is not None:
        print(
            f"  supervised: a fleetd that dies starts again after {args.restart:g}s "
            f"(pid in {args.dir}/NODE.pid, restarts in {args.dir}/NODE.log)"
        )
    for n, bits in zip(nodes, coord, strict=True):
        print(
            f"  {n.name}  rpc {n.address}:50052  netns {n.netns}  "
            f"coordinator link {n.coordinator_link} ({fmt_rate(bits)})"
        )
    print(f"nodes file: {lab.nodes_file}")
    print(f"  fleetctl status {lab.nodes_file}")
    print(f"  fleetctl ab {lab.nodes_file} --model MODEL.gguf")
    print(f"  fleetctl lab down --dir {args.dir}")
    return 0

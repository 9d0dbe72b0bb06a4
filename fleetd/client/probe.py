"""Is a ggml RPC server answering? One HELLO, one JSON line.

    python -m fleetd.client.probe HOST:PORT [--timeout S]

prints {"version": "7.0.0", "features": 3} and exits 0 when the server answered HELLO within
the timeout (`features`: the bits of fleetd.wire.Feature it advertised), else prints
{"error": "..."} and exits 1. Deploy health checks call it on the node.
"""

from __future__ import annotations

import argparse
import json
import sys

from fleetd.client.rpc import RpcClient
from fleetd.errors import FleetdError
from fleetd.transport.tcp import Timeout

DEFAULT_TIMEOUT = 2.0


def probe(endpoint: str, timeout: float = DEFAULT_TIMEOUT) -> dict:
    """{"version": "M.m.p", "features": int} or {"error": "..."}; never raises for a down server."""
    try:
        with RpcClient(endpoint, Timeout(connect=timeout, read=timeout)) as client:
            return {"version": ".".join(map(str, client.version)), "features": int(client.features)}
    except (FleetdError, ValueError, OSError) as exc:
        return {"error": str(exc)}


def main(argv: list[str] | None = None) -> int:
    """The command line: one probe, its JSON answer printed; exit 1 on an error."""
    p = argparse.ArgumentParser(prog="python -m fleetd.client.probe", description=__doc__.splitlines()[0])
    p.add_argument("endpoint", metavar="HOST:PORT")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"bound on the connect and on the HELLO answer, in seconds (default {DEFAULT_TIMEOUT:g})",
    )
    args = p.parse_args(argv)
    if not args.timeout > 0:
        print(json.dumps({"error": f"--timeout {args.timeout:g}: must be above 0"}))
        return 1
    answer = probe(args.endpoint, args.timeout)
    print(json.dumps(answer))
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main())

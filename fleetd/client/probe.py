"""`python -m fleetd.client.probe HOST:PORT [--timeout S]`: one HELLO, one JSON line.

    {"version": "7.0.0", "features": 1}     exit 0: the server answered HELLO
    {"error": "..."}                        exit 1: it did not (refused, timed out, not RPC)

fleetctl deploy's health check runs it with the installed release's interpreter, so a pass
also proves that release's fleetd imports.
"""

from __future__ import annotations

import argparse
import json
import sys

from fleetd.client.rpc import RpcClient
from fleetd.errors import FleetdError
from fleetd.transport.tcp import Timeout


def probe(endpoint: str, timeout: float) -> dict:
    with RpcClient(endpoint, Timeout(connect=timeout, read=timeout)) as client:
        return {"version": ".".join(map(str, client.version)), "features": int(client.features)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fleetd.client.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("endpoint", metavar="HOST:PORT")
    ap.add_argument("--timeout", type=float, default=5.0, metavar="S",
                    help="seconds for the connect and for the answer (default 5)")
    args = ap.parse_args(argv)
    try:
        answer = probe(args.endpoint, args.timeout)
    except (FleetdError, ValueError, OSError) as exc:
        print(json.dumps({"error": f"HELLO {args.endpoint}: {exc}"}))
        return 1
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())

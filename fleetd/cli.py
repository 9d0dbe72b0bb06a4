"""Entry points: `fleetd` (the daemon) and `fleetctl` (the operator's tool)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from fleetd import __version__
from fleetd.errors import FleetdError


def _fleetd_parser() -> argparse.ArgumentParser:
    from fleetd.server.config import DEFAULT_CONTROL_PORT, DEFAULT_RPC_PORT

    p = argparse.ArgumentParser(
        prog="fleetd",
        description="ggml RPC server (protocol 7, stock llama.cpp clients work unmodified) "
        "with direct server-to-server transfer.",
    )
    p.add_argument("-H", "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("-p", "--port", type=int, default=DEFAULT_RPC_PORT, help=f"RPC port (default {DEFAULT_RPC_PORT})")
    p.add_argument("-d", "--device", default="cpu", help="devices, comma separated: cpu (default cpu)")
    p.add_argument("-c", "--cache-dir", type=Path, help="cache directory for SET_TENSOR_HASH (off by default)")
    p.add_argument("-t", "--threads", type=int, help="threads for numpy/BLAS kernels (default: all cores)")
    p.add_argument(
        "--control-port", type=int, default=DEFAULT_CONTROL_PORT,
        help=f"loopback control API port, 0 to disable (default {DEFAULT_CONTROL_PORT})",
    )
    p.add_argument("--no-p2p", action="store_true", help="start with peer copy switched off")
    p.add_argument("--peer-allow", help="hosts/CIDRs COPY_TENSOR_TO may push to (comma separated)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("-V", "--version", action="version", version=f"fleetd {__version__}")
    return p


def _set_threads(n: int | None) -> None:
    # BLAS reads these once, when numpy is first imported: set them before that happens.
    if n:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(n)


def fleetd_main(argv: list[str] | None = None) -> int:
    args = _fleetd_parser().parse_args(argv)
    if not 0 < args.port < 65536:
        print(f"fleetd: error: --port {args.port} outside 1..65535", file=sys.stderr)
        return 2
    _set_threads(args.threads)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from fleetd.server.config import ServerConfig
    from fleetd.server.daemon import serve_forever

    config = ServerConfig(
        host=args.host, port=args.port, devices=[d for d in args.device.split(",") if d],
        cache_dir=args.cache_dir, threads=args.threads,
        control_port=args.control_port or None, p2p=not args.no_p2p,
        peer_allow=args.peer_allow.split(",") if args.peer_allow else None,
    )
    try:
        return serve_forever(config)
    except (FleetdError, ValueError, OSError) as exc:
        print(f"fleetd: error: {exc}", file=sys.stderr)
        return 1


def fleetctl_main(argv: list[str] | None = None) -> int:
    from fleetd.fleet.cli import main

    return main(argv)


if __name__ == "__main__":
    import sys

    sys.exit(fleetd_main())

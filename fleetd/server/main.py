"""The `fleetd` entry point: flags and config file into a ServerConfig, then serve."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tomllib
from pathlib import Path

from fleetd import __version__
from fleetd.device_names import DEVICE_NAMES, unknown_devices
from fleetd.errors import FleetdError
from fleetd.ports import DEFAULT_RPC_PORT, control_port_for
from fleetd.server.config import ServerConfig, ServerLimits
from fleetd.server.daemon import serve_forever

# Built-in defaults; a --config file overrides them and command-line flags override both.
FLEETD_DEFAULTS = {
    "host": "127.0.0.1",
    "port": DEFAULT_RPC_PORT,
    "devices": ["cpu"],
    "cache_dir": None,
    "cache_max_bytes": None,  # the cache directory's budget (fleetd.server.cache_dir)
    "threads": None,
    "dequant_cache": None,
    "control_port": None,  # --port + 100 (fleetd.ports.control_port_for)
    "p2p": True,
    "peer_allow": None,
    "allow": None,
    "limits": {},  # a [limits] table: ServerLimits field names (fleetd(8) LIMITS)
    "log_level": "info",
    "log_file": None,  # None: stderr (the supervisor's or the journal's)
    "worker_user": None,
    "pin_workers": True,
    "user": None,  # started as root: the user to drop to after binding (fleetd.server.privileges)
}

# -- limits flags: one per ServerLimits field, --max-memory 8G, --idle-timeout 3600, ...
LIMIT_HELP = {
    "max_memory": "bytes all buffers together may take (default 90%% of RAM)",
    "max_session_memory": "bytes one session's buffers may take (default: --max-memory)",
    "max_request_bytes": "bytes of one unfinished request held per connection (default 64M)",
    "max_buffered_bytes": "bytes of unfinished requests held by all connections (default 512M)",
    "max_connections": "RPC connections served at once; more are closed (default 256)",
    "max_connections_per_address": "RPC connections served at once from one client address (default 64)",
    "max_graph_tensors": "nodes and tensors of one GRAPH_COMPUTE (default 262144)",
    "view_expansion": "how many times its extent a view's logical size may be (default 16)",
    "view_slack": "bytes a view's logical size may exceed that by (default 1M)",
    "hello_timeout": "seconds from connect to HELLO (default 5)",
    "idle_timeout": "seconds between requests before a connection is closed (default 86400)",
    "request_timeout": "seconds without a byte inside a request, and the grace before "
    "--min-request-rate applies (default 10)",
    "min_request_rate": "bytes/s a request must arrive at after the grace (default 4K)",
    "max_peer_links": "COPY_TENSOR_TO destinations one session keeps linked (default 16)",
    "max_peer_held_bytes": "asynchronous peer copies' bytes held daemon-wide (default 256M)",
    "max_workers": "compute worker processes alive at once, one per computing session; at the "
    "cap the least recently used idle one makes room (default 64)",
    "worker_idle_timeout": "seconds a compute worker may idle before it is reaped (default 300)",
    "graph_timeout": "seconds one graph may compute before its worker is killed and its "
    "connection closed (default 600)",
}


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits", "sizes take K/M/G/T suffixes; see fleetd(8) LIMITS")
    for f in dataclasses.fields(ServerLimits):
        g.add_argument(
            "--" + f.name.replace("_", "-"), dest=f"limit_{f.name}", metavar="N", help=LIMIT_HELP.get(f.name)
        )


def _limit_flags(args: argparse.Namespace) -> dict:
    return {
        f.name: getattr(args, f"limit_{f.name}")
        for f in dataclasses.fields(ServerLimits)
        if getattr(args, f"limit_{f.name}", None) is not None
    }


def _fleetd_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fleetd",
        description="ggml RPC server (protocol 7, stock llama.cpp clients work unmodified) "
        "with direct server-to-server transfer.",
        epilog="A TOML --config file may set host, port, devices (list), cache_dir, threads, "
        "cache_max_bytes, control_port, p2p (bool), peer_allow (list), allow (list), log_level, "
        "log_file, user, "
        "worker_user, pin_workers (bool) and a [limits] "
        "table (the limits flags' names with _); flags win over it.",
    )
    p.add_argument("--config", type=Path, help="TOML configuration file (written by fleetctl deploy)")
    p.add_argument("-H", "--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("-p", "--port", type=int, help=f"RPC port (default {DEFAULT_RPC_PORT})")
    p.add_argument(
        "-d",
        "--device",
        help="devices, comma separated: cpu (ggml's CPU kernels), numpy (the portable op table); default cpu",
    )
    p.add_argument(
        "-c", "--cache-dir", type=Path, help="cache directory for SET_TENSOR_HASH (off by default)"
    )
    p.add_argument(
        "--cache-max-bytes",
        metavar="N",
        help="bytes the cache directory may hold, oldest "
        "files evicted first: a size (64G) or a share of free space at start (default 0.5x)",
    )
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        help="ggml's compute threads, and numpy/BLAS's (default: half the cores, as stock)",
    )
    p.add_argument(
        "--dequant-cache",
        help="numpy device's f32 weight cache: a fraction of buffer bytes "
        "(default 0.5x) or a size (2G; 0 for none)",
    )
    p.add_argument(
        "--control-port", type=int, help="loopback control API port, 0 to disable (default: --port + 100)"
    )
    p.add_argument("--no-p2p", action="store_true", default=None, help="start with peer copy switched off")
    p.add_argument(
        "--peer-allow",
        help="hosts/CIDRs COPY_TENSOR_TO may push to, comma separated (default: loopback and "
        "the subnet of the bound address)",
    )
    p.add_argument(
        "--allow",
        help="hosts/CIDRs whose RPC connections are served, comma separated (default: loopback "
        "when bound to loopback, else loopback and the subnet of the bound address)",
    )
    p.add_argument(
        "--user",
        metavar="NAME",
        help="started as root: drop to this user after binding (refuses to start when it does not exist)",
    )
    _add_limit_flags(p)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--log-file",
        type=Path,
        metavar="PATH",
        help="append the log to this file (default: stderr); /v1/status reports it, "
        "fleetctl logs and the TUI read it",
    )
    p.add_argument(
        "--worker-user",
        metavar="USER",
        help="user the contained compute workers run as when fleetd runs as root "
        "(default: fleetd if it exists, else nobody)",
    )
    p.add_argument(
        "--no-pin-workers",
        action="store_true",
        default=None,
        help="leave compute workers where the scheduler puts them (default: a session's "
        "daemon thread and its worker share the least used cores)",
    )
    p.add_argument("--no-counters", action="store_true", help=argparse.SUPPRESS)  # benchmarks only
    p.add_argument("-V", "--version", action="version", version=f"fleetd {__version__}")
    return p


def resolve_settings(args: argparse.Namespace) -> dict:
    """Defaults < config file < flags. Raises ValueError with one clear line."""
    settings = dict(FLEETD_DEFAULTS)
    if args.config is not None:
        try:
            with open(args.config, "rb") as f:
                loaded = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"--config {args.config}: {exc}") from exc
        unknown = sorted(set(loaded) - set(settings))
        if unknown:
            raise ValueError(f"--config {args.config}: unknown keys {', '.join(unknown)}")
        settings.update(loaded)
    flags = {
        "host": args.host,
        "port": args.port,
        "cache_dir": args.cache_dir,
        "threads": args.threads,
        "control_port": args.control_port,
        "log_level": args.log_level,
        "dequant_cache": args.dequant_cache,
        "log_file": args.log_file,
        "devices": args.device.split(",") if args.device else None,
        "peer_allow": args.peer_allow.split(",") if args.peer_allow else None,
        "p2p": False if args.no_p2p else None,
        "allow": args.allow.split(",") if args.allow else None,
        "worker_user": args.worker_user,
        "pin_workers": False if args.no_pin_workers else None,
        "user": args.user,
        "cache_max_bytes": args.cache_max_bytes,
    }
    limits = dict(settings["limits"]) if isinstance(settings["limits"], dict) else None
    if limits is None:
        raise ValueError("limits: must be a [limits] table")
    limits.update(_limit_flags(args))
    settings.update({k: v for k, v in flags.items() if v is not None})
    if settings["control_port"] is None:  # two fleetd on one host, one per GPU: their own ports
        settings["control_port"] = control_port_for(int(settings["port"]))
    settings["limits"] = ServerLimits.from_settings(limits)
    bad = unknown_devices(settings["devices"])
    if bad:
        raise ValueError(f"device {', '.join(map(repr, bad))}: unknown (known: {', '.join(DEVICE_NAMES)})")
    if not 0 < int(settings["port"]) < 65536:
        raise ValueError(f"port {settings['port']} outside 1..65535")
    return settings


def _set_threads(n: int | None) -> None:
    # BLAS reads these once, when numpy is first imported: set them before that happens.
    if n:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(n)


def fleetd_main(argv: list[str] | None = None) -> int:
    """The fleetd command: settings resolved, logging set up, then serve until stopped; exit 2 for
    bad settings, 1 when it cannot serve."""
    args = _fleetd_parser().parse_args(argv)
    try:
        settings = resolve_settings(args)
    except ValueError as exc:
        print(f"fleetd: error: {exc}", file=sys.stderr)
        return 2
    _set_threads(settings["threads"])
    log_file = Path(settings["log_file"]).absolute() if settings["log_file"] else None
    try:
        logging.basicConfig(
            level=str(settings["log_level"]).upper(),
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
            **({"filename": str(log_file)} if log_file else {}),
        )
    except OSError as exc:
        print(f"fleetd: error: --log-file {log_file}: {exc.strerror}", file=sys.stderr)
        return 2
    config = ServerConfig(
        host=settings["host"],
        port=int(settings["port"]),
        devices=list(settings["devices"]),
        cache_dir=Path(settings["cache_dir"]) if settings["cache_dir"] else None,
        threads=settings["threads"],
        control_port=settings["control_port"] or None,
        dequant_cache=settings["dequant_cache"],
        p2p=bool(settings["p2p"]),
        peer_allow=settings["peer_allow"],
        allow=settings["allow"],
        limits=settings["limits"],
        count_commands=not args.no_counters,
        worker_user=settings["worker_user"],
        pin_workers=bool(settings["pin_workers"]),
        user=settings["user"],
        cache_max_bytes=settings["cache_max_bytes"],
        log_file=str(log_file) if log_file else None,
    )
    try:
        return serve_forever(config)
    except (FleetdError, ValueError, OSError) as exc:
        print(f"fleetd: error: {exc}", file=sys.stderr)
        return 1


main = fleetd_main

"""fleetctl serve: a GGUF served over the fleet with a plan, until Ctrl-C or `fleetctl serve --stop`.

Reads the plan file (--plan) or plans now (fleetd.fleet.plan over plan_probe's measurements),
starts the patched llama-server behind the front of fleetd.fleet.serve, shows llama-server's
progress while it loads (rich, on stderr), prints the URL and the layers each node holds, and
then one line per event of the supervisor (a node down, a restart, a new plan). The state file
(fleetd.fleet.serve_control) lets `fleetctl serve --stop` from another shell end it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from fleetd.ctl.options import fleet_args, open_fleet
from fleetd.ctl.plan_command import DEFAULT_CTX
from fleetd.errors import FleetError, UsageError
from fleetd.fleet.plan import DoesNotFit, ModelSizes, PlanError, Workload, read_model
from fleetd.fleet.plan_probe import plan_for
from fleetd.fleet.serve import (
    DEFAULT_PORT,
    DEFAULT_REPLAN_AFTER_S,
    DEFAULT_START_TIMEOUT_S,
    ServeConfig,
    Service,
    check_plan,
    stage_lines,
)
from fleetd.fleet.serve_control import (
    ServeRecord,
    remove_state,
    running_serves,
    state_dir,
    state_path,
    stop_serve,
    write_state,
)
from fleetd.tools import find_p2p_tool

SERVE_HELP = (
    "serve a GGUF over the fleet with its plan (the patched llama-server behind a front that "
    "answers 503 while a node is down and restarts around it), until Ctrl-C or --stop"
)


def configure_serve(p) -> None:
    """The flags of `fleetctl serve`: the model, the nodes file, the front, the plan, --stop."""
    p.add_argument("model", type=Path, nargs="?", metavar="MODEL.gguf", help="the GGUF model to serve")
    fleet_args(p, json_output=False, nodes_optional=True)
    p.add_argument(
        "--port",
        type=int,
        default=None,
        metavar="P",
        help=f"port of the HTTP front (llama-server's API; default {DEFAULT_PORT}); with --stop: "
        "which serve to stop",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the front listens on (default 127.0.0.1)")
    p.add_argument(
        "--plan",
        type=Path,
        default=None,
        metavar="FILE",
        help="plan file of `fleetctl plan --json` (default: plan now)",
    )
    p.add_argument(
        "--ctx",
        type=int,
        default=None,
        metavar="N",
        help=f"without --plan: context size to plan for (default: the model's, else {DEFAULT_CTX})",
    )
    p.add_argument(
        "--parallel", type=int, default=1, metavar="N", help="without --plan: sequences at once (-np)"
    )
    p.add_argument(
        "--replan-after",
        type=float,
        default=DEFAULT_REPLAN_AFTER_S,
        metavar="S",
        help="seconds a node may be down before serving with a new plan without it, when the "
        f"others hold the model (default {DEFAULT_REPLAN_AFTER_S:g}; 0: always wait for the node)",
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N", help="llama-server's -t (default: its own)"
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT_S,
        metavar="S",
        help=f"seconds llama-server may take to load (default {DEFAULT_START_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--stop",
        action="store_true",
        help="stop the fleetctl serve running on --port (or the only one running) and wait until it has",
    )


def cmd_serve(args) -> int:
    """fleetctl serve: 0 when stopped by --stop (SIGTERM), 130 on Ctrl-C, 1 when it cannot start."""
    if args.stop:
        return _stop(args)
    model = _model(args)
    _refuse_a_second_serve(DEFAULT_PORT if args.port is None else args.port)
    with open_fleet(args) as fleet:
        doc = _read_plan(args.plan, model) if args.plan else _plan_now(args, fleet, model)
        config = ServeConfig(
            model=args.model,
            host=args.host,
            port=DEFAULT_PORT if args.port is None else args.port,
            replan_after=args.replan_after,
            threads=args.threads,
            start_timeout=args.start_timeout,
            log_path=state_dir() / f"serve-{DEFAULT_PORT if args.port is None else args.port}.log",
        )
        config.log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        config.log_path.write_bytes(b"")  # this run's output only
        service = Service(config, doc, model, exe=find_p2p_tool("llama-server"), nodes=fleet, say=_say)
        return _run(service)


def _model(args) -> ModelSizes:
    if args.model is None or args.nodes is None:
        raise UsageError("MODEL.gguf and NODES are required (or --stop)")
    if not args.model.is_file():
        raise UsageError(f"{args.model}: no such file")
    try:
        return read_model(args.model)
    except PlanError as exc:
        raise UsageError(str(exc)) from exc


def _read_plan(path: Path, model: ModelSizes) -> dict:
    try:
        return check_plan(json.loads(path.read_text()), model)
    except OSError as exc:
        raise UsageError(f"--plan {path}: {exc.strerror or exc}") from exc
    except (ValueError, PlanError) as exc:
        raise UsageError(f"--plan {path}: {exc}") from exc


def _plan_now(args, fleet, model: ModelSizes) -> dict:
    """What `fleetctl plan` would write: memory first (does it fit?), then measured."""
    work = Workload(ctx=args.ctx or model.n_ctx_train or DEFAULT_CTX, parallel=args.parallel)
    try:
        with _progress() as bar:
            task = bar.add_task("measuring the nodes", total=None)
            return plan_for(
                fleet, model, work, lambda step, done: bar.update(task, description=step)
            ).as_dict()
    except DoesNotFit as exc:
        raise FleetError(str(exc)) from exc


def _refuse_a_second_serve(port: int) -> None:
    for record in running_serves():
        if record.port == port:
            raise FleetError(
                f"fleetctl serve already runs on port {port} (pid {record.pid}): --stop it first"
            )


def _progress() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def _say(line: str) -> None:
    """One supervisor event, time-stamped, on stderr."""
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def _run(service: Service) -> int:
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    record = None
    try:
        name = service.config.model.name
        with _progress() as bar:
            task = bar.add_task(f"loading {name}", total=None)
            service.start(on_wait=lambda line: bar.update(task, description=f"loading {name}: {line[:80]}"))
        record = ServeRecord(
            os.getpid(),
            service.port,
            service.url,
            str(service.config.model),
            str(service.config.log_path),
            time.time(),
        )
        write_state(record)
        print(f"serving {name} at {service.url}")
        for line in stage_lines(service.plan):
            print(f"  {line}")
        print(f"llama-server's log: {service.config.log_path}")
        print(f"stop: Ctrl-C, or fleetctl serve --stop --port {service.port}")
        sys.stdout.flush()
        while not stop.wait(1.0):
            pass
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        service.stop()
        if record is not None:
            remove_state(record)
        _say(f"stopped serving at {service.url}")


def _stop(args) -> int:
    if args.model is not None or args.nodes is not None:
        raise UsageError("--stop takes no MODEL.gguf or NODES (only --port)")
    running = running_serves()
    if args.port is not None:
        running = [r for r in running if r.port == args.port]
        if not running:
            raise FleetError(
                f"no fleetctl serve runs on port {args.port} ({state_path(args.port)} names none)"
            )
    elif not running:
        raise FleetError(f"no fleetctl serve runs (no state file in {state_dir()})")
    elif len(running) > 1:
        ports = ", ".join(str(r.port) for r in running)
        raise UsageError(f"several fleetctl serve run (ports {ports}): say which with --port")
    record = running[0]
    stop_serve(record)
    print(f"stopped fleetctl serve on port {record.port} (pid {record.pid})")
    return 0

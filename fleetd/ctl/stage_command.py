"""fleetctl stage: each node's cache directory gets the tensors the plan gives it (fleetd.fleet.stage),
in parallel, with a progress bar per node on stderr and a summary (or --json) on stdout.

Exit 0 when every node is staged; 1 when a node failed (each failure one line on stderr, the
others staged all the same); 2 for a usage error (no model, a bad plan file, a plan for other nodes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from fleetd.ctl.options import fleet_args, open_fleet, print_json, print_renderables
from fleetd.ctl.plan_command import DEFAULT_CTX
from fleetd.errors import UsageError
from fleetd.fleet.node import Fleet, FleetResult, Node
from fleetd.fleet.plan import DoesNotFit, PlanError, Workload, read_model
from fleetd.fleet.plan_probe import plan_for
from fleetd.fleet.render import fmt_bytes, reason
from fleetd.fleet.stage import Model, NodeResult, Share, check_model, plan_shares, stage_node

STAGE_HELP = (
    "put into each node's cache directory the tensors the plan gives it, so the next load "
    "sends hashes instead of weights"
)


def configure_stage(p) -> None:
    """The flags of `fleetctl stage`: the model, the nodes file and the plan."""
    p.add_argument("model", type=Path, metavar="MODEL.gguf", help="the GGUF model to stage")
    fleet_args(p)
    p.add_argument(
        "--plan",
        type=Path,
        metavar="FILE",
        help="the plan file (fleetctl plan --json) the next load uses (default: plan now, "
        "as fleetctl plan does with its defaults)",
    )


def _usage_error(message: str) -> int:
    print(f"fleetctl stage: error: {message}", file=sys.stderr)
    return 2


def cmd_stage(args) -> int:
    """fleetctl stage: exit 0 when every node of the plan is staged, 1 when one failed."""
    if not args.model.is_file():
        return _usage_error(f"{args.model}: no such file")
    try:
        model = Model(args.model)
        doc = _read_plan(args.plan) if args.plan else None
    except UsageError as exc:
        return _usage_error(str(exc))
    with open_fleet(args) as fleet:
        if doc is None:
            doc = _plan_now(args, fleet)
            if doc is None:
                return 1
        try:
            check_model(model, doc)
            shares = _shares_on(fleet, plan_shares(doc))
        except UsageError as exc:
            return _usage_error(str(exc))
        result = _stage_all(model, shares, quiet=args.json or not sys.stderr.isatty())
    _report(args, result, shares)
    return 0 if result.ok else 1


def _read_plan(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"--plan {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"--plan {path}: not JSON ({exc})") from None


def _plan_now(args, fleet: Fleet) -> dict | None:
    """The plan `fleetctl plan MODEL NODES --json` would write; None (said on stderr) when the
    model does not fit."""
    try:
        sizes = read_model(args.model)
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    work = Workload(ctx=sizes.n_ctx_train or DEFAULT_CTX)
    try:
        return plan_for(fleet, sizes, work).as_dict()
    except DoesNotFit as exc:
        print(f"fleetctl stage: {exc}", file=sys.stderr)
        return None


def _shares_on(fleet: Fleet, shares: list[Share]) -> dict[Node, Share]:
    """Each stage of the plan with its node of the nodes file (by name)."""
    by_name = {n.name: n for n in fleet}
    missing = [s.name for s in shares if s.name not in by_name]
    if missing:
        raise UsageError(f"the plan names nodes the nodes file does not: {', '.join(missing)}")
    return {by_name[s.name]: s for s in shares}


def _stage_all(model: Model, shares: dict[Node, Share], quiet: bool) -> FleetResult:
    """stage_node on every node at once, a progress bar each on stderr (none when `quiet`: with
    --json, or when stderr is not a terminal, where only the failure lines go)."""
    nodes = Fleet(shares)
    if quiet:
        return nodes.map(lambda n: stage_node(model, n, shares[n]))
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True)) as bar:
        tasks = {n: bar.add_task(f"{n.name} hashing", total=None) for n in nodes}

        def one(node: Node) -> NodeResult:
            task = tasks[node]
            return stage_node(
                model,
                node,
                shares[node],
                started=lambda total: bar.update(task, total=max(total, 1), description=node.name),
                progress=lambda n: bar.advance(task, n),
            )

        result = nodes.map(one)
        for node, value in result.items():
            if not isinstance(value, BaseException) and value.sent_bytes == 0:
                bar.update(tasks[node], completed=1, total=1, description=f"{node.name} (all there)")
    return result


def summary_table(result: FleetResult, shares: dict[Node, Share]) -> Table:
    """Per node: its layers, the files it should hold, what was sent and what was already there."""
    t = Table(title="staged")
    for col in ("node", "layers", "tensors", "sent", "already there", "seconds", "cache directory"):
        t.add_column(col, justify="left" if col in ("node", "cache directory") else "right")
    for node, r in result.items():
        s = shares[node]
        layers = f"{s.first}-{s.stop - 1}" + (" + output" if s.output else "")
        if isinstance(r, BaseException):
            t.add_row(node.name, layers, "", "", "", "", f"[red]{reason(r)}[/red]")
            continue
        t.add_row(
            node.name,
            layers,
            f"{r.files} ({fmt_bytes(r.bytes)})",
            f"{r.sent_files} ({fmt_bytes(r.sent_bytes)})",
            f"{r.present_files} ({fmt_bytes(r.present_bytes)})",
            f"{r.seconds:.1f}",
            r.cache_dir,
        )
    return t


def json_summary(result: FleetResult, model: str) -> dict:
    nodes = {}
    for node, r in result.items():
        if isinstance(r, BaseException):
            nodes[node.name] = {"ok": False, "error": reason(r)}
        else:
            nodes[node.name] = dict(r.as_dict(), ok=True, tensors=r.tensors)
    return {"model": model, "nodes": nodes}


def _report(args, result: FleetResult, shares: dict[Node, Share]) -> None:
    if args.json:
        print_json(json_summary(result, args.model.name))
    else:
        print_renderables(summary_table(result, shares))
    for node, exc in result.failed.items():
        print(f"fleetctl stage: {failure_line(node, exc)}", file=sys.stderr)


def failure_line(node: Node, exc: BaseException) -> str:
    """One node's failure as one line, naming the node once."""
    text = str(exc) or type(exc).__name__
    return text if text.startswith(f"{node.name}: ") else f"{node.name}: {type(exc).__name__}: {text}"

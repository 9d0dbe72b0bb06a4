"""fleetctl plan: where each layer of a GGUF should go on a fleet, and the llama.cpp flags for it.

Reads the model (fleetd.fleet.plan), checks that it fits the nodes' free memory before anything
is timed (exit 1 naming the node and the shortfall otherwise), measures the nodes and links
(fleetd.fleet.plan_probe, with a progress bar on stderr), optimises and prints the placement as
tables, or as a versioned plan file with --json.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from fleetd.ctl.options import fleet_args, open_fleet, print_json, print_renderables
from fleetd.fleet.plan import (
    PLAN_VERSION,
    DoesNotFit,
    PlanError,
    Workload,
    fmt_mib,
    read_model,
)
from fleetd.fleet.plan_probe import plan_for

PLAN_HELP = (
    "place a GGUF's layers on the fleet from the nodes' free memory, measured compute and links; "
    "print --rpc and --tensor-split and the expected t/s"
)
MIB = 1 << 20
DEFAULT_CTX = 4096  # when the GGUF does not say its training context


def configure_plan(p) -> None:
    """The flags of `fleetctl plan`: the model, the nodes file and the context to size for."""
    p.add_argument("model", type=Path, metavar="MODEL.gguf", help="the GGUF model to place")
    fleet_args(p)
    p.add_argument(
        "--ctx",
        type=int,
        default=None,
        metavar="N",
        help="context size to size the KV cache for, llama.cpp's -c (default: the model's "
        f"training context, else {DEFAULT_CTX})",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="sequences decoded at once, llama.cpp's -np (default 1)",
    )


def cmd_plan(args) -> int:
    """fleetctl plan: exit 0 with a plan, 1 when the model does not fit or a node is down."""
    if not args.model.is_file():
        return _usage_error(f"{args.model}: no such file")
    try:
        model = read_model(args.model)
    except PlanError as exc:  # the operator's input, like a bad nodes file: one line, exit 2
        return _usage_error(str(exc))
    work = Workload(ctx=args.ctx or model.n_ctx_train or DEFAULT_CTX, parallel=args.parallel)
    with open_fleet(args) as fleet:
        try:
            if args.json:
                plan = plan_for(fleet, model, work)
            else:
                with Progress(console=Console(stderr=True), transient=True) as bar:
                    task = bar.add_task("measuring", total=1.0)
                    plan = plan_for(
                        fleet,
                        model,
                        work,
                        lambda step, done: bar.update(task, completed=done, description=step),
                    )
        except DoesNotFit as exc:
            return _does_not_fit(args, exc)
    doc = plan.as_dict()
    if args.json:
        print_json(doc)
    else:
        print_renderables(*plan_renderables(doc))
    return 0


def _usage_error(message: str) -> int:
    print(f"fleetctl plan: error: {message}", file=sys.stderr)
    return 2


def _does_not_fit(args, exc: DoesNotFit) -> int:
    if args.json:
        print_json({"version": PLAN_VERSION, "fits": False, "error": str(exc), "shortfalls": exc.shortfalls})
    print(f"fleetctl plan: {exc}", file=sys.stderr)
    return 1


# -- pure renderers over the plan document ------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _mb_s(link: dict | None) -> str:
    if link is None:
        return "unknown"
    return f"{link['bytes_per_s'] / 1e6:,.0f} MB/s, {link['latency_s'] * 1e3:.2f} ms"


def stages_table(doc: dict) -> Table:
    """The device order: per node its layers and the memory it will hold against what it has."""
    t = Table(title=f"plan for {Path(doc['model']['path']).name} (-c {doc['ctx']} -np {doc['parallel']})")
    for col in ("#", "node", "layers", "weights", "KV", "compute", "total", "usable / free"):
        t.add_column(col, justify="left" if col == "node" else "right")
    for i, s in enumerate(doc["stages"]):
        m = s["memory"]
        first, stop = s["layers"]
        layers = f"{first}-{stop - 1} ({s['layer_count']})" + (" + output" if s["output"] else "")
        t.add_row(
            str(i),
            s["name"],
            layers,
            fmt_mib(m["weights"]),
            fmt_mib(m["kv"]),
            fmt_mib(m["compute"]),
            fmt_mib(m["total"]),
            f"{m['usable'] / MIB:.1f} / {fmt_mib(m['free'])}",
        )
    return t


def measured_table(doc: dict) -> Table:
    """What the probe measured per node: device, compute per layer, one step's commands, the
    coordinator link."""
    t = Table(title="measured")
    cols = ("node", "device", "decode ms/layer", "prompt ms/token/layer", "step ms", "upload", "download")
    for col in cols:
        t.add_column(col, justify="left" if col in ("node", "device") else "right")
    for n in doc["measured"]["nodes"]:
        t.add_row(
            n["name"],
            n["kind"],
            _ms(n["decode_layer_s"]),
            _ms(n["prompt_token_s"]),
            _ms(n["step_s"]) if n.get("step_s") else "-",
            _mb_s(n["upload"]),
            _mb_s(n["download"]),
        )
    return t


def speeds_table(doc: dict) -> Table:
    p = doc["predicted"]
    t = Table(title="expected tokens/s")
    for col in ("path", "prompt t/s", "decode t/s"):
        t.add_column(col, justify="left" if col == "path" else "right")
    t.add_row("hub (through the coordinator)", f"{p['prompt_hub']:.1f}", f"{p['decode_hub']:.1f}")
    t.add_row("direct (peer copy)", f"{p['prompt_direct']:.1f}", f"{p['decode_direct']:.1f}")
    return t


def flags_text(doc: dict) -> Text:
    out = Text()
    out.append("llama.cpp flags: ", style="bold")
    out.append(" ".join(doc["llama_args"]) + "\n")
    out.append("-ot overrides: none needed (the output layer goes to the last device by the split)\n")
    if doc["unused"]:
        out.append(f"unused (faster without them): {', '.join(doc['unused'])}\n", style="yellow")
    peers = doc["measured"]["peers"]
    if peers:
        links = "; ".join(f"{x['from']} -> {x['to']} {_mb_s(x['link'])}" for x in peers)
        out.append(f"peer links: {links}\n")
    for note in doc["notes"]:
        out.append(f"note: {note}\n", style="dim")
    return out


def plan_renderables(doc: dict) -> list:
    return [stages_table(doc), speeds_table(doc), measured_table(doc), flags_text(doc)]

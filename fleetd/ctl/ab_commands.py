"""fleetctl ab (hub vs direct on a fleet) and fleetctl demo (the same on a local fleet)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from fleetd.ctl.options import fleet_args, open_fleet
from fleetd.errors import FleetError
from fleetd.fleet.ab import abba, compare
from fleetd.fleet.chart import write_bar_chart
from fleetd.fleet.local import START_TIMEOUT_S
from fleetd.fleet.model_ab import DEFAULT_SHAPES, SHAPES, direct_path_problems, parse_shapes, run_model_ab
from fleetd.fleet.node import Fleet
from fleetd.fleet.render import (
    ab_table,
    ab_verdict,
    model_ab_bars,
    model_ab_chart_panels,
    model_ab_steps_table,
    model_ab_table,
    model_ab_verdict,
)
from fleetd.transport import free_port, wait_listening


def _print_ab(doc: dict) -> None:
    console = Console()
    console.print(ab_table(doc))  # the per-step accounting, once
    console.print(ab_verdict(doc))


# -- ab ----------------------------------------------------------------------------------------

AB_HELP = (
    "A/B: the same layer split through the coordinator (hub) and direct (COPY_TENSOR_TO); "
    "synthetic stages, or a real model with --model"
)


def configure_ab(p) -> None:
    """The flags of `fleetctl ab`: the nodes file, the workload and each workload's sizes."""
    fleet_args(p)
    p.add_argument(
        "--workload",
        choices=("synthetic", "model"),
        help="synthetic: fleetd's own matmul stages (the default without --model); "
        "model: the patched llama.cpp tools on --model (the default with it)",
    )
    p.add_argument(
        "--model",
        type=Path,
        metavar="GGUF",
        help="run the --shapes (llama-bench, llama-batched-bench, llama-server) and "
        "llama-completion on this model through the nodes (tools from scripts/build-llama-p2p.sh)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of both arms, ABBA order (default: 3 for the model, 2 for synthetic)",
    )
    p.add_argument("--n-prompt", type=int, default=128, help="model: prompt tokens (default 128)")
    p.add_argument("--n-gen", type=int, default=32, help="model: generated tokens (default 32)")
    p.add_argument(
        "--shapes",
        metavar="LIST",
        help=f"model: what each cell runs, comma-separated from {', '.join(SHAPES)}, or all "
        f"(default {','.join(DEFAULT_SHAPES)}): pp/decode = llama-bench -p/-n; ubatch = the prompt "
        "in --micro-batches micro-batches (-b > -ub); batched4/8 = llama-batched-bench -npl 4/8; "
        "server = llama-server -np N under --server-clients closed-loop clients",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="model, ubatch shape: the prompt goes in at least this many micro-batches "
        "(-b n_prompt -ub n_prompt/K; default 4)",
    )
    p.add_argument(
        "--server-clients",
        type=int,
        default=4,
        help="model, server shape: parallel clients and llama-server slots (-np; default 4)",
    )
    p.add_argument(
        "--server-requests",
        type=int,
        default=4,
        help="model, server shape: requests per client; the load stops after clients x this many (default 4)",
    )
    p.add_argument(
        "--server-seconds",
        type=float,
        default=120.0,
        help="model, server shape: no request starts later than this, none may take longer (default 120)",
    )
    p.add_argument("--chart", type=Path, metavar="PNG", help="model: also write the chart to this PNG file")
    p.add_argument(
        "--anyway",
        action="store_true",
        help="model: run even when the nodes say the direct path cannot copy (P2P off, "
        "an allow-list that refuses the next node): both arms then measure the hub path",
    )
    p.add_argument(
        "--rows", type=int, default=32, help="synthetic: hidden state rows (default 32, as the seed)"
    )
    p.add_argument(
        "--n-embd", type=int, default=5120, help="synthetic: hidden size (default 5120, as the seed)"
    )
    p.add_argument("--layers", type=int, help="synthetic: layers in total (default 2 per stage)")
    p.add_argument("--steps", type=int, default=5, help="synthetic: steps per run (default 5, ABBA order)")
    p.add_argument(
        "--no-local",
        action="store_true",
        help="synthetic: no coordinator stage: every stage is a node (default: the "
        "coordinator's numpy device is the last stage, like RPC0,RPC1,CUDA0)",
    )


# Every number ab takes: (flag, attribute, lowest, highest); outside -> one line, exit 2.
AB_RANGES = (
    ("--rounds", "rounds", 1, 50),
    ("--n-prompt", "n_prompt", 1, 4096),
    ("--n-gen", "n_gen", 2, 1024),
    ("--rows", "rows", 1, 4096),
    ("--n-embd", "n_embd", 1, 65536),
    ("--layers", "layers", 1, 1024),
    ("--steps", "steps", 2, 1000),
)


def _usage_error(message: str) -> int:
    print(f"fleetctl ab: error: {message}", file=sys.stderr)
    return 2


def cmd_ab(args) -> int:
    """fleetctl ab: the synthetic A/B on the fleet, or the model one with --model; exit 1 when a node
    is down or the two paths' outputs differ."""
    for flag, attr, low, high in AB_RANGES:
        value = getattr(args, attr)
        if value is not None and not low <= value <= high:
            return _usage_error(f"{flag} {value}: must be in {low}..{high}")
    for flag, value in (("--timeout", args.timeout), ("--connect-timeout", args.connect_timeout)):
        if not 0 < value <= 3600:
            return _usage_error(f"{flag} {value:g}: must be above 0 and at most 3600 seconds")
    workload = args.workload or ("model" if args.model else "synthetic")
    if workload == "model" and args.model is None:
        return _usage_error("--workload model needs --model GGUF")
    if workload == "synthetic" and args.model is not None:
        return _usage_error("--model runs the model workload, not --workload synthetic")
    if workload == "model":
        return _cmd_model_ab(args)
    with open_fleet(args) as fleet:
        stages = len(fleet) + (0 if args.no_local else 1)
        if args.layers and args.layers < stages:
            return _usage_error(f"--layers {args.layers}: must be at least the number of stages ({stages})")
        down = fleet.map(lambda n: n.hello()).failed
        if down:
            for node, exc in down.items():
                print(f"fleetctl ab: node {node.name} is down: {exc}", file=sys.stderr)
            return 1
        order = abba(args.rounds or 2)
        doc = compare(fleet, args.layers, args.rows, args.n_embd, args.steps, not args.no_local, order)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_ab(doc)
    return 0 if doc["outputs_identical"] else 1


def _model_settings(args) -> dict:
    """run_model_ab's keyword arguments from the flags (a ValueError for bad shapes)."""
    shapes = parse_shapes(args.shapes) if args.shapes is not None else DEFAULT_SHAPES
    if "ubatch" in shapes and args.n_prompt < args.micro_batches:
        raise ValueError(
            f"--n-prompt {args.n_prompt} < --micro-batches {args.micro_batches}: "
            "each micro-batch needs a prompt token"
        )
    return {
        "rounds": args.rounds,
        "n_prompt": args.n_prompt,
        "n_gen": args.n_gen,
        "shapes": shapes,
        "micro_batches": args.micro_batches,
        "server_clients": args.server_clients,
        "server_requests": args.server_requests,
        "server_seconds": args.server_seconds,
    }


def _cmd_model_ab(args) -> int:
    args.rounds = args.rounds or 3
    try:
        settings = _model_settings(args)
    except ValueError as exc:
        return _usage_error(str(exc))
    if not args.model.is_file():
        return _usage_error(f"--model {args.model}: no such file")
    console = Console(stderr=True)
    with open_fleet(args) as fleet:
        problems = direct_path_problems(fleet)
        if problems:
            said = "; ".join(problems)
            if not args.anyway:
                print(
                    f"fleetctl ab: the direct path cannot copy on this fleet: {said}. Nothing was "
                    "run; fix it, or pass --anyway to measure the hub path in both arms.",
                    file=sys.stderr,
                )
                return 1
            console.print(
                f"[bold yellow]WARNING: the direct arm will not copy: {said}. Both arms "
                "measure the hub path (--anyway).[/]"
            )
        if args.json:
            result = run_model_ab(fleet, args.model, **settings)
        else:
            with Progress(console=console, transient=True) as bar:
                task = bar.add_task("A/B", total=1.0)
                result = run_model_ab(
                    fleet,
                    args.model,
                    **settings,
                    progress=lambda step, fraction: bar.update(task, completed=fraction, description=step),
                )
    doc = result.as_dict()
    if args.chart is not None:
        title = f"hub vs direct: {doc['stages']} rpc stages, {args.model.name}"
        if not doc["direct_ran"]:
            title += " - the direct arm never copied: both bars are the hub path"
        write_bar_chart(args.chart, title, model_ab_chart_panels(doc))
        doc["chart"] = str(args.chart)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        out = Console()
        out.print(model_ab_table(doc))
        out.print(model_ab_steps_table(doc))
        out.print(model_ab_bars(doc, out.width))
        out.print(model_ab_verdict(doc))
        if args.chart is not None:
            out.print(f"chart: {args.chart}")
    if not result.ok or not result.direct_ran:  # no win claimed for a path that never ran
        print(f"fleetctl ab: {result.verdict}", file=sys.stderr)
    return 0 if result.ok and result.direct_ran else 1


# -- demo: a local fleet on loopback -----------------------------------------------------------


def _llama_run(fleet: Fleet, workdir: Path, console: Console) -> dict | None:
    """Generate the small model and run llama-completion through the fleet, when the pinned tools
    are built; None when they are not."""
    from fleetd.tools import find_tool

    try:
        exe = find_tool("llama-completion")
    except FileNotFoundError as exc:
        console.print(f"[yellow]skipping the llama.cpp run: {exc}[/]")
        return None
    from fleetd.models import generate

    model = generate("llama", "f16", workdir)

    def complete(rpc: str) -> tuple[list[str], str]:
        args = [
            str(exe),
            "-m",
            str(model),
            "--rpc",
            rpc,
            "-ngl",
            "99",
            "-p",
            "Once upon a time",
            "-n",
            "24",
            "--temp",
            "0",
            "-no-cnv",
            "--no-warmup",
            "-t",
            "1",
        ]
        # llama.cpp prints through an asynchronous log thread that can drop the tail at exit
        # on a busy machine; a complete run ends with a blank line, so rerun (at most twice).
        for _ in range(3):
            p = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=600)
            if p.returncode != 0:
                raise FleetError(
                    f"llama-completion exited {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"
                )
            if p.stdout.endswith("\n\n"):
                break
        return args, p.stdout

    args, ours = complete(",".join(n.spec.rpc_endpoint for n in fleet))
    # The same command against the stock ggml-rpc-server: the tokens must be the same.
    port = free_port()
    stock = subprocess.Popen(
        [str(find_tool("ggml-rpc-server")), "-p", str(port), "-t", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        try:
            wait_listening(port, START_TIMEOUT_S)
        except TimeoutError as exc:
            raise FleetError(f"the stock ggml-rpc-server did not start: {exc}") from None
        _, theirs = complete(f"127.0.0.1:{port}")
    finally:
        stock.terminate()
        stock.wait(10)
    return {"model": str(model), "command": " ".join(args), "output": ours, "same_as_stock": ours == theirs}


DEMO_HELP = "start a local fleet on loopback, run llama.cpp and an A/B through it, show stats"

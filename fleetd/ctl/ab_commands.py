"""fleetctl ab (hub vs direct on a fleet) and fleetctl demo (the same on a local fleet)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from rich.console import Console

from fleetd.ctl.options import by_name, fleet_args, open_fleet
from fleetd.errors import FleetError
from fleetd.fleet.ab import compare
from fleetd.fleet.local import START_TIMEOUT_S, LocalFleet
from fleetd.fleet.node import Fleet
from fleetd.fleet.render import ab_steps_text, ab_table, ab_verdict, stats_table, status_table
from fleetd.transport import free_port, wait_listening


def _print_ab(doc: dict) -> None:
    console = Console()
    console.print(ab_table(doc))
    console.print(ab_steps_text(doc))
    console.print(ab_verdict(doc))


# -- ab ----------------------------------------------------------------------------------------

AB_HELP = "A/B: the same layer split through the coordinator (hub) and direct (COPY_TENSOR_TO)"


def configure_ab(p) -> None:
    fleet_args(p)
    p.add_argument("--rows", type=int, default=32, help="hidden state rows (default 32, as the seed)")
    p.add_argument("--n-embd", type=int, default=5120, help="hidden size (default 5120, as the seed)")
    p.add_argument("--layers", type=int, help="layers in total (default 2 per stage)")
    p.add_argument("--steps", type=int, default=5, help="steps per run (default 5, ABBA order)")
    p.add_argument("--no-local", action="store_true",
                   help="no coordinator stage: every stage is a node (default: the coordinator's "
                        "numpy device is the last stage, like RPC0,RPC1,CUDA0)")


def cmd_ab(args) -> int:
    if args.steps < 2:
        raise FleetError("--steps must be at least 2 (the first step is a full GRAPH_COMPUTE)")
    with open_fleet(args) as fleet:
        doc = compare(fleet, args.layers, args.rows, args.n_embd, args.steps, not args.no_local)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_ab(doc)
    return 0 if doc["outputs_identical"] else 1


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
        args = [str(exe), "-m", str(model), "--rpc", rpc, "-ngl", "99", "-p", "Once upon a time",
                "-n", "24", "--temp", "0", "-no-cnv", "--no-warmup", "-t", "1"]
        # llama.cpp prints through an asynchronous log thread that can drop the tail at exit
        # on a busy machine; a complete run ends with a blank line, so rerun (at most twice).
        for _ in range(3):
            p = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=600)
            if p.returncode != 0:
                raise FleetError(f"llama-completion exited {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
            if p.stdout.endswith("\n\n"):
                break
        return args, p.stdout

    args, ours = complete(",".join(n.spec.rpc_endpoint for n in fleet))
    # The same command against the stock ggml-rpc-server: the tokens must be the same.
    port = free_port()
    stock = subprocess.Popen([str(find_tool("ggml-rpc-server")), "-p", str(port), "-t", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def configure_demo(p) -> None:
    p.add_argument("--nodes", type=int, default=2, help="fleetd processes to start (default 2)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--n-embd", type=int, default=1024, help="hidden size of the A/B (default 1024)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-llama", action="store_true", help="skip the llama.cpp run")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_demo(args) -> int:
    console = Console(stderr=args.json)
    report: dict = {}
    console.print(f"starting {args.nodes} fleetd nodes on loopback")
    with tempfile.TemporaryDirectory(prefix="fleetd-demo-") as tmp, LocalFleet(args.nodes, tmp) as local:
        fleet, workdir = local.fleet, Path(tmp)
        console.print(f"local fleet: {', '.join(local.endpoints)} (nodes file {local.nodes_file})")
        console.print(status_table(by_name(fleet.map(lambda n: n.status()))))
        if not args.no_llama:
            with console.status("llama-completion on a generated model through the fleet"):
                report["llama"] = _llama_run(fleet, workdir, console)
            if report["llama"]:
                console.print(f"[bold]llama-completion --rpc {','.join(local.endpoints)}[/]")
                console.print(report["llama"]["output"].strip())
                same = report["llama"]["same_as_stock"]
                console.print("(random weights, so the text is noise) same output as the stock "
                              f"ggml-rpc-server: {'[green]yes[/]' if same else '[red]NO[/]'}")
        with console.status("A/B: hub path vs direct path"):
            report["ab"] = compare(fleet, None, args.rows, args.n_embd, args.steps, True)
        stats = by_name(fleet.map(lambda n: n.stats()))
        report["stats"] = {k: (v.doc if not isinstance(v, Exception) else str(v)) for k, v in stats.items()}
        if not args.json:
            _print_ab(report["ab"])
            console.print(stats_table(stats))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    llama_ok = report.get("llama") is None or report["llama"]["same_as_stock"]
    return 0 if report["ab"]["outputs_identical"] and llama_ok else 1

"""fleetctl deploy | start | stop | restart | logs | uninstall | inventory | wheels."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

from fleetd.ctl.options import fleet_args, open_fleet
from fleetd.fleet.deploy import SERVICE_USER, STEPS, Deployer, NodeOutcome, build, clean_build, inventory
from fleetd.fleet.node import Fleet
from fleetd.fleet.nodes_file import NODES_FILE_HELP
from fleetd.fleet.render import lifecycle_table, outcome_table
from fleetd.tools import LLAMA_VERSION


def _deploy_args(p: argparse.ArgumentParser) -> None:
    fleet_args(p)
    p.add_argument("--node", action="append", default=[], help="only this node (repeatable)")
    p.add_argument(
        "--root", help="install directory on nodes (default /opt/fleetd for root, else ~/.local/share/fleetd)"
    )
    p.add_argument("--no-systemd", action="store_true", help="never use systemd units")
    p.add_argument(
        "--service-user",
        default=SERVICE_USER,
        metavar="NAME",
        help=f"as root, run fleetd as this system user, created when missing (default {SERVICE_USER})",
    )
    p.add_argument(
        "--python",
        default="python3",
        metavar="PATH",
        help="the nodes' interpreter for the agent and the releases' venvs (default python3; "
        "as root, one the service user can read, e.g. /usr/bin/python3)",
    )


def _ggml_lib_arg(p) -> None:
    p.add_argument(
        "--ggml-lib",
        type=Path,
        metavar="DIR",
        help="portable ggml build whose *.so files the wheel carries (default: "
        f"~/.cache/fleetd/llama.cpp-{LLAMA_VERSION}/lib-portable, from FLEETD_GGML_PORTABLE=1 "
        "scripts/build-llama.sh ggml; without one nodes run the numpy device)",
    )


def _load(args) -> Fleet:
    fleet = open_fleet(args)
    return fleet.select(args.node) if args.node else fleet


def _failed(node, exc: Exception) -> NodeOutcome:
    return NodeOutcome(node.name, "failed", detail=f"{type(exc).__name__}: {exc}")


# -- deploy ------------------------------------------------------------------------------------

DEPLOY_HELP = "install, configure, start and health-check fleetd on every node over SSH"


def configure_deploy(p) -> None:
    _deploy_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--source", type=Path, help="project tree to build the wheel from (default: this one)")
    p.add_argument("--wheel-dir", type=Path, help="use the fleetd wheel found here instead of building")
    _ggml_lib_arg(p)


def _warn(command: str, warning: str | None) -> None:
    if warning:  # plain print: one line, never wrapped to the terminal's width
        print(f"fleetctl {command}: warning: {warning}", file=sys.stderr)


def cmd_deploy(args) -> int:
    """fleetctl deploy: build the wheels once, deploy (or --dry-run plan) every node in parallel,
    one outcome per node; exit 1 unless every node deployed, was unchanged or was planned."""
    console = Console(stderr=True)
    with _load(args) as fleet:
        with console.status("building wheels"):
            b = build(source=args.source, wheel_dir=args.wheel_dir, ggml_lib=args.ggml_lib)
        _warn("deploy", b.warning)
        try:
            with Progress(
                SpinnerColumn(),
                TextColumn("{task.fields[node]:<24}"),
                BarColumn(),
                TextColumn("{task.description}"),
                console=console,
                disable=args.json or not console.is_terminal,
            ) as progress:
                tasks = {n: progress.add_task("waiting", total=len(STEPS), node=n.name) for n in fleet}

                def step(node, name):
                    progress.update(tasks[node], description=name, completed=STEPS.index(name))

                deployer = Deployer(
                    fleet,
                    b,
                    root=args.root,
                    systemd=not args.no_systemd,
                    progress=step,
                    service_user=args.service_user,
                    python=args.python,
                )
                result = fleet.map(deployer.plan if args.dry_run else deployer.deploy)
                for n in fleet:
                    progress.update(tasks[n], completed=len(STEPS), description="done")
        finally:
            clean_build(b)
        outcomes = [v if isinstance(v, NodeOutcome) else _failed(n, v) for n, v in result.items()]
    if args.json:
        print(json.dumps([o.as_dict() for o in outcomes], indent=2))
    else:
        Console().print(outcome_table(outcomes))
        changed = sum(o.status == "deployed" for o in outcomes)
        if not args.dry_run and changed == 0 and all(o.status == "unchanged" for o in outcomes):
            Console().print("nothing changed: every node already runs this build")
    return 0 if all(o.status in ("deployed", "unchanged", "planned") for o in outcomes) else 1


# -- start | stop | restart | logs | uninstall: one Deployer method per node -------------------

START_HELP = "start the deployed fleetd on nodes"
STOP_HELP = "stop fleetd on nodes"
RESTART_HELP = "restart fleetd on nodes"
LOGS_HELP = "show the tail of fleetd's log on nodes"
UNINSTALL_HELP = "stop fleetd and remove its install directory on nodes"


def configure_lifecycle(p) -> None:
    _deploy_args(p)


def configure_logs(p) -> None:
    _deploy_args(p)
    p.add_argument("-n", "--lines", type=int, default=50, help="lines per node (default 50)")


def lifecycle_command(action: str) -> Callable[[argparse.Namespace], int]:
    """cmd_<action>(args): Deployer.<action> on every node, a table or --json of the outcomes."""

    def run(args) -> int:
        with _load(args) as fleet:
            deployer = Deployer(
                fleet,
                None,
                root=args.root,
                systemd=not args.no_systemd,
                service_user=args.service_user,
                python=args.python,
            )
            fn = getattr(deployer, action)
            result = fleet.map((lambda n: fn(n, args.lines)) if action == "logs" else fn)
        rows = {
            n.name: (v if not isinstance(v, Exception) else {"error": f"{type(v).__name__}: {v}"})
            for n, v in result.items()
        }
        if args.json:
            print(json.dumps(rows, indent=2))
        elif action == "logs":
            for node, v in rows.items():
                print(f"==> {node} {v.get('path', '')} <==".replace("  <", " <"))
                print("\n".join(v.get("lines", [])) or v.get("error") or "(nothing logged there yet)")
        else:
            Console().print(lifecycle_table(action, rows))
        return 0 if result.ok else 1

    run.__name__ = run.__qualname__ = f"cmd_{action}"
    return run


cmd_start = lifecycle_command("start")
cmd_stop = lifecycle_command("stop")
cmd_restart = lifecycle_command("restart")
cmd_logs = lifecycle_command("logs")
cmd_uninstall = lifecycle_command("uninstall")


# -- inventory ---------------------------------------------------------------------------------

INVENTORY_HELP = "print an Ansible inventory (YAML) for ansible/deploy.yml"


def configure_inventory(p) -> None:
    p.add_argument("nodes", type=Path, help="nodes file")
    p.epilog = NODES_FILE_HELP
    p.formatter_class = argparse.RawDescriptionHelpFormatter


def cmd_inventory(args) -> int:
    sys.stdout.write(inventory(Fleet.load(args.nodes)))
    return 0


# -- wheels ------------------------------------------------------------------------------------

WHEELS_HELP = "build the wheels deploy ships into DIR (for ansible/deploy.yml)"


def configure_wheels(p) -> None:
    p.add_argument("dir", type=Path, metavar="DIR", help="where to put the wheels (made if missing)")
    p.add_argument("--source", type=Path, help="project tree to build the wheel from (default: this one)")
    _ggml_lib_arg(p)


def cmd_wheels(args) -> int:
    """fleetctl wheels: the wheels deploy would ship, copied into DIR, and the ansible line to use them."""
    b = build(source=args.source, ggml_lib=args.ggml_lib)
    _warn("wheels", b.warning)
    try:
        args.dir.mkdir(parents=True, exist_ok=True)
        for f in b.files:
            shutil.copyfile(f, args.dir / f.name)
    finally:
        clean_build(b)
    libs = ", ".join(b.ggml_libs) or "no ggml libraries"
    print(f"{args.dir}: {len(b.files)} wheel(s), fleetd {b.version} (release {b.release}; {libs})")
    print(f"ansible-playbook ... -e fleetd_wheel_dir={args.dir.resolve()} -e fleetd_version={b.version}")
    return 0

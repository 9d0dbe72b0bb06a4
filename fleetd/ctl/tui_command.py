"""fleetctl tui: the Textual dashboard (tui/) over a nodes file."""

from __future__ import annotations

from fleetd.ctl.options import fleet_args, open_fleet

TUI_HELP = "live dashboard: nodes, rates and history, node detail, deploy, P2P switch, A/B runs"


def configure_tui(p) -> None:
    fleet_args(p, json_output=False)
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between polls of every node (default 1)",
    )
    p.add_argument(
        "--screenshot",
        metavar="PATH",
        help="where the s key writes SVG screenshots: a directory, or a file ending in "
        ".svg (default: the current directory)",
    )
    p.add_argument("--ab-rows", type=int, default=32, metavar="N", help="A/B screen: rows (default 32)")
    p.add_argument(
        "--ab-n-embd", type=int, default=1024, metavar="N", help="A/B screen: hidden size (default 1024)"
    )
    p.add_argument(
        "--ab-steps", type=int, default=5, metavar="N", help="A/B screen: steps per run (default 5)"
    )
    p.add_argument("--ab-model", metavar="GGUF", default="", help="A/B screen: model for the model workload")
    p.add_argument(
        "--no-local", action="store_true", help="A/B screen: no coordinator stage, every stage is a node"
    )


def cmd_tui(args) -> int:
    # Imported here: textual loads only for this command, not for every fleetctl call.
    from tui.app import FleetApp
    from tui.screens.ab import AbSettings

    ab = AbSettings(args.ab_rows, args.ab_n_embd, args.ab_steps, not args.no_local, args.ab_model)
    with open_fleet(args) as fleet:
        FleetApp(fleet, args.interval, ab, args.screenshot).run()
    return 0

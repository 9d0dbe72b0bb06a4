"""fleetctl tui: the Textual dashboard (tui/) over a nodes file."""

from __future__ import annotations

from fleetd.ctl.options import fleet_args, open_fleet
from fleetd.errors import FleetError

TUI_HELP = "live dashboard: nodes, command and byte rates, P2P switch, A/B runs"


def configure_tui(p) -> None:
    fleet_args(p)
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between polls of every node (default 1)")
    p.add_argument("--ab-rows", type=int, default=32, metavar="N", help="A/B screen: rows (default 32)")
    p.add_argument("--ab-n-embd", type=int, default=1024, metavar="N",
                   help="A/B screen: hidden size (default 1024)")
    p.add_argument("--ab-steps", type=int, default=5, metavar="N", help="A/B screen: steps per run (default 5)")
    p.add_argument("--no-local", action="store_true",
                   help="A/B screen: no coordinator stage, every stage is a node")


def cmd_tui(args) -> int:
    if args.json:
        raise FleetError("tui: --json does not apply here (try fleetctl status --json)")
    if not args.interval > 0:
        raise FleetError(f"--interval {args.interval:g}: must be above 0")
    for flag, value, least in (("--ab-rows", args.ab_rows, 1), ("--ab-n-embd", args.ab_n_embd, 1),
                               ("--ab-steps", args.ab_steps, 2)):
        if value < least:
            raise FleetError(f"{flag} {value}: must be at least {least}")
    # Imported here: textual loads only for this command, not for every fleetctl call.
    from tui.app import FleetApp
    from tui.screens.ab import AbSettings

    ab = AbSettings(args.ab_rows, args.ab_n_embd, args.ab_steps, not args.no_local)
    with open_fleet(args) as fleet:
        FleetApp(fleet, args.interval, ab).run()
    return 0

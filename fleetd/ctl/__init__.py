"""fleetctl, the operator's command line (entry point `fleetctl = fleetd.ctl:main`).

    main.py              the subcommand table, the parser, main()
    options.py           the nodes file and SSH flags every fleet subcommand shares
    control_commands.py  status, stats, p2p
    deploy_commands.py   deploy, start, stop, restart, logs, uninstall, inventory
    ab_commands.py       ab
    plan_command.py      plan (placement from the GGUF and the measured nodes)
    demo_command.py      demo (a local fleet; --keep leaves it running)
    tui_command.py       tui (the Textual dashboard in tui/)
    extra.py             the ctl extra (rich, textual, paramiko): one line when it is missing

It sits on the fleetd.fleet library, whose renderers it prints; nothing below imports it.
"""

import sys

from fleetd.ctl.extra import missing_ctl_package

try:
    from fleetd.ctl.main import main
except ModuleNotFoundError as exc:  # installed without the ctl extra (a node's fleetd)
    _missing = missing_ctl_package(exc)
    if _missing is None:
        raise

    def main(argv: list[str] | None = None) -> int:
        print(_missing, file=sys.stderr)
        return 1


__all__ = ["main"]

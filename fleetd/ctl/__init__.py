"""fleetctl, the operator's command line (entry point `fleetctl = fleetd.ctl:main`).

    main.py              the subcommand table, the parser, main()
    options.py           the nodes file and SSH flags every fleet subcommand shares
    control_commands.py  status, stats, p2p
    deploy_commands.py   deploy, start, stop, restart, logs, uninstall, inventory
    ab_commands.py       ab
    demo_command.py      demo (a local fleet; --keep leaves it running)
    tui_command.py       tui (the Textual dashboard in tui/)

It sits on the fleetd.fleet library, whose renderers it prints; nothing below imports it.
"""

from fleetd.ctl.main import main

__all__ = ["main"]

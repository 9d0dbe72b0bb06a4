"""fleetctl subcommands. Each registers itself with @command in fleetd.fleet.cli."""

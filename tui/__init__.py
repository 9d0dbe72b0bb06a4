"""fleetctl tui: the Textual dashboard. It talks only to fleetd.fleet, never to sockets."""

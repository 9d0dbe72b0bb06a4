"""FleetApp: the fleetctl tui dashboard. It holds the one Fleet handle; screens get it from here.

    FleetApp(Fleet.load("nodes.txt"), interval=1.0).run()
"""

from __future__ import annotations

from typing import ClassVar

from textual.app import App
from textual.binding import BindingType

from fleetd.fleet.node import Fleet
from tui.screens.ab import AbScreen, AbSettings
from tui.screens.dashboard import DashboardScreen


class FleetApp(App):
    CSS_PATH = "fleet.tcss"
    TITLE = "fleetd"
    BINDINGS: ClassVar[list[BindingType]] = [
        ("q", "quit", "Quit"),
        ("a", "show_ab", "A/B"),
    ]

    def __init__(self, fleet: Fleet, interval: float = 1.0, ab: AbSettings | None = None) -> None:
        super().__init__()
        self.fleet = fleet
        self.interval = interval
        self.ab_settings = ab or AbSettings()

    def on_mount(self) -> None:
        self.sub_title = f"{len(self.fleet)} node(s), polled every {self.interval:g}s"
        # Installed, so leaving the A/B screen keeps its last result for the next visit.
        self.install_screen(AbScreen(self.fleet, self.ab_settings), "ab")
        self.push_screen(DashboardScreen(self.fleet, self.interval))

    def action_show_ab(self) -> None:
        if not isinstance(self.screen, AbScreen):
            self.push_screen("ab")

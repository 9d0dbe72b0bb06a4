"""FleetApp: the fleetctl tui dashboard. It holds the one Fleet handle; screens get it from here.

    FleetApp(Fleet.load("nodes.txt"), interval=1.0).run()

Screens: the dashboard (always at the bottom; with a serving panel while a `fleetctl serve`
runs on this machine, or the one at `serve_url`), a node's detail (Enter), deploy and lifecycle
(d), A/B (a). `s` (and the command palette's Screenshot) writes an SVG of the current screen to
`screenshot` (a directory, or a file path ending in .svg), by default the current directory.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

from textual.app import App, SystemCommand
from textual.binding import BindingType
from textual.screen import Screen

from fleetd.fleet.node import Fleet
from tui.screens.ab import AbScreen, AbSettings
from tui.screens.dashboard import DashboardScreen


class FleetApp(App):
    """The dashboard app: polls the fleet, pushes the screens, writes screenshots where asked."""

    CSS_PATH = "fleet.tcss"
    TITLE = "fleetd"
    BINDINGS: ClassVar[list[BindingType]] = [
        ("q", "quit", "Quit"),
        ("a", "show_ab", "A/B"),
        ("s", "screenshot", "Screenshot"),
    ]

    def __init__(
        self,
        fleet: Fleet,
        interval: float = 1.0,
        ab: AbSettings | None = None,
        screenshot: str | Path | None = None,
        serve_url: str | None = None,
    ) -> None:
        super().__init__()
        self.fleet = fleet
        self.interval = interval
        self.serve_url = serve_url
        self.ab_settings = ab or AbSettings()
        self.screenshot_target = Path(screenshot) if screenshot is not None else Path.cwd()
        self.last_screenshot: Path | None = None

    def on_mount(self) -> None:
        self.sub_title = f"{len(self.fleet)} node(s), polled every {self.interval:g}s"
        # Installed, so leaving the A/B screen keeps its last result and history for the next visit.
        self.install_screen(AbScreen(self.fleet, self.ab_settings), "ab")
        self.push_screen(DashboardScreen(self.fleet, self.interval, self.serve_url))

    @property
    def dashboard(self) -> DashboardScreen | None:
        return next((s for s in self.screen_stack if isinstance(s, DashboardScreen)), None)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        board = self.dashboard
        if board is None:
            return
        yield SystemCommand(
            "Deploy", "Deploy fleetd to the nodes (the deploy screen, d)", board.action_show_deploy
        )
        yield SystemCommand("Node detail", "The selected node in detail (Enter)", board.action_show_node)
        yield SystemCommand(
            "P2P on every node",
            "Switch peer copy on every node that answers (P)",
            board.action_toggle_fleet_p2p,
        )
        yield SystemCommand(
            "Reset counters", "Zero the counters of every node, after asking (r)", board.action_reset_stats
        )
        yield SystemCommand("A/B", "Hub vs direct, synthetic or a model (a)", self.action_show_ab)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "show_ab" and isinstance(self.screen, AbScreen):
            return False  # already there: the footer does not offer it
        return True

    def action_show_ab(self) -> None:
        if not isinstance(self.screen, AbScreen):
            self.push_screen("ab")

    # -- screenshots -------------------------------------------------------------------------

    def screenshot_path(self) -> Path:
        """Where the next screenshot goes: the .svg file given, or a new name in the directory."""
        target = self.screenshot_target.expanduser()
        if target.suffix.lower() == ".svg":
            return target
        screen = type(self.screen).__name__.removesuffix("Screen").lower() or "screen"
        return target / f"fleetd-{screen}-{time.strftime('%Y%m%d-%H%M%S')}.svg"

    def action_screenshot(self, filename: str | None = None, path: str | None = None) -> None:
        self.deliver_screenshot(filename, path)

    def deliver_screenshot(
        self, filename: str | None = None, path: str | None = None, time_format: str | None = None
    ) -> str | None:
        """Textual's default delivers to ~/Downloads and fails without a reason when that does
        not exist: ours writes where the user asked and says where, or why not."""
        target = self.screenshot_path()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(self.export_screenshot(), encoding="utf-8")
        except OSError as exc:
            self.notify(f"screenshot not saved: {target}: {exc.strerror or exc}", severity="error")
            return None
        self.last_screenshot = target
        self.notify(f"screenshot saved to {target}")
        return str(target)

"""PeerToggle: the selected node's peer-copy (P2P) switch.

The screen sets `node_key`, `node_name`, `enabled` and `pending`; a user toggle (the `p` key
via the screen, or a click) posts `PeerToggle.Changed` and marks the switch pending until the
screen, having asked the node, sets the answer. Setting `enabled` never posts, so a poll that
refreshes it cannot echo back as a switch request.
"""

from __future__ import annotations

from rich.text import Text
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget


class PeerToggle(Widget):
    """The selected node's P2P switch: shows on/off/pending, posts Changed on a user toggle."""

    DEFAULT_CSS = """
    PeerToggle { height: 1; width: auto; }
    """

    node_key: reactive[str | None] = reactive(None)
    node_name = reactive("")
    enabled: reactive[bool | None] = reactive(None)  # None: down, unknown, or not served
    pending = reactive(False)

    class Changed(Message):
        """The user asked to switch P2P on `node_key` to `enabled`."""

        def __init__(self, toggle: PeerToggle, node_key: str, enabled: bool) -> None:
            super().__init__()
            self.toggle = toggle
            self.node_key = node_key
            self.enabled = enabled

        @property
        def control(self) -> PeerToggle:
            return self.toggle

    def render(self) -> Text:
        if self.node_key is None:
            return Text("P2P: no node selected", style="dim")
        if self.pending:
            state = Text("switching…", style="italic")
        elif self.enabled is None:
            state = Text("n/a", style="dim")
        else:
            state = Text("on", style="bold green") if self.enabled else Text("off", style="bold yellow")
        return Text.assemble(
            "P2P ", (self.node_name, "bold"), ": ", state, " ", ("  p: switch it · P: every node", "dim")
        )

    def toggle(self) -> bool:
        """Ask to flip the switch; False (and a bell) when there is nothing to flip yet."""
        if self.node_key is None or self.enabled is None or self.pending:
            self.app.bell()
            return False
        self.pending = True
        self.post_message(self.Changed(self, self.node_key, not self.enabled))
        return True

    def on_click(self) -> None:
        self.toggle()

"""The dashboard's widgets, one per module. They know nothing of SSH or fleetd: screens set their
attributes, and they report back with messages."""

from tui.history import Rates, rates_between
from tui.widgets.counters import Counters
from tui.widgets.history_panel import HistoryPanel
from tui.widgets.node_table import NodeRow, NodeTable
from tui.widgets.peer_toggle import PeerToggle
from tui.widgets.serving_panel import ServingPanel, ServingView

__all__ = [
    "Counters",
    "HistoryPanel",
    "NodeRow",
    "NodeTable",
    "PeerToggle",
    "Rates",
    "ServingPanel",
    "ServingView",
    "rates_between",
]

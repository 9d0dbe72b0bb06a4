"""#18's small things, each as the operator meets it: the tables say only what they know."""

from __future__ import annotations

from rich.console import Console

from fleetd.fleet.control_docs import P2pState
from fleetd.fleet.render import ab_verdict, p2p_table, stats_table


def text_of(renderable, width: int = 100) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_p2p_status_has_no_empty_was_column_and_a_switch_has_it():
    status = text_of(p2p_table({"a": P2pState(True), "b": P2pState(False)}))
    assert "Was" not in status
    switched = text_of(p2p_table({"a": P2pState(False, was=True), "b": P2pState(False, was=False)}))
    assert "Was" in switched


def test_a_down_node_in_stats_is_not_a_command():
    out = text_of(stats_table({"gone": OSError("refused")}))
    row = next(line for line in out.splitlines() if "gone" in line)
    cells = [c.strip() for c in row.strip("│ \n").split("│")]
    assert cells[:3] == ["gone", "", "down"]  # Node, Command (empty), Count


def _ab_doc(hub: list[float], direct: list[float], copies: int = 8) -> dict:
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"outputs_identical": True,
            "arms": {"hub": {"seconds_per_step": med(hub)},
                     "direct": {"seconds_per_step": med(direct), "node_peer_copies": copies}},
            "runs": [{"arm": "hub", "seconds_per_step": x} for x in hub]
                    + [{"arm": "direct", "seconds_per_step": x} for x in direct]}


def test_synthetic_ab_gives_a_speed_verdict_with_its_spread():
    assert "direct vs hub: x2.00 steps/s (faster beyond the spread of the runs)" in \
        ab_verdict(_ab_doc([0.2, 0.22], [0.1, 0.11])).plain
    assert "within the spread" in ab_verdict(_ab_doc([0.2, 0.1], [0.15, 0.12])).plain
    assert "the direct arm ran the hub path" in ab_verdict(_ab_doc([0.2, 0.2], [0.2, 0.2], copies=0)).plain

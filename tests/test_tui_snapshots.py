"""Snapshot tests (pytest-textual-snapshot) of every screen of fleetctl tui, at 80x24 and wider.

The screens are fed fixed answers: the dashboard's polling is stopped and `DashboardScreen.polled`
gets /v1/status and /v1/stats documents shaped as fleetd sends them (taken from a real daemon),
so every render is the same. The behaviour against a real fleet is tests/test_tui.py's.

Update after a deliberate change with `pytest tests/test_tui_snapshots.py --snapshot-update`,
look at the report, and commit tests/__snapshots__. The PNGs in docs/ are these SVGs:
`sed 's/<svg /<svg xml:space="preserve" /' X.svg | rsvg-convert -w 1200 -o docs/tui-X.png`.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("pytest_textual_snapshot")

from fleetd.fleet.control_docs import NodeStats, NodeStatus  # noqa: E402
from fleetd.fleet.node import Fleet  # noqa: E402
from fleetd.fleet.ssh import ControlUnreachable  # noqa: E402
from tui.app import FleetApp  # noqa: E402
from tui.screens.ab import AbScreen, synthetic_run  # noqa: E402
from tui.screens.dashboard import DashboardScreen  # noqa: E402
from tui.screens.deploy import DeployScreen  # noqa: E402
from tui.screens.node import NodeScreen  # noqa: E402

COMMANDS = (
    "ALLOC_BUFFER",
    "GET_ALIGNMENT",
    "BUFFER_GET_BASE",
    "SET_TENSOR",
    "GET_TENSOR",
    "GRAPH_COMPUTE",
    "HELLO",
    "COPY_TENSOR_TO",
    "PEER_BARRIER",
)
REASONS = ("disabled", "not_allowed", "unreachable", "refused", "write_rejected", "timeout")
POLLS = 40  # of history on every node


def status_doc(port: int, sessions: int, p2p: bool = True, allocated: int = 0) -> dict:
    total = 16 << 30
    return {
        "version": "0.1.0",
        "protocol": "7.0.0",
        "features": {"bits": 1, "peer_copy": True},
        "rpc": {"host": "0.0.0.0", "port": port},
        "devices": [{"index": 0, "name": "CPU", "kind": "cpu", "free": total - allocated, "total": total}],
        "started": 0.0,
        "uptime_seconds": 7384.0,
        "p2p": {"enabled": p2p, "served": True},
        "sessions": [
            {
                "id": i + 1,
                "peer": f"10.0.0.9:{41000 + i}",
                "started": 0.0,
                "age_seconds": 95.0 + i,
                "commands": 1200 * (i + 1),
                "request_bytes": 3 << 20,
                "response_bytes": 1 << 20,
            }
            for i in range(sessions)
        ],
    }


def stats_doc(i: int, scale: int, fallbacks: int = 0) -> dict:
    """The i-th poll of a node whose traffic rises and falls (a wave), so the history has a shape."""
    wave = (0, 1, 3, 6, 9, 12, 9, 6, 3, 1)
    done = sum(wave[k % len(wave)] for k in range(i + 1)) * scale
    commands = {c: {"count": 0, "request_bytes": 0, "response_bytes": 0} for c in COMMANDS}
    commands["HELLO"] = {"count": 2, "request_bytes": 66, "response_bytes": 72}
    commands["SET_TENSOR"] = {"count": done, "request_bytes": done * 65_536, "response_bytes": 0}
    commands["GET_TENSOR"] = {"count": done, "request_bytes": done * 320, "response_bytes": done * 16_384}
    commands["GRAPH_COMPUTE"] = {"count": done // 2, "request_bytes": done * 900, "response_bytes": done * 4}
    commands["COPY_TENSOR_TO"] = {"count": done // 2, "request_bytes": done * 600, "response_bytes": done * 8}
    return {
        "since": 1000.0,
        "total": {"commands": commands, "graph_computes": done // 2, "compute_seconds": done * 0.0021},
        "peer": {
            "copies_ok": done // 2,
            "bytes_pushed": done * 32_768,
            "bytes_confirmed": done * 32_768,
            "links_opened": 1,
            "fallbacks": {r: (fallbacks if r == "refused" else 0) for r in REASONS},
        },
        "sessions": [],
    }


@pytest.fixture(autouse=True)
def no_serve_to_find(tmp_path, monkeypatch):
    """The serving panel finds serves by their state files under $XDG_RUNTIME_DIR/fleetd: an empty
    one here, so a fleetctl serve running on this machine never shows in these pictures."""
    runtime = tmp_path / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))


def nodes_file(tmp_path):
    # Closed loopback ports: nothing answers, and the polls are stopped before they matter.
    path = tmp_path / "nodes.txt"
    path.write_text(
        "localhost rpc_port=9 control_port=9 name=gpu-a\n"
        "root@127.0.0.12:9 rpc_port=50052 name=gpu-b\n"
        "127.0.0.13:9 name=gpu-c\n"
    )
    return path


def make_app(tmp_path) -> FleetApp:
    return FleetApp(Fleet.load(nodes_file(tmp_path)), interval=1.0, screenshot=tmp_path)


async def all_done(pilot) -> None:
    """Until every worker (a cancelled one too: a thread runs to its end) has finished."""
    while any(not w.is_finished for w in pilot.app.workers):
        await pilot.pause(0.05)
    await pilot.pause(0.1)


async def feed(pilot) -> DashboardScreen:
    """Stop polling and give the dashboard fixed answers: two nodes up, one down."""
    app = pilot.app
    await pilot.pause()
    screen = app.screen
    assert isinstance(screen, DashboardScreen)
    screen._timer.stop()
    app.workers.cancel_all()
    # A poll that answered just before the cancel may still hand its answer over: let every
    # worker end and every answer land, then replace them all.
    await all_done(pilot)
    screen.samples.clear()
    screen._latencies.clear()
    screen._answered_at.clear()
    screen._poll_started.clear()  # the cancelled polls: none is hanging in these pictures
    for h in screen.histories.values():
        h.points.clear()
    t0 = 1000.0
    screen.clock = lambda: t0 + POLLS + 0.4  # ages as if the last answer came 0.4 s ago
    for i in range(POLLS):
        at = t0 + i + 1
        screen.polled(
            "0",
            NodeStatus.parse(status_doc(50052, 2, allocated=5 << 30)),
            NodeStats.parse(stats_doc(i, 40)),
            at,
            0.012,
        )
        screen.polled(
            "1",
            NodeStatus.parse(status_doc(50052, 1, p2p=False, allocated=9 << 30)),
            NodeStats.parse(stats_doc(i, 7, fallbacks=3)),
            at,
            0.034,
        )
    screen.polled("2", ControlUnreachable("ssh you@127.0.0.13:9: connection refused"), None, t0 + POLLS, 3.1)
    await pilot.pause()
    return screen


def test_dashboard_80x24(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path), terminal_size=(80, 24), run_before=feed)


def test_dashboard_160x40(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path), terminal_size=(160, 40), run_before=feed)


def test_node_screen(snap_compare, tmp_path):
    async def run_before(pilot):
        screen = await feed(pilot)
        node = NodeScreen(screen, "0")
        await pilot.app.push_screen(node)
        await pilot.pause()
        pilot.app.workers.cancel_all()  # the log comes from the line below, not from SSH
        await all_done(pilot)
        node._show_log(
            [f"2026-12-01 22:0{i}:00 fleetd.server INFO session {i} from 10.0.0.9 closed" for i in range(6)]
        )
        await pilot.pause()

    assert snap_compare(make_app(tmp_path), terminal_size=(100, 40), run_before=run_before)


def test_deploy_screen(snap_compare, tmp_path):
    async def run_before(pilot):
        screen = await feed(pilot)
        deploy = DeployScreen(screen.fleet, screen.nodes["1"])
        await pilot.app.push_screen(deploy)
        await pilot.pause()
        await pilot.press("t")  # the selected node, then all of them
        from fleetd.fleet.deploy import NodeOutcome

        for node, step in ((screen.nodes["0"], "health"), (screen.nodes["1"], "install")):
            deploy._step(node, step)
        deploy._deployed(
            [
                NodeOutcome(
                    "gpu-a",
                    "unchanged",
                    "0.1.0-3f2a9c1b7d4e",
                    "0.1.0-3f2a9c1b7d4e",
                    "0.1.0-3f2a9c1b7d4e already running",
                    {"check": "python 3.11, 40 GiB free, port ours"},
                ),
                NodeOutcome(
                    "gpu-b",
                    "rolled-back",
                    "0.1.0-3f2a9c1b7d4e",
                    "0.1.0-8e1d0a2b6c5f",
                    "health check failed, rolled back to 0.1.0-8e1d0a2b6c5f: no HELLO on port 50052",
                    {"check": "python 3.12, 112 GiB free, port ours", "upload": "1 wheel(s)"},
                ),
            ]
        )
        await pilot.pause()

    assert snap_compare(make_app(tmp_path), terminal_size=(100, 32), run_before=run_before)


AB_DOC = {
    "stages": 3,
    "layers": 6,
    "rows": 32,
    "n_embd": 1024,
    "steps": 5,
    "outputs_identical": True,
    "arms": {
        "hub": {
            "per_step": {
                "commands": {"SET_TENSOR": 2.0, "GET_TENSOR": 2.0},
                "request_bytes": 263_000,
                "response_bytes": 262_000,
            },
            "md5": "a5a99942213e0f",
            "seconds_per_step": 0.0089,
            "node_peer_copies": 0,
            "node_fallbacks": 0,
        },
        "direct": {
            "per_step": {
                "commands": {"SET_TENSOR": 1.0, "GET_TENSOR": 1.0, "COPY_TENSOR_TO": 1.0},
                "request_bytes": 132_000,
                "response_bytes": 131_000,
            },
            "md5": "a5a99942213e0f",
            "seconds_per_step": 0.0061,
            "node_peer_copies": 8,
            "node_fallbacks": 0,
        },
    },
    "runs": [
        {"arm": a, "seconds_per_step": s}
        for a, s in (("hub", 0.0090), ("direct", 0.0060), ("direct", 0.0062), ("hub", 0.0088))
    ],
}


def test_ab_screen(snap_compare, tmp_path):
    async def run_before(pilot):
        await feed(pilot)
        await pilot.press("a")
        screen = pilot.app.screen
        assert isinstance(screen, AbScreen)
        screen._finished(synthetic_run(copy.deepcopy(AB_DOC), {"rows": 32}, 0.0, 2.4, {}))
        doc = copy.deepcopy(AB_DOC)
        doc["arms"]["direct"]["node_peer_copies"] = 0
        screen._finished(synthetic_run(doc, {"rows": 32}, 0.0, 2.1, {"disabled": 12}))
        await pilot.pause()

    assert snap_compare(make_app(tmp_path), terminal_size=(100, 40), run_before=run_before)


def test_reset_asks_first(snap_compare, tmp_path):
    async def run_before(pilot):
        await feed(pilot)
        await pilot.press("r")
        await pilot.pause()

    assert snap_compare(make_app(tmp_path), terminal_size=(80, 24), run_before=run_before)


def test_node_screen_80x24(snap_compare, tmp_path):
    async def run_before(pilot):
        screen = await feed(pilot)
        node = NodeScreen(screen, "0")
        await pilot.app.push_screen(node)
        await pilot.pause()
        pilot.app.workers.cancel_all()
        await all_done(pilot)
        node._show_log(["2026-12-01 22:00:00 fleetd.server INFO session 1 from 10.0.0.9 closed"])
        await pilot.pause()
        # the devices table, stacked under the peer copies: every header readable at 80 columns
        node.query_one("#node-body").scroll_to_widget(node.query_one("#node-devices"), animate=False)
        await pilot.pause()
        assert node.query_one("#node-counters").has_class("narrow")

    assert snap_compare(make_app(tmp_path), terminal_size=(80, 24), run_before=run_before)

"""fleetctl tui against a real local fleet (two fleetd processes on loopback started by
fleetd.fleet.local, reached over plain HTTP) through a real Textual pilot.

pytest-asyncio is not a dependency, so each test runs its pilot scenario with asyncio.run.
Every wait is bounded: `settle` pauses the pilot in short steps until a condition holds or a
deadline passes, then the test's assert reports what the screen shows.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from fleetd import __version__
from fleetd.client import RpcClient
from fleetd.ctl import main
from fleetd.fleet.local import LocalFleet
from fleetd.fleet.node import Fleet
from fleetd.transport import free_port
from fleetd.transport.tcp import Timeout
from tui.app import FleetApp
from tui.screens.ab import AbScreen, AbSettings
from tui.screens.dashboard import DashboardScreen
from tui.widgets import NodeTable, PeerToggle

pytestmark = pytest.mark.timeout(60)

POLL_S = 0.2  # the dashboard's poll interval in these tests
WAIT_S = 10.0  # the most any condition may take to show up
SIZE = (140, 40)
BOUNDED = Timeout(connect=5.0, read=10.0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two fleetd processes for the whole module; tests leave P2P as they found it (on)."""
    with LocalFleet(2, tmp_path_factory.mktemp("tui-fleet")) as local:
        yield local.fleet


async def settle(pilot, condition, timeout: float = WAIT_S) -> bool:
    """Let the app run until `condition()` holds (True) or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await pilot.pause(0.05)
    return True


def cell(table: NodeTable, key: str, column: str) -> str:
    return str(table.get_cell(key, column))


def dashboard(app: FleetApp) -> DashboardScreen:
    assert isinstance(app.screen, DashboardScreen), app.screen
    return app.screen


def test_table_shows_both_nodes_up_with_their_versions(fleet):
    async def scenario():
        app = FleetApp(fleet, POLL_S)
        async with app.run_test(size=SIZE) as pilot:
            table = dashboard(app).query_one(NodeTable)
            keys = ["0", "1"]
            await settle(pilot, lambda: all(cell(table, k, "state") == "up" for k in keys))
            for key, node in zip(keys, fleet, strict=True):
                assert cell(table, key, "node") == node.name
                assert cell(table, key, "state") == "up"
                assert cell(table, key, "version") == __version__
                assert cell(table, key, "rpc") == f":{node.spec.rpc_port}"
                assert cell(table, key, "p2p") == "on"
            await pilot.press("q")
        assert app.return_code == 0

    asyncio.run(scenario())


def test_traffic_makes_the_counters_move(fleet):
    node = fleet[1]
    stop = threading.Event()

    def traffic():
        # Commands until told to stop (bounded by the test's own deadline below), so every
        # poll in the window sees new commands whatever the scheduling on a busy machine.
        with RpcClient(node.spec.rpc_endpoint, BOUNDED) as client:
            deadline = time.monotonic() + WAIT_S
            while not stop.is_set() and time.monotonic() < deadline:
                client.get_alignment()
                client.get_device_memory()
                time.sleep(0.01)

    async def scenario():
        app = FleetApp(fleet, POLL_S)
        async with app.run_test(size=SIZE) as pilot:
            screen = dashboard(app)
            table = screen.query_one(NodeTable)
            assert await settle(pilot, lambda: cell(table, "1", "commands") != "")
            before = int(cell(table, "1", "commands").replace(",", ""))
            sender = threading.Thread(target=traffic)
            sender.start()
            try:
                moved = await settle(pilot, lambda: (screen.samples["1"].rates is not None
                                                     and screen.samples["1"].rates.commands_per_s > 0))
                rates = screen.samples["1"].rates
                shown_rate = cell(table, "1", "commands_per_s")
                shown_bytes = cell(table, "1", "bytes_per_s")
            finally:
                stop.set()
                sender.join(WAIT_S)
            assert moved, f"rates stayed at {rates}"
            assert float(shown_rate.replace(",", "")) > 0
            assert rates.bytes_per_s > 0 and shown_bytes.endswith("/s") and not shown_bytes.startswith("0 B")
            after_settled = await settle(
                pilot, lambda: int(cell(table, "1", "commands").replace(",", "")) > before)
            assert after_settled, cell(table, "1", "commands")

    asyncio.run(scenario())


def test_p_switches_p2p_off_and_back_on_on_the_selected_node(fleet):
    async def scenario():
        app = FleetApp(fleet, POLL_S)
        async with app.run_test(size=SIZE) as pilot:
            screen = dashboard(app)
            table, toggle = screen.query_one(NodeTable), screen.query_one(PeerToggle)
            assert await settle(pilot, lambda: toggle.enabled is True)
            await pilot.press("down")  # select the second node
            assert await settle(pilot, lambda: toggle.node_key == "1" and toggle.enabled is True)
            second, first = fleet[1], fleet[0]

            await pilot.press("p")
            assert await settle(pilot, lambda: cell(table, "1", "p2p") == "off"), cell(table, "1", "p2p")
            assert second.p2p().enabled is False
            assert first.p2p().enabled is True  # only the selected node switched
            assert toggle.enabled is False and not toggle.pending

            await pilot.press("p")
            assert await settle(pilot, lambda: cell(table, "1", "p2p") == "on"), cell(table, "1", "p2p")
            assert second.p2p().enabled is True

    try:
        asyncio.run(scenario())
    finally:
        for node in fleet:  # whatever happened above, the next test gets P2P on
            node.set_p2p(True)


def test_r_resets_the_counters_on_every_node(fleet):
    for node in fleet:  # something to reset on each node
        with RpcClient(node.spec.rpc_endpoint, BOUNDED) as client:
            client.get_alignment()

    def commands(table: NodeTable, key: str) -> int | None:
        text = cell(table, key, "commands")
        return int(text.replace(",", "")) if text else None

    async def scenario():
        app = FleetApp(fleet, POLL_S)
        async with app.run_test(size=SIZE) as pilot:
            table = dashboard(app).query_one(NodeTable)
            assert await settle(pilot, lambda: all((commands(table, k) or 0) > 0 for k in ("0", "1")))
            await pilot.press("r")
            assert await settle(pilot, lambda: all(commands(table, k) == 0 for k in ("0", "1"))), \
                [cell(table, k, "commands") for k in ("0", "1")]

    asyncio.run(scenario())
    for node in fleet:  # the daemons agree: the polls themselves are control API, not RPC
        assert node.stats().total.command_count == 0


def test_a_node_that_does_not_answer_shows_down_with_its_reason(fleet, tmp_path):
    alive = fleet[0].spec
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"localhost rpc_port={alive.rpc_port} control_port={alive.control_port} name=alive\n"
                     f"localhost rpc_port={free_port()} control_port={free_port()} name=dead\n")
    with Fleet.load(nodes) as mixed:
        async def scenario():
            app = FleetApp(mixed, POLL_S)
            async with app.run_test(size=SIZE) as pilot:
                screen = dashboard(app)
                table = screen.query_one(NodeTable)
                assert await settle(pilot, lambda: cell(table, "1", "state") != "…")
                assert await settle(pilot, lambda: cell(table, "0", "state") == "up")
                assert cell(table, "1", "state") == "down"
                assert cell(table, "1", "version") == ""
                down = str(screen.query_one("#down").content)
                assert "dead: down: ControlUnreachable" in down
                assert "alive" not in down
                # Still polled, still down, the app still running: no traceback took it away.
                await pilot.pause(3 * POLL_S)
                assert app.is_running and cell(table, "1", "state") == "down"

        asyncio.run(scenario())


def test_ab_screen_runs_hub_and_direct_with_identical_outputs(fleet):
    async def scenario():
        app = FleetApp(fleet, POLL_S, AbSettings(rows=4, n_embd=64, steps=3))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("a")
            assert isinstance(app.screen, AbScreen)
            screen = app.screen
            await pilot.click("#ab-run")
            assert await settle(pilot, lambda: screen.result is not None
                                or "failed" in str(screen.query_one("#ab-state").content), 30)
            assert screen.result is not None, screen.query_one("#ab-state").content
            assert screen.result["outputs_identical"] is True
            assert set(screen.result["arms"]) == {"hub", "direct"}
            assert screen.result["arms"]["direct"]["node_peer_copies"] > 0
            assert str(screen.query_one("#ab-verdict").content) == "outputs of all runs: identical"
            await pilot.press("escape")
            assert isinstance(app.screen, DashboardScreen)

    asyncio.run(scenario())


def test_fleetctl_tui_rejects_bad_arguments(tmp_path, capsys):
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("localhost\n")
    assert main(["tui", str(nodes), "--interval", "0"]) == 1
    assert "--interval 0: must be above 0" in capsys.readouterr().err
    assert main(["tui", str(nodes), "--ab-steps", "1"]) == 1
    assert "--ab-steps 1: must be at least 2" in capsys.readouterr().err

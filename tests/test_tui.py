"""fleetctl tui against a real local fleet (two fleetd processes on loopback started by
fleetd.fleet.local, reached over plain HTTP) through a real Textual pilot.

pytest-asyncio is not a dependency, so each test runs its pilot scenario with asyncio.run.
Every wait is bounded: `settle` pauses the pilot in short steps until a condition holds or a
deadline passes, then the test's assert reports what the screen shows.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pytest
from rich.console import Console
from textual.widgets import RichLog

from fleetd import __version__
from fleetd.client import RpcClient
from fleetd.ctl import main
from fleetd.fleet.local import LocalFleet
from fleetd.fleet.node import Fleet
from fleetd.transport import free_port
from fleetd.transport.tcp import Timeout
from tui.app import FleetApp
from tui.screens.ab import AbScreen, AbSettings
from tui.screens.confirm import ConfirmScreen
from tui.screens.dashboard import DashboardScreen
from tui.screens.deploy import DeployScreen
from tui.screens.node import NodeScreen
from tui.widgets import NodeTable, PeerToggle

pytestmark = pytest.mark.timeout(60)

POLL_S = 0.2  # the dashboard's poll interval in these tests
WAIT_S = 10.0  # the most any condition may take to show up
SIZE = (140, 40)
BOUNDED = Timeout(connect=5.0, read=10.0)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Two fleetd processes for the whole module; tests leave P2P as they found it (on) and every
    process running."""
    with LocalFleet(2, tmp_path_factory.mktemp("tui-fleet")) as local:
        yield local


@pytest.fixture(scope="module")
def fleet(local):
    return local.fleet


def notes(app) -> str:
    """Every notification the app showed so far, one per line."""
    return "\n".join(str(n.message) for n in app._notifications)


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
            before = int(cell(table, "1", "commands").replace(" ", ""))
            sender = threading.Thread(target=traffic)
            sender.start()
            try:
                moved = await settle(
                    pilot,
                    lambda: (
                        screen.samples["1"].rates is not None and screen.samples["1"].rates.commands_per_s > 0
                    ),
                )
                rates = screen.samples["1"].rates
                shown_rate = cell(table, "1", "commands_per_s")
                shown_bytes = cell(table, "1", "bytes_per_s")
            finally:
                stop.set()
                sender.join(WAIT_S)
            assert moved, f"rates stayed at {rates}"
            assert float(shown_rate.replace(" ", "")) > 0
            assert rates.bytes_per_s > 0 and shown_bytes.endswith("/s") and not shown_bytes.startswith("0 B")
            after_settled = await settle(
                pilot, lambda: int(cell(table, "1", "commands").replace(" ", "")) > before
            )
            assert after_settled, cell(table, "1", "commands")
            # The history kept it: commands/s above 0 in the recent polls, and the row's sparkline.
            assert max(screen.histories["1"].series("commands_per_s")) > 0
            assert cell(table, "1", "history").strip() != ""

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
        return int(text.replace(" ", "")) if text else None

    async def scenario():
        app = FleetApp(fleet, POLL_S)
        async with app.run_test(size=SIZE) as pilot:
            table = dashboard(app).query_one(NodeTable)
            assert await settle(pilot, lambda: all((commands(table, k) or 0) > 0 for k in ("0", "1")))
            await pilot.press("r")
            assert isinstance(app.screen, ConfirmScreen)  # it asks first, naming the nodes
            assert (
                app.screen.question == f"Reset the counters of 2 node(s): {fleet[0].name}, {fleet[1].name}?"
            )
            await pilot.press("n")
            await pilot.pause(3 * POLL_S)
            assert all((commands(table, k) or 0) > 0 for k in ("0", "1"))  # "no" reset nothing
            await pilot.press("r", "y")
            assert await settle(pilot, lambda: all(commands(table, k) == 0 for k in ("0", "1"))), [
                cell(table, k, "commands") for k in ("0", "1")
            ]

    asyncio.run(scenario())
    for node in fleet:  # the daemons agree: the polls themselves are control API, not RPC
        assert node.stats().total.command_count == 0


def test_a_node_that_does_not_answer_shows_down_with_its_reason(fleet, tmp_path):
    alive = fleet[0].spec
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(
        f"localhost rpc_port={alive.rpc_port} control_port={alive.control_port} name=alive\n"
        f"localhost rpc_port={free_port()} control_port={free_port()} name=dead\n"
    )
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


def test_ab_screen_runs_keeps_a_history_and_exports_it(fleet, tmp_path):
    async def scenario():
        app = FleetApp(fleet, POLL_S, AbSettings(rows=4, n_embd=64, steps=3, rounds=3))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("a")
            assert isinstance(app.screen, AbScreen)
            screen = app.screen
            screen.export_dir = tmp_path
            await pilot.click("#ab-run")
            assert await settle(
                pilot,
                lambda: screen.result is not None or "failed" in str(screen.query_one("#ab-state").content),
                30,
            )
            assert screen.result is not None, screen.query_one("#ab-state").content
            assert screen.result["outputs_identical"] is True
            assert set(screen.result["arms"]) == {"hub", "direct"}
            assert screen.result["arms"]["direct"]["node_peer_copies"] > 0
            run = screen.history[-1]
            assert run.verdict.startswith("outputs identical; direct vs hub steps/s x")
            assert run.warning == ""  # the direct arm copied: no fallback warning
            # the form's rounds drive the synthetic run too (#18 item 9): 3 rounds, ABBA
            assert [arm for _, arm, _ in run.chart] == ["hub", "direct", "direct", "hub", "hub", "direct"]

            # Enter runs again (the footer says so); the old results dim until the new ones come.
            assert screen.query_one("#ab-run").has_focus
            await pilot.press("enter")
            assert screen.query_one("#ab-results").has_class("old") or len(screen.history) == 2
            assert await settle(pilot, lambda: len(screen.history) == 2, 30), screen.query_one(
                "#ab-state"
            ).content
            assert not screen.query_one("#ab-results").has_class("old")
            assert screen.query_one("#ab-history").row_count == 2

            await pilot.press("e")
            [export] = tmp_path.glob("fleetd-ab-*.json")
            runs = json.loads(export.read_text())
            assert [r["workload"] for r in runs] == ["synthetic", "synthetic"]
            assert runs[0]["result"]["outputs_identical"] is True

            await pilot.press("escape")
            assert isinstance(app.screen, DashboardScreen)

    asyncio.run(scenario())


def test_ab_reports_a_direct_arm_that_never_copied(fleet):
    async def scenario():
        app = FleetApp(fleet, POLL_S, AbSettings(rows=4, n_embd=64, steps=3))
        async with app.run_test(size=SIZE) as pilot:
            for node in fleet:  # the nodes refuse COPY_TENSOR_TO: the direct arm falls back
                node.set_p2p(False)
            await pilot.press("a")
            screen = app.screen
            await pilot.click("#ab-run")
            assert await settle(
                pilot, lambda: screen.history or "failed" in str(screen.query_one("#ab-state").content), 30
            )
            assert screen.history, screen.query_one("#ab-state").content
            run = screen.history[-1]
            assert not run.ok
            assert run.warning.startswith("the direct arm never copied peer to peer")

    try:
        asyncio.run(scenario())
    finally:
        for node in fleet:
            node.set_p2p(True)


def test_ab_model_workload_says_why_it_cannot_run(fleet, tmp_path):
    not_a_model = tmp_path / "m.gguf"
    not_a_model.write_bytes(b"not a gguf")

    async def scenario():
        app = FleetApp(fleet, POLL_S, AbSettings(model=str(tmp_path / "missing.gguf")))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("a")
            screen = app.screen
            screen.query_one("#workload").value = "model"
            await pilot.click("#ab-run")
            assert "no such file" in str(screen.query_one("#ab-state").content)
            screen.query_one("#model").value = str(not_a_model)
            await pilot.press("enter")  # the Run key, this time
            assert await settle(
                pilot, lambda: "A/B failed" in str(screen.query_one("#ab-state").content), 30
            ), screen.query_one("#ab-state").content
            assert not screen.history

    asyncio.run(scenario())


def test_stale_after_two_missed_intervals_and_up_again(local):
    proc, key = local.processes[1], "1"

    async def scenario():
        app = FleetApp(local.fleet, POLL_S)
        async with app.run_test(size=SIZE) as pilot:
            screen = dashboard(app)
            table = screen.query_one(NodeTable)
            assert await settle(pilot, lambda: cell(table, key, "state") == "up")
            assert cell(table, key, "latency").endswith("ms") and (
                cell(table, key, "seen") == "now" or cell(table, key, "seen").endswith("s")
            )
            os.kill(proc.pid, signal.SIGSTOP)  # it stops answering; its sockets stay open
            try:
                # Stale long before the control API's 30 s read timeout: two intervals.
                assert await settle(pilot, lambda: cell(table, key, "state") == "stale"), cell(
                    table, key, "state"
                )
                assert screen.is_stale(key)
                assert cell(table, "0", "state") == "up"
                assert cell(table, key, "seen").endswith("s")  # the age of its last answer
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert await settle(pilot, lambda: cell(table, key, "state") == "up"), cell(table, key, "state")

    try:
        asyncio.run(scenario())
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_fleet_wide_p2p_and_p_on_a_down_node_says_why(fleet, tmp_path):
    alive = fleet[0].spec
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(
        f"localhost rpc_port={alive.rpc_port} control_port={alive.control_port} name=alive\n"
        f"localhost rpc_port={free_port()} control_port={free_port()} name=dead\n"
    )
    with Fleet.load(nodes) as mixed:

        async def scenario():
            app = FleetApp(mixed, POLL_S)
            async with app.run_test(size=SIZE) as pilot:
                screen = dashboard(app)
                table = screen.query_one(NodeTable)
                assert await settle(
                    pilot, lambda: cell(table, "1", "state") == "down" and cell(table, "0", "state") == "up"
                )
                await pilot.press("down", "p")
                assert "dead is down, nothing switched: ControlUnreachable" in notes(app)
                await pilot.press("P")  # every node that can: alive only, dead named as skipped
                assert await settle(pilot, lambda: cell(table, "0", "p2p") == "off"), cell(table, "0", "p2p")
                assert mixed[0].p2p().enabled is False
                assert "P2P off on alive" in notes(app) and "skipped: dead is down" in notes(app)
                await pilot.press("P")
                assert await settle(pilot, lambda: cell(table, "0", "p2p") == "on"), cell(table, "0", "p2p")

        try:
            asyncio.run(scenario())
        finally:
            fleet[0].set_p2p(True)


def test_fleet_wide_p2p_switch_gives_one_notification_not_one_per_node(fleet):
    """#18 item 9: `P` on a fleet raises one popup with every node's answer."""

    async def scenario():
        app = FleetApp(fleet, POLL_S)
        async with app.run_test(size=SIZE) as pilot:
            table = dashboard(app).query_one(NodeTable)
            assert await settle(pilot, lambda: all(cell(table, k, "p2p") == "on" for k in ("0", "1")))
            before = len(app._notifications)
            await pilot.press("P")
            assert await settle(pilot, lambda: all(cell(table, k, "p2p") == "off" for k in ("0", "1")))
            await pilot.pause(0.3)
            new = [str(n.message) for n in list(app._notifications)[before:]]
            assert len(new) == 1, new
            assert new[0].startswith("P2P off on ") and all(n.name in new[0] for n in fleet), new
            assert [n.p2p().enabled for n in fleet] == [False, False]

    try:
        asyncio.run(scenario())
    finally:
        for node in fleet:
            node.set_p2p(True)


def test_80x24_keeps_the_essentials_without_horizontal_scroll(fleet):
    async def scenario():
        app = FleetApp(fleet, POLL_S)
        async with app.run_test(size=(80, 24)) as pilot:
            table = dashboard(app).query_one(NodeTable)
            assert await settle(pilot, lambda: cell(table, "1", "commands_per_s") != "")
            shown = {c.key for c in table.columns_shown}
            assert {"node", "state", "p2p", "commands_per_s", "bytes_per_s", "seen"} <= shown
            assert "version" not in shown  # given way at 80 columns
            assert table.virtual_size.width <= table.size.width, (table.virtual_size, table.size)
            await pilot.resize_terminal(160, 40)
            assert await settle(pilot, lambda: "version" in {c.key for c in table.columns_shown})
            assert cell(table, "0", "version") == __version__

    asyncio.run(scenario())


def test_node_screen_shows_one_node_in_detail(fleet):
    node = fleet[0]
    with RpcClient(node.spec.rpc_endpoint, BOUNDED) as client:
        client.get_alignment()

        async def scenario():
            app = FleetApp(fleet, POLL_S)
            async with app.run_test(size=SIZE) as pilot:
                table = dashboard(app).query_one(NodeTable)
                assert await settle(pilot, lambda: cell(table, "0", "state") == "up")
                await pilot.press("enter")
                assert isinstance(app.screen, NodeScreen)
                screen = app.screen
                assert await settle(pilot, lambda: "GET_ALIGNMENT" in text_of(screen, "#node-commands"))
                assert "devices" in text_of(screen, "#node-devices")
                sessions = text_of(screen, "#node-sessions")
                local = "{}:{}".format(*client.sock.getsockname()[:2])
                assert local in sessions  # our open RPC connection, by its address
                assert "fallbacks by reason" in text_of(screen, "#node-peer")
                # The log comes over the lifecycle path: a LocalFleet node was not deployed by fleetctl.
                assert await settle(pilot, lambda: screen.log_lines is not None)
                lines = screen.log_lines
                assert isinstance(lines, list) or "fleetd is not deployed here by fleetctl" in str(lines), (
                    lines
                )
                await pilot.press("escape")
                assert isinstance(app.screen, DashboardScreen)

        asyncio.run(scenario())


def test_deploy_screen_asks_before_changes_only_and_reports(fleet):
    async def scenario():
        app = FleetApp(fleet, POLL_S)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, lambda: cell(dashboard(app).query_one(NodeTable), "0", "state") == "up")
            await pilot.press("d")
            screen = app.screen
            assert isinstance(screen, DeployScreen)
            assert [n.name for n in screen.targets] == [fleet[0].name]  # the selected node first
            await pilot.press("t")
            assert [n.name for n in screen.targets] == [n.name for n in fleet]
            await pilot.press("S")
            assert isinstance(app.screen, ConfirmScreen) and fleet[1].name in app.screen.question
            await pilot.press("n")
            assert screen.results is None  # no stop without a yes
            await pilot.press("n")  # dry run: the same Deployer.plan as fleetctl deploy --dry-run
            assert app.screen is screen  # read-only: no question (#18 item 9)
            assert await settle(pilot, lambda: screen.outcomes is not None, 120)
            for o in screen.outcomes:  # their RPC ports are held by fleetd that fleetctl did not start
                assert o.status == "failed" and "which fleetctl did not deploy" in o.detail, o
            await pilot.press("L")
            assert app.screen is screen  # logs are read-only: no question either
            assert await settle(pilot, lambda: screen.results is not None, 60)
            # not deployed by fleetctl, but started by it (LocalFleet, --log-file): their logs
            for r in screen.results.values():
                assert "error" not in r and r["path"].endswith(".log") and r["lines"], r
            assert all(node.status() for node in fleet)  # still running

    asyncio.run(scenario())


def test_deploy_log_lines_wrap_at_80x24(fleet):
    """#18 item 6: a long deploy log line (a failure's reason) is read whole, not cropped."""

    async def scenario():
        app = FleetApp(fleet, POLL_S)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("d")
            screen = app.screen
            assert isinstance(screen, DeployScreen)
            log = screen.query_one("#deploy-log", RichLog)
            screen._log("n0: failed: " + "reason " * 30 + "END")
            await pilot.pause(0.2)
            lines = [strip.text for strip in log.lines]
            assert len(lines) > 1 and lines[-1].rstrip().endswith("END"), lines
            assert max(len(line.rstrip()) for line in lines) <= log.content_size.width, lines

    asyncio.run(scenario())


def test_screenshot_key_writes_svg_where_asked(fleet, tmp_path):
    async def scenario():
        target = tmp_path / "shots" / "dash.svg"
        app = FleetApp(fleet, POLL_S, screenshot=target)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("s")
            assert target.read_text().startswith("<svg") and app.last_screenshot == target
            app.screenshot_target = tmp_path / "afile"  # a file where a directory should be
            (tmp_path / "afile").write_text("")
            assert app.deliver_screenshot() is None  # what the command palette's Screenshot calls
            await pilot.pause()
            assert "screenshot not saved: " in notes(app), notes(app)

    asyncio.run(scenario())


def text_of(screen, selector: str) -> str:
    widget = screen.query_one(selector)
    console = Console(width=200, record=True)
    console.print(widget.content if hasattr(widget, "content") else widget.render())
    return console.export_text()


def test_fleetctl_tui_rejects_bad_arguments(tmp_path, capsys):
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("localhost\n")
    assert main(["tui", str(nodes), "--interval", "0"]) == 2
    assert "--interval 0: must be above 0" in capsys.readouterr().err
    assert main(["tui", str(nodes), "--ab-steps", "1"]) == 2
    assert "--ab-steps 1: must be at least 2" in capsys.readouterr().err


def test_seen_and_poll_tell_a_killed_node_from_a_frozen_one(tmp_path):
    """#18 item 5, real signals: SIGKILL one node, SIGSTOP the other. Seen is when a node last
    answered (a failed poll is no answer); Poll of a poll that hangs is its age so far."""
    with LocalFleet(2, tmp_path) as own:
        killed, frozen = own.processes

        async def scenario():
            app = FleetApp(own.fleet, POLL_S)
            async with app.run_test(size=SIZE) as pilot:
                screen = dashboard(app)
                table = screen.query_one(NodeTable)
                assert await settle(
                    pilot, lambda: cell(table, "0", "state") == "up" == cell(table, "1", "state")
                )
                killed.send_signal(signal.SIGKILL)
                frozen.send_signal(signal.SIGSTOP)
                try:
                    assert await settle(pilot, lambda: cell(table, "0", "state") == "down")
                    # down, and Seen keeps the age of its last answer instead of "now"
                    assert await settle(pilot, lambda: cell(table, "0", "seen") not in ("now", ""))
                    assert await settle(pilot, lambda: cell(table, "1", "latency").startswith(">"))
                    first = screen.hanging_poll_age("1")
                    await pilot.pause(4 * POLL_S)
                    assert screen.hanging_poll_age("1") > first  # it grows while the poll hangs
                    table.move_cursor(row=1)
                    await pilot.press("enter")
                    assert await settle(pilot, lambda: isinstance(app.screen, NodeScreen))
                    summary = lambda: str(app.screen.query_one("#node-summary").content)  # noqa: E731
                    assert await settle(pilot, lambda: "a poll has been waiting" in summary()), summary()
                    assert "now ago" not in summary()
                finally:
                    frozen.send_signal(signal.SIGCONT)

        asyncio.run(scenario())


def test_80x24_page_down_scrolls_and_the_footer_names_enter(fleet):
    """#18 item 6: below the fold at 80x24, PageDown scrolls with the node table focused, and
    Enter (node detail) is in the footer."""

    async def scenario():
        app = FleetApp(fleet, POLL_S)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = dashboard(app)
            table = screen.query_one(NodeTable)
            assert await settle(pilot, lambda: cell(table, "0", "state") == "up")
            assert app.focused is table
            box = screen.query_one("#counters-box")
            assert await settle(pilot, lambda: box.max_scroll_y > 0)  # something below the fold
            await pilot.press("pagedown")
            assert await settle(pilot, lambda: box.scroll_y > 0)
            await pilot.press("pageup")
            assert await settle(pilot, lambda: box.scroll_y == 0)
            shown = {b.binding.description for b in app.active_bindings.values() if b.binding.show}
            assert "Node" in shown, shown

    asyncio.run(scenario())


def test_history_panel_grows_to_every_series_when_the_first_points_come():
    """#18 item 6: the panel mounted empty ("no history yet", one line) kept that height and
    showed commands/s only, until a resize."""
    from textual.app import App

    from tui.history import History, Rates
    from tui.widgets.history_panel import LINES, HistoryPanel

    class One(App):
        def compose(self):
            yield HistoryPanel()

    async def scenario():
        app = One()
        async with app.run_test(size=(100, 20)) as pilot:
            panel = app.query_one(HistoryPanel)
            history = History()
            panel.history = history  # mounted before the first rate
            await pilot.pause(0.1)
            assert panel.size.height == 1
            for i in range(5):
                history.add(float(i), Rates(10.0 * i, 1000.0, 2000.0, 0.0))
                panel.history = history  # the same object, as the dashboard passes it
                await pilot.pause(0.05)
            await pilot.pause(0.1)
            assert panel.size.height == len(LINES), panel.size

    asyncio.run(scenario())

"""fleetctl tui against a real local fleet (two fleetd processes on loopback started by
fleetd.fleet.local, reached over plain HTTP) through a real Textual pilot.

pytest-asyncio is not a dependency, so each test runs its pilot scenario with asyncio.run.
Every wait is bounded: `settle` pauses the pilot in short steps until a condition holds or a
deadline passes, then the test's assert reports what the screen shows.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
from helpers import needs_tool
from rich.console import Console
from textual.widgets import RichLog

from fleetd import __version__
from fleetd.client import RpcClient
from fleetd.ctl import main
from fleetd.fleet.local import LocalFleet
from fleetd.fleet.node import Fleet
from fleetd.fleet.plan import Workload, read_model, split_plan
from fleetd.fleet.plan_probe import memory_only
from fleetd.fleet.serve import ServeConfig, Service
from fleetd.fleet.serve_control import ServeRecord, ServingRates, remove_state, write_state
from fleetd.fleet.server_load import completion_body
from fleetd.models import generate_named
from fleetd.tools import find_p2p_tool
from fleetd.transport import free_port
from fleetd.transport.tcp import Timeout
from tui.app import FleetApp
from tui.screens.ab import AbScreen, AbSettings
from tui.screens.confirm import ConfirmScreen
from tui.screens.dashboard import DashboardScreen
from tui.screens.deploy import DeployScreen
from tui.screens.node import NodeScreen
from tui.widgets import NodeTable, PeerToggle, ServingPanel, ServingView
from tui.widgets.serving_panel import StageLayers, serving_text

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


@pytest.fixture(autouse=True)
def own_runtime_dir(tmp_path, monkeypatch):
    """The serving panel finds serves by their state files under $XDG_RUNTIME_DIR/fleetd: every
    test gets a directory of its own, so a fleetctl serve running on this machine shows in none."""
    runtime = tmp_path / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


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
                assert cell(table, key, "seen").endswith("s")  # the age of its last answer
                # The other node is unaffected. On a loaded 2-core CI machine its own answer can
                # be late by two 0.2 s intervals too, so wait for it rather than read it once,
                # while node 1 stays stopped and so stays stale.
                assert await settle(pilot, lambda: cell(table, "0", "state") == "up"), cell(
                    table, "0", "state"
                )
                assert screen.is_stale(key) and cell(table, key, "state") == "stale"
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


def test_fleetctl_tui_rejects_a_serve_url_that_is_not_one(tmp_path, capsys):
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("localhost\n")
    assert main(["tui", str(nodes), "--serve-url", "localhost:8080"]) == 2
    assert "--serve-url localhost:8080: not an http://HOST:PORT URL" in capsys.readouterr().err
    assert main(["tui", str(nodes), "--serve-url", "http://127.0.0.1:99999"]) == 2
    assert "--serve-url http://127.0.0.1:99999: not a port" in capsys.readouterr().err


# -- the serving panel (#21 item 3): a real fleetctl serve over a local fleet ----------------------

SERVE_CTX = 512


def serving_line_fits(text: str, width: int) -> bool:
    return all(len(line) <= width for line in text.splitlines())


def test_serving_panel_gives_way_by_priority_and_folds_to_one_line():
    """Pure rendering: the prompt rate goes first, the URL and phase stay; one_line folds the
    layers into the first line where they fit, and drops them where they would say nothing."""
    url = "http://127.0.0.1:8080"
    view = ServingView(
        url,
        "serving",
        stages=(StageLayers("local-0", 0, 1), StageLayers("local-1", 1, 2, output=True)),
        rates=ServingRates(12.5, 1234.5, 41.25),
    )
    wide = serving_text(view, 120).plain.splitlines()
    assert wide == [
        f"Serve {url}  serving  12.5 req/s  prompt 1 234 t/s  decode 41.2 t/s",
        "layers local-0 0-0 (1) · local-1 1-1 (1) + output",
    ]
    narrow = serving_text(view, 62).plain.splitlines()[0]
    assert "prompt" not in narrow and "12.5 req/s" in narrow and "decode 41.2 t/s" in narrow
    assert serving_text(view, 40).plain.splitlines()[0] == f"Serve {url}  serving"
    folded = serving_text(view, 140, one_line=True).plain
    assert "\n" not in folded and folded.endswith("layers local-0 0-0 (1) · local-1 1-1 (1) + output")
    first_at_78 = serving_text(view, 78).plain.splitlines()[0]
    assert first_at_78 == f"Serve {url}  serving  12.5 req/s  decode 41.2 t/s"
    assert serving_text(view, 78, one_line=True).plain == first_at_78  # 10 cells left: no layers
    down = ServingView(url, "down", "node local-1 (localhost:1) does not answer: refused", view.stages)
    line = serving_text(down, 60).plain.splitlines()[0]
    assert line.startswith(f"Serve {url}  down: node local-1") and line.endswith("…") and len(line) == 60
    gone = serving_text(ServingView.not_running(url, "connection refused"), 80).plain
    assert gone == f"Serve {url}  not running: connection refused"


@pytest.fixture(scope="module")
def serve_model(tmp_path_factory):
    return generate_named("llama-q8_0", tmp_path_factory.mktemp("tui-serve-model"))


@pytest.fixture(scope="module")
def serve_fleet(tmp_path_factory):
    """Two fleetd of their own for the serves (the other tests' counters stay theirs)."""
    with LocalFleet(2, tmp_path_factory.mktemp("tui-serve-fleet"), server_args=["--threads", "1"]) as local:
        yield local


def one_layer_each(model, local: LocalFleet) -> dict:
    """A plan with one layer on each node (as tests/test_serve.py's, from the nodes' free memory
    only): both nodes serve, so the panel has two to show."""
    sizes = read_model(model)
    work = Workload(ctx=SERVE_CTX)
    doc = split_plan(sizes, memory_only(local.fleet), work, (0, 1), [1, 1]).as_dict()
    assert [s["layer_count"] for s in doc["stages"]] == [1, 1], doc["stages"]
    return doc


@contextmanager
def running_serve(model, local: LocalFleet):
    """serve.Service (the front, the supervisor, the patched llama-server) over `local`."""
    config = ServeConfig(
        model=model, port=0, threads=1, start_timeout=60, log_path=local.workdir / "llama-server.log"
    )
    service = Service(
        config, one_layer_each(model, local), read_model(model), exe=find_p2p_tool("llama-server")
    )
    with service.start():
        yield service


def post_completion(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("POST", "/completion", json.dumps(completion_body("the time of", 8)))
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def panel_text(app: FleetApp) -> str:
    text = dashboard(app).query_one(ServingPanel).text
    return "" if text is None else text.plain


@needs_tool("p2p/llama-server")
def test_serving_panel_shows_a_running_serve_its_layers_and_its_rates(serve_model, serve_fleet):
    with running_serve(serve_model, serve_fleet) as service:
        url = service.url
        answered: list[int] = []
        stop = threading.Event()

        def requests():
            # real /completion requests until the panel has seen some (bounded by WAIT_S)
            deadline = time.monotonic() + WAIT_S
            while not stop.is_set() and time.monotonic() < deadline:
                answered.append(post_completion(service.port))

        async def scenario():
            app = FleetApp(serve_fleet.fleet, POLL_S, serve_url=url)
            async with app.run_test(size=SIZE) as pilot:
                screen = dashboard(app)
                assert await settle(pilot, lambda: "serving" in panel_text(app)), panel_text(app)
                first, layers = panel_text(app).splitlines()
                assert first.startswith(f"Serve {url}  serving")
                assert layers == "layers local-0 0-0 (1) · local-1 1-1 (1) + output"
                sender = threading.Thread(target=requests)
                sender.start()
                try:
                    moved = await settle(
                        pilot,
                        lambda: (
                            screen.serving is not None
                            and screen.serving.rates is not None
                            and screen.serving.rates.requests_per_s > 0
                            and screen.serving.rates.decode_tps > 0
                        ),
                    )
                    shown = panel_text(app)
                finally:
                    stop.set()
                    sender.join(WAIT_S)
                assert moved, (screen.serving, answered)
                assert answered and set(answered) == {200}, answered
                req_s = shown.split("  serving  ", 1)[1].split(" req/s", 1)[0]
                assert float(req_s.replace(" ", "")) > 0, shown
                assert "prompt " in shown and "decode " in shown
                # 80x24: both lines, within the width; shorter: one line
                await pilot.resize_terminal(80, 24)
                panel = screen.query_one(ServingPanel)
                assert await settle(pilot, lambda: panel.size == (78, 2)), (panel.size, panel_text(app))
                assert serving_line_fits(panel_text(app), 78) and f"Serve {url}" in panel_text(app)
                await pilot.resize_terminal(80, 20)
                assert await settle(pilot, lambda: panel.size.height == 1), panel_text(app)
                assert serving_line_fits(panel_text(app), 78)

        asyncio.run(scenario())


@needs_tool("p2p/llama-server")
def test_serving_panel_finds_the_serve_on_this_machine_and_says_when_it_stopped(
    serve_model, serve_fleet, own_runtime_dir
):
    """No --serve-url: the panel finds the serve by its state file (as `fleetctl serve --stop`
    does), shows it, and once it has stopped says "not running", never a traceback; the
    dashboard with no serve to find has no panel at all."""
    # The state file names a live `fleetctl serve` process: a stand-in with "serve" in its
    # command line, since the Service runs inside this test's process.
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "serve"])
    try:
        with running_serve(serve_model, serve_fleet) as service:
            url = service.url
            record = ServeRecord(stand_in.pid, service.port, url, serve_model.name, "", time.time())
            write_state(record)

            async def scenario():
                app = FleetApp(serve_fleet.fleet, POLL_S)
                async with app.run_test(size=SIZE) as pilot:
                    panel = dashboard(app).query_one(ServingPanel)
                    assert await settle(pilot, lambda: "serving" in panel_text(app)), panel_text(app)
                    assert panel.display and panel_text(app).startswith(f"Serve {url}  serving")
                    service.stop()  # the front closes: the state file is still there
                    # a poll while it closes may read "connection reset by peer" first (a loaded host)
                    closed = f"Serve {url}  not running: connection refused"
                    assert await settle(pilot, lambda: panel_text(app) == closed), panel_text(app)
                    stand_in.kill()  # the process gone too: the file is stale, and removed
                    stand_in.wait(WAIT_S)
                    assert await settle(
                        pilot, lambda: "no fleetctl serve runs on this machine" in panel_text(app)
                    )
                    assert not (own_runtime_dir / "fleetd" / f"serve-{service.port}.json").exists()
                    assert panel_text(app).startswith(f"Serve {url}  not running")

            asyncio.run(scenario())
            remove_state(record)
    finally:
        stand_in.kill()
        stand_in.wait(WAIT_S)

    async def nothing_to_find():
        app = FleetApp(serve_fleet.fleet, POLL_S)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(3 * POLL_S)
            panel = dashboard(app).query_one(ServingPanel)
            assert not panel.display and panel.text is None and panel.size.height == 0

    asyncio.run(nothing_to_find())

"""#18's small things, each as the operator meets it: the tables say only what they know."""

from __future__ import annotations

from rich.console import Console

from fleetd.fleet.ab import abba
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
    return {
        "outputs_identical": True,
        "arms": {
            "hub": {"seconds_per_step": med(hub)},
            "direct": {"seconds_per_step": med(direct), "node_peer_copies": copies},
        },
        "runs": [{"arm": "hub", "seconds_per_step": x} for x in hub]
        + [{"arm": "direct", "seconds_per_step": x} for x in direct],
    }


def test_synthetic_ab_gives_a_speed_verdict_with_its_spread():
    assert (
        "direct vs hub: x2.00 steps/s (faster beyond the spread of the runs)"
        in ab_verdict(_ab_doc([0.2, 0.22], [0.1, 0.11])).plain
    )
    assert "within the spread" in ab_verdict(_ab_doc([0.2, 0.1], [0.15, 0.12])).plain
    one = ab_verdict(_ab_doc([0.2], [0.1])).plain  # --rounds 1: nothing to judge a spread by
    assert "x2.00" in one and "no spread" in one and "beyond" not in one, one
    never = ab_verdict(_ab_doc([0.2, 0.2], [0.1, 0.1], copies=0)).plain
    assert "the direct arm never copied" in never and "no speed verdict" in never and "x2.00" not in never


def test_status_shows_each_sessions_allocated_bytes_and_layers(fleetd_server, tmp_path):
    """#18 item 10: which node holds which layers, and how many bytes each session holds."""
    import json

    from helpers import endpoint

    from fleetd.client.graph import GraphBuilder
    from fleetd.client.rpc import RpcClient
    from fleetd.fleet.node import Fleet
    from fleetd.fleet.render import fmt_bytes, layer_ranges, sessions_table
    from fleetd.wire import GgmlType

    srv = fleetd_server(control_port=0)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"localhost rpc_port={srv.address[1]} control_port={srv.control.port} name=n\n")
    with RpcClient(endpoint(srv)) as c:
        handle, _ = c.alloc_buffer(1 << 16)
        base = c.buffer_get_base(handle)
        g = GraphBuilder()
        for i, layer in enumerate((3, 4, 5, 9)):
            t = g.tensor(GgmlType.F32, (16,), handle, base + 64 * i)
            t.name = f"blk.{layer}.attn_q.weight"
            c.set_tensor(t.rpc(), bytes(64))
        c.sync()
        (status,) = Fleet.load(nodes).map(lambda n: n.status()).values()
        (session,) = status.sessions
        assert session.allocated_bytes == 1 << 16 and session.layers == (3, 4, 5, 9)
        out = text_of(sessions_table({"n": status}), width=140)
        assert fmt_bytes(1 << 16) in out, out
        assert "3-5,9" in out
    assert layer_ranges([0, 1, 2, 7, 8, 11]) == "0-2,7-8,11" and layer_ranges([]) == ""
    json.dumps(status.doc)


def test_fleetctl_model_make_writes_the_same_model_everywhere(tmp_path, capsys):
    """#18 item 8: a test model without scripts/ (and without a download)."""
    import hashlib

    from gguf import GGUFReader

    from fleetd.ctl.main import main

    paths = []
    for d in ("a", "b"):
        assert main(["model", "make", "--arch", "llama", "--type", "q4_k", "--dir", str(tmp_path / d)]) == 0
        paths.append(capsys.readouterr().out.strip())
    first, second = (open(p, "rb").read() for p in paths)
    assert hashlib.sha256(first).digest() == hashlib.sha256(second).digest()
    reader = GGUFReader(paths[0])
    assert any(t.name.startswith("blk.0.") for t in reader.tensors)
    assert main(["model", "make", "--size", "huge", "--dir", str(tmp_path)]) == 2
    assert "unknown size 'huge'" in capsys.readouterr().err


def test_status_polls_are_counted_apart_from_the_nodes_commands(fleetd_server, tmp_path):
    """#18 item 9: every `fleetctl status` HELLOs the RPC port; that is a probe, not traffic."""
    import time

    from helpers import endpoint

    from fleetd.client.rpc import RpcClient
    from fleetd.ctl.control_commands import status_and_hello
    from fleetd.fleet.node import Fleet

    srv = fleetd_server(control_port=0)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"localhost rpc_port={srv.address[1]} control_port={srv.control.port} name=n\n")
    fleet = Fleet.load(nodes)
    for _ in range(3):
        fleet.map(status_and_hello).values()
    with RpcClient(endpoint(srv)) as c:  # a client's session: its HELLO is traffic
        c.alloc_buffer(4096)
    for _ in range(200):  # the server sees each close a moment after the client
        if not srv.state.live_sessions():
            break
        time.sleep(0.01)
    (stats,) = fleet.map(lambda n: n.stats()).values()
    total = stats.total
    assert total.commands["HELLO"].count == 1, total.commands["HELLO"]
    assert total.commands["ALLOC_BUFFER"].count == 1
    assert total.probe_connections >= 3


def test_abba_rounds_alternate_which_arm_goes_first():
    assert abba(1) == ("hub", "direct")
    assert abba(3) == ("hub", "direct", "direct", "hub", "hub", "direct")


def test_chart_title_keeps_underscores_and_the_y_axis_has_values():
    """#18 item 9: a model file's name keeps its underscores; each panel's axis says its scale."""
    import numpy as np
    import pytest

    from fleetd.fleet.chart import INK, render_bar_chart, y_ticks

    assert y_ticks(182) == [0, 50, 100, 150, 200]
    assert y_ticks(1234) == [0, 500, 1000, 1500]
    assert y_ticks(0.37) == pytest.approx([0, 0.1, 0.2, 0.3, 0.4])
    panels = {"decode tok/s": {"hub": (125.0, 120.0, 130.0), "direct": (182.0, 170.0, 190.0)}}

    def ink(img, rows, cols) -> int:
        return int((img[rows, cols] == INK).all(axis=-1).sum())

    underscored = render_bar_chart("a_b", panels)
    spaced = render_bar_chart("a b", panels)
    assert ink(underscored, slice(0, 30), slice(0, 80)) > ink(spaced, slice(0, 30), slice(0, 80))
    # left of the first panel's axis (x 16..60): the tick values, one per tick, nothing else
    label_column = ink(underscored, slice(60, 390), slice(16, 58))
    assert label_column > 5 * 10, label_column
    assert np.array_equal(underscored[:, 60:], spaced[:, 60:])  # the title is all that differs


def test_stats_watch_with_three_busy_nodes_fits_100x30_with_the_copies_table(fleetd_server, tmp_path):
    """#18 item 6: where the per-command view would overflow, one row per node, copies below."""
    from helpers import endpoint

    from fleetd.client.graph import GraphBuilder
    from fleetd.client.rpc import RpcClient
    from fleetd.ctl.control_commands import watch_view
    from fleetd.fleet.node import Fleet
    from fleetd.wire import GgmlType

    servers = [fleetd_server(control_port=0) for _ in range(3)]
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(
        "".join(
            f"localhost rpc_port={s.address[1]} control_port={s.control.port} name=node{i}\n"
            for i, s in enumerate(servers)
        )
    )

    def traffic(rounds: int) -> None:
        for srv in servers:
            with RpcClient(endpoint(srv)) as c:
                handle, _ = c.alloc_buffer(4096)
                base = c.buffer_get_base(handle)
                t = GraphBuilder().tensor(GgmlType.F32, (16,), handle, base).rpc()
                for _ in range(rounds):
                    c.set_tensor(t, bytes(64))
                    c.get_tensor(t)
                c.get_alignment()
                c.get_max_size()
                c.get_device_memory()
                c.buffer_clear(handle, 0)
                c.free_buffer(handle)

    fleet = Fleet.load(nodes)
    traffic(2)
    before = {n.name: v for n, v in fleet.map(lambda n: n.stats()).items()}
    traffic(5)
    after = {n.name: v for n, v in fleet.map(lambda n: n.stats()).items()}
    console = Console(width=100, height=30, record=True, color_system=None)
    view = watch_view(after, before, 2.0, console)
    lines = console.render_lines(view, console.options, pad=False)
    assert len(lines) < 30, len(lines)
    console.print(view)
    out = console.export_text()
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "peer copies (COPY_TENSOR_TO)" in out  # the copies table is on screen
    assert "BUFFER_CLEAR" not in out  # the per-command table would not have fit: the compact one
    for i in range(3):
        assert f"node{i}" in out
    assert "GET_TENSOR 5" in out and "SET_TENSOR 5" in out, out  # busiest since the sample before
    roomy = Console(width=100, height=200, record=True, color_system=None)
    roomy.print(watch_view(after, before, 2.0, roomy))
    assert "BUFFER_CLEAR" in roomy.export_text()  # where it fits: every command, as before


def test_every_fleetctl_option_says_what_it_does_and_help_names_only_real_devices():
    """#18 items 8 and 9: options without help text (demo --rows/--steps, logs -n), cuda:0 in
    --help although fleetd refuses it, via_netns undocumented."""
    import argparse

    from fleetd.ctl.main import NODES_FILE_HELP, build_parser
    from fleetd.device_names import DEVICE_NAMES

    _, parsers = build_parser()
    silent = []
    todo = list(parsers.items())
    while todo:
        name, parser = todo.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):  # lab up|down, model make: each theirs
                silent += [f"{name} {c.dest}" for c in action._choices_actions if not c.help]
                todo += [(f"{name} {sub}", p) for sub, p in action.choices.items()]
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                silent.append(f"{name} {action.option_strings or action.dest}")
    assert silent == []
    assert "cuda" not in NODES_FILE_HELP and "via_netns" in NODES_FILE_HELP
    assert all(d in NODES_FILE_HELP for d in DEVICE_NAMES)

"""The loopback control API of a real in-process daemon, over real HTTP (stdlib client).

/v1/status, /v1/stats (+ reset), /v1/p2p, /metrics parsed with prometheus_client's own parser
and checked against /v1/stats; bad requests get a JSON 4xx and the API keeps serving.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetd.client import RpcClient
from fleetd.server.control import MAX_BODY
from fleetd.server.stats import COMMAND_CODES
from fleetd.transport.tcp import Timeout
from fleetd.wire import Feature, GgmlType, RpcTensor, cmd_name, contiguous_strides

pytestmark = pytest.mark.timeout(60)

BOUNDED = Timeout(connect=5.0, read=30.0)


def api(srv, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.control.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, resp.getheader("Content-Type"), data
    finally:
        conn.close()


def get_json(srv, path: str) -> dict:
    status, ctype, data = api(srv, "GET", path)
    assert status == 200 and ctype == "application/json", data
    return json.loads(data)


def traffic(srv, nbytes: int = 4096) -> None:
    """HELLO, ALLOC_BUFFER, BUFFER_GET_BASE, SET_TENSOR, GET_TENSOR; then close and wait (bounded)
    until the session has folded its counters into the totals."""
    with RpcClient(f"127.0.0.1:{srv.address[1]}", BOUNDED) as c:
        ptr, _ = c.alloc_buffer(nbytes)
        base = c.buffer_get_base(ptr)
        ne = (nbytes // 4, 1, 1, 1)
        t = RpcTensor(
            id=1, type=GgmlType.F32, buffer=ptr, ne=ne, nb=contiguous_strides(GgmlType.F32, ne), data=base
        )
        data = np.arange(nbytes // 4, dtype=np.float32)
        c.set_tensor(t, data)
        assert bytes(c.get_tensor(t, 0, nbytes)) == data.tobytes()
    wait_sessions(srv, 0)


def wait_sessions(srv, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(srv.state.live_sessions()) != n:
        assert time.monotonic() < deadline, f"{len(srv.state.live_sessions())} sessions, expected {n}"
        time.sleep(0.01)


def metrics(srv) -> dict:
    """{(sample name, labels as a sorted tuple): value} from the Prometheus text."""
    status, ctype, data = api(srv, "GET", "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(data.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_status_lists_devices_sessions_and_p2p(fleetd_server):
    srv = fleetd_server(control_port=0)
    with RpcClient(f"127.0.0.1:{srv.address[1]}", BOUNDED) as c:
        c.device_count()  # answered: the session exists and has counted HELLO
        wait_sessions(srv, 1)
        st = get_json(srv, "/v1/status")
        local = "{}:{}".format(*c.sock.getsockname()[:2])
    assert st["protocol"] == "7.0.0"
    assert st["rpc"]["port"] == srv.address[1]
    assert st["features"] == {
        "bits": srv.state.features(),
        "peer_copy": True,
        "peer_copy_async": True,
        "peer_gate": True,
    }
    assert st["features"]["bits"] == Feature.ALL
    assert st["p2p"]["enabled"] is True
    assert [d["name"] for d in st["devices"]] == [d.name for d in srv.state.devices]
    assert all(0 < d["free"] <= d["total"] for d in st["devices"])
    assert st["uptime_seconds"] >= 0
    [session] = st["sessions"]
    assert session["peer"] == local
    assert session["commands"] >= 1 and session["request_bytes"] > 0 and session["response_bytes"] > 0


def test_metrics_parse_and_match_stats(fleetd_server):
    srv = fleetd_server(control_port=0)
    traffic(srv, 8192)
    stats = get_json(srv, "/v1/stats")
    m = metrics(srv)
    cmds = stats["total"]["commands"]
    assert set(cmds) == {cmd_name(c) for c in COMMAND_CODES}
    for name, v in cmds.items():  # every command has its series, zero or not
        lab = (("command", name),)
        assert m[("fleetd_rpc_commands_total", lab)] == v["count"]
        assert m[("fleetd_rpc_request_bytes_total", lab)] == v["request_bytes"]
        assert m[("fleetd_rpc_response_bytes_total", lab)] == v["response_bytes"]
    # What the client did, as the daemon counted it (SET_TENSOR: 9-byte header, 296-byte tensor,
    # cache flag, offset, then the data; GET_TENSOR answers an 8-byte size and the data).
    assert cmds["HELLO"]["count"] == 1 and cmds["SET_TENSOR"]["count"] == 1
    assert cmds["SET_TENSOR"]["request_bytes"] == 9 + 296 + 1 + 8 + 8192
    assert cmds["GET_TENSOR"]["response_bytes"] == 8 + 8192
    assert m[("fleetd_graph_computes_total", ())] == stats["total"]["graph_computes"]
    assert m[("fleetd_graph_compute_seconds_total", ())] == pytest.approx(
        stats["total"]["compute_seconds"], abs=1e-5
    )
    peer = stats["peer"]
    assert m[("fleetd_peer_copies_total", ())] == peer["copies_ok"]
    assert m[("fleetd_peer_pushed_bytes_total", ())] == peer["bytes_pushed"]
    for reason, n in peer["fallbacks"].items():
        assert m[("fleetd_peer_copy_fallbacks_total", (("reason", reason),))] == n
    assert m[("fleetd_sessions", ())] == 0
    assert m[("fleetd_p2p_enabled", ())] == 1


def test_stats_reset_zeroes_totals_and_metrics(fleetd_server):
    srv = fleetd_server(control_port=0)
    traffic(srv)
    assert get_json(srv, "/v1/stats")["total"]["commands"]["SET_TENSOR"]["count"] == 1
    status, _, data = api(srv, "POST", "/v1/stats/reset")
    assert status == 200 and json.loads(data)["reset"] is True
    after = get_json(srv, "/v1/stats")
    assert all(
        v == {"count": 0, "request_bytes": 0, "response_bytes": 0}
        for v in after["total"]["commands"].values()
    )
    assert after["since"] == json.loads(data)["since"]
    assert all(v == 0 for (name, _), v in metrics(srv).items() if name.startswith("fleetd_rpc_"))


def test_put_p2p_switches_the_daemon(fleetd_server):
    srv = fleetd_server(control_port=0)
    status, _, data = api(srv, "PUT", "/v1/p2p", b'{"enabled": false}', {"Content-Type": "application/json"})
    assert status == 200 and json.loads(data) == {
        "enabled": False,
        "served": True,
        "was": True,
        "peer_allow": ["127.0.0.0/8", "::1/128", "127.0.0.0/24"],  # the default: loopback + own /24
        "peer_allow_complete": True,
    }
    assert srv.state.p2p_enabled is False
    assert get_json(srv, "/v1/p2p")["enabled"] is False
    assert metrics(srv)[("fleetd_p2p_enabled", ())] == 0
    with RpcClient(f"127.0.0.1:{srv.address[1]}", BOUNDED) as c:  # new connections lose the bit
        assert not c.features & Feature.PEER_COPY
    status, _, data = api(srv, "PUT", "/v1/p2p", b'{"enabled": true}')
    assert status == 200 and json.loads(data)["was"] is False and srv.state.p2p_enabled is True


@pytest.mark.parametrize(
    "method, path, body, headers, code",
    [
        ("PUT", "/v1/p2p", b"nope", {}, 400),
        ("PUT", "/v1/p2p", b'{"enabled": "yes"}', {}, 400),
        ("PUT", "/v1/p2p", b'{"enabled": true, "x": 1}', {}, 400),
        ("PUT", "/v1/p2p", b"[true]", {}, 400),
        ("PUT", "/v1/p2p", b"x" * (MAX_BODY + 1), {}, 413),
        ("DELETE", "/v1/p2p", None, {}, 405),
        ("POST", "/v1/status", b"", {}, 405),
        ("GET", "/v2/anything", None, {}, 404),
        ("GET", "/v1/status", None, {"Origin": "http://evil.example"}, 403),
        ("GET", "/v1/status", None, {"Host": "evil.example:50152"}, 403),
    ],
)
def test_bad_requests_get_json_errors(fleetd_server, method, path, body, headers, code):
    srv = fleetd_server(control_port=0)
    status, ctype, data = api(srv, method, path, body, headers)
    assert status == code
    assert ctype == "application/json"
    err = json.loads(data)["error"]
    assert "Traceback" not in err and "\n" not in err
    assert srv.state.p2p_enabled is True  # nothing switched by a refused request
    assert get_json(srv, "/v1/status")["protocol"] == "7.0.0"  # still serving


def test_garbage_on_the_socket_gets_400_and_the_api_survives(fleetd_server):
    srv = fleetd_server(control_port=0)
    with socket.create_connection(("127.0.0.1", srv.control.port), timeout=10) as s:
        s.sendall(b"\x16\x03\x01 garbage garbage HTTP/1.1\r\n\r\n")
        answer = b""
        for _ in range(100):  # the server closes after its answer; bounded reads until then
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n", 1)[0]
    assert b'"error"' in answer
    assert get_json(srv, "/v1/status")["protocol"] == "7.0.0"


def test_binds_loopback_only_and_stops(fleetd_server):
    srv = fleetd_server(control_port=0)
    host, port = srv.control._httpd.server_address[:2]
    assert host == "127.0.0.1" and port == srv.control.port != 0
    srv.control.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_control_port_in_use_is_a_clear_error(fleetd_server):
    from fleetd.server import Server, ServerConfig

    a = fleetd_server(control_port=0)
    b = Server(ServerConfig(host="127.0.0.1", port=0, control_port=a.control.port))
    try:
        with pytest.raises(OSError, match=rf"control API 127.0.0.1:{a.control.port}: .*--control-port"):
            b.start()
    finally:
        b.stop()
    assert get_json(a, "/v1/status")["protocol"] == "7.0.0"

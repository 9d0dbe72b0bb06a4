"""The loopback control API: JSON status, stats and the P2P switch, plus Prometheus /metrics.

    GET  /v1/status        version, protocol and feature bits, devices, uptime, sessions, P2P
    GET  /v1/stats         per command count / request bytes / response bytes, graph computes,
                           compute seconds, peer copies and fallbacks; per session and in total
    POST /v1/stats/reset   zero every counter (live sessions and closed ones)
    GET  /v1/p2p           {"enabled": bool, "served": bool}
    PUT  /v1/p2p           body {"enabled": bool}: switch peer copy at runtime
    GET  /metrics          Prometheus text exposition from the daemon's own CollectorRegistry

/metrics (counters get `_total` on exposition; every command has a series from the start):
fleetd_rpc_commands_total{command}, fleetd_rpc_request_bytes_total{command},
fleetd_rpc_response_bytes_total{command}, fleetd_graph_computes_total,
fleetd_graph_compute_seconds_total, fleetd_peer_copies_total, fleetd_peer_pushed_bytes_total,
fleetd_peer_confirmed_bytes_total, fleetd_peer_links_opened_total,
fleetd_peer_copy_fallbacks_total{reason}, and the gauges fleetd_sessions, fleetd_p2p_enabled,
fleetd_uptime_seconds.

It binds 127.0.0.1 only: fleetctl and the TUI reach it through an SSH direct-tcpip channel, so a
node exposes nothing beyond its RPC port. A browser on the node is kept out too: a request with
an Origin header, or a Host header that is not a loopback name, gets 403 (DNS rebinding and
cross-site POSTs). Every failure is a JSON answer `{"error": "..."}` with a 4xx/5xx status.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetd import __version__
from fleetd.server.stats import COMMAND_CODES, CommandCounters
from fleetd.wire import PROTOCOL_VERSION, Feature, cmd_name
from fleetd.wire.text import client_text

if TYPE_CHECKING:
    from fleetd.server.state import ServerState

log = logging.getLogger("fleetd.control")

CONTROL_HOST = "127.0.0.1"
# Request bodies are tiny JSON objects ({"enabled": true}); anything bigger is a mistake.
MAX_BODY = 4096
# An idle keep-alive connection is dropped after this many seconds, so stop() leaves no reader.
IDLE_TIMEOUT = 30.0
# Exactly one loopback name and an optional port: "127.0.0.1:P, evil.com" is not one.
_LOOPBACK_HOST = re.compile(r"(127\.0\.0\.1|localhost|\[::1\])(:[0-9]{1,5})?", re.IGNORECASE)
_DIGITS = re.compile(r"[0-9]{1,18}")  # ASCII only: "²".isdigit() is True, int("²") fails


class HttpError(Exception):
    """A control API request refused: answered with `status` and {"error": message}."""

    def __init__(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


# -- the documents -----------------------------------------------------------------------------


def _bytes_moved(c: CommandCounters) -> tuple[int, int]:
    return sum(c.request_bytes.values()), sum(c.response_bytes.values())


def status_doc(state: ServerState) -> dict:
    """The /v1/status document: version, protocol, features, RPC address, devices, health, P2P
    and the open sessions."""
    now = time.time()
    features = state.features()
    sessions = []
    for s in sorted(state.live_sessions(), key=lambda s: s.id):
        counters = s.counters_now()
        rx, tx = _bytes_moved(counters)
        sessions.append(
            {
                "id": s.id,
                "peer": s.peer,
                "started": s.started,
                "age_seconds": round(now - s.started, 3),
                "commands": sum(counters.count.values()),
                "request_bytes": rx,
                "response_bytes": tx,
                # buffers this session holds, and the model layers whose weights it wrote there
                "allocated_bytes": state.registry.owned_bytes(s.id),
                "layers": sorted(s.layers),
            }
        )
    host, port = state.address[:2]
    return {
        "version": __version__,
        "pid": os.getpid(),  # which process answers: a supervisor's restart changes it
        "protocol": ".".join(map(str, PROTOCOL_VERSION)),
        "features": {
            "bits": int(features),
            "peer_copy": bool(features & Feature.PEER_COPY),
            "peer_copy_async": bool(features & Feature.PEER_COPY_ASYNC),
            "peer_gate": bool(features & Feature.PEER_GATE),
        },
        "rpc": {"host": host, "port": port},
        "devices": [
            {
                "index": i,
                "name": d.name,
                "kind": d.kind,
                "free": free,
                "total": total,
                "library": d.library,
                "fallback": d.fallback,
                "workers": d.worker_stats(),
            }
            for i, d in enumerate(state.devices)
            for free, total in [d.memory()]
        ],
        "started": state.started,
        # false while the RPC accept loop cannot accept (no fds, no threads, no memory)
        "healthy": state.unhealthy is None,
        "unhealthy_reason": state.unhealthy,
        "uptime_seconds": round(now - state.started, 3),
        "log_file": state.config.log_file,  # None: the supervisor's or the journal's
        "p2p": p2p_doc(state),
        "sessions": sessions,
    }


def stats_doc(state: ServerState, reset_at: float) -> dict:
    sessions = []
    for s in sorted(state.live_sessions(), key=lambda s: s.id):
        sessions.append({"id": s.id, "peer": s.peer, "started": s.started, **s.counters_now().as_dict()})
    return {
        "since": reset_at,
        "total": state.total_counters().as_dict(),
        "peer": state.peer_stats.as_dict() | {"held_bytes": state.peer_memory.held},
        "sessions": sessions,
    }


def p2p_doc(state: ServerState) -> dict:
    # "served": COPY_TENSOR_TO / PEER_BARRIER are in the command table (every fleetd serves
    # them); "enabled" is the runtime switch. Clients read both.
    # "peer_allow": where COPY_TENSOR_TO may push; "peer_allow_complete" is false for the
    # default policy on a wildcard bind, which also allows the subnet a client came in on.
    policy = state.peer_policy
    return {
        "enabled": bool(state.p2p_enabled),
        "served": True,
        "peer_allow": [str(n) for n in policy.networks],
        "peer_allow_complete": not (policy.default and state.config.host in ("0.0.0.0", "::", "")),
    }


# -- /metrics ----------------------------------------------------------------------------------


class FleetdCollector:
    """Reads the daemon's counters at scrape time (prometheus_client's custom collector).

    Label values come from closed sets only: command names and fallback reasons.
    """

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def describe(self) -> list[Metric]:
        return []  # no describe-time checks: the values are read at scrape time

    def collect(self) -> Iterator[Metric]:
        state = self.state
        total = state.total_counters()
        families = (
            ("fleetd_rpc_commands", "RPC commands served", total.count),
            ("fleetd_rpc_request_bytes", "RPC request bytes received, framing included", total.request_bytes),
            ("fleetd_rpc_response_bytes", "RPC response bytes sent, framing included", total.response_bytes),
        )
        for name, doc, values in families:
            fam = CounterMetricFamily(name, doc, labels=["command"])
            for c in COMMAND_CODES:  # zeros for every command: series exist before first use
                fam.add_metric([cmd_name(c)], values[c])
            yield fam
        yield CounterMetricFamily("fleetd_graph_computes", "graphs computed", value=total.graph_computes)
        yield CounterMetricFamily(
            "fleetd_graph_compute_seconds", "seconds spent computing graphs", value=total.compute_seconds
        )
        # PeerCounters totals; fallbacks by the closed reason set (FALLBACK_REASONS)
        peer = state.peer_stats.as_dict()
        yield CounterMetricFamily(
            "fleetd_peer_copies",
            "peer copies that landed (COPY_TENSOR_TO confirmed by PEER_BARRIER, "
            "COPY_TENSOR_TO_ASYNC staged by the destination)",
            value=peer["copies_ok"],
        )
        yield CounterMetricFamily(
            "fleetd_peer_copies_taken",
            "asynchronous copies whose push failed and whose bytes the client took (PEER_TAKE)",
            value=peer["copies_taken"],
        )
        yield CounterMetricFamily(
            "fleetd_peer_gates_failed",
            "PEER_GATEs answered 0: the session skipped commands until the client's PEER_RESUME",
            value=peer["gates_failed"],
        )
        yield GaugeMetricFamily(
            "fleetd_peer_held_bytes",
            "asynchronous copies' bytes held now (staged, queued, kept)",
            value=state.peer_memory.held,
        )
        yield CounterMetricFamily(
            "fleetd_peer_pushed_bytes",
            "bytes pushed to peers by COPY_TENSOR_TO, landed or not",
            value=peer["bytes_pushed"],
        )
        yield CounterMetricFamily(
            "fleetd_peer_confirmed_bytes",
            "bytes pushed to peers whose PEER_BARRIER answered 1",
            value=peer["bytes_confirmed"],
        )
        yield CounterMetricFamily(
            "fleetd_peer_links_opened", "connections opened to peers", value=peer["links_opened"]
        )
        fam = CounterMetricFamily(
            "fleetd_peer_copy_fallbacks",
            "peer copies that did not land (the client falls back), by reason",
            labels=["reason"],
        )
        for reason, n in peer["fallbacks"].items():
            fam.add_metric([reason], n)
        yield fam
        yield GaugeMetricFamily(
            "fleetd_sessions", "RPC connections open now", value=len(state.live_sessions())
        )
        yield GaugeMetricFamily(
            "fleetd_p2p_enabled", "1 when peer copy is switched on", value=int(state.p2p_enabled)
        )
        yield GaugeMetricFamily(
            "fleetd_uptime_seconds", "seconds since the daemon started", value=time.time() - state.started
        )


# -- HTTP --------------------------------------------------------------------------------------


Route = Callable[["ControlAPI", "_Handler"], tuple[HTTPStatus, dict]]


def _get_status(api: ControlAPI, req: _Handler):
    return HTTPStatus.OK, status_doc(api.state)


def _get_stats(api: ControlAPI, req: _Handler):
    return HTTPStatus.OK, stats_doc(api.state, api.reset_at)


def _post_stats_reset(api: ControlAPI, req: _Handler):
    req.read_body()  # an optional body is read and ignored
    api.reset_stats()
    return HTTPStatus.OK, {"reset": True, "since": api.reset_at}


def _get_p2p(api: ControlAPI, req: _Handler):
    return HTTPStatus.OK, p2p_doc(api.state)


def _put_p2p(api: ControlAPI, req: _Handler):
    body = req.read_json()
    enabled = body.get("enabled") if isinstance(body, dict) else None
    if not isinstance(enabled, bool) or set(body) != {"enabled"}:
        raise HttpError(HTTPStatus.BAD_REQUEST, 'PUT /v1/p2p: expected {"enabled": true|false}')
    was = bool(api.state.p2p_enabled)
    api.state.set_p2p(enabled)
    if was != enabled:
        log.info("control: P2P switched %s", "on" if enabled else "off")
    return HTTPStatus.OK, {**p2p_doc(api.state), "was": was}


ROUTES: dict[str, dict[str, Route]] = {
    "/v1/status": {"GET": _get_status},
    "/v1/stats": {"GET": _get_stats},
    "/v1/stats/reset": {"POST": _post_stats_reset},
    "/v1/p2p": {"GET": _get_p2p, "PUT": _put_p2p},
    "/metrics": {"GET": None},  # text, served by _Handler._metrics
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"fleetd/{__version__}"
    timeout = IDLE_TIMEOUT
    api: ControlAPI  # set on the subclass ControlAPI makes

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        try:
            self._check_origin()
            routes = ROUTES.get(path)
            if routes is None:
                raise HttpError(
                    HTTPStatus.NOT_FOUND, f"{method} {path}: no such resource (have: {', '.join(ROUTES)})"
                )
            if method not in routes:
                allow = ", ".join(routes)
                raise HttpError(
                    HTTPStatus.METHOD_NOT_ALLOWED,
                    f"{method} {path}: method not allowed (allowed: {allow})",
                    {"Allow": allow},
                )
            if path == "/metrics":
                self._send(HTTPStatus.OK, generate_latest(self.api.registry), CONTENT_TYPE_LATEST)
                return
            status, doc = routes[method](self.api, self)
            self._send_json(status, doc)
        except HttpError as exc:
            self._send_json(exc.status, {"error": str(exc)}, exc.headers)
        except (TimeoutError, ConnectionError) as exc:  # the client's doing: one line
            self.close_connection = True
            log.info(
                "control %s: %s %s: client gone or too slow: %s",
                self.address_string(),
                method,
                client_text(path),
                exc,
            )
        except Exception:
            log.exception("control: %s %s failed", method, client_text(path))
            self._send_json(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                {"error": f"{method} {path}: internal error, see the daemon log"},
            )

    def _check_origin(self) -> None:
        if self.headers.get("Origin") is not None:
            raise HttpError(HTTPStatus.FORBIDDEN, "control API: cross-origin requests refused")
        hosts = self.headers.get_all("Host") or []
        if len(hosts) > 1 or (hosts and not _LOOPBACK_HOST.fullmatch(hosts[0])):
            raise HttpError(
                HTTPStatus.FORBIDDEN,
                f"control API: Host {client_text(', '.join(hosts))!r} is not one loopback name[:port]",
            )

    def read_body(self) -> bytes:
        raw = self.headers.get("Content-Length")
        if raw is None:
            if self.headers.get("Transfer-Encoding"):
                raise HttpError(
                    HTTPStatus.LENGTH_REQUIRED,
                    "control API: chunked bodies not accepted, send Content-Length",
                )
            return b""
        if not _DIGITS.fullmatch(raw.strip()):
            raise HttpError(
                HTTPStatus.BAD_REQUEST, f"control API: Content-Length {client_text(raw)!r} is not a number"
            )
        n = int(raw)
        if n > MAX_BODY:
            self.close_connection = True  # the body stays unread
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"control API: body of {n} bytes over the {MAX_BODY}-byte limit",
            )
        body = self.rfile.read(n)
        if len(body) != n:
            self.close_connection = True
            raise HttpError(HTTPStatus.BAD_REQUEST, f"control API: body ended after {len(body)} of {n} bytes")
        return body

    def read_json(self):
        body = self.read_body()
        try:
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HttpError(
                HTTPStatus.BAD_REQUEST, f"{self.command} {self.path}: body is not JSON: {exc}"
            ) from exc
        except RecursionError:
            raise HttpError(
                HTTPStatus.BAD_REQUEST, f"{self.command} {self.path}: body nested too deeply"
            ) from None

    def _send_json(self, status: HTTPStatus, doc: dict, headers: dict[str, str] | None = None) -> None:
        self._send(status, (json.dumps(doc) + "\n").encode(), "application/json", headers)

    def _send(
        self, status: HTTPStatus, body: bytes, ctype: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error(self, code, message=None, explain=None) -> None:
        # The stdlib's own parse errors (bad request line, header too long): JSON, like ours.
        self.close_connection = True
        try:
            self._send_json(HTTPStatus(code), {"error": f"control API: {message or HTTPStatus(code).phrase}"})
        except OSError:
            pass

    def log_message(self, format: str, *args) -> None:
        log.debug("control %s: %s", self.address_string(), client_text(format % args, 200))


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        # socketserver prints a traceback to stderr; a client's timeout or reset is one line.
        exc = sys.exc_info()[1]
        if isinstance(exc, (TimeoutError, ConnectionError)):
            log.info("control %s: client gone or too slow: %s", client_address[0], exc)
        else:
            log.error("control %s: request failed: %r", client_address[0], exc, exc_info=exc)  # ours


class ControlAPI:
    """The HTTP server over one daemon's state. `port=0` picks a free port, read back from `.port`."""

    def __init__(self, state: ServerState, port: int) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"control API: port {port} outside 0..65535")
        self.state = state
        self.host = CONTROL_HOST  # never configurable: the API is reached through SSH
        self.requested_port = port
        self.port: int | None = None
        self.reset_at = time.time()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(FleetdCollector(state))
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<ControlAPI {self.host}:{self.port or self.requested_port}>"

    def start(self) -> None:
        """Bind the loopback port (an OSError that says which one) and serve it on a daemon thread."""
        handler = type("Handler", (_Handler,), {"api": self})
        try:
            self._httpd = _HTTPServer((self.host, self.requested_port), handler)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"control API {self.host}:{self.requested_port}: {exc.strerror} "
                "(another fleetd on this host? give each its own --control-port; 0 disables it)",
            ) from exc
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="fleetd-control",
            daemon=True,
        )
        self._thread.start()
        log.info("control API on http://%s:%d", self.host, self.port)

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None

    def reset_stats(self) -> None:
        self.state.reset_stats()
        self.reset_at = time.time()

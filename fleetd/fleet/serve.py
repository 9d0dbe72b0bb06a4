"""`fleetctl serve`: the patched llama-server over a fleet with a plan, behind a small HTTP front
that keeps the service up when a node dies.

    service = Service(ServeConfig(model, port=8080), plan_doc, nodes, say=print)
    with service.start(on_wait=show_last_line):  # binds the front, starts llama-server, /health
        service.url                                # http://127.0.0.1:8080, until stop()

Three parts around one lock:

- **the front** (`--port`, http.server's ThreadingHTTPServer): forwards every request to
  llama-server on an internal loopback port (http.client, the answer streamed back); while the
  service is not serving it answers 503 with a JSON reason and Retry-After at once; a request
  whose upstream fails in flight gets 502 naming the node. `GET /fleet/status` is its own.
- **the supervisor** (a thread): every `watch_interval` HELLO on each node of the plan and
  llama-server's exit status. On an outage: one line, llama-server stopped (the pinned RPC
  client has no reconnect: its next request would abort it), then HELLO with back-off until
  every node of the plan answers again (llama-server restarted with the same plan: the node's
  tensors are loaded again), or, `replan_after` seconds into the outage, a new plan without the
  nodes that are down when the rest hold the model. One line each time.
- **llama-server**: server_load.LlamaServer (start, wait for /health, stop).

Every wait is bounded: HELLO (PROBE_TIMEOUT), llama-server's start (`start_timeout`) and stop
(server_load.STOP_TIMEOUT_S), each upstream read (`request_timeout`).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from fleetd.client.rpc import RpcClient
from fleetd.errors import FleetdError, FleetError
from fleetd.fleet.node import Node
from fleetd.fleet.plan import PLAN_VERSION, Fleet, Link, ModelSizes, NodeFacts, PlanError, Workload, optimise
from fleetd.fleet.plan_probe import memory_only
from fleetd.fleet.server_load import HOST as UPSTREAM_HOST
from fleetd.fleet.server_load import STOP_TIMEOUT_S, LlamaServer
from fleetd.transport import TcpStream, Timeout, parse_endpoint

DEFAULT_PORT = 8080  # llama-server's own default
WATCH_INTERVAL_S = 1.0
PROBE_TIMEOUT = Timeout(connect=2.0, read=2.0)  # one HELLO; a node slower than this is down
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.25, 2.0  # HELLO polls while a node is down
DEFAULT_REPLAN_AFTER_S = 30.0
DEFAULT_START_TIMEOUT_S = 600.0  # a large model over slow links loads for minutes
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # per read from llama-server: a long generation
OUTAGE_STOP_GRACE_S = 1.0  # llama-server blocked on a dead node may not end on SIGTERM: then SIGKILL
EXIT_WAIT_S = 1.0  # how long a failed request waits for llama-server's exit status
RETRY_AFTER_S = 2
STATUS_PATH = "/fleet/status"
MONITORING_PATHS = {"/metrics", "/health", "/v1/health"}  # polls, not counted as requests
CHUNK = 64 << 10
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones http.client sets itself.
NOT_FORWARDED = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
LOADING, SERVING, DOWN, STOPPED = "loading", "serving", "down", "stopped"


@dataclass(frozen=True)
class ServeConfig:
    """What `fleetctl serve` runs: the model, where the front listens, the supervisor's bounds."""

    model: Path
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    replan_after: float = DEFAULT_REPLAN_AFTER_S  # 0: never, wait for the node
    threads: int | None = None  # llama-server's -t
    start_timeout: float = DEFAULT_START_TIMEOUT_S
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    watch_interval: float = WATCH_INTERVAL_S
    log_path: Path | None = None  # llama-server's output (appended); None: a temporary file


# -- the plan document -----------------------------------------------------------------------------


def check_plan(doc: object, model: ModelSizes) -> dict:
    """A plan file's document, checked against the model to serve; PlanError names what is wrong."""
    if not isinstance(doc, dict) or doc.get("version") != PLAN_VERSION:
        raise PlanError(f"not a plan file of version {PLAN_VERSION} (fleetctl plan --json)")
    if doc.get("fits") is not True:
        raise PlanError(f"the plan says the model does not fit: {doc.get('error', '?')}")
    args, stages = doc.get("llama_args"), doc.get("stages")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args) or not stages:
        raise PlanError("the plan has no llama_args or no stages")
    if not all(isinstance(s, dict) and {"name", "endpoint", "layers"} <= s.keys() for s in stages):
        raise PlanError("a stage of the plan lacks its name, endpoint or layers")
    n_layer = doc.get("model", {}).get("n_layer")
    if n_layer != model.n_layer:
        raise PlanError(f"the plan is for {n_layer} layers, {Path(model.path).name} has {model.n_layer}")
    return doc


def stage_lines(doc: dict) -> list[str]:
    """Per node of the plan: its name, endpoint and the layers it holds."""
    lines = []
    for s in doc["stages"]:
        first, stop = s["layers"]
        held = f"layers {first}-{stop - 1} ({stop - first})" if stop > first else "no layers"
        lines.append(f"{s['name']} {s['endpoint']}: {held}" + (" + output" if s.get("output") else ""))
    return lines


def llama_server_args(config: ServeConfig, doc: dict) -> list[str]:
    """The plan's flags for the model, with /metrics on (the serving panel reads it)."""
    threads = ["-t", str(config.threads)] if config.threads else []
    return ["-m", str(config.model), *doc["llama_args"], "--metrics", *threads]


def facts_from_plan(doc: dict) -> Fleet:
    """The measurements a plan file keeps (plan.measured_dict), as the optimiser takes them."""
    measured = doc.get("measured") or {}
    try:
        nodes = tuple(
            NodeFacts(
                **dict(
                    n,
                    upload=Link(**n["upload"]),
                    download=Link(**n["download"]),
                    decode_profile=tuple(tuple(x) for x in n.get("decode_profile", ())),
                )
            )
            for n in measured.get("nodes", [])
        )
        index = {n.name: i for i, n in enumerate(nodes)}
        peers = {
            (index[p["from"]], index[p["to"]]): Link(**p["link"]) if p["link"] else None
            for p in measured.get("peers", [])
        }
    except (KeyError, TypeError) as exc:
        raise PlanError(f"the plan's measurements are incomplete: {exc}") from exc
    if not nodes:
        raise PlanError("the plan keeps no measurements of the nodes")
    return Fleet(nodes, peers, tuple(measured.get("notes", ())))


def replan(model: ModelSizes, doc: dict, nodes: Sequence[Node], down: set[str]) -> dict:
    """A new plan without the nodes in `down`: the plan's measured speeds and links, each other
    node's free memory asked now. DoesNotFit (a PlanError) when the rest cannot hold the model."""
    measured = facts_from_plan(doc)
    keep = [i for i, f in enumerate(measured.nodes) if f.name not in down]
    names = {measured.nodes[i].name for i in keep}
    fresh = {f.name: f for f in memory_only([n for n in nodes if n.name in names]).nodes}
    keep = [i for i in keep if measured.nodes[i].name in fresh]
    if not keep:
        raise PlanError("no other node to plan for")
    kept = [measured.nodes[i] for i in keep]
    facts = tuple(replace(f, free=fresh[f.name].free, total=fresh[f.name].total) for f in kept)
    new_index = {old: new for new, old in enumerate(keep)}
    peers = {
        (new_index[a], new_index[b]): link
        for (a, b), link in measured.peers.items()
        if a in new_index and b in new_index
    }
    work = Workload(ctx=doc["ctx"], parallel=doc["parallel"])
    return optimise(model, Fleet(facts, peers, measured.notes), work).as_dict()


# -- the watch ---------------------------------------------------------------------------------------


def hello_problem(endpoint: str, timeout: Timeout = PROBE_TIMEOUT) -> str | None:
    """None when the RPC server at `endpoint` answers HELLO within `timeout`, else why not."""
    client = RpcClient(endpoint, timeout)
    try:
        client.open()
        return None
    except (FleetdError, OSError, ValueError) as exc:
        return f"no HELLO answer ({type(exc).__name__}: {exc})"
    finally:
        try:
            client.close()
        except (FleetdError, OSError):
            pass  # the answer (or its absence) is what counts


class NodeWatch:
    """One node of the plan, watched on a connection of its own: HELLO once, then GET_ALIGNMENT
    at each check (one session for the whole service, so no log lines on the node per check; a
    killed node fails the next check at once, a frozen one after PROBE_TIMEOUT). A node that
    advertises no fleetd feature may be a stock ggml-rpc-server, which serves one client at a
    time: a kept connection would lock llama-server out, so it is watched by TCP connect only
    (refused: down). Opened before llama-server connects; thread-safe."""

    def __init__(self, name: str, endpoint: str) -> None:
        self.name, self.endpoint = name, endpoint
        self.connect_only = False
        self._closed = False
        self._client: RpcClient | None = None
        self._lock = threading.Lock()

    def check(self) -> str | None:
        """None while the node answers, else why not (the connection is dropped, and reopened at
        the next check)."""
        with self._lock:
            if self._closed:
                return None  # a watch of a plan no longer served
            try:
                self._check()
                return None
            except (FleetdError, OSError, ValueError) as exc:
                self._close()
                return f"no answer ({type(exc).__name__}: {exc})"

    def _check(self) -> None:
        if self.connect_only:
            TcpStream.connect(parse_endpoint(self.endpoint), PROBE_TIMEOUT.connect, self.endpoint).close()
        elif self._client is not None:
            self._client.get_alignment(0)
        else:
            self._client = RpcClient(self.endpoint, PROBE_TIMEOUT)
            self._client.open()
            if not self._client.features:
                self.connect_only = True
                self._close()

    def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except (FleetdError, OSError):
                pass  # a node that is gone closes nothing

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._close()


def exit_text(code: int) -> str:
    """An exit status as a person reads it: "exit 1", "SIGABRT"."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


@dataclass
class FrontCounters:
    """What the front answered since it started: forwarded (any status from llama-server; not
    the MONITORING_PATHS), failed in flight (502) and refused while not serving (503)."""

    forwarded: int = 0
    failed: int = 0
    unavailable: int = 0


@dataclass
class _State:
    phase: str = LOADING
    reason: str = "loading the model"
    since: float = field(default_factory=time.monotonic)
    restarts: int = 0
    replans: int = 0


class Unavailable(Exception):
    """The service is not serving right now; the message says why (the 503's reason)."""


class _Stopping(Exception):
    """Raised inside llama-server's start wait when the service stops meanwhile."""


class Service:
    """llama-server over the fleet with `plan`, behind the front, watched by the supervisor.

    `nodes` (the nodes file's) are asked for their free memory when a replan is due; `say`
    gets one line per event (an outage, a restart, a replan)."""

    def __init__(
        self,
        config: ServeConfig,
        plan: dict,
        model: ModelSizes,
        *,
        exe: Path,
        nodes: Sequence[Node] = (),
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.config, self.model, self.exe = config, model, exe
        self.nodes = list(nodes)
        self.counters = FrontCounters()
        self.port = config.port
        self._plan = plan
        self._say = say or (lambda line: None)
        self._state = _State()
        self._lock = threading.Lock()  # _state, _plan, _server, counters, the server's log
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._server: LlamaServer | None = None
        self._watches: list[NodeWatch] = []
        self._front: _Front | None = None
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def plan(self) -> dict:
        with self._lock:
            return self._plan

    @property
    def phase(self) -> str:
        with self._lock:
            return self._state.phase

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, on_wait: Callable[[str], None] | None = None) -> Service:
        """Bind the front, start llama-server and wait for /health, start the supervisor. A
        FleetError (port taken, llama-server not ready) after everything is stopped again."""
        try:
            self._bind()
            self._start_server(on_wait)
            self._spawn(self._supervise, "serve-supervisor")
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> Service:
        return self if self._front else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the supervisor, the front and llama-server; safe to call twice."""
        self._stopping.set()
        self._wake.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()  # each of their waits is bounded (module docstring)
        if self._front is not None:
            self._front.server_close()
        self._drop_server()
        for watch in self._watches:
            watch.close()
        with self._lock:
            self._state = replace(self._state, phase=STOPPED, reason="fleetctl serve stopped")

    def _bind(self) -> None:
        try:
            self._front = _Front((self.config.host, self.config.port), self)
        except OSError as exc:
            raise FleetError(f"port {self.config.port} on {self.config.host}: {exc.strerror or exc}") from exc
        self.port = self._front.server_address[1]
        self._spawn(self._serve_front, "serve-front")

    def _serve_front(self) -> None:
        front = self._front
        assert front is not None
        stopper = threading.Thread(target=lambda: (self._stopping.wait(), front.shutdown()), daemon=True)
        stopper.start()
        front.serve_forever(poll_interval=0.2)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _start_server(self, on_wait: Callable[[str], None] | None) -> None:
        def waiting(line: str) -> None:
            if self._stopping.is_set():
                raise _Stopping()
            if on_wait is not None:
                on_wait(line)

        self._watch(self.plan)
        env = dict(os.environ, GGML_NO_BACKTRACE="1")  # an abort exits at once (no debugger attached)
        server = LlamaServer(
            self.exe,
            llama_server_args(self.config, self.plan),
            env,
            "serve",
            self.config.start_timeout,
            log_path=self.config.log_path,
            on_wait=waiting,
        )
        try:
            server.__enter__()
        except _Stopping:
            raise FleetError("fleetctl serve stopped while llama-server started") from None
        with self._lock:
            self._server = server
            self._state = replace(self._state, phase=SERVING, reason="", since=time.monotonic())

    def _watch(self, plan: dict) -> None:
        """Watches for the plan's nodes, opened before llama-server connects (NodeWatch); a node
        that does not answer now fails the start."""
        for watch in self._watches:
            watch.close()
        self._watches = [NodeWatch(s["name"], s["endpoint"]) for s in plan["stages"]]
        for watch in self._watches:
            problem = watch.check()
            if problem is not None:
                raise FleetError(f"node {watch.name} ({watch.endpoint}) does not answer: {problem}")

    def _drop_server(self, grace: float = STOP_TIMEOUT_S) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop(grace)

    # -- the supervisor ----------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            if self.phase == SERVING:
                problem = self._find_problem()
                if problem is not None:
                    self._mark_outage(problem)
                    continue
                self._wake.wait(self.config.watch_interval)
                self._wake.clear()
            else:
                self._recover()

    def _find_problem(self, exit_wait: float = 0.0) -> str | None:
        """A node of the plan that does not answer HELLO (named), else llama-server's exit."""
        for watch in self._watches:
            problem = watch.check()
            if problem is not None:
                return f"node {watch.name} ({watch.endpoint}) does not answer: {problem}"
        with self._lock:
            server = self._server
        if server is None:
            return None
        deadline = time.monotonic() + exit_wait
        while (code := server.exit_code()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if code is None:
            return None
        with self._lock:
            last = server.last_line()
        return f"llama-server exited ({exit_text(code)}): {last}"

    def _mark_outage(self, problem: str) -> None:
        with self._lock:
            if self._state.phase != SERVING or self._stopping.is_set():
                return
            self._state = replace(self._state, phase=DOWN, reason=problem, since=time.monotonic())
        seconds = self.config.replan_after
        after = f"; a new plan without it after {seconds:g}s" if seconds else ""
        self._say(f"{problem}: answering 503 until it is back{after}")
        self._wake.set()

    def _recover(self) -> None:
        """Stop llama-server, then poll with back-off until the plan's nodes answer (restart) or
        a replan is due (restart without the nodes that are down)."""
        self._drop_server(OUTAGE_STOP_GRACE_S)  # its requests in flight cannot finish: fail them now
        with self._lock:
            began = self._state.since
        delay, replan_tried = BACKOFF_FIRST_S, False
        while not self._stopping.is_set():
            down = {s["name"] for s in self.plan["stages"] if hello_problem(s["endpoint"]) is not None}
            if not down:
                if self._restart("every node of the plan answers again", began):
                    return
            elif self._replan_due(began) and not replan_tried:
                replan_tried = True
                if self._replan(down) and self._restart(f"new plan without {', '.join(sorted(down))}", began):
                    return
            self._stopping.wait(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    def _replan_due(self, began: float) -> bool:
        after = self.config.replan_after
        return after > 0 and time.monotonic() - began >= after

    def _replan(self, down: set[str]) -> bool:
        names = ", ".join(sorted(down))
        try:
            doc = replan(self.model, self.plan, self.nodes, down)
        except (PlanError, FleetdError, OSError) as exc:
            self._say(f"no new plan without {names}: {exc}; waiting for {names}")
            return False
        with self._lock:
            self._plan = doc
            self._state = replace(self._state, replans=self._state.replans + 1)
        self._say(f"new plan without {names}: " + "; ".join(stage_lines(doc)))
        return True

    def _restart(self, why: str, began: float) -> bool:
        with self._lock:
            self._state = replace(self._state, phase=LOADING, reason=f"restarting llama-server: {why}")
        self._say(f"{why}: restarting llama-server")
        try:
            self._start_server(None)
        except FleetError as exc:
            with self._lock:
                self._state = replace(self._state, phase=DOWN, reason=f"llama-server did not start: {exc}")
            if not self._stopping.is_set():
                self._say(f"llama-server did not start: {exc}")
            return False
        with self._lock:
            self._state = replace(self._state, restarts=self._state.restarts + 1)
        self._say(f"serving again at {self.url}, {time.monotonic() - began:.1f}s after the outage began")
        return True

    # -- what the front asks -------------------------------------------------------------------

    def upstream_port(self) -> int:
        """llama-server's loopback port while serving; Unavailable (the reason) otherwise."""
        with self._lock:
            if self._state.phase == SERVING and self._server is not None:
                return self._server.port
            self.counters.unavailable += 1
            s = self._state
            down_for = f" (down for {time.monotonic() - s.since:.1f}s)" if s.phase == DOWN else ""
        raise Unavailable(s.reason + down_for)

    def explain_failure(self, exc: BaseException) -> str:
        """Why a request to llama-server failed in flight: the node that does not answer, or
        llama-server's exit; marks the outage so the supervisor acts at once."""
        if self._stopping.is_set():
            return "fleetctl serve is stopping"
        with self._lock:
            self.counters.failed += 1
            if self._state.phase != SERVING:
                return self._state.reason
        problem = self._find_problem(exit_wait=EXIT_WAIT_S)
        if problem is None:
            return f"llama-server closed the connection ({type(exc).__name__}: {exc})"
        self._mark_outage(problem)
        return problem

    def count_forwarded(self, path: str) -> None:
        if path.split("?", 1)[0] in MONITORING_PATHS:
            return
        with self._lock:
            self.counters.forwarded += 1

    def status(self) -> dict:
        """The service as `GET /fleet/status` answers it (and the TUI's serving panel reads)."""
        with self._lock:
            s, plan, c = self._state, self._plan, self.counters
            return {
                "phase": s.phase,
                "reason": s.reason,
                "for_s": round(time.monotonic() - s.since, 3),
                "url": self.url,
                "restarts": s.restarts,
                "replans": s.replans,
                "requests": {"forwarded": c.forwarded, "failed": c.failed, "unavailable": c.unavailable},
                "stages": [
                    {k: st.get(k) for k in ("name", "endpoint", "layers", "layer_count", "output")}
                    for st in plan["stages"]
                ],
            }


# -- the front --------------------------------------------------------------------------------------


class _Front(ThreadingHTTPServer):
    daemon_threads = True  # a request in flight never holds up the stop
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], service: Service) -> None:
        self.service = service
        super().__init__(address, _Handler)


def error_body(status: int, message: str) -> bytes:
    """llama-server's own error shape, so clients read ours the same way."""
    kind = "unavailable_error" if status in (502, 503) else "invalid_request_error"
    return json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Front

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        pass  # llama-server logs the requests; the supervisor says what matters

    def do_GET(self) -> None:
        if self.path == STATUS_PATH:
            self._answer(200, json.dumps(self.server.service.status()).encode())
        else:
            self._forward()

    def do_POST(self) -> None:
        self._forward()

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = do_POST

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _request_body(self) -> bytes | None:
        """The request's body (None when empty); ValueError for one we do not take."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise ValueError("send the request body with a Content-Length, not chunked")
        length = int(self.headers.get("Content-Length") or 0)  # ValueError when not a number
        if length < 0:
            raise ValueError(f"Content-Length {length}")
        return self.rfile.read(length) if length > 0 else None

    def _forward(self) -> None:
        service = self.server.service
        try:
            body = self._request_body()
        except ValueError as exc:
            self.close_connection = True  # the body's end is unknown
            self._answer(400, error_body(400, str(exc)))
            return
        try:
            port = service.upstream_port()
        except Unavailable as exc:
            self._answer(503, error_body(503, str(exc)), {"Retry-After": str(RETRY_AFTER_S)})
            return
        conn = http.client.HTTPConnection(UPSTREAM_HOST, port, timeout=service.config.request_timeout)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in NOT_FORWARDED}
            conn.request(self.command, self.path, body, headers)
            upstream = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            self._answer(502, error_body(502, service.explain_failure(exc)))
            return
        try:
            self._relay(upstream)
            service.count_forwarded(self.path)
        except (OSError, http.client.HTTPException) as exc:
            # headers already sent: the status cannot change; cut the answer short, say why once
            service.explain_failure(exc)
            self.close_connection = True
        finally:
            conn.close()

    def _relay(self, upstream: http.client.HTTPResponse) -> None:
        self.send_response(upstream.status, upstream.reason)
        length = upstream.getheader("Content-Length")
        no_body = self.command == "HEAD" or upstream.status in (204, 304) or 100 <= upstream.status < 200
        for k, v in upstream.getheaders():
            if k.lower() not in NOT_FORWARDED or (k.lower() == "content-length" and length):
                self.send_header(k, v)
        chunked = not no_body and length is None
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if no_body:
            return
        while data := upstream.read1(CHUNK):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            self.wfile.flush()
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

"""A node killed while `fleetctl serve` answers a closed loop of requests, in the lab (issue 21's
"must show"): the node's fleetd runs under a supervisor that starts it again as systemd does in
production, the coordinator reaches the nodes over rated links.

    sudo .venv/bin/python benchmarks/serve_fault_lab.py --rounds 3

Setup: a lab of 3 nodes (`fleetd.fleet.lab`: coordinator links --coordinator-link 200mbit, peer
links --peer-link 2gbit), each fleetd supervised with --restart 1 s (`Lab.up(restart_s=...)`: the
deploy's unit has Restart=always, RestartSec=2, StartLimitBurst=10 in 60 s; 1 s here keeps the
rounds short, and the bound below is counted from the node's return, not from the kill). The
model is generated (`fleetd.models`, --model llama-q8_0-wide12: 12 layers, 62 MB). The plan is
llama.cpp's even split in the nodes file's order, measured on the lab's nodes as `fleetctl plan`
measures (`plan_probe.measure`, `plan.split_plan`), so every node serves 4 layers (the
optimiser would put a model this small on one node, and a node that holds nothing would be no
fault). Then the real command, a subprocess:

    fleetctl serve MODEL lab/nodes.txt --plan plan.json --port P --threads 1

and --clients (4) threads in a closed loop, each POSTing /completion (--n-predict 32, greedy)
with a --timeout (60 s) per request and pausing 0.1 s after an answer other than 200.

Each round: after --kill-after seconds of answers, SIGKILL one node's fleetd (`Lab.kill_fleetd`;
round 1 the middle node of the plan, then the next ones in turn); its supervisor starts it again
after restart_s; the round ends once the service has answered 200 again --settle times. Per
request: start, end, status, and the reason in the body of an answer other than 200. Per round:

- in flight: the requests started before the kill and answered after it, by status; each one
  that failed (and each that failed after the kill while serve still believed it was serving)
  must be 502 with the killed node's name in its reason; how long after the kill the last of
  them failed: at once when llama-server's next command goes to the dead node (it aborts), up
  to ~2 s when it is waiting for a PEER_GATE answer from the node after it (that node waits up
  to fleetd's peer wait, 10 s, for the copy from the dead one; serve's watch sees the node gone
  within 1 s and SIGKILLs llama-server after a 1 s SIGTERM grace);
- 503: how many were answered during the outage and the longest one (answered at once: no hang);
- kill -> the node's control API answers again with a new pid (restart_s + fleetd's start);
- node back -> the first 200 (answered), against the bound; kill -> first 200 (the outage);
- any request that took longer than --timeout (must be none).

The bound, node back -> first 200 answered: BOUND_S = 10 s. It is serve's longest HELLO poll gap
in an outage (BACKOFF_MAX_S, 2 s: the polls back off 0.25 s doubling to 2 s), plus llama-server's
start with the same plan (the whole model uploaded again over the 200 Mbit/s links: ~2.5 s for
62 MB, with llama-server's own start ~3 s), plus the first request's generation (~0.5 s for 32
tokens here), with slack for two cores shared with everything else. The benchmark asserts only
correctness: that the failures in flight name the node, that no request outlived its timeout,
and that the service answered again at all (within --recovery-limit); the bound and the numbers
are reported, a violation of correctness is printed and exits 1.

Writes benchmarks/results/serve_fault_lab.json (every request, serve's lines, the supervisors'
lines). Needs root, the patched llama-server (scripts/build-llama-p2p.sh). About 1-2 min.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, show  # noqa: E402

from fleetd.client import RpcClient  # noqa: E402
from fleetd.errors import FleetdError, FleetError  # noqa: E402
from fleetd.fleet.lab import Lab, fmt_rate, parse_rate  # noqa: E402
from fleetd.fleet.node import Fleet as NodeFleet  # noqa: E402
from fleetd.fleet.plan import Workload, even_counts, read_model, split_plan  # noqa: E402
from fleetd.fleet.plan_probe import measure  # noqa: E402
from fleetd.fleet.serve import BACKOFF_MAX_S  # noqa: E402
from fleetd.fleet.server_load import completion_body  # noqa: E402
from fleetd.models import generate_named  # noqa: E402
from fleetd.transport import Timeout, free_port  # noqa: E402

BOUND_S = 10.0  # node back (control API) -> the service's first 200 answered; see the docstring
REPO = Path(__file__).resolve().parents[1]
PROMPT = "the time of their first new"
CTX = 512
SERVE_START_S = 180.0  # fleetctl serve: plan read, llama-server loaded, URL printed
SERVE_STOP_S = 60.0
NODE_BACK_LIMIT_S = 60.0  # kill -> the control API answers with a new pid (restart_s + start)
POLL_S = 0.05
PAUSE_AFTER_FAILURE_S = 0.1  # a client that got 503 (or 502) asks again after this
LOOP_LIMIT = 50_000  # requests in the whole run, at most
HELLO_TIMEOUT = Timeout(connect=1.0, read=1.0)


@dataclass
class Request:
    client: int
    start: float  # seconds since the run began (monotonic)
    end: float
    status: int  # 0: no HTTP answer (the exception is the reason)
    reason: str  # the error body's message, for an answer other than 200
    text_md5: str  # of the generated text, for a 200

    @property
    def took(self) -> float:
        return self.end - self.start


class ClosedLoop:
    """`clients` threads each sending the next /completion as soon as the last was answered
    (PAUSE_AFTER_FAILURE_S after one that was not 200), until stop(), LOOP_LIMIT requests or
    `seconds`; every answer recorded."""

    def __init__(self, port: int, t0: float, clients: int, n_predict: int, timeout: float, seconds: float):
        self.port, self.t0, self.timeout = port, t0, timeout
        self.body = json.dumps(completion_body(PROMPT, n_predict))
        self.deadline = time.monotonic() + seconds
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def __enter__(self) -> ClosedLoop:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    def _one(self, client: int) -> Request:
        start = self.now()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/completion", self.body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
            status = response.status
        except (OSError, http.client.HTTPException) as exc:
            return Request(client, start, self.now(), 0, f"{type(exc).__name__}: {exc}", "")
        finally:
            conn.close()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = {}
        if status == 200:
            text = str(doc.get("content", ""))
            return Request(client, start, self.now(), 200, "", hashlib.md5(text.encode()).hexdigest())
        error = doc.get("error") if isinstance(doc, dict) else None
        reason = error.get("message", "") if isinstance(error, dict) else raw[:300].decode(errors="replace")
        return Request(client, start, self.now(), status, reason, "")

    def _client(self, client: int) -> None:
        while not self._stop.is_set() and time.monotonic() < self.deadline:
            with self._lock:
                if len(self.requests) >= LOOP_LIMIT:
                    return
            r = self._one(client)
            with self._lock:
                self.requests.append(r)
            if r.status != 200:
                self._stop.wait(PAUSE_AFTER_FAILURE_S)

    def wait_for(self, what, seconds: float) -> Request | None:
        """The first recorded request for which `what` holds (by start), waiting at most `seconds`."""
        end = time.monotonic() + seconds
        while True:
            hits = [r for r in self.snapshot() if what(r)]
            if hits:
                return min(hits, key=lambda r: r.start)
            if time.monotonic() >= end:
                return None
            time.sleep(POLL_S)


# -- the lab and the plan -------------------------------------------------------------------------


def even_plan(model: Path, nodes_file: Path, nodes: int) -> dict:
    """The plan of llama.cpp's even split over the lab's nodes in their file order, measured on
    them as `fleetctl plan` measures (plan.split_plan): every node serves, so each is a fault."""
    sizes = read_model(model)
    work = Workload(ctx=CTX)
    with NodeFleet.load(nodes_file) as fleet:
        facts = measure(fleet, sizes, prompt_tokens=work.prompt_tokens)
    if sizes.n_layer < nodes:
        raise FleetError(f"{model.name}: {sizes.n_layer} layers for {nodes} nodes")
    return split_plan(sizes, facts, work, range(nodes), even_counts(sizes.n_layer, nodes)).as_dict()


def node_pid(fleet: NodeFleet, name: str) -> int | None:
    """The pid the node's control API reports (inside its namespace), None while it does not answer."""
    node = next(n for n in fleet if n.name == name)
    try:
        return int(node.status().doc["pid"])
    except Exception:  # down, or not listening yet: asked again until the deadline
        return None


def hello(endpoint: str) -> bool:
    try:
        RpcClient(endpoint, HELLO_TIMEOUT).open().close()
        return True
    except (FleetdError, OSError, ValueError):
        return False


# -- fleetctl serve ------------------------------------------------------------------------------


class Serve:
    """`fleetctl serve` as a subprocess: its lines (stdout: the URL and the stages; stderr: the
    supervisor's events, time-stamped), timed, read by a thread each; stderr also into a file."""

    def __init__(self, argv: list[str], env: dict, t0: float, err_path: Path) -> None:
        self.t0 = t0
        self.lines: list[tuple[float, str]] = []  # stdout
        self.events: list[tuple[float, str]] = []  # stderr
        self._err = open(err_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
        )
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.lines, None), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.events, self._err), daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream, into: list, copy) -> None:
        for line in stream:
            if copy is not None:
                copy.write(line)
                copy.flush()
            line = line.rstrip()
            if line:
                into.append((time.monotonic() - self.t0, line))
                print(f"  serve| {line}", file=sys.stderr, flush=True)

    def wait_line(self, pattern: str, seconds: float) -> tuple[float, str] | None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            hit = next(((t, line) for t, line in list(self.lines) if re.search(pattern, line)), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None:
                return None
            time.sleep(POLL_S)
        return None

    def stop(self, port: int, env: dict, fleetctl: list[str]) -> int | None:
        """`fleetctl serve --stop --port P` from "another shell", then SIGTERM, SIGKILL: bounded."""
        if self.proc.poll() is None:
            try:
                subprocess.run(
                    [*fleetctl, "serve", "--stop", "--port", str(port)],
                    env=env,
                    cwd=REPO,
                    capture_output=True,
                    timeout=SERVE_STOP_S,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            try:
                self.proc.wait(SERVE_STOP_S / 2)
            except subprocess.TimeoutExpired:
                pass
        for t in self._readers:
            t.join(5)
        self._err.close()
        return self.proc.poll()


def fleetctl_argv() -> list[str]:
    exe = Path(sys.executable).parent / "fleetctl"
    if exe.is_file():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from fleetd.ctl import main; sys.exit(main())"]


# -- one round -----------------------------------------------------------------------------------


def run_round(r: int, victim: str, endpoint: str, lab: Lab, fleet: NodeFleet, loop: ClosedLoop, a) -> dict:
    say = lambda text: print(f"[round {r}] {text}", file=sys.stderr, flush=True)  # noqa: E731
    began = loop.now()
    # answers before the kill: at least one per client, and --kill-after seconds of them
    ok = loop.wait_for(lambda q: q.status == 200 and q.start >= began, a.recovery_limit)
    if ok is None:
        raise FleetError(f"round {r}: no 200 within {a.recovery_limit:g}s before the kill")
    end = time.monotonic() + a.recovery_limit
    while time.monotonic() < end:
        answered = [q for q in loop.snapshot() if q.status == 200 and q.start >= began]
        if len(answered) >= a.clients and loop.now() - began >= a.kill_after:
            break
        time.sleep(POLL_S)
    old_pid = lab.fleetd_pid(victim)
    killed = loop.now()
    lab.kill_fleetd(victim)
    say(f"SIGKILL {victim}'s fleetd (pid {old_pid}) at {killed:.2f}s")
    # the supervisor starts it again: its control API answers with a new pid, then HELLO
    back = back_hello = None
    new_pid = None
    end = time.monotonic() + a.restart + NODE_BACK_LIMIT_S
    while time.monotonic() < end:
        pid = node_pid(fleet, victim)
        if pid is not None and pid != old_pid:
            back, new_pid = loop.now(), pid
            break
        time.sleep(POLL_S)
    if back is not None:
        while time.monotonic() < end and not hello(endpoint):
            time.sleep(POLL_S)
        back_hello = loop.now()
        say(f"{victim} answers again (pid {new_pid}) {back - killed:.2f}s after the kill")
    else:
        say(f"{victim} did not answer again within {a.restart + NODE_BACK_LIMIT_S:g}s")
    # the service answers again: a 200 started after the kill
    first = loop.wait_for(lambda q: q.status == 200 and q.start > killed, a.recovery_limit)
    if first is not None:
        say(f"first 200 after the kill answered at {first.end - killed:.2f}s after it")
        settle_end = time.monotonic() + a.recovery_limit
        while time.monotonic() < settle_end:
            n = sum(1 for q in loop.snapshot() if q.status == 200 and q.start >= first.start)
            if n >= a.settle:
                break
            time.sleep(POLL_S)
    ended = loop.now()
    return {
        "round": r,
        "victim": victim,
        "endpoint": endpoint,
        "old_pid": old_pid,
        "new_pid": new_pid,
        "began": began,
        "killed": killed,
        "back": back,
        "back_hello": back_hello,
        "first_200": asdict(first) if first else None,
        "ended": ended,
    }


def analyse(rnd: dict, requests: list[Request], timeout: float) -> dict:
    """What a round shows, from its requests (started in [began, ended))."""
    killed, victim = rnd["killed"], rnd["victim"]
    mine = [q for q in requests if rnd["began"] <= q.start < rnd["ended"]]
    first = rnd["first_200"]
    first_start = first["start"] if first else float("inf")
    in_flight = [q for q in mine if q.start < killed < q.end]
    # after the kill, before the service answered again: 503 (not serving) or 502 (forwarded
    # before serve marked the outage, failed in flight)
    during = [q for q in mine if killed <= q.start < first_start]
    failed_in_flight = [q for q in in_flight + during if q.status not in (200, 503)]
    unnamed = [asdict(q) for q in failed_in_flight if q.status != 502 or victim not in q.reason]
    refused = [q for q in during if q.status == 503]
    hung = [asdict(q) for q in mine if q.took > timeout or (q.status == 0 and "timed out" in q.reason)]
    back = rnd["back"]
    return {
        "round": rnd["round"],
        "victim": victim,
        "requests": len(mine),
        "in_flight": dict(collections.Counter(q.status for q in in_flight)),
        "failed_in_flight": len(failed_in_flight),
        "failed_in_flight_naming_node": len(failed_in_flight) - len(unnamed),
        "unnamed": unnamed,
        "in_flight_reasons": sorted({q.reason for q in failed_in_flight})[:5],
        "in_flight_failed_by_s": max((q.end - killed for q in failed_in_flight), default=None),
        "after_kill_statuses": dict(collections.Counter(q.status for q in during)),
        "refused_503": len(refused),
        "refused_503_naming_node_or_restart": sum(
            1 for q in refused if victim in q.reason or "restarting llama-server" in q.reason
        ),
        "refused_503_max_s": max((q.took for q in refused), default=None),
        "refused_503_reasons": sorted(
            {re.sub(r"\(down for [\d.]+s\)", "(down for Xs)", q.reason) for q in refused}
        )[:5],
        "kill_to_node_back_s": None if back is None else back - killed,
        "kill_to_hello_s": None if rnd["back_hello"] is None else rnd["back_hello"] - killed,
        "node_back_to_serving_s": None if back is None or not first else first["start"] - back,
        "node_back_to_first_200_s": None if back is None or not first else first["end"] - back,
        "outage_s": None if not first else first["end"] - killed,
        "longest_request_s": max((q.took for q in mine), default=None),
        "hung": hung,
        "answered_again": first is not None,
    }


def supervisor_lines(lab_dir: Path, names: list[str]) -> dict[str, list[str]]:
    out = {}
    for name in names:
        try:
            text = (lab_dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            continue
        out[name] = [line for line in text.splitlines() if "fleetd.supervise:" in line]
    return out


def fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=60.0, help="per request, seconds (default 60)")
    ap.add_argument("--restart", type=float, default=1.0, help="the supervisor's RestartSec (default 1)")
    ap.add_argument("--kill-after", type=float, default=4.0, help="seconds of answers before each kill")
    ap.add_argument("--settle", type=int, default=8, help="200s after the recovery that end a round")
    ap.add_argument("--recovery-limit", type=float, default=120.0, help="seconds to wait for a 200, at most")
    ap.add_argument("--coordinator-link", default="200mbit")
    ap.add_argument("--peer-link", default="2gbit")
    ap.add_argument("--model", default="llama-q8_0-wide12", help="a fleetd.models name with >= 3 layers")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/fleetd-lab-fault"), help="work directory")
    ap.add_argument("--models", type=Path, default=Path("/tmp/fleetd-fault-models"), help="model cache")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/serve_fault_lab.json)")
    a = ap.parse_args()
    if not 1 <= a.rounds <= 20 or not 1 <= a.clients <= 32 or a.timeout <= 0 or a.restart < 0:
        ap.error("--rounds 1..20, --clients 1..32, --timeout > 0, --restart >= 0")
    if os.geteuid() != 0:
        print("serve_fault_lab: needs root (network namespaces)", file=sys.stderr)
        return 2
    nodes = 3
    work_dir = a.dir
    if work_dir.exists():
        Lab(work_dir / "lab").down()  # a lab a killed run left behind
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True)
    runtime = work_dir / "run"
    runtime.mkdir(mode=0o700)
    model = generate_named(a.model, a.models)
    lab = Lab(work_dir / "lab")
    serve: Serve | None = None
    port = free_port()
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), COLUMNS="200", PYTHONUNBUFFERED="1")
    fleetctl = fleetctl_argv()
    rounds, t0 = [], time.monotonic()
    loop: ClosedLoop | None = None
    try:
        lab_nodes = lab.up(
            nodes, parse_rate(a.coordinator_link), parse_rate(a.peer_link), 1, restart_s=a.restart
        )
        print(
            f"lab up in {lab.dir}: {', '.join(n.name for n in lab_nodes)}, "
            f"supervised (restart {a.restart:g}s)",
            file=sys.stderr,
            flush=True,
        )
        doc = even_plan(model, lab.nodes_file, nodes)
        plan_file = work_dir / "plan.json"
        plan_file.write_text(json.dumps(doc))
        stages = [(s["name"], s["endpoint"], s["layer_count"]) for s in doc["stages"]]
        argv = [*fleetctl, "serve", str(model), str(lab.nodes_file), "--plan", str(plan_file)]
        argv += ["--port", str(port), "--threads", "1"]
        started = time.monotonic()
        serve = Serve(argv, env, t0, work_dir / "serve.stderr")
        if serve.wait_line(r"^stop: ", SERVE_START_S) is None:
            tail = (work_dir / "serve.stderr").read_text(errors="replace")[-2000:]
            raise FleetError(f"fleetctl serve printed no URL within {SERVE_START_S:g}s: {tail}")
        load_s = time.monotonic() - started
        url_line = serve.wait_line(r"^serving ", 1)
        print(f"{url_line[1] if url_line else '?'} ({load_s:.1f}s to start)", file=sys.stderr, flush=True)
        seconds = a.rounds * (a.kill_after + a.restart + NODE_BACK_LIMIT_S + 3 * a.recovery_limit) + 60
        with (
            NodeFleet.load(lab.nodes_file) as fleet,
            ClosedLoop(port, t0, a.clients, a.n_predict, a.timeout, seconds) as loop,
        ):
            for r in range(a.rounds):
                victim, endpoint, _ = stages[(1 + r) % len(stages)]  # the middle one first
                rounds.append(run_round(r + 1, victim, endpoint, lab, fleet, loop, a))
                if rounds[-1]["first_200"] is None:
                    break  # the service did not come back: no point killing another node
    finally:
        requests = loop.snapshot() if loop is not None else []
        serve_rc = serve.stop(port, env, fleetctl) if serve is not None else None
        sup = supervisor_lines(lab.dir, [f"lab-{j}" for j in range(nodes)])
        removed = lab.down()
        print(f"lab down: {len(removed)} removed", file=sys.stderr, flush=True)

    results = [analyse(rnd, requests, a.timeout) for rnd in rounds]
    show(
        f"fleetctl serve, a node SIGKILLed, {nodes}-node lab ({a.coordinator_link} coordinator, "
        f"{a.peer_link} peers), supervised restart {a.restart:g}s, {a.clients} clients, "
        f"n_predict {a.n_predict}, bound {BOUND_S:g}s",
        [
            "round",
            "killed",
            "requests",
            "in flight (status: n)",
            "failed, named",
            "failed by s",
            "503",
            "503 max s",
            "kill -> node back s",
            "back -> serving s",
            "back -> 200 s",
            "outage s",
            "longest s",
            "hung",
        ],
        [
            [
                x["round"],
                x["victim"],
                x["requests"],
                " ".join(f"{k}:{v}" for k, v in sorted(x["in_flight"].items())),
                f"{x['failed_in_flight']}, {x['failed_in_flight_naming_node']}",
                fmt(x["in_flight_failed_by_s"]),
                x["refused_503"],
                fmt(x["refused_503_max_s"], 3),
                fmt(x["kill_to_node_back_s"]),
                fmt(x["node_back_to_serving_s"]),
                fmt(x["node_back_to_first_200_s"]),
                fmt(x["outage_s"]),
                fmt(x["longest_request_s"]),
                len(x["hung"]),
            ]
            for x in results
        ],
    )
    violations = []
    for x in results:
        if x["unnamed"]:
            violations.append(
                f"round {x['round']}: {len(x['unnamed'])} failed in flight without 502 naming "
                f"{x['victim']}: {x['unnamed'][:3]}"
            )
        if x["hung"]:
            violations.append(
                f"round {x['round']}: {len(x['hung'])} requests outlived the {a.timeout:g}s "
                f"timeout: {x['hung'][:3]}"
            )
        if not x["answered_again"]:
            violations.append(
                f"round {x['round']}: the service did not answer 200 again within {a.recovery_limit:g}s"
            )
    if len(results) < a.rounds:
        violations.append(f"{len(results)} of {a.rounds} rounds ran")
    within = [x["node_back_to_first_200_s"] for x in results if x["node_back_to_first_200_s"] is not None]
    for x in results:
        print(f"round {x['round']}: in flight failed with: {x['in_flight_reasons'][:2]}")
        print(f"round {x['round']}: 503 said: {x['refused_503_reasons'][:2]}")
    if within:
        print(
            f"node back -> first 200: {min(within):.2f}-{max(within):.2f}s "
            f"({'within' if max(within) <= BOUND_S else 'ABOVE'} the {BOUND_S:g}s bound); "
            f"serve started in {load_s:.1f}s"
        )
    doc_out = {
        "config": {
            "nodes": nodes,
            "coordinator_link": fmt_rate(parse_rate(a.coordinator_link)),
            "peer_link": fmt_rate(parse_rate(a.peer_link)),
            "restart_s": a.restart,
            "clients": a.clients,
            "n_predict": a.n_predict,
            "timeout_s": a.timeout,
            "kill_after_s": a.kill_after,
            "model": a.model,
            "bound_s": BOUND_S,
            "backoff_max_s": BACKOFF_MAX_S,
        },
        "command": " ".join(["fleetctl", *argv[len(fleetctl) :]]),
        "plan": [{"name": n, "endpoint": e, "layers": c} for n, e, c in stages],
        "serve_start_s": load_s,
        "serve_exit": serve_rc,
        "rounds": results,
        "marks": rounds,
        "serve_lines": [{"t": round(t, 3), "line": line} for t, line in serve.lines],
        "serve_events": [{"t": round(t, 3), "line": line} for t, line in serve.events],
        "supervisor_lines": sup,
        "requests": [asdict(q) for q in requests],
        "violations": violations,
    }
    print(f"wrote {save('serve_fault_lab', doc_out, a.out)}")
    if violations:
        print("VIOLATED:\n  " + "\n  ".join(violations), file=sys.stderr)
        return 1
    print("correct: every failure in flight named the node, no request hung, the service answered again")
    return 0


if __name__ == "__main__":
    sys.exit(main())

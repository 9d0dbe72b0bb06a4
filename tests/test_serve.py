"""fleetctl serve (#21 items 3 and 4): the patched llama-server over a local fleet of 2 fleetd,
behind serve's front, with real processes throughout (no mocks).

- The command as an operator runs it (a subprocess): the URL, the layers per node, /completion
  with the same greedy text as llama-completion over the same fleet and split, the serving
  sample a panel polls, then `fleetctl serve --stop` from "another shell": exit 0, port freed,
  state file gone.
- A node SIGKILLed under a closed loop of requests: the requests in flight fail with 502 naming
  the node, the ones meanwhile get 503 with the reason at once, and once the node is back on
  its port the service answers again (same text) within RECOVERY_BOUND_S.
- A node that stays down: after --replan-after, a plan without it, and answers again.
- Usage errors: one line, exit 2.

Bounds: every loop is bounded in count and time; each request has a timeout.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import needs_tool, run_client

from fleetd.fleet.local import LocalFleet
from fleetd.fleet.plan import Workload, read_model, split_plan
from fleetd.fleet.plan_probe import measure
from fleetd.fleet.serve import ServeConfig, Service
from fleetd.fleet.serve_control import read_serving, serving_rates
from fleetd.fleet.server_load import completion_body
from fleetd.models import generate_named
from fleetd.tools import find_p2p_tool
from fleetd.transport import free_port

pytestmark = [needs_tool("p2p/llama-server", "p2p/llama-completion"), pytest.mark.timeout(150)]

REPO = Path(__file__).resolve().parents[1]
CTX = 512
PROMPT = "the time of their first new"
N_PREDICT = 24
REQUEST_TIMEOUT_S = 20.0  # no single request may take longer: nothing hangs
OUTAGE_SEEN_BOUND_S = 5.0  # kill -> the first 503 naming the node
RECOVERY_BOUND_S = 20.0  # node answering again -> the service answers 200 (back-off 2 s + a load)
LOOP_LIMIT = 2000  # requests per closed loop, at most


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return generate_named("llama-q8_0", tmp_path_factory.mktemp("serve-models"))


@pytest.fixture
def fleet(tmp_path):
    with LocalFleet(2, tmp_path, server_args=["--threads", "1"]) as local:
        yield local


def one_layer_each(model: Path, local: LocalFleet) -> dict:
    """A real plan (measured on the nodes) with one layer on each node, so both nodes serve. The
    optimiser alone would put this tiny model on one node whatever the free memory: a node alone
    needs a smaller compute buffer than each node of a split (plan.stage_memory), so a node that
    holds one layer of the split holds both alone. The split is fixed here (plan.split_plan)."""
    sizes = read_model(model)
    work = Workload(ctx=CTX)
    facts = measure(local.fleet, sizes)
    doc = split_plan(sizes, facts, work, (0, 1), [1, 1]).as_dict()
    assert [s["layer_count"] for s in doc["stages"]] == [1, 1], doc["stages"]
    return doc


def post_completion(port: int, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/completion", json.dumps(completion_body(PROMPT, N_PREDICT)))
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def llama_completion(model: Path, doc: dict) -> str:
    """llama-completion over the same fleet with the plan's split: the reference greedy text."""
    args = [a for a in doc["llama_args"]]
    np_at = args.index("-np")
    del args[np_at : np_at + 2]  # one sequence: llama-completion's own
    cmd = [str(find_p2p_tool("llama-completion")), "-m", str(model), *args]
    cmd += ["-p", PROMPT, "-n", str(N_PREDICT), "--temp", "0", "--seed", "1", "-t", "1", "-no-cnv"]
    cmd += ["--ignore-eos"]
    text = run_client(cmd, timeout=120).stdout.decode(errors="replace")
    assert PROMPT in text
    return text.split(PROMPT, 1)[1].rstrip("\n")


def fleetctl(*argv: str, env: dict) -> subprocess.Popen:
    code = "import sys; from fleetd.ctl import main; sys.exit(main())"
    return subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_until(stream, pattern: str, seconds: float) -> str:
    """Lines of `stream` until one matches `pattern` (bounded: a reader thread, then a deadline)."""
    seen: list[str] = []
    found = threading.Event()

    def reader():
        for line in stream:
            seen.append(line)
            if re.search(pattern, line):
                found.set()
                return

    threading.Thread(target=reader, daemon=True).start()
    assert found.wait(seconds), f"no line matching {pattern!r} within {seconds}s: {''.join(seen)}"
    return "".join(seen)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# -- the command -------------------------------------------------------------------------------------


def test_serve_answers_like_llama_completion_and_stops_from_another_shell(model, fleet, tmp_path):
    doc = one_layer_each(model, fleet)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(doc))
    port = free_port()
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_RUNTIME_DIR=str(runtime), COLUMNS="200")
    args = [
        str(model),
        str(fleet.nodes_file),
        "--plan",
        str(plan_file),
        "--port",
        str(port),
        "--threads",
        "1",
    ]
    serve = fleetctl("serve", *args, env=env)
    try:
        out = read_until(serve.stdout, r"^stop: ", 60)
        url = f"http://127.0.0.1:{port}"
        assert f"serving {model.name} at {url}" in out
        first, last = doc["stages"]
        assert f"  {first['name']} {first['endpoint']}: layers 0-0 (1)\n" in out
        assert f"  {last['name']} {last['endpoint']}: layers 1-1 (1) + output\n" in out
        state = runtime / "fleetd" / f"serve-{port}.json"
        assert json.loads(state.read_text())["pid"] == serve.pid

        before = read_serving(url)
        status, answer = post_completion(port)
        assert status == 200, answer
        assert answer["content"] == llama_completion(model, doc)  # same greedy text, same fleet
        after = read_serving(url)
        rates = serving_rates(before, after)
        assert after.phase == "serving" and after.requests == before.requests + 1
        assert rates.requests_per_s > 0 and rates.decode_tps > 0 and rates.prompt_tps > 0
        assert [s["layer_count"] for s in after.stages] == [1, 1]

        second = fleetctl("serve", "--stop", "--port", str(port), env=env)
        stop_out, stop_err = second.communicate(timeout=60)
        assert second.returncode == 0, stop_err
        assert f"stopped fleetctl serve on port {port} (pid {serve.pid})" in stop_out
        assert serve.wait(30) == 0
        assert port_is_free(port) and not state.exists()
        again = fleetctl("serve", "--stop", env=env)  # nothing left to stop: one line, exit 1
        _, err = again.communicate(timeout=60)
        assert again.returncode == 1 and err.count("\n") == 1 and "no fleetctl serve runs" in err
    finally:
        stop(serve)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (serve stops its llama-server), SIGKILL only when that does not end it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve"], "MODEL.gguf and NODES are required"),
        (["serve", "--port", "70000", "--stop"], "--port 70000: must be in 0..65535"),
        (["serve", "m.gguf", "n.txt", "--stop"], "--stop takes no MODEL.gguf or NODES"),
        (["serve", "--replan-after", "-1", "--stop"], "--replan-after -1: must be at least 0"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, message, capsys):
    from fleetd.ctl.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().splitlines()[-1].startswith("fleetctl serve: error:")


def test_a_plan_file_for_another_model_is_a_usage_error(model, tmp_path, capsys):
    from fleetd.ctl.main import main

    nodes = tmp_path / "nodes.txt"
    nodes.write_text("localhost rpc_port=1\n")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "fits": True, "llama_args": [], "stages": []}))
    assert main(["serve", str(model), str(nodes), "--plan", str(plan)]) == 2
    assert "--plan" in capsys.readouterr().err


# -- a node that dies ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    started: float
    took: float
    status: int
    message: str
    content: str


class ClosedLoop:
    """`clients` threads each sending the next /completion as soon as the last was answered, until
    stop(), LOOP_LIMIT requests or `seconds`; every answer recorded with its time."""

    def __init__(self, port: int, clients: int = 2, seconds: float = 90.0) -> None:
        self.port, self.deadline = port, time.monotonic() + seconds
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def __enter__(self) -> ClosedLoop:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT_S + 5)

    def _client(self) -> None:
        while (
            not self._stop.is_set() and time.monotonic() < self.deadline and len(self.outcomes) < LOOP_LIMIT
        ):
            started = time.monotonic()
            try:
                status, doc = post_completion(self.port)
                message = doc.get("error", {}).get("message", "")
                outcome = Outcome(
                    started, time.monotonic() - started, status, message, doc.get("content", "")
                )
            except (OSError, http.client.HTTPException, ValueError) as exc:
                outcome = Outcome(started, time.monotonic() - started, 0, repr(exc), "")
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.status != 200:
                time.sleep(0.05)  # a client that got 503 retries, not in a tight spin

    def wait_for(self, what, seconds: float) -> Outcome | None:
        """The first outcome for which `what` holds, waiting at most `seconds`."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with self._lock:
                hit = next((o for o in self.outcomes if what(o)), None)
            if hit is not None:
                return hit
            time.sleep(0.05)
        return None


def start_service(model: Path, doc: dict, local: LocalFleet, lines: list[str], **config) -> Service:
    log = local.workdir / "llama-server.log"
    cfg = ServeConfig(model=model, port=0, threads=1, start_timeout=60, log_path=log, **config)
    service = Service(
        cfg, doc, read_model(model), exe=find_p2p_tool("llama-server"), nodes=local.fleet, say=lines.append
    )
    return service.start()


def test_a_killed_node_fails_requests_in_flight_with_its_name_then_the_service_comes_back(model, fleet):
    doc = one_layer_each(model, fleet)
    lines: list[str] = []
    with start_service(model, doc, fleet, lines, replan_after=0) as service:
        reference = post_completion(service.port)[1]["content"]
        with ClosedLoop(service.port) as loop:
            assert loop.wait_for(lambda o: o.status == 200, 10), loop.outcomes
            time.sleep(0.5)
            killed = time.monotonic()
            fleet.kill(1)
            first_503 = loop.wait_for(lambda o: o.status == 503 and o.started > killed, OUTAGE_SEEN_BOUND_S)
            assert first_503 is not None, loop.outcomes[-5:]
            time.sleep(1.0)  # a second of outage under load: 503s, each answered at once
            fleet.restart(1)
            back = time.monotonic()
            answered = loop.wait_for(lambda o: o.status == 200 and o.started > back, RECOVERY_BOUND_S)
        outcomes = loop.outcomes
    failed = [o for o in outcomes if o.status != 200]
    in_flight = [o for o in failed if o.status == 502]
    meanwhile = [o for o in failed if o.status == 503]
    print(
        f"\n{len(outcomes)} requests: {len(in_flight)} x 502 (in flight), {len(meanwhile)} x 503; "
        f"first 503 {first_503.started - killed:.2f}s after the kill: {first_503.message!r}; "
        f"node back -> answering: {(answered.started + answered.took - back) if answered else None}s"
    )
    print(f"a request in flight got: {in_flight[0].message if in_flight else None!r}")
    print("\n".join(lines))
    assert answered is not None, f"no 200 within {RECOVERY_BOUND_S}s of the node's return: {lines}"
    assert all(o.status in (502, 503) for o in failed), failed
    assert max(o.took for o in outcomes) < REQUEST_TIMEOUT_S  # nothing hung
    assert in_flight and all("local-1" in o.message for o in in_flight), in_flight
    assert all("local-1" in o.message or "restarting llama-server" in o.message for o in meanwhile), meanwhile
    assert max(o.took for o in meanwhile) < 1.0  # a 503 is answered at once
    assert {o.content for o in outcomes if o.status == 200} == {reference}  # same text before and after
    assert sum("local-1" in line and "does not answer" in line for line in lines) == 1, lines
    assert any("restarting llama-server" in line for line in lines), lines
    assert any(line.startswith("serving again at") for line in lines), lines


def test_a_node_that_stays_down_is_planned_around(model, fleet):
    doc = one_layer_each(model, fleet)
    lines: list[str] = []
    with start_service(model, doc, fleet, lines, replan_after=2.0) as service:
        reference = post_completion(service.port)[1]["content"]
        fleet.kill(0)
        deadline = time.monotonic() + 30
        status, answer = 0, {}
        while time.monotonic() < deadline:
            status, answer = post_completion(service.port)
            if status == 200:
                break
            message = answer["error"]["message"]
            assert status in (502, 503) and ("local-0" in message or "restarting" in message), answer
            time.sleep(0.2)
        assert status == 200, (answer, lines)
        assert answer["content"] == reference
        assert [s["name"] for s in service.plan["stages"]] == ["local-1"]
        assert any(line.startswith("new plan without local-0: local-1") for line in lines), lines
        assert service.status()["replans"] == 1

"""llama-server under a closed-loop load: the patched server over the fleet, and N clients of our
own (threads and http.client, the standard library only) that each send their next /completion
as soon as the last one was answered.

    with LlamaServer(exe, args, env, label="direct", start_timeout=600) as server:
        load = run_load(server.port, clients=4, prompts=SERVER_PROMPTS, n_predict=32,
                        limits=LoadLimits(requests=16, seconds=60))
    load.tokens_per_s, load.requests_per_s, load.texts

Bounded in count and in time: at most `requests` in all, none started after `seconds`, each
answered within `seconds` (or the run fails), so a run ends within twice its time limit whatever
the server does. A server that exits or never answers /health is one FleetError line naming its
last line of output; it is always stopped (terminate, wait, kill) when the block ends.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fleetd.errors import FleetError
from fleetd.transport import free_port

HOST = "127.0.0.1"
_LOG_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ [A-Z] ")  # "0.00.005.554 E " in llama.cpp's log
HEALTH_POLL_S = 0.05  # a loopback GET: polling often costs nothing and starts serving sooner
HEALTH_REQUEST_TIMEOUT_S = 2.0
STOP_TIMEOUT_S = 10.0
_LOG_TAIL_BYTES = 64 << 10
# Different prompts, so the clients' sequences differ; each prompt's greedy text is compared
# between arms (and between the requests of one arm).
SERVER_PROMPTS = (
    "the time of their first new",
    "once upon a time there was",
    "in the beginning the nodes",
    "a small model on a large fleet",
)


# -- the server --------------------------------------------------------------------------------


def _last_line(log) -> str:
    """The server's last line of output, without llama.cpp's time stamp and level letter."""
    log.seek(0, 2)
    log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))  # a long-running server's log grows
    lines = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[-1]).strip() if lines else "no output"


def health_status(port: int) -> int | None:
    """/health's HTTP status (200 ready, 503 loading), None while nothing answers."""
    conn = http.client.HTTPConnection(HOST, port, timeout=HEALTH_REQUEST_TIMEOUT_S)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


class LlamaServer:
    """One llama-server on a free loopback port, as a context manager: entering starts it and
    waits until /health answers 200 (a FleetError when it exits first or is not ready within
    `start_timeout`); leaving stops it (terminate, wait, kill after STOP_TIMEOUT_S)."""

    def __init__(
        self,
        exe: Path,
        args: Sequence[str],
        env: Mapping[str, str],
        label: str,
        start_timeout: float,
        *,
        log_path: Path | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> None:
        """`log_path`: append the server's output there (default: a temporary file);
        `on_wait(last line)` runs at every /health poll while it starts (raise in it to give up)."""
        self.exe, self.args, self.env = exe, list(args), dict(env)
        self.label, self.start_timeout = label, start_timeout
        self.port = 0
        self.pid = 0
        self._proc: subprocess.Popen | None = None
        self._log = open(log_path, "ab+") if log_path else tempfile.TemporaryFile()  # noqa: SIM115
        self._on_wait = on_wait

    def __enter__(self) -> LlamaServer:
        self.port = free_port()
        self._proc = subprocess.Popen(
            [str(self.exe), *self.args, "--host", HOST, "--port", str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        self.pid = self._proc.pid
        try:
            self._wait_ready(self._proc)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _wait_ready(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.start_timeout
        while health_status(self.port) != 200:
            code = proc.poll()
            if code is not None:
                raise FleetError(
                    f"llama-server ({self.label}) exited {code} before it was ready: {_last_line(self._log)}"
                )
            if time.monotonic() >= deadline:
                raise FleetError(
                    f"llama-server ({self.label}) not ready within {self.start_timeout:g}s: "
                    f"{_last_line(self._log)}"
                )
            if self._on_wait is not None:
                self._on_wait(_last_line(self._log))
            time.sleep(HEALTH_POLL_S)

    def exit_code(self) -> int | None:
        """The exit status once the server has exited (negative: the signal), else None."""
        return None if self._proc is None else self._proc.poll()

    def last_line(self) -> str:
        """The server's last line of output (what an abort says)."""
        return "no output" if self._log.closed else _last_line(self._log)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Terminate, wait, kill after `timeout`; closes the captured output. Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()


# -- the load ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadLimits:
    """How much load one run may send: `requests` in all, none started after `seconds`, and each
    answered within `seconds`."""

    requests: int
    seconds: float


@dataclass
class LoadResult:
    """What the closed-loop clients got: answered requests, generated tokens, the wall time from
    the first request to the last answer, why the run stopped ("count", "time" or "error"), and per
    prompt the distinct texts the server answered (one each when greedy decoding is
    deterministic)."""

    clients: int
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stopped_by: str = "count"
    texts: dict[str, list[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


def completion_body(prompt: str, n_predict: int) -> dict:
    """Greedy, exactly `n_predict` tokens (EOS ignored), nothing reused from an earlier request."""
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "top_k": 1,
        "seed": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": False,
    }


class _Tickets:
    """Request numbers for the clients, until `limit` are out, the deadline passed, or stop()."""

    def __init__(self, limit: int, deadline: float) -> None:
        self.limit, self.deadline = limit, deadline
        self.issued = 0
        self.stopped = False
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            if self.stopped or self.issued >= self.limit or time.monotonic() >= self.deadline:
                return None
            self.issued += 1
            return self.issued - 1

    def stop(self) -> None:
        with self._lock:
            self.stopped = True


def _post_completion(conn: http.client.HTTPConnection, body: dict) -> dict:
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise ValueError(f"HTTP {response.status}: {data[:200].decode(errors='replace')}")
    answer = json.loads(data)
    if not isinstance(answer.get("content"), str) or not isinstance(answer.get("tokens_predicted"), int):
        raise ValueError(f"an answer without content and tokens_predicted: {data[:200]!r}")
    return answer


class _Recorder:
    """The answers of all clients, under one lock."""

    def __init__(self, result: LoadResult) -> None:
        self.result = result
        self.last_answer = 0.0
        self._lock = threading.Lock()

    def answer(self, prompt: str, answer: dict) -> None:
        with self._lock:
            self.result.requests += 1
            self.result.tokens += answer["tokens_predicted"]
            texts = self.result.texts.setdefault(prompt, [])
            if answer["content"] not in texts:
                texts.append(answer["content"])
            self.last_answer = time.monotonic()

    def error(self, message: str) -> None:
        with self._lock:
            self.result.errors.append(message)


def _client(
    port: int, prompts: Sequence[str], n_predict: int, timeout: float, tickets: _Tickets, rec: _Recorder
) -> None:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        while (ticket := tickets.take()) is not None:
            prompt = prompts[ticket % len(prompts)]
            try:
                rec.answer(prompt, _post_completion(conn, completion_body(prompt, n_predict)))
            except (OSError, http.client.HTTPException, ValueError) as exc:
                rec.error(f"request {ticket}: {type(exc).__name__}: {exc}")
                tickets.stop()  # one failure ends the run: the numbers would not mean much
                return
    finally:
        conn.close()


def run_load(
    port: int, clients: int, prompts: Sequence[str], n_predict: int, limits: LoadLimits
) -> LoadResult:
    """`clients` closed-loop clients against the server on loopback `port`, within `limits`;
    failed requests are in `errors` (the run stops at the first)."""
    if clients < 1 or limits.requests < 1 or not limits.seconds > 0 or not prompts:
        raise ValueError(f"a load needs clients, requests, time and prompts: {clients}, {limits}")
    result = LoadResult(clients)
    rec = _Recorder(result)
    start = time.monotonic()
    tickets = _Tickets(limits.requests, start + limits.seconds)
    threads = [
        threading.Thread(
            target=_client,
            args=(port, prompts, n_predict, limits.seconds, tickets, rec),
            name=f"load-client-{i}",
            daemon=True,
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:  # each request times out after limits.seconds: these joins end
        t.join()
    result.seconds = (rec.last_answer or time.monotonic()) - start
    if result.errors:
        result.stopped_by = "error"
    else:
        result.stopped_by = "count" if tickets.issued >= limits.requests else "time"
    return result

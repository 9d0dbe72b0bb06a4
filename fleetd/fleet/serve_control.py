"""Reaching a running `fleetctl serve` from outside it.

- Its state file, `serve-<port>.json` under a per-user directory (`state_dir()`): the pid, the
  port and the URL, written once the front answers and removed when it stops. `fleetctl serve
  --stop` reads it and sends SIGTERM.
- Its serving state for a panel that polls (the TUI): `read_serving(url)` takes one sample (the
  front's `/fleet/status` and llama-server's Prometheus `/metrics` through the front),
  `serving_rates(before, after)` turns two samples into requests/s and prompt and decode t/s.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from fleetd.errors import FleetError
from fleetd.fleet.serve import SERVING, STATUS_PATH

STOP_WAIT_S = 30.0  # llama-server's stop is bounded by 10 s, the supervisor's probes by a few
STOP_POLL_S = 0.1

# -- the state file ----------------------------------------------------------------------------------


def state_dir() -> Path:
    """Where serve's state files live: $XDG_RUNTIME_DIR/fleetd (per user, cleared at logout),
    else $XDG_STATE_HOME/fleetd, else ~/.local/state/fleetd."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "fleetd"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "fleetd"


def state_path(port: int) -> Path:
    return state_dir() / f"serve-{port}.json"


@dataclass(frozen=True)
class ServeRecord:
    """One running `fleetctl serve`: its pid, the front's port and URL, the model, llama-server's
    log and when it started (seconds since the epoch)."""

    pid: int
    port: int
    url: str
    model: str
    log: str
    started: float


def write_state(record: ServeRecord) -> Path:
    """Write the record (owner-only, replaced atomically); its path."""
    path = state_path(record.port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    part.write_text(json.dumps(asdict(record)) + "\n")
    part.chmod(0o600)
    part.replace(path)
    return path


def remove_state(record: ServeRecord) -> None:
    """Remove the record's file, unless another serve has written its own there since."""
    path = state_path(record.port)
    try:
        if json.loads(path.read_text()).get("pid") == record.pid:
            path.unlink()
    except (OSError, ValueError):
        pass  # gone already, or not ours to remove


def is_serve_process(pid: int) -> bool:
    """Whether `pid` runs and is a `fleetctl serve` (not a later process that got the pid)."""
    try:
        return b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def running_serves() -> list[ServeRecord]:
    """The serves whose state files name a live serve process; stale files are removed."""
    found = []
    for path in sorted(state_dir().glob("serve-*.json")):
        try:
            record = ServeRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # half-written or foreign: not a record
        if is_serve_process(record.pid):
            found.append(record)
        else:
            remove_state(record)
    return found


def stop_serve(record: ServeRecord, timeout: float = STOP_WAIT_S) -> None:
    """SIGTERM to the serve, then wait until it has exited (FleetError after `timeout`)."""
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while is_serve_process(record.pid):
        if time.monotonic() > deadline:
            raise FleetError(
                f"fleetctl serve on port {record.port} (pid {record.pid}) still runs after {timeout:g}s"
            )
        time.sleep(STOP_POLL_S)


# -- the serving state, for a panel that polls -----------------------------------------------------

# llama-server's --metrics counters (Prometheus text) a sample keeps
LLAMA_COUNTERS = {
    "llamacpp:prompt_tokens_total": "prompt_tokens",
    "llamacpp:prompt_seconds_total": "prompt_seconds",
    "llamacpp:tokens_predicted_total": "decode_tokens",
    "llamacpp:tokens_predicted_seconds_total": "decode_seconds",
}


@dataclass(frozen=True)
class ServingSample:
    """One look at a running serve: its phase and reason, the layers each node holds, requests the
    front forwarded, restarts, and llama-server's counters (since its last start)."""

    at: float
    phase: str
    reason: str
    stages: list[dict]
    requests: int
    restarts: int
    prompt_tokens: float = 0.0
    prompt_seconds: float = 0.0
    decode_tokens: float = 0.0
    decode_seconds: float = 0.0


@dataclass(frozen=True)
class ServingRates:
    """Between two samples: requests/s through the front, prompt and decode tokens per second of
    llama-server's own processing time (0 where it processed nothing)."""

    requests_per_s: float
    prompt_tps: float
    decode_tps: float


def _get(url: str, path: str, timeout: float) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def llama_counters(text: str) -> dict[str, float]:
    """The LLAMA_COUNTERS of llama-server's /metrics text, by their short names."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in LLAMA_COUNTERS:
                found[LLAMA_COUNTERS[sample.name]] = float(sample.value)
    return found


def read_serving(url: str, timeout: float = 2.0) -> ServingSample:
    """One sample of the serve at `url` (its front); OSError or HTTPException when it does not
    answer. /metrics is read only while it serves (it is llama-server's, through the front)."""
    _, body = _get(url, STATUS_PATH, timeout)
    doc = json.loads(body)
    counters: dict[str, float] = {}
    if doc["phase"] == SERVING:
        status, text = _get(url, "/metrics", timeout)
        if status == 200:
            counters = llama_counters(text.decode(errors="replace"))
    return ServingSample(
        at=time.monotonic(),
        phase=doc["phase"],
        reason=doc["reason"],
        stages=doc["stages"],
        requests=doc["requests"]["forwarded"],
        restarts=doc["restarts"],
        **counters,
    )


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def serving_rates(before: ServingSample, after: ServingSample) -> ServingRates:
    """Rates between two samples; across a llama-server restart its counters start again at 0,
    so `after`'s own totals are the change."""
    elapsed = after.at - before.at
    base = before if after.restarts == before.restarts else ServingSample(0, "", "", [], 0, 0)
    return ServingRates(
        requests_per_s=(after.requests - before.requests) / elapsed if elapsed > 0 else 0.0,
        prompt_tps=_rate(
            after.prompt_tokens - base.prompt_tokens, after.prompt_seconds - base.prompt_seconds
        ),
        decode_tps=_rate(
            after.decode_tokens - base.decode_tokens, after.decode_seconds - base.decode_seconds
        ),
    )

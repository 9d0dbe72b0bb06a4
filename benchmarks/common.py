"""Shared benchmark plumbing: start fleetd (fleetd.fleet.local) and the stock server as processes,
print, save JSON."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fleetd.fleet.local import LocalFleet
from fleetd.fleet.procs import process_tree
from fleetd.tools import find_tool
from fleetd.transport import free_port, wait_listening

RESULTS = Path(__file__).resolve().parent / "results"


# On a small machine, whether a server lands on the client's core or the other one changes a
# round trip by 2x. Pin the client to the first core and every server to the rest, the same for
# stock and fleetd, so that placement is not what the ratio measures.
CPUS = sorted(os.sched_getaffinity(0))
CLIENT_CPUS = set(CPUS[:1]) if len(CPUS) > 1 else set(CPUS)
SERVER_CPUS = set(CPUS[1:]) if len(CPUS) > 1 else set(CPUS)


def stop_processes(procs, timeout: float = 10.0) -> None:
    """SIGTERM every process still running, then wait for each, SIGKILL one that outlives
    `timeout`."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout)


def _pin(cpus: set[int]):
    return lambda: os.sched_setaffinity(0, cpus)


def pin_client() -> None:
    os.sched_setaffinity(0, CLIENT_CPUS)


@contextlib.contextmanager
def server_process(kind: str, threads: int = 1, extra: list[str] | None = None):
    """Yield the endpoint of a running 'fleetd' or 'stock' server process, pinned to SERVER_CPUS."""
    with server_with_pid(kind, threads, extra) as (endpoint, _pid):
        yield endpoint


@contextlib.contextmanager
def server_with_pid(kind: str, threads: int = 1, extra: list[str] | None = None):
    """As server_process, yielding (endpoint, the server's pid)."""
    if kind == "fleetd":  # the one fleetd launcher (fleetd.fleet.local); no control API needed
        with LocalFleet(
            1,
            server_args=["--threads", str(threads), *(extra or [])],
            control=False,
            preexec_fn=_pin(SERVER_CPUS),
        ) as local:
            yield local.endpoints[0], local.processes[0].pid
        return
    with stock_process(threads, extra) as (endpoint, proc):
        yield endpoint, proc.pid


def steal_ns() -> float:
    """CPU time the hypervisor gave other guests instead of this machine so far (/proc/stat's
    steal): a cell with much of it ran on a host busy elsewhere."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) * 1e9 / os.sysconf("SC_CLK_TCK")


def tree_cpu_by_process(root: int) -> dict[int, int]:
    """CPU time so far of each live process of `root`'s tree (its live threads, exact), in ns:
    fleetd's daemon, fork server and compute workers, or the stock server."""
    return {pid: cpu_ns(pid) for pid in process_tree(root)}


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far, in ns (schedstat: exact, where /proc's stat
    counts in 10 ms ticks; threads that ended are not in it)."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # the process ended
        return 0
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            pass
    return total


@contextlib.contextmanager
def stock_process(
    threads: int = 1, extra: list[str] | None = None, env: dict | None = None, log: Path | None = None
):
    """Yield (endpoint, Popen) of a running stock ggml-rpc-server pinned to SERVER_CPUS, its
    output into `log` (or nowhere); stopped on exit."""
    port = free_port()
    args = [str(find_tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)]
    with open(log or os.devnull, "ab") as out:  # the child keeps its own fd
        proc = subprocess.Popen(
            args + (extra or []), stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_pin(SERVER_CPUS)
        )
    try:
        wait_listening(port)
        yield f"127.0.0.1:{port}", proc
    finally:
        stop_processes([proc])


def show(title: str, columns: list[str], rows: list[list]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        table.add_row(*(str(x) for x in r))
    Console(width=160).print(table)


def save(name: str, data: dict, path: str | None = None) -> Path:
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    return out

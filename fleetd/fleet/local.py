"""A local fleet: N `python -m fleetd.server` processes on free loopback ports, started and
stopped as one (the one place that starts fleetd processes on this machine).

    with LocalFleet(2, workdir) as local:
        local.fleet          # Fleet of local nodes (control API over loopback, no SSH)
        local.endpoints      # ["127.0.0.1:41234", ...] for an RPC client or llama.cpp --rpc
        local.nodes_file     # a nodes file naming them, for fleetctl

Ready means what a client needs: the RPC port answers HELLO and, when the node has one, the
control API answers /v1/status. fleetctl demo and ab, the benchmarks and the tests that need
real processes all start fleetd here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fleetd.client import RpcClient
from fleetd.errors import FleetError
from fleetd.fleet.node import Fleet
from fleetd.transport import Timeout, free_port

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.1
# One readiness probe: short, since it is retried until START_TIMEOUT_S.
PROBE_TIMEOUT = Timeout(connect=1.0, read=2.0)


def last_line(log: Path) -> str:
    """The last line a started fleetd wrote to its log: what a failed start says."""
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1] if lines else "no output"


def wait_answering(
    proc: subprocess.Popen,
    checks: Sequence[tuple[str, Callable[[], object]]],
    deadline: float,
    where: str,
    log: Path,
) -> None:
    """Each (what, check) in turn, retried until it passes: a started fleetd is ready when it
    answers. A process that exits, or a check still failing at `deadline`, is a FleetError
    naming `where`, what did not answer, and the last line of its log."""
    for what, check in checks:
        while True:
            if proc.poll() is not None:
                raise FleetError(f"{where} exited with {proc.returncode}: {last_line(log)}")
            try:
                check()
                break
            except Exception as exc:  # not up yet: retried until the deadline
                if time.monotonic() > deadline:
                    raise FleetError(
                        f"{where}: no answer to {what} in time: {exc} ({last_line(log)})"
                    ) from None
                time.sleep(POLL_S)


class LocalFleet:
    """`count` fleetd processes on 127.0.0.1, each with its own RPC and control port.

    `server_args` go to every `fleetd` (e.g. ["--threads", "1"]); `control=False` starts them
    without the control API (`--control-port 0`; `fleet` then cannot ask them anything).
    `preexec_fn` runs in each child before exec (the benchmarks pin servers to cores with it).
    Logs go to `workdir/node-<i>.log`; without a workdir, to a temporary one removed on stop.
    """

    def __init__(
        self,
        count: int = 2,
        workdir: str | Path | None = None,
        *,
        server_args: Sequence[str] = (),
        control: bool = True,
        log_level: str = "info",
        start_timeout: float = START_TIMEOUT_S,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        if count < 1:
            raise FleetError(f"local fleet: {count} nodes: need at least 1")
        self.count = count
        self.server_args = list(server_args)
        self.control = control
        self.log_level = log_level
        self.start_timeout = start_timeout
        self.preexec_fn = preexec_fn
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fleetd-local-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.processes: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        self.nodes_file = self.workdir / "nodes.txt"
        self.fleet = Fleet()

    def __repr__(self) -> str:
        return f"<LocalFleet {', '.join(self.endpoints) or f'{self.count} nodes, not started'}>"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> LocalFleet:
        """Start the fleetd processes on free loopback ports, write their nodes file and wait until
        each answers HELLO (and its control API); on failure all are stopped."""
        try:
            lines = []
            for i in range(self.count):
                rpc = free_port()
                control = free_port() if self.control else 0
                self.processes.append(self._spawn(i, rpc, control))
                self.endpoints.append(f"127.0.0.1:{rpc}")
                lines.append(
                    f"localhost rpc_port={rpc}"
                    + (f" control_port={control}" if control else "")
                    + f" name=local-{i}"
                )
            self.nodes_file.write_text(
                "# a local fleet on loopback (fleetd.fleet.local)\n" + "\n".join(lines) + "\n"
            )
            self.fleet = Fleet.load(self.nodes_file)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, i: int, rpc: int, control: int) -> subprocess.Popen:
        log_path = self.workdir / f"node-{i}.log"
        args = [
            sys.executable,
            "-m",
            "fleetd.server",
            "--host",
            "127.0.0.1",
            "--port",
            str(rpc),
            "--control-port",
            str(control),
            "--log-level",
            self.log_level,
            "--log-file",
            str(log_path.absolute()),
            *self.server_args,
        ]
        # stdout and stderr (a traceback before logging starts) append to the same file
        with open(log_path, "ab") as log:  # the child keeps its own copy
            return subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                preexec_fn=self.preexec_fn,
            )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        for i in range(len(self.processes)):
            self._wait_node(i, deadline)

    def _wait_node(self, i: int, deadline: float) -> None:
        node, proc, endpoint = self.fleet[i], self.processes[i], self.endpoints[i]
        checks = [("HELLO", lambda: RpcClient(endpoint, PROBE_TIMEOUT).open().close())]
        if self.control:
            checks.append(("the control API", node.status))
        log = self.workdir / f"node-{i}.log"
        wait_answering(proc, checks, deadline, f"{node.name} ({endpoint})", log)

    # -- one node: a crash and its return (what a supervisor or systemd would do) -------------

    def kill(self, i: int) -> None:
        """SIGKILL node `i`, as a crash or the OOM killer would, and reap it."""
        self.processes[i].kill()
        self.processes[i].wait()

    def restart(self, i: int) -> None:
        """Start node `i` again on its own RPC and control ports (after it exited or was killed)
        and wait until it answers."""
        if self.processes[i].poll() is None:
            raise FleetError(f"{self.fleet[i].name}: still running")
        rpc = int(self.endpoints[i].rsplit(":", 1)[1])
        control = self.fleet[i].spec.control_port if self.control else 0
        self.processes[i] = self._spawn(i, rpc, control)
        self._wait_node(i, time.monotonic() + self.start_timeout)

    def stop(self) -> None:
        """Close the fleet, terminate the processes (killed after STOP_TIMEOUT_S) and drop a temporary
        workdir."""
        self.fleet.close()
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        for p in self.processes:
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.processes = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

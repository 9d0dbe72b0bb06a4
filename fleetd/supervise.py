"""A minimal supervisor for nodes without systemd: `python -m fleetd.supervise -- CMD...`.

Restarts CMD when it exits abnormally, with a growing delay, and gives up after MAX_RESTARTS
within WINDOW_S (a daemon that cannot start must fail its health check, not loop forever).
SIGTERM/SIGINT are passed on to the child and end the supervisor.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

MAX_RESTARTS = 5
WINDOW_S = 60.0


def main(argv: list[str] | None = None) -> int:
    """Run COMMAND, restarting it after an abnormal exit with a doubling delay; give up after
    MAX_RESTARTS within WINDOW_S, and stop with it on SIGTERM or SIGINT."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m fleetd.supervise -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    stopping = False
    child: subprocess.Popen | None = None

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    restarts: list[float] = []
    while True:
        child = subprocess.Popen(argv)
        rc = child.wait()
        if stopping or rc == 0:
            return rc
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < WINDOW_S] + [now]
        if len(restarts) > MAX_RESTARTS:
            print(
                f"fleetd.supervise: {argv[0]} exited {rc} {len(restarts)} times in {WINDOW_S:.0f}s, "
                "giving up",
                file=sys.stderr,
                flush=True,
            )
            return rc
        delay = min(10.0, 0.5 * 2 ** (len(restarts) - 1))
        print(
            f"fleetd.supervise: {argv[0]} exited {rc}, restarting in {delay:.1f}s",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(delay)


if __name__ == "__main__":
    sys.exit(main())

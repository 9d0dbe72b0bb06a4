"""A minimal supervisor for nodes without systemd: `python -m fleetd.supervise [OPTIONS] -- CMD...`.

Restarts CMD when it exits abnormally, with a growing delay, and gives up after MAX_RESTARTS
within WINDOW_S (a daemon that cannot start must fail its health check, not loop forever).
SIGTERM/SIGINT are passed on to the child and end the supervisor (exit 0 when the child ended
by it): a signal that arrives while it waits to restart ends it there, without starting CMD
again.

The options make it behave as fleetd's systemd unit does (`fleetctl lab up --restart S`):

    --restart-sec S   a fixed delay before each restart (RestartSec=), instead of the doubling one
    --always          restart after exit 0 too (Restart=always; default: on failure only)
    --burst N         give up when CMD was started N times within --interval (StartLimitBurst=)
    --interval S      that window (StartLimitIntervalSec=)
    --pid-file PATH   CMD's current pid, rewritten at each start (temporary name + rename),
                      removed when the supervisor ends

Each exit and restart is one line on stderr with the wall-clock time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

MAX_RESTARTS = 5
WINDOW_S = 60.0
FIRST_DELAY_S, MAX_DELAY_S = 0.5, 10.0  # the doubling delay without --restart-sec
SLEEP_STEP_S = 0.05  # how soon a stop signal ends a wait to restart


def _say(text: str) -> None:
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"
    print(f"{stamp} fleetd.supervise: {text}", file=sys.stderr, flush=True)


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited {rc}"


def _label(argv: list[str]) -> str:
    """`python -m fleetd.server` -> "python -m fleetd.server"; a plain command -> its name."""
    name = os.path.basename(argv[0])
    return f"{name} -m {argv[2]}" if argv[1:2] == ["-m"] and len(argv) > 2 else name


def _write_pid(path: str | None, pid: int) -> None:
    if path is None:
        return
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        f.write(f"{pid}\n")
    os.replace(tmp, path)


def _parse(argv: list[str]) -> argparse.Namespace | None:
    p = argparse.ArgumentParser(prog="python -m fleetd.supervise", add_help=True)
    p.add_argument("--restart-sec", type=float, default=None, metavar="S")
    p.add_argument("--always", action="store_true")
    p.add_argument("--burst", type=int, default=None, metavar="N")
    p.add_argument("--interval", type=float, default=None, metavar="S")
    p.add_argument("--pid-file", default=None, metavar="PATH")
    p.add_argument("command", nargs=argparse.REMAINDER)
    if "--" in argv:  # everything after the first "--" is the command, untouched
        at = argv.index("--")
        args = p.parse_args(argv[:at])
        args.command = argv[at + 1 :]
    else:
        args = p.parse_args(argv)
    if not args.command:
        return None
    if args.restart_sec is not None and not 0 <= args.restart_sec <= 3600:
        p.error("--restart-sec: must be in 0..3600")
    if args.burst is not None and args.burst < 1:
        p.error("--burst: must be at least 1")
    if args.interval is not None and args.interval <= 0:
        p.error("--interval: must be above 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run COMMAND, restarting it after an abnormal exit (any exit with --always) after a delay;
    give up when it was started too often within the window, and stop with it on SIGTERM or
    SIGINT."""
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    if args is None:
        print("usage: python -m fleetd.supervise [OPTIONS] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    command, label = args.command, _label(args.command)
    # without the options: MAX_RESTARTS restarts (MAX_RESTARTS + 1 starts) within WINDOW_S
    burst = args.burst if args.burst is not None else MAX_RESTARTS + 1
    window = args.interval if args.interval is not None else WINDOW_S
    stopping = False
    child: subprocess.Popen | None = None

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    starts: list[float] = []
    try:
        while True:
            starts.append(time.monotonic())
            child = subprocess.Popen(command)
            if stopping:  # a signal between the wait below and this start: end it at once
                child.terminate()
            _write_pid(args.pid_file, child.pid)
            if len(starts) > 1:
                _say(f"started {label} again, pid {child.pid}")
            rc = child.wait()
            if stopping:  # ended on our SIGTERM/SIGINT: a clean stop
                return rc if rc > 0 else 0
            if rc == 0 and not args.always:
                return rc
            now = time.monotonic()
            starts = [t for t in starts if now - t < window]
            if len(starts) >= burst:
                _say(
                    f"{label} (pid {child.pid}) {_exit_text(rc)}; started {len(starts)} times in "
                    f"{window:g}s, giving up"
                )
                return rc if rc > 0 else 1
            if args.restart_sec is not None:
                delay = args.restart_sec
            else:
                delay = min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (len(starts) - 1))
            _say(f"{label} (pid {child.pid}) {_exit_text(rc)}; restarting in {delay:.1f}s")
            end = time.monotonic() + delay
            while not stopping and (left := end - time.monotonic()) > 0:
                time.sleep(min(SLEEP_STEP_S, left))
            if stopping:
                return rc if rc > 0 else 0
    finally:
        if args.pid_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(args.pid_file)


if __name__ == "__main__":
    sys.exit(main())

"""fleetd.supervise, the supervisor without systemd (and the lab's, `fleetctl lab up --restart`):
a killed child is started again after --restart-sec with its pid in --pid-file, --burst starts
within --interval end it, and a SIGTERM while it waits to restart ends it without a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = [sys.executable, "-c", "import time; time.sleep(60)"]


def supervise(tmp_path: Path, *options: str) -> tuple[subprocess.Popen, Path]:
    pid_file = tmp_path / "child.pid"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetd.supervise", *options, "--pid-file", str(pid_file), "--", *CHILD],
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, pid_file


def wait_pid(pid_file: Path, other_than: int | None = None, seconds: float = 10.0) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            pid = int(pid_file.read_text())
            if pid != other_than:
                return pid
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"no new pid in {pid_file} within {seconds}s")


def test_a_killed_child_is_restarted_after_restart_sec_until_the_burst(tmp_path):
    options = ("--restart-sec", "0.3", "--always", "--burst", "3", "--interval", "60")
    proc, pid_file = supervise(tmp_path, *options)
    try:
        first = wait_pid(pid_file)
        killed = time.monotonic()
        os.kill(first, signal.SIGKILL)
        second = wait_pid(pid_file, first)
        assert time.monotonic() - killed >= 0.3  # RestartSec
        os.kill(second, signal.SIGKILL)
        third = wait_pid(pid_file, second)
        os.kill(third, signal.SIGKILL)  # the third start within the window: it gives up
        assert proc.wait(10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert err.count("killed by SIGKILL; restarting in 0.3s") == 2, err
    assert err.count(" again, pid ") == 2, err
    assert "started 3 times in 60s, giving up" in err, err
    assert not pid_file.exists()


def test_sigterm_while_waiting_to_restart_ends_it_without_a_restart(tmp_path):
    proc, pid_file = supervise(tmp_path, "--restart-sec", "5", "--always")
    try:
        first = wait_pid(pid_file)
        os.kill(first, signal.SIGKILL)
        time.sleep(0.5)  # it now waits 5 s to restart
        stopped = time.monotonic()
        proc.terminate()
        proc.wait(5)
        assert time.monotonic() - stopped < 2.0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert "restarting in 5.0s" in err and "again, pid" not in err, err
    assert not pid_file.exists()


def test_sigterm_is_passed_on_to_the_child_and_ends_both(tmp_path):
    proc, pid_file = supervise(tmp_path, "--restart-sec", "0.1", "--always")
    try:
        child = wait_pid(pid_file)
        proc.terminate()
        assert proc.wait(10) == 0  # the child ended by the signal it was asked to end by
        assert (
            not Path(f"/proc/{child}").exists()
            or b"time.sleep" not in Path(f"/proc/{child}/cmdline").read_bytes()
        )
    finally:
        if proc.poll() is None:
            proc.kill()

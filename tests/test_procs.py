"""fleetd.fleet.procs on real processes: a process's children and its whole tree, as the lab's
CPU accounting (a daemon, then its fork server with the workers it forks) reads them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from fleetd.fleet.procs import children_of, process_tree


def test_children_and_tree_of_a_parent_with_a_grandchild():
    # a child that starts a grandchild and waits on it: parent -> child -> grandchild
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '30'])"],
    )
    grandchild = None
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        tree = process_tree(child.pid)
        assert len(tree) == 2, tree
        grandchild = tree[1]
        assert children_of(os.getpid()).count(child.pid) == 1
        assert children_of(child.pid) == [grandchild]
        assert children_of(grandchild) == []
        assert process_tree(os.getpid())[0] == os.getpid()
        assert {child.pid, grandchild} <= set(process_tree(os.getpid()))
    finally:
        for pid in process_tree(child.pid)[1:] + ([grandchild] if grandchild else []):
            try:  # the grandchild first: once its parent dies it is no longer in our tree
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        child.kill()
        child.wait()

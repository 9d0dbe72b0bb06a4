"""Local processes as /proc shows them: a process and its descendants (a lab node's fleetd with
its fork server and compute workers), for the lab's measurements and the tests' hang reports."""

from __future__ import annotations

from pathlib import Path


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant, parents before their children, siblings by pid."""
    children = _children_by_parent()
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += sorted(children.get(pid, []))
    return out


def children_of(pid: int) -> list[int]:
    """`pid`'s live child processes (fleetd's fork server, whose children are its workers)."""
    return sorted(_children_by_parent().get(pid, []))

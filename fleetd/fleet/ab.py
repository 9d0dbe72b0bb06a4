"""A/B on a real fleet: the same layer split through the coordinator (hub) and with
COPY_TENSOR_TO (direct), per-step accounting side by side, outputs compared by md5, and what
the nodes themselves counted (peer copies, fallbacks) over each arm."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from fleetd.errors import FleetError, TransportError
from fleetd.fleet.node import Fleet
from fleetd.pipeline import Pipeline, per_step


def abba(rounds: int) -> tuple[str, ...]:
    """The arms' order over `rounds` rounds: (hub, direct), (direct, hub), ... so that drift on a
    shared machine, and whichever arm runs first in a round, hit both alike."""
    return tuple(
        arm for r in range(rounds) for arm in (("hub", "direct") if r % 2 == 0 else ("direct", "hub"))
    )


@dataclass
class ArmResult:
    """One arm of a synthetic A/B: its per-step accounting, output md5, time per step, and the
    peer copies and fallbacks the nodes counted meanwhile."""

    arm: str
    per_step: dict
    md5: str
    seconds_per_step: float
    node_peer_copies: int  # copies the nodes report as done during this arm
    node_fallbacks: int

    def as_dict(self) -> dict:
        return {
            "arm": self.arm,
            "per_step": self.per_step,
            "md5": self.md5,
            "seconds_per_step": self.seconds_per_step,
            "node_peer_copies": self.node_peer_copies,
            "node_fallbacks": self.node_fallbacks,
        }


def _peer_totals(fleet: Fleet) -> tuple[int, int]:
    """(copies ok, fallbacks) summed over nodes that answer; nodes that do not count as 0."""
    copies = fallbacks = 0
    for value in fleet.map(lambda n: n.stats()).values():
        if isinstance(value, Exception):
            continue
        copies += value.peer.copies_ok
        fallbacks += value.peer.fallback_count
    return copies, fallbacks


def node_lost(fleet: Fleet, exc: TransportError, arm: str) -> FleetError:
    """A transport error mid-run as the node it came from and what to do: the message names an
    endpoint ("SET_TENSOR to 127.0.0.1:51003: ..."), the nodes file names the node."""
    text = str(exc)
    hit = next((n for n in fleet if n.spec.rpc_endpoint in text), None)
    who = f"node {hit.name} ({hit.spec.rpc_endpoint})" if hit is not None else "a node"
    return FleetError(
        f"{who} stopped answering during the {arm} arm ({type(exc).__name__}: {text}). "
        "Nothing was measured; see `fleetctl status NODES` and `fleetctl logs NODES`, "
        "then `fleetctl start NODES` (or restart it) and run ab again"
    )


def run_arm(
    fleet: Fleet,
    endpoints: list[str],
    arm: str,
    layers: int,
    rows: int,
    n_embd: int,
    steps: int,
    local_last: bool,
) -> ArmResult:
    """One arm: `steps` pipeline steps (the first, which uploads the graph, left out of the
    time), the nodes' peer counters around it; a node lost mid-arm is named (node_lost)."""
    try:
        before = _peer_totals(fleet)
        with Pipeline(
            endpoints, layers, rows, n_embd, local_last=local_last, p2p=arm == "direct", stats=False
        ) as p:
            results = [p.step()]  # GRAPH_COMPUTE: left out of the per-step window
            t0 = time.perf_counter()
            results += [p.step() for _ in range(steps - 1)]
            elapsed = time.perf_counter() - t0
        after = _peer_totals(fleet)
    except TransportError as exc:
        raise node_lost(fleet, exc, arm) from exc
    window = results[1:] or results
    return ArmResult(
        arm,
        per_step(window),
        hashlib.md5(b"".join(r.output for r in results)).hexdigest(),
        elapsed / max(1, len(results) - 1),
        after[0] - before[0],
        after[1] - before[1],
    )


def compare(
    fleet: Fleet,
    layers: int | None = None,
    rows: int = 32,
    n_embd: int = 5120,
    steps: int = 5,
    local_last: bool = True,
    order: tuple[str, ...] = abba(2),
) -> dict:
    """Both arms, in an ABBA order (`abba`) so drift on a shared machine hits both alike."""
    endpoints = [n.spec.rpc_endpoint for n in fleet]
    stages = len(endpoints) + int(local_last)
    layers = layers or 2 * stages
    runs = [run_arm(fleet, endpoints, arm, layers, rows, n_embd, steps, local_last) for arm in order]
    arms = {}
    for r in runs:
        arms.setdefault(r.arm, []).append(r)
    summary = {
        arm: {
            "per_step": rs[0].per_step,
            "md5": rs[0].md5,
            "seconds_per_step": sorted(x.seconds_per_step for x in rs)[len(rs) // 2],
            "node_peer_copies": sum(x.node_peer_copies for x in rs),
            "node_fallbacks": sum(x.node_fallbacks for x in rs),
        }
        for arm, rs in arms.items()
    }
    md5s = {r.md5 for r in runs}
    return {
        "stages": stages,
        "layers": layers,
        "rows": rows,
        "n_embd": n_embd,
        "steps": steps,
        "rounds": len(order) // 2,
        "arms": summary,
        "runs": [r.as_dict() for r in runs],
        "outputs_identical": len(md5s) == 1,
    }

#!/usr/bin/env python3
"""A GRAPH_COMPUTE's intake: fleetd vs the stock server, for graphs sent again and for new ones.

    benchmarks/intake.py [--nodes 300] [--rounds 30] [--json PATH]

llama.cpp sends a whole GRAPH_COMPUTE whenever its graph changed since the last one (a decode
step after a prompt's micro-batch, a repetition of llama-bench, a server between prompts), and
GRAPH_RECOMPUTE only for the same graph again. fleetd checks every graph against its rules,
plans it and has the session's worker build it; a session keeps its last 4 graphs planned and
its worker keeps them built (docs/DESIGN.md, "Planned graphs"). Two cases, each a chain of
--nodes MUL/ADD nodes over 1 KiB tensors (the compute is microseconds: the time is the intake):

- `in turn`: two graphs sent one after the other, as llama-bench's prompt and decode tests do
  (fleetd runs the plans it kept);
- `new`: a graph not sent before every time (fleetd checks, plans and builds each).

The figure is the median of compute + a GET_ALIGNMENT round trip (ms), and fleetd / stock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pin_client, save, server_with_pid, show  # noqa: E402

from fleetd.client import RpcClient  # noqa: E402
from fleetd.client.graph import GraphBuilder  # noqa: E402
from fleetd.wire import GgmlOp, GgmlType  # noqa: E402

WIDTH = 256  # floats a tensor
SLOTS = 64  # distinct graphs for the `new` case, each at its own place in the buffer


def chain(ptr: int, base: int, nodes: int, slot: int) -> bytes:
    """A GRAPH_COMPUTE payload: x * w + w * w ... over `nodes` nodes, its tensors at `slot`."""
    g = GraphBuilder()
    stride = WIDTH * 4
    at = base + slot * (nodes + 2) * stride
    x = g.tensor(GgmlType.F32, (WIDTH,), ptr, at)
    w = g.tensor(GgmlType.F32, (WIDTH,), ptr, at + stride)
    cur = x
    for i in range(nodes):
        node = g.tensor(GgmlType.F32, (WIDTH,), ptr, at + (i + 2) * stride)
        node.op, node.src = (GgmlOp.ADD if i % 2 else GgmlOp.MUL), [cur, w]
        cur = node
    return g.serialize([cur])


def measure(endpoint: str, nodes: int, rounds: int) -> dict[str, float]:
    """Median ms of a GRAPH_COMPUTE and a round trip behind it, per case."""
    c = RpcClient(endpoint).open()
    try:
        size = SLOTS * (nodes + 2) * WIDTH * 4
        ptr, _ = c.alloc_buffer(size)
        base = c.buffer_get_base(ptr)
        graphs = [chain(ptr, base, nodes, slot) for slot in range(SLOTS)]

        def timed(payload: bytes) -> float:
            t0 = time.perf_counter()
            c.graph_compute(payload)
            c.get_alignment()
            return (time.perf_counter() - t0) * 1e3

        for g in graphs[:2]:  # warm: the worker, the two graphs `in turn` sends
            timed(g)
        in_turn = [timed(graphs[i % 2]) for i in range(2 * rounds)]
        new = [timed(graphs[2 + i % (SLOTS - 2)]) for i in range(min(rounds, SLOTS - 2))]
        c.free_buffer(ptr)
        return {"in turn": statistics.median(in_turn), "new": statistics.median(new)}
    finally:
        c.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=300, help="nodes a graph (a llama layer is ~20-30)")
    p.add_argument("--rounds", type=int, default=30, help="computes per case (at most 62 for `new`)")
    p.add_argument("--json", help="where to write the JSON (default benchmarks/results/intake.json)")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.rounds < 1:
        p.error("--nodes and --rounds must be at least 1")
    pin_client()
    with server_with_pid("stock") as (stock_ep, _), server_with_pid("fleetd") as (fleetd_ep, _):
        stock = measure(stock_ep, args.nodes, args.rounds)
        fleetd = measure(fleetd_ep, args.nodes, args.rounds)
    rows = [
        [case, f"{stock[case]:.2f}", f"{fleetd[case]:.2f}", f"{fleetd[case] / stock[case]:.2f}"]
        for case in stock
    ]
    show(
        f"GRAPH_COMPUTE of a {args.nodes}-node graph, then a round trip (median ms)",
        ["graphs", "stock", "fleetd", "fleetd / stock"],
        rows,
    )
    out = save(
        "intake",
        {"nodes": args.nodes, "rounds": args.rounds, "stock_ms": stock, "fleetd_ms": fleetd},
        args.json,
    )
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

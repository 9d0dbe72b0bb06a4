#!/usr/bin/env python3
"""One decode step's round trip with a near-empty graph: fleetd vs the stock server.

    benchmarks/hop.py [--steps 2000] [--rounds 5] [--hidden-kib 16] [--gap-ms 3] [--daemon-loop]
                      [--json PATH]

A step is what llama.cpp sends a node per token once its graph is stored: the inputs
(SET_TENSOR of a token id, a position, and a hidden state), GRAPH_RECOMPUTE, and the GET_TENSOR
of the result, which waits for the compute. The graph is one small ADD, so the time is what a
server spends around a graph: parsing, checks, the hand-off to a compute worker and back, the
reply. Servers run side by side (pinned away from the client), rounds alternate their order;
the figure is the median step, its ratio fleetd / stock (lower is better), and the difference
in microseconds, which the Python client's own share (the same for both) does not dilute.

Beside the time, the CPU each server's processes spend per step (every live thread, exact, from
schedstat): on a node whose cores are shared (the lab, a busy machine) that is what a step costs
the others. fleetd's is split into the daemon (its session thread: the socket, the checks, the
hand-off) and the compute worker (the graph, its side of the hand-off). With --daemon-loop a
third server runs: fleetd with its loop kept in the daemon (FLEETD_STINTS=0), where by default
the session's worker takes the connection while its stored graph decodes (docs/DESIGN.md,
"Stints").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pin_client, save, server_with_pid, show, tree_cpu_by_process  # noqa: E402

from fleetd.client import RpcClient  # noqa: E402
from fleetd.client.graph import GraphBuilder  # noqa: E402
from fleetd.wire import GgmlType  # noqa: E402


class Step:
    """A stored graph on one server and the commands of one decode step against it."""

    def __init__(self, endpoint: str, hidden: int) -> None:
        self.client = RpcClient(endpoint).open()
        n = hidden // 4
        self.ptr, _ = self.client.alloc_buffer(3 * hidden + 4096)
        base = self.client.buffer_get_base(self.ptr)
        g = GraphBuilder()
        self.token = g.tensor(GgmlType.I32, (1,), self.ptr, base)
        self.pos = g.tensor(GgmlType.I32, (1,), self.ptr, base + 64)
        self.x = g.tensor(GgmlType.F32, (n,), self.ptr, base + 4096)
        w = g.tensor(GgmlType.F32, (n,), self.ptr, base + 4096 + hidden)
        out = g.place(g.add(self.x, w), self.ptr, base + 4096 + 2 * hidden)
        self.out = out
        self.hidden = np.random.default_rng(1).standard_normal(n).astype(np.float32)
        self.result = np.empty(n, np.float32)
        self.client.set_tensor(w.rpc(), np.ones(n, np.float32))
        self.client.set_tensor(self.x.rpc(), self.hidden)
        self.client.graph_compute(g.serialize([out]))
        self.client.get_tensor(out.rpc(), out=self.result)
        assert np.allclose(self.result, self.hidden + 1), "the server computed a wrong sum"
        self.rpc = (self.token.rpc(), self.pos.rpc(), self.x.rpc(), out.rpc())
        self.ids = np.zeros(1, np.int32)

    def run(self, steps: int, gap: float = 0.0) -> list[float]:
        """Seconds of each step; with `gap`, that long idle after each (not timed), as a lab
        node waits for the other nodes between its steps."""
        token, pos, x, out = self.rpc
        c, ids, hidden, result = self.client, self.ids, self.hidden, self.result
        times = []
        for i in range(steps):
            ids[0] = i
            t0 = time.perf_counter()
            c.set_tensor(token, ids)
            c.set_tensor(pos, ids)
            c.set_tensor(x, hidden)
            c.graph_recompute(0)
            c.get_tensor(out, out=result)
            times.append(time.perf_counter() - t0)
            if gap:
                time.sleep(gap)
        return times

    def close(self) -> None:
        self.client.free_buffer(self.ptr)
        self.client.close()


@contextlib.contextmanager
def fleetd_server(extra: list[str], daemon_loop: bool):
    """A fleetd node; with `daemon_loop`, its loop kept in the daemon (FLEETD_STINTS=0 in its
    environment, this process's own left as it was) where the session's worker would take the
    connection for stints."""
    with contextlib.ExitStack() as stack:
        was = os.environ.get("FLEETD_STINTS")
        if daemon_loop:
            os.environ["FLEETD_STINTS"] = "0"
        try:
            server = stack.enter_context(server_with_pid("fleetd", extra=extra))
        finally:
            if was is None:
                os.environ.pop("FLEETD_STINTS", None)
            else:
                os.environ["FLEETD_STINTS"] = was
        yield server


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="steps per server per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the servers' order reversed each round")
    p.add_argument("--hidden-kib", type=int, default=16, help="the hidden state's size (KiB)")
    p.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="idle this long after each step (a lab node between its tokens: 3 ms); default none",
    )
    p.add_argument(
        "--daemon-loop",
        action="store_true",
        help="a third server: fleetd with its loop kept in the daemon (no stints), for A/B",
    )
    p.add_argument("--fleetd-args", default="", help='more fleetd flags, e.g. "-d numpy"')
    p.add_argument("--json", help="where to write the JSON (default benchmarks/results/hop.json)")
    args = p.parse_args(argv)
    pin_client()
    arms = ["fleetd"] + (["fleetd, loop in daemon"] if args.daemon_loop else [])
    names = ["stock", *arms]
    medians: dict[str, list[float]] = {n: [] for n in names}
    cpu_us: dict[str, list[float]] = {n: [] for n in names}
    for arm in arms:
        cpu_us[f"{arm} daemon"], cpu_us[f"{arm} worker"] = [], []
    extra = args.fleetd_args.split()
    with contextlib.ExitStack() as stack:
        servers = {"stock": stack.enter_context(server_with_pid("stock"))}
        for arm in arms:
            servers[arm] = stack.enter_context(fleetd_server(extra, arm != "fleetd"))
        roots = {n: pid for n, (_, pid) in servers.items()}
        steps = {n: Step(ep, args.hidden_kib * 1024) for n, (ep, _) in servers.items()}
        try:
            for s in steps.values():
                s.run(200)  # warm: the worker, the caches, the branch predictors
            for r in range(args.rounds):
                order = names if r % 2 == 0 else names[::-1]
                for name in order:
                    before = tree_cpu_by_process(roots[name])
                    medians[name].append(statistics.median(steps[name].run(args.steps, args.gap_ms / 1e3)))
                    after = tree_cpu_by_process(roots[name])
                    per = {pid: (after[pid] - before.get(pid, 0)) / args.steps / 1e3 for pid in after}
                    cpu_us[name].append(sum(per.values()))
                    if name != "stock":  # the daemon's own threads, the rest is its workers'
                        daemon = per.get(roots[name], 0.0)
                        cpu_us[f"{name} daemon"].append(daemon)
                        cpu_us[f"{name} worker"].append(sum(per.values()) - daemon)
        finally:
            for s in steps.values():
                s.close()
    stock_us = statistics.median(medians["stock"]) * 1e6
    results: dict[str, dict] = {}
    wall_rows, cpu_rows = [], []
    for arm in arms:
        ratios = [f / s for f, s in zip(medians[arm], medians["stock"])]
        diffs = [(f - s) * 1e6 for f, s in zip(medians[arm], medians["stock"])]
        cpu_ratios = [f / s for f, s in zip(cpu_us[arm], cpu_us["stock"])]
        results[arm] = {
            "step_s": medians[arm],
            "ratio": statistics.median(ratios),
            "extra_us": statistics.median(diffs),
            "cpu_ratio": statistics.median(cpu_ratios),
        }
        wall_rows.append(
            [
                arm,
                f"{stock_us:.1f}",
                f"{statistics.median(medians[arm]) * 1e6:.1f}",
                f"{statistics.median(ratios):.2f}",
                f"{statistics.median(diffs):+.1f}",
                f"{min(ratios):.2f}..{max(ratios):.2f}",
            ]
        )
        cpu_rows.append(
            [
                arm,
                *(
                    f"{statistics.median(cpu_us[k]):.1f}"
                    for k in ("stock", arm, f"{arm} daemon", f"{arm} worker")
                ),
                f"{statistics.median(cpu_ratios):.2f}",
                f"{min(cpu_ratios):.2f}..{max(cpu_ratios):.2f}",
            ]
        )
    show(
        f"One decode step's round trip, {args.hidden_kib} KiB hidden state"
        + (f", {args.gap_ms:g} ms idle after each" if args.gap_ms else "")
        + " (median step, µs)",
        ["server", "stock", "it", "ratio (paired median)", "it - stock µs", "spread of the ratio"],
        wall_rows,
    )
    show(
        "Server CPU per step (µs, median of rounds; fleetd = daemon + compute worker)",
        ["server", "stock", "it", "daemon", "worker", "it / stock (paired)", "spread"],
        cpu_rows,
    )
    out = save(
        "hop",
        {
            "hidden_bytes": args.hidden_kib * 1024,
            "gap_ms": args.gap_ms,
            "steps": args.steps,
            "rounds": args.rounds,
            "stock_step_s": medians["stock"],
            "fleetd_step_s": medians["fleetd"],
            # the default fleetd's, as before; every arm's in "arms"
            "ratio": results["fleetd"]["ratio"],
            "extra_us": results["fleetd"]["extra_us"],
            "cpu_us_per_step": cpu_us,
            "cpu_ratio": results["fleetd"]["cpu_ratio"],
            "arms": results,
        },
        args.json,
    )
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

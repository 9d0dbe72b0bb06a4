"""SET_TENSOR / GET_TENSOR throughput and small-command latency: fleetd vs the stock server.

    .venv/bin/python benchmarks/transfer.py [--max-mib 256] [--json PATH]

All servers run as separate processes on loopback, driven by the same Python client; sizes are
measured alternately (stock, fleetd, fleetd without counters, then the reverse order in the next
round) so drift on a shared machine hits all alike. Ratio = fleetd / stock (throughput: higher is
better; latency: lower is better), taken per round and given as the median and min..max over the
rounds: on this shared host one round's ratio moves by up to 2x either way, and a ratio of
medians taken minutes apart says less than the paired one. "count cost" = fleetd / fleetd with
command counting switched off (1.00 = free).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_ns, pin_client, save, server_with_pid, show  # noqa: E402

from fleetd.client import RpcClient  # noqa: E402
from fleetd.wire import GgmlType, RpcTensor, contiguous_strides  # noqa: E402

KIB = 1024
MIB = 1024 * KIB


def sizes(max_bytes: int) -> list[int]:
    out, n = [], 4 * KIB
    while n <= max_bytes:
        out.append(n)
        n *= 4
    return out


def reps_for(size: int) -> int:
    # ~64 MiB per measurement, at least 3, at most 2000 (a 4 KiB measurement then lasts
    # ~0.1-0.3 s, long enough to average over the host's scheduling hiccups): bounded in count.
    return max(3, min(2000, (64 * MIB) // size))


class Target:
    def __init__(self, endpoint: str, pid: int, max_bytes: int):
        self.pid = pid
        self.cpu_per_op = 0.0  # the server's CPU seconds per request in the last measurement
        self.client = RpcClient(endpoint).open()
        self.ptr, _ = self.client.alloc_buffer(max_bytes)
        self.base = self.client.buffer_get_base(self.ptr)

    def tensor(self, size: int) -> RpcTensor:
        ne = (size // 4, 1, 1, 1)
        return RpcTensor(
            id=1,
            type=GgmlType.F32,
            buffer=self.ptr,
            ne=ne,
            nb=contiguous_strides(GgmlType.F32, ne),
            data=self.base,
        )

    def _throughput(self, size: int, request, then=lambda: None) -> float:
        """Bytes a second over reps_for(size) requests (`then` ends the timed part), the
        server's CPU per request into cpu_per_op."""
        n = reps_for(size)
        c0, t0 = cpu_ns(self.pid), time.perf_counter()
        for _ in range(n):
            request()
        then()
        seconds = time.perf_counter() - t0
        self.cpu_per_op = (cpu_ns(self.pid) - c0) / 1e9 / n
        return n * size / seconds

    def set_throughput(self, size: int, data: np.ndarray) -> float:
        t = self.tensor(size)
        self.client.sync()
        # SET_TENSOR has no response: the round trip after them proves they landed
        return self._throughput(size, lambda: self.client.set_tensor(t, data), self.client.sync)

    def get_throughput(self, size: int, out: np.ndarray) -> float:
        t = self.tensor(size)
        return self._throughput(size, lambda: self.client.get_tensor(t, 0, size, out=out))

    def latency(self, n: int) -> float:
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.client.get_alignment(0)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def close(self):
        self.client.free_buffer(self.ptr)
        self.client.close()


def run(max_bytes: int, rounds: int, latency_calls: int) -> dict:
    results = {"set": {}, "get": {}, "latency": {}, "cpu_set": {}, "cpu_get": {}}
    with (
        server_with_pid("stock") as stock,
        server_with_pid("fleetd") as fleetd,
        server_with_pid("fleetd", extra=["--no-counters"]) as nocount,
    ):
        servers = {"stock": stock, "fleetd": fleetd, "fleetd-nocount": nocount}
        for size in sizes(max_bytes):
            data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
            out = np.empty(size, np.uint8)
            for kind in ("set", "get"):
                for name in servers:
                    results[kind].setdefault(name, {})[size] = []
                    results["cpu_" + kind].setdefault(name, {})[size] = []
                for r in range(rounds):
                    for name, server in alternate(servers, r):
                        # a connection of its own each time: loopback TCP settles a connection
                        # into a fast or a slow regime for bulk sends (256 KiB SETs at ~2.4 or
                        # ~6 GB/s, the stock server's as fleetd's), which one connection kept
                        # for a whole run would decide for every round of it
                        tgt = Target(*server, size)
                        try:
                            fn = tgt.set_throughput if kind == "set" else tgt.get_throughput
                            results[kind][name][size].append(fn(size, data if kind == "set" else out))
                            results["cpu_" + kind][name][size].append(tgt.cpu_per_op)
                        finally:
                            tgt.close()
        targets = {name: Target(*server, 4 * KIB) for name, server in servers.items()}
        try:
            for r in range(rounds):
                for name, tgt in alternate(targets, r):
                    results["latency"].setdefault(name, []).append(tgt.latency(latency_calls))
        finally:
            for tgt in targets.values():
                tgt.close()
    return results


def alternate(targets: dict, r: int) -> list:
    """The targets in order on even rounds, reversed on odd ones."""
    items = list(targets.items())
    return items if r % 2 == 0 else items[::-1]


def paired(fleetd: list[float], stock: list[float]) -> tuple[float, float, float]:
    """fleetd / stock per round: (median, min, max)."""
    ratios = [f / s for f, s in zip(fleetd, stock, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per size (median taken)")
    p.add_argument("--latency-calls", type=int, default=2000)
    p.add_argument("--json", help="where to write the JSON (default benchmarks/results/transfer.json)")
    args = p.parse_args(argv)

    pin_client()
    raw = run(args.max_mib * MIB, args.rounds, args.latency_calls)
    rows, cpu_rows, records = [], [], []
    for size in sizes(args.max_mib * MIB):
        rec = {"size": size}
        row, cpu_row = [fmt_size(size)], [fmt_size(size)]
        for kind in ("set", "get"):
            s = statistics.median(raw[kind]["stock"][size])
            f = statistics.median(raw[kind]["fleetd"][size])
            n = statistics.median(raw[kind]["fleetd-nocount"][size])
            ratio, low, high = paired(raw[kind]["fleetd"][size], raw[kind]["stock"][size])
            st, fl = raw["cpu_" + kind]["stock"][size], raw["cpu_" + kind]["fleetd"][size]
            cpu, cpu_low, cpu_high = paired(fl, st)  # lower is better: fleetd's CPU over stock's
            us = {"stock": statistics.median(st) * 1e6, "fleetd": statistics.median(fl) * 1e6}
            rec[kind] = {
                "stock_bps": s,
                "fleetd_bps": f,
                "fleetd_nocount_bps": n,
                "ratio": ratio,
                "ratio_min": low,
                "ratio_max": high,
                "count_cost": f / n,
                "cpu_us": us,
                "cpu_ratio": cpu,
                "cpu_ratio_min": cpu_low,
                "cpu_ratio_max": cpu_high,
            }
            spread = f"{ratio:.2f} ({low:.2f}..{high:.2f})"
            row += [f"{s / MIB:.0f}", f"{f / MIB:.0f}", spread, f"{f / n:.2f}"]
            cpu_row += [
                f"{us['stock']:.1f}",
                f"{us['fleetd']:.1f}",
                f"{cpu:.2f} ({cpu_low:.2f}..{cpu_high:.2f})",
            ]
        rows.append(row)
        cpu_rows.append(cpu_row)
        records.append(rec)
    show(
        "SET_TENSOR / GET_TENSOR on loopback (MiB/s, median; ratio: paired per round, median (min..max))",
        [
            "payload",
            "SET stock",
            "SET fleetd",
            "SET ratio",
            "SET count cost",
            "GET stock",
            "GET fleetd",
            "GET ratio",
            "GET count cost",
        ],
        rows,
    )
    show(
        "The server's CPU per request (µs, all its threads; ratio fleetd / stock, lower is better)",
        ["payload", "SET stock", "SET fleetd", "SET ratio", "GET stock", "GET fleetd", "GET ratio"],
        cpu_rows,
    )
    ls = statistics.median(raw["latency"]["stock"])
    lf = statistics.median(raw["latency"]["fleetd"])
    ln = statistics.median(raw["latency"]["fleetd-nocount"])
    show(
        "Small command round trip (GET_ALIGNMENT, median)",
        ["", "stock µs", "fleetd µs", "ratio", "fleetd no count µs", "count cost"],
        [
            [
                "latency",
                f"{ls * 1e6:.1f}",
                f"{lf * 1e6:.1f}",
                f"{lf / ls:.2f}",
                f"{ln * 1e6:.1f}",
                f"{lf / ln:.2f}",
            ]
        ],
    )
    out = save(
        "transfer",
        {
            "throughput": records,
            "latency": {
                "stock_s": ls,
                "fleetd_s": lf,
                "fleetd_nocount_s": ln,
                "ratio": lf / ls,
                "count_cost": lf / ln,
            },
            "rounds": args.rounds,
            "raw": {
                k: {
                    n: {str(s): v for s, v in d.items()} if isinstance(d, dict) else d
                    for n, d in raw[k].items()
                }
                for k in raw
            },
        },
        args.json,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SET_TENSOR / GET_TENSOR throughput and small-command latency: fleetd vs the stock server.

    .venv/bin/python benchmarks/transfer.py [--max-mib 256] [--json PATH]

All servers run as separate processes on loopback, driven by the same Python client; sizes are
measured alternately (stock, fleetd, fleetd without counters, ...) so drift on a shared machine
hits all alike. Ratio = fleetd / stock (throughput: higher is better; latency: lower is better);
"count cost" = fleetd / fleetd with command counting switched off (1.00 = free).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pin_client, save, server_process, show  # noqa: E402

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
    # Enough repetitions for ~64 MiB per measurement, at least 3, at most 200: bounded in count.
    return max(3, min(200, (64 * MIB) // size))


class Target:
    def __init__(self, endpoint: str, max_bytes: int):
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

    def set_throughput(self, size: int, data: np.ndarray) -> float:
        t = self.tensor(size)
        n = reps_for(size)
        self.client.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            self.client.set_tensor(t, data)
        self.client.sync()  # SET_TENSOR has no response: the next round trip proves it landed
        return n * size / (time.perf_counter() - t0)

    def get_throughput(self, size: int, out: np.ndarray) -> float:
        t = self.tensor(size)
        n = reps_for(size)
        t0 = time.perf_counter()
        for _ in range(n):
            self.client.get_tensor(t, 0, size, out=out)
        return n * size / (time.perf_counter() - t0)

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
    results = {"set": {}, "get": {}, "latency": {}}
    with (
        server_process("stock") as stock_ep,
        server_process("fleetd") as fleetd_ep,
        server_process("fleetd", extra=["--no-counters"]) as nocount_ep,
    ):
        targets = {
            "stock": Target(stock_ep, max_bytes),
            "fleetd": Target(fleetd_ep, max_bytes),
            "fleetd-nocount": Target(nocount_ep, max_bytes),
        }
        try:
            for size in sizes(max_bytes):
                data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                out = np.empty(size, np.uint8)
                for kind in ("set", "get"):
                    for name in targets:
                        results[kind].setdefault(name, {})[size] = []
                    for _ in range(rounds):
                        for name, tgt in targets.items():
                            fn = tgt.set_throughput if kind == "set" else tgt.get_throughput
                            results[kind][name][size].append(fn(size, data if kind == "set" else out))
            for _ in range(rounds):
                for name, tgt in targets.items():
                    results["latency"].setdefault(name, []).append(tgt.latency(latency_calls))
        finally:
            for tgt in targets.values():
                tgt.close()
    return results


def fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per size (median taken)")
    p.add_argument("--latency-calls", type=int, default=2000)
    p.add_argument("--json", help="where to write the JSON (default benchmarks/results/transfer.json)")
    args = p.parse_args(argv)

    pin_client()
    raw = run(args.max_mib * MIB, args.rounds, args.latency_calls)
    rows, records = [], []
    for size in sizes(args.max_mib * MIB):
        rec = {"size": size}
        row = [fmt_size(size)]
        for kind in ("set", "get"):
            s = statistics.median(raw[kind]["stock"][size])
            f = statistics.median(raw[kind]["fleetd"][size])
            n = statistics.median(raw[kind]["fleetd-nocount"][size])
            rec[kind] = {
                "stock_bps": s,
                "fleetd_bps": f,
                "fleetd_nocount_bps": n,
                "ratio": f / s,
                "count_cost": f / n,
            }
            row += [f"{s / MIB:.0f}", f"{f / MIB:.0f}", f"{f / s:.2f}", f"{f / n:.2f}"]
        rows.append(row)
        records.append(rec)
    show(
        "SET_TENSOR / GET_TENSOR throughput on loopback (MiB/s, median)",
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

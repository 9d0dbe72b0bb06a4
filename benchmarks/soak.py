"""Soak: N clients x M minutes of mixed traffic against one fleetd process; RSS, threads and fds
of the daemon sampled from /proc at the start, during and at the end (must come back flat).

    .venv/bin/python benchmarks/soak.py --clients 8 --minutes 2

Each client loops, bounded by the duration and by --max-iterations: HELLO, ALLOC_BUFFER, SET,
GET (checked), a small graph (ADD then MUL_MAT) computed and recomputed, FREE; one iteration in
five it vanishes instead: mid-request, mid-SET_TENSOR data, after allocating without freeing, or
right after connecting. Prints a table and writes benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, server_process, show  # noqa: E402

from fleetd.client import GraphBuilder, RpcClient  # noqa: E402
from fleetd.transport.tcp import Timeout  # noqa: E402
from fleetd.wire import GgmlType  # noqa: E402

N = 256  # elements per vector


def pid_listening_on(port: int) -> int:
    """The pid of the process holding the listening socket on `port` (from /proc, no psutil)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # LISTEN
                inodes.add(f[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    raise RuntimeError(f"no process listens on port {port}")


def _span(values) -> tuple:
    values = list(values)
    return min(values), max(values)


def sample(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
        "hwm_mib": int(fields["VmHWM"].split()[0]) / 1024,
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def add(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1


def good_iteration(endpoint: str, rng: random.Random) -> None:
    with RpcClient(endpoint, timeout=Timeout(connect=5.0, read=30.0)) as c:
        size = 4 * N * 4 + 4 * N * N
        handle, _ = c.alloc_buffer(size)
        base = c.buffer_get_base(handle)
        g = GraphBuilder()
        a = g.tensor(GgmlType.F32, (N,), handle, base)
        b = g.tensor(GgmlType.F32, (N,), handle, base + 4 * N)
        w = g.tensor(GgmlType.F32, (N, N), handle, base + 8 * N)
        s = g.place(g.add(a, b), handle, base + 8 * N + 4 * N * N)
        out = g.place(g.mul_mat(w, s), handle, base + 12 * N + 4 * N * N)
        x = np.asarray([rng.random() for _ in range(N)], dtype=np.float32)
        c.set_tensor(a.rpc(), x.tobytes())
        c.set_tensor(b.rpc(), x.tobytes())
        c.set_tensor(w.rpc(), np.eye(N, dtype=np.float32).tobytes())
        if c.get_tensor(a.rpc()) != x.tobytes():
            raise AssertionError("GET_TENSOR returned other bytes than SET_TENSOR wrote")
        c.graph_compute(g.serialize([s, out]))
        c.graph_recompute()
        y = np.frombuffer(c.get_tensor(out.rpc()), dtype=np.float32)
        if not np.allclose(y, 2 * x, atol=1e-5):
            raise AssertionError("graph result wrong")
        c.free_buffer(handle)


def vanish(endpoint: str, rng: random.Random) -> str:
    host, port = endpoint.rsplit(":", 1)
    how = rng.choice(["connect", "mid-header", "mid-set", "no-free"])
    if how == "no-free":
        c = RpcClient(endpoint, timeout=Timeout(connect=5.0, read=30.0)).open()
        c.alloc_buffer(1 << 20)
        c.close()  # without FREE_BUFFER: the daemon frees it when the session ends
        return how
    s = socket.create_connection((host, int(port)), timeout=5)
    try:
        if how != "connect":
            s.sendall(struct.pack("<BQ", 14, 24) + bytes(24))
            s.recv(36)
            if how == "mid-header":
                s.sendall(struct.pack("<BQ", 0, 12)[:5])
            else:  # SET_TENSOR announcing 1 MiB of data, then gone after 100 bytes
                s.sendall(struct.pack("<BQ", 6, 305 + (1 << 20)) + bytes(400))
    finally:
        s.close()
    return how


def client(endpoint: str, seed: int, until: float, max_iter: int, tally: Tally) -> None:
    rng = random.Random(seed)
    for _ in range(max_iter):
        if time.monotonic() >= until:
            return
        try:
            if rng.random() < 0.2:
                tally.add("vanished:" + vanish(endpoint, rng))
            else:
                good_iteration(endpoint, rng)
                tally.add("ok")
        except AssertionError:
            tally.add("WRONG")
            raise
        except Exception as exc:  # counted: a failed good iteration is a finding
            tally.add(f"error:{type(exc).__name__}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--max-iterations", type=int, default=100_000, help="per client, a hard bound")
    ap.add_argument("--device", default="cpu", help="fleetd device (default cpu)")
    ap.add_argument("--json", help="where to write the JSON (default benchmarks/results/soak.json)")
    args = ap.parse_args()
    if args.clients < 1 or args.minutes <= 0 or args.max_iterations < 1:
        ap.error("--clients, --minutes and --max-iterations must be positive")
    with server_process("fleetd", extra=["--device", args.device]) as endpoint:
        pid = pid_listening_on(int(endpoint.rsplit(":", 1)[1]))
        good_iteration(endpoint, random.Random(0))  # warm: imports, first graph, allocator
        start = sample(pid)
        tally = Tally()
        until = time.monotonic() + 60 * args.minutes
        threads = [
            threading.Thread(target=client, args=(endpoint, i, until, args.max_iterations, tally))
            for i in range(args.clients)
        ]
        samples = []
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(min(5.0, 60 * args.minutes / 10))
            samples.append(sample(pid))
        for t in threads:
            t.join()
        time.sleep(1.0)  # sessions of vanished clients close on their own read error
        end = sample(pid)
    rows = [
        ["start", f"{start['rss_mib']:.1f}", start["threads"], start["fds"]],
        [
            "peak during",
            f"{max(s['rss_mib'] for s in samples):.1f}",
            max(s["threads"] for s in samples),
            max(s["fds"] for s in samples),
        ],
        # the plateau: a leak keeps growing here, allocator warm-up does not
        [
            "last half: min..max",
            "{:.1f}..{:.1f}".format(*_span(s["rss_mib"] for s in samples[len(samples) // 2 :])),
            "{}..{}".format(*_span(s["threads"] for s in samples[len(samples) // 2 :])),
            "{}..{}".format(*_span(s["fds"] for s in samples[len(samples) // 2 :])),
        ],
        ["end", f"{end['rss_mib']:.1f}", end["threads"], end["fds"]],
    ]
    show(
        f"soak: {args.clients} clients x {args.minutes:g} min, fleetd --device {args.device}",
        ["when", "RSS MiB", "threads", "fds"],
        rows,
    )
    show("iterations", ["outcome", "count"], sorted([k, v] for k, v in tally.counts.items()))
    out = save(
        "soak",
        {
            "clients": args.clients,
            "minutes": args.minutes,
            "device": args.device,
            "start": start,
            "end": end,
            "samples": samples,
            "outcomes": tally.counts,
        },
        args.json,
    )
    print(f"wrote {out}")
    flat = (
        end["threads"] <= start["threads"]
        and end["fds"] <= start["fds"]
        and end["rss_mib"] <= start["rss_mib"] * 1.10 + 16
    )
    bad = tally.counts.get("WRONG", 0) + sum(v for k, v in tally.counts.items() if k.startswith("error:"))
    print("flat" if flat else "NOT FLAT", "/", f"{bad} failed good iterations")
    return 0 if flat and not bad else 1


if __name__ == "__main__":
    sys.exit(main())

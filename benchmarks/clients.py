#!/usr/bin/env python3
"""Several clients at once against one node: llama-bench decode runs started together, through
fleetd and through the stock ggml-rpc-server, same models, one run. Prints a table, writes JSON.

    benchmarks/clients.py [--models m1,m2,m3] [--clients 1,2,4] [--tg 128] [--json out.json]

For each model, server and client count N: the wall time of N clients started together, the
aggregate speed-up N x (one client's wall time) / (N clients' wall time) (1.0x: served one after
the other), each client's decode t/s (fairness: the slowest against the fastest), the peak Pss
of the server's process tree, and whether every client's greedy text (llama-completion --temp 0,
run N at once) is the text one client alone gets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from decode import TreeMemory, ensure_models, peak_rss_mib, start_server  # noqa: E402

from fleetd.tools import find_tool  # noqa: E402

DEFAULT_MODELS = ["llama-q4_k-bench", "llama-q8_0", "qwen3moe-q8_0-bench"]


def one_bench(model: Path, endpoint: str, tg: int) -> float:
    args = [
        str(find_tool("llama-bench")),
        "-m",
        str(model),
        "--rpc",
        endpoint,
        "-ngl",
        "99",
        "-p",
        "0",
        "-n",
        str(tg),
        "-t",
        "1",
        "-r",
        "1",
        "-o",
        "json",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1800, check=True)
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def one_completion(model: Path, endpoint: str, n: int) -> str:
    """The greedy text's bytes (hex: a generated model prints any bytes)."""
    args = [
        str(find_tool("llama-completion")),
        "-m",
        str(model),
        "--rpc",
        endpoint,
        "-ngl",
        "99",
        "-p",
        "The fleet",
        "-n",
        str(n),
        "--temp",
        "0",
        "-t",
        "1",
        "--no-warmup",
        "-no-cnv",
        "--seed",
        "1",
    ]
    proc = subprocess.run(args, capture_output=True, timeout=1800)  # a random model's text: bytes
    if b"common_perf_print" not in proc.stderr:
        # llama.cpp logs through a thread of its own; a process that exits before it drained
        # loses the tail of stdout too (seen with 4 at once on 2 cores): not a comparable text
        return None
    return proc.stdout.hex()


def together(fn, n: int, *args) -> tuple[list, float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda _: fn(*args), range(n)))
    return results, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", default=str(Path.home() / ".cache" / "fleetd" / "models"))
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--text-tokens", type=int, default=32)
    ap.add_argument(
        "--threads", type=int, default=None, help="server compute threads (default: as each server's)"
    )
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "clients.json"))
    ap.add_argument("--log", default="/tmp/fleetd-bench-clients.log")
    args = ap.parse_args()
    counts = sorted({int(c) for c in args.clients.split(",")} | {1})
    names = args.models.split(",")
    models_dir = Path(args.models_dir)
    ensure_models(models_dir, names)
    threads = args.threads or max(1, (os.cpu_count() or 2) // 2)
    rows = []
    for name in names:
        model = models_dir / f"{name}.gguf"
        for server in ("stock", "fleetd"):
            proc, endpoint = start_server(server, threads, Path(args.log), [])
            tree = TreeMemory(proc.pid)
            try:
                alone_text = one_completion(model, endpoint, args.text_tokens)
                base_wall = None
                for n in counts:
                    speeds, wall = together(one_bench, n, model, endpoint, args.tg)
                    if n == 1:
                        base_wall = wall
                    texts = []
                    for _ in range(3):  # a run whose client log was cut short is run again
                        texts, _ = together(one_completion, n, model, endpoint, args.text_tokens)
                        if None not in texts:
                            break
                    rows.append(
                        {
                            "model": name,
                            "server": server,
                            "clients": n,
                            "wall_s": wall,
                            "speedup": n * base_wall / wall,
                            "client_tps": speeds,
                            "aggregate_tps": sum(speeds),
                            "fairness": min(speeds) / max(speeds),
                            "same_text": all(t == alone_text and t for t in texts),
                            "cut_logs": texts.count(None),
                        }
                    )
                    print(
                        f"{name} {server} x{n}: {rows[-1]['speedup']:.2f}x, "
                        f"t/s {[round(s, 1) for s in speeds]}",
                        flush=True,
                    )
            finally:
                peak_tree = tree.stop()
                peak_daemon = peak_rss_mib(proc.pid)
                proc.terminate()
                proc.wait(10)
            for r in rows:
                if r["model"] == name and r["server"] == server:
                    r["peak_pss_tree_mib"], r["peak_rss_mib"] = peak_tree, peak_daemon
    head = (
        f"{'model':22} {'server':7} {'N':>2} {'wall s':>7} {'x one':>6} {'agg t/s':>8} "
        f"{'min/max':>7} {'text':>5} {'Pss MiB':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:22} {r['server']:7} {r['clients']:2d} {r['wall_s']:7.1f} {r['speedup']:6.2f} "
            f"{r['aggregate_tps']:8.1f} {r['fairness']:7.2f} {'same' if r['same_text'] else 'DIFF':>5} "
            f"{r['peak_pss_tree_mib']:8.0f}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"threads": threads, "tg": args.tg, "cpus": os.cpu_count(), "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""llama-bench prompt processing (pp) and decode (tg) tokens/s through fleetd and through the
stock ggml-rpc-server, same models, same thread count, one run, and each server's peak RSS
(VmHWM: a server starts fresh for every model). Prints a table, writes JSON.

    benchmarks/decode.py [--models DIR] [--threads 1] [--pp 64] [--tg 32] [--json out.json]

Models are fleetd.models' ("<arch>-<type>[-bench]", generated when missing). llama.cpp
sends GRAPH_RECOMPUTE for every decode step whose graph is unchanged, so tg measures fleetd's
plan-cache hot path. fleetd runs from the interpreter running this script, with its
PYTHONPATH: `PYTHONPATH=/other/checkout benchmarks/decode.py` measures that checkout's server.
`--baseline DIR` adds an arm `cpu@base`: the ggml device of the checkout in DIR, in the same run
(e.g. a worktree of the commit before contained compute).

Memory: the stock server's and each daemon's peak RSS (VmHWM), and for fleetd the peak of the
proportional set size (Pss, /proc/PID/smaps_rollup) of the daemon plus its fork server and
compute workers, sampled every 0.2 s: buffer pages the daemon and a worker both map count once.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleetd.models import generate_named
from fleetd.tools import find_tool
from fleetd.transport import free_port, wait_listening

# ~100M-parameter variants ("-bench"): big enough that kernels, not per-op overhead, dominate.
DEFAULT_MODELS = [
    "llama-q4_k-bench",
    "llama-q8_0-bench",
    "llama-f16-bench",
    "qwen3moe-q8_0-bench",
    "llama-q8_0",
]


# With --pin (the default on 2+ cores) the client runs on the first core and every server on the
# others, the same for stock and fleetd: which core (or SMT sibling) a server shares with the
# client otherwise changes a token's time by more than the differences measured here.
_CPUS = sorted(os.sched_getaffinity(0))
CLIENT_CPUS: set[int] | None = None
SERVER_CPUS: set[int] | None = None


def _pin_to(cpus: set[int] | None):
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def start_server(
    kind: str, threads: int, log: Path, fleetd_args: list[str], checkout: str | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = None
    if kind == "fleetd":
        # -P: not the working directory's fleetd but PYTHONPATH's, then this checkout's.
        args = [
            sys.executable,
            "-P",
            "-m",
            "fleetd.server",
            "--port",
            str(port),
            "--control-port",
            "0",
            "-t",
            str(threads),
            "--log-level",
            "warning",
            *fleetd_args,
        ]
        path = [p for p in (checkout, os.environ.get("PYTHONPATH"), str(REPO)) if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    else:
        args = [str(find_tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)]
    with open(log, "ab") as out:  # the child keeps its own fd
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_pin_to(SERVER_CPUS)
        )
    wait_listening(port)
    return proc, f"127.0.0.1:{port}"


def peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident set (VmHWM), while it still runs."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeMemory:
    """The peak of the summed Pss of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        self.pid, self.peak_kib, self.processes = pid, 0, 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            pids = [self.pid, *descendants(self.pid)]
            self.processes = max(self.processes, len(pids))
            self.peak_kib = max(self.peak_kib, sum(pss_kib(p) for p in pids))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_kib / 1024


def bench(model: Path, endpoint: str, threads: int, pp: int, tg: int, reps: int) -> dict[str, float]:
    """{'pp': tokens/s, 'tg': tokens/s} from llama-bench's JSON output."""
    args = [
        str(find_tool("llama-bench")),
        "-m",
        str(model),
        "--rpc",
        endpoint,
        "-ngl",
        "99",
        "-p",
        str(pp),
        "-n",
        str(tg),
        "-t",
        str(threads),
        "-r",
        str(reps),
        "-o",
        "json",
    ]
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=1800, check=True, preexec_fn=_pin_to(CLIENT_CPUS)
    )
    rows = json.loads(proc.stdout)
    out = {}
    for row in rows:
        kind = "pp" if row.get("n_prompt", 0) > 0 else "tg"
        out[kind] = float(row["avg_ts"])
    return out


def ensure_models(models_dir: Path, names: list[str]) -> None:
    missing = [n for n in names if not (models_dir / f"{n}.gguf").exists()]
    if not missing:
        return
    for name in missing:
        generate_named(name, models_dir)


def paired_ratio(runs: dict[str, list[dict]], arm: str, ref: str, kind: str) -> float:
    """Median over rounds of arm / ref measured in the same round: on a noisy shared machine
    the rounds' common drift cancels, which a ratio of two medians does not."""
    ratios = [a[kind] / b[kind] for a, b in zip(runs[arm], runs[ref]) if a.get(kind) and b.get(kind)]
    return median(ratios) if ratios else float("nan")


def table(results: list[dict], arms: list[str]) -> str:
    """One row per model and test: median t/s of every arm, fleetd arms as the median paired
    ratio to stock (and `cpu` to `cpu@base` when there), peak RSS."""
    fleetd = [a for a in arms if a != "stock"]
    base = "cpu@base" in arms and "cpu" in arms
    head = f"{'model':20} {'test':4} {'stock t/s':>10}"
    head += "".join(f" {a + ' t/s':>11} {'ratio':>6}" for a in fleetd)
    head += f" {'cpu/base':>8}" if base else ""
    head += "".join(f" {a + ' MiB':>11}" for a in arms)
    head += "".join(f" {a + ' tree':>12}" for a in fleetd)
    lines = [head, "-" * len(head)]
    for r in results:
        for kind in ("pp", "tg"):
            s = r["stock"].get(kind)
            line = f"{r['model']:20} {kind:4} {s or 0:10.1f}"
            for a in fleetd:
                line += f" {r[a].get(kind) or 0:11.1f} {r[a].get(kind + '_ratio', float('nan')):6.2f}"
            if base:
                line += f" {r['cpu'].get(kind + '_vs_base', float('nan')):8.2f}"
            if kind == "pp":  # one peak per server and model
                line += "".join(f" {r[a].get('peak_rss_mib') or 0:11.0f}" for a in arms)
                line += "".join(f" {r[a].get('peak_pss_tree_mib') or 0:12.0f}" for a in fleetd)
            lines.append(line)
    return "\n".join(lines)


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", default=str(Path.home() / ".cache" / "fleetd" / "models"))
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument(
        "--devices",
        default="cpu,numpy",
        help="fleetd devices to run beside stock, comma separated (cpu = ggml kernels, numpy)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="servers run in turn this many times, the order reversed each round; medians",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "decode.json"))
    ap.add_argument("--log", default="/tmp/fleetd-bench.log")
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=len(_CPUS) > 1,
        help="client on the first core, servers on the rest (default with 2+ cores)",
    )
    ap.add_argument("--fleetd-args", default="", help='more fleetd flags, e.g. "--dequant-cache 4x"')
    ap.add_argument(
        "--baseline", metavar="DIR", help="also run the ggml device of the checkout in DIR (arm cpu@base)"
    )
    args = ap.parse_args()
    global CLIENT_CPUS, SERVER_CPUS
    if args.pin and len(_CPUS) > 1:
        CLIENT_CPUS, SERVER_CPUS = set(_CPUS[:1]), set(_CPUS[1:])
    devices = [d for d in args.devices.split(",") if d]
    if args.baseline:
        devices.append("cpu@base")
    if args.rounds < 1 or args.reps < 1 or args.pp < 1 or args.tg < 1 or args.threads < 1:
        ap.error("--rounds, --reps, --pp, --tg and --threads must be positive")

    names = args.models.split(",")
    models_dir = Path(args.models_dir)
    ensure_models(models_dir, names)
    arms = ["stock", *devices]
    results = []
    for name in names:
        runs: dict[str, list[dict]] = {a: [] for a in arms}
        for rnd in range(args.rounds):
            for arm in arms if rnd % 2 == 0 else arms[::-1]:
                device, _, base = arm.partition("@")
                extra = [] if arm == "stock" else ["--device", device, *shlex.split(args.fleetd_args)]
                proc, endpoint = start_server(
                    "stock" if arm == "stock" else "fleetd",
                    args.threads,
                    Path(args.log),
                    extra,
                    args.baseline if base else None,
                )
                tree = TreeMemory(proc.pid)
                try:
                    got = bench(
                        models_dir / f"{name}.gguf", endpoint, args.threads, args.pp, args.tg, args.reps
                    )
                    got["peak_rss_mib"] = peak_rss_mib(proc.pid)
                    got["peak_pss_tree_mib"] = tree.stop()
                    got["processes"] = tree.processes
                    runs[arm].append(got)
                finally:
                    proc.terminate()
                    proc.wait(10)
        row = {"model": name, "rounds": runs}
        for arm in arms:
            row[arm] = {k: median([r[k] for r in runs[arm] if r.get(k)]) for k in ("pp", "tg")}
            row[arm]["peak_rss_mib"] = max(r["peak_rss_mib"] or 0 for r in runs[arm])
            row[arm]["peak_pss_tree_mib"] = max(r["peak_pss_tree_mib"] or 0 for r in runs[arm])
            for kind in ("pp", "tg"):
                if arm != "stock":
                    row[arm][kind + "_ratio"] = paired_ratio(runs, arm, "stock", kind)
                if arm == "cpu" and "cpu@base" in runs:
                    row[arm][kind + "_vs_base"] = paired_ratio(runs, "cpu", "cpu@base", kind)
        results.append(row)
        print(f"{name}: " + ", ".join(f"{a} {row[a]}" for a in arms), flush=True)
    print(table(results, arms))
    meta = {
        "threads": args.threads,
        "pp": args.pp,
        "tg": args.tg,
        "reps": args.reps,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "devices": devices,
        "fleetd_args": args.fleetd_args,
        "results": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

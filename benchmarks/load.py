#!/usr/bin/env python3
"""Model load through the stock ggml-rpc-server and through fleetd, side by side in one run, without
and with a cache directory. Prints a table, writes JSON.

    benchmarks/load.py [--models llama-q8_0-load,llama-f16-load] [--devices cpu] [--rounds 3]
                       [--json PATH]

Every load is `llama-completion -ngl 99 --rpc <server> -n 1 --no-warmup` against a fresh server
process, three per model and server:

- none: no cache directory;
- cold: an empty one (stock `-c` with LLAMA_CACHE, fleetd `--cache-dir`): the client asks
  SET_TENSOR_HASH for every weight tensor above 10 MiB, misses, and sends it with the cache flag;
  the server hashes it and writes a cache file;
- warm: the same directory again: SET_TENSOR_HASH hits, those tensors are not sent.

Time is the model load as llama-completion's log stamps it (from "load the model" to
"constructing llama_context": metadata, buffers, every weight uploaded; the client's wall time is
in the JSON); CPU is the server's user + system time over the client's run, the load and its one
token (/proc/<pid>/stat: on a busy machine steadier than the time); peak RSS is the server's
VmHWM. Ratio = fleetd / stock (lower is better). "files" = cache files after the cold load
(stock/fleetd; their names must agree); a warm load that rewrote one (a miss) is reported. Models are
fleetd.models' ("<arch>-<type>[-<size>]", generated when missing; "-load": ~190 MB Q8_0 /
~360 MB f16, FFN matrices above the 10 MiB threshold). fleetd runs from this interpreter as
`python -m fleetd.server` (fleetd.fleet.local): the working directory's fleetd first, then
PYTHONPATH's, so run it from a neutral directory to measure another checkout. The client is
pinned to one core and the servers to the others, as in common.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CLIENT_CPUS, SERVER_CPUS, save, show, stock_process  # noqa: E402
from decode import median, peak_rss_mib  # noqa: E402

from fleetd.fleet.local import LocalFleet  # noqa: E402
from fleetd.models import generate_named  # noqa: E402
from fleetd.tools import find_tool  # noqa: E402

DEFAULT_MODELS = ["llama-q8_0-load", "llama-f16-load"]
MODES = ("none", "cold", "warm")
# llama.cpp's log lines start "<min>.<s>.<ms>.<us> <level> " (time since start; shown with -lv 4).
STAMP = r"^(\d+)\.(\d+)\.(\d+)\.(\d+) \w "
LOAD_START = re.compile(STAMP + r"llama_completion: load the model", re.M)
LOAD_END = re.compile(STAMP + r"llama_context: constructing llama_context", re.M)


def stamp_s(m: re.Match) -> float:
    minutes, secs, ms, us = (int(g) for g in m.groups())
    return minutes * 60 + secs + ms / 1e3 + us / 1e6


@contextlib.contextmanager
def server(arm: str, cache: Path | None, workdir: Path):
    """(endpoint, pid) of a fresh server: "stock", or fleetd with the device `arm`."""
    if arm != "stock":
        args = ["--device", arm, "--threads", "1"] + (["--cache-dir", str(cache)] if cache else [])
        pin = lambda: os.sched_setaffinity(0, SERVER_CPUS)  # noqa: E731
        with LocalFleet(1, workdir, server_args=args, control=False, preexec_fn=pin) as local:
            yield local.endpoints[0], local.processes[0].pid
        return
    env = dict(os.environ)
    extra = []
    if cache:  # the stock server's -c directory is $LLAMA_CACHE/rpc
        extra.append("-c")
        env["LLAMA_CACHE"] = str(cache)
    with stock_process(1, extra, env, workdir / "stock.log") as (endpoint, proc):
        yield endpoint, proc.pid


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat utime, stime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_once(model: Path, endpoint: str) -> dict[str, float]:
    args = [
        str(find_tool("llama-completion")),
        "-m",
        str(model),
        "--rpc",
        endpoint,
        "-ngl",
        "99",
        "-p",
        "the",
        "-n",
        "1",
        "--no-warmup",
        "-c",
        "256",
        "-t",
        "1",
        "-no-cnv",
        "--temp",
        "0",
        "-fit",
        "off",
        "-lv",
        "4",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        args,
        capture_output=True,
        timeout=1800,
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, CLIENT_CPUS),
    )
    wall = time.perf_counter() - t0
    out = proc.stderr.decode(errors="replace")
    start, end = LOAD_START.search(out), LOAD_END.search(out)
    if proc.returncode != 0 or not start or not end:
        raise SystemExit(f"llama-completion against {endpoint} failed ({proc.returncode}): {out[-2000:]}")
    # From "load the model" to the context: metadata, buffers, every weight uploaded.
    return {"load_s": stamp_s(end) - stamp_s(start), "wall_s": wall}


def cache_files(arm: str, cache: Path) -> dict[str, int]:
    """{file name: inode} of the finished cache files of a server's directory."""
    directory = cache / "rpc" if arm == "stock" else cache
    if not directory.is_dir():
        return {}
    # by inode: a rewrite replaces the file (a new inode); a hit only touches its mtime (fleetd's
    # cache budget keeps the most recently used files)
    return {p.name: p.stat().st_ino for p in directory.iterdir() if not p.name.startswith(".")}


def run_model(model: Path, arms: list[str], rounds: int, workdir: Path) -> dict:
    # The client mmaps the model: read it once so that no arm pays the disk.
    with open(model, "rb") as f:
        while f.read(1 << 24):
            pass
    # One unrecorded load per server first. On a freshly booted VM the first touch of guest
    # memory costs a host fault (measured here: 0.17 GB/s against 3-10 GB/s once touched), and it
    # falls on whichever process reaches new memory first, unevenly between the arms.
    for arm in arms:
        with server(arm, None, workdir) as (endpoint, _pid):
            load_once(model, endpoint)
    runs: dict[str, dict[str, list[dict]]] = {a: {m: [] for m in MODES} for a in arms}
    files: dict[str, int] = {}
    names: dict[str, set[str]] = {}
    warm_misses: dict[str, int] = {a: 0 for a in arms}
    for rnd in range(rounds):
        order = arms if rnd % 2 == 0 else arms[::-1]
        caches = {a: workdir / f"cache-{a}" for a in arms}
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir()
        for mode in MODES:  # the arms in turn for each mode: drift on a shared machine hits all
            for arm in order:
                cache = caches[arm] if mode != "none" else None
                before = cache_files(arm, caches[arm])
                with server(arm, cache, workdir) as (endpoint, pid):
                    cpu0 = cpu_seconds(pid)
                    got = load_once(model, endpoint)
                    got["server_cpu_s"] = cpu_seconds(pid) - cpu0  # what the load cost the server
                    got["peak_rss_mib"] = peak_rss_mib(pid)
                after = cache_files(arm, caches[arm])
                if mode == "cold":
                    files[arm], names[arm] = len(after), set(after)
                if mode == "warm":
                    warm_misses[arm] += sum(1 for n, t in after.items() if before.get(n) != t)
                runs[arm][mode].append(got)
    # Every server names a file by the FNV-1a of its bytes: the same names, or a hash is wrong.
    same_names = all(n == names[arms[0]] for n in names.values())
    row = {
        "model": model.stem,
        "bytes": model.stat().st_size,
        "files": files,
        "same_names": same_names,
        "warm_misses": warm_misses,
        "rounds": runs,
    }
    for arm in arms:
        row[arm] = {
            m: {k: median([r[k] for r in runs[arm][m]]) for k in ("load_s", "wall_s", "server_cpu_s")}
            for m in MODES
        }
        for m in MODES:
            row[arm][m]["peak_rss_mib"] = max(r["peak_rss_mib"] or 0 for r in runs[arm][m])
    return row


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def table_rows(results: list[dict], arms: list[str]) -> tuple[list[str], list[list]]:
    fleetd = [a for a in arms if a != "stock"]
    columns = ["model", "cache", "stock load s"]
    for a in fleetd:
        columns += [f"{a} load s", f"{a} ratio"]
    columns += ["stock CPU s"]
    for a in fleetd:
        columns += [f"{a} CPU s", f"{a} CPU ratio"]
    columns += ["stock MiB"]
    for a in fleetd:
        columns += [f"{a} MiB", f"{a} RSS ratio"]
    columns += ["files"]
    rows = []
    for r in results:
        for mode in MODES:
            s = r["stock"][mode]
            line = [r["model"], mode, f"{s['load_s']:.2f}"]
            for a in fleetd:
                line += [f"{r[a][mode]['load_s']:.2f}", ratio(r[a][mode]["load_s"], s["load_s"])]
            line += [f"{s['server_cpu_s']:.2f}"]
            for a in fleetd:
                line += [
                    f"{r[a][mode]['server_cpu_s']:.2f}",
                    ratio(r[a][mode]["server_cpu_s"], s["server_cpu_s"]),
                ]
            line += [f"{s['peak_rss_mib']:.0f}"]
            for a in fleetd:
                line += [
                    f"{r[a][mode]['peak_rss_mib']:.0f}",
                    ratio(r[a][mode]["peak_rss_mib"], s["peak_rss_mib"]),
                ]
            line += ["/".join(str(r["files"].get(a, 0)) for a in arms) if mode == "cold" else ""]
            rows.append(line)
    return columns, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", default=str(Path.home() / ".cache" / "fleetd" / "models"))
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument(
        "--devices", default="cpu", help="fleetd devices beside stock, comma separated (cpu, numpy)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="every load this many times, the servers' order reversed each round; medians",
    )
    ap.add_argument(
        "--workdir", default=None, help="cache directories and server logs (default: a temporary one)"
    )
    ap.add_argument("--json", default=None, help="default benchmarks/results/load.json")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be positive")
    arms = ["stock", *[d for d in args.devices.split(",") if d]]
    try:
        models = [generate_named(n, Path(args.models_dir)) for n in args.models.split(",") if n]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleetd-load-")))
        results = []
        for model in models:
            row = run_model(model, arms, args.rounds, workdir)
            results.append(row)
            print(f"{row['model']}: " + ", ".join(f"{a} {row[a]}" for a in arms), flush=True)
    columns, rows = table_rows(results, arms)
    show(
        f"model load, median of {args.rounds} round(s); ratio = fleetd / stock (lower is better); "
        "files = cache files written by the cold load (stock/fleetd)",
        columns,
        rows,
    )
    for r in results:
        if not r["same_names"]:
            print(f"warning: {r['model']}: the servers' cache files have different names (hashes)")
        for arm, misses in r["warm_misses"].items():
            if misses:
                print(
                    f"warning: {r['model']}: {arm}'s warm load rewrote {misses} cache file(s) "
                    "(SET_TENSOR_HASH missed)"
                )
    out = save(
        "load",
        {"rounds": args.rounds, "cpus": os.cpu_count(), "devices": arms[1:], "results": results},
        args.json,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

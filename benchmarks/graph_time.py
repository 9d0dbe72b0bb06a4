#!/usr/bin/env python3
"""How long ggml's own graph compute takes inside fleetd's worker against the stock server, node
by node of a pipeline: uprobes at `ggml_graph_compute`'s entry and return (`perf probe`), in the
static stock `ggml-rpc-server` and in the ggml library fleetd loads.

    sudo .venv/bin/python benchmarks/graph_time.py [--nodes 3] [--rounds 4] [--compare-lib DIR]

A fleet of stock servers and one of fleetd on loopback (every server on the same cores, the
client on its own, as benchmarks/common.py places them); the real llama-bench decodes over each
(`-sm layer -p 0 -n N`) in ABBA order. A graph's time is entry to return of the kernels' call
(the same function, the same graphs; perf on CLOCK_MONOTONIC, so each call falls in its bench
run's span); each fleetd run is paired with the stock run nearest in time,
and the table gives, per node, the median over rounds of fleetd / stock (median graph time of a
run), with min..max. `--compare-lib DIR` adds a third fleet whose fleetd loads ggml from DIR
(FLEETD_GGML_LIB_DIR), e.g. an older build. Needs root and perf; about 1 min for 4 rounds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SERVER_CPUS, _pin, pin_client, save, show, stock_process  # noqa: E402
from lab_arms import abba_rounds  # noqa: E402

from fleetd.compute.ggml.lib import load  # noqa: E402
from fleetd.fleet.local import LocalFleet  # noqa: E402
from fleetd.models import generate_named  # noqa: E402
from fleetd.tools import find_tool  # noqa: E402

GROUP = "fleetdgt"  # the probes' event group, removed at the end
TRACEFS = Path("/sys/kernel/tracing")
RETURN = "__return"  # what perf appends to a return probe's name


def probe(binary: Path, name: str) -> None:
    """Entry and return probes on ggml_graph_compute in `binary`: GROUP:name and (perf names
    it) GROUP:name__return."""
    for spec in (f"{GROUP}:{name}=ggml_graph_compute", f"{GROUP}:{name}=ggml_graph_compute%return"):
        subprocess.run(
            ["perf", "probe", "-q", "-x", str(binary), "-a", spec], check=True, capture_output=True
        )


def graph_times(script: str) -> dict[int, tuple[str, list[tuple[float, float]]]]:
    """pid -> (probe name, [(start s, duration s)]) from `perf script -F pid,time,event`. A
    library's PLT entry may be probed besides the function: the first entry and the first
    return of a call pair up."""
    open_at: dict[int, float] = {}
    calls: dict[int, tuple[str, list]] = {}
    for line in script.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        pid, at, event = int(parts[0]), float(parts[1].rstrip(":")), parts[2].rstrip(":").split(":")[-1]
        if event.endswith(RETURN):
            if pid in open_at:
                start = open_at.pop(pid)
                calls.setdefault(pid, (event.removesuffix(RETURN), []))[1].append((start, at - start))
        else:
            open_at.setdefault(pid, at)
    return calls


def runs_by_node(calls, runs: list[tuple[str, float, float]]) -> list[tuple[float, str, list[float]]]:
    """(start, arm, median graph time per node, largest first) for each bench run (arm, t0, t1):
    the calls of that arm's probe within the run, one median per process."""
    out = []
    for arm, t0, t1 in runs:
        meds = []
        for name, seq in calls.values():
            inside = [d for at, d in seq if t0 <= at <= t1] if name == arm else []
            if inside:
                meds.append(statistics.median(inside))
        out.append((t0, arm, sorted(meds, reverse=True)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--model", default="llama-f16-wide", help="a fleetd.models name")
    p.add_argument("--n-gen", type=int, default=256, help="decode tokens a run (default 256)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--compare-lib", metavar="DIR", help="a third fleet: fleetd with ggml from DIR")
    p.add_argument("--json", help="where to write the JSON (default benchmarks/results/graph_time.json)")
    a = p.parse_args(argv)
    if a.nodes < 1 or a.rounds < 1 or a.n_gen < 1:
        p.error("--nodes, --rounds and --n-gen must be at least 1")
    if os.geteuid() != 0 or not shutil.which("perf"):
        p.error("needs root and perf (uprobes)")
    if a.compare_lib and not Path(a.compare_lib).is_dir():
        p.error(f"--compare-lib {a.compare_lib}: not a directory")
    if not (TRACEFS / "uprobe_events").exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False)
    pin_client()
    libs = {"fleetd": load().cpu_path}
    if a.compare_lib:
        libs["compare"] = load_in_child(a.compare_lib)
    stock_bin = find_tool("ggml-rpc-server")
    bench = find_tool("llama-bench")
    subprocess.run(["perf", "probe", "-q", "-d", f"{GROUP}:*"], capture_output=True)
    try:
        probe(stock_bin, "stock")
        for arm, lib in libs.items():
            probe(lib.resolve(), arm)
    except subprocess.CalledProcessError as exc:
        subprocess.run(["perf", "probe", "-q", "-d", f"{GROUP}:*"], capture_output=True)
        print(
            f"graph_time.py: perf probe failed: {exc.stderr.decode(errors='replace').strip()}",
            file=sys.stderr,
        )
        return 2
    own_lib_dir = os.environ.get("FLEETD_GGML_LIB_DIR")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = generate_named(a.model, Path(tmp))
        fleets = {"stock": ",".join(stack.enter_context(stock_process())[0] for _ in range(a.nodes))}
        for arm in libs:
            lib_dir = a.compare_lib if arm == "compare" else own_lib_dir
            if lib_dir:  # the fleet's daemons inherit it
                os.environ["FLEETD_GGML_LIB_DIR"] = lib_dir
            else:
                os.environ.pop("FLEETD_GGML_LIB_DIR", None)
            local = stack.enter_context(
                LocalFleet(
                    a.nodes, server_args=["--threads", "1"], control=False, preexec_fn=_pin(SERVER_CPUS)
                )
            )
            fleets[arm] = ",".join(local.endpoints)
        if own_lib_dir:  # as it was
            os.environ["FLEETD_GGML_LIB_DIR"] = own_lib_dir
        else:
            os.environ.pop("FLEETD_GGML_LIB_DIR", None)
        data = Path(tmp) / "perf.data"
        rec = subprocess.Popen(
            ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-e", f"{GROUP}:*", "-a", "-o", str(data)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)

        def bench_run(arm: str) -> tuple[str, float, float]:
            """One llama-bench decode over `arm`'s fleet: (arm, start, end)."""
            t0 = time.monotonic()
            subprocess.run(
                [str(bench), "-m", str(model), "--rpc", fleets[arm], "-ngl", "99", "-sm", "layer"]
                + ["-p", "0", "-n", str(a.n_gen), "-r", "1", "-t", "1"],
                check=True,
                capture_output=True,
                timeout=600,
            )
            return arm, t0, time.monotonic()

        try:  # a round is A B B A: two of abba()'s, in order and reversed
            by_half = abba_rounds(list(fleets), 2 * a.rounds, bench_run)
            spans = [span for half in by_half for span in half]
        finally:
            rec.send_signal(2)
            rec.wait(60)
            subprocess.run(["perf", "probe", "-q", "-d", f"{GROUP}:*"], capture_output=True)
        script = subprocess.run(
            ["perf", "script", "-i", str(data), "-F", "pid,time,event"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    runs = [r for r in runs_by_node(graph_times(script), spans) if len(r[2]) == a.nodes]
    stock = [r for r in runs if r[1] == "stock"]
    ratios: dict[str, list[list[float]]] = collections.defaultdict(lambda: [[] for _ in range(a.nodes)])
    for start, arm, meds in runs:
        if arm == "stock" or not stock:
            continue
        near = min(stock, key=lambda s: abs(s[0] - start))[2]
        for j in range(a.nodes):
            ratios[arm][j].append(meds[j] / near[j])
    rows, doc = [], {"nodes": a.nodes, "model": a.model, "n_gen": a.n_gen, "rounds": a.rounds, "arms": {}}
    for arm, per_node in ratios.items():
        rows.append(
            [f"{arm} ({libs[arm].name})"]
            + [f"{statistics.median(x):.2f} ({min(x):.2f}..{max(x):.2f})" for x in per_node]
        )
        doc["arms"][arm] = {"library": str(libs[arm]), "graph_time_x_stock_by_node": per_node}
    doc["runs"] = [{"start": s, "arm": n, "median_graph_s_by_node": m} for s, n, m in runs]
    show(
        f"ggml_graph_compute time x the stock server's, per node (largest graph first), {a.nodes} nodes on "
        f"loopback, {a.model}, decode tg{a.n_gen}, {a.rounds} ABBA rounds",
        ["fleet"] + [f"node {j + 1}" for j in range(a.nodes)],
        rows,
    )
    print(f"JSON: {save('graph_time', doc, a.json)}")
    return 0


def load_in_child(directory: str) -> Path:
    """The library fleetd would load from `directory`, asked of a child process (this one
    already holds its own ggml)."""
    out = subprocess.run(
        [sys.executable, "-c", "from fleetd.compute.ggml.lib import load; print(load().cpu_path)"],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, FLEETD_GGML_LIB_DIR=directory),
    )
    return Path(out.stdout.strip())


if __name__ == "__main__":
    raise SystemExit(main())

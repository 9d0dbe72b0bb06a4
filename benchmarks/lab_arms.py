"""Four arms side by side on the lab's emulated network (issue 20 item 5): a fleet of stock
`ggml-rpc-server`, fleetd on the hub path, fleetd with the synchronous direct copy, fleetd
with the asynchronous one. One lab (`fleetd.fleet.lab`), one stock server beside each fleetd in
every node's namespace, the same patched llama.cpp tools for every arm (only the servers and
GGML_RPC_P2P differ: 0 for stock and hub, sync, 1), the model split with `-sm layer -ngl 99`.

    sudo .venv/bin/python benchmarks/lab_arms.py --nodes 3 --coordinator-link 200mbit \\
        --peer-link 2gbit --rounds 3 [--chart docs/lab-arms.png]

Per cell (an arm in a round): llama-bench pp (n_prompt tokens in micro-batches of --ubatch, so
pipeline parallelism has several in flight) and tg; llama-batched-bench with --sequences
sequences; llama-completion --temp 0: the md5 of the greedy text, which must be equal in every
cell. Rounds run the arms in order and then reversed (ABBA); the table gives medians and
min..max over rounds, ratios against the stock fleet and the hub. Peak RSS (VmHWM) of every
server process is read at the end, and the hypervisor's steal time per cell (/proc/stat): a
cell with seconds of it ran while the host was busy elsewhere. Beside the medians, the ratios
per round (each from the same round's two cells, so drift between rounds cancels): their median
and quartiles over all rounds and over the quiet ones (no cell lost over 100 ms to steal);
`--report FILE` prints the tables of a saved run. Writes benchmarks/results/lab_arms.json. Needs
root. A cell takes 3-10 s on 2 cores (3 arms x 20 rounds with --n-gen 128: 3 min at 1 Gbit/s,
5-7 min at 200 Mbit/s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, show, steal_ns, stop_processes  # noqa: E402

from fleetd.errors import FleetError  # noqa: E402
from fleetd.fleet.chart import write_bar_chart  # noqa: E402
from fleetd.fleet.lab import Lab, parse_rate  # noqa: E402
from fleetd.fleet.model_ab import (  # noqa: E402
    PROMPT,
    client_stats,
    parse_batched_table,
    parse_bench_json,
    run_p2p_tool,
)
from fleetd.models import generate_named  # noqa: E402
from fleetd.ports import DEFAULT_RPC_PORT  # noqa: E402
from fleetd.tools import find_tool  # noqa: E402
from fleetd.transport import wait_listening  # noqa: E402

ARMS = ("stock", "hub", "sync", "async")
P2P_ENV = {"stock": "0", "hub": "0", "sync": "sync", "async": "1"}
STOCK_PORT = DEFAULT_RPC_PORT + 1
METRICS = {"pp_tps": "prompt tok/s", "tg_tps": "decode tok/s", "batched_tps": "batched tok/s"}
TOOL_TIMEOUT_S = 600


def start_stock(
    lab_nodes,
    threads: int,
    log_dir: Path,
    extra: Sequence[str] = (),
    env_for: Callable | None = None,
    node_cpus: Sequence[Sequence[int] | None] | None = None,
) -> list[subprocess.Popen]:
    """A stock ggml-rpc-server (`extra` flags, `env_for(node)` its environment, `node_cpus[j]`
    the cores it may run on, as its node's fleetd) in each node's namespace on STOCK_PORT, each
    answering before this returns; all stopped if one does not."""
    procs = []
    exe = str(find_tool("ggml-rpc-server"))
    try:
        for j, n in enumerate(lab_nodes):
            cpus = set(node_cpus[j]) if node_cpus and node_cpus[j] else None

            def place(n=n, cpus=cpus) -> None:  # before exec, as the lab places its fleetd
                if n.cpu_group:
                    n.join_cpu_group()
                if cpus:
                    os.sched_setaffinity(0, cpus)

            with open(log_dir / f"stock-{n.name}.log", "ab") as log:
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", n.netns, exe, "-H", n.address, "-p", str(STOCK_PORT)]
                        + ["-t", str(threads), *extra],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env_for(n) if env_for else None,
                        preexec_fn=place if (cpus or n.cpu_group) else None,
                    )
                )
        for n, proc in zip(lab_nodes, procs, strict=True):
            deadline = time.monotonic() + 30
            while True:  # the root namespace reaches the node's address over its coordinator link
                try:
                    wait_listening(STOCK_PORT, timeout=1.0, host=n.address)
                    break
                except TimeoutError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise FleetError(f"stock ggml-rpc-server on {n.address} did not start") from None
    except BaseException:
        stop_processes(procs)
        raise
    return procs


def arm_endpoints(lab_nodes, arms: Sequence[str]) -> dict[str, str]:
    """--rpc for each arm: the stock servers (start_stock's port) for "stock", the lab's fleetd
    for every other arm (they differ in the client's GGML_RPC_P2P only)."""
    port = {"stock": STOCK_PORT}
    return {
        arm: ",".join(f"{n.address}:{port.get(arm, DEFAULT_RPC_PORT)}" for n in lab_nodes) for arm in arms
    }


def abba(arms: Sequence[str], r: int) -> list[str]:
    """Round r's order: the arms as given on even rounds, reversed on odd ones (ABBA)."""
    return list(arms) if r % 2 == 0 else list(arms[::-1])


def abba_rounds(arms: Sequence[str], rounds: int, run: Callable[[str], dict]) -> list[list[dict]]:
    """run(arm) for every arm in every round, in abba() order, a progress line each: the
    cells of each round."""
    out = []
    for r in range(rounds):
        cells = []
        for arm in abba(arms, r):
            print(f"round {r + 1}/{rounds}: {arm}", file=sys.stderr, flush=True)
            cells.append(run(arm))
        out.append(cells)
    return out


def parse_arms(ap: argparse.ArgumentParser, text: str, known: Sequence[str]) -> list[str]:
    """--arms as a list, or a usage error naming what is unknown."""
    arms = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in arms if x not in known]
    if bad or not arms:
        ap.error(f"--arms: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(known)}")
    return arms


def add_lab_options(ap: argparse.ArgumentParser, coordinator_link: str) -> None:
    """The lab's own options (nodes, links, model, rounds), as lab_arms.py and lab_cpu.py take
    them; `coordinator_link` the default rate of each node's link to the coordinator."""
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--coordinator-link", default=coordinator_link)
    ap.add_argument("--peer-link", default="2gbit")
    ap.add_argument("--model", default="llama-f16-wide", help="a fleetd.models name (default llama-f16-wide)")
    ap.add_argument("--rounds", type=int, default=3)


def parse_links(ap: argparse.ArgumentParser, a) -> tuple[int, int]:
    """(coordinator, peer) link rates in bit/s from --coordinator-link and --peer-link."""
    try:
        return parse_rate(a.coordinator_link), parse_rate(a.peer_link)
    except ValueError as exc:
        ap.error(str(exc))


def one_core_each(nodes: int) -> list[list[int]]:
    """Node j's cores for --pin-nodes: core j mod this machine's cores."""
    cores = sorted(os.sched_getaffinity(0))
    return [[cores[j % len(cores)]] for j in range(nodes)]


def run(tool: str, args: list[str], arm: str) -> subprocess.CompletedProcess:
    return run_p2p_tool(tool, args, P2P_ENV[arm], arm, TOOL_TIMEOUT_S)


def cell(model: Path, rpc: str, arm: str, a) -> dict:
    stolen = steal_ns()
    out = tools_cell(model, rpc, arm, a)
    out["steal_ms"] = (steal_ns() - stolen) / 1e6  # the host's: a cell with seconds of it is noise
    return out


def tools_cell(model: Path, rpc: str, arm: str, a) -> dict:
    base = ["-m", str(model), "--rpc", rpc, "-sm", "layer", "-ngl", "99", "-t", "1"]
    bench = run(
        "llama-bench",
        [*base, "-p", str(a.n_prompt), "-n", str(a.n_gen), "-b", str(a.n_prompt), "-ub", str(a.ubatch)]
        + ["-r", "1", "-o", "json"],
        arm,
    )
    out: dict = {"arm": arm, **parse_bench_json(bench.stdout)}
    out["bench_client"] = client_stats(bench.stderr, "llama-bench")
    ctx = a.sequences * (a.batch_prompt + a.batch_gen) + 16
    for _ in range(3):  # llama's log thread can drop the table at exit on a busy machine
        batched = run(
            "llama-batched-bench",
            [*base, "-c", str(ctx), "-npp", str(a.batch_prompt), "-ntg", str(a.batch_gen)]
            + ["-npl", str(a.sequences), "-b", str(a.batch_prompt * a.sequences), "-ub", str(a.ubatch)],
            arm,
        )
        rows = parse_batched_table(batched.stdout + "\n" + batched.stderr)
        if rows:
            break
    else:
        raise FleetError(f"llama-batched-bench ({arm}): no table in 3 runs")
    out["batched_tps"] = rows[-1]["s"]
    for _ in range(3):
        text = run(
            "llama-completion",
            # -v: llama.cpp logs "pipeline parallelism enabled" at a level shown only then
            [*base, "-p", PROMPT, "-n", str(a.text_gen), "--temp", "0", "--seed", "1", "-no-cnv", "-v"],
            arm,
        )
        if text.stdout.endswith("\n\n"):
            break
    out["md5"] = hashlib.md5(text.stdout.encode()).hexdigest()
    out["pipeline_parallel"] = "pipeline parallelism enabled" in text.stderr
    return out


def peak_rss_mib(pids: list[int]) -> list[float]:
    out = []
    for pid in pids:
        try:
            line = next(
                x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM")
            )
            out.append(int(line.split()[1]) / 1024)
        except (OSError, StopIteration):
            out.append(float("nan"))
    return out


QUIET_MS = 100  # a round is quiet when none of its cells lost more than this to the host's steal


def summarize(rounds: list[dict], arms: Sequence[str]) -> dict:
    """Per arm and metric: median, min and max over the rounds."""
    by_arm = {arm: [c for rd in rounds for c in rd["cells"] if c["arm"] == arm] for arm in arms}
    return {
        arm: {
            m: {
                "median": statistics.median(c[m] for c in cells),
                "min": min(c[m] for c in cells),
                "max": max(c[m] for c in cells),
            }
            for m in METRICS
        }
        for arm, cells in by_arm.items()
        if cells
    }


def paired(rounds: list[dict], arm: str, ref: str, metric: str, quiet_ms: float | None = None) -> list[float]:
    """arm / ref per round, each from the same round's two cells (ABBA: next to each other in
    time), so drift between rounds cancels; with `quiet_ms`, only rounds where no cell lost
    more than that to the host's steal."""
    out = []
    for rd in rounds:
        cells = {c["arm"]: c for c in rd["cells"]}
        if arm not in cells or ref not in cells or not cells[ref][metric]:
            continue
        if quiet_ms is not None and max(c["steal_ms"] for c in rd["cells"]) > quiet_ms:
            continue
        out.append(cells[arm][metric] / cells[ref][metric])
    return out


def spread(xs: list[float]) -> dict:
    """Median and quartiles (the values themselves below 4 of them)."""
    if not xs:
        return {"n": 0}
    q = statistics.quantiles(xs, n=4) if len(xs) >= 4 else [min(xs), statistics.median(xs), max(xs)]
    return {"n": len(xs), "median": q[1], "q1": q[0], "q3": q[2]}


def paired_summary(rounds: list[dict], arms: Sequence[str]) -> dict:
    """Per arm, metric and reference arm: the paired ratios over all rounds and the quiet ones."""
    return {
        arm: {
            m: {
                f"x_{ref}": {
                    "all": spread(paired(rounds, arm, ref, m)),
                    "quiet": spread(paired(rounds, arm, ref, m, QUIET_MS)),
                }
                for ref in ("stock", "hub")
                if ref in arms and ref != arm
            }
            for m in METRICS
        }
        for arm in arms
    }


def cores_text(node_cores: float | None, pin_nodes: bool) -> str:
    cores = f" of {node_cores:g} cores" if node_cores else ""
    return cores + (", each pinned to one core" if pin_nodes else "")


def _ratio_text(r: dict) -> str:
    if not r["n"]:
        return "-"
    return f"{r['median']:.2f} [{r['q1']:.2f}..{r['q3']:.2f}] n={r['n']}"


def report(doc: dict) -> None:
    """The tables of a run: medians with min..max and their ratios, then the paired ratios per
    round (all rounds, and the quiet ones), md5, steal, pipeline parallelism, peak RSS."""
    st, rounds = doc["settings"], doc["rounds"]
    arms = _arms_of(doc)
    summary = doc.get("summary") or summarize(rounds, arms)
    pairs = doc.get("paired") or paired_summary(rounds, arms)
    rows = []
    for m, label in METRICS.items():
        for arm in arms:
            s = summary[arm][m]
            vs = [
                f"{s['median'] / summary[ref][m]['median']:.2f}" if ref in summary and ref != arm else "-"
                for ref in ("stock", "hub")
            ]
            rows.append([label, arm, f"{s['median']:.1f}", f"{s['min']:.1f}..{s['max']:.1f}", *vs])
    title = (
        f"{st['nodes']} nodes{cores_text(st.get('node_cores'), st.get('pin_nodes'))}, "
        f"coordinator links {st['coordinator_link']}, peer links {st['peer_link']}, "
        f"{doc['model']}, {st['rounds']} rounds (ABBA)"
    )
    show(title, ["metric", "arm", "median", "min..max", "x stock", "x hub"], rows)
    rows = []
    for m, label in METRICS.items():
        for arm in arms:
            ratios = pairs[arm][m]
            if not ratios:
                continue
            row = [label, arm]
            for ref in ("stock", "hub"):
                r = ratios.get(f"x_{ref}")
                row += [_ratio_text(r["all"]), _ratio_text(r["quiet"])] if r else ["-", "-"]
            rows.append(row)
    show(
        f"paired per round: median (quartiles); quiet: no cell of the round lost over {QUIET_MS} ms to steal",
        ["metric", "arm", "x stock", "x stock, quiet", "x hub", "x hub, quiet"],
        rows,
    )
    md5s = {c["md5"] for rd in rounds for c in rd["cells"]}
    print(f"greedy text md5 equal in every cell: {len(md5s) == 1} ({', '.join(sorted(md5s))})")
    steal = sorted((c["steal_ms"], rd["round"], c["arm"]) for rd in rounds for c in rd["cells"])
    print(
        f"host steal per cell: median {statistics.median(x for x, _, _ in steal):.0f} ms, "
        f"most {steal[-1][0]:.0f} ms (round {steal[-1][1]}, {steal[-1][2]})"
    )
    pp = {c["pipeline_parallel"] for rd in rounds for c in rd["cells"]}
    print(f"llama.cpp logged 'pipeline parallelism enabled': {sorted(pp)}")
    rss = doc["peak_rss_mib"]
    print(f"peak RSS MiB per node: stock {rss['stock']}, fleetd daemon {rss['fleetd']}")


def chart(doc: dict, path: str) -> str:
    """A bar chart of a run: each metric's median per arm, min..max as the error bar."""
    st, summary = doc["settings"], doc.get("summary") or summarize(doc["rounds"], _arms_of(doc))
    panels = {
        label: {
            arm: (summary[arm][m]["median"], summary[arm][m]["min"], summary[arm][m]["max"])
            for arm in summary
        }
        for m, label in METRICS.items()
    }
    title = (
        f"{st['nodes']} nodes{cores_text(st.get('node_cores'), st.get('pin_nodes'))}, "
        f"coordinator {st['coordinator_link']}, peers {st['peer_link']}, "
        f"{st['rounds']} rounds: median, min..max"
    )
    return write_bar_chart(path, title, panels)


def _arms_of(doc: dict) -> list[str]:
    return [c["arm"] for c in doc["rounds"][0]["cells"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_lab_options(ap, coordinator_link="200mbit")
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--ubatch", type=int, default=128, help="micro-batch (default 128: 4 per prompt)")
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--sequences", type=int, default=4, help="llama-batched-bench sequences (default 4)")
    ap.add_argument("--batch-prompt", type=int, default=128)
    ap.add_argument("--batch-gen", type=int, default=32)
    ap.add_argument("--text-gen", type=int, default=32, help="greedy tokens for the md5 (default 32)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--fleetd-args", default="", help="more fleetd flags (--fleetd-args='--max-memory 1G')")
    ap.add_argument(
        "--node-cores",
        type=float,
        help="CPU time per node in cores (a quota each node's fleetd or stock server runs under): "
        "nodes that stand for machines, so that a 4th node adds compute (default: none, all share)",
    )
    ap.add_argument(
        "--pin-nodes",
        action="store_true",
        help="run node j (its fleetd with its workers, its stock server) on core j mod the "
        "machine's cores, as a machine's own cores: a daemon and its worker then wake on one core",
    )
    ap.add_argument("--chart", help="write a PNG bar chart here")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/lab_arms.json)")
    ap.add_argument(
        "--report", metavar="JSON", help="print the tables of an earlier run's JSON (and --chart) and exit"
    )
    a = ap.parse_args()
    if a.report:
        try:
            doc = json.loads(Path(a.report).read_text())
            report(doc)
            if a.chart:
                print(f"wrote {chart(doc, a.chart)}")
        except (KeyError, IndexError, TypeError) as exc:
            ap.error(f"--report {a.report}: not a lab_arms.py result (no {exc})")
        except (OSError, ValueError) as exc:
            ap.error(f"--report {a.report}: {exc}")
        return 0
    arms = parse_arms(ap, a.arms, ARMS)
    coord, peer = parse_links(ap, a)
    work = Path(tempfile.mkdtemp(prefix="lab-arms-"))
    model = generate_named(a.model, work)
    lab = Lab(work / "lab")
    stock: list[subprocess.Popen] = []
    try:
        node_cpus = one_core_each(a.nodes) if a.pin_nodes else None
        lab_nodes = lab.up(
            a.nodes,
            coord,
            peer,
            node_args=[shlex.split(a.fleetd_args)] * a.nodes,
            node_cores=a.node_cores,
            node_cpus=node_cpus,
        )
        stock = start_stock(lab_nodes, 1, work, node_cpus=node_cpus)
        rpc = arm_endpoints(lab_nodes, ARMS)
        rounds = [
            {"round": r + 1, "order": abba(arms, r), "cells": cells}
            for r, cells in enumerate(abba_rounds(arms, a.rounds, lambda arm: cell(model, rpc[arm], arm, a)))
        ]
        rss = {
            "stock": peak_rss_mib([p.pid for p in stock]),
            "fleetd": peak_rss_mib(lab.state.get("pids", [])),
        }
    finally:
        for p in stock:
            p.terminate()
        for p in stock:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        lab.down()

    md5s = {c["md5"] for rd in rounds for c in rd["cells"]}
    doc = {
        "settings": {k: v for k, v in vars(a).items() if k not in ("chart", "out", "report")},
        "model": model.name,
        "summary": summarize(rounds, arms),
        "paired": paired_summary(rounds, arms),
        "md5_equal": len(md5s) == 1,
        "peak_rss_mib": rss,
        "rounds": rounds,
    }
    report(doc)
    print(f"wrote {save('lab_arms', doc, a.out)}")
    if a.chart:
        print(f"wrote {chart(doc, a.chart)}")
    return 0 if len(md5s) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())

"""`fleetctl stage` then `fleetctl serve` in the lab (issue 21, second "must show"): how long a load
of a ~0.7 GB model takes over 200 Mbit/s coordinator links, and how many bytes cross those links,
for fleetd without staging, fleetd staged, and the stock server with its own `-c` cache.

    .venv/bin/python benchmarks/stage_lab.py --rounds 2 [--chart docs/stage-lab.png]

One lab (`fleetd.fleet.lab`, 3 nodes, coordinator links --coordinator-link, peer links
--peer-link, torn down in a finally), each fleetd started with `-c` (a cache directory of its
own) and a --max-memory that holds its even share of the layers and no more (the plan would put
a model this size whole on one node); a stock `ggml-rpc-server -c` beside it in every node's
namespace (port 50053) while the stock arm runs, its cache directory a fresh one per arm
(`$LLAMA_CACHE/rpc`, which is where the pinned rpc-server.cpp puts it). The model: fleetd.models
"llama-f16-stage" (6 layers, ~680 MB f16, 30 of its 57 tensors, 93% of the bytes, above the
client's 10 MiB hash threshold). One plan for every arm: `fleetctl plan MODEL NODES --json` once;
its --rpc order and --tensor-split, and the stock arm the same with the stock ports.

A load: llama-server with the plan's flags (`fleetd.fleet.serve.llama_server_args`, as serve
starts it), timed from its start until /health answers 200; then one greedy /completion whose text
must be equal in every load; then stopped. Arms, each starting from empty caches, each load
twice (1st, 2nd):

- fleetd unstaged: llama-server (the patched client) started directly. fleetd's `-c` stores what
  a first load sends (the client's cache flag), as the stock server's does, so its 2nd load is
  already a cached one.
- fleetd staged: `fleetctl stage MODEL NODES --plan plan.json` (timed), then `fleetctl serve MODEL
  NODES --plan plan.json --port P` as a subprocess (its real code path), timed from its start
  until the front's /health answers 200 (so fleetctl's own start, its node watches and the front
  are in it), stopped with `fleetctl serve --stop --port P`. In the lab the nodes share this
  host's disk, so stage is a local copy (hash + write + fsync), not a transfer over the link: on
  real nodes it sends the hashed tensors' bytes (what a first load sends less the tensors under
  the threshold) once, ahead of time, over SFTP.
- stock -c: the stock ggml-rpc-server with an empty `-c` cache, llama-server started directly.

Bytes on the coordinator links per load (start until /health 200), two ways: the fleetd nodes'
own counters (/v1/stats: request + response bytes of every command, summed over the nodes), and
for every arm the kernel's counters of each node's coordinator veth (rx + tx bytes of the root
end: payload plus TCP/IP headers and ACKs; 0.3% above the first here, with segmentation
offload). Rounds run the arms in order, then reversed; medians and min..max over rounds.

What the lab cannot show: a real disk (the caches and the model are in this host's page cache, so
a cached load reads memory, where a node would read its disk) and a real stage transfer (above).
The coordinator and the three nodes share 2 cores. Writes benchmarks/results/stage_lab.json.
Needs root. About 3.5 minutes with the defaults (the plan ~20 s, then ~1.5 min per round; the
model is generated once into --models-dir, ~11 s).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, show, stop_processes  # noqa: E402
from lab_arms import STOCK_PORT, start_stock  # noqa: E402
from plan_lab import room_for  # noqa: E402

from fleetd.ctl.plan_command import DEFAULT_CTX  # noqa: E402
from fleetd.errors import FleetdError, FleetError  # noqa: E402
from fleetd.fleet.chart import write_bar_chart  # noqa: E402
from fleetd.fleet.lab import Lab, LabNode, parse_rate  # noqa: E402
from fleetd.fleet.model_ab import PROMPT  # noqa: E402
from fleetd.fleet.node import Fleet  # noqa: E402
from fleetd.fleet.plan import Workload, read_model  # noqa: E402
from fleetd.fleet.serve import ServeConfig, llama_server_args  # noqa: E402
from fleetd.fleet.server_load import LlamaServer, completion_body, health_status  # noqa: E402
from fleetd.models import generate_named  # noqa: E402
from fleetd.tools import find_p2p_tool  # noqa: E402
from fleetd.transport import free_port  # noqa: E402

ARMS = ("unstaged", "staged", "stock")
LABELS = {"unstaged": "fleetd unstaged", "staged": "fleetd staged + serve", "stock": "stock -c"}
FLEETCTL = str(Path(sys.executable).parent / "fleetctl")
CMD_TIMEOUT_S = 600  # fleetctl plan / stage
HTTP_TIMEOUT_S = 300  # one completion
STOP_TIMEOUT_S = 60  # fleetctl serve --stop, and the serve process ending after it
RELEASE_S = 30  # the nodes free a stopped llama-server's buffers asynchronously
POLL_S = 0.2  # as server_load's /health poll
MB = 1e6
MIB = 1 << 20


def max_memory(model: Path, nodes: int) -> str:
    """fleetd --max-memory that holds an even share of the layers (and the output layer) but not
    one more: the model fits no single node, so the plan spreads it over all of them (a model this
    size would otherwise go whole onto one node, which the plan predicts fastest)."""
    sizes = read_model(model)
    work = Workload(ctx=sizes.n_ctx_train or DEFAULT_CTX)  # what `fleetctl plan` sizes for
    share = -(-sizes.n_layer // nodes)
    return f"{room_for(sizes, work, share, True) // MIB + 1}M"


# -- counters ------------------------------------------------------------------------------------


def link_bytes(links: list[str]) -> dict[str, int]:
    """rx + tx bytes of each coordinator link's root end (kernel counters)."""
    out = {}
    for dev in links:
        stats = Path("/sys/class/net") / dev / "statistics"
        out[dev] = int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())
    return out


def node_counters(fleet: Fleet) -> dict[str, dict[str, int]]:
    """Per node: request + response bytes per command, since its start (/v1/stats totals)."""
    result = fleet.map(lambda n: n.stats()).raise_on_failure()
    return {
        node.name: {name: c.request_bytes + c.response_bytes for name, c in st.total.commands.items()}
        for node, st in result.items()
    }


def snapshot(fleet: Fleet, links: list[str]) -> dict:
    return {"t": time.monotonic(), "links": link_bytes(links), "nodes": node_counters(fleet)}


def delta(before: dict, after: dict) -> dict:
    """Bytes between two snapshots: per link and in all (kernel), per node, per command and in all
    (fleetd's counters)."""
    links = {k: after["links"][k] - before["links"][k] for k in after["links"]}
    per_cmd: dict[str, int] = {}
    per_node = {}
    for node, cmds in after["nodes"].items():
        old = before["nodes"].get(node, {})
        d = {c: v - old.get(c, 0) for c, v in cmds.items() if v - old.get(c, 0)}
        per_node[node] = sum(d.values())
        for c, v in d.items():
            per_cmd[c] = per_cmd.get(c, 0) + v
    return {
        "seconds": after["t"] - before["t"],
        "link_bytes": sum(links.values()),
        "link_bytes_per_link": links,
        "counter_bytes": sum(per_node.values()),
        "counter_bytes_per_node": per_node,
        "counter_bytes_per_command": per_cmd,
    }


# -- the nodes' state ----------------------------------------------------------------------------


def wait_released(fleet: Fleet) -> None:
    """Until no session holds memory on any fleetd (RELEASE_S at most)."""
    deadline = time.monotonic() + RELEASE_S
    while True:
        try:
            held = [sum(s.allocated_bytes for s in n.status().sessions) for n in fleet]
        except (FleetdError, OSError) as exc:
            raise FleetError(f"a node's status: {exc}") from exc
        if not any(held):
            return
        if time.monotonic() > deadline:
            raise FleetError(f"the nodes still hold {held} bytes {RELEASE_S}s after the last load")
        time.sleep(POLL_S)


def empty(directory: Path) -> None:
    """Everything in a cache directory removed (fleetd looks files up by name, so a removed
    file is a miss), the directory kept."""
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def held(directory: Path) -> tuple[int, int]:
    """(files, bytes) of cache files (16 hex digits, as both servers name them) under `directory`."""
    files = [p for p in directory.rglob("*") if p.is_file() and len(p.name) == 16]
    return len(files), sum(p.stat().st_size for p in files)


# -- stock servers -------------------------------------------------------------------------------


def start_stock_cached(lab_nodes: list[LabNode], cache_root: Path, log_dir: Path) -> list[subprocess.Popen]:
    """A stock `ggml-rpc-server -c` in each node's namespace; its cache `<cache_root>/<node>/rpc`
    ($LLAMA_CACHE/rpc: tools/rpc/rpc-server.cpp's fs_get_cache_directory)."""
    return start_stock(
        lab_nodes, 1, log_dir, ["-c"], lambda n: dict(os.environ, LLAMA_CACHE=str(cache_root / n.name))
    )


# -- one load ------------------------------------------------------------------------------------


def complete(port: int, n_predict: int) -> str:
    """One greedy /completion: its text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request(
            "POST",
            "/completion",
            json.dumps(completion_body(PROMPT, n_predict)),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise FleetError(f"/completion: HTTP {resp.status}: {body[:200]!r}")
        return json.loads(body)["content"]
    finally:
        conn.close()


def direct_load(args: list[str], ctx: dict, label: str) -> dict:
    """llama-server started directly: seconds until /health 200, the bytes meanwhile, the text."""
    before = snapshot(ctx["fleet"], ctx["links"])
    server = LlamaServer(
        ctx["llama_server"],
        args,
        dict(os.environ, GGML_NO_BACKTRACE="1"),  # as serve starts it
        label,
        ctx["a"].start_timeout,
        log_path=ctx["work"] / f"llama-server-{label}.log",
    )
    t0 = time.monotonic()
    with server:
        load_s = time.monotonic() - t0
        load = delta(before, snapshot(ctx["fleet"], ctx["links"]))
        mid = snapshot(ctx["fleet"], ctx["links"])
        text = complete(server.port, ctx["a"].n_predict)
        after = delta(mid, snapshot(ctx["fleet"], ctx["links"]))
    return {"load_s": load_s, **load, "completion_link_bytes": after["link_bytes"], "text": text}


def serve_load(ctx: dict, label: str) -> dict:
    """`fleetctl serve` as a subprocess: seconds until its front's /health answers 200 (and until
    it printed its URL), the bytes meanwhile, the text; then `fleetctl serve --stop`."""
    a, port = ctx["a"], free_port()
    argv = [FLEETCTL, "serve", str(ctx["model"]), str(ctx["nodes_file"]), "--plan", str(ctx["plan_file"])]
    argv += ["--port", str(port)]
    before = snapshot(ctx["fleet"], ctx["links"])
    printed: list[float] = []
    with open(ctx["work"] / f"serve-{label}.log", "ab") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True, bufsize=1
        )
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("serving ") and not printed:
                printed.append(time.monotonic() - t0)
            lines.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = t0 + a.start_timeout
        while health_status(port) != 200:
            if proc.poll() is not None:
                raise FleetError(f"fleetctl serve exited {proc.returncode}: {' | '.join(lines[-3:])}")
            if time.monotonic() > deadline:
                raise FleetError(f"fleetctl serve not serving within {a.start_timeout:g}s")
            time.sleep(POLL_S)
        load_s = time.monotonic() - t0
        load = delta(before, snapshot(ctx["fleet"], ctx["links"]))
        mid = snapshot(ctx["fleet"], ctx["links"])
        text = complete(port, a.n_predict)
        after = delta(mid, snapshot(ctx["fleet"], ctx["links"]))
        stop = subprocess.run(
            [FLEETCTL, "serve", "--stop", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=STOP_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        if stop.returncode != 0:
            raise FleetError(f"fleetctl serve --stop: exit {stop.returncode}: {stop.stderr.strip()}")
        proc.wait(STOP_TIMEOUT_S)
    finally:
        stop_processes([proc])
        reader.join(10)
    return {
        "load_s": load_s,
        "url_printed_s": printed[0] if printed else None,
        **load,
        "completion_link_bytes": after["link_bytes"],
        "text": text,
        "serve_exit": proc.returncode,
    }


def fleetctl_start_s() -> float:
    """The median of 3 `fleetctl serve --help`: Python and fleetctl's imports, which every
    `fleetctl serve` load pays before it reaches llama-server."""
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run([FLEETCTL, "serve", "--help"], capture_output=True, timeout=60, check=True)
        times.append(time.monotonic() - t0)
    return statistics.median(times)


# -- the arms ------------------------------------------------------------------------------------


def run_arm(arm: str, rnd: int, ctx: dict) -> dict:
    say = ctx["say"]
    out: dict = {"arm": arm, "round": rnd, "loads": []}
    if arm in ("unstaged", "staged"):
        for d in ctx["cache_dirs"]:
            empty(d)
    if arm == "unstaged":
        for i in (1, 2):
            wait_released(ctx["fleet"])
            say(f"round {rnd}: {arm} load {i}")
            load = direct_load(ctx["fleetd_args"], ctx, f"{arm}-r{rnd}-{i}")
            load["cache_after"] = [held(d) for d in ctx["cache_dirs"]]
            out["loads"].append(load)
    elif arm == "staged":
        wait_released(ctx["fleet"])
        say(f"round {rnd}: fleetctl stage")
        before = snapshot(ctx["fleet"], ctx["links"])
        p = subprocess.run(
            [FLEETCTL, "stage", str(ctx["model"]), str(ctx["nodes_file"]), "--plan", str(ctx["plan_file"])]
            + ["--json"],
            capture_output=True,
            text=True,
            timeout=CMD_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        stage = delta(before, snapshot(ctx["fleet"], ctx["links"]))
        if p.returncode != 0:
            raise FleetError(f"fleetctl stage: exit {p.returncode}: {p.stderr.strip()}")
        report = json.loads(p.stdout)
        out["stage"] = {
            "seconds": stage["seconds"],
            "link_bytes": stage["link_bytes"],
            "counter_bytes": stage["counter_bytes"],
            "sent_bytes": sum(n["sent_bytes"] for n in report["nodes"].values()),
            "sent_files": sum(n["sent_files"] for n in report["nodes"].values()),
            "per_node": {
                k: {x: v[x] for x in ("sent_files", "sent_bytes", "seconds")}
                for k, v in report["nodes"].items()
            },
        }
        for i in (1, 2):
            wait_released(ctx["fleet"])
            say(f"round {rnd}: {arm} load {i} (fleetctl serve)")
            load = serve_load(ctx, f"{arm}-r{rnd}-{i}")
            load["cache_after"] = [held(d) for d in ctx["cache_dirs"]]
            out["loads"].append(load)
    else:
        cache_root = ctx["work"] / "stock-cache" / f"r{rnd}"
        cache_root.mkdir(parents=True)
        procs = start_stock_cached(ctx["lab_nodes"], cache_root, ctx["work"])
        try:
            for i in (1, 2):
                say(f"round {rnd}: {arm} load {i}")
                load = direct_load(ctx["stock_args"], ctx, f"{arm}-r{rnd}-{i}")
                load["cache_after"] = [held(cache_root / n.name) for n in ctx["lab_nodes"]]
                out["loads"].append(load)
        finally:
            stop_processes(procs)
    return out


# -- output --------------------------------------------------------------------------------------


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread(s: dict, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(s['min'] / scale)}..{fmt.format(s['max'] / scale)}"


def analyse(cells: list[dict]) -> dict:
    summary: dict = {}
    for arm in ARMS:
        mine = [c for c in cells if c["arm"] == arm]
        if not mine:
            continue
        summary[arm] = {}
        for i in (1, 2):
            loads = [c["loads"][i - 1] for c in mine]
            summary[arm][str(i)] = {
                "load_s": summarise([x["load_s"] for x in loads]),
                "link_bytes": summarise([x["link_bytes"] for x in loads]),
                "counter_bytes": summarise([x["counter_bytes"] for x in loads]),
            }
            if arm == "staged":
                printed = [x["url_printed_s"] for x in loads if x["url_printed_s"] is not None]
                summary[arm][str(i)]["url_printed_s"] = summarise(printed) if printed else None
        if arm == "staged":
            summary[arm]["stage"] = {
                k: summarise([c["stage"][k] for c in mine]) for k in ("seconds", "link_bytes", "sent_bytes")
            }
    return summary


def report(summary: dict, cells: list[dict], a, model_bytes: int) -> list[list[str]]:
    base = summary.get("unstaged", {}).get("1", {}).get("load_s", {}).get("median")
    rows = []
    if "staged" in summary:
        st = summary["staged"]["stage"]
        rows.append(
            [
                LABELS["staged"],
                "fleetctl stage (local copy)",
                f"{st['seconds']['median']:.1f}",
                spread(st["seconds"]),
                f"{st['link_bytes']['median'] / MB:.2f}",
                "-",
                "-",
                "-",
            ]
        )
    for arm in ARMS:
        if arm not in summary:
            continue
        for i in ("1", "2"):
            s = summary[arm][i]
            t = s["load_s"]["median"]
            stock = summary.get("stock", {}).get(i, {}).get("load_s", {}).get("median")
            rows.append(
                [
                    LABELS[arm],
                    "1st load" if i == "1" else "2nd load",
                    f"{t:.1f}",
                    spread(s["load_s"]),
                    f"{s['link_bytes']['median'] / MB:.1f}",
                    f"{s['counter_bytes']['median'] / MB:.1f}" if arm != "stock" else "-",
                    f"{t / base:.2f}" if base else "-",
                    f"{t / stock:.2f}" if stock and arm != "stock" else "-",
                ]
            )
    show(
        f"{a.nodes} nodes, coordinator links {a.coordinator_link}, peer links {a.peer_link}, "
        f"{a.model} ({model_bytes / MB:.0f} MB), {a.rounds} round(s), arms in order then reversed",
        [
            "arm",
            "load",
            "load s",
            "min..max",
            "MB on coord. links (kernel)",
            "MB (fleetd counters)",
            "x unstaged 1st",
            "x stock same load",
        ],
        rows,
    )
    return rows


def chart(summary: dict, path: str, a) -> Path:
    """One panel per load (1st, 2nd) and measure (seconds, MB on the links), one bar per arm."""
    short = {"unstaged": "unstaged", "staged": "staged", "stock": "stock -c"}
    panels: dict = {}
    for measure, key, scale in (("s", "load_s", 1.0), ("MB", "link_bytes", MB)):
        for i, which in (("1", "1st"), ("2", "2nd")):
            panels[f"{which} load {measure}"] = {
                short[arm]: tuple(summary[arm][i][key][k] / scale for k in ("median", "min", "max"))
                for arm in ARMS
                if arm in summary
            }
    title = f"{a.model} load: seconds, MB on the {a.coordinator_link} coordinator links"
    return write_bar_chart(path, title, panels)


# -- main ----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--coordinator-link", default="200mbit")
    ap.add_argument("--peer-link", default="2gbit")
    ap.add_argument(
        "--model", default="llama-f16-stage", help="a fleetd.models name (default llama-f16-stage)"
    )
    ap.add_argument(
        "--models-dir",
        default=str(Path.home() / ".cache" / "fleetd" / "models"),
        help="where the model is generated (reused when there; default ~/.cache/fleetd/models)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-predict", type=int, default=16, help="greedy tokens per completion (default 16)")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds one load may take")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--dir", help="work directory: lab, caches, logs (default a new temporary one)")
    ap.add_argument("--chart", help="write a PNG bar chart here")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/stage_lab.json)")
    a = ap.parse_args()
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not arms or any(x not in ARMS for x in arms):
        ap.error(f"--arms: choose from {', '.join(ARMS)}")
    if not 1 <= a.rounds <= 10:
        ap.error("--rounds: 1..10")
    if not 1 <= a.n_predict <= 512:
        ap.error("--n-predict: 1..512")
    if not 1 <= a.nodes <= 6:
        ap.error("--nodes: 1..6")
    try:
        coord, peer = parse_rate(a.coordinator_link), parse_rate(a.peer_link)
    except ValueError as exc:
        ap.error(str(exc))
    if os.geteuid() != 0:
        ap.error("needs root (network namespaces)")

    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="stage-lab-"))
    work.mkdir(parents=True, exist_ok=True)
    t_gen = time.monotonic()
    model = generate_named(a.model, Path(a.models_dir))
    gen_s = time.monotonic() - t_gen
    model_bytes = model.stat().st_size
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    say(f"model {model} ({model_bytes / MB:.0f} MB; {gen_s:.1f}s to generate or find); work dir {work}")

    cache_dirs = [work / "fleetd-cache" / f"lab-{j}" for j in range(a.nodes)]
    for d in cache_dirs:
        d.mkdir(parents=True, exist_ok=True)
        empty(d)
    lab = Lab(work / "lab")
    cells: list[dict] = []
    try:
        room = max_memory(model, a.nodes)
        say(f"each fleetd: -c (its own cache directory) --max-memory {room}")
        lab_nodes = lab.up(
            a.nodes, coord, peer, node_args=[["-c", str(d), "--max-memory", room] for d in cache_dirs]
        )
        # the lab's nodes file, with each node's cache directory (fleetctl stage writes there)
        nodes_file = work / "nodes.txt"
        lines = [x for x in lab.nodes_file.read_text().splitlines() if x.strip() and not x.startswith("#")]
        nodes_file.write_text(
            "".join(
                line + ("\n" if " cache_dir=" in line else f" cache_dir={d}\n")
                for line, d in zip(lines, cache_dirs, strict=True)
            )
        )
        plan_file = work / "plan.json"
        t0 = time.monotonic()
        p = subprocess.run(
            [FLEETCTL, "plan", str(model), str(nodes_file), "--json"],
            capture_output=True,
            text=True,
            timeout=CMD_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        plan_s = time.monotonic() - t0
        if p.returncode != 0:
            raise FleetError(f"fleetctl plan: exit {p.returncode}: {p.stderr.strip()}")
        plan_file.write_text(p.stdout)
        plan = json.loads(p.stdout)
        say(f"plan ({plan_s:.1f}s): --rpc {plan['rpc']} --tensor-split {plan['tensor_split']}")
        fleetd_args = llama_server_args(ServeConfig(model=model), plan)
        i = fleetd_args.index("--rpc")
        stock_args = list(fleetd_args)
        stock_args[i + 1] = ",".join(
            f"{ep.rsplit(':', 1)[0]}:{STOCK_PORT}" for ep in fleetd_args[i + 1].split(",")
        )
        fleet = Fleet.load(nodes_file)
        ctx = {
            "a": a,
            "say": say,
            "work": work,
            "model": model,
            "nodes_file": nodes_file,
            "plan_file": plan_file,
            "fleet": fleet,
            "lab_nodes": lab_nodes,
            "links": [n.coordinator_link for n in lab_nodes],
            "cache_dirs": cache_dirs,
            "fleetd_args": fleetd_args,
            "stock_args": stock_args,
            "llama_server": find_p2p_tool("llama-server"),
        }
        with fleet:
            for r in range(1, a.rounds + 1):
                for arm in arms if r % 2 == 1 else arms[::-1]:
                    cells.append(run_arm(arm, r, ctx))
    finally:
        lab.down()

    start_s = fleetctl_start_s()
    summary = analyse(cells)
    report(summary, cells, a, model_bytes)
    texts = {x["text"] for c in cells for x in c["loads"]}
    print(f"greedy text equal in every load: {len(texts) == 1} ({sorted(texts)!r})")
    agree = [
        x["link_bytes"] / x["counter_bytes"]
        for c in cells
        if c["arm"] != "stock"
        for x in c["loads"]
        if x["counter_bytes"]
    ]
    if agree:
        print(f"fleetd loads: kernel link bytes / fleetd counter bytes {min(agree):.3f}..{max(agree):.3f}")
    for c in cells:
        first = c["loads"][0]["cache_after"]
        print(
            f"round {c['round']} {LABELS[c['arm']]}: cache after the 1st load: "
            + ", ".join(f"{n} files {b / MB:.0f} MB" for n, b in first)
        )
    printed = [x["url_printed_s"] for c in cells if c["arm"] == "staged" for x in c["loads"]]
    if printed and all(v is not None for v in printed):
        print(f"fleetctl serve printed its URL {', '.join(f'{v:.1f}' for v in printed)}s after its start")
    sent = {
        f"{c['arm']} r{c['round']} load {i + 1}": x["counter_bytes_per_command"].get("SET_TENSOR", 0) / MB
        for c in cells
        if c["arm"] != "stock"
        for i, x in enumerate(c["loads"])
    }
    print("fleetd SET_TENSOR MB per load: " + ", ".join(f"{k} {v:.1f}" for k, v in sent.items()))
    print(f"fleetctl's own start (`fleetctl serve --help`, median of 3): {start_s:.2f}s, in every serve load")
    print(f"plan: --rpc {plan['rpc']} --tensor-split {plan['tensor_split']} ({plan_s:.1f}s)")
    doc = {
        "settings": {k: v for k, v in vars(a).items() if k not in ("chart", "out", "dir")},
        "model": model.name,
        "model_bytes": model_bytes,
        "plan": {k: plan[k] for k in ("rpc", "tensor_split", "llama_args", "stages")},
        "plan_seconds": plan_s,
        "fleetctl_start_s": start_s,
        "fleetd_max_memory": room,
        "fleetd_args": fleetd_args,
        "stock_args": stock_args,
        "summary": summary,
        "text_equal": len(texts) == 1,
        "texts": sorted(texts),
        "cells": cells,
    }
    print(f"wrote {save('stage_lab', doc, a.out)}")
    if a.chart:
        print(f"wrote {chart(summary, a.chart, a)}")
    return 0 if len(texts) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())

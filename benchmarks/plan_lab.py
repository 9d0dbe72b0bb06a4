"""`fleetctl plan` in the lab (issue 21, first "must show"): the plan's split against llama.cpp's
default split on the same fleet of 3 fleetd nodes, with unequal nodes and with equal ones.

    sudo .venv/bin/python benchmarks/plan_lab.py --rounds 4 --chart docs/plan-lab.png

Configurations (one lab each, `fleetd.fleet.lab`, torn down in a finally):

- unequal, in the nodes file's order:
  lab-0 "slow link": its coordinator link at --slow-link (the others at --fast-link);
  lab-1 "small memory": fleetd --max-memory that holds about a third of the layers;
  lab-2 "slow cpu": with --slow-cpu quota (the default), a CFS quota of --slow-cores of a core
  (its daemon, fork server and workers; `Lab.up(node_cores=...)`), a machine that computes
  slower for bursts as for long runs once it is over its share (at 0.3 cores its share covered
  the 3 layers llama.cpp's split gives it in decode, which it computes while the others' stages
  leave it idle: decode did not differ, plan/default 0.75-1.36 by round over four runs; at the
  default 0.15 it does); with --slow-cpu busy, its
  fleetd pinned to the last core, sharing it with a busy loop pinned there too (a bounded
  Python loop, started before the plan measures and killed in a finally), so it gets about half
  a core when it computes for long, but a node that slept gets a few ms of credit from the
  scheduler first, so decode's bursts hardly see the loop. Every fleetd computes with 1 thread
  (`--threads 1`).
  The other two hold about 7/12 of the layers each: no node holds the whole model.
- equal: the same three nodes without the quota or the busy loop, all links at --fast-link, each holding
  about 5/12 of the layers (so all three are needed and the default even split fits).

Per configuration: `fleetctl plan` (fleetd.fleet.plan_probe.measure and plan.optimise, as
`cmd_plan` runs them) over the lab's nodes file, then ABBA rounds of two arms with the patched
client (GGML_RPC_P2P=1, the asynchronous direct path where both ends have it):
"plan" = the plan's --rpc order and --tensor-split; "default" = the nodes in their file order,
no --tensor-split (llama.cpp splits by the free memory each node reports). Each cell: llama-bench
(pp --n-prompt in one micro-batch, tg --n-gen; -sm layer -ngl 99 -t 1) and llama-completion
--temp 0 with the plan's -c (the greedy text's md5, equal across every cell), during which every
node's /v1/status is polled: the bytes its sessions hold (allocated_bytes, max over the run)
and the layers they wrote, against the plan's predicted weights + KV + compute per node. The
predicted t/s of the plan (its direct path) against the measured medians; also the cost model's
prediction for the default split (the layers the nodes reported). Before each round the fleet is
probed again (as `fleetctl plan` probes it; --no-probe-rounds skips it) and both splits costed
with that probe: the "in-round" predictions, against the host as the round found it (its speed
drifts by up to 2x over a day, enough to move the plan's own prediction by 25% between the
probe and arms run minutes later). Then the model that does not
fit: `fleetctl plan --ctx 65536` on the unequal lab exits 1 before anything is loaded.

Writes benchmarks/results/plan_lab.json (and the chart with --chart). Needs root.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, show, stop_processes  # noqa: E402

from fleetd.errors import FleetdError, FleetError  # noqa: E402
from fleetd.fleet.chart import write_bar_chart  # noqa: E402
from fleetd.fleet.lab import Lab, fmt_rate, parse_rate  # noqa: E402
from fleetd.fleet.model_ab import PROMPT, client_stats, parse_bench_json, run_p2p_tool  # noqa: E402
from fleetd.fleet.node import Fleet as NodeFleet  # noqa: E402
from fleetd.fleet.plan import (  # noqa: E402
    MEMORY_MARGIN,
    MEMORY_MARGIN_BYTES,
    Fleet,
    Workload,
    compute_buffer_bytes,
    kv_bytes_per_layer,
    optimise,
    predict,
    read_model,
)
from fleetd.fleet.plan_probe import measure, memory_only  # noqa: E402
from fleetd.models import generate_named  # noqa: E402
from fleetd.tools import find_p2p_tool  # noqa: E402

ARMS = ("plan", "default")
TOOL_TIMEOUT_S = 600
POLL_S = 0.1
RELEASE_S = 30
GENERATED_CHARS = 16  # of text past the echoed prompt: the load is over
BUSY_MAX_S = 3600  # the busy loop ends by itself after this, whatever happens to this script
BUSY = (
    "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
)
MIB = 1 << 20
CPUS = sorted(os.sched_getaffinity(0))
SLOW_CPU = CPUS[-1]


# -- sizing the nodes ----------------------------------------------------------------------------


def room_for(model, work: Workload, layers: int, last: bool) -> int:
    """--max-memory (bytes) that holds `layers` layers (and the output layer when `last`), and
    half a layer more, not a whole one, under the plan's margins."""
    per = model.layer_bytes(0) + kv_bytes_per_layer(model, work.cells)
    need = layers * per + compute_buffer_bytes(model, work.cells, last, work.ubatch, work.parallel)
    need += (model.output_bytes() if last else 0) + per // 2
    return int((need + MEMORY_MARGIN_BYTES) / (1 - MEMORY_MARGIN)) + 1


def configurations(model, work: Workload, a) -> dict[str, dict]:
    n = model.n_layer
    # no node holds the whole model (a fleet is for models that do not fit one machine; and the
    # compute buffer estimate is calibrated for pipelined splits of 2+ nodes)
    big = f"{room_for(model, work, math.ceil(n * 7 / 12), True) // MIB + 1}M"
    small = f"{room_for(model, work, max(1, n // 3), False) // MIB + 1}M"
    equal = f"{room_for(model, work, math.ceil(n * 5 / 12), True) // MIB + 1}M"
    fast, slow = parse_rate(a.fast_link), parse_rate(a.slow_link)
    busy = a.slow_cpu == "busy"
    return {
        "unequal": {
            "roles": ["slow link", "small memory", "slow cpu"],
            "rates": [slow, fast, fast],
            "args": [["--max-memory", big], ["--max-memory", small], ["--max-memory", big]],
            "cpus": [None, None, [SLOW_CPU] if busy else None],
            "cores": [None, None, None if busy else a.slow_cores],
            "busy": busy,
        },
        "equal": {
            "roles": ["equal", "equal", "equal"],
            "rates": [fast, fast, fast],
            "args": [["--max-memory", equal]] * 3,
            "cpus": [None, None, None],
            "cores": None,
            "busy": False,
        },
    }


def start_busy(cpu: int, seconds: float) -> subprocess.Popen:
    """A busy loop pinned to `cpu` that ends by itself after `seconds` (killed earlier by the caller)."""
    return subprocess.Popen(
        [sys.executable, "-c", BUSY, str(seconds)],
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        stdin=subprocess.DEVNULL,
    )


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.kill()
    proc.wait(10)


# -- the nodes' own report -----------------------------------------------------------------------


def node_memory(nodes_file: Path) -> tuple[dict[str, int], dict[str, set[int]]]:
    """Per node (RPC endpoint): the bytes its sessions hold and the layers they wrote (blk.N)."""
    held, layers = {}, {}
    with NodeFleet.load(nodes_file) as fleet:
        for node in fleet:
            ep = node.spec.rpc_endpoint
            try:
                st = node.status()
            except (FleetdError, OSError):
                held[ep], layers[ep] = -1, set()
                continue
            held[ep] = sum(s.allocated_bytes for s in st.sessions)
            layers[ep] = {x for s in st.sessions for x in s.layers}
    return held, layers


def wait_released(nodes_file: Path) -> None:
    """Until no session holds memory on any node (a stopped tool's session ends asynchronously,
    and a node at its --max-memory refuses the next tool's buffers meanwhile); RELEASE_S at most."""
    deadline = time.monotonic() + RELEASE_S
    while time.monotonic() < deadline:
        held, _ = node_memory(nodes_file)
        if all(v <= 0 for v in held.values()):
            return
        time.sleep(POLL_S)
    raise FleetError(f"the nodes still hold memory {RELEASE_S:g}s after the last tool ended: {held}")


def memory_after_load(
    model: Path, rpc: str, split: list[str] | None, work: Workload, nodes_file: Path
) -> dict:
    """llama-completion with the arm's flags and the plan's -c, decoding until stopped; once it
    has generated text (weights, KV and the compute buffers are all allocated before the first
    token) the nodes' /v1/status is polled until two polls agree, then the tool is stopped.
    Bounded by TOOL_TIMEOUT_S."""
    exe = str(find_p2p_tool("llama-completion"))
    args = [exe, "-m", str(model), "--rpc", rpc, "-sm", "layer", "-ngl", "99", "-t", "1"]
    args += ["--tensor-split", ",".join(split)] if split else []
    # -fit off: llama-bench's default (llama-completion would otherwise move an unset split)
    args += ["-c", str(work.ctx), "-np", str(work.parallel), "-ub", str(work.ubatch), "-fit", "off"]
    args += ["-p", PROMPT, "-n", "-1", "--context-shift", "--ignore-eos", "--temp", "0", "-no-cnv"]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, GGML_RPC_P2P="1"),
    )
    out: list[bytes] = []
    reader = threading.Thread(
        target=lambda: out.extend(iter(lambda: proc.stdout.read1(256), b"")), daemon=True
    )
    reader.start()
    try:
        deadline = time.monotonic() + TOOL_TIMEOUT_S
        # generated text after the echoed prompt: the weights, KV and compute buffers are all there
        while sum(map(len, out)) < len(PROMPT) + GENERATED_CHARS:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise FleetError("llama-completion ended (or ran out of time) before it generated text")
            time.sleep(POLL_S)
        last, polls = None, 0
        while time.monotonic() < deadline and proc.poll() is None:
            held, layers = node_memory(nodes_file)
            polls += 1
            if (held, layers) == last:
                return {"held": held, "layers": {k: sorted(v) for k, v in layers.items()}, "polls": polls}
            last = (held, layers)
            time.sleep(POLL_S)
        raise FleetError(f"the nodes' memory did not settle while llama-completion ran ({polls} polls)")
    finally:
        stop_processes([proc])
        reader.join(10)


# -- one cell ------------------------------------------------------------------------------------


def arm_split(arm: str, plan, natural_rpc: str) -> tuple[str, list[str] | None]:
    """The arm's --rpc list and its --tensor-split proportions (None: llama.cpp's default)."""
    if arm == "plan":
        return plan.rpc, plan.tensor_split.split(",")
    return natural_rpc, None


def bench(model: Path, rpc: str, split: list[str] | None, a) -> dict:
    args = ["-m", str(model), "--rpc", rpc, "-sm", "layer", "-ngl", "99", "-t", "1"]
    args += ["-ts", "/".join(split)] if split else []  # llama-bench's own separator
    args += ["-p", str(a.n_prompt), "-n", str(a.n_gen), "-b", str(a.n_prompt), "-ub", str(a.n_prompt)]
    args += ["-r", "1", "-o", "json"]
    p = run_p2p_tool("llama-bench", args, "1", "llama-bench", TOOL_TIMEOUT_S)
    return {**parse_bench_json(p.stdout), "bench_client": client_stats(p.stderr, "llama-bench")}


def completion(model: Path, rpc: str, split: list[str] | None, work: Workload, a) -> str:
    """The md5 of llama-completion's greedy text with the plan's -c."""
    args = ["-m", str(model), "--rpc", rpc, "-sm", "layer", "-ngl", "99", "-t", "1"]
    args += ["--tensor-split", ",".join(split)] if split else []
    # -fit off: llama-bench's default (llama-completion would otherwise move an unset split)
    args += ["-c", str(work.ctx), "-np", str(work.parallel), "-ub", str(work.ubatch), "-fit", "off"]
    args += ["-p", PROMPT, "-n", str(a.text_gen), "--temp", "0", "--seed", "1", "-no-cnv"]
    for _ in range(3):  # llama's log thread can drop the last line at exit on a busy machine
        p = run_p2p_tool("llama-completion", args, "1", "llama-completion", TOOL_TIMEOUT_S)
        if p.stdout.endswith("\n\n"):
            break
    return hashlib.md5(p.stdout.encode()).hexdigest()


# -- one configuration ---------------------------------------------------------------------------


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_config(name: str, cfg: dict, model_path: Path, model, work: Workload, a, work_dir: Path) -> dict:
    lab = Lab(work_dir / f"lab-{name}")
    busy = None
    say = lambda text: print(f"[{name}] {text}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        if cfg["busy"]:
            busy = start_busy(SLOW_CPU, min(BUSY_MAX_S, a.busy_seconds))
        lab_nodes = lab.up(
            3,
            cfg["rates"],
            parse_rate(a.peer_link),
            1,
            node_args=cfg["args"],
            node_cpus=cfg["cpus"],
            node_cores=cfg["cores"],
        )
        endpoints = [f"{n.address}:50052" for n in lab_nodes]
        roles = dict(zip(endpoints, cfg["roles"], strict=True))
        names = {f"{n.address}:50052": n.name for n in lab_nodes}
        natural = ",".join(endpoints)
        # fleetctl plan, as cmd_plan runs it: fits at all? then measure and optimise
        with NodeFleet.load(lab.nodes_file) as fleet:
            t0 = time.monotonic()
            optimise(model, memory_only(fleet), work)
            facts = measure(fleet, model, prompt_tokens=work.prompt_tokens)
            plan_s = time.monotonic() - t0
        plan = optimise(model, facts, work)
        doc = plan.as_dict()
        say(f"plan: --rpc {plan.rpc} --tensor-split {plan.tensor_split} (measured in {plan_s:.1f}s)")
        no_fit = does_not_fit(lab.nodes_file, model_path) if name == "unequal" else None
        memory = {}
        for arm in ARMS:
            say(f"{arm}: the nodes' memory after the load")
            wait_released(lab.nodes_file)
            memory[arm] = memory_after_load(model_path, *arm_split(arm, plan, natural), work, lab.nodes_file)
        rounds, round_facts = [], []
        for r in range(a.rounds):
            if a.probe_rounds:  # the host as the round finds it: its speed drifts over minutes
                say(f"round {r + 1}/{a.rounds}: probe")
                wait_released(lab.nodes_file)
                with NodeFleet.load(lab.nodes_file) as fleet:
                    round_facts.append(measure(fleet, model, prompt_tokens=work.prompt_tokens))
            order = list(ARMS) if r % 2 == 0 else list(ARMS[::-1])
            for arm in order:
                say(f"round {r + 1}/{a.rounds}: {arm}")
                rpc, split = arm_split(arm, plan, natural)
                wait_released(lab.nodes_file)
                cell = {"round": r + 1, "arm": arm, **bench(model_path, rpc, split, a)}
                wait_released(lab.nodes_file)
                cell["md5"] = completion(model_path, rpc, split, work, a)
                rounds.append(cell)
    finally:
        stop(busy)
        lab.down()
    res = analyse(name, cfg, model, work, facts, plan, doc, rounds, memory, roles, names, no_fit, plan_s)
    res["round_predictions"] = round_predictions(model, work, plan, res, round_facts)
    return res


def round_predictions(model, work: Workload, plan, res: dict, round_facts: list) -> list[dict]:
    """Each round's probe costing the plan's split and the default one (the nodes, order and
    counts as the run used them): the cost model against the host as that round found it."""
    by_name = {n: i for i, n in enumerate(res["node_names"])}
    splits = {
        "plan": ([s.node for s in plan.stages], [s.layers for s in plan.stages]),
        "default": ([by_name[n] for n in res["default_order"]], res["default_counts"]),
    }
    out = []
    for r, facts in enumerate(round_facts, 1):
        cell = {"round": r}
        for arm, (order, counts) in splits.items():
            if sum(counts) != model.n_layer:
                continue
            sp = predict(model, facts, order, counts, work)
            cell[arm] = {"pp_tps": sp.prompt_direct, "tg_tps": sp.decode_direct}
        out.append(cell)
    return out


def analyse(name, cfg, model, work, facts, plan, doc, rounds, memory, roles, names, no_fit, plan_s) -> dict:
    by_arm = {arm: [c for c in rounds if c["arm"] == arm] for arm in ARMS}
    summary = {
        arm: {m: summarise([c[m] for c in cells]) for m in ("pp_tps", "tg_tps")}
        for arm, cells in by_arm.items()
    }
    # the default split as the nodes reported it: the layers each node's sessions wrote
    endpoints = [n.endpoint for n in facts.nodes]
    default_layers = {ep: set(memory["default"]["layers"].get(ep, [])) for ep in endpoints}
    default_order = [i for i, ep in enumerate(endpoints) if default_layers[ep]]
    default_counts = [len(default_layers[endpoints[i]]) for i in default_order]
    default_speeds = None
    if default_order and sum(default_counts) == model.n_layer:
        default_speeds = predict(model, facts, default_order, default_counts, work)
    predicted = {
        "plan": {"pp_tps": plan.speeds.prompt_direct, "tg_tps": plan.speeds.decode_direct},
        "default": (
            {"pp_tps": default_speeds.prompt_direct, "tg_tps": default_speeds.decode_direct}
            if default_speeds
            else None
        ),
    }
    # the same split costed as before the whole-layer, step and burst probes: the layer's
    # matrices alone, back to back, and no step cost besides the client's waits
    old = Fleet(
        tuple(
            replace(
                n,
                decode_layer_s=n.decode_matmul_s,
                prompt_token_s=n.prompt_matmul_s,
                step_s=0.0,
                decode_profile=(),
            )
            for n in facts.nodes
        ),
        facts.peers,
        facts.notes,
    )
    order = [s.node for s in plan.stages]
    old_speeds = predict(model, old, order, [s.layers for s in plan.stages], work)
    predicted["plan_matrices_only"] = {"pp_tps": old_speeds.prompt_direct, "tg_tps": old_speeds.decode_direct}
    per_node = []
    for s in plan.stages:
        reported = memory["plan"]["held"].get(s.endpoint, 0)
        layers = memory["plan"]["layers"].get(s.endpoint, [])
        per_node.append(
            {
                "node": names.get(s.endpoint, s.name),
                "role": roles.get(s.endpoint, ""),
                "endpoint": s.endpoint,
                "planned_layers": [s.first_layer, s.first_layer + s.layers],
                "reported_layers": layers,
                "predicted": {"weights": s.memory.weights, "kv": s.memory.kv, "compute": s.memory.compute},
                "predicted_total": s.memory.total,
                "reported_total": reported,
                "ratio": s.memory.total / reported if reported else None,
            }
        )
    md5s = sorted({c["md5"] for c in rounds})
    # the arms of one ABBA round ran minutes apart at most: their ratio cancels the host's drift
    rounds_run = sorted({c["round"] for c in rounds})
    cell = {(c["round"], c["arm"]): c for c in rounds}
    paired = {
        m: [cell[(r, "plan")][m] / cell[(r, "default")][m] for r in rounds_run] for m in ("pp_tps", "tg_tps")
    }
    return {
        "paired": paired,
        "config": name,
        "roles": {names[ep]: role for ep, role in roles.items()},
        "coordinator_links": [fmt_rate(b) for b in cfg["rates"]],
        "fleetd_args": cfg["args"],
        "cpus": cfg["cpus"],
        "busy_loop_cpu": SLOW_CPU if cfg["busy"] else None,
        "node_cores": cfg["cores"],
        "plan_seconds": plan_s,
        "plan": doc,
        "plan_order": [names.get(s.endpoint, s.name) for s in plan.stages],
        "plan_counts": [s.layers for s in plan.stages],
        "node_names": [names[ep] for ep in endpoints],
        "default_order": [names[endpoints[i]] for i in default_order],
        "default_counts": default_counts,
        "summary": summary,
        "predicted": predicted,
        "memory": per_node,
        "memory_after_load": memory,
        "md5s": md5s,
        "md5_equal": len(md5s) == 1,
        "does_not_fit": no_fit,
        "rounds": rounds,
    }


def does_not_fit(nodes_file: Path, model_path: Path) -> dict:
    """`fleetctl plan --ctx 65536` on this lab: exit 1 and one line, nothing allocated."""
    with NodeFleet.load(nodes_file) as fleet:
        before = [sum(s.allocated_bytes for s in n.status().sessions) for n in fleet]
    argv = [
        str(Path(sys.executable).parent / "fleetctl"),
        "plan",
        str(model_path),
        str(nodes_file),
        "--ctx",
        "65536",
    ]
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    return {
        "command": f"fleetctl plan {model_path.name} nodes.txt --ctx 65536",
        "exit": p.returncode,
        "stderr": p.stderr.strip(),
        "seconds": took,
        "allocated_before": before,
    }


# -- output --------------------------------------------------------------------------------------


def in_round_ratios(res: dict, arm: str, m: str) -> list[float]:
    """Each round's prediction over the same round's measurement, for one arm and metric."""
    measured = {c["round"]: c[m] for c in res["rounds"] if c["arm"] == arm}
    return [
        p[arm][m] / measured[p["round"]]
        for p in res.get("round_predictions", [])
        if arm in p and measured.get(p["round"])
    ]


def report(results: list[dict], model, a) -> None:
    rows = []
    for res in results:
        s, pred = res["summary"], res["predicted"]
        for m, label in (("pp_tps", "prompt t/s"), ("tg_tps", "decode t/s")):
            for arm in ARMS:
                v = s[arm][m]
                p = (pred[arm] or {}).get(m)
                ratios = in_round_ratios(res, arm, m)
                rows.append(
                    [
                        res["config"],
                        label,
                        arm,
                        f"{v['median']:.1f}",
                        f"{v['min']:.1f}..{v['max']:.1f}",
                        f"{v['median'] / s['default'][m]['median']:.2f}",
                        f"{p:.1f}" if p else "-",
                        f"{p / v['median']:.2f}" if p else "-",
                        (
                            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
                            if ratios
                            else "-"
                        ),
                    ]
                )
    show(
        f"{model.n_layer} layers ({Path(model.path).name}), {a.rounds} rounds ABBA, "
        f"pp{a.n_prompt} tg{a.n_gen}; pred/meas: the plan's own probe; in-round: each round's "
        "probe over that round (median, min..max)",
        ["config", "metric", "arm", "median", "min..max", "x default", "predicted", "pred/meas", "in-round"],
        rows,
    )
    mem_rows = []
    for res in results:
        for m in res["memory"]:
            mem_rows.append(
                [
                    res["config"],
                    f"{m['node']} ({m['role']})",
                    f"{m['planned_layers'][0]}-{m['planned_layers'][1] - 1}",
                    ",".join(map(str, m["reported_layers"])) or "-",
                    f"{m['predicted_total'] / MIB:.2f}",
                    f"{m['reported_total'] / MIB:.2f}",
                    f"{m['ratio']:.3f}" if m["ratio"] else "-",
                ]
            )
    show(
        "memory per node: plan's prediction (weights + KV + compute) vs the nodes' /v1/status after the load",
        ["config", "node", "planned layers", "reported layers", "predicted MiB", "reported MiB", "pred/rep"],
        mem_rows,
    )
    for res in results:
        s, old = res["summary"], res["predicted"]["plan_matrices_only"]
        for m, label in (("pp_tps", "prompt"), ("tg_tps", "decode")):
            ahead = s["plan"][m]["min"] > s["default"][m]["max"]
            behind = s["plan"][m]["max"] < s["default"][m]["min"]
            where = (
                "ahead beyond the spread"
                if ahead
                else "behind beyond the spread"
                if behind
                else "within the spread"
            )
            paired = ", ".join(f"{x:.2f}" for x in res["paired"][m])
            print(
                f"{res['config']} {label}: plan {where} of the default (plan/default by round: "
                f"{paired}); the matrices-only model predicted {old[m]:.1f} t/s "
                f"({old[m] / s['plan'][m]['median']:.2f}x measured)"
            )
    for res in results:
        print(
            f"{res['config']}: plan {res['plan_order']} {res['plan_counts']} "
            f"(--tensor-split {res['plan']['tensor_split']}); default {res['default_order']} "
            f"{res['default_counts']}; greedy md5 equal in every cell: {res['md5_equal']}"
        )
        nf = res["does_not_fit"]
        if nf:
            print(
                f"does not fit: `{nf['command']}` exit {nf['exit']} in {nf['seconds']:.1f}s: {nf['stderr']}"
            )


def chart(results: list[dict], path: str) -> Path:
    panels = {}
    for res in results:
        for m, label in (("pp_tps", "prompt"), ("tg_tps", "decode")):
            panel = {}
            for arm in ARMS:
                v = res["summary"][arm][m]
                panel[arm] = (v["median"], v["min"], v["max"])
            for arm in ARMS:
                p = (res["predicted"][arm] or {}).get(m)
                if p:
                    panel[f"{arm} pred"] = (p, p, p)
            panels[f"{res['config']} {label} t/s"] = panel
    title = "plan vs default split: median, min..max"
    return write_bar_chart(path, title, panels)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="llama-f16-wide12", help="a fleetd.models name (default llama-f16-wide12)"
    )
    ap.add_argument("--rounds", type=int, default=4, help="ABBA rounds (default 4)")
    ap.add_argument("--n-prompt", type=int, default=512, help="prompt tokens, one micro-batch (default 512)")
    # tg32 lasted 0.3 s and moved by up to 40% between rounds of one arm
    ap.add_argument("--n-gen", type=int, default=128, help="generated tokens (default 128)")
    ap.add_argument("--ctx", type=int, default=1024, help="the plan's -c (default 1024)")
    ap.add_argument("--text-gen", type=int, default=32, help="greedy tokens for the md5 (default 32)")
    ap.add_argument("--fast-link", default="1gbit", help="coordinator links (default 1gbit)")
    ap.add_argument(
        "--slow-link", default="100mbit", help="the slow node's coordinator link (default 100mbit)"
    )
    ap.add_argument("--peer-link", default="2gbit", help="node-to-node links (default 2gbit)")
    ap.add_argument("--configs", default="unequal,equal", help="comma list of unequal, equal")
    ap.add_argument(
        "--slow-cpu",
        choices=("quota", "busy"),
        default="quota",
        help="the slow node: a CPU quota (default) or its core shared with a busy loop",
    )
    ap.add_argument(
        "--slow-cores",
        type=float,
        default=0.15,
        help="the slow node's quota in cores (default 0.15; at 0.3 its share covers its decode layers)",
    )
    ap.add_argument("--busy-seconds", type=float, default=1800, help=f"busy loop bound (<= {BUSY_MAX_S})")
    ap.add_argument(
        "--no-probe-rounds",
        dest="probe_rounds",
        action="store_false",
        help="skip the probe before each round (it costs 10-30 s a round; the plan's own probe stays)",
    )
    ap.add_argument("--chart", help="write a PNG chart here")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/plan_lab.json)")
    a = ap.parse_args()
    if not 1 <= a.rounds <= 20:
        ap.error("--rounds: 1..20")
    for flag in ("n_prompt", "n_gen", "text_gen", "ctx"):
        if not 1 <= getattr(a, flag) <= 65536:
            ap.error(f"--{flag.replace('_', '-')}: 1..65536")
    if a.slow_cpu == "busy" and len(CPUS) < 2:
        ap.error("--slow-cpu busy needs 2 cores: the slow node shares one with a busy loop")
    if not 0.1 <= a.slow_cores <= 1:
        ap.error("--slow-cores: 0.1..1")
    work_dir = Path(tempfile.mkdtemp(prefix="plan-lab-"))
    model_path = generate_named(a.model, work_dir)
    model = read_model(model_path)
    work = Workload(ctx=a.ctx, parallel=1, ubatch=a.n_prompt)
    configs = configurations(model, work, a)
    wanted = [x.strip() for x in a.configs.split(",") if x.strip()]
    if not wanted or any(x not in configs for x in wanted):
        ap.error(f"--configs: choose from {', '.join(configs)}")
    results = [run_config(name, configs[name], model_path, model, work, a, work_dir) for name in wanted]
    report(results, model, a)
    doc = {
        "settings": {k: v for k, v in vars(a).items() if k not in ("chart", "out")},
        "model": Path(model.path).name,
        "slow_cpu": SLOW_CPU,
        "results": results,
    }
    print(f"wrote {save('plan_lab', doc, a.out)}")
    if a.chart:
        print(f"wrote {chart(results, a.chart)}")
    return 0 if all(r["md5_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

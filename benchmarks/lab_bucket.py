"""Does the lab charge decode for its coordinator links? Hub vs asynchronous direct decode with
the links' token bucket as `fleetctl lab` set it before 2026-12-06 (4 ms at the rate, at least
64 KiB) and with two Ethernet frames (what it sets now), switched live in one lab so the arms
are paired.

    sudo .venv/bin/python benchmarks/lab_bucket.py [--rounds 4] [--n-gen 128] [--link 200mbit]

The old bucket passed a decode step's few KiB at memory speed: an 8 KiB GET over a "200
Mbit/s" link came back as if the link were not there, where a real line serialises it (0.33 ms).
With two frames in the bucket they pay the rate. Per round, four cells in ABBA order: (old
bucket, two frames) x (hub, async), each `llama-bench -p 0 -n N -r 2` over 3 nodes (the 12-layer
wide model). Prints the t/s per cell and async/hub per round; writes
benchmarks/results/lab_bucket.json. About 2.5 min.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save, show  # noqa: E402
from lab_arms import run  # noqa: E402

from fleetd.fleet.lab import TBF_LATENCY, Lab, parse_rate  # noqa: E402
from fleetd.fleet.model_ab import parse_bench_json  # noqa: E402
from fleetd.models import generate_named  # noqa: E402
from fleetd.ports import DEFAULT_RPC_PORT  # noqa: E402

FRAME = 1514
BUCKETS = ("4 ms (old)", "two frames")
ARMS = ("hub", "async")


def old_burst(bits: int) -> int:
    return max(64 * 1024, int(bits / 8 * 0.004))  # fleetd.fleet.lab._tbf before 2026-12-06


def set_bucket(lab_nodes, bits: int, burst: int) -> None:
    """Both ends of every node's coordinator link (the peer links keep theirs)."""
    for n in lab_nodes:
        for dev, ns in ((n.coordinator_link, None), ("coord0", n.netns)):
            cmd = ["ip", "netns", "exec", ns] if ns else []
            cmd += ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", str(bits)]
            cmd += ["burst", str(burst), "latency", TBF_LATENCY]
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--link", default="200mbit", help="coordinator link rate (default 200mbit)")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/lab_bucket.json)")
    a = ap.parse_args()
    if a.rounds < 1 or a.n_gen < 1:
        ap.error("--rounds and --n-gen must be at least 1")
    try:
        bits = parse_rate(a.link)
    except ValueError as exc:
        ap.error(str(exc))
    work = Path(tempfile.mkdtemp(prefix="lab-bucket-"))
    model = generate_named("llama-f16-wide12", work)
    lab = Lab(work / "lab")
    tps: dict[tuple[str, str], list[float]] = {(b, arm): [] for b in BUCKETS for arm in ARMS}
    cells = list(tps)
    try:
        nodes = lab.up(3, bits, parse_rate("2gbit"))
        rpc = ",".join(f"{n.address}:{DEFAULT_RPC_PORT}" for n in nodes)
        args = ["-m", str(model), "--rpc", rpc, "-sm", "layer", "-ngl", "99", "-t", "1", "-p", "0"]
        args += ["-n", str(a.n_gen), "-r", "2", "-o", "json"]
        for r in range(a.rounds):
            for bucket, arm in cells if r % 2 == 0 else cells[::-1]:
                print(f"round {r + 1}/{a.rounds}: {bucket}, {arm}", file=sys.stderr, flush=True)
                set_bucket(nodes, bits, old_burst(bits) if bucket == BUCKETS[0] else 2 * FRAME)
                out = run("llama-bench", args, arm)
                tps[(bucket, arm)].append(parse_bench_json(out.stdout, ("tg_tps",))["tg_tps"])
    finally:
        lab.down()
    rows, ratios = [], {}
    for bucket in BUCKETS:
        hub, asy = tps[(bucket, "hub")], tps[(bucket, "async")]
        ratios[bucket] = [x / y for x, y in zip(asy, hub, strict=True)]
        rows.append(
            [
                bucket,
                ", ".join(f"{x:.0f}" for x in hub),
                ", ".join(f"{x:.0f}" for x in asy),
                ", ".join(f"{x:.2f}" for x in ratios[bucket]),
                f"{statistics.median(ratios[bucket]):.2f}",
            ]
        )
    show(
        f"decode t/s, 3 nodes, coordinator links {a.link}, tg{a.n_gen}, {a.rounds} ABBA rounds",
        ["bucket", "hub", "async", "async / hub per round", "median"],
        rows,
    )
    out = save(
        "lab_bucket",
        {"settings": vars(a), "tg_tps": {f"{b}/{arm}": v for (b, arm), v in tps.items()}, "ratios": ratios},
        a.out,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

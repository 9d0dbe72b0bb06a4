#!/usr/bin/env python3
"""The structure-aware GRAPH_COMPUTE fuzzer (tests/graph_fuzzer.py) against a fleetd subprocess:
a table per op (cases, computed, refused, worker deaths, hangs, daemon deaths, corruptions) and
one line per finding with the seed that replays it.

    scripts/fuzz_graphs.py --seconds 60                       # seeds 0.. for a minute
    scripts/fuzz_graphs.py --seed 100000 --cases 20000 --json /tmp/graph-fuzz.json
    scripts/fuzz_graphs.py --ops TOP_K,ARGSORT --cases 500
    scripts/fuzz_graphs.py --case 445 -v                      # replay one case, print its graph

A seed names its op (FUZZ_OPS[seed % len(FUZZ_OPS)]) and every byte of its case, so --case needs
nothing else. Exit status 1 when a case killed the daemon or corrupted a buffer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import graph_fuzzer as gf  # noqa: E402

from fleetd.wire import GgmlOp, op_name  # noqa: E402


def parse_ops(text: str | None):
    if not text:
        return gf.FUZZ_OPS
    ops = []
    for name in text.split(","):
        try:
            op = GgmlOp[name.strip().upper()]
        except KeyError:
            raise SystemExit(f"fuzz_graphs: unknown op {name!r}") from None
        if op not in gf.FUZZ_OPS:
            raise SystemExit(f"fuzz_graphs: {op.name} has no generator (FUZZ_OPS)")
        ops.append(op)
    return ops


def print_case(seed: int) -> None:
    case = gf.build_case(seed)
    print(f"case {seed}: {case.op}, buffer {case.size} bytes")
    for note in case.notes:
        print(f"  mutation: {note}")
    for t in case.gen.roots + case.gen.views:
        role = "node" if t in case.gen.nodes else "view" if t.view_src else "leaf"
        print(
            f"  {role} {t.id:#x} {op_name(t.op)} "
            f"type={t.type} ne={list(t.ne)} nb={list(t.nb)} src={[s.id for s in t.src]} "
            f"offs={case.offsets.get(t.id, t.view_offs)} params={t.op_params[:8]}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--cases", type=int, default=100000, help="at most this many cases (default 100000)")
    p.add_argument("--seconds", type=float, default=None, help="stop starting cases after this long")
    p.add_argument("--ops", help="comma-separated ops (default: every op with a rule)")
    p.add_argument("--case", type=int, help="replay one case by its seed")
    p.add_argument("--json", help="write the table and every finding as JSON here")
    p.add_argument("--threads", type=int, default=2, help="fleetd -t (default 2)")
    p.add_argument("--log-dir", default="/tmp", help="where the daemon's log goes (default /tmp)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every case's outcome")
    args = p.parse_args(argv)

    if args.case is not None:
        seeds = [args.case]
        if args.verbose:
            print_case(args.case)
    else:
        seeds = gf.seeds_for(parse_ops(args.ops), args.seed, args.cases)

    def report(r: gf.Result) -> None:
        if r.finding:
            print("FINDING " + gf.describe(r), flush=True)
        elif args.verbose:
            print(f"seed {r.seed} {r.op}: {r.outcome} {r.log}", flush=True)

    t0 = time.monotonic()
    with gf.Daemon(Path(args.log_dir), threads=args.threads) as daemon:
        results = gf.run_cases(daemon, seeds, args.seconds, on_result=report)
        starts = daemon.starts
    print()
    print(gf.format_table(results))
    findings = [r for r in results if r.finding]
    print(
        f"\n{len(results)} cases in {time.monotonic() - t0:.0f}s, {len(findings)} findings, "
        f"daemon started {starts} times"
    )
    if args.json:
        gf.dump_json(results, args.json)
    return 1 if any(r.outcome == "daemon_death" or r.corruptions for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

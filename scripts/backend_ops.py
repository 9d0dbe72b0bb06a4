#!/usr/bin/env python3
"""Run llama.cpp's test-backend-ops against fleetd (and optionally the stock ggml-rpc-server),
case by case, and write the op coverage table.

    scripts/backend_ops.py                      # the issue's ops against fleetd -> docs/op-coverage.md
    scripts/backend_ops.py -o ADD,MUL_MAT -p 'type=f16'
    scripts/backend_ops.py --servers fleetd,stock --json /tmp/cov.json
    scripts/backend_ops.py --one-process --servers fleetd,stock -o ADD,MUL_MAT   # as a user runs it

test-backend-ops compares every case with ggml's CPU backend. The RPC client claims support for
every op, so a server that cannot compute a case closes the connection (fleetd) or aborts
(stock) and the client process dies. The harness knows each op's case list (from
`test-backend-ops support`, which computes nothing), records the case that was running as
failed ("server closed"), and resumes after it with explicit case names.

`--one-process` runs every op in one test-backend-ops process per server, as a user would: a
server that cuts the client loses every later case, counted as "not reached" (the case lists
still come from `support` mode).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleetd.tools import find_tool
from fleetd.transport import free_port, wait_listening

# What llama.cpp sends for llama / qwen3 / qwen3moe / gemma3 (issue 3), by test-backend-ops name.
ISSUE_OPS = [
    "ADD",
    "SUB",
    "MUL",
    "DIV",
    "ADD_ID",
    "SCALE",
    "CPY",
    "DUP",
    "CONT",
    "GET_ROWS",
    "SET_ROWS",
    "RMS_NORM",
    "NORM",
    "L2_NORM",
    "ROPE",
    "SOFT_MAX",
    "REGLU",
    "GEGLU",
    "SWIGLU",
    "SWIGLU_OAI",
    "GEGLU_ERF",
    "GEGLU_QUICK",
    "SWIGLU_CLAMP",
    "ABS",
    "SGN",
    "NEG",
    "STEP",
    "TANH",
    "ELU",
    "RELU",
    "SIGMOID",
    "GELU",
    "GELU_QUICK",
    "SILU",
    "HARDSWISH",
    "HARDSIGMOID",
    "EXP",
    "EXPM1",
    "SOFTPLUS",
    "GELU_ERF",
    "XIELU",
    "FLOOR",
    "CEIL",
    "ROUND",
    "TRUNC",
    "SUM",
    "SUM_ROWS",
    "MEAN",
    "ARGMAX",
    "ARGSORT",
    "TOP_K",
    "CONCAT",
    "PAD",
    "CLAMP",
    "SQR",
    "SQRT",
    "LOG",
    "SIN",
    "COS",
    "REPEAT",
    "CUMSUM",
    "LEAKY_RELU",
    "GROUP_NORM",
    "SET",
    "ACC",
    "ARANGE",
    "FILL",
    "ROPE_BACK",
    "MUL_MAT_HADAMARD",  # MUL_MAT with ggml_mul_mat_set_hint(GGML_HINT_SRC0_IS_HADAMARD)
    "MUL_MAT",
    "MUL_MAT_ID",
    "FLASH_ATTN_EXT",  # the long ones last
]
MAX_ARGS_BYTES = 100_000  # one argv string stays under Linux's MAX_ARG_STRLEN (128 KiB)
# A failing case's messages come before its name on the same line: "[CPY] ERR = … > …   CPY(…): FAIL".
CASE_LINE = re.compile(r"(?:^|\s)([A-Z][A-Z0-9_]*\(.*\)): (.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class OpResult:
    passed: int = 0
    failed: int = 0
    not_supported: int = 0
    failures: list[str] = field(default_factory=list)
    params: str | None = None  # the -p filter these counts are for (None: every case)
    not_reached: int = 0  # --one-process: cases after the client was cut

    def count(self, name: str, verdict: str) -> None:
        """One reported case: passed, not supported by the CPU reference, or failed."""
        if verdict.endswith("OK"):
            self.passed += 1
        elif "not supported" in verdict:
            self.not_supported += 1
        else:
            self.failed += 1
            self.failures.append(f"{name}: {verdict}")


def tool_env(endpoint: str) -> dict:
    return dict(os.environ, FLEETD_RPC_ENDPOINT=endpoint)


class Server:
    """fleetd or the stock ggml-rpc-server as a process, (re)started on demand: the stock server
    aborts on a graph it cannot compute, and the remaining cases still need a server."""

    def __init__(self, kind: str, log_dir: Path, device: str = "cpu", extra: list[str] = ()) -> None:
        self.kind, self.log_dir, self.device, self.extra = kind, log_dir, device, list(extra)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def ensure(self) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self.port = free_port()
            if self.kind == "fleetd":
                args = [
                    sys.executable,
                    "-m",
                    "fleetd.server",
                    "--port",
                    str(self.port),
                    "--control-port",
                    "0",
                    "--device",
                    self.device,
                    "--log-level",
                    "warning",
                    *self.extra,
                ]
            else:
                args = [str(find_tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(self.port), "-t", "1"]
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / f"{self.kind}-server.log", "ab") as log:  # the child keeps its fd
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
            wait_listening(self.port)
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def list_cases(endpoint: str, op: str, params: str | None) -> list[str]:
    """Full case names of `op` in run order (support mode builds graphs, computes nothing)."""
    args = [str(find_tool("test-backend-ops")), "support", "-b", "RPC0", "-o", op]
    if params:
        args += ["-p", params]
    out = subprocess.run(args, env=tool_env(endpoint), capture_output=True, text=True, check=False).stdout
    cases = []
    for line in out.splitlines():
        m = CASE_LINE.search(ANSI.sub("", line))
        if m and m.group(1).startswith(op + "("):
            cases.append(m.group(1))
    return cases


def batch_size(cases: list[str]) -> int:
    """How many leading cases fit, comma-joined, in one argv string (at least one)."""
    size = 0
    for n, c in enumerate(cases):
        size += len(c) + 1
        if size > MAX_ARGS_BYTES:
            return max(n, 1)
    return len(cases)


def run_once(endpoint: str, filters: list[str], timeout: float, log: Path) -> tuple[dict[str, str], int]:
    """One test-backend-ops run, streamed into `log`: {case name: verdict} and the exit status."""
    args = ["stdbuf", "-oL", str(find_tool("test-backend-ops")), "-b", "RPC0", *filters]
    with open(log, "ab") as out:
        start = out.tell()
        proc = subprocess.Popen(args, env=tool_env(endpoint), stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    verdicts = {}
    for line in text.splitlines():
        m = CASE_LINE.search(ANSI.sub("", line))
        if m and (m.group(2).endswith(("OK", "FAIL")) or "not supported" in m.group(2)):
            verdicts.setdefault(m.group(1), line[: m.start(1)].strip() + " " + m.group(2))
    return verdicts, rc


def run_op(server: Server, op: str, params: str | None, timeout: float, log: Path) -> OpResult:
    result = OpResult(params=params)
    remaining = list_cases(server.ensure(), op, params)
    whole_op = True
    while remaining:
        if whole_op:
            batch, filters = remaining, ["-o", op] + (["-p", params] if params else [])
        else:
            batch = remaining[: batch_size(remaining)]
            filters = ["-o", ",".join(batch)]
        whole_op = False
        verdicts, rc = run_once(server.ensure(), filters, timeout, log)
        for name in batch:
            if (verdict := verdicts.get(name)) is not None:
                result.count(name, verdict)
        missing = [c for c in batch if c not in verdicts]
        rest = remaining[len(batch) :]
        if missing:
            # The first unreported case took the server (or its connection) down; resume after it.
            why = "server closed the connection" if rc not in (0, 1) else f"not reported (exit {rc})"
            result.failed += 1
            result.failures.append(f"{missing[0]}: {why}")
            missing = missing[1:]
        remaining = missing + rest
    return result


def run_one_process(
    server: Server,
    ops: list[str],
    params: str | None,
    timeout: float,
    log: Path,
    extra_filters: list[str] = (),
) -> dict[str, OpResult]:
    """Every op's cases in one test-backend-ops run; what the run never reported is not reached."""
    cases = {op: list_cases(server.ensure(), op, params) for op in ops}
    filters = ["-o", ",".join(ops)] + (["-p", params] if params else []) + list(extra_filters)
    verdicts, rc = run_once(server.ensure(), filters, timeout, log)
    results = {}
    for op, names in cases.items():
        r = results[op] = OpResult(params=params)
        for name in names:
            if (verdict := verdicts.get(name)) is None:
                r.not_reached += 1
            else:
                r.count(name, verdict)
        if r.not_reached:
            r.failures.append(f"{r.not_reached} cases not reached (test-backend-ops exit {rc})")
    return results


def one_process_markdown(results: dict[str, dict[str, OpResult]], notes: list[str] = ()) -> str:
    servers = list(results)
    ops = list(dict.fromkeys(op for r in results.values() for op in r))
    lines = [
        "# test-backend-ops in one process per server",
        "",
        "Generated by `scripts/test-backend-ops.sh` (`scripts/backend_ops.py --one-process`): every",
        "op below in one test-backend-ops run through each server, as a user runs it; a client the",
        "server cuts loses every later case (*not reached*).",
        "",
        *[f"- {n}" for n in notes],
        *([""] if notes else []),
        "| op | " + " | ".join(f"{s} pass | fail | n/s | not reached" for s in servers) + " |",
        "|---|" + "---:|" * (4 * len(servers)),
    ]
    totals = {s: Counter() for s in servers}
    for op in ops:
        cells = []
        for s in servers:
            r = results[s].get(op) or OpResult()
            cells += [str(r.passed), str(r.failed), str(r.not_supported), str(r.not_reached)]
            totals[s].update(p=r.passed, f=r.failed, n=r.not_supported, u=r.not_reached)
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines.append(
        "| **total** | "
        + " | ".join(f"**{t['p']}** | **{t['f']}** | **{t['n']}** | **{t['u']}**" for t in totals.values())
        + " |"
    )
    failures = [(s, f) for s in servers for r in results[s].values() for f in r.failures]
    if failures:
        lines += ["", "## Failing cases", ""] + [f"- {s}: `{f[:300]}`" for s, f in failures[:200]]
    return "\n".join(lines) + "\n"


def coverage_markdown(results: dict[str, dict[str, OpResult]], notes: list[str] = ()) -> str:
    servers = list(results)
    ops = sorted({op for r in results.values() for op in r})
    lines = [
        "# Op coverage: test-backend-ops against RPC servers",
        "",
        "Generated by `scripts/backend_ops.py` (llama.cpp test-backend-ops of the pinned tree, each",
        "case compared with ggml's CPU backend). Columns per server (fleetd: per device): passed /",
        "failed / not supported. All cases of each op, except where the op names a `-p` filter.",
        "",
        *[f"- {n}" for n in notes],
        *([""] if notes else []),
        "- *n/s*: ggml's CPU backend, the reference and what the stock server computes with, does not",
        "  support the case; test-backend-ops skips it.",
        '- *fail* with "server closed the connection": the server refused the graph (fleetd: one',
        "  `UnsupportedOp` log line naming op and types, that connection closed, the daemon serving",
        "  on); otherwise the numbers differ from the CPU's beyond the case's error bound.",
        "",
        "| op | " + " | ".join(f"{s} pass | {s} fail | {s} n/s" for s in servers) + " |",
        "|---|" + "---:|" * (3 * len(servers)),
    ]
    totals = {s: Counter() for s in servers}
    for op in ops:
        cells = []
        for s in servers:
            r = results[s].get(op)
            if r is None:
                cells += ["", "", ""]
                continue
            cells += [str(r.passed), str(r.failed), str(r.not_supported)]
            totals[s].update(passed=r.passed, failed=r.failed, ns=r.not_supported)
        filters = {results[s][op].params for s in servers if op in results[s]} - {None}
        label = op + "".join(f" (`-p {f}`)" for f in sorted(filters))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append(
        "| **total** | "
        + " | ".join(
            f"**{totals[s]['passed']}** | **{totals[s]['failed']}** | **{totals[s]['ns']}**" for s in servers
        )
        + " |"
    )
    failures = [(s, f) for s in servers for r in results[s].values() for f in r.failures]
    if failures:
        lines += ["", "## Failing cases", ""]
        lines += [f"- {s}: `{f[:300]}`" for s, f in failures[:400]]
    return "\n".join(lines) + "\n"


def one_process_main(args) -> int:
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, OpResult]] = {}
    ops = args.ops.split(",")
    for kind in args.servers.split(","):
        server = Server(kind, log_dir, args.device, args.fleetd_args.split())
        column = f"fleetd-{args.device}" if kind == "fleetd" else kind
        log = log_dir / f"one-process-{column}.log"
        log.unlink(missing_ok=True)
        try:
            results[column] = run_one_process(server, ops, args.params, args.timeout, log)
        finally:
            server.stop()
        for op, r in results[column].items():
            print(
                f"{column:12} {op:16} pass {r.passed:5}  fail {r.failed:4}  n/s {r.not_supported:4}  "
                f"not reached {r.not_reached:5}",
                flush=True,
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(one_process_markdown(results, args.note))
    if args.json:
        Path(args.json).write_text(
            json.dumps({s: {op: vars(r) for op, r in ops.items()} for s, ops in results.items()}, indent=1)
        )
    # fleetd must pass every case the stock server passes, and reach them all
    stock = results.get("stock", {})
    worse = [
        (s, op)
        for s, ops_ in results.items()
        if s != "stock"
        for op, r in ops_.items()
        if r.not_reached or (op in stock and r.passed < stock[op].passed)
    ]
    for s, op in worse:
        print(f"{s}: {op} behind the stock server or cut short", file=sys.stderr)
    return 1 if worse else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "-o", "--ops", default=",".join(ISSUE_OPS), help="comma separated test-backend-ops op names"
    )
    ap.add_argument("-p", "--params", default=None, help="test-backend-ops -p regex over case params")
    ap.add_argument("--servers", default="fleetd", help="fleetd, stock, or fleetd,stock")
    ap.add_argument("--device", default="cpu", help="fleetd's device: cpu (ggml kernels, default) or numpy")
    ap.add_argument(
        "--out", default=str(REPO / "docs" / "op-coverage.md"), help="markdown table ('' for none)"
    )
    ap.add_argument("--json", default=None, help="also write results as JSON")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="start from the results in --json and replace only the ops run now",
    )
    ap.add_argument("--note", action="append", default=[], help="a line for the table's header (repeatable)")
    ap.add_argument("--log-dir", default="/tmp/fleetd-backend-ops")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per test-backend-ops run")
    ap.add_argument(
        "--one-process",
        action="store_true",
        help="all ops in one test-backend-ops run per server (a cut client loses the rest)",
    )
    ap.add_argument("--fleetd-args", default="", help='more fleetd flags, e.g. "--request-timeout 1"')
    args = ap.parse_args()
    if args.one_process:
        return one_process_main(args)

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, OpResult]] = {}
    if args.merge and args.json and Path(args.json).exists():
        saved = json.loads(Path(args.json).read_text())
        results = {s: {op: OpResult(**r) for op, r in ops.items()} for s, ops in saved.items()}
    for kind in args.servers.split(","):
        server = Server(kind, log_dir, args.device)
        column = f"fleetd-{args.device}" if kind == "fleetd" else kind
        results.setdefault(column, {})
        log = log_dir / f"test-backend-ops-{column}.log"
        try:
            for op in args.ops.split(","):
                r = run_op(server, op, args.params, args.timeout, log)
                results[column][op] = r
                print(
                    f"{column:12} {op:16} pass {r.passed:5}  fail {r.failed:4}  n/s {r.not_supported:4}",
                    flush=True,
                )
                for f in r.failures[:5]:
                    print(f"         {f[:200]}", flush=True)
                # After every op: a long run leaves its results behind even if cut short.
                if args.out:
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(coverage_markdown(results, args.note))
                if args.json:
                    Path(args.json).write_text(
                        json.dumps(
                            {s: {op: vars(r) for op, r in ops.items()} for s, ops in results.items()},
                            indent=1,
                        )
                    )
        finally:
            server.stop()
    failed = sum(r.failed for ops in results.values() for r in ops.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

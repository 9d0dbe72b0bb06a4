"""Per-step accounting at the coordinator, as plain data and as the seed's text tables.

Formatters only: they return strings and dicts, the CLI and the pipeline decide where they go.
"""

from __future__ import annotations

from fleetd.pipeline.results import StepResult
from fleetd.wire import Cmd

# Row order of the tables: the data movers first, as in the seed's PR description.
ROW_ORDER = (
    Cmd.GET_TENSOR,
    Cmd.SET_TENSOR,
    Cmd.COPY_TENSOR_TO,
    Cmd.COPY_TENSOR_TO_ASYNC,
    Cmd.PEER_WAIT,
    Cmd.GRAPH_COMPUTE,
    Cmd.GRAPH_RECOMPUTE,
)


def per_step(results: list[StepResult]) -> dict:
    """Mean commands and bytes per step over `results` (the caller picks the window)."""
    n = len(results)
    if n == 0:
        raise ValueError("per_step: no steps")
    counts: dict[str, float] = {}
    req = resp = 0
    for r in results:
        for cmd, c in r.counters.count.items():
            counts[Cmd(cmd).name] = counts.get(Cmd(cmd).name, 0) + c
        req += sum(r.counters.request_bytes.values())
        resp += sum(r.counters.response_bytes.values())
    return {
        "steps": n,
        "commands": {k: v / n for k, v in counts.items()},
        "total_commands": sum(counts.values()) / n,
        "request_bytes": req / n,
        "response_bytes": resp / n,
        "direct_copies": sum(r.direct for r in results) / n,
        "fallbacks": sum(r.fallbacks for r in results) / n,
    }


def _bytes(x: float) -> str:
    return f"{round(x):,}".replace(",", " ")


def step_table(columns: dict[str, dict]) -> str:
    """The seed's table: one column per arm (`per_step` dicts), one row per command."""
    arms = list(columns)
    names = [c.name for c in ROW_ORDER]
    names += sorted({k for col in columns.values() for k in col["commands"]} - set(names))
    names = [k for k in names if any(col["commands"].get(k) for col in columns.values())]
    rows = [["per step"] + arms]
    for k in names:
        rows.append(
            [k] + [f"{col['commands'][k]:.2f}" if k in col["commands"] else "-" for col in columns.values()]
        )
    rows.append(["total commands"] + [f"{c['total_commands']:.2f}" for c in columns.values()])
    rows.append(
        ["request bytes from the coordinator"] + [_bytes(c["request_bytes"]) for c in columns.values()]
    )
    rows.append(
        ["response bytes to the coordinator"] + [_bytes(c["response_bytes"]) for c in columns.values()]
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def step_line(r: StepResult) -> str:
    cmds = ", ".join(f"{Cmd(c).name} {n}" for c, n in sorted(r.counters.count.items()) if n)
    req = sum(r.counters.request_bytes.values())
    resp = sum(r.counters.response_bytes.values())
    return (
        f"rpc stats: step {r.step}: {cmds}; request {_bytes(req)} B, response {_bytes(resp)} B; "
        f"direct {r.direct}, fallback {r.fallbacks}"
    )

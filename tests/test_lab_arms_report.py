"""benchmarks/lab_arms.py's report without a lab: paired ratios per round (each from the same
round's cells), the quiet-round filter by steal, and --report on a saved run's JSON."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from helpers import REPO

SCRIPT = REPO / "benchmarks" / "lab_arms.py"


def load():
    spec = importlib.util.spec_from_file_location("lab_arms", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cell(arm: str, tps: float, steal_ms: float = 0.0) -> dict:
    return {
        "arm": arm,
        "pp_tps": tps,
        "tg_tps": tps / 4,
        "batched_tps": tps / 2,
        "md5": "same",
        "pipeline_parallel": True,
        "steal_ms": steal_ms,
    }


def run_of(rounds: list[list[dict]]) -> dict:
    return {
        "settings": {"nodes": 3, "coordinator_link": "1gbit", "peer_link": "2gbit", "rounds": len(rounds)},
        "model": "test.gguf",
        "peak_rss_mib": {"stock": [1.0], "fleetd": [2.0]},
        "rounds": [
            {"round": i + 1, "order": [c["arm"] for c in r], "cells": r} for i, r in enumerate(rounds)
        ],
    }


def test_paired_ratios_take_each_rounds_own_cells_and_quiet_rounds_drop_stolen_ones():
    lab_arms = load()
    rounds = run_of(
        [
            [cell("stock", 100), cell("async", 120)],
            [cell("async", 60, steal_ms=900), cell("stock", 50)],  # a slow round: both fell
            [cell("stock", 200), cell("async", 300)],
        ]
    )["rounds"]
    assert lab_arms.paired(rounds, "async", "stock", "tg_tps") == [1.2, 1.2, 1.5]
    assert lab_arms.paired(rounds, "async", "stock", "tg_tps", quiet_ms=100) == [1.2, 1.5]
    summary = lab_arms.paired_summary(rounds, ["stock", "async"])
    assert summary["async"]["pp_tps"]["x_stock"]["all"] == {"n": 3, "median": 1.2, "q1": 1.2, "q3": 1.5}
    assert summary["async"]["pp_tps"]["x_stock"]["quiet"]["n"] == 2
    assert "x_hub" not in summary["async"]["pp_tps"]  # no hub arm in this run
    # medians of the arms alone: 120/100 is not what a per-arm median ratio gives here
    assert lab_arms.summarize(rounds, ["stock", "async"])["async"]["pp_tps"]["median"] == 120


def test_report_prints_and_charts_a_saved_run_and_a_bad_file_is_a_usage_error(tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(run_of([[cell("stock", 100), cell("hub", 90), cell("async", 130)]] * 4)))
    png = tmp_path / "run.png"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--report", str(saved), "--chart", str(png)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "paired per round" in proc.stdout
    assert "1.30 [1.30..1.30] n=4" in proc.stdout  # async over stock, every round
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--report", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lab_arms.py: error: --report") and "not a lab_arms.py result" in last

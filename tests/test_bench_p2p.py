"""benchmarks/p2p.py runs end to end on a small pipeline: the three arms' outputs agree, the
boundary is timed for each arm with both clients (prebuilt frames and the Pipeline's own), and
the JSON has every number, the client's CPU a move included. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.timeout(240)
@pytest.mark.parametrize("client", ["raw", "pipeline"])
def test_the_p2p_benchmark_times_every_arms_boundary(tmp_path, client):
    out = tmp_path / "p2p.json"
    args = ["--rows", "1", "--n-embd", "256", "--steps", "2", "--rounds", "2", "--boundary", "50"]
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "p2p.py"),
            *args,
            "--boundary-client",
            client,
            "--no-stock",
        ]
        + ["--cpus", "0", "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    md5s = {arm["md5"] for arm in result["arms"].values()}
    assert len(md5s) == 1, result["arms"]
    boundary = result["boundary"]
    for arm in ("hub", "direct", "async"):
        assert 0 < boundary[arm]["q1"] <= boundary[arm]["median"] <= boundary[arm]["q3"], boundary[arm]
        assert boundary[arm]["client_cpu"] > 0, boundary[arm]
    assert boundary["async_over_hub"] > 0
    assert f"{client} client, CPUs 0" in proc.stdout


@pytest.mark.parametrize("cpus", ["zero", "0,4096"])
def test_a_bad_cpu_list_is_a_usage_error(cpus):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "p2p.py"), "--cpus", cpus],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"p2p.py: error: --cpus {cpus}:")

"""The README's main job: `fleetctl demo` on a local fleet, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import needs_tool


@needs_tool("llama-completion", "ggml-rpc-server")  # the demo compares with the stock server
def test_demo_runs_llama_and_ab_on_a_local_fleet():
    p = subprocess.run([sys.executable, "-m", "fleetd.server", "--help"], capture_output=True, text=True)
    assert p.returncode == 0
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "from fleetd.ctl import main; raise SystemExit(main())",
            "demo",
            "--json",
            "--n-embd",
            "256",
            "--steps",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert doc["llama"]["same_as_stock"] is True
    assert doc["ab"]["outputs_identical"] is True
    direct = doc["ab"]["arms"]["direct"]
    assert direct["per_step"]["commands"]["COPY_TENSOR_TO"] == 1.0 and direct["node_peer_copies"] > 0
    assert doc["ab"]["arms"]["hub"]["node_peer_copies"] == 0

"""The structure-aware GRAPH_COMPUTE fuzzer (tests/graph_fuzzer.py), bounded for CI.

A fixed seed range (every op with a rule, ~2000 cases, about a minute on 2 cores) against a
`python -m fleetd.server -d cpu` subprocess: no case may kill the daemon, and no case may change
a byte outside the extents its graph's nodes may write, in its own buffer or in another session's.
Refusals and contained compute failures are fine. The long form: scripts/fuzz.sh
(FLEETD_GRAPH_FUZZ_SECONDS=3600); one case again: scripts/fuzz_graphs.py --case SEED -v.
"""

from __future__ import annotations

import os

import graph_fuzzer as gf
import pytest

from fleetd.compute.ggml.rules import RULES

SEED = int(os.environ.get("FLEETD_GRAPH_FUZZ_SEED", "0"))
CASES = int(os.environ.get("FLEETD_GRAPH_FUZZ_CASES", "2000"))
SECONDS = float(os.environ.get("FLEETD_GRAPH_FUZZ_CI_SECONDS", "75"))


def test_every_ruled_op_is_fuzzed():
    assert sorted(op for op in RULES if op not in gf.FUZZ_OPS) == []
    assert set(gf.GENERATORS) == set(gf.FUZZ_OPS)


def test_a_seed_replays_its_case():
    for seed in range(0, 400, 7):
        a, b = gf.build_case(seed), gf.build_case(seed)
        gf.place(a, 0x10, 1 << 32)
        gf.place(b, 0x10, 1 << 32)
        ga, gb = a.gen.g.serialize(a.gen.nodes), b.gen.g.serialize(b.gen.nodes)
        assert ga.nodes == gb.nodes and ga.tensors.tobytes() == gb.tensors.tobytes()
        assert gf.write_plan(a, 1 << 32) == gf.write_plan(b, 1 << 32)
        assert a.op == gf.op_of(seed).name


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    try:
        from fleetd.compute.ggml.device import load_device

        load_device()
    except OSError as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"ggml libraries: {exc}")
    with gf.Daemon(tmp_path_factory.mktemp("graph-fuzz")) as d:
        yield d


@pytest.mark.timeout(SECONDS + 120)
def test_graph_fuzz_no_daemon_death_no_corruption(daemon):
    results = gf.run_cases(daemon, range(SEED, SEED + CASES), SECONDS)
    bad = [r for r in results if r.outcome in ("daemon_death", "hang") or r.corruptions]
    print(gf.format_table(results))
    assert results, "no case ran"
    assert not bad, (
        f"{len(bad)} of {len(results)} cases killed or wedged the daemon or corrupted a buffer:\n"
        + "\n".join(gf.describe(r)[: 6000 if r.step else 600] for r in bad[:40])
    )

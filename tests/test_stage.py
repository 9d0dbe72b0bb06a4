"""fleetctl stage end to end: two real fleetd nodes with a cache directory each, one reached over
loopback and one through a real sshd (SFTP), and a generated model whose FFN matrices are above the
client's 10 MiB SET_TENSOR_HASH threshold (fleetd.models "hash2": 2 layers, 3 such matrices each).

Stage puts exactly the planned tensors into each node's directory under the names fleetd's own
hashing gives them, a second run sends nothing, `fleetctl status` counts them, and the patched
llama-completion then loads with SET_TENSOR_HASH hits (the nodes' counters) and prints the text of
an unstaged load. An interrupted stage leaves no file under a final name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import needs_tool

from fleetd.fleet.local import LocalFleet
from fleetd.fleet.node import Fleet
from fleetd.fleet.plan import tensor_split
from fleetd.fleet.ssh import SshOptions
from fleetd.fleet.stage import HASH_THRESHOLD, Model, manifest_name
from fleetd.fleet.stage_store import LocalStore
from fleetd.models import generate
from fleetd.server.cache_dir import file_fnv1a_64

PROMPT = "the time of their first new"
HASHED = ("ffn_gate", "ffn_up", "ffn_down")  # per layer, the matrices above the threshold
LOAD_TIME = re.compile(r"load time =\s+([\d.]+) ms")


def fleetctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from fleetd.ctl import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return generate("llama", "f16", tmp_path_factory.mktemp("stage-model"), "hash2")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, ssh_server):
    """Two fleetd with a cache directory each: n0 on loopback, n1 through the test sshd."""
    work = tmp_path_factory.mktemp("stage-fleet")
    caches = [work / "cache-0", work / "cache-1"]
    (work / "b").mkdir()
    with (
        LocalFleet(1, work, server_args=["--threads", "1", "-c", str(caches[0])]) as a,
        LocalFleet(1, work / "b", server_args=["--threads", "1", "-c", str(caches[1])]) as b,
    ):
        specs = [lf.fleet[0].spec for lf in (a, b)]
        lines = [
            f"localhost rpc_port={specs[0].rpc_port} control_port={specs[0].control_port} name=n0 "
            f"cache_dir={caches[0]}",
            ssh_server.node_line(
                rpc_port=specs[1].rpc_port, control_port=specs[1].control_port, name="n1", cache_dir=caches[1]
            ),
        ]
        nodes = work / "nodes.txt"
        nodes.write_text("\n".join(lines) + "\n")
        ssh = ["-i", str(ssh_server.identity), "--known-hosts", str(ssh_server.known_hosts)]
        options = SshOptions(identity=(str(ssh_server.identity),), known_hosts=(str(ssh_server.known_hosts),))
        yield {
            "nodes": nodes,
            "ssh": ssh,
            "options": options,
            "caches": caches,
            "endpoints": [a.endpoints[0], b.endpoints[0]],
            "work": work,
        }


def plan_doc(names: list[str], endpoints: list[str]) -> dict:
    """A version-1 plan as `fleetctl plan --json` writes it: one layer per node, the output last."""
    stages = [
        {"name": n, "endpoint": e, "layers": [i, i + 1], "layer_count": 1, "output": i == len(names) - 1}
        for i, (n, e) in enumerate(zip(names, endpoints))
    ]
    split = tensor_split([1] * len(names))
    args = ["--rpc", ",".join(endpoints), "-ngl", "3", "-sm", "layer", "--tensor-split", split, "-c", "512"]
    return {"version": 1, "fits": True, "model": {"n_layer": 2}, "stages": stages, "llama_args": args}


@pytest.fixture(scope="module")
def plan_file(fleet) -> Path:
    path = fleet["work"] / "plan.json"
    path.write_text(json.dumps(plan_doc(["n0", "n1"], fleet["endpoints"])))
    return path


def hashed_files(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir() if re.fullmatch(r"[0-9a-f]{16}", p.name)}


def expected_files(model: Path, layer: int) -> dict[str, int]:
    """The layer's tensors above the threshold, named by fleetd's own hash of their bytes."""
    m = Model(model)
    out = {}
    for t in m.tensors.values():
        if t.name.startswith(f"blk.{layer}.") and t.size > HASH_THRESHOLD:
            out[f"{file_hash(m, t):016x}"] = t.size
    return out


def file_hash(m: Model, t) -> int:
    """fleetd's cache directory's hash (file_fnv1a_64: chunked reads of a file) of the bytes."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"stage-test-{os.getpid()}.bin"
    path.write_bytes(m.view(t))
    try:
        with open(path, "rb", buffering=0) as f:
            return file_fnv1a_64(f)
    finally:
        path.unlink()


def stats(fleet, name: str):
    with Fleet.load(fleet["nodes"], fleet["options"]) as f:
        (node,) = f.select([name])
        return node.stats().total.commands


def reset_stats(fleet) -> None:
    with Fleet.load(fleet["nodes"], fleet["options"]) as f:
        f.map(lambda n: n.reset_stats()).raise_on_failure()


def complete(model: Path, doc: dict) -> tuple[str, float, float]:
    """The patched llama-completion over the fleet with the plan's flags: text, load ms, wall s."""
    from fleetd.tools import find_p2p_tool

    args = [str(find_p2p_tool("llama-completion")), "-m", str(model), *doc["llama_args"]]
    args += ["-p", PROMPT, "-n", "8", "--temp", "0", "-no-cnv", "--no-warmup", "-t", "1"]
    t0 = time.monotonic()
    p = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=120)
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-2000:]
    load = LOAD_TIME.search(p.stderr + p.stdout)
    return p.stdout, float(load.group(1)) if load else float("nan"), wall


def clear(directory: Path) -> None:
    for p in directory.iterdir():
        p.unlink()


@needs_tool("p2p/llama-completion")
def test_stage_then_load_sends_hashes_and_gives_the_unstaged_text(model, fleet, plan_file, capsys):
    doc = json.loads(plan_file.read_text())
    weights = sum(expected_files(model, 0).values()) + sum(expected_files(model, 1).values())

    # An unstaged load: the weights go over SET_TENSOR (fleetd then caches them itself: cleared).
    reset_stats(fleet)
    text_unstaged, load_unstaged, wall_unstaged = complete(model, doc)
    unstaged = [stats(fleet, n) for n in ("n0", "n1")]
    for c in fleet["caches"]:
        clear(c)

    p = fleetctl("stage", str(model), str(fleet["nodes"]), "--plan", str(plan_file), "--json", *fleet["ssh"])
    assert p.returncode == 0, p.stderr
    first = json.loads(p.stdout)["nodes"]
    for i, name in enumerate(("n0", "n1")):
        want = expected_files(model, i)
        assert len(want) == len(HASHED)
        assert hashed_files(fleet["caches"][i]) == want  # exactly the plan's, under fleetd's names
        for file in want:
            with open(fleet["caches"][i] / file, "rb", buffering=0) as f:
                assert f"{file_fnv1a_64(f):016x}" == file
        assert first[name]["ok"] and first[name]["sent_files"] == 3
        assert first[name]["sent_bytes"] == sum(want.values())
        assert (fleet["caches"][i] / manifest_name(model.name)).is_file()
        assert not [x for x in os.listdir(fleet["caches"][i]) if x.startswith(".store.")]

    stage = ("stage", str(model), str(fleet["nodes"]), "--plan", str(plan_file), *fleet["ssh"])
    again = fleetctl(*stage)
    assert again.returncode == 0, again.stderr
    second = json.loads(fleetctl(*stage, "--json").stdout)["nodes"]
    assert all(second[n]["sent_bytes"] == 0 and second[n]["present_files"] == 3 for n in ("n0", "n1"))
    assert "staged" in again.stdout and "n1" in again.stdout

    status = fleetctl("status", str(fleet["nodes"]), *fleet["ssh"])
    assert status.returncode == 0, status.stderr
    for name in ("n0", "n1"):
        assert f"{name}: model {model.name}: 3 of 3 tensors" in status.stdout, status.stdout
    sj = json.loads(fleetctl("status", str(fleet["nodes"]), "--json", *fleet["ssh"]).stdout)
    assert sj["n1"]["staged"][0]["present_files"] == 3 and sj["n1"]["staged"][0]["files"] == 3

    # The staged load: every weight above the threshold found by hash, none sent as SET_TENSOR.
    reset_stats(fleet)
    text_staged, load_staged, wall_staged = complete(model, doc)
    staged = [stats(fleet, n) for n in ("n0", "n1")]
    assert text_staged == text_unstaged and text_staged.strip()
    for i in range(2):
        assert staged[i]["SET_TENSOR_HASH"].count == 3
        assert unstaged[i]["SET_TENSOR"].request_bytes - staged[i]["SET_TENSOR"].request_bytes >= sum(
            expected_files(model, i).values()
        )
    bytes_unstaged = sum(s["SET_TENSOR"].request_bytes + s["SET_TENSOR_HASH"].request_bytes for s in unstaged)
    bytes_staged = sum(s["SET_TENSOR"].request_bytes + s["SET_TENSOR_HASH"].request_bytes for s in staged)
    with capsys.disabled():
        print(
            f"\n[stage] hashed weights {weights} B; coordinator -> nodes at load: unstaged "
            f"{bytes_unstaged} B, staged {bytes_staged} B; load {load_unstaged:.0f} ms vs "
            f"{load_staged:.0f} ms (wall {wall_unstaged:.2f} s vs {wall_staged:.2f} s); "
            f"stage {first['n0']['seconds']:.2f} s (loopback), {first['n1']['seconds']:.2f} s (SFTP)"
        )


def test_a_node_without_a_cache_directory_fails_alone_with_one_line(model, fleet, tmp_path):
    lines = fleet["nodes"].read_text().splitlines()
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(lines[0] + "\nlocalhost rpc_port=1 control_port=2 name=bare\n")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_doc(["n0", "bare"], [fleet["endpoints"][0], "127.0.0.1:1"])))
    p = fleetctl("stage", str(model), str(nodes), "--plan", str(plan))
    assert p.returncode == 1
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("fleetctl stage: bare: no cache directory known") and "cache_dir=DIR" in line
    assert "-c DIR" in line
    assert len(hashed_files(fleet["caches"][0])) == 3  # n0 staged all the same


def test_an_interrupted_stage_leaves_no_file_under_a_final_name(model, tmp_path):
    m = Model(model)
    t = next(t for t in m.tensors.values() if t.size > HASH_THRESHOLD)
    store = LocalStore(str(tmp_path))

    def stop(n):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.put("00000000000000aa", m.view(t), stop)
    assert os.listdir(tmp_path) == []
    # A process killed after its first chunk: a temp file at most, never the name.
    script = (
        "import os; from fleetd.fleet.stage import Model\n"
        "from fleetd.fleet.stage_store import LocalStore\n"
        f"m = Model({str(model)!r}); t = m.tensors[{t.name!r}]\n"
        f"LocalStore({str(tmp_path)!r}).put('00000000000000aa', m.view(t), lambda n: os._exit(9))\n"
    )
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 9
    left = os.listdir(tmp_path)
    assert "00000000000000aa" not in left and all(x.startswith(".store.stage.") for x in left), left


def test_usage_errors_are_one_line_and_exit_2(model, fleet, tmp_path):
    nodes = str(fleet["nodes"])
    bad_plan = tmp_path / "bad.json"
    bad_plan.write_text('{"version": 9}')
    other = tmp_path / "other.json"
    other.write_text(json.dumps(plan_doc(["n0", "nope"], fleet["endpoints"])))
    cases = [
        ("stage", str(tmp_path / "missing.gguf"), nodes),
        ("stage", str(model), nodes, "--plan", str(tmp_path / "missing.json")),
        ("stage", str(model), nodes, "--plan", str(bad_plan)),
        ("stage", str(model), nodes, "--plan", str(other), *fleet["ssh"]),
    ]
    for args in cases:
        p = fleetctl(*args)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)


def test_without_a_plan_file_stage_plans_first(model, fleet):
    """No --plan: the plan `fleetctl plan` would make (measured on the nodes), then staged: the
    nodes it uses hold all of the model's hashed tensors between them."""
    p = fleetctl("stage", str(model), str(fleet["nodes"]), "--json", *fleet["ssh"], timeout=180)
    assert p.returncode == 0, p.stderr
    nodes = json.loads(p.stdout)["nodes"]
    assert all(n["ok"] for n in nodes.values())
    assert sum(n["files"] for n in nodes.values()) == 2 * len(HASHED)


def test_a_lab_node_is_staged_in_place_without_ssh(tmp_path):
    """A `fleetctl lab` node (via_netns) is a namespace of this host: its cache directory is this
    host's directory, written without SSH; without cache_dir= there is none to guess (no deploy)."""
    from fleetd.fleet.node import Node
    from fleetd.fleet.nodes_file import NodeSpec
    from fleetd.fleet.stage_store import NoCacheDir, open_store

    spec = NodeSpec(host="10.210.0.11", name="lab-0", via_netns="fl0n0", cache_dir=str(tmp_path))
    store = open_store(Node(spec))
    try:
        assert isinstance(store, LocalStore) and store.where == str(tmp_path)
    finally:
        store.close()
    with pytest.raises(NoCacheDir, match="lab-0: no cache directory known"):
        open_store(Node(NodeSpec(host="10.210.0.11", name="lab-0", via_netns="fl0n0")))


def test_the_stage_lab_model_is_half_a_gigabyte_mostly_sent_by_hash():
    """fleetd.models "stage" (benchmarks/stage_lab.py), sized from its dims without writing it:
    >= 0.5 GB in f16, and every matrix but K and V above the client's hash threshold."""
    from fleetd.models import SIZES

    d = SIZES["stage"]
    q = d.n_head * d.head_dim
    kv = d.n_head_kv * d.head_dim
    matrices = {"q": (q, d.n_embd), "o": (d.n_embd, q), "k": (kv, d.n_embd), "v": (kv, d.n_embd)}
    matrices |= {"gate": (d.n_ff, d.n_embd), "up": (d.n_ff, d.n_embd), "down": (d.n_embd, d.n_ff)}
    sizes = {name: rows * cols * 2 for name, (rows, cols) in matrices.items()}  # f16
    hashed = {name for name, size in sizes.items() if size > HASH_THRESHOLD}
    assert hashed == {"q", "o", "gate", "up", "down"}
    assert d.n_layer * sum(sizes.values()) >= 500_000_000
    assert sum(sizes[n] for n in hashed) / sum(sizes.values()) > 0.9
    assert d.n_layer % 3 == 0  # an even split over the lab's 3 nodes

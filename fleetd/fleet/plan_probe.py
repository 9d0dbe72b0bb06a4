"""`fleetctl plan`'s measurements: each node's memory, device kind, compute rate on the model's
own matrices, and the links (coordinator to node, node to node over the peer path).

    facts = measure(fleet_nodes, model, progress=lambda step, fraction: ...)
    plan = optimise(model, facts, Workload(ctx, parallel))     # fleetd.fleet.plan, pure

Everything is bounded: one RPC connection per node (closed at the end, so a stock server that
serves one client at a time is free again for llama.cpp), buffers of at most PROBE_BYTES or a
fraction of what the node has free, REPEATS timed runs per measurement (the fastest counts: the
noise on a shared machine only ever adds time), and MAX_PEER_NODES for the node-to-node pairs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fleetd.client.graph import GraphBuilder, Tensor
from fleetd.client.rpc import RpcClient
from fleetd.errors import FleetdError, FleetError
from fleetd.fleet.node import Node
from fleetd.fleet.plan import F32, Fleet, Link, Matrix, ModelSizes, NodeFacts, padded
from fleetd.transport.tcp import Timeout
from fleetd.wire import Feature, GgmlType, RpcTensor

PROBE_TIMEOUT = Timeout(connect=5.0, read=120.0)
PROBE_BYTES = 4 << 20  # the link probe's transfer; the compute probe's weights at most 16x this
LATENCY_ROUNDS = 5
REPEATS = 4  # timed runs per measurement, after one untimed (the graph's first compute)
PROMPT_BATCH = 32  # tokens of the prompt probe's batch
MAX_PEER_NODES = 8  # node-to-node links are measured for fleets up to this size
MIN_SECONDS = 1e-6  # a measured time below this is taken as this (a rate must stay finite)

Progress = Callable[[str, float], None]


@dataclass
class _Probe:
    """One node's open connection and a buffer on it."""

    node: Node
    client: RpcClient
    endpoint: str
    buffer: int = 0
    base: int = 0
    size: int = 0

    def alloc(self, size: int) -> None:
        self.free()
        ptr, _ = self.client.alloc_buffer(size)
        if ptr == 0:
            raise FleetError(f"{self.node.name}: ALLOC_BUFFER of {size} bytes refused while measuring")
        self.buffer, self.base, self.size = ptr, self.client.buffer_get_base(ptr), size

    def free(self) -> None:
        if self.buffer:
            self.client.free_buffer(self.buffer)
            self.buffer = 0

    def tensor(self, g: GraphBuilder, type_: int, ne, offset: int) -> Tensor:
        return g.tensor(type_, ne, self.buffer, self.base + offset)

    def close(self) -> None:
        try:
            self.free()
            self.client.sync()
        finally:
            self.client.close()


def _timed(run: Callable[[], object], latency: float = 0.0) -> float:
    """The fastest of REPEATS runs, less `latency`, never below MIN_SECONDS."""
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return max(MIN_SECONDS, min(times) - latency)


def _latency(client: RpcClient) -> float:
    times = []
    for _ in range(LATENCY_ROUNDS):
        t0 = time.perf_counter()
        client.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bytes_tensor(p: _Probe, nbytes: int, offset: int = 0) -> RpcTensor:
    g = GraphBuilder()
    return p.tensor(g, GgmlType.F32, (nbytes // F32,), offset).rpc()


def _links(p: _Probe, latency: float) -> tuple[Link, Link]:
    """(upload, download) over the coordinator link: SET_TENSOR and GET_TENSOR of PROBE_BYTES."""
    size = min(PROBE_BYTES, p.size) // F32 * F32
    t = _bytes_tensor(p, size)
    data = bytes(size)

    def upload():
        p.client.set_tensor(t, data)
        p.client.sync()

    up = _timed(upload, latency)
    down = _timed(lambda: p.client.get_tensor(t), latency)
    return Link(latency, size / up), Link(latency, size / down)


def _scaled(matrices: Sequence[Matrix], budget: int) -> tuple[list[Matrix], float]:
    """The matrices with fewer output rows when their bytes pass `budget`; the fraction kept
    (the measured time is divided by it)."""
    total = sum(m.nbytes for m in matrices)
    if total <= budget:
        return list(matrices), 1.0
    keep = budget / total
    out = []
    for m in matrices:
        rows = max(1, int(m.n * keep))
        out.append(Matrix(m.name, m.type, m.k, rows, m.nbytes * rows // m.n))
    return out, sum(m.nbytes for m in out) / total


def _matmul_seconds(p: _Probe, matrices: Sequence[Matrix], tokens: int, latency: float) -> float:
    """One graph of MUL_MATs (each matrix times `tokens` f32 columns) on the node: its compute
    time, the fastest of REPEATS GRAPH_RECOMPUTEs."""
    align = p.client.get_alignment()
    layout, at = [], 0
    for m in matrices:
        w_at = at
        at = padded(at + m.nbytes, align)
        x_at = at
        at = padded(at + m.k * tokens * F32, align)
        y_at = at
        at = padded(at + m.n * tokens * F32, align)
        layout.append((m, w_at, x_at, y_at))
    p.alloc(max(at, align))
    p.client.buffer_clear(p.buffer, 0)  # zero weights: the same work, no bytes over the link
    g = GraphBuilder()
    nodes = []
    for m, w_at, x_at, y_at in layout:
        w = p.tensor(g, m.type, (m.k, m.n), w_at)
        x = p.tensor(g, GgmlType.F32, (m.k, tokens), x_at)
        nodes.append(g.place(g.mul_mat(w, x), p.buffer, p.base + y_at))
    p.client.graph_compute(g.serialize(nodes))
    p.client.sync()

    def recompute():
        p.client.graph_recompute(0)
        p.client.sync()

    return _timed(recompute, latency)


def _compute(p: _Probe, matrices: Sequence[Matrix], free: int, latency: float) -> tuple[float, float]:
    """(seconds for one token, seconds per token of a PROMPT_BATCH batch) through `matrices`."""
    budget = max(1 << 20, min(16 * PROBE_BYTES, free // 4))
    scaled, kept = _scaled(matrices, budget)
    decode = _matmul_seconds(p, scaled, 1, latency) / kept
    prompt = _matmul_seconds(p, scaled, PROMPT_BATCH, latency) / kept / PROMPT_BATCH
    return decode, prompt


def _device_kind(node: Node) -> str:
    """The device kind from the control API (`cpu (ggml)`), or why it is unknown."""
    try:
        devices = node.status().devices
    except (FleetdError, OSError) as exc:
        return f"unknown ({type(exc).__name__})"
    if not devices:
        return "unknown"
    d = devices[0]
    return f"{d.name} ({d.kind})" if d.kind else d.name


def _node_facts(p: _Probe, model: ModelSizes) -> NodeFacts:
    c = p.client
    free, total = c.get_device_memory(0)
    alignment = c.get_alignment(0)
    latency = _latency(c)
    p.alloc(max(alignment, min(PROBE_BYTES, free // 8)))
    upload, download = _links(p, latency)
    decode, prompt = _compute(p, model.layer_matrices, free, latency)
    out = [model.output_matrix] if model.output_matrix else []
    out_decode, out_prompt = _compute(p, out, free, latency) if out else (0.0, 0.0)
    p.free()
    return NodeFacts(
        name=p.node.name,
        endpoint=p.endpoint,
        free=free,
        total=total,
        kind=_device_kind(p.node),
        alignment=alignment,
        peer_copy=bool(c.features & Feature.PEER_COPY),
        decode_layer_s=decode,
        prompt_token_s=prompt,
        output_decode_s=out_decode,
        output_prompt_s=out_prompt,
        upload=upload,
        download=download,
    )


def _peer_link(src: _Probe, dst: _Probe, hidden: int) -> Link | None:
    """COPY_TENSOR_TO src -> dst of one token's hidden state and of PROBE_BYTES (or what the
    buffers hold); None when the source answers 0 (refused)."""
    big = min(PROBE_BYTES, src.size, dst.size) // F32 * F32
    small = min(hidden, big)
    s_small, d_small = _bytes_tensor(src, small), _bytes_tensor(dst, small)
    if not src.client.copy_tensor_to(s_small, d_small, small, dst.endpoint):
        return None
    s_big, d_big = _bytes_tensor(src, big), _bytes_tensor(dst, big)
    latency = _timed(lambda: src.client.copy_tensor_to(s_small, d_small, small, dst.endpoint))
    took = _timed(lambda: src.client.copy_tensor_to(s_big, d_big, big, dst.endpoint), latency)
    return Link(latency, big / took)


def _peers(probes: list[_Probe], facts: list[NodeFacts], hidden: int, progress: Progress):
    peers: dict[tuple[int, int], Link | None] = {}
    notes = []
    capable = [i for i, f in enumerate(facts) if f.peer_copy]
    if len(probes) > MAX_PEER_NODES:
        return peers, [f"more than {MAX_PEER_NODES} nodes: node-to-node links not measured (hub cost)"]
    for i in capable:
        probes[i].alloc(max(facts[i].alignment, min(PROBE_BYTES, facts[i].free // 8)))
    pairs = [(a, b) for a in capable for b in capable if a != b]
    for done, (a, b) in enumerate(pairs):
        progress(f"peer link {facts[a].name} -> {facts[b].name}", done / max(1, len(pairs)))
        peers[(a, b)] = _peer_link(probes[a], probes[b], hidden)
        if peers[(a, b)] is None:
            notes.append(f"peer copy {facts[a].name} -> {facts[b].name} refused: unknown (hub cost)")
    for f in facts:
        if not f.peer_copy:
            notes.append(f"{f.name} does not advertise the peer copy: its boundaries use the hub path")
    return peers, notes


def _open(node: Node) -> _Probe:
    endpoint = node.spec.rpc_endpoint
    try:
        return _Probe(node, RpcClient(endpoint, PROBE_TIMEOUT).open(), endpoint)
    except (FleetdError, OSError) as exc:
        raise FleetError(f"{node.name}: RPC port {endpoint} does not answer: {exc}") from exc


FREE_LINK = Link(MIN_SECONDS, float("inf"))  # memory_only's links: (almost) no cost


def memory_only(nodes: Sequence[Node]) -> Fleet:
    """Each node's free memory and alignment (GET_DEVICE_MEMORY, GET_ALIGNMENT), nothing timed:
    enough to tell whether a model fits before anything is measured."""
    facts = []
    for node in nodes:
        p = _open(node)
        try:
            free, total = p.client.get_device_memory(0)
            facts.append(
                NodeFacts(
                    name=node.name,
                    endpoint=p.endpoint,
                    free=free,
                    total=total,
                    kind="?",
                    alignment=p.client.get_alignment(0),
                    peer_copy=bool(p.client.features & Feature.PEER_COPY),
                    decode_layer_s=MIN_SECONDS,
                    prompt_token_s=MIN_SECONDS,
                    output_decode_s=MIN_SECONDS,
                    output_prompt_s=MIN_SECONDS,
                    upload=FREE_LINK,
                    download=FREE_LINK,
                )
            )
        finally:
            p.close()
    return Fleet(tuple(facts))


def measure(nodes: Sequence[Node], model: ModelSizes, progress: Progress | None = None) -> Fleet:
    """Measure every node (one after the other: a node computing beside another's probe would
    measure the other's load) and the peer links between them."""
    say = progress or (lambda step, fraction: None)
    probes: list[_Probe] = []
    try:
        for node in nodes:
            probes.append(_open(node))
        facts = []
        for i, p in enumerate(probes):
            say(f"measuring {p.node.name}", i / (len(probes) + 1))
            facts.append(_node_facts(p, model))
        say("peer links", len(probes) / (len(probes) + 1))
        peers, notes = _peers(probes, facts, model.hidden_bytes, say)
        say("done", 1.0)
        return Fleet(tuple(facts), peers, tuple(notes))
    finally:
        for p in probes:
            try:
                p.close()
            except (FleetdError, OSError):
                pass  # the measurement stands or has already raised; a close error adds nothing

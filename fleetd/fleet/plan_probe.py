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

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fleetd.client.graph import GraphBuilder, Tensor, f32_bits
from fleetd.client.rpc import RpcClient
from fleetd.errors import FleetdError, FleetError
from fleetd.fleet.node import Node
from fleetd.fleet.plan import (
    F32,
    KV_CELL_PAD,
    STEP_SETS,
    Fleet,
    Link,
    Matrix,
    ModelSizes,
    NodeFacts,
    Plan,
    Workload,
    optimise,
    padded,
)
from fleetd.transport.tcp import Timeout
from fleetd.wire import Feature, GgmlOp, GgmlType, GluOp, RpcTensor

PROBE_TIMEOUT = Timeout(connect=5.0, read=120.0)
PROBE_BYTES = 4 << 20  # the link probe's transfer; the compute probe's weights at most 16x this
LATENCY_ROUNDS = 5
REPEATS = 4  # timed runs per measurement, after one untimed (the graph's first compute)
MAX_PROMPT_TOKENS = 512  # the prompt probe's batch at most (llama.cpp's default micro-batch)
COMPUTE_REPEATS = 5  # timed compute runs (the median counts: see _timed)
# The layer matrices are timed this many times over the whole fleet, each pass after every node's
# previous one, and the median pass counts: a shared host's speed moves by +-20% over seconds (one
# lab node timed 12 times in 30 s: 0.13-0.20 ms per prompt token), so the back-to-back runs of
# one pass, a fraction of a second, measured a slow or a fast moment rather than the node.
COMPUTE_PASSES = 3
PROMPT_BATCH = 32  # tokens of the prompt probe's batch unless the workload's is given
MAX_PEER_NODES = 8  # node-to-node links are measured for fleets up to this size
MIN_SECONDS = 1e-6  # a measured time below this is taken as this (a rate must stay finite)
MAX_REPEATS = 16  # copies of a layer's matrices in one compute probe (see _compute)
# Idle before each timed step: a node waits while the others compute, and a core that went idle
# wakes slowly (on the 2-core VM here a step took ~0.4 ms back to back, ~0.8-1.0 ms after 5 ms
# idle); 5 ms is about one decode step of the lab's fleets, long enough to reach that regime.
STEP_IDLE_S = 0.005
STEP_ROUNDS = 9  # timed decode-step imitations per node (the median counts: see _step_seconds)
# Decode bursts: a node's matrices for this many layers in one graph, each after PROFILE_IDLE_S idle
# (see _decode_profile); the median of PROFILE_ROUNDS. Longer bursts are not timed: after that
# idle a node under a quota has not earned its share back, so they measure the probe's own duty
# cycle (a 0.3-core node: 4 layers 2.6x slower than in the pipeline's 17 ms gaps). The idle is
# about a decode token of the lab's fleets, the gap a node has between its stages: after 5 ms,
# a 0.15-core node ran its 1-layer bursts at a third of its full speed (1.2 ms of CPU each 6 ms
# is over its share), and a plan giving it 1 layer was predicted at 0.77x the decode it ran.
PROFILE_IDLE_S = 0.02
PROFILE_LAYERS = (1, 2)
PROFILE_ROUNDS = 7
OPS_COPIES = 8  # a decode layer's other ops, this many layers' worth in one graph
F16 = 2

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
    # the round trip of the 4-byte GET_TENSOR that ends every timed graph (_recompute), which
    # their timings are less: measured once per node, after its first buffer
    round_trip: float = 0.0
    _tail: RpcTensor | None = None

    def alloc(self, size: int) -> None:
        self.free()
        ptr, _ = self.client.alloc_buffer(size)
        if ptr == 0:
            raise FleetError(f"{self.node.name}: ALLOC_BUFFER of {size} bytes refused while measuring")
        self.buffer, self.base, self.size = ptr, self.client.buffer_get_base(ptr), size
        self._tail = None

    def tail(self) -> RpcTensor:
        """The first 4 bytes of the buffer, built once per buffer (not in a timed run)."""
        if self._tail is None:
            self._tail = self.tensor(GraphBuilder(), GgmlType.F32, (1,), 0).rpc()
        return self._tail

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


def _timed(run: Callable[[], object], latency: float = 0.0, typical: bool = False) -> float:
    """The fastest of REPEATS runs (`typical`: the median of COMPUTE_REPEATS runs back to
    back), less `latency`, never below MIN_SECONDS.

    Transfers take the fastest: noise only ever adds time to them. Compute takes the median: on
    a node that shares its core with another busy process, the fastest graph is the one the
    scheduler let run ahead on the credit a task that slept gets (a few ms), while a node that
    computes many layers per token runs at its share; back to back, the runs after the first
    are at that share."""
    times = []
    for _ in range(COMPUTE_REPEATS if typical else REPEATS):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return max(MIN_SECONDS, (statistics.median(times) if typical else min(times)) - latency)


def _latency(round_trip: Callable[[], object]) -> float:
    """The median of LATENCY_ROUNDS `round_trip`s."""
    times = []
    for _ in range(LATENCY_ROUNDS):
        t0 = time.perf_counter()
        round_trip()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _recompute(p: _Probe) -> None:
    """The stored graph's GRAPH_RECOMPUTE, to its end: a 4-byte GET_TENSOR after it, as a
    decode step ends in the GET of its result. Not GET_ALIGNMENT (`sync`): the daemon serves
    that in Python, and a node under a CPU quota pays it from its share (a 0.15-core node's
    1-layer bursts, timed with it, ran at a third of full speed half the time)."""
    p.client.graph_recompute(0)
    p.client.get_tensor(p.tail())


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

    return _timed(lambda: _recompute(p), latency, typical=True)


def _compute(
    p: _Probe,
    matrices: Sequence[Matrix],
    free: int,
    latency: float,
    graph: float = 0.0,
    prompt_tokens: int = PROMPT_BATCH,
) -> tuple[float, float]:
    """(seconds for one token, seconds per token of a `prompt_tokens` batch) through
    `matrices`, less the graph's own dispatch (`graph`, counted once per node and step).

    For one token, matrices smaller than the budget are laid out up to MAX_REPEATS times, each
    copy with its own weights, and the time divided by the copies: a node computes several
    layers back to back, from memory rather than cache, and a one-layer graph of well under a
    millisecond is mostly dispatch and wake-up. The prompt's batch is the workload's own (the
    matrices' per-token cost falls with the batch: at 32 tokens it was ~25% above that at 512).

    The copies take up to half the node's free memory (at most 64 MiB): a split's decode reads
    each weight once a token from memory, and copies that fit the last-level cache measure a
    speed no split sees (the lab's nodes share a 32 MiB L3: at free // 4, 24 MiB of copies,
    three equal nodes were predicted 1.5-1.7x the decode t/s they ran)."""
    budget = max(1 << 20, min(16 * PROBE_BYTES, free // 2))
    total = sum(m.nbytes for m in matrices)
    reps = max(1, min(MAX_REPEATS, budget // max(1, total)))
    scaled, kept = _scaled(list(matrices) * reps, budget)
    decode = max(MIN_SECONDS, _matmul_seconds(p, scaled, 1, latency) - graph) / kept / reps
    scaled, kept = _scaled(matrices, budget)
    prompt = max(MIN_SECONDS, _matmul_seconds(p, scaled, prompt_tokens, latency) - graph) / kept
    return decode, prompt / prompt_tokens


def _after_idle(run: Callable[[], object], rounds: int, idle: float = STEP_IDLE_S) -> float:
    """`run`, each time after `idle` seconds of idle, as a pipeline's node works between the
    others' stages: the median of `rounds` (wake-ups, whose typical cost, not the luckiest,
    is what each token pays)."""
    times = []
    for _ in range(rounds):
        time.sleep(idle)
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _decode_profile(
    p: _Probe, matrices: Sequence[Matrix], free: int, n_layer: int
) -> tuple[tuple[int, float], ...]:
    """((layers, seconds), ...): one token through that many layers' matrices in one graph, each
    run after PROFILE_IDLE_S of idle, as a node in a pipeline computes its stage between the
    others' (the median of PROFILE_ROUNDS), less the same for a one-ADD graph: the round trip,
    the dispatch and the wake-up, which the step (step_s) already counts.

    A node is not always as fast in a short burst as back to back: under a CPU quota it runs at
    full speed until its share is spent, sharing its core with a busy process it gets a few ms
    of credit after sleeping (lab: a 0.3-core node ran 1 layer at full speed and 4x slower back
    to back; costed back to back, a split giving it 1 layer was predicted at 0.73x the decode
    it ran). plan.full_speed takes its speed from these points and its share from their ratio
    to the back-to-back rate. The layers cycle over copies with their own weights (as
    _compute)."""
    budget = max(1 << 20, min(16 * PROBE_BYTES, free // 2))
    total = sum(m.nbytes for m in matrices)
    copies = max(1, min(MAX_REPEATS, budget // max(1, total)))
    scaled, kept = _scaled(list(matrices) * copies, budget)
    per_copy = len(matrices)
    counts = [n for n in PROFILE_LAYERS if n <= max(1, n_layer)]
    align = p.client.get_alignment()
    lay = _Layout(align)
    tiny = lay.take(3 * F32)
    weights = [lay.take(m.nbytes) for m in scaled]
    inputs = [lay.take(m.k * F32) for m in scaled]
    outputs = [[lay.take(m.n * F32) for m in scaled[:per_copy]] for _ in range(max(counts))]
    p.alloc(max(lay.at, align))
    p.client.buffer_clear(p.buffer, 0)  # zero weights: the same work, no bytes over the link
    g, node = _tiny_graph(p, tiny)
    p.client.graph_compute(g.serialize([node]))
    p.client.sync()
    baseline = _after_idle(lambda: _recompute(p), PROFILE_ROUNDS, PROFILE_IDLE_S)
    profile = []
    for layers in counts:
        g = GraphBuilder()
        nodes = []
        for k in range(layers):
            first = (k % copies) * per_copy
            for j in range(per_copy):
                m = scaled[first + j]
                w = p.tensor(g, m.type, (m.k, m.n), weights[first + j])
                x = p.tensor(g, GgmlType.F32, (m.k, 1), inputs[first + j])
                nodes.append(g.place(g.mul_mat(w, x), p.buffer, p.base + outputs[k][j]))
        p.client.graph_compute(g.serialize(nodes))
        p.client.sync()
        took = _after_idle(lambda: _recompute(p), PROFILE_ROUNDS, PROFILE_IDLE_S) - baseline
        profile.append((layers, max(MIN_SECONDS, took) / kept))
    return tuple(profile)


class _Layout:
    """Offsets of tensors packed into one probe buffer, each aligned."""

    def __init__(self, align: int) -> None:
        self.align, self.at = align, 0

    def take(self, nbytes: int) -> int:
        at = self.at
        self.at = padded(at + max(1, nbytes), self.align)
        return at


def _tiny_graph(p: _Probe, offset: int) -> tuple[GraphBuilder, Tensor]:
    """One ADD of two f32 in the probe buffer at `offset` (12 bytes): a graph that costs only
    its dispatch."""
    g = GraphBuilder()
    a = p.tensor(g, GgmlType.F32, (1,), offset)
    b = p.tensor(g, GgmlType.F32, (1,), offset + F32)
    return g, g.place(g.add(a, b), p.buffer, p.base + offset + 2 * F32)


def _overheads(p: _Probe, hidden: int, latency: float) -> tuple[float, float]:
    """(seconds one graph costs besides its ops, seconds of one decode step's commands).

    The graph: a GRAPH_RECOMPUTE of one ADD, less a round trip (daemon, worker, daemon). The
    step, as the client sends a node one token's work: STEP_SETS small SET_TENSORs (positions,
    mask, inputs), a GRAPH_RECOMPUTE and the GET_TENSOR that waits for it, one round trip and
    every command's handling, each after STEP_IDLE_S of nothing. The median of STEP_ROUNDS:
    these are wake-ups, whose typical cost, not the luckiest, is what each token pays."""
    align = p.client.get_alignment()
    lay = _Layout(align)
    graph_at, small_at, out_at = lay.take(3 * F32), lay.take(1024), lay.take(hidden)
    p.alloc(max(lay.at, align))
    g, node = _tiny_graph(p, graph_at)
    p.client.graph_compute(g.serialize([node]))
    p.client.sync()

    graph = _timed(lambda: _recompute(p), latency)
    small, out = _bytes_tensor(p, 1024, small_at), _bytes_tensor(p, hidden // F32 * F32, out_at)
    data = bytes(1024)

    def step():
        for _ in range(STEP_SETS):
            p.client.set_tensor(small, data)
        p.client.graph_recompute(0)
        p.client.get_tensor(out)

    return graph, max(MIN_SECONDS, _after_idle(step, STEP_ROUNDS))


def _rope_params(head_dim: int) -> list[int]:
    """ggml_rope_ext's op_params for llama's normal rope (mode 0)."""
    params = [0] * 11
    params[1], params[3] = head_dim, 4096
    for i, v in ((5, 10000.0), (6, 1.0), (7, 0.0), (8, 1.0), (9, 32.0), (10, 1.0)):
        params[i] = f32_bits(v)
    return params


def _layer_ops_seconds(p: _Probe, model: ModelSizes, tokens: int, latency: float, graph: float) -> float:
    """One llama layer's graph less its matrices, on `tokens` tokens: attention and FFN norms,
    rope of q and k, the new K and V into the f16 cache, flash attention over a cache of
    `tokens` padded to 256 cells under a causal mask, SwiGLU and both residual adds (what the
    matmul probe leaves out). Less the graph's own dispatch (`graph`), which the step counts
    once per node."""
    e, h, hkv = model.n_embd, model.n_head, model.n_head_kv
    d, dv, ff = model.head_dim_k, model.head_dim_v, model.n_ff
    cells = padded(tokens, KV_CELL_PAD)
    lay = _Layout(p.client.get_alignment())
    at = {
        "x": lay.take(e * tokens * F32),
        "norm": lay.take(e * F32),
        "n1": lay.take(e * tokens * F32),
        "n2": lay.take(e * tokens * F32),
        "q": lay.take(h * d * tokens * F32),
        "k": lay.take(hkv * d * tokens * F32),
        "v": lay.take(hkv * dv * tokens * F32),
        "qr": lay.take(h * d * tokens * F32),
        "kr": lay.take(hkv * d * tokens * F32),
        "kc": lay.take(hkv * d * tokens * F16),
        "vc": lay.take(hkv * dv * tokens * F16),
        "pos": lay.take(tokens * 4),
        "K": lay.take(d * cells * hkv * F16),
        "V": lay.take(dv * cells * hkv * F16),
        "mask": lay.take(cells * tokens * F16),
        "fa": lay.take(dv * h * tokens * F32),
        "wo": lay.take(e * tokens * F32),
        "r1": lay.take(e * tokens * F32),
        "n3": lay.take(e * tokens * F32),
        "n4": lay.take(e * tokens * F32),
        "gate": lay.take(ff * tokens * F32),
        "up": lay.take(ff * tokens * F32),
        "glu": lay.take(ff * tokens * F32),
        "down": lay.take(e * tokens * F32),
        "r2": lay.take(e * tokens * F32),
    }
    p.alloc(lay.at)
    p.client.buffer_clear(p.buffer, 0)
    g = GraphBuilder()
    # the causal mask llama.cpp sets: query i sees the cells up to its own position (the cache
    # holds cells - tokens before the batch); flash attention skips the masked ones
    visible = np.arange(cells)[None, :] <= np.arange(tokens)[:, None] + (cells - tokens)
    mask_data = np.where(visible, np.float16(0), np.float16(-np.inf)).astype(np.float16)
    p.client.set_tensor(p.tensor(g, GgmlType.F16, (cells, tokens), at["mask"]).rpc(), mask_data.tobytes())

    def leaf(name, type_, ne):
        return p.tensor(g, type_, ne, at[name])

    def put(name, t):
        return g.place(t, p.buffer, p.base + at[name])

    f32 = GgmlType.F32
    scale = f32_bits(1.0 / math.sqrt(d))

    def one_layer() -> list:
        x, norm = leaf("x", f32, (e, tokens)), leaf("norm", f32, (e,))
        pos = leaf("pos", GgmlType.I32, (tokens,))
        n1 = put("n1", g.rms_norm(x, 1e-5))
        n2 = put("n2", g.mul(n1, norm))
        q = leaf("q", f32, (d, h, tokens))
        k = leaf("k", f32, (d, hkv, tokens))
        qr = put("qr", g._node(GgmlOp.ROPE, f32, q.ne, [q, pos], _rope_params(d)))
        kr = put("kr", g._node(GgmlOp.ROPE, f32, k.ne, [k, pos], _rope_params(d)))
        kc = g.cpy(kr, leaf("kc", GgmlType.F16, (d, hkv, tokens)))
        vc = g.cpy(leaf("v", f32, (dv, hkv, tokens)), leaf("vc", GgmlType.F16, (dv, hkv, tokens)))
        # q as flash attention reads it: [d, tokens, heads], a permuted view of the roped q
        qp = g.view_of(qr, (d, tokens, h, 1), (F32, F32 * d * h, F32 * d, F32 * d * h * tokens), 0)
        big_k = leaf("K", GgmlType.F16, (d, cells, hkv))
        big_v = leaf("V", GgmlType.F16, (dv, cells, hkv))
        mask = leaf("mask", GgmlType.F16, (cells, tokens))
        fa = put(
            "fa",
            g._node(GgmlOp.FLASH_ATTN_EXT, f32, (dv, h, tokens), [qp, big_k, big_v, mask], [scale, 0, 0, 0]),
        )
        r1 = put("r1", g.add(leaf("wo", f32, (e, tokens)), x))
        n3 = put("n3", g.rms_norm(r1, 1e-5))
        n4 = put("n4", g.mul(n3, norm))
        gate, up = leaf("gate", f32, (ff, tokens)), leaf("up", f32, (ff, tokens))
        glu = put("glu", g._node(GgmlOp.GLU, f32, (ff, tokens), [gate, up], [int(GluOp.SWIGLU), 0]))
        r2 = put("r2", g.add(leaf("down", f32, (e, tokens)), r1))
        return [n1, n2, qr, kr, kc, vc, qp, fa, r1, n3, n4, glu, r2]

    # one token's ops take tens of microseconds, less than the round trip's noise: several
    # layers' worth in one graph, the time divided by them
    copies = OPS_COPIES if tokens == 1 else 1
    p.client.graph_compute(g.serialize([n for _ in range(copies) for n in one_layer()]))
    p.client.sync()

    return max(0.0, _timed(lambda: _recompute(p), latency, typical=True) - graph) / copies


def _layer_ops(
    p: _Probe, model: ModelSizes, latency: float, graph: float, prompt_tokens: int
) -> tuple[float, float, str | None]:
    """(decode, prompt per token) seconds of a layer's ops besides its matrices. A node that
    refuses the graph (a device without one of its ops) closes the probe's connection: it is
    opened again, and the plan goes on with the matrices alone and a note."""
    try:
        decode = _layer_ops_seconds(p, model, 1, latency, graph)
        prompt = _layer_ops_seconds(p, model, prompt_tokens, latency, graph) / prompt_tokens
        return decode, prompt, None
    except (FleetdError, OSError) as exc:
        note = f"{p.node.name}: layer ops not measured, matrices only ({type(exc).__name__}: {exc})"
    try:
        p.client.close()
    except (FleetdError, OSError):
        pass
    p.buffer = 0
    p.client = _open(p.node).client
    return 0.0, 0.0, note


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


def _node_facts(p: _Probe, model: ModelSizes, prompt_tokens: int) -> tuple[NodeFacts, str | None]:
    c = p.client
    free, total = c.get_device_memory(0)
    alignment = c.get_alignment(0)
    latency = _latency(c.sync)  # the links' timings end in the same sync
    p.alloc(max(alignment, min(PROBE_BYTES, free // 8)))
    p.round_trip = _latency(lambda: c.get_tensor(p.tail()))
    upload, download = _links(p, latency)
    graph, step = _overheads(p, model.hidden_bytes, p.round_trip)
    decode_mm, prompt_mm = _compute(p, model.layer_matrices, free, p.round_trip, graph, prompt_tokens)
    profile = _decode_profile(p, model.layer_matrices, free, model.n_layer)
    out = [model.output_matrix] if model.output_matrix else []
    out_decode, out_prompt = _compute(p, out, free, p.round_trip, graph, 1) if out else (0.0, 0.0)
    peer_copy = bool(c.features & Feature.PEER_COPY)
    gate = Feature.PEER_COPY_ASYNC | Feature.PEER_GATE
    peer_gate = c.features & gate == gate
    ops_decode, ops_prompt, note = _layer_ops(p, model, p.round_trip, graph, prompt_tokens)
    p.free()
    facts = NodeFacts(
        name=p.node.name,
        endpoint=p.endpoint,
        free=free,
        total=total,
        kind=_device_kind(p.node),
        alignment=alignment,
        peer_copy=peer_copy,
        decode_layer_s=decode_mm + ops_decode,
        prompt_token_s=prompt_mm + ops_prompt,
        output_decode_s=out_decode,
        output_prompt_s=out_prompt,
        upload=upload,
        download=download,
        step_s=step,
        graph_s=graph,
        decode_matmul_s=decode_mm,
        prompt_matmul_s=prompt_mm,
        peer_gate=peer_gate,
        decode_profile=profile,
    )
    return facts, note


def _rematmul(p: _Probe, model: ModelSizes, facts: NodeFacts, prompt_tokens: int) -> tuple[float, float]:
    """(decode, prompt) matrix seconds of one more pass over the node (_compute, as first timed)."""
    try:
        return _compute(p, model.layer_matrices, facts.free, p.round_trip, facts.graph_s, prompt_tokens)
    finally:
        p.free()


def _median_pass(facts: NodeFacts, timed: list[tuple[float, float]]) -> NodeFacts:
    """The node's facts with its layer matrices at the median pass (decode and prompt each), the
    other ops of a layer as first timed."""
    decode = statistics.median(d for d, _ in timed)
    prompt = statistics.median(q for _, q in timed)
    return dataclasses.replace(
        facts,
        decode_matmul_s=decode,
        prompt_matmul_s=prompt,
        decode_layer_s=decode + facts.decode_layer_s - facts.decode_matmul_s,
        prompt_token_s=prompt + facts.prompt_token_s - facts.prompt_matmul_s,
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


def measure(
    nodes: Sequence[Node],
    model: ModelSizes,
    progress: Progress | None = None,
    prompt_tokens: int = PROMPT_BATCH,
) -> Fleet:
    """Measure every node (one after the other: a node computing beside another's probe would
    measure the other's load; its layer matrices again in COMPUTE_PASSES - 1 more passes over
    the fleet, the median pass counting) and the peer links between them; the prompt at `prompt_tokens`
    tokens a step (the workload's micro-batch: `Workload.prompt_tokens`)."""
    prompt_tokens = max(1, min(prompt_tokens, MAX_PROMPT_TOKENS))
    say = progress or (lambda step, fraction: None)
    probes: list[_Probe] = []
    try:
        for node in nodes:
            probes.append(_open(node))
        facts, notes = [], []
        steps = len(probes) * COMPUTE_PASSES + 1
        for i, p in enumerate(probes):
            say(f"measuring {p.node.name}", i / steps)
            node_facts, note = _node_facts(p, model, prompt_tokens)
            facts.append(node_facts)
            notes += [note] if note else []
        passes = [[(f.decode_matmul_s, f.prompt_matmul_s)] for f in facts]
        for k in range(1, COMPUTE_PASSES):
            for j in range(len(probes)):
                i = j if k % 2 == 0 else len(probes) - 1 - j  # the next pass starts where one ended
                say(f"timing {probes[i].node.name} again", (k * len(probes) + j) / steps)
                passes[i].append(_rematmul(probes[i], model, facts[i], prompt_tokens))
        facts = [_median_pass(f, timed) for f, timed in zip(facts, passes, strict=True)]
        say("peer links", (steps - 1) / steps)
        peers, peer_notes = _peers(probes, facts, model.hidden_bytes, say)
        say("done", 1.0)
        return Fleet(tuple(facts), peers, tuple(notes + peer_notes))
    finally:
        for p in probes:
            try:
                p.close()
            except (FleetdError, OSError):
                pass  # the measurement stands or has already raised; a close error adds nothing


def plan_for(
    nodes: Sequence[Node], model: ModelSizes, work: Workload, progress: Progress | None = None
) -> Plan:
    """What `fleetctl plan` computes (and stage and serve without --plan): free memory first,
    so a model that does not fit raises DoesNotFit before anything is timed or loaded, then the
    nodes measured and the placement optimised over what was measured (DoesNotFit again if
    free memory fell meanwhile)."""
    optimise(model, memory_only(nodes), work)
    return optimise(model, measure(nodes, model, progress, work.prompt_tokens), work)

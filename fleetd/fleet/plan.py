"""`fleetctl plan`'s computation: what a GGUF needs per layer, the cost model, the placement.

No I/O besides reading the GGUF (fleetd/fleet/plan_probe.py measures the nodes). How the pinned
llama.cpp (0.3.36) places a model split over RPC devices (`src/llama-model.cpp`, load_tensors):

- `token_embd` is the input layer: always on the coordinator's CPU, never on a node.
- With every layer offloaded (`-ngl` above the layer count) the n_layer repeating layers and the
  output layer (`output.weight`, `output_norm`; a copy of `token_embd` when the output is tied)
  are n_layer + 1 slots; slot `il` goes to the first device whose cumulative share of
  `--tensor-split` is above il / (n_layer + 1). So the split "c0,c1,...,c_last + 1" in `--rpc`
  order gives device d exactly c_d layers and the last device the output layer (`tensor_split`).
- The KV cache of a layer lives on that layer's device (`llama_kv_cache`: per layer a K tensor of
  n_embd_k_gqa x cells and a V tensor of n_embd_v_gqa x cells, f16 by default). The cells are
  `-c` padded to 256; with `-np N` and a per-sequence cache each sequence's share is padded to
  256 again (`llama_context`), so cells = N * pad(pad(c, 256) / N, 256).
- Every tensor in a device's buffer is padded to the device's alignment.

The compute buffer is estimated, not derived: see `compute_buffer_bytes`.

The cost model (per token, seconds; every term measured on the fleet by plan_probe):

- a node's layers: the layers' matrices (MUL_MAT over the layer's own weight shapes and type)
  plus the rest of a llama layer's graph per layer (norms, rope, the new K/V into the cache,
  flash attention, SwiGLU, the residual adds). Decode at the node's full speed, from its burst
  profile (one token through 1 and 2 layers' matrices in one graph after an idle gap), and at
  most its share of the step: a node under a CPU quota or sharing its core runs a short stage
  at full speed but computes at most share x the step, the share being its full speed over its
  back-to-back rate (`share_bound`). The prompt: a batch, per token and layer, back to back.
  The last node adds the output matrix;
- per node and step, its commands: the probe times what the client sends a node per token
  (STEP_SETS small SET_TENSORs, the GRAPH_RECOMPUTE with one graph's dispatch, the GET_TENSOR
  that waits), `step_s`, after an idle gap as a node in a pipeline has; one round trip where it
  was not measured; and the positions and attention mask (`step_input_bytes`) over its
  coordinator link;
- the client's waits: `step_s` ends in a round trip, but in a step the client waits only where
  a result must come back before it can go on: the GET of the last node's logits, and per
  boundary the GET from the source (hub) or the synchronous copy's answer. So each node counts
  its step less its round trip, and the waits are added where they are;
- the input (n_embd f32 per token) coordinator -> first node, the logits (n_vocab f32 per output
  token) last node -> coordinator;
- per boundary the hidden state (n_embd f32 per token): hub = the source's round trip (its GET)
  and the bytes down from it and up to the destination (the SET needs no answer); synchronous
  direct = one COPY_TENSOR_TO as measured from the client; asynchronous direct with the gate
  (both ends advertise bits 1 and 2) = one push over the peer link, no wait of the client: half
  the peer round trip (the measured copy less the client's round trip to the source) and the
  bytes at the peer rate. The hub cost where the peer copy was refused or not measured.

The matrices alone, one step a round trip, predicted ~2x the decode t/s measured in the lab
(benchmarks/plan_lab.py): the per-graph dispatch and the step's commands were missing. Then,
with the gate in C (issue 20), a round trip per node and two per boundary predicted 0.59-0.95x
the decode t/s measured: the client waits once per step on the gated direct path.

Stages run one after the other (a single sequence's decode does; the prompt's micro-batch
overlap on the asynchronous direct path is not modelled, so the direct prompt t/s is a lower
bound). The optimiser minimises the time of one request on the direct path (a micro-batch of
prompt and REQUEST_GEN_TOKENS generated), over every order of every subset of the nodes (<= 6
nodes; more keep the file's order) with a DP over contiguous layer ranges, subject to memory:
weights + KV + compute buffer <= free x (1 - MEMORY_MARGIN) - MEMORY_MARGIN_BYTES on every
node. llama.cpp's default split (by free memory, the file's order) is kept when it fits and the
best is not predicted more than KEEP_DEFAULT_MARGIN faster: the plan moves off the default only
for a gain beyond the noise.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf

PLAN_VERSION = 1
KV_CELL_PAD = 256  # llama_context pads n_ctx (and each sequence's share) to this
KV_TYPE_BYTES = 2  # f16 K and V, llama.cpp's default cache type
F32 = 4
DEFAULT_UBATCH = 512  # llama.cpp's -ub default: the prompt goes through in micro-batches of this
MEMORY_MARGIN = 0.05  # of a node's free memory, kept free
MEMORY_MARGIN_BYTES = 4 << 20  # and this much besides (allocator slack, the daemon's own buffers)
MAX_ORDERED_NODES = 6  # exhaustive search over orders up to this many nodes
# A node's bursts this much faster than back to back or less are noise and cache, not a share:
# three equal nodes of a lab measured 0.68-0.95 (and were predicted 1.29-1.35x the decode they
# ran when costed at that speed); a 0.3-core quota measures 0.27-0.30.
SHARED_BELOW = 0.6
REQUEST_GEN_TOKENS = 128  # the request the optimiser times: a micro-batch of prompt, then these
# llama.cpp's default split (by free memory) is kept unless the best placement is predicted
# faster by more than this: identical nodes measure up to ~30% apart per layer on a shared
# 2-core machine, and a split chasing that noise lost to the default in the lab (at 0.05, three
# equal nodes got [5, 2, 5] for a predicted 7% gain and ran 0.96x the default's decode; unequal
# nodes are predicted 20-40% ahead).
KEEP_DEFAULT_MARGIN = 0.15
DEFAULT_ALIGNMENT = 32  # ggml's CPU buffer alignment, what fleetd and the stock server report
# What the pinned client sends each node per step besides the hidden state: a handful of
# SET_TENSORs (positions, the attention mask, output ids; the first node its inputs), one
# GRAPH_RECOMPUTE and the read that waits for it. The probe times this sequence (step_s).
STEP_SETS = 6
MASK_BYTES = 2  # f16 attention mask per cell and token

# The compute buffer, calibrated against what the pinned llama-completion logs ("RPC0[...]
# compute buffer size"; flash attention left at the tools' "auto": the sizes show no n_head x
# cells score matrix) for fleetd.models' llama models over 2-3 fleetd nodes: n_embd 256-1024, n_ff
# 512-1536, 512-8192 cells, 1-4 sequences. Per device, for U = min(ubatch, cells) tokens:
#   f32 x U x (4 n_embd + 4 n_ff + 2 max(0, n_embd - n_head x head_dim))   the live activations
#   + 8 bytes x U x cells per sequence        the attention mask and its f16 copy per stream
#   + COMPUTE_SLACK                           graph inputs (positions, output ids)
#   + on the last device f32 x n_vocab x n_seq  the logits of one token per sequence
# Measured 8.04-48.05 MiB over nine shapes; the formula is within +0.1% of eight of them and 6%
# above one (n_embd 512, 512 cells: 17.04 MiB), never below (it sizes a reservation).
# That is the pipelined split (2+ devices: llama.cpp's scheduler keeps copies of each split's
# inputs per micro-batch in flight). One device alone is not pipelined and reuses far more:
#   f32 x U x (3 n_embd + 3 n_ff) + 2 bytes x U x cells per sequence (the f16 mask only)
#   + COMPUTE_SLACK + the logits
# Measured 5.01-69.0 MiB over four shapes (n_embd 256-2048, n_ff 512-11264, 512-2048 cells, 1-4
# sequences): exact on two, 1-3% above on n_ff 11264 and 17-19% above on n_embd 2048 with a
# narrow attention (n_head x head_dim 256), never below.
# tests/test_plan.py checks both against llama-completion when the tools are built.
COMPUTE_SLACK = 64 << 10
COMPUTE_TOLERANCE = 0.10  # the tests' bound on (predicted - reported) / reported


class PlanError(ValueError):
    """A model `plan` cannot read (not a GGUF, no layers, an unknown shape)."""


@dataclass(frozen=True)
class Matrix:
    """One weight matrix: ggml ne (k inputs, n outputs) and its ggml type, as the probe builds it."""

    name: str
    type: int
    k: int
    n: int
    nbytes: int


@dataclass(frozen=True)
class ModelSizes:
    """What a GGUF needs: its shape, the bytes of each layer, the input and output layers, and the
    matrices of one layer and of the output (what the compute probe multiplies)."""

    path: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    sliding_window: int
    layer_tensors: tuple[tuple[int, ...], ...]  # per layer, each tensor's bytes
    input_bytes: int  # token_embd: the coordinator's
    output_tensors: tuple[int, ...]  # output.weight (or the tied token_embd copy), output_norm
    layer_matrices: tuple[Matrix, ...]
    output_matrix: Matrix | None

    def layer_bytes(self, layer: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
        return sum(padded(b, alignment) for b in self.layer_tensors[layer])

    def output_bytes(self, alignment: int = DEFAULT_ALIGNMENT) -> int:
        return sum(padded(b, alignment) for b in self.output_tensors)

    @property
    def hidden_bytes(self) -> int:
        """The hidden state one token carries across a stage boundary (f32)."""
        return self.n_embd * F32

    @property
    def ffn_fraction(self) -> float:
        """The share of a layer's matrix bytes in its feed-forward (ffn_*) matrices: of its
        prompt matrix time too, a batch's matmul costing about its weights times its rows."""
        total = sum(m.nbytes for m in self.layer_matrices)
        ffn = sum(m.nbytes for m in self.layer_matrices if m.name.startswith("ffn_"))
        return ffn / total if total else 0.0


def padded(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise PlanError(f"{key}: not in the GGUF")
        return default
    return f.contents()


def _matrix(t) -> Matrix:
    k, n = int(t.shape[0]), int(math.prod(int(x) for x in t.shape[1:]))
    return Matrix(t.name.split(".", 2)[-1].removesuffix(".weight"), int(t.tensor_type), k, n, int(t.n_bytes))


def read_model(path: str | Path) -> ModelSizes:
    """The sizes `plan` needs, from the GGUF's metadata and tensor table (no tensor is read)."""
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise PlanError(f"{path}: not a GGUF file: {exc}") from exc
    arch = str(_field(reader, "general.architecture"))
    n_layer = int(_field(reader, f"{arch}.block_count"))
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_head_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    head_k = int(_field(reader, f"{arch}.attention.key_length", n_embd // n_head))
    head_v = int(_field(reader, f"{arch}.attention.value_length", head_k))
    layers: list[list[int]] = [[] for _ in range(n_layer)]
    named = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            index = int(t.name.split(".")[1])
            if not 0 <= index < n_layer:
                raise PlanError(f"{path}: tensor {t.name} is past the {n_layer} layers")
            layers[index].append(int(t.n_bytes))
    if n_layer == 0 or not all(layers):
        raise PlanError(f"{path}: no repeating layers (blk.N.*) to split")
    embd = named.get("token_embd.weight")
    out = named.get("output.weight", embd)  # tied: llama.cpp duplicates token_embd on the output device
    if out is None:
        raise PlanError(f"{path}: neither output.weight nor token_embd.weight")
    output = [int(out.n_bytes)] + [int(named[n].n_bytes) for n in ("output_norm.weight",) if n in named]
    first = sorted((t for t in reader.tensors if t.name.startswith("blk.0.")), key=lambda t: t.name)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return ModelSizes(
        path=str(path),
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_k,
        head_dim_v=head_v,
        n_ff=int(_field(reader, f"{arch}.feed_forward_length", 4 * n_embd)),
        n_vocab=len(tokens.data) if tokens is not None else int(out.shape[1]),
        n_ctx_train=int(_field(reader, f"{arch}.context_length", 0)),
        sliding_window=int(_field(reader, f"{arch}.attention.sliding_window", 0)),
        layer_tensors=tuple(tuple(b) for b in layers),
        input_bytes=int(embd.n_bytes) if embd is not None else 0,
        output_tensors=tuple(output),
        layer_matrices=tuple(_matrix(t) for t in first if len(t.shape) >= 2 and t.shape[1] > 1),
        output_matrix=_matrix(out),
    )


# -- memory ---------------------------------------------------------------------------------------


def kv_cells(ctx: int, parallel: int) -> int:
    """The KV cells llama_context makes for `-c ctx -np parallel` (a cache per sequence)."""
    total = padded(ctx, KV_CELL_PAD)
    return parallel * padded(total // parallel, KV_CELL_PAD)


def kv_bytes_per_layer(model: ModelSizes, cells: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    k = cells * model.n_head_kv * model.head_dim_k * KV_TYPE_BYTES
    v = cells * model.n_head_kv * model.head_dim_v * KV_TYPE_BYTES
    return padded(k, alignment) + padded(v, alignment)


def compute_buffer_bytes(
    model: ModelSizes,
    cells: int,
    last: bool,
    ubatch: int = DEFAULT_UBATCH,
    parallel: int = 1,
    devices: int = 2,
) -> int:
    """The estimated compute buffer of one of `devices` devices (the formulas above
    COMPUTE_SLACK: one for a device alone, one for a pipelined split)."""
    tokens = min(ubatch, cells)
    per_sequence = cells // max(1, parallel)
    logits = F32 * model.n_vocab * parallel if last else 0
    if devices == 1:
        activations = F32 * tokens * (3 * model.n_embd + 3 * model.n_ff)
        return activations + 2 * tokens * per_sequence + COMPUTE_SLACK + logits
    narrower_q = max(0, model.n_embd - model.n_head * model.head_dim_k)
    activations = F32 * tokens * (4 * model.n_embd + 4 * model.n_ff + 2 * narrower_q)
    return activations + 8 * tokens * per_sequence + COMPUTE_SLACK + logits


@dataclass(frozen=True)
class StageMemory:
    """What one node will hold (bytes) against what it has free."""

    weights: int
    kv: int
    compute: int
    free: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    @property
    def usable(self) -> int:
        return usable_memory(self.free)


def usable_memory(free: int) -> int:
    return max(0, int(free * (1 - MEMORY_MARGIN)) - MEMORY_MARGIN_BYTES)


# -- what the probe measured -----------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """A measured path: seconds for a round trip of nothing, bytes per second beyond it."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class NodeFacts:
    """One node as measured: memory, device kind, compute times and its coordinator link.

    `decode_layer_s`: one token through one layer's matrices; `prompt_token_s`: per token of a
    batch; `output_*`: the same for the output matrix (on the last node)."""

    name: str
    endpoint: str
    free: int
    total: int
    kind: str
    alignment: int
    peer_copy: bool  # bit 0: the synchronous COPY_TENSOR_TO
    decode_layer_s: float
    prompt_token_s: float
    output_decode_s: float
    output_prompt_s: float
    upload: Link  # coordinator -> node (SET_TENSOR)
    download: Link  # node -> coordinator (GET_TENSOR)
    # One decode step's commands on the node (STEP_SETS SET_TENSORs, a GRAPH_RECOMPUTE, the
    # GET_TENSOR that waits for it); 0: not measured, one round trip (upload.latency_s) stands in.
    step_s: float = 0.0
    graph_s: float = 0.0  # one graph's dispatch besides its ops (in step_s, not in the layers)
    decode_matmul_s: float = 0.0  # the layer's matrices alone (decode_layer_s adds its other ops)
    prompt_matmul_s: float = 0.0
    peer_gate: bool = False  # bits 1 and 2: the asynchronous copy the client does not wait for
    # ((layers, seconds), ...): that many layers' matrices in one graph after an idle gap, as a
    # pipeline's node computes its stage (a node may be faster in a burst than back to back);
    # empty: not measured, decode_matmul_s per layer
    decode_profile: tuple[tuple[int, float], ...] = ()

    @property
    def round_trip_s(self) -> float:
        return self.upload.latency_s


@dataclass(frozen=True)
class Fleet:
    """The measured nodes and the peer links between them ((source, destination) index pairs;
    None where the peer copy was refused or not tried)."""

    nodes: tuple[NodeFacts, ...]
    peers: dict[tuple[int, int], Link | None] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


# -- the cost model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The context and sequences the plan sizes for, and the tokens a prompt step carries."""

    ctx: int = 4096
    parallel: int = 1
    ubatch: int = DEFAULT_UBATCH

    @property
    def cells(self) -> int:
        return kv_cells(self.ctx, self.parallel)

    @property
    def prompt_tokens(self) -> int:
        return min(self.ubatch, self.cells)


def boundary_seconds(fleet: Fleet, a: int, b: int, nbytes: float, direct: bool) -> float:
    """Moving `nbytes` of hidden state from node a to node b, with the client's wait it costs:
    over the peer link when `direct` and measured (a push nobody waits for when both ends have
    the gate, else the synchronous copy's round trip from the client), else through the
    coordinator (the GET from a waits for its round trip; the SET to b does not)."""
    src, dst = fleet.nodes[a], fleet.nodes[b]
    peer = fleet.peers.get((a, b)) if direct else None
    if peer is None:
        return src.download.seconds(nbytes) + nbytes / dst.upload.bytes_per_s
    if src.peer_gate and dst.peer_gate:
        return max(0.0, peer.latency_s - src.round_trip_s) / 2 + nbytes / peer.bytes_per_s
    return peer.seconds(nbytes)


def step_input_bytes(tokens: int) -> int:
    """What every node of the split gets from the coordinator per step besides the hidden state:
    the positions (i32) and the attention mask (cells padded to 256 by tokens; f16, as flash
    attention takes it: cast once, then copied to every node)."""
    return 4 * tokens + MASK_BYTES * padded(tokens, KV_CELL_PAD) * tokens


def step_seconds(node: NodeFacts) -> float:
    """A node's per-step command overhead, less the round trip it ends in (the client's waits
    are counted where they are): measured (step_s), else nothing beyond that round trip."""
    return max(0.0, node.step_s - node.round_trip_s) if node.step_s > 0 else 0.0


def fixed_seconds(model: ModelSizes, fleet: Fleet, order: Sequence[int], tokens: int, direct: bool) -> float:
    """One step's time that does not depend on the layer counts: each node's step (its commands,
    the positions and mask), the input, the boundaries, the output matrix and the logits."""
    nodes = fleet.nodes
    first, last = nodes[order[0]], nodes[order[-1]]
    hidden = model.hidden_bytes * tokens
    outputs = tokens if tokens == 1 else 1  # decode: every token's logits; a prompt: the last one's
    t = sum(step_seconds(nodes[i]) + step_input_bytes(tokens) / nodes[i].upload.bytes_per_s for i in order)
    t += hidden / first.upload.bytes_per_s
    t += sum(boundary_seconds(fleet, a, b, hidden, direct) for a, b in itertools.pairwise(order))
    # llama.cpp multiplies only the output tokens' rows by the output matrix (a prompt: the last)
    t += output_seconds(last, outputs, tokens == 1)
    t -= last_layer_saving(model, last, tokens, outputs)
    t += last.download.seconds(model.n_vocab * F32 * outputs)  # the one wait every step has
    return t


def last_layer_saving(model: ModelSizes, node: NodeFacts, tokens: int, outputs: int) -> float:
    """What the last layer does not compute of a prompt's micro-batch: llama.cpp's graphs keep
    only the output tokens' rows after the last layer's attention (inp_out_ids), so its
    feed-forward matrices run for those alone. Counted as a whole layer, a plan that gave a
    0.15-core node the last layer only was predicted at 0.65-0.71x the prompt t/s it ran, the
    same counts with that node first at 0.98-1.05x."""
    if tokens <= outputs:
        return 0.0
    matmul = node.prompt_matmul_s or node.prompt_token_s
    return matmul * model.ffn_fraction * (tokens - outputs)


def decode_seconds(node: NodeFacts, layers: int) -> float:
    """One token through `layers` layers on the node, its matrices and their other ops, at the
    node's full speed (`full_speed`): what its stage takes while it is within its share."""
    if layers <= 0:
        return 0.0
    if not node.decode_profile or not node.decode_matmul_s:
        return layers * node.decode_layer_s
    full, share = full_speed(node)
    ops = max(0.0, node.decode_layer_s - node.decode_matmul_s)
    return layers * (full + ops * share)  # the ops were timed back to back too


def full_speed(node: NodeFacts) -> tuple[float, float]:
    """(seconds a layer's matrices take at full speed, the node's share of a core): full speed
    is the faster of its burst profile's 1- and 2-layer points per layer, never slower than
    back to back; the share is full speed over the back-to-back rate (1: a node of its own;
    0.3: a 0.3-core quota, or about 0.5 sharing its core with a busy process). Without a
    profile, or with bursts less than 1 / SHARED_BELOW faster: back to back, a share of 1."""
    points = [(int(n), float(t)) for n, t in node.decode_profile if 0 < int(n) <= 2]
    if not points or not node.decode_matmul_s:
        return node.decode_matmul_s or node.decode_layer_s, 1.0
    full = min(min(t / n for n, t in points), node.decode_matmul_s)
    if full / node.decode_matmul_s > SHARED_BELOW:
        return node.decode_matmul_s, 1.0
    return full, full / node.decode_matmul_s


def stage_seconds(node: NodeFacts, layers: int, tokens: int) -> float:
    """A node's `layers` layers for one step of `tokens` tokens (decode: one)."""
    return decode_seconds(node, layers) if tokens == 1 else node.prompt_token_s * tokens * layers


@dataclass(frozen=True)
class Speeds:
    """Predicted tokens per second: prompt and decode, through the coordinator and direct."""

    prompt_hub: float
    decode_hub: float
    prompt_direct: float
    decode_direct: float


def predict(
    model: ModelSizes, fleet: Fleet, order: Sequence[int], counts: Sequence[int], work: Workload
) -> Speeds:
    def step(tokens: int, direct: bool) -> float:
        layers = sum(stage_seconds(fleet.nodes[i], c, tokens) for i, c in zip(order, counts))
        total = layers + fixed_seconds(model, fleet, order, tokens, direct)
        return max(total, share_bound(model, fleet, order, counts)) if tokens == 1 else total

    pp = work.prompt_tokens
    return Speeds(
        prompt_hub=pp / step(pp, False),
        decode_hub=1 / step(1, False),
        prompt_direct=pp / step(pp, True),
        decode_direct=1 / step(1, True),
    )


def share_bound(model: ModelSizes, fleet: Fleet, order: Sequence[int], counts: Sequence[int]) -> float:
    """The shortest decode step the nodes' shares allow: a node with a share q of a core
    computes at most q x the step (its stage at full speed, the output matrix on the last),
    whatever the others do. Below the pipeline's sum in every lab run so far, except where a
    slow node holds many layers."""
    bound = 0.0
    for pos, (i, c) in enumerate(zip(order, counts)):
        node = fleet.nodes[i]
        _, share = full_speed(node)
        busy = decode_seconds(node, c) + (output_seconds(node, 1, True) if pos == len(order) - 1 else 0.0)
        bound = max(bound, busy / share)
    return bound


def output_seconds(node: NodeFacts, rows: int, decode: bool) -> float:
    """The output matrix for `rows` output rows on the node: at full speed in a decode step's
    burst, back to back after a prompt's micro-batch."""
    return node.output_decode_s * rows * (full_speed(node)[1] if decode else 1.0)


def objective_seconds(model, fleet, order, counts, work: Workload) -> float:
    """What the optimiser minimises, on the direct path: one request of a micro-batch of
    prompt and REQUEST_GEN_TOKENS generated tokens (llama-bench's pp512 tg128 by default).
    One prompt token plus one generated token weighed a prompt token at a sixth of a decode
    token's time: a 1.5x faster prompt moved the sum by 9%, under KEEP_DEFAULT_MARGIN."""
    s = predict(model, fleet, order, counts, work)
    return work.prompt_tokens / s.prompt_direct + REQUEST_GEN_TOKENS / s.decode_direct


# -- the placement ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One node of the plan: which layers it holds and its memory."""

    node: int
    name: str
    endpoint: str
    first_layer: int
    layers: int
    output: bool
    memory: StageMemory


@dataclass(frozen=True)
class Plan:
    """A placement: the stages in `--rpc` order, the flags for llama.cpp and the predicted speeds."""

    model: ModelSizes
    work: Workload
    stages: tuple[Stage, ...]
    speeds: Speeds
    unused: tuple[str, ...]
    notes: tuple[str, ...]
    measured: Fleet

    @property
    def rpc(self) -> str:
        return ",".join(s.endpoint for s in self.stages)

    @property
    def tensor_split(self) -> str:
        return tensor_split([s.layers for s in self.stages])

    def llama_args(self) -> list[str]:
        """The flags that load this plan in the pinned llama.cpp tools."""
        return [
            "--rpc",
            self.rpc,
            "-ngl",
            str(self.model.n_layer + 1),
            "-sm",
            "layer",
            "--tensor-split",
            self.tensor_split,
            "-c",
            str(self.work.ctx),
            "-np",
            str(self.work.parallel),
        ]

    def as_dict(self) -> dict:
        """The plan file (`--json`): versioned, everything a later `stage`/`serve` needs."""
        m = self.model
        return {
            "version": PLAN_VERSION,
            "fits": True,
            "model": {
                "path": m.path,
                "arch": m.arch,
                "n_layer": m.n_layer,
                "n_embd": m.n_embd,
                "n_vocab": m.n_vocab,
                "input_bytes": m.input_bytes,
            },
            "ctx": self.work.ctx,
            "parallel": self.work.parallel,
            "kv_cells": self.work.cells,
            "rpc": self.rpc,
            "tensor_split": self.tensor_split,
            "overrides": [],
            "llama_args": self.llama_args(),
            "stages": [
                {
                    "name": s.name,
                    "endpoint": s.endpoint,
                    "layers": [s.first_layer, s.first_layer + s.layers],
                    "layer_count": s.layers,
                    "output": s.output,
                    "memory": dict(asdict(s.memory), total=s.memory.total, usable=s.memory.usable),
                }
                for s in self.stages
            ],
            "unused": list(self.unused),
            "predicted": asdict(self.speeds),
            "measured": measured_dict(self.measured),
            "memory_margin": {"fraction": MEMORY_MARGIN, "bytes": MEMORY_MARGIN_BYTES},
            "notes": list(self.notes),
        }


def measured_dict(fleet: Fleet) -> dict:
    """What the probe measured, as the plan file keeps it (links as latency and bytes/s)."""
    names = [n.name for n in fleet.nodes]
    return {
        "nodes": [asdict(n) for n in fleet.nodes],
        "peers": [
            {"from": names[a], "to": names[b], "link": asdict(link) if link else None}
            for (a, b), link in sorted(fleet.peers.items())
        ],
        "notes": list(fleet.notes),
    }


def tensor_split(counts: Sequence[int]) -> str:
    """`--tensor-split` giving device d exactly counts[d] layers and the last the output layer
    (proportions; llama.cpp cuts at cumulative share > il / (n_layer + 1))."""
    return ",".join(str(c + (1 if d == len(counts) - 1 else 0)) for d, c in enumerate(counts))


def layers_from_split(split: Sequence[float], n_layer: int) -> list[int]:
    """The layer counts llama.cpp's load_tensors gives each device for `split` (the output slot
    not counted): the inverse of `tensor_split`, for tests and for checking a plan file."""
    total = sum(split)
    cumulative = list(itertools.accumulate(s / total for s in split))
    counts = [0] * len(split)
    for il in range(n_layer):
        counts[next(d for d, c in enumerate(cumulative) if c > il / (n_layer + 1))] += 1
    return counts


class DoesNotFit(PlanError):
    """No placement fits: `shortfalls` maps a node to the bytes it lacks in the closest plan."""

    def __init__(self, message: str, shortfalls: dict[str, int]) -> None:
        super().__init__(message)
        self.shortfalls = shortfalls


def stage_memory(
    model: ModelSizes, node: NodeFacts, layers: range, last: bool, work: Workload, devices: int
) -> StageMemory:
    align = node.alignment
    weights = sum(model.layer_bytes(il, align) for il in layers) + (model.output_bytes(align) if last else 0)
    return StageMemory(
        weights=weights,
        kv=len(layers) * kv_bytes_per_layer(model, work.cells, align),
        compute=compute_buffer_bytes(model, work.cells, last, work.ubatch, work.parallel, devices),
        free=node.free,
    )


def _orders(count: int) -> list[tuple[int, ...]]:
    if count > MAX_ORDERED_NODES:  # the nodes file's order, all of them
        return [tuple(range(count))]
    return [p for size in range(1, count + 1) for p in itertools.permutations(range(count), size)]


def _best_counts(model, fleet, order, work) -> tuple[float, list[int]] | None:
    """The cheapest layer counts (each >= 1) for this order under memory; None if none fits.
    A DP over (position, layers placed); the layer cost is linear in the count per node. The
    share bound (a max over the nodes, not a sum) is not in it: it only binds where a slow node
    holds many layers, which the prompt's back-to-back cost already steers away from, and each
    order's counts are then compared by the whole prediction (objective_seconds)."""
    n = model.n_layer
    best = [math.inf] * (n + 1)
    best[0] = 0.0
    choice: list[list[int]] = []
    for pos, i in enumerate(order):
        node, last = fleet.nodes[i], pos == len(order) - 1
        per_layer = REQUEST_GEN_TOKENS * decode_seconds(node, 1) + work.prompt_tokens * node.prompt_token_s
        prefix = _weight_prefix(model, node.alignment)
        kv = kv_bytes_per_layer(model, work.cells, node.alignment)
        room = usable_memory(node.free) - compute_buffer_bytes(
            model, work.cells, last, work.ubatch, work.parallel, len(order)
        )
        room -= model.output_bytes(node.alignment) if last else 0
        nxt, took = [math.inf] * (n + 1), [0] * (n + 1)
        stop_max = n - (len(order) - pos - 1)
        for start in range(n):
            if best[start] == math.inf:
                continue
            for stop in [n] if last else range(start + 1, stop_max + 1):
                if prefix[stop] - prefix[start] + (stop - start) * kv > room:
                    break
                cost = best[start] + (stop - start) * per_layer
                if cost < nxt[stop]:
                    nxt[stop], took[stop] = cost, stop - start
        best = nxt
        choice.append(took)
    if best[n] == math.inf:
        return None
    counts, at = [], n
    for took in reversed(choice):
        counts.append(took[at])
        at -= took[at]
    counts.reverse()
    return best[n], counts


def _weight_prefix(model: ModelSizes, alignment: int) -> list[int]:
    return list(
        itertools.accumulate((model.layer_bytes(il, alignment) for il in range(model.n_layer)), initial=0)
    )


def _uniform_layers(model: ModelSizes) -> bool:
    return len(set(model.layer_tensors)) == 1


def optimise(model: ModelSizes, fleet: Fleet, work: Workload) -> Plan:
    """The placement with the smallest objective_seconds that fits; DoesNotFit names each node's
    shortfall in the even split over all nodes when nothing fits."""
    if not fleet.nodes:
        raise PlanError("no nodes to plan for")
    found: tuple[float, tuple[int, ...], list[int]] | None = None
    # Equal layers: the counts depend on which nodes and which is last, not on the order between.
    shared: dict[tuple, dict[int, int] | None] = {}
    for order in _orders(len(fleet.nodes)):
        if len(order) > model.n_layer:
            continue
        key = (tuple(sorted(order[:-1])), order[-1]) if _uniform_layers(model) else order
        if key not in shared:
            result = _best_counts(model, fleet, order, work)
            shared[key] = None if result is None else dict(zip(order, result[1]))
        by_node = shared[key]
        if by_node is None:
            continue
        counts = [by_node[i] for i in order]
        total = objective_seconds(model, fleet, order, counts, work)
        if found is None or total < found[0]:
            found = (total, order, counts)
    if found is None:
        raise _does_not_fit(model, fleet, work)
    _, order, counts = found
    default = _default_split(model, fleet, work)
    if default is not None:
        d_order, d_counts = default
        d_total = objective_seconds(model, fleet, d_order, d_counts, work)
        if d_total <= found[0] * (1 + KEEP_DEFAULT_MARGIN):
            order, counts = d_order, d_counts
    return _plan(model, fleet, work, order, counts)


def _default_split(model: ModelSizes, fleet: Fleet, work: Workload) -> tuple[list[int], list[int]] | None:
    """llama.cpp's own split when no --tensor-split is given (by each node's free memory, in
    the nodes file's order; nodes it gives no layer are left out), if it fits; else None."""
    counts = layers_from_split([max(n.free, 1) for n in fleet.nodes], model.n_layer)
    order = [i for i, c in enumerate(counts) if c > 0]
    start = 0
    for pos, i in enumerate(order):
        memory = stage_memory(
            model, fleet.nodes[i], range(start, start + counts[i]), pos == len(order) - 1, work, len(order)
        )
        if memory.total > memory.usable:
            return None
        start += counts[i]
    return order, [counts[i] for i in order]


def _plan(model, fleet: Fleet, work: Workload, order, counts) -> Plan:
    stages, start = [], 0
    for pos, (i, c) in enumerate(zip(order, counts)):
        node, last = fleet.nodes[i], pos == len(order) - 1
        memory = stage_memory(model, node, range(start, start + c), last, work, len(order))
        stages.append(Stage(i, node.name, node.endpoint, start, c, last, memory))
        start += c
    notes = list(fleet.notes)
    if model.sliding_window:
        notes.append("sliding-window layers are sized with the full context (an overestimate)")
    if len(fleet.nodes) > MAX_ORDERED_NODES:
        notes.append(f"more than {MAX_ORDERED_NODES} nodes: the nodes file's order, every node used")
    unused = tuple(n.name for i, n in enumerate(fleet.nodes) if i not in order)
    speeds = predict(model, fleet, order, counts, work)
    return Plan(model, work, tuple(stages), speeds, unused, tuple(notes), fleet)


def split_plan(
    model: ModelSizes, fleet: Fleet, work: Workload, order: Sequence[int], counts: Sequence[int]
) -> Plan:
    """The plan of a split given by hand (`order`: node indices, `counts`: layers each, in
    order), with its memory and predicted speed, as optimise would describe it; not checked
    against the nodes' memory (the stages' `memory` says whether it fits)."""
    if len(order) != len(counts) or len(set(order)) != len(order) or not order:
        raise PlanError(f"split: {len(order)} distinct nodes wanted for {len(counts)} counts")
    if any(c < 1 for c in counts) or sum(counts) != model.n_layer:
        raise PlanError(f"split: counts {list(counts)} must each be >= 1 and add up to {model.n_layer}")
    if not all(0 <= i < len(fleet.nodes) for i in order):
        raise PlanError(f"split: node index out of 0..{len(fleet.nodes) - 1}")
    return _plan(model, fleet, work, list(order), list(counts))


def even_counts(n_layer: int, nodes: int) -> list[int]:
    """llama.cpp's split for equal shares."""
    return layers_from_split([1.0] * nodes, n_layer)


def _does_not_fit(model: ModelSizes, fleet: Fleet, work: Workload) -> DoesNotFit:
    """The shortfall per node of the split by free memory (llama.cpp's default), the closest
    thing to a fit there is; and the total shortfall."""
    nodes = fleet.nodes
    counts = layers_from_split([max(n.free, 1) for n in nodes], model.n_layer)
    shortfalls, start = {}, 0
    for pos, (node, c) in enumerate(zip(nodes, counts)):
        memory = stage_memory(model, node, range(start, start + c), pos == len(nodes) - 1, work, len(nodes))
        start += c
        if memory.total > memory.usable:
            shortfalls[node.name] = memory.total - memory.usable
    need = sum(model.layer_bytes(il) for il in range(model.n_layer)) + model.output_bytes()
    need += model.n_layer * kv_bytes_per_layer(model, work.cells)
    need += sum(
        compute_buffer_bytes(model, work.cells, i == len(nodes) - 1, work.ubatch, work.parallel, len(nodes))
        for i in range(len(nodes))
    )
    have = sum(usable_memory(n.free) for n in nodes)
    where = ", ".join(f"{name} short by {fmt_mib(b)}" for name, b in shortfalls.items()) or "no single split"
    return DoesNotFit(
        f"{Path(model.path).name} does not fit: needs {fmt_mib(need)}, the nodes have "
        f"{fmt_mib(have)} usable ({fmt_mib(max(0, need - have))} short in total; split by free "
        f"memory: {where})",
        shortfalls or {n.name: 0 for n in nodes},
    )


def fmt_mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"

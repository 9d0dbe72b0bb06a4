"""The synthetic workload: layers of RMS_NORM, MUL (norm weight), MUL_MAT (n_embd x n_embd), ADD
(residual) over a hidden state of rows x n_embd f32, with seeded weights and inputs.

Each stage keeps everything in one buffer laid out by `StageLayout`: per layer its norm weight and
matrix, then the stage's input hidden state, then per layer four activations. The last layer's
residual sum is the stage's output, which the next stage receives into its input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from fleetd.client.graph import GraphBuilder, Tensor
from fleetd.wire import GgmlType, GraphCompute

RMS_EPS = 1e-6
F32 = 4


@dataclass(frozen=True)
class Workload:
    """The synthetic model: layer count, hidden state shape and the seed of every weight and input."""

    layers: int
    rows: int = 32
    n_embd: int = 5120
    seed: int = 0

    @property
    def hidden_bytes(self) -> int:
        return self.rows * self.n_embd * F32

    def norm_weight(self, layer: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1, layer])
        return (1.0 + 0.1 * rng.standard_normal(self.n_embd, dtype=np.float32)).astype(np.float32)

    def matrix(self, layer: int) -> np.ndarray:
        """(n_embd out, n_embd in): ggml's ne = (in, out), rows of `in` contiguous."""
        rng = np.random.default_rng([self.seed, 2, layer])
        w = rng.standard_normal((self.n_embd, self.n_embd), dtype=np.float32)
        w *= np.float32(1.0 / np.sqrt(self.n_embd))
        return w

    def hidden_input(self, step: int) -> np.ndarray:
        """The "embeddings" the coordinator sends to the first stage at `step`."""
        rng = np.random.default_rng([self.seed, 3, step])
        return rng.standard_normal((self.rows, self.n_embd), dtype=np.float32)

    def split(self, stages: int) -> list[range]:
        """Layers per stage, as even as possible (`--tensor-split 1,1,...`)."""
        if not 0 < stages <= self.layers:
            raise ValueError(f"{self.layers} layers cannot be split over {stages} stages")
        bounds = [round(i * self.layers / stages) for i in range(stages + 1)]
        return [range(bounds[i], bounds[i + 1]) for i in range(stages)]


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass
class StageLayout:
    """Byte offsets inside a stage's one buffer."""

    weights: dict[int, tuple[int, int]] = field(default_factory=dict)  # layer -> (norm, matrix)
    hidden_in: int = 0
    activations: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    size: int = 0


def layout_stage(work: Workload, layers: range, alignment: int) -> StageLayout:
    """The offsets of a stage's layers, input and activations in its one buffer, each aligned."""
    lay = StageLayout()
    at = 0

    def take(nbytes: int) -> int:
        nonlocal at
        off = at
        at = _align(at + nbytes, alignment)
        return off

    for layer in layers:
        lay.weights[layer] = (take(work.n_embd * F32), take(work.n_embd * work.n_embd * F32))
    lay.hidden_in = take(work.hidden_bytes)
    for layer in layers:
        lay.activations[layer] = tuple(take(work.hidden_bytes) for _ in range(4))
    lay.size = max(at, alignment)
    return lay


@dataclass
class StageGraph:
    """A stage's graph, its input and output tensors, and the weights still to upload."""

    graph: GraphCompute
    hidden_in: Tensor
    hidden_out: Tensor
    # Tensors and how to make their values (made at upload time, one at a time: a 5120 x 5120
    # matrix is 100 MiB).
    weights: list[tuple[Tensor, Callable[[], np.ndarray]]]


def build_stage(
    work: Workload, layers: range, lay: StageLayout, buffer: int, base: int, device: int = 0
) -> StageGraph:
    """The stage's graph over `layers`: per layer RMS_NORM, MUL, MUL_MAT and the residual ADD, placed
    in `buffer` by `lay`."""
    g = GraphBuilder()
    x = g.tensor(GgmlType.F32, (work.n_embd, work.rows), buffer, base + lay.hidden_in, "hidden_in")
    hidden_in = x
    nodes: list[Tensor] = []
    weights = []
    for layer in layers:
        off_norm, off_mat = lay.weights[layer]
        gw = g.tensor(GgmlType.F32, (work.n_embd,), buffer, base + off_norm, f"blk.{layer}.norm")
        w = g.tensor(GgmlType.F32, (work.n_embd, work.n_embd), buffer, base + off_mat, f"blk.{layer}.w")
        weights += [(gw, partial(work.norm_weight, layer)), (w, partial(work.matrix, layer))]
        a_norm, a_mul, a_mm, a_out = lay.activations[layer]
        n = g.place(g.rms_norm(x, RMS_EPS), buffer, base + a_norm)
        m = g.place(g.mul(n, gw), buffer, base + a_mul)
        mm = g.place(g.mul_mat(w, m), buffer, base + a_mm)
        x = g.place(g.add(mm, x), buffer, base + a_out)
        for t, name in ((n, "norm"), (m, "mul"), (mm, "mul_mat"), (x, "out")):
            t.name = f"blk.{layer}.{name}"
        nodes += [n, m, mm, x]
    return StageGraph(g.serialize(nodes, device), hidden_in, x, weights)

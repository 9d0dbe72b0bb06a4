"""A layer-split coordinator over P stages, with hub or direct stage boundaries.

    with Pipeline(["10.0.0.2:50052", "10.0.0.3:50052"], layers=3, local_last=True) as p:
        r = p.step()          # r.output (bytes of the last hidden state), r.counters, r.direct

One step is what a decode step is to llama.cpp's scheduler: the coordinator SET_TENSORs the
input into stage 0, every stage runs its graph (GRAPH_COMPUTE on the first step, GRAPH_RECOMPUTE
after), and each boundary moves the hidden state to the next stage:

- hub:    GET_TENSOR from the source to the coordinator, SET_TENSOR out to the destination
          (a remote-to-local boundary is always just the GET_TENSOR);
- direct: one COPY_TENSOR_TO to the source, when both ends advertised Feature.PEER_COPY and
          GGML_RPC_P2P is not "0"; an answer of 0 falls back to the hub path for that step.
          With `async_copy` (and both ends advertising Feature.PEER_COPY_ASYNC): a
          COPY_TENSOR_TO_ASYNC to the source, not answered, then, where the destination
          advertises Feature.PEER_GATE, a PEER_GATE on it, not waited for either (as the patched
          llama.cpp client does): the destination's graph is sent right behind it and the gates'
          answers are read before the next reply from a gated stage (settle_gates). A gate of 0
          made its stage skip what followed: the step is redone from that boundary on the hub
          path (PEER_RESUME, the source's kept bytes by PEER_TAKE, the graphs sent again).
          Without the gate bit: PEER_WAIT on the destination; a wait of 0 takes the source's
          kept bytes (PEER_TAKE) and SETs them.

The last stage's output comes back with one GET_TENSOR (or a local read). All counters are the
coordinator's (ClientCounters, shared by every stage's client); GGML_RPC_STATS=1 prints one line
per step and the per-step table when the pipeline closes.
"""

from __future__ import annotations

import os
import sys

from fleetd.client.stats import ClientCounters
from fleetd.pipeline.report import per_step, step_line, step_table
from fleetd.pipeline.results import StepResult
from fleetd.pipeline.stages import LocalStage, RemoteStage
from fleetd.pipeline.synthetic import StageGraph, Workload, build_stage, layout_stage
from fleetd.transport.tcp import Timeout

DEFAULT_TIMEOUT = Timeout(connect=10.0, read=300.0)


def p2p_from_env() -> bool:
    return os.environ.get("GGML_RPC_P2P", "1") != "0"


def stats_from_env() -> bool:
    return os.environ.get("GGML_RPC_STATS", "0") not in ("", "0")


class Pipeline:
    """The coordinator of one layer split: a client per remote stage, the stages' graphs and weights
    placed at start, one `step()` per decode step."""

    def __init__(
        self,
        endpoints: list[str],
        layers: int,
        rows: int = 32,
        n_embd: int = 5120,
        local_last: bool = False,
        p2p: bool | None = None,
        seed: int = 0,
        peer_endpoints: list[str] | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        stats: bool | None = None,
        async_copy: bool = False,
    ) -> None:
        self.work = Workload(layers, rows, n_embd, seed)
        self.p2p = p2p_from_env() if p2p is None else p2p
        self.print_stats = stats_from_env() if stats is None else stats
        self.async_copy = async_copy
        self.counters = ClientCounters()
        self.steps: list[StepResult] = []
        self.stages: list[RemoteStage | LocalStage] = []
        self._gates: list[tuple[int, int, int]] = []  # (boundary, stream, seq): answers not read
        self._gate_tally = [0, 0]  # this step's gates: landed, failed
        peers = peer_endpoints or [None] * len(endpoints)
        if len(peers) != len(endpoints):
            raise ValueError("peer_endpoints must name one endpoint per remote stage")
        try:
            for ep, peer in zip(endpoints, peers):
                self.stages.append(RemoteStage(ep, self.counters, timeout, peer))
            if local_last:
                self.stages.append(LocalStage())
            if not self.stages:
                raise ValueError("a pipeline needs at least one stage")
            self.graphs = self._place()
        except BaseException:
            self.close()
            raise

    # -- set-up (not part of any step's counters) ---------------------------------------------

    def _place(self) -> list[StageGraph]:
        graphs = []
        for stage, layers in zip(self.stages, self.work.split(len(self.stages))):
            lay = layout_stage(self.work, layers, stage.alignment())
            buffer, base = stage.alloc(lay.size)
            sg = build_stage(self.work, layers, lay, buffer, base)
            for tensor, make in sg.weights:
                stage.set_tensor(tensor.rpc(), make())
            graphs.append(sg)
        return graphs

    def direct_boundary(self, i: int) -> bool:
        """Whether boundary i -> i+1 is tried with COPY_TENSOR_TO."""
        a, b = self.stages[i], self.stages[i + 1]
        return self.p2p and a.peer_copy and b.peer_copy

    # -- one step ----------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One decode step: the input into stage 0, every stage's graph, each boundary moved (direct
        or hub), the last stage's output read back."""
        index = len(self.steps)
        first = index == 0
        before = self.counters.snapshot()
        direct = fallbacks = 0
        self._gate_tally = [0, 0]
        hidden = self.work.hidden_input(index)
        self.stages[0].set_tensor(self.graphs[0].hidden_in.rpc(), hidden)
        for i, stage in enumerate(self.stages):
            stage.compute(self.graphs[i].graph, first)
            if i + 1 == len(self.stages):
                break
            moved = self._move(i, first)
            direct += moved == "direct"
            fallbacks += moved == "fallback"
        self.settle_gates(first)
        direct, fallbacks = direct + self._gate_tally[0], fallbacks + self._gate_tally[1]
        output = self.stages[-1].get_tensor(self.graphs[-1].hidden_out.rpc())
        result = StepResult(index, output, self.counters.minus(before), direct, fallbacks)
        self.steps.append(result)
        if self.print_stats:
            print(step_line(result), file=sys.stderr)
        return result

    def _move(self, i: int, first: bool = False) -> str:
        """Boundary i -> i+1: "direct", "fallback", "hub", or "gate" (its answer read later by
        settle_gates, which counts it)."""
        src_stage, dst_stage = self.stages[i], self.stages[i + 1]
        src = self.graphs[i].hidden_out.rpc()
        dst = self.graphs[i + 1].hidden_in.rpc()
        how = "hub"
        if (
            self.direct_boundary(i)
            and self.async_copy
            and src_stage.peer_copy_async
            and dst_stage.peer_copy_async
        ):
            stream, seq = dst_stage.next_copy()
            src_stage.client.copy_tensor_to_async(src, dst, src.nbytes, dst_stage.peer_endpoint, stream, seq)
            if dst_stage.peer_gate:
                dst_stage.client.peer_gate(stream, seq)
                self._gates.append((i, stream, seq))
                return "gate"
            if dst_stage.client.peer_wait(stream, seq):
                return "direct"
            dst_stage.set_tensor(dst, src_stage.client.peer_take(stream, seq, src.nbytes))
            return "fallback"
        if self._gates and self._gates[-1][0] == i - 1:  # a reply from stage i comes after its gate's
            self.settle_gates(first)
        if self.direct_boundary(i):
            if src_stage.client.copy_tensor_to(src, dst, src.nbytes, dst_stage.peer_endpoint):
                return "direct"
            how = "fallback"
        return self._move_hub(i, how)

    def _move_hub(self, i: int, how: str = "hub") -> str:
        dst = self.graphs[i + 1].hidden_in.rpc()
        self.stages[i + 1].set_tensor(dst, self.stages[i].get_tensor(self.graphs[i].hidden_out.rpc()))
        return how

    def settle_gates(self, first: bool) -> tuple[int, int]:
        """Read every open gate's answer, in order: (landed, failed), also counted into the
        step's tally. A stage whose gate said 0 skipped everything sent after it (its graph,
        its own copy onwards, so the next gates fail too): from the first such boundary the
        step is redone on the hub path, with the source's kept bytes, the graphs sent again
        (whole on the first step: a skipped GRAPH_COMPUTE stored nothing)."""
        gates, self._gates = self._gates, []
        answers = [self.stages[i + 1].client.gate_result() for i, _, _ in gates]
        bad = answers.index(False) if not all(answers) else len(gates)
        self._gate_tally[0] += bad
        self._gate_tally[1] += len(gates) - bad
        if bad == len(gates):
            return bad, 0
        for (i, _, _), landed in zip(gates, answers):
            if not landed:
                self.stages[i + 1].client.peer_resume()
        start, stream, seq = gates[bad]
        last = gates[-1][0] + 1  # the last stage that had a gate: what comes after was not sent
        src, dst = self.graphs[start].hidden_out.rpc(), self.graphs[start + 1].hidden_in.rpc()
        self.stages[start + 1].set_tensor(dst, self.stages[start].client.peer_take(stream, seq, src.nbytes))
        for k in range(start + 1, last + 1):
            self.stages[k].compute(self.graphs[k].graph, first)
            if k < last:
                self._move_hub(k)
        return bad, len(gates) - bad

    def run(self, steps: int) -> list[StepResult]:
        return [self.step() for _ in range(steps)]

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        if self.print_stats and len(self.steps) > 1:
            arm = "direct" if any(s.direct for s in self.steps) else "hub"
            print(step_table({arm: per_step(self.steps[1:])}), file=sys.stderr)
        for stage in self.stages:
            stage.close()
        self.stages = []

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Hub vs direct (synchronous and asynchronous) stage boundaries on a local fleet: per-step
commands, coordinator bytes and wall time, with the stock ggml-rpc-server's hub path side by
side when it is built.

    .venv/bin/python benchmarks/p2p.py                       # seed shape: 3 stages, 32 x 5120
    .venv/bin/python benchmarks/p2p.py --rows 4 --n-embd 256 --steps 5 --json-out /tmp/p2p.json

Servers run on loopback (fleetd and stock alike as processes), so wall times say
little about a real network; the command and byte columns are exact either way. The hub,
direct and async arms are three pipelines open side by side on the same fleetd servers, timed in
alternating rounds (--rounds; the order flips every round) so that drift on a shared machine
hits both alike; the ratios direct / hub and async / hub are taken per round and given as median and range.
Then boundary 0 -> 1 is timed alone (--boundary moves per arm, alternating move by move): the
direct path's own cost against the hub's, without the stages' compute around it. By default its
commands go out as prebuilt frames, a send and an exact read each, as a compiled client sends
them (--boundary-client raw): through the Pipeline's own client (--boundary-client pipeline) the
client's Python bookkeeping is most of a move (121 us of CPU a hub move, 144 an async one, on the
2-core test machine), and the hub's share of it is the larger. The client's CPU per move is
printed beside the times. --cpus pins the whole run (servers, workers, client) to those CPUs:
with one, a move's time is the CPU of everything it sets off, without the cross-CPU wake-ups
that on a shared VM make the same arm 55 or 185 us from one run to the next.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from fleetd.fleet.local import LocalFleet
from fleetd.pipeline import Pipeline, per_step, step_table
from fleetd.tools import find_tool, have_tool
from fleetd.transport import wait_listening
from fleetd.wire import (
    Cmd,
    CopyTensorTo,
    CopyTensorToAsync,
    GetAlignment,
    GetTensor,
    PeerGate,
    SetTensor,
)
from fleetd.wire.connection import encode_response
from fleetd.wire.tensor import RPC_TENSOR


def start_stock(n: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, eps = [], []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(
            subprocess.Popen(
                [str(find_tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_listening(port)
        # The probe connection above was a whole "client" to the stock server; let it go.
        time.sleep(0.2)
        eps.append(f"127.0.0.1:{port}")
    return procs, eps


def open_pipeline(endpoints: list[str], args, p2p: bool, async_copy: bool = False) -> Pipeline:
    p = Pipeline(
        endpoints,
        args.layers or args.stages,
        args.rows,
        args.n_embd,
        local_last=args.local_last,
        p2p=p2p,
        stats=False,
        async_copy=async_copy,
    )
    try:
        p.step()  # GRAPH_COMPUTE; not in the window
    except BaseException:
        p.close()
        raise
    return p


def timed(p: Pipeline, steps: int) -> float:
    """Seconds per step over `steps` steps."""
    t0 = time.perf_counter()
    p.run(steps)
    return (time.perf_counter() - t0) / steps


def column(p: Pipeline, seconds: list[float]) -> dict:
    results = p.steps[1:]
    out = per_step(results)
    out["seconds_per_step"] = statistics.median(seconds)
    out["seconds_per_round"] = seconds
    out["md5"] = hashlib.md5(b"".join(r.output for r in results)).hexdigest()
    return out


def request_frame(request, body: int = 0) -> bytes:
    """| cmd u8 | size u64 | payload |, as ClientConnection.send frames a request, without its
    reply bookkeeping (the raw boundary client reads each reply by its known size); `body`: the
    bytes of data that follow (a SET_TENSOR's), counted in size."""
    payload = request.encode()
    return struct.pack("<BQ", request.cmd, len(payload) + body) + payload


class RawBoundary:
    """Boundary 0 -> 1 of one pipeline moved with prebuilt frames on its connections' sockets,
    each reply read by its exact size: per command a send and a read, as a compiled client pays,
    so that the arms differ in what the servers do and not in the client's Python. The
    pipeline's own client saw none of it: every reply is read before the next move."""

    SYNC = request_frame(GetAlignment(0))
    SYNC_REPLY = len(encode_response(Cmd.GET_ALIGNMENT, 0))
    GATE_REPLY = len(encode_response(Cmd.PEER_GATE, 1))
    COPY_REPLY = len(encode_response(Cmd.COPY_TENSOR_TO, 1))
    # | stream u64 | seq u64 |: in PEER_GATE's payload first, in COPY_TENSOR_TO_ASYNC's after its
    # two tensors and size
    COPY_IDS = struct.Struct("<QQ")
    COPY_IDS_AT = 9 + 2 * RPC_TENSOR.size + 8

    def __init__(self, p: Pipeline) -> None:
        self.src_stage, self.dst_stage = p.stages[0], p.stages[1]
        self.src_sock, self.dst_sock = self.src_stage.client.sock, self.dst_stage.client.sock
        self.src = p.graphs[0].hidden_out.rpc()
        self.dst = p.graphs[1].hidden_in.rpc()
        self.get = request_frame(GetTensor(self.src, 0, self.src.nbytes))
        self.set_head = request_frame(SetTensor(self.dst, 0, self.src.nbytes, 0), self.src.nbytes)
        ep = self.dst_stage.peer_endpoint
        self.copy = request_frame(CopyTensorTo(self.src, self.dst, self.src.nbytes, ep))
        # the async arm's two frames, built once; each move writes its (stream, seq) into them
        self.copy_async = bytearray(
            request_frame(CopyTensorToAsync(self.src, self.dst, self.src.nbytes, 0, 0, ep))
        )
        self.gate = bytearray(request_frame(PeerGate(0, 0)) + self.SYNC)
        self.buf = bytearray(8 + self.src.nbytes + self.GATE_REPLY + self.SYNC_REPLY)

    def _read(self, sock: socket.socket, n: int) -> memoryview:
        view = memoryview(self.buf)[:n]
        got = 0
        while got < n:
            k = sock.recv_into(view[got:])
            if not k:
                raise SystemExit("boundary: a server closed the connection")
            got += k
        return view

    def move(self, arm: str) -> None:
        if arm == "hub":
            self.src_sock.sendall(self.get)
            data = self._read(self.src_sock, 8 + self.src.nbytes)[8:]
            self.dst_sock.sendall(self.set_head + bytes(data) + self.SYNC)
            self._read(self.dst_sock, self.SYNC_REPLY)
        elif arm == "direct":
            self.src_sock.sendall(self.copy)
            if self._read(self.src_sock, self.COPY_REPLY)[8] != 1:
                raise SystemExit("boundary: the direct arm's copy was refused")
            self.dst_sock.sendall(self.SYNC)
            self._read(self.dst_sock, self.SYNC_REPLY)
        else:
            stream, seq = self.dst_stage.next_copy()
            self.COPY_IDS.pack_into(self.copy_async, self.COPY_IDS_AT, stream, seq)
            self.COPY_IDS.pack_into(self.gate, 9, stream, seq)
            self.src_sock.sendall(self.copy_async)
            self.dst_sock.sendall(self.gate)
            if self._read(self.dst_sock, self.GATE_REPLY + self.SYNC_REPLY)[8] != 1:
                raise SystemExit("boundary: the async arm's gate answered 0")


def boundary_seconds(
    pipes: dict[str, Pipeline], moves: int, client: str = "raw"
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Boundary 0 -> 1 alone, `moves` times per arm, alternating move by move: hub GET_TENSOR +
    SET_TENSOR, direct COPY_TENSOR_TO, async COPY_TENSOR_TO_ASYNC + PEER_GATE (PEER_WAIT where
    the destination has no gate, pipeline client only), each followed by one round trip to the
    destination, which stands for the destination's next command: sent right behind the hub's
    SET and behind the gate, as llama.cpp's client and the client half send the next graph, and
    answered once the copy landed. The gate's answer is read before the round trip's, as the
    client half reads it. (Until 2026-12-07 the round trip was sent only after the gate's answer
    had come back: one more round trip on the destination than a client pays, which the hub arm
    did not have.) Returns each arm's seconds per move and the client's mean CPU seconds per
    move."""
    seconds: dict[str, list[float]] = {arm: [] for arm in pipes}
    cpu = dict.fromkeys(pipes, 0.0)
    raw = {arm: RawBoundary(p) for arm, p in pipes.items()} if client == "raw" else {}
    arms = list(pipes)
    for i in range(moves):
        for arm in arms if i % 2 == 0 else arms[::-1]:
            c0, t0 = time.thread_time(), time.perf_counter()
            if raw:
                raw[arm].move(arm)
            else:
                _pipeline_move(arm, pipes[arm])
            seconds[arm].append(time.perf_counter() - t0)
            cpu[arm] += time.thread_time() - c0
    return seconds, {arm: c / moves for arm, c in cpu.items()}


def _pipeline_move(arm: str, p: Pipeline) -> None:
    dst = p.stages[1].client
    how = p._move(0)
    if how == "gate":
        dst.sync_begin()
        how = "direct" if p.settle_gates(first=False) == (1, 0) else "fallback"
        if how != "direct":  # the destination skipped the round trip behind the gate
            raise SystemExit(f"boundary: the {arm} arm moved by {how}")
        dst.sync_end()
    else:
        dst.sync()
    if how != ("direct" if arm == "async" else arm):
        raise SystemExit(f"boundary: the {arm} arm moved by {how}")


def run_arms(endpoints: list[str], args) -> tuple[dict[str, dict], tuple[dict, dict]]:
    """hub, direct and async on the same servers, in alternating rounds (ABC CBA ...); then the
    boundary alone."""
    pipes = {"hub": open_pipeline(endpoints, args, False)}
    try:
        pipes["direct"] = open_pipeline(endpoints, args, True)
        pipes["async"] = open_pipeline(endpoints, args, True, async_copy=True)
        seconds: dict[str, list[float]] = {arm: [] for arm in pipes}
        arms = list(pipes)
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                seconds[arm].append(timed(pipes[arm], args.steps))
        cols = {arm: column(p, seconds[arm]) for arm, p in pipes.items()}
        remote = [s for s in pipes["direct"].stages if s.client is not None]
        moves: tuple[dict[str, list[float]], dict[str, float]] = ({}, {})
        if args.boundary and len(remote) >= 2:
            moves = boundary_seconds(pipes, args.boundary, args.boundary_client)
            # one more step per arm, which must agree: the moves left every arm's bytes alike
            if len({p.step().output for p in pipes.values()}) != 1:
                raise SystemExit("boundary: the arms' outputs differ after the boundary moves")
        return cols, moves
    finally:
        for p in pipes.values():
            p.close()


def quartiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"q1": q[0], "median": q[1], "q3": q[2]}


def run_stock(endpoints: list[str], args) -> dict:
    # A stock server serves one client at a time: one pipeline, rounds back to back.
    with open_pipeline(endpoints, args, True) as p:  # never advertises the bit
        return column(p, [timed(p, args.steps) for _ in range(args.rounds)])


def ratio(num: list[float], den: list[float]) -> dict:
    per_round = [a / b for a, b in zip(num, den)]
    return {
        "median": statistics.median(per_round),
        "min": min(per_round),
        "max": max(per_round),
        "rounds": per_round,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--local-last", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--n-embd", type=int, default=5120)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per arm")
    ap.add_argument(
        "--boundary",
        type=int,
        default=200,
        metavar="N",
        help="then time boundary 0 -> 1 alone N times per arm (0: skip)",
    )
    ap.add_argument(
        "--boundary-client",
        choices=("raw", "pipeline"),
        default="raw",
        help="the boundary's commands as prebuilt frames (raw: a compiled client's cost) or "
        "through the Pipeline's Python client",
    )
    ap.add_argument(
        "--cpus",
        default=None,
        metavar="LIST",
        help="pin the whole run to these CPUs (e.g. 0, or 0,1): with one, a move's time is the "
        "CPU it sets off, without cross-CPU wake-ups",
    )
    ap.add_argument("--no-stock", action="store_true", help="skip the stock server column")
    ap.add_argument("--json-out", type=Path, default=Path("benchmarks/results/p2p.json"))
    args = ap.parse_args()
    remote = args.stages - int(args.local_last)
    if args.steps < 1 or args.rounds < 1 or args.boundary < 0:
        ap.error("--steps and --rounds must be at least 1, --boundary at least 0")
    if args.cpus is not None:
        allowed = os.sched_getaffinity(0)
        try:
            cpus = {int(c) for c in args.cpus.split(",")}
        except ValueError:
            ap.error(f"--cpus {args.cpus}: expected CPU numbers, e.g. 0 or 0,1")
        if not cpus or not cpus <= allowed:
            ap.error(f"--cpus {args.cpus}: this process may run on CPUs {sorted(allowed)} only")
        os.sched_setaffinity(0, cpus)  # the servers and their workers inherit it

    with LocalFleet(remote, control=False) as local:
        cols, moves = run_arms(local.endpoints, args)
    if not args.no_stock and have_tool("ggml-rpc-server"):
        procs, stock_eps = start_stock(remote)
        try:
            cols["hub (stock)"] = run_stock(stock_eps, args)
        finally:
            for p in procs:
                p.kill()
                p.wait()

    print(
        f"{args.stages} stages, hidden state {args.rows} x {args.n_embd} f32, "
        f"{args.steps} steps after the first x {args.rounds} rounds"
    )
    print(step_table(cols))
    print(
        "seconds per step (loopback, median of rounds)  "
        + "  ".join(f"{c['seconds_per_step']:.4f}" for c in cols.values())
    )
    direct_over_hub = ratio(cols["direct"]["seconds_per_round"], cols["hub"]["seconds_per_round"])
    async_over_hub = ratio(cols["async"]["seconds_per_round"], cols["hub"]["seconds_per_round"])
    for name, r in (("direct", direct_over_hub), ("async", async_over_hub)):
        print(
            f"{name} / hub time per step: median {r['median']:.3f} (rounds {r['min']:.3f} .. {r['max']:.3f})"
        )
    boundary = {}
    moves, client_cpu = moves
    if moves:
        boundary = {arm: quartiles(v) | {"client_cpu": client_cpu[arm]} for arm, v in moves.items()}
        boundary["direct_over_hub"] = boundary["direct"]["median"] / boundary["hub"]["median"]
        boundary["async_over_hub"] = boundary["async"]["median"] / boundary["hub"]["median"]
        print(
            f"boundary 0 -> 1 alone, {args.boundary} moves per arm, {args.boundary_client} client"
            + (f", CPUs {args.cpus}" if args.cpus else "")
            + " (us: median [quartiles], client CPU a move)"
        )
        for arm in moves:
            b = boundary[arm]
            print(
                f"  {arm:7s} {b['median'] * 1e6:7.1f} [{b['q1'] * 1e6:.1f} .. {b['q3'] * 1e6:.1f}]"
                f"  client {b['client_cpu'] * 1e6:.1f}"
            )
        print(
            f"  direct / hub {boundary['direct_over_hub']:.3f}  async / hub {boundary['async_over_hub']:.3f}"
        )
    for arm, c in cols.items():
        print(f"md5 {arm}: {c['md5']}")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "arms": cols,
                "direct_over_hub": direct_over_hub,
                "async_over_hub": async_over_hub,
                "boundary": boundary,
            },
            indent=2,
        )
    )
    print(f"wrote {args.json_out}")
    return 0 if cols["hub"]["md5"] == cols["direct"]["md5"] == cols["async"]["md5"] else 1


if __name__ == "__main__":
    sys.exit(main())

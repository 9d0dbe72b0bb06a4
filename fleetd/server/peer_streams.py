"""The destination side of the asynchronous peer copy, and the budget both sides hold its bytes
against: streams owned by client sessions, pushes staged until the owner's PEER_WAIT writes
them (fleetd.server.peer_async has the whole protocol and the source side). Held by ServerState.

Two implementations of the same rules: `NativePeerStreams` / `NativePeerMemory` over
libfleetd-native's peer_stage.c, which the sessions' C loops share (a PEER_PUSH and the
PEER_GATE that writes it are then served without the interpreter: DESIGN.md, "Asynchronous
peer copy"), and the pure Python `PeerStreams` / `PeerMemory` without the library.
`make_peer_staging` picks.

A push goes: `admit` (its bytes reserved and an `Arrival` to read them into, or the reason it is
refused), the data read into `arrival.data`, then `stage` (or `refuse` on any failure). A wait
gets a `Staged` (its tensor and bytes), the caller writes them and calls `done`.
"""

from __future__ import annotations

import ctypes
import secrets
import threading
import time
from dataclasses import dataclass, field

from fleetd.compute import native
from fleetd.errors import RemoteProtocolError
from fleetd.wire import PUSH_FAILED, PeerPush, RpcTensor

MAX_STREAMS_PER_SESSION = 64  # one per destination connection of a client is all it needs
MAX_UNWAITED = 4096  # copies of one stream staged or refused and not yet waited for


class PeerMemory:
    """Bytes of asynchronous copies a daemon holds (staged, queued, kept), against one cap."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._cond = threading.Condition()

    def reserve(self, n: int, timeout: float = 0.0) -> bool:
        """Take `n` bytes of the budget, waiting up to `timeout` for room; False if there is none."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.held + n > self.limit:
                left = deadline - time.monotonic()
                if left <= 0 or n > self.limit:
                    return False
                self._cond.wait(left)
            self.held += n
            return True

    def release(self, n: int) -> None:
        if n:
            with self._cond:
                self.held -= n
                self._cond.notify_all()


# -- the destination: streams, staged pushes, waits ---------------------------------------------

ARRIVING = "arriving"  # the push's header came, its data is streaming in
REFUSED = "refused"  # the push was refused or failed: the wait answers 0 at once


@dataclass
class Staged:
    """A pushed copy waiting for its PEER_WAIT: where it goes and its bytes."""

    dst: RpcTensor
    data: bytearray | memoryview
    address: int = 0  # NativePeerStreams: the C buffer behind data


@dataclass
class Arrival:
    """An admitted push whose bytes are being read into `data`."""

    stream: int
    seq: int
    data: bytearray | memoryview
    address: int = 0  # NativePeerStreams: the C buffer behind data


@dataclass
class _Stream:
    owner: int  # the session id whose PEER_WAITs it serves
    waited: int = 0  # the highest seq a PEER_WAIT answered: later pushes for it are late
    slots: dict[int, Staged | str] = field(default_factory=dict)  # seq -> Staged, ARRIVING, REFUSED


class PeerStreams:
    """The destination side, daemon-wide: streams by id, each owned by one client session."""

    def __init__(self, memory: PeerMemory) -> None:
        self.memory = memory
        self._streams: dict[int, _Stream] = {}
        self._cond = threading.Condition()

    def open(self, owner: int) -> int:
        """A new stream owned by session `owner` (PEER_STREAM)."""
        with self._cond:
            if sum(1 for s in self._streams.values() if s.owner == owner) >= MAX_STREAMS_PER_SESSION:
                raise RemoteProtocolError(
                    f"PEER_STREAM: this connection already owns {MAX_STREAMS_PER_SESSION} streams"
                )
            while True:
                sid = secrets.randbits(64)
                if sid and sid not in self._streams:
                    break
            self._streams[sid] = _Stream(owner)
            return sid

    handle = None  # no C staging: the sessions' loops leave PEER_PUSH and PEER_GATE to Python

    def vouch(self, stream_id: int, dst: RpcTensor, size: int, frees: int) -> None:
        """(NativePeerStreams: Python checked this destination; nothing to remember here.)"""

    def admit(self, push: PeerPush, p2p_enabled: bool) -> Arrival | str:
        """May `push` be staged? An Arrival (its bytes are reserved; the caller reads them into
        its `data`, then calls `stage`, or `refuse` on any failure) or the reason it is refused
        (the caller discards its data and answers 0; a known stream's wait for it then answers 0
        at once)."""
        with self._cond:
            stream = self._streams.get(push.stream)
            if stream is None:
                return "unknown stream"
            if push.seq <= stream.waited or push.seq in stream.slots:
                return f"seq {push.seq} late or repeated"
            if len(stream.slots) >= MAX_UNWAITED:  # refused ones too: a peer cannot grow this
                return f"{MAX_UNWAITED} copies of this stream not waited for yet"
            reason = None
            if push.flags & PUSH_FAILED:
                reason = "the source failed this copy"
            elif not p2p_enabled:
                reason = "peer copy is off on this daemon"
            elif not self.memory.reserve(push.size):
                reason = f"no room: {self.memory.held} of {self.memory.limit} peer-copy bytes held"
            stream.slots[push.seq] = REFUSED if reason else ARRIVING
            # A refusal answers the wait now. An arrival only lengthens it, which the waiter
            # finds when it next looks (at its deadline at the latest): waking it for that
            # would cost the copy's critical path a thread switch for nothing.
            if reason:
                self._cond.notify_all()
                return reason
            return Arrival(push.stream, push.seq, bytearray(push.size))

    def stage(self, arrival: Arrival, dst: RpcTensor) -> None:
        with self._cond:
            stream = self._streams.get(arrival.stream)
            if stream is None or stream.slots.get(arrival.seq) is not ARRIVING:
                self.memory.release(len(arrival.data))  # the owner left while the data came in
                return
            stream.slots[arrival.seq] = Staged(dst, arrival.data)
            self._cond.notify_all()

    def refuse(self, arrival: Arrival) -> None:
        """An admitted push failed while its data came in (bad region, the source went away)."""
        self.memory.release(len(arrival.data))
        with self._cond:
            stream = self._streams.get(arrival.stream)
            if stream is not None and stream.slots.get(arrival.seq) is ARRIVING:
                stream.slots[arrival.seq] = REFUSED
                self._cond.notify_all()

    def done(self, staged: Staged) -> None:
        """The waited copy's bytes were written (or could not be): let them go."""
        self.memory.release(len(staged.data))

    def wait(
        self, stream_id: int, seq: int, owner: int, timeout: float, transfer: float, gone
    ) -> Staged | None:
        """PEER_WAIT: the staged copy `seq` (its bytes still reserved: the caller writes them,
        then calls `done`), or None if it was refused or did not start arriving within `timeout`
        (one that is arriving gets `transfer` more). `gone()` is asked every half second:
        a client that left ends the wait with ConnectionError."""
        start = time.monotonic()
        with self._cond:
            stream = self._streams.get(stream_id)
            if stream is None or stream.owner != owner:
                raise RemoteProtocolError(f"PEER_WAIT: stream {stream_id:#x} is not this connection's")
            if seq <= stream.waited:
                raise RemoteProtocolError(
                    f"PEER_WAIT: seq {seq} after seq {stream.waited}: waits follow the copies' order"
                )
            while True:
                slot = stream.slots.get(seq)
                if slot is not None and slot is not ARRIVING:
                    break
                limit = timeout + (transfer if slot is ARRIVING else 0.0)
                left = start + limit - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
                if gone():
                    raise ConnectionError("client left while waiting for a peer copy")
            # Everything up to seq is settled now: a later push for it is late, and copies the
            # client skipped are dropped unwritten.
            stream.waited = seq
            for s in [s for s in stream.slots if s <= seq]:
                dropped = stream.slots.pop(s)
                if isinstance(dropped, Staged) and s != seq:
                    self.memory.release(len(dropped.data))
        return slot if isinstance(slot, Staged) else None

    def close_owner(self, owner: int) -> None:
        """A client session ended: its streams and their staged bytes go."""
        with self._cond:
            for sid in [sid for sid, s in self._streams.items() if s.owner == owner]:
                for slot in self._streams.pop(sid).slots.values():
                    if isinstance(slot, Staged):
                        self.memory.release(len(slot.data))
            self._cond.notify_all()


# -- the same over peer_stage.c ------------------------------------------------------------------

# fleetd_streams_admit's fixed reasons, as PeerStreams.admit words them (2, 3 and 6 carry numbers)
_REASONS = {
    1: "unknown stream",
    4: "the source failed this copy",
    5: "peer copy is off on this daemon",
}
_NOT_OWNER, _OUT_OF_ORDER = -1, -2
_ARRIVING, _STAGED, _REFUSED = 1, 2, 3
_TENSOR = 296


def _c_bytes(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class NativePeerMemory:
    """PeerMemory over peer_stage.c's budget (the one the C loops reserve from too)."""

    def __init__(self, lib, table: int) -> None:
        self._lib, self._table = lib, table

    def reserve(self, n: int, timeout: float = 0.0) -> bool:
        return bool(self._lib.fleetd_mem_reserve(self._table, n, int(timeout * 1e9)))

    def release(self, n: int) -> None:
        self._lib.fleetd_mem_release(self._table, n)

    @property
    def held(self) -> int:
        return self._lib.fleetd_mem_held(self._table)

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._limit = value
        self._lib.fleetd_mem_set_limit(self._table, value)


class NativePeerStreams:
    """PeerStreams over peer_stage.c: one table, daemon-wide, that the sessions' C loops share
    (`handle`). The rules and their words are PeerStreams'."""

    def __init__(self, lib, limit: int) -> None:
        self._lib = lib
        # The table lives as long as the process: a loop may hold its address at any time.
        self.handle = lib.fleetd_streams_new(limit, MAX_STREAMS_PER_SESSION, MAX_UNWAITED)
        if not self.handle:
            raise MemoryError("fleetd_streams_new")
        self.memory = NativePeerMemory(lib, self.handle)
        self.memory.limit = limit

    def open(self, owner: int) -> int:
        while True:
            sid = secrets.randbits(64)
            rc = self._lib.fleetd_streams_open(self.handle, sid, owner)
            if rc == 0:
                return sid
            if rc == 2:
                raise RemoteProtocolError(
                    f"PEER_STREAM: this connection already owns {MAX_STREAMS_PER_SESSION} streams"
                )
            if rc < 0:
                raise MemoryError("fleetd_streams_open")

    def vouch(self, stream_id: int, dst: RpcTensor, size: int, frees: int) -> None:
        """Python checked `dst` for a push of `size` bytes while the registry's free count was
        `frees`: the C loops may stage the stream's next pushes to it until anything is freed."""
        self._lib.fleetd_streams_vouch(self.handle, stream_id, dst.pack(), size, frees)

    def admit(self, push: PeerPush, p2p_enabled: bool) -> Arrival | str:
        address = ctypes.c_void_p()
        rc = self._lib.fleetd_streams_admit(
            self.handle,
            push.stream,
            push.seq,
            push.size,
            push.flags,
            int(p2p_enabled),
            0,
            None,
            0,
            ctypes.byref(address),
        )
        if rc == 2:
            return f"seq {push.seq} late or repeated"
        if rc == 3:
            return f"{MAX_UNWAITED} copies of this stream not waited for yet"
        if rc == 6:
            return f"no room: {self.memory.held} of {self.memory.limit} peer-copy bytes held"
        if rc:
            return _REASONS.get(rc, f"refused ({rc})")
        return Arrival(push.stream, push.seq, _c_bytes(address.value, push.size), address.value)

    def stage(self, arrival: Arrival, dst: RpcTensor) -> None:
        self._lib.fleetd_streams_stage(
            self.handle, arrival.stream, arrival.seq, dst.pack(), arrival.address, len(arrival.data)
        )

    def refuse(self, arrival: Arrival) -> None:
        self._lib.fleetd_streams_refuse(
            self.handle, arrival.stream, arrival.seq, arrival.address, len(arrival.data)
        )

    def wait(
        self, stream_id: int, seq: int, owner: int, timeout: float, transfer: float, gone
    ) -> Staged | None:
        lib, start = self._lib, time.monotonic()
        dst = ctypes.create_string_buffer(_TENSOR)
        size = ctypes.c_uint64()
        state = 0
        while True:
            limit = timeout + (transfer if state == _ARRIVING else 0.0)
            end = start + limit
            until = min(end, time.monotonic() + 0.5)
            state = lib.fleetd_streams_wait(
                self.handle, stream_id, seq, owner, int(until * 1e9), dst, ctypes.byref(size)
            )
            if state == _NOT_OWNER:
                raise RemoteProtocolError(f"PEER_WAIT: stream {stream_id:#x} is not this connection's")
            if state == _OUT_OF_ORDER:
                raise RemoteProtocolError(
                    f"PEER_WAIT: seq {seq} after a later seq was waited for: waits follow the copies' order"
                )
            if state in (_STAGED, _REFUSED):
                break
            limit = timeout + (transfer if state == _ARRIVING else 0.0)
            if time.monotonic() >= start + limit:
                break
            if gone():
                raise ConnectionError("client left while waiting for a peer copy")
        address = lib.fleetd_streams_settle(self.handle, stream_id, seq, owner)
        if state != _STAGED or not address:
            return None
        n = size.value
        return Staged(RpcTensor.unpack_from(dst.raw, 0), _c_bytes(address, n), address)

    def done(self, staged: Staged) -> None:
        self._lib.fleetd_streams_done(self.handle, staged.address, len(staged.data))

    def close_owner(self, owner: int) -> None:
        self._lib.fleetd_streams_close_owner(self.handle, owner)


def make_peer_staging(limit: int) -> tuple[PeerMemory | NativePeerMemory, PeerStreams | NativePeerStreams]:
    """The budget and the destination side: over peer_stage.c when the library has it."""
    lib = native.peer_stage()
    if lib is not None:
        streams = NativePeerStreams(lib, limit)
        return streams.memory, streams
    memory = PeerMemory(limit)
    return memory, PeerStreams(memory)

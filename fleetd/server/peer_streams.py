"""The destination side of the asynchronous peer copy, and the budget both sides hold its bytes
against: streams owned by client sessions, pushes staged until the owner's PEER_WAIT writes
them (fleetd.server.peer_async has the whole protocol and the source side). Held by ServerState.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

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
    data: bytearray


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

    def admit(self, push: PeerPush, p2p_enabled: bool) -> str | None:
        """May `push` be staged? None (its bytes are reserved; the caller reads them, then calls
        `stage`, or `refuse` on any failure) or the reason it is refused (the caller discards
        its data and answers 0; a known stream's wait for it then answers 0 at once)."""
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

    def stage(self, stream_id: int, seq: int, dst: RpcTensor, data: bytearray) -> None:
        with self._cond:
            stream = self._streams.get(stream_id)
            if stream is None or stream.slots.get(seq) is not ARRIVING:
                self.memory.release(len(data))  # the owner left while the data came in
                return
            stream.slots[seq] = Staged(dst, data)
            self._cond.notify_all()

    def refuse(self, stream_id: int, seq: int, reserved: int) -> None:
        """An admitted push failed while its data came in (bad region, the source went away)."""
        self.memory.release(reserved)
        with self._cond:
            stream = self._streams.get(stream_id)
            if stream is not None and stream.slots.get(seq) is ARRIVING:
                stream.slots[seq] = REFUSED
                self._cond.notify_all()

    def wait(
        self, stream_id: int, seq: int, owner: int, timeout: float, transfer: float, gone
    ) -> Staged | None:
        """PEER_WAIT: the staged copy `seq` (its bytes still reserved: the caller writes them,
        then releases), or None if it was refused or did not start arriving within `timeout`
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

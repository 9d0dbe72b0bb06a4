"""Framing between the daemon and a compute worker over one AF_UNIX stream socket.

A message is `| kind u32 | n_fds u32 | length u64 | payload |`; file descriptors (buffer
memfds) travel as SCM_RIGHTS on the header's sendmsg (past MAX_FDS, on one byte each after it).
The daemon sends pickled dicts (the worker trusts its
daemon); the worker answers with a kind and a short UTF-8 text, which the daemon parses
without unpickling anything (it trusts no worker).
"""

from __future__ import annotations

import array
import os
import socket
import struct

HEADER = struct.Struct("<IIQ")  # kind, number of fds, payload length
MAX_FDS = 250  # SCM_RIGHTS carries at most 253 per message
MAX_REPLY = 64 * 1024

# daemon -> worker
MSG_COMPUTE = 1  # {"key", "spec" or None, "maps": [(handle, base, size)], "unmap": [...], "threads"}
MSG_FORGET = 2  # {"keys": [...], "unmap": [...]}
MSG_RUN = 3  # RUN: compute the graph the worker holds, nothing else changed (the decode hot path)
RUN = struct.Struct("<I")  # threads
# SERVE: a stint of the session's connection served in the worker, the built graph's
# GRAPH_RECOMPUTE computed in place. fds: the client's socket, the page the worker's loop context
# (its counts) lies in. Payload: the graph's device, its threads, budget_ms, then n_regions x
# SERVE_REGION (the daemon's order), n_written x u32 (the regions the graph writes) and
# n_align x u64 (GET_ALIGNMENT per device)
SERVE = struct.Struct("<IIIIII")  # device, threads, budget_ms, n_regions, n_written, n_align
MSG_SERVE = 4
SERVE_REGION = struct.Struct("<QQQ")  # handle, base, size
# worker -> daemon
REPLY_DONE = 100
REPLY_REFUSED = 101  # the graph's data breaks a rule the kernel relies on (row ids): closes the session
REPLY_FAILED = 102  # ggml returned an error status
REPLY_READY = 103  # sent once, after the sandbox is up: what it is ("uid=... seccomp=on")
REPLY_SERVED = 104  # a stint's end: SERVED, written flags, bytes left, a text (counts: the page)
# loop answer, REPLY_* of a graph that failed (else 0), the loop's -errno, bytes left, n_regions,
# text length; then a written flag per region, the bytes left, the text
SERVED = struct.Struct("<iiiIII")


class ChannelClosed(EOFError):
    """The other end closed the channel before a whole message arrived."""


def send_message(sock: socket.socket, kind: int, payload: bytes, fds=()) -> None:
    """One message, `fds` as SCM_RIGHTS on its header; past MAX_FDS, each further batch on one byte."""
    fds = list(fds)
    header = HEADER.pack(kind, len(fds), len(payload))
    if not fds:
        sock.sendall(header + payload)
        return
    for start in range(0, len(fds), MAX_FDS):
        data = header if start == 0 else b"\0"
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds[start : start + MAX_FDS]))]
        sent = sock.sendmsg([data], rights)
        if sent < len(data):
            sock.sendall(data[sent:])
    sock.sendall(payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ChannelClosed("the other end closed the channel")
        got += k
    return bytes(out)


def recv_message(
    sock: socket.socket, max_payload: int | None = None, max_fds: int = 0
) -> tuple[int, bytes, list[int]]:
    """One message and the descriptors sent with it (at most `max_fds`, else ValueError)."""
    head, fds = _recv_with_fds(sock, HEADER.size, MAX_FDS if max_fds else 0)
    kind, n_fds, length = HEADER.unpack(head)
    try:
        if n_fds > max_fds or (max_payload is not None and length > max_payload):
            raise ValueError(f"message of {length} bytes and {n_fds} fds: over the limit")
        while len(fds) < n_fds:
            _, more = _recv_with_fds(sock, 1, MAX_FDS)
            fds += more
        return kind, recv_exact(sock, length), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_with_fds(sock: socket.socket, size: int, n_fds: int) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    data = bytearray()
    while len(data) < size:
        space = socket.CMSG_SPACE(n_fds * fds.itemsize) if n_fds and not fds else 0
        chunk, ancdata, _flags, _addr = sock.recvmsg(size - len(data), space)
        if not chunk:
            raise ChannelClosed("the other end closed the channel")
        data += chunk
        for level, kind, blob in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(blob[: len(blob) - len(blob) % fds.itemsize])
    return bytes(data), list(fds)

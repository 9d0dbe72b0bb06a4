"""A TCP connection opened inside another network namespace (`ip netns` names it), for the
lab's nodes, whose control API listens on their own namespace's 127.0.0.1 (fleetd/fleet/lab.py).

setns(2) moves only the calling thread, so a short-lived thread joins the namespace, connects,
and ends; the socket stays in the namespace it was made in. Needs root (CAP_SYS_ADMIN).
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"


def connect_in_netns(netns: str, address: tuple[str, int], timeout: float) -> socket.socket:
    """socket.create_connection(address) from inside `netns`; raises what it raises, or OSError."""
    out: dict = {}

    def run() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            out["sock"] = socket.create_connection(address, timeout=timeout)
        except BaseException as exc:  # handed to the caller's thread
            out["exc"] = exc

    t = threading.Thread(target=run, name=f"netns-{netns}", daemon=True)
    t.start()
    t.join()
    if "exc" in out:
        raise out["exc"]
    return out["sock"]

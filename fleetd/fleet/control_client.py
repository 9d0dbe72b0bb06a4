"""The control API client: one HTTP/1.1 exchange with a node's loopback control API.

The standard library's `http.client` speaks HTTP; only the stream under it is ours. A remote
node's control port is reached through an SSH direct-tcpip channel (a paramiko Channel), a
local node over plain loopback TCP: `ControlConnection.connect()` sets `self.sock` to whichever
`open_stream()` gives, and http.client does the rest. One request per connection, bounded in
time (`timeout` per read) and size (MAX_RESPONSE).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from typing import Any

from fleetd import __version__
from fleetd.errors import ReadTimeout
from fleetd.fleet.ssh import ControlUnreachable, NodeError

# Largest control API answer we read: /v1/stats of a daemon with thousands of sessions is ~1 MiB.
MAX_RESPONSE = 16 << 20


class ControlError(NodeError):
    """The control API answered with an error status, or with something we cannot use."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ControlConnection(http.client.HTTPConnection):
    """http.client over a stream someone else opens: a socket or a paramiko Channel.

    The Host header says 127.0.0.1:<port>, which is what the control API accepts (it refuses
    non-loopback Host names); the stream itself may come from anywhere.
    """

    def __init__(self, port: int, open_stream: Callable[[], Any], timeout: float) -> None:
        super().__init__("127.0.0.1", port, timeout=timeout)
        self._open_stream = open_stream

    def connect(self) -> None:
        self.sock = self._open_stream()
        self.sock.settimeout(self.timeout)


def exchange(
    conn: ControlConnection, method: str, path: str, body: bytes | None, what: str
) -> tuple[int, str, bytes]:
    """One request on `conn` (closed afterwards): (status, content type, body)."""
    headers = {"User-Agent": f"fleetctl/{__version__}", "Accept": "application/json", "Connection": "close"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    where = f"{what}: {method} {path}"
    try:
        conn.connect()  # connect errors are the stream opener's, already ours: let them through
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            too_big = ControlError(f"{where}: answer over {MAX_RESPONSE >> 20} MiB")
            if resp.length is not None:  # Content-Length: read() raises IncompleteRead if short
                if resp.length > MAX_RESPONSE:
                    raise too_big
                data = resp.read()
            else:  # chunked or to EOF: one byte past the limit shows it was crossed
                data = resp.read(MAX_RESPONSE + 1)
                if len(data) > MAX_RESPONSE:
                    raise too_big
        except TimeoutError as exc:
            raise ReadTimeout(f"{where}: no answer within {conn.timeout:g}s") from exc
        except http.client.RemoteDisconnected as exc:
            raise ControlUnreachable(f"{where}: got nothing ({type(exc).__name__})") from exc
        except http.client.IncompleteRead as exc:
            got, more = len(exc.partial), exc.expected
            raise ControlUnreachable(f"{where}: answer ended after {got} of {got + more} bytes") from exc
        except (http.client.HTTPException, ValueError) as exc:
            raise ControlUnreachable(
                f"{where}: got an answer that is not HTTP ({type(exc).__name__})"
            ) from exc
        except OSError as exc:
            raise ControlUnreachable(f"{where}: {exc}") from exc
        return resp.status, resp.getheader("Content-Type", ""), data
    finally:
        conn.close()


def json_answer(status: int, ctype: str, data: bytes, where: str) -> dict:
    """The JSON object of an answer; an error status raises ControlError with the daemon's message."""
    try:
        answer = json.loads(data) if "json" in ctype else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ControlError(f"{where}: answer is not JSON: {exc}", status) from exc
    if status >= 400:
        msg = answer.get("error") if isinstance(answer, dict) else None
        raise ControlError(f"{where}: HTTP {status}: {msg or data[:200]!r}", status)
    if not isinstance(answer, dict):
        raise ControlError(f"{where}: expected a JSON object, got {ctype or 'no type'}", status)
    return answer

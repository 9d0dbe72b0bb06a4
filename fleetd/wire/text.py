"""Client-chosen strings (tensor names, endpoints, Host headers) as they may enter a log line."""

from __future__ import annotations

MAX_LOGGED = 80


def client_text(value, limit: int = MAX_LOGGED) -> str:
    """A printable, bounded rendering of `value` (bytes or str): non-printables and quotes
    escaped as repr does, so a client cannot forge a log line or flood one; longer values are cut
    with the original length noted."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        text = bytes(value).decode("utf-8", errors="backslashreplace")
    else:
        text = str(value)
    cut = text[:limit]
    shown = repr(cut)[1:-1]  # \n, \x1b, \u2028, ... escaped; no surrounding quotes
    return shown if len(text) <= limit else f"{shown}...({len(text)} chars)"

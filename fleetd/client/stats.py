"""Client-side counters (GGML_RPC_STATS): commands and bytes per command as the client sees them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ClientCounters:
    """Per command, as one client sees it: requests sent and bytes each way."""

    count: Counter = field(default_factory=Counter)
    request_bytes: Counter = field(default_factory=Counter)
    response_bytes: Counter = field(default_factory=Counter)

    def sent(self, cmd, nbytes: int) -> None:
        self.count[cmd] += 1
        self.request_bytes[cmd] += nbytes

    def received(self, cmd, nbytes: int) -> None:
        self.response_bytes[cmd] += nbytes

    def snapshot(self) -> ClientCounters:
        return ClientCounters(Counter(self.count), Counter(self.request_bytes), Counter(self.response_bytes))

    def minus(self, earlier: ClientCounters) -> ClientCounters:
        return ClientCounters(
            self.count - earlier.count,
            self.request_bytes - earlier.request_bytes,
            self.response_bytes - earlier.response_bytes,
        )

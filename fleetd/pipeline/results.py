"""What one pipeline step leaves behind: the data the coordinator produces and the report reads."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from fleetd.client.stats import ClientCounters


@dataclass
class StepResult:
    """One pipeline step: its output bytes, the coordinator's counters over it, how each boundary moved."""

    step: int
    output: bytes
    counters: ClientCounters  # this step's commands and bytes at the coordinator
    direct: int  # boundaries moved by COPY_TENSOR_TO
    fallbacks: int  # COPY_TENSOR_TO answered 0, moved through the hub instead

    @property
    def md5(self) -> str:
        return hashlib.md5(self.output).hexdigest()

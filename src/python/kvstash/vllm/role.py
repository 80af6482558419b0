"""What the connector's two roles both hold: its config, the cache geometry, the interval's
counts they add to, whether P/D takes the direct path, and the store (the cell), opened on first
use. SchedulerRole (scheduler.py) and WorkerRole (worker.py) extend it; vLLM makes a connector
per role, and each holds the one it was made for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvstash

if TYPE_CHECKING:
    from kvstash.vllm.config import KvstashConfig
    from kvstash.vllm.geometry import Geometry


class Role:
    """The state and the store that the scheduler's side and a worker's side both use."""

    def __init__(self, config: KvstashConfig, geometry: Geometry, stats: dict[str, int], engine_id: str):
        self.config = config
        self.geometry = geometry
        self._stats = stats  # this interval's counts (Counts.interval), which the connector hands vLLM
        self._direct = config.pd == "direct"
        self._engine_id = engine_id
        self._store: kvstash.Store | None = None

    @property
    def store(self) -> kvstash.Store:
        if self._store is None:
            self._store = self.config.open_store()
        return self._store

    @property
    def opened_store(self) -> kvstash.Store | None:
        """The store if it was opened: the counts read its metrics, and never open it for them."""
        return self._store

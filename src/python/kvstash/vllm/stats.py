"""The connector's counts as vLLM reports them: KvstashStats (one interval's lookups, chunks
found, loaded, saved and failed, and the increments of the store's own metrics, under
STORE_SERIES keys), KvstashPromMetrics (the same in vLLM's Prometheus endpoint), and Counts,
what one connector counts as it goes and hands vLLM each interval.
"""

from __future__ import annotations

from typing import Any

import kvstash
from kvstash import _metrics


def _stats_base():
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    return KVConnectorStats


# A KvstashStats key that is a series of the store's own metrics (its increment this interval).
STORE_SERIES = "store:"


class KvstashStats(_stats_base()):
    """Counts of one interval: lookups, chunks found, loaded, saved and failed, and the
    increments of the store's own metrics (keys "store:<series>"). Workers' add up."""

    def reset(self):
        self.data = {k: 0 for k in self.data}

    def aggregate(self, other):
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self):
        return {k: v for k, v in self.data.items() if not k.startswith(STORE_SERIES)}

    def is_empty(self):
        return not any(self.data.values())


def _prom_base():
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    return KVConnectorPromMetrics


class KvstashPromMetrics(_prom_base()):
    """The connector's counts and the store's own metrics in vLLM's Prometheus endpoint, next
    to vLLM's, under vLLM's labels (model_name, engine): vllm:kvstash_connector_<count>_total
    and vllm:kvstash_<the store's name> (docs/operations.md, "Engine-side metrics")."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._recorder = _metrics.Recorder(self._counter_cls, self._histogram_cls, labelnames, prefix="vllm:")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        labelvalues = self.per_engine_labelvalues[engine_idx]
        deltas = {}
        for k, v in transfer_stats_data.items():
            if not v:
                continue
            deltas[k[len(STORE_SERIES):] if k.startswith(STORE_SERIES) else f"kvstash_connector_{k}_total"] = v
        self._recorder.record(deltas, labelvalues)


class Counts:
    """One connector's counts: this interval's (KvstashStats' keys), which its role adds to as
    it goes and take() hands vLLM and zeroes, and the sums of every interval since it started
    (totals). The direct P/D path's export and import keep counts of their own, added in as
    they are taken."""

    def __init__(self) -> None:
        self.interval = {"lookups": 0, "chunks_found": 0, "chunks_loaded": 0, "chunks_load_failed": 0,
                         "chunks_saved": 0, "chunks_save_failed": 0, "chunks_already_stored": 0,
                         "chunks_corrupt_removed": 0, "chunks_announced": 0,
                         "requests_unnamed": 0}
        self._announced_reported = 0
        self._totals: dict[str, int] = {}
        # The store's own metrics (Store.metrics_text), handed to vLLM's Prometheus registry as
        # their increments (KvstashStats, build_prom_metrics).
        self._store_deltas: _metrics.Deltas | None = None

    def take(self, announced: int, sides: tuple[Any, ...], opened_store: kvstash.Store | None) -> KvstashStats | None:
        """The interval's counts (get_kv_connector_stats), zeroed; None when nothing was counted.
        `announced`: the chunks the saves' commits announced since start (KV events); `sides`: the
        direct path's export and import (None where closed); `opened_store`: the store if it was
        opened (its metrics' increments are added, and it is never opened for them)."""
        self.interval["chunks_announced"] += announced - self._announced_reported
        self._announced_reported = announced
        for side in sides:
            if side is not None:
                for k, v in side.stats.items():
                    self.interval[k] = self.interval.get(k, 0) + v
                    side.stats[k] = 0
        # The store's metrics grew by these since the last interval (its own counters and
        # latency histograms: docs/operations.md, "Engine-side metrics").
        store: dict[str, float] = {}
        if opened_store is not None:
            if self._store_deltas is None:
                self._store_deltas = _metrics.Deltas(opened_store.metrics_text)
            store = {STORE_SERIES + k: v for k, v in self._store_deltas.take().items()}
        if not any(self.interval.values()) and not store:
            return None
        stats = KvstashStats(data={**self.interval, **store})
        for k, v in self.interval.items():
            self._totals[k] = self._totals.get(k, 0) + v
            self.interval[k] = 0
        return stats

    def totals(self, sides: tuple[Any, ...]) -> dict[str, int]:
        """Every count since the connector started (take's are per interval), with those of
        `sides`, the direct path's export and import (None where closed)."""
        out = dict(self._totals)
        for k, v in self.interval.items():
            out[k] = out.get(k, 0) + v
        for side in sides:
            for k, v in (side.stats if side is not None else {}).items():
                out[k] = out.get(k, 0) + v
        return out

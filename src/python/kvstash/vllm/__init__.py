"""kvstash.vllm: a vLLM KV connector that offloads prefix chunks to a kvstash cell.

Load it as shipped, with no code in vLLM:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvstashConnector",
        "kv_connector_module_path": "kvstash.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"redis_url": "redis://10.0.0.5:6379", "cell": "prod"}}'

What it does. Every full chunk of a request's tokens (``chunk_tokens``, by default one vLLM
block) is stored as kvstash objects of a group of KV heads each (so that engines of any
tensor-parallel degree share them), per pipeline stage its layers, keyed by a SHA-256 chain
over the tokens before it and everything else its KV was computed from: the model by its
weights' content, the cache geometry, vLLM's KV-cache layout, the request's ``cache_salt`` and
LoRA adapter (by content), and the multimodal items and prompt embeddings each chunk holds
(kvstash._vllm_keys; docs/integration.md, "What a key names"). After each
forward step the chunks whose KV became complete are saved layer by layer from vLLM's paged
cache (prompt chunks, and with ``save_decode`` the chunks decode fills). When a request comes
in, the scheduler asks the cell how many leading chunks beyond vLLM's own prefix-cache hit are
stored, every object of them (one Redis round trip, no data moved, nothing changed), and
the workers load those chunks layer by layer into the blocks vLLM allocated, each layer waited
for just before its attention runs. A chunk that fails to load (evicted meanwhile, its node
dead, its checksum wrong) is reported through ``get_block_ids_with_load_errors`` and vLLM
recomputes it; a failed save is a future miss.

Config keys (``kv_connector_extra_config``), all optional: see ``KvstashConfig``.

Hybrid models (SupportsHMA: vLLM's hybrid allocator stays on): each KV-cache group, full
attention, a sliding window or Mamba state, is stored as objects of its own; a window's group
only the chunks its window still reads, a Mamba group the state a step ended on (Group,
Geometry.hit), and their loads run while the request waits, so that a failed one is the
request's (vLLM takes no failed blocks with several groups).

Limits, refused with a clear error rather than served wrong: KV-cache groups of another kind
(Mamba outside mamba_cache_mode "align" or with speculative blocks, chunked local attention,
MLA beside other groups),
block-compact layouts (each layer's blocks dense, as vLLM's default), pipeline stages that are
not the model's hidden layers one KV cache each, a hybrid model with pipeline parallelism or the
direct P/D path, KV scales computed at run time. A request whose LoRA adapter's files are not on
this host (so not to be named by content) is neither looked up nor saved.

The package, a module per role: config (KvstashConfig, the vLLM releases it is tested with),
geometry (Geometry and Group: the cache's shape and the chunks' keys), metadata (what the
scheduler hands the workers each step), role (what both roles hold), scheduler (SchedulerRole),
worker (WorkerRole), stats (the counts vLLM reports). KvstashConnector, here, is the class vLLM
loads by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

import kvstash
from kvstash.vllm.config import TESTED_VLLM, KvstashConfig, _vllm_version, check_vllm_version
from kvstash.vllm.geometry import Geometry, Group
from kvstash.vllm.metadata import BlockRead, ChunkRun, Keep, KvstashMetadata
from kvstash.vllm.role import Role
from kvstash.vllm.scheduler import SchedulerRole, log_key_options
from kvstash.vllm.stats import STORE_SERIES, Counts, KvstashPromMetrics, KvstashStats
from kvstash.vllm.worker import WorkerRole

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "TESTED_VLLM", "BlockRead", "ChunkRun", "Geometry", "Group", "Keep", "KvstashConfig", "KvstashConnector",
    "KvstashMetadata", "KvstashPromMetrics", "KvstashStats", "SchedulerRole", "STORE_SERIES", "WorkerRole",
    "check_vllm_version",
]


class KvstashConnector(KVConnectorBase_V1, SupportsHMA):
    """What vLLM loads by name ("kv_connector_module_path": "kvstash.vllm"). vLLM makes one
    connector per role, in its scheduler (KVConnectorRole.SCHEDULER) and in each worker
    (WORKER), and calls that role's hooks on it; this class checks what both roles need once
    (the config, the vLLM release, the cache geometry, kv_role and the P/D path), makes the
    role object for its role (SchedulerRole or WorkerRole), and hands each hook to it. A hook
    of the other role raises RuntimeError. get_kv_connector_stats, totals and shutdown serve
    either role."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = KvstashConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        check_vllm_version(_vllm_version(), self.config.allow_untested_vllm)
        self.geometry = Geometry.of(vllm_config, kv_cache_config, self.config)
        if role == KVConnectorRole.SCHEDULER:
            log_key_options(self.geometry)
        # Roles (vLLM's kv_role). kv_both is a cache: it looks chunks up, loads and saves them.
        # In P/D through the cell a kv_producer only saves and a kv_consumer only loads; with
        # the direct path neither uses the cell, and blocks go from prefill to decode.
        kv_role = self._kv_transfer_config.kv_role or "kv_both"
        if kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(f"kvstash: kv_role {kv_role!r} is kv_both, kv_producer or kv_consumer")
        direct = self.config.pd == "direct"
        if direct and len(self.geometry.stages) > 1:
            raise ValueError("kvstash: pd 'direct' reads a prefill rank's blocks by its tensor-parallel rank alone: "
                             "it is not served with pipeline parallelism (pd 'cell' is)")
        if direct and self.geometry.hybrid():
            raise ValueError("kvstash: pd 'direct' hands off one KV-cache group's blocks: a hybrid model is served "
                             "with pd 'cell'")
        engine_id = str(self._kv_transfer_config.engine_id or "")
        self._counts = Counts()  # this interval's, which the role adds to, and every interval's
        # The role this connector serves; the other is None.
        self._scheduler: SchedulerRole | None = None
        self._worker: WorkerRole | None = None
        self._side: Role
        if role == KVConnectorRole.SCHEDULER:
            self._side = self._scheduler = SchedulerRole(self.config, self.geometry, self._counts.interval,
                                                         vllm_config, kv_role, engine_id)
        else:
            self._side = self._worker = WorkerRole(self.config, self.geometry, self._counts.interval, kv_role,
                                                   engine_id, kv_cache_config)

    def _as_scheduler(self) -> SchedulerRole:
        if self._scheduler is None:
            raise RuntimeError("kvstash: a scheduler's hook was called on a worker's connector")
        return self._scheduler

    def _as_worker(self) -> WorkerRole:
        if self._worker is None:
            raise RuntimeError("kvstash: a worker's hook was called on the scheduler's connector")
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save lost to a preemption is a future miss

    @property
    def store(self) -> kvstash.Store:
        """The store (the cell) this connector's role uses, opened on first use."""
        return self._side.store

    # ---- scheduler side (SchedulerRole)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._as_scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        return self._as_scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._as_scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._as_scheduler().update_connector_output(connector_output)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._as_scheduler().request_finished_all_groups(request, block_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._as_scheduler().request_finished(request, block_ids)

    def reset_cache(self) -> bool:
        return self._as_scheduler().reset_cache()

    # ---- worker side (WorkerRole)

    def register_kv_caches(self, kv_caches: dict[str, Any]):
        self._as_worker().register_kv_caches(kv_caches)

    # Sleep mode (vLLM's --enable-sleep-mode): the KV cache's memory is released and mapped
    # again on wake-up, so the caches registered over it (direct RDMA and GPU registrations)
    # are dropped before and opened again after. vLLM drains transfers before it calls these.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        self._as_worker().unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._as_worker().restore_kv_caches()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._as_worker().start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._as_worker().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._as_worker().save_kv_layer(layer_name, self._get_connector_metadata())

    def wait_for_save(self):
        self._as_worker().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._as_worker().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """get_finished's, and the hybrid model's requests whose load failed (failed_recving)."""
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving |= self._as_worker().take_failed_fetches()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._as_worker().get_block_ids_with_load_errors()

    # ---- either side

    def shutdown(self):
        self._side.shutdown()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KvstashStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvstashPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self):
        return self._counts.take(self._announced, (self._export, self._import), self._side.opened_store)

    def totals(self) -> dict[str, int]:
        """Every count since the connector started (the stats above are per interval)."""
        return self._counts.totals((self._export, self._import))

    # ---- What the tests read of the connector: each role's state, under the names it had when
    # the connector held both roles' state itself. A worker's direct P/D sides and announced
    # count are None and 0 on the scheduler's connector, as they were.

    @property
    def _stats(self) -> dict[str, int]:
        """This interval's counts (Counts.interval), which the role adds to."""
        return self._counts.interval

    @property
    def _named(self) -> dict[str, tuple[str, list[bytes]] | None]:
        return self._as_scheduler()._named

    def _naming(self, request: Request) -> tuple[str, list[bytes]] | None:
        return self._as_scheduler()._naming(request)

    def _found_chunks(self, tokens: list[int], limit: int, naming: tuple[str, list[bytes]],
                      first: int = 0) -> tuple[int, Keep | None]:
        return self._as_scheduler()._found_chunks(tokens, limit, naming, first)

    @property
    def _caches(self) -> dict[str, list[kvstash.KvCache]]:
        return self._as_worker()._caches

    def _cache_for(self, request_salt: str) -> kvstash.KvCache:
        return self._as_worker()._cache_for(request_salt)

    @property
    def _export(self) -> Any:
        return self._worker._export if self._worker is not None else None

    @property
    def _import(self) -> Any:
        return self._worker._import if self._worker is not None else None

    @property
    def _announced(self) -> int:
        return self._worker._announced if self._worker is not None else 0

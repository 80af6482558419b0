"""kvstash.vllm_tier: a kvstash cell as a secondary tier behind vLLM's CPU offloading tier.

vLLM 0.34's ``TieringOffloadingSpec`` keeps offloaded KV in a CPU (primary) tier and cascades
every chunk stored there to its secondary tiers; a chunk the CPU tier no longer holds is
promoted back from a secondary tier before the GPU reads it. ``KvstashTier`` is such a tier.
vLLM loads it by module path, with no code in vLLM (the factory's out-of-tree path: ``type``
is the class name, ``module_path`` the module):

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 17179869184,
            "secondary_tiers": [{"type": "KvstashTier", "module_path": "kvstash.vllm_tier",
                                 "redis_url": "redis://10.0.0.5:6379", "cell": "prod"}]}}'

The tier's keys besides ``type`` and ``module_path`` are ``KvstashTierConfig``'s; vLLM's own
``backpressure`` key works as for its shipped tiers.

Data path. The tier registers the CPU tier's whole buffer (``primary_kv_view``, chunk ``c`` at
``c * block_size_bytes``) with its Store once (``register_memory``), and each put and get names
a chunk's slot in place: the bytes go between that slot and a memory node's pool with no
staging copy (over RDMA, from registered memory). Transfers run on ``io_threads`` threads, a
chunk per call, so that one job's chunks move in parallel; the scheduler's thread only queues
them. A store job first asks the cell, in one round trip, which of its chunks it already
holds (another engine of the fleet may have put them) and puts only the others.

Lookups. vLLM calls ``lookup`` once per chunk on the scheduler's thread, under the tiering
manager's lock. A round trip to Redis there would stall every request behind it, so lookups
are asynchronous, with vLLM's own ``AsyncLookupManager`` (as its fs and obj tiers): a chunk
not seen before answers RETRY, the step's new chunks go to the cell as one ``contains_each``
(one round trip for the step's chunks of a request) when the step ends, and the next step's
lookup answers HIT or MISS. The request waits one step, not a Redis round trip per chunk. A
completed store marks its chunks present, a failed load marks its failed chunks missing.

What a key names. vLLM's ``OffloadKey`` is a chunk's block hash and its KV-cache group: the
hash chains the tokens of every block up to the chunk's end, with what vLLM puts beside them
(``generate_block_hash_extra_keys``: the LoRA adapter's name and path, each multimodal item's
hash, the request's ``cache_salt``, the prompt embeddings' SHA-256), from a seed that is fixed
for SHA-256 (vLLM's default hash) and random per process for xxhash unless ``PYTHONHASHSEED``
is set. It does not name what one process never changes, so the key adds a namespace: 128 bits
of the SHA-256 of the model's weights by their content (``kvstash._identity``, as kvstash.vllm
names them, or ``weights_id``), the KV-cache dtype, tokens per hash and blocks per chunk, each
KV-cache group's block size and layer names, the KV-cache layout (or the canonical format),
the parallel layout (tensor, pipeline and context parallel sizes and worker bytes per block,
left out where vLLM certifies the bytes parallelism-agnostic), the chunk's bytes in the CPU
tier, and the operator's ``model`` label and ``extra``. A key is
``vllm-tier:<namespace>:<block hash, hex>:g<group>``, routed among cells by the whole key.

Not named, so the operator's to keep apart (``extra``): runtime overrides of the model's
configuration that change the KV (``--hf-overrides``, ``--quantization``, a load format), which
vLLM's offloading spec does not carry to the tier; the checkpoint's own config.json is in the
weights' digest. A LoRA adapter is named as vLLM's hash names it, by name and path, not by
content (the tier sees only the hash). These keys are not kvstash.vllm's: a cell serves both,
but the connector and the tier do not share chunks.

Failures never reach the engine as exceptions. A chunk that does not load (evicted or removed
since the lookup, its node dead, its checksum wrong, a timeout) fails its promotion job with
``successful_keys`` naming the chunks that did load: vLLM keeps those and recomputes the rest.
A chunk whose checksum failed is removed from the cell (``remove_corrupt``), so that later
lookups miss it instead of failing again. A failed put fails its store job (the chunk stays in
the CPU tier; the cell has it or not). A lookup that cannot reach the cell is a miss.

Metrics. Each job reports ``transfer_bytes`` (bytes moved) and ``transfer_time`` (from its first
transfer's start to its last one's end), which vLLM counts as
``vllm:kv_offload_tiering_{read,write}_{bytes,time}`` for this tier; its promotion and cascade
failures are counted there too. The tier adds ``vllm:kv_offload_kvstash_chunk_failures``, by
operation and kvstash status code.

vLLM 0.34's tier interface has no touch hook (recency goes to the cell with each get), and this
tier emits no KV events (the cell's ``kvstash events`` relay publishes its objects).
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvstash
from kvstash import _identity
from kvstash._cell import CellConfig

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

KEY_PREFIX = "vllm-tier:"
CHUNK_FAILURES = "vllm:kv_offload_kvstash_chunk_failures"


@dataclass
class KvstashTierConfig(CellConfig):
    """A ``secondary_tiers`` entry's keys: where the cell is (CellConfig) and how chunks move."""

    io_threads: int = 8  # transfers in flight at once (each a chunk's put or get)
    replicas: int = 1  # copies of each chunk on distinct memory nodes (1-4)
    model: str = ""  # a label for the model in the keys, besides its weights' content
    # A string that names the weights' content (a digest the operator vouches for): the files
    # are then not read. "": the SHA-256 of the files vLLM loads, computed at start (cached).
    weights_id: str = ""
    extra: str = ""  # anything else that changes the KV bytes and vLLM's offloading spec does not say
    locality: str = "REMOTE"  # vLLM's tier locality ("LOCAL" or "REMOTE"), for its load filters

    WHERE: ClassVar[str] = "the KvstashTier entry of secondary_tiers"

    def check(self) -> None:
        if self.io_threads < 1:
            raise ValueError("kvstash: io_threads must be >= 1")
        if not 1 <= self.replicas <= 4:
            raise ValueError("kvstash: replicas must be within [1, 4]")
        if self.locality.upper() not in ("LOCAL", "REMOTE"):
            raise ValueError("kvstash: locality is 'LOCAL' or 'REMOTE'")


def namespace(offloading_spec: OffloadingSpec, chunk_bytes: int, config: KvstashTierConfig) -> str:
    """What the keys of this engine's chunks name besides vLLM's block hash: 128 bits (hex) of
    the SHA-256 of everything the chunk's bytes depend on that the hash leaves out (module
    docstring). ValueError when the weights are not on this host and no weights_id names them."""
    c = offloading_spec.config
    weights = config.weights_id or _identity.weights_name_at(_identity.local_path(c.model.name), c.model.name,
                                                            KvstashTierConfig.WHERE)
    layout: str | None = c.kv_cache_layout
    if c.canonical_layout and layout is not None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id

        layout = "canonical:" + canonical_format_id(layout)
    p = c.parallel
    # Where vLLM certifies the bytes are the same under any topology (canonical pages, or one
    # copy of an MLA latent), the topology is not named, so that engines of any degree share.
    agnostic = p.is_parallelism_agnostic or c.replicated_layout
    parts: dict[str, Any] = {
        "format": "kvstash.vllm_tier.v1",
        "weights": weights,
        "label": config.model,
        "dtype": c.model.dtype,
        "tokens_per_hash": c.cache.tokens_per_hash,
        "blocks_per_chunk": c.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in c.groups],
        "layout": layout,
        "replicated": bool(c.replicated_layout),
        "parallel": None if agnostic else [p.tp_size, p.pp_size, p.pcp_size, p.dcp_size, p.world_size,
                                           c.worker_kv_bytes_per_block],
        "chunk_bytes": chunk_bytes,
        "extra": config.extra,
    }
    return _identity.short(hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest())


class _Lookups(AsyncLookupManager):
    """vLLM's asynchronous lookup front end, asking the cell on its own thread."""

    def __init__(self, tier: KvstashTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        # An error is the base class's to turn into misses (and log).
        return self._tier.store.contains_each([self._tier.key(k) for k in keys])


class _Job:
    """A submitted job's progress, shared by the threads moving its chunks (under the tier's lock)."""

    __slots__ = ("job_id", "keys", "is_load", "left", "ok", "moved", "first_start", "last_end")

    def __init__(self, job_id: JobId, keys: list[OffloadKey], is_load: bool) -> None:
        self.job_id = job_id
        self.keys = keys
        self.is_load = is_load
        self.left = len(keys)
        self.ok = [False] * len(keys)
        self.moved = 0  # bytes that went over the wire
        self.first_start: float | None = None
        self.last_end: float | None = None


class KvstashTier(SecondaryTierManager):
    """A secondary tier in a kvstash cell (module docstring).

    Thread safety: vLLM calls the tier's methods under its tiering manager's lock, one at a time;
    the transfer threads share only the jobs' progress and the finished results with them, under
    the tier's own lock.
    """

    medium: ClassVar[Medium] = Medium.CPU  # the memory nodes' DRAM pools
    # Not HOST: that would count a hit from the cell as one from this host's CPU tier.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, **options: Any) -> None:
        """options: the tier's entry in ``secondary_tiers`` less what vLLM's factory takes
        (KvstashTierConfig; ValueError naming an unknown or ill-typed key). kvstash.Error when
        the cell cannot be opened: the engine does not start without its tier."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = KvstashTierConfig.from_extra(options)
        self.locality = Locality(self.config.locality.upper())
        self._namespace = namespace(offloading_spec, self.block_size_bytes, self.config)
        self._key_head = f"{KEY_PREFIX}{self._namespace}:"

        # One flat byte view of the CPU tier: a chunk's slot is a slice of it, passed to puts and
        # gets as the buffer itself (a memoryview of more than one dimension cannot be sliced).
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view[:]
        self.store = self.config.open_store()
        if self._flat.nbytes:
            pinned = (ctypes.c_char * self._flat.nbytes).from_buffer(self._flat)
            try:
                self.store.register_memory(ctypes.addressof(pinned), self._flat.nbytes)
            finally:
                del pinned  # the buffer export, so that the view can be released at shutdown

        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: dict[JobId, _Job] = {}  # submitted, not yet finished
        self._finished: list[tuple[JobResult, _Job]] = []  # with the job, for its keys
        self._failures: collections.Counter[tuple[str, str]] = collections.Counter()  # (op, code) -> chunks
        self._pool = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvstash_tier")
        self._lookups = _Lookups(self)
        logger.info("kvstash tier: cell %s at %s, keys %s*", self.config.cell, self.config.redis_url,
                    self._key_head)

    def key(self, key: OffloadKey) -> str:
        """The kvstash key of vLLM's chunk `key` (module docstring, "What a key names")."""
        return f"{self._key_head}{get_offload_block_hash(key).hex()}:g{get_offload_group_idx(key)}"

    # ---- vLLM's calls (scheduler thread, under the manager's lock; none blocks on the cell) ----

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def submit_store(self, job_metadata: TransferJob) -> None:
        job = self._start(job_metadata, is_load=False)
        if job.keys:
            self._pool.submit(self._plan_store, job, [int(c) for c in job_metadata.chunk_ids])

    def submit_load(self, job_metadata: TransferJob) -> None:
        job = self._start(job_metadata, is_load=True)
        for i, chunk in enumerate(job_metadata.chunk_ids):
            self._pool.submit(self._move, job, i, int(chunk))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._finished = self._finished, []
        for result, job in done:
            if not job.is_load:
                if result.success:
                    self._lookups.mark_present(job.keys)
            elif not result.success:
                self._lookups.mark_miss([k for k, ok in zip(job.keys, job.ok) if not ok])
        return [result for result, _ in done]

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._jobs) or bool(self._finished)

    def drain_jobs(self) -> None:
        """Waits for every submitted job: each chunk's transfer ends by its deadline (timeout_ms),
        so this returns within a deadline per chunk queued on a thread."""
        with self._idle:
            self._idle.wait_for(lambda: not self._jobs)

    def shutdown(self) -> None:
        """Ends the lookups and the transfers (those running finish: they write the CPU tier's
        memory), then closes the store and lets go of the CPU tier's buffer, before vLLM unmaps it."""
        self._lookups.shutdown()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.store = None  # deregisters the buffer
        self._flat.release()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {CHUNK_FAILURES: OffloadingCounterMetadata(
            documentation="Chunks the kvstash tier failed to put (op 'put') or get (op 'get'), by kvstash status "
                          "code (not_found, corrupt, unavailable, timeout, no_space, ...).",
            labelnames=("op", "code"))}

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._lock:
            if not self._failures:
                return None
            failures, self._failures = self._failures, collections.Counter()
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        for labels, n in failures.items():
            stats.increase_counter(CHUNK_FAILURES, n, labels)
        return stats

    # ---- Transfer threads ----

    def _start(self, job_metadata: TransferJob, is_load: bool) -> _Job:
        keys = list(job_metadata.keys)
        assert len(keys) == len(job_metadata.chunk_ids)
        job = _Job(job_metadata.job_id, keys, is_load)
        with self._lock:
            self._jobs[job.job_id] = job
            if not keys:
                self._finish(job)
        return job

    def _slot(self, chunk: int) -> memoryview:
        at = chunk * self.block_size_bytes
        return self._flat[at:at + self.block_size_bytes]

    def _plan_store(self, job: _Job, chunks: list[int]) -> None:
        """A store job's chunks the cell lacks are put; those it holds count as stored."""
        try:
            present = self.store.contains_each([self.key(k) for k in job.keys])
        except Exception as e:  # the puts will tell whether the cell is there
            logger.debug("kvstash tier: presence check of job %d failed: %s", job.job_id, e)
            present = [False] * len(job.keys)
        for i, chunk in enumerate(chunks):
            if present[i]:
                self._done(job, i, True, 0.0, 0.0, 0)
            else:
                self._pool.submit(self._move, job, i, chunk)

    def _move(self, job: _Job, i: int, chunk: int) -> None:
        """One chunk between its CPU-tier slot and the cell, in place; its outcome into the job."""
        key = self.key(job.keys[i])
        start = time.monotonic()
        ok, code = False, ""
        try:
            if job.is_load:
                self.store.get(key, [self._slot(chunk)])
            else:
                self.store.put(key, [self._slot(chunk)], ttl_ms=self.config.ttl_ms, replicas=self.config.replicas)
            ok = True
        except kvstash.Error as e:
            code = getattr(e, "code", "error")
            logger.debug("kvstash tier: %s of %s failed: %s", "get" if job.is_load else "put", key, e)
        except Exception as e:  # never an exception out of a transfer thread: the job would never finish
            code = type(e).__name__
            logger.warning("kvstash tier: %s of %s failed: %r", "get" if job.is_load else "put", key, e)
        end = time.monotonic()
        if code == "corrupt":
            self._remove_corrupt(key)
        self._done(job, i, ok, start, end, self.block_size_bytes if ok else 0, code)

    def _remove_corrupt(self, key: str) -> None:
        """A chunk whose bytes failed their checksum leaves the cell: later lookups miss it
        rather than fail its load again, and a recompute's store puts it anew."""
        try:
            self.store.remove_corrupt(key)
            logger.warning("kvstash tier: chunk %s failed its checksum and is removed from the cell", key)
        except kvstash.Error as e:
            logger.warning("kvstash tier: corrupt chunk %s could not be removed: %s", key, e)

    def _done(self, job: _Job, i: int, ok: bool, start: float, end: float, moved: int, code: str = "") -> None:
        with self._lock:
            job.ok[i] = ok
            job.moved += moved
            if moved:
                job.first_start = start if job.first_start is None else min(job.first_start, start)
                job.last_end = end if job.last_end is None else max(job.last_end, end)
            if not ok:
                self._failures["get" if job.is_load else "put", code or "error"] += 1
            job.left -= 1
            if job.left == 0:
                self._finish(job)

    def _finish(self, job: _Job) -> None:
        """The job's result, for get_finished_jobs (the lock held)."""
        success = all(job.ok)
        loaded = None
        if job.is_load and not success:
            loaded = tuple(k for k, ok in zip(job.keys, job.ok) if ok) or None
        took = None if job.first_start is None else job.last_end - job.first_start
        result = JobResult(job_id=job.job_id, success=success, successful_keys=loaded, transfer_time=took,
                           transfer_bytes=job.moved)
        self._finished.append((result, job))
        del self._jobs[job.job_id]
        self._idle.notify_all()

"""kvstash.sglang: an SGLang HiCache storage backend over a kvstash cell.

SGLang loads it as shipped, as a dynamic backend:

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
          "backend_name": "kvstash", "module_path": "kvstash.sglang",
          "class_name": "KvstashHiCacheStorage", "redis_url": "redis://10.0.0.5:6379"}'

SGLang names each page of its host KV cache by a hash chain over the tokens (its own keys,
seeded with the request's LoRA adapter id and cache salt; multimodal items enter as their
hashes in the token ids); each page is one kvstash object, under that key prefixed with the
engine's model by content (``engine_identity``: the weights' bytes, not their path or served
name, the dtype, quantization, KV-cache dtype and config overrides, and the content of every
adapter of ``--lora-paths``), the host pool's layout and dtype, and, except for MLA (one copy
that every rank reads, per context-parallel shard), the tensor-, pipeline- and context-parallel
rank. A page moves between
SGLang's host pool and the cell in place (``batch_get_v1`` / ``batch_set_v1``: the pool's
buffers registered once, no copy through Python); ``get`` / ``set`` move one tensor. A hybrid
model's other pools (a sliding window's KV, Mamba state: HiCache's v2 pool transfers) store
their pages as objects of their own, and a lookup folds every pool in one round trip.

Config keys (besides the three SGLang reads): see ``KvstashHiCacheConfig``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

import uuid

import kvstash
from kvstash import _identity, _metrics
from kvstash._cell import CellConfig

logger = logging.getLogger(__name__)

@dataclass
class KvstashHiCacheConfig(CellConfig):
    """``--hicache-storage-backend-extra-config`` keys kvstash reads: where the cell is
    (CellConfig), and how many pages of a batch move at once."""

    threads: int = 8  # pages in flight at once in a batch
    # A string that names the weights' content ("sha256:<hex>" as `python -m kvstash._identity`
    # prints it, or a digest the operator vouches for): the weights' files are then not read.
    # "": their SHA-256, computed at start (cached across restarts). Needed where SGLang's
    # server arguments are not at hand (a backend made outside a server).
    weights_id: str = ""

    WHERE: ClassVar[str] = "HiCache extra config"
    # Keys SGLang itself reads (interface_v1: 1 selects the in-place page variants).
    ENGINE_KEYS: ClassVar[frozenset[str]] = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})

    def check(self) -> None:
        if self.threads < 1:
            raise ValueError("kvstash: threads must be > 0")


def _server_args() -> Any:
    """SGLang's server arguments in this process (its scheduler's), or None outside a server."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:
        return None


def _adapters(lora_paths: Any) -> list[tuple[str, str]]:
    """(name, path) of every adapter of --lora-paths, in whichever form SGLang holds them."""
    if not lora_paths:
        return []
    items = lora_paths.items() if isinstance(lora_paths, dict) else lora_paths
    out = []
    for item in items:
        if isinstance(item, tuple):
            name, path = item
        elif isinstance(item, str):
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
        elif isinstance(item, dict):
            name, path = item.get("lora_name", ""), item.get("lora_path", "")
        else:
            name, path = getattr(item, "lora_name", ""), getattr(item, "lora_path", "")
        out.append((str(name), str(path)))
    return sorted(out)


def engine_identity(weights_id: str = "") -> str:
    """The engine's model as its pages' keys name it: a 128-bit digest of the weights' content
    (or `weights_id`), dtype, quantization, KV-cache dtype, load format, config overrides, and
    the content of each adapter SGLang loads at start (--lora-paths: their ids there are the
    adapter's name and path, which a rewritten adapter keeps; adapters loaded later get ids of
    their own, which no other engine shares). ValueError when what names it cannot be read."""
    args = _server_args()
    if args is None and not weights_id:
        raise ValueError("kvstash: SGLang's server arguments are not set in this process, so the model cannot be "
                         "named by its content: set weights_id in the HiCache extra config")
    parts: dict[str, Any] = {}
    if args is not None:
        for name in ("dtype", "quantization", "kv_cache_dtype", "load_format", "json_model_override_args"):
            parts[name] = str(getattr(args, name, None))
        adapters = []
        for name, path in _adapters(getattr(args, "lora_paths", None)):
            where = _identity.local_path(path)
            if where is None:
                raise ValueError(f"kvstash: LoRA adapter {name!r} ({path}) is not on this host to be named by its "
                                 f"content")
            adapters.append([name, _identity.content_digest(where)])
        parts["lora"] = adapters
    dummy = "dummy" if str(getattr(args, "load_format", "")) == "dummy" else ""
    parts["weights"] = weights_id or dummy or _identity.weights_name_at(
        _identity.local_path(str(args.model_path), getattr(args, "revision", None)), str(args.model_path),
        "the HiCache extra config")
    identity = _identity.digest_of(parts)
    logger.info("kvstash: this engine's pages are keyed by model %s (weights %s)", identity, parts["weights"])
    return identity


def _new_metrics():
    from sglang.srt.observability.metrics_collector import StorageMetrics

    return StorageMetrics()


_recorder: _metrics.Recorder | None = None


def _store_recorder() -> _metrics.Recorder:
    """The process's one recorder of stores' metrics into prometheus_client (which SGLang's
    /metrics serves, across its processes in multiprocess mode): sglang:kvstash_*, labelled
    with the model and the tensor-parallel rank."""
    global _recorder
    if _recorder is None:
        from prometheus_client import Counter, Histogram

        _recorder = _metrics.Recorder(Counter, Histogram, ["model_name", "tp_rank"], prefix="sglang:")
    return _recorder


class KvstashHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        self.storage_config = storage_config
        self.config = KvstashHiCacheConfig.from_extra(storage_config.extra_config)
        self.store = self.config.open_store()
        self.identity = engine_identity(self.config.weights_id)
        self.prefix = self._prefix(storage_config, None)
        self.writer = storage_config.is_storage_writer
        self.mem_pool_host = None
        self._io = ThreadPoolExecutor(self.config.threads, thread_name_prefix="kvstash-hicache")
        # Counts since the start, and SGLang's per-interval metrics (get_stats hands them over).
        self.stats = {"pages_got": 0, "pages_get_failed": 0, "pages_set": 0, "pages_set_failed": 0,
                      "pages_existed": 0}
        self._metrics = _new_metrics()
        self._store_deltas = _metrics.Deltas(self.store.metrics_text)
        # Under turn-ttl: each page's use as its request's prefetch lookup saw it (KeepHint), by
        # cell key, for the gets and puts of that page that follow; the oldest forgotten.
        self._keeps: OrderedDict[str, kvstash.KeepHint] = OrderedDict()
        if kwargs and kwargs.get("mem_pool_host") is not None:
            self.register_mem_pool_host(kwargs["mem_pool_host"])

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _prefix(self, s: HiCacheStorageConfig, pool: Any) -> str:
        """What a page's key is salted with besides SGLang's own key: the model by content
        (engine_identity), the rank's shard, and (once the host pool is known) its layout and
        dtype, so that pools laying the same tokens out differently never share a page (the
        sizes can match: a layer_first page loaded into a page_first pool would be scrambled,
        not refused)."""
        if s.is_mla_model:
            shard = "mla"  # one latent copy every rank reads, unless context parallelism splits it
            cp, dcp = getattr(s, "attn_cp_size", 1) or 1, getattr(s, "dcp_size", 1) or 1
            if cp > 1:
                shard += f".cp{s.attn_cp_rank}of{cp}"
            if dcp > 1:
                shard += f".dcp{s.dcp_rank}of{dcp}"
        else:
            shard = f"tp{s.tp_rank}of{s.tp_size}.pp{s.pp_rank}of{s.pp_size}"
            if (getattr(s, "attn_cp_size", 1) or 1) > 1:
                shard += f".cp{s.attn_cp_rank}of{s.attn_cp_size}"
        pool_part = ""
        if pool is not None:
            dtype = str(getattr(pool, "dtype", "")).removeprefix("torch.")
            pool_part = f"{getattr(pool, 'layout', 'layout?')}.{dtype}:"
        return f"sgl:{self.identity}:{shard}:{pool_part}"

    # ---- the host pool, registered once (zero-copy for RDMA)

    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)
        self.prefix = self._prefix(self.storage_config, mem_pool_host)
        self._register_buffers(mem_pool_host)

    def _register_buffers(self, pool: Any) -> None:
        """A host pool's buffers registered with the store once: its pages move in place."""
        for name in ("kv_buffer", "temporal_buffer", "conv_buffer"):  # KV pools; Mamba's state
            buffers = getattr(pool, name, None)
            for t in buffers if isinstance(buffers, (list, tuple)) else [buffers]:
                if isinstance(t, torch.Tensor) and t.numel() > 0 and not t.is_cuda:
                    self.store.register_memory(t.data_ptr(), t.numel() * t.element_size())

    # ---- a hybrid model's other host pools (HiCache's v2 interface: SWA, Mamba, indexer...)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        """Another pool of a hybrid model (a sliding window's KV, Mamba state, ...): its pages are
        objects of their own, keyed by the same page hash, the pool's name, layout and dtype."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register_buffers(host_pool)

    def _pool(self, name: Any) -> Any:
        if str(name) == "kv":
            return self.mem_pool_host
        pool = getattr(self, "registered_pools", {}).get(name)
        if pool is None:
            raise ValueError(f"kvstash: HiCache pool {name} was never registered (register_mem_host_pool_v2)")
        return pool

    def _pool_keys(self, name: Any, keys: list[str]) -> list[str]:
        """The cell's keys of pool `name`'s pages (the KV pool's are v1's)."""
        if str(name) == "kv":
            return [self._key(k) for k in keys]
        prefix = self._prefix(self.storage_config, self._pool(name))
        return [f"{prefix}{name}:{k}" for k in keys]

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """The usable prefix of `keys` (HiCache's fold): the KV pool's leading pages, cut by each
        other pool's: every page for ALL_PAGES, the last len(transfer.keys) pages before the
        cut for TRAILING_PAGES (a window's KV, Mamba state). One round trip for every pool."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult

        transfers = list(pool_transfers or [])
        if not keys:
            return PoolTransferResult(0, {})
        asked = self._pool_keys(PoolName.KV, keys)
        for t in transfers:
            asked += self._pool_keys(t.name, keys)
        try:
            present = self.store.contains_each(asked, timeout_ms=self.config.timeout_ms)
        except kvstash.Error as e:
            logger.warning("kvstash: exists of %d pages failed, treating them as missing: %s", len(keys), e)
            return PoolTransferResult(0, {})
        n = len(keys)
        kv = next((i for i in range(n) if not present[i]), n)
        hits: dict[Any, int] = {PoolName.KV: kv} if kv else {}
        final = kv
        for j, t in enumerate(transfers):
            if final == 0:
                break
            has = present[(j + 1) * n:(j + 2) * n]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                cut = next((i for i in range(kv) if not has[i]), kv)
            else:  # the trailing pages of some prefix: the longest whose tail is stored
                trailing = max(1, len(t.keys) if t.keys else 1)
                cut = next((end for end in range(kv, 0, -1) if all(has[max(0, end - trailing):end])), 0)
            if cut:
                hits[t.name] = cut
            final = min(final, cut)
        return PoolTransferResult(final, hits)

    def _move_v2(self, transfers: list, move: Any, skip_stored: bool = False) -> tuple[dict[str, list[bool]], int]:
        """Each transfer's pages moved by `move` (a cell key, the page's buffers), and how many
        were skipped: with `skip_stored`, those the cell holds already (one round trip a pool)
        count as moved."""
        out, skipped = {}, 0
        for t in transfers:
            keys = self._pool_keys(t.name, list(t.keys or []))
            if not keys:
                out[t.name] = []
                continue
            pages = self._page_buffers(keys, t.host_indices, self._pool(t.name))
            done = [False] * len(keys)
            if skip_stored:
                try:
                    done = self.store.contains_each(keys, timeout_ms=self.config.timeout_ms)
                except kvstash.Error as e:
                    logger.warning("kvstash: exists of %d pages failed, storing them all: %s", len(keys), e)
                skipped += sum(done)
            todo = [i for i, ok in enumerate(done) if not ok]
            for i, ok in zip(todo, self._io.map(move, [keys[i] for i in todo], [pages[i] for i in todo])):
                done[i] = ok
            out[t.name] = done
        return out, skipped

    def batch_get_v2(self, transfers: list, extra_info: Any = None) -> dict[str, list[bool]]:
        """Each pool's pages into its host pool's slots; per pool, which arrived."""
        done, _ = self._move_v2(transfers, self._get_key)
        got = sum(sum(v) for v in done.values())
        self.stats["pages_got"] += got
        self.stats["pages_get_failed"] += sum(len(v) for v in done.values()) - got
        return done

    def batch_set_v2(self, transfers: list, extra_info: Any = None) -> dict[str, list[bool]]:
        """Each pool's pages from its host pool into the cell (those stored already are not put
        again); per pool, which are stored."""
        done, existed = self._move_v2(transfers, self._put_key, skip_stored=True)
        stored = sum(sum(v) for v in done.values())
        self.stats["pages_existed"] += existed
        self.stats["pages_set"] += stored - existed
        self.stats["pages_set_failed"] += sum(len(v) for v in done.values()) - stored
        return done

    def _get_key(self, key: str, buffers: list[tuple[int, int]]) -> bool:
        """A page by its cell key into `buffers` (no prefix added)."""
        try:
            self.store.get(key, into=buffers, timeout_ms=self.config.timeout_ms, keep=self._keeps.get(key))
            return True
        except kvstash.Error as e:
            if e.code != "not_found":
                logger.warning("kvstash: page %s did not load: %s", key, e)
            return False

    def _put_key(self, key: str, buffers: list[tuple[int, int]], keep: kvstash.KeepHint | None = None) -> bool:
        """A page from `buffers` under its cell key (no prefix added)."""
        try:
            self.store.put(key, buffers, ttl_ms=self.config.ttl_ms, timeout_ms=self.config.timeout_ms,
                           keep=keep or self._keeps.get(key))
            return True
        except kvstash.Error as e:
            logger.warning("kvstash: page %s was not stored: %s", key, e)
            return False

    def _page_buffers(self, keys: list[str], host_indices: torch.Tensor,
                      pool: Any = None) -> list[list[tuple[int, int]]]:
        ptrs, sizes = (pool or self.mem_pool_host).get_page_buffer_meta(host_indices)
        if not keys or len(ptrs) % len(keys):
            raise ValueError(f"kvstash: {len(ptrs)} page buffers for {len(keys)} keys")
        per = len(ptrs) // len(keys)
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per])) for i in range(len(keys))]

    # ---- existence

    def exists(self, key: str) -> bool:
        return self._lookup([key], None)[0] == 1

    KEEPS_REMEMBERED: ClassVar[int] = 1 << 16

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages are stored: one Redis script for the whole run. The pages' uses
        are remembered for a turn-ttl cell (a prefetch's lookup: the request's)."""
        hit, hints = self._lookup(keys, extra_info)
        for key, hint in zip(map(self._key, keys), hints or ()):
            self._keeps[key] = hint
            self._keeps.move_to_end(key)
        while len(self._keeps) > self.KEEPS_REMEMBERED:
            self._keeps.popitem(last=False)
        return hit

    def _lookup(self, keys: list[str], extra_info: Any) -> tuple[int, list[kvstash.KeepHint] | None]:
        """How many leading pages of `keys` are stored, and, under turn-ttl, each page's use: the
        request's turn and lookup clock, its place after SGLang's prefix_keys (the pages before
        these, from the sequence's start)."""
        if not keys:
            return 0, None
        cell_keys = [self._key(k) for k in keys]
        try:
            hit, turn, clock = self.store.lookup_prefix(cell_keys, timeout_ms=self.config.timeout_ms)
        except kvstash.Error as e:
            logger.warning("kvstash: exists of %d pages failed, treating them as missing: %s", len(keys), e)
            return 0, None
        if not clock:  # another policy: no hints
            return hit, None
        before = len(getattr(extra_info, "prefix_keys", None) or ())
        tokens = getattr(self.mem_pool_host, "page_size", 0)
        split = kvstash.keep_key_hash(cell_keys[min(hit, len(keys) - 1)])
        return hit, [kvstash.KeepHint(turn=turn, chunks=before + len(keys), index=before + i, tokens=tokens,
                                      key_hash=kvstash.keep_key_hash(k), split_hash=split, looked_up=clock)
                     for i, k in enumerate(cell_keys)]

    # ---- pages in place (SGLang's zero-copy variants)

    def _get_one(self, key: str, buffers: list[tuple[int, int]]) -> bool:
        return self._get_key(self._key(key), buffers)

    def _set_one(self, key: str, buffers: list[tuple[int, int]], keep: kvstash.KeepHint | None = None) -> bool:
        return self._put_key(self._key(key), buffers, keep)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        pages = self._page_buffers(keys, host_indices)
        t0 = time.perf_counter()
        done = list(self._io.map(self._get_one, keys, pages))
        self._record(self._metrics.prefetch_pgs, self._metrics.prefetch_bandwidth, pages, done, t0)
        self.stats["pages_got"] += sum(done)
        self.stats["pages_get_failed"] += len(done) - sum(done)
        return done

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)  # MLA: the storage writer's copy serves every rank
        # Pages chain: the leading ones stored already (by this or another engine) are skipped.
        # A page's use is its request's prefetch's if remembered (this lookup, by the request's
        # own backup, would count the turn on from its earlier pages), else this lookup's.
        stored, hints = self._lookup(keys, extra_info)
        hints = [self._keeps.get(self._key(k)) or h for k, h in zip(keys, hints)] if hints else [None] * len(keys)
        self.stats["pages_existed"] += stored
        pages = self._page_buffers(keys, host_indices)
        t0 = time.perf_counter()
        done = [True] * stored + list(self._io.map(self._set_one, keys[stored:], pages[stored:], hints[stored:]))
        self._record(self._metrics.backup_pgs, self._metrics.backup_bandwidth, pages[stored:], done[stored:], t0)
        self.stats["pages_set"] += sum(done[stored:])
        self.stats["pages_set_failed"] += len(done) - sum(done)
        return done

    # ---- one tensor at a time (the generic interface)

    @staticmethod
    def _tensor_buffer(t: torch.Tensor) -> list:
        # SGLang hands storage its host pool's pages, written by its own device-to-host copy
        # before a backup and read by its host-to-device copy after a load: kvstash moves host
        # bytes only, and orders nothing against a GPU stream. A GPU tensor here would be read
        # by the host behind the back of the streams that write it.
        if t.is_cuda:
            raise ValueError("kvstash: HiCache storage moves host pages; a CUDA tensor must go through SGLang's "
                             "host pool first")
        if not t.is_contiguous():
            raise ValueError("kvstash: a page tensor must be contiguous")
        # A buffer object over the tensor's bytes, not its address: the store takes raw
        # addresses only inside memory registered with it (the host pool's pages are).
        return [t.reshape(-1).view(torch.uint8).numpy()]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        if target_location is None:
            try:
                data = self.store.get(self._key(key), timeout_ms=self.config.timeout_ms)
            except kvstash.Error:
                return None
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return target_location if self._get_one(key, self._tensor_buffer(target_location)) else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        return [self.get(k, t) for k, t in zip(keys, target_locations or [None] * len(keys))]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if not self.writer:
            return True
        if self.exists(key):
            return True
        return self._set_one(key, self._tensor_buffer(value))

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self.set(k, v) for k, v in zip(keys, values))

    def clear(self) -> None:
        """SGLang's clear of its storage (the clear_hicache_storage request): the cell is shared
        with other engines, so its pages go by TTL and eviction, never all at once; this engine's
        keys become its own from now on (a new epoch in their prefix), so it finds none of the
        pages stored before, and no other engine finds the ones it stores after."""
        self.identity = f"{self.identity}.epoch-{uuid.uuid4().hex[:16]}"
        self.prefix = self._prefix(self.storage_config, self.mem_pool_host)
        logger.info("kvstash: clear(): this engine's pages are its own from now on; the cell's go by TTL and "
                    "eviction")

    @staticmethod
    def _record(pgs: list, bandwidth: list, pages: list, done: list[bool], t0: float) -> None:
        """One batch in SGLang's metrics: pages moved, and GB/s of the pages that moved."""
        seconds = time.perf_counter() - t0
        moved = sum(n for page, ok in zip(pages, done) if ok for _, n in page)
        pgs.append(sum(done))
        if seconds > 0 and moved:
            bandwidth.append(moved / seconds / 1e9)

    def get_stats(self):
        """SGLang's StorageMetrics of the interval since the last call (with
        --enable-storage-metrics); the counts since the start stay in `stats`. The store's own
        metrics (docs/operations.md, "Engine-side metrics") go to SGLang's Prometheus endpoint
        at the same time, as sglang:kvstash_*."""
        c = self.storage_config
        _store_recorder().record(self._store_deltas.take(), [c.model_name or "", str(c.tp_rank)])
        out, self._metrics = self._metrics, _new_metrics()
        return out

    def close(self):
        self._io.shutdown(wait=True)

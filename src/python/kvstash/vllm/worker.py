"""A worker's side of the connector (WorkerRole): its rank's KV-cache tensors registered as
kvstash caches (one per KV-cache group, and per request salt), the loads each step starts and
each layer waits for before its attention runs, the saves each layer adds to once its attention
wrote it and the step waits for (their commits announcing the chunks to routers: KV events), the
direct P/D path's export (a prefill's blocks held for its decode) and import (a decode's reads),
and the blocks and requests whose loads failed, reported back to vLLM.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import kvstash
from kvstash import _handoff
from kvstash.vllm.metadata import ChunkRun, KvstashMetadata
from kvstash.vllm.role import Role

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvstash.vllm.config import KvstashConfig
    from kvstash.vllm.geometry import Geometry

logger = logging.getLogger(__name__)


class WorkerRole(Role):
    """A worker's side of the connector, which vLLM's model runner calls from its forward pass."""

    def __init__(self, config: KvstashConfig, geometry: Geometry, stats: dict[str, int], kv_role: str,
                 engine_id: str, kv_cache_config: KVCacheConfig):
        super().__init__(config, geometry, stats, engine_id)
        self._kv_role = kv_role  # vLLM's kv_role (KvstashConnector): which direct P/D sides open
        self._kv_cache_config = kv_cache_config
        self._export: _handoff.PrefillExport | None = None
        self._import: _handoff.DecodeReads | None = None
        self._unheld: set[str] = set()  # holds no export can serve: freed at the next get_finished
        self._unread: set[str] = set()  # reads no import can do: failed at the next get_finished
        self._caches: OrderedDict[str, list[kvstash.KvCache]] = OrderedDict()  # by request salt; "" first
        self._tensors: list[list[Any]] = []  # each KV-cache group's layers' tensors
        self._pointers: list[list[int]] = []  # and where each layer's block 0 is
        self._layer_index: dict[str, tuple[int, int]] = {}  # layer -> (its group, its index there)
        self._tp_rank = 0
        self._stage = 0  # pipeline parallelism: the stage whose layers this worker holds
        # (run, KV-cache group, its first chunk, the KvLoad or KvSave)
        self._loads: list[tuple[ChunkRun, int, int, Any]] = []
        self._saves: list[tuple[ChunkRun, int, int, Any]] = []
        self._saving = False  # this step's saves have begun
        # A hybrid model's loads, by request: (its groups' loads, whether some block is unfilled)
        self._fetches: dict[str, tuple[list[tuple[ChunkRun, int, int, Any]], bool]] = {}
        self._failed_fetches: set[str] = set()
        self._load_errors: set[int] = set()
        self._events_off_until = 0.0  # KV events: the cell's were off; send none until then
        self._announced = 0  # chunks whose saves' commits announced them (KV events)

    def register_kv_caches(self, kv_caches: dict[str, Any]):
        g = self.geometry
        if len(kv_caches) != g.num_layers:
            raise ValueError(f"kvstash: {len(kv_caches)} KV-cache tensors, the config names {g.num_layers} layers")
        names = list(kv_caches)
        try:
            from vllm.model_executor.models.utils import extract_layer_index

            names.sort(key=extract_layer_index)
            indices = [extract_layer_index(n) for n in names]
        except (ImportError, ValueError):
            indices = list(range(len(names)))  # registration order
        self._stage = g.stage_of(indices)  # pipeline parallelism: which stage's layers these are
        # Each KV-cache group's layers in the model's order (one group: every tensor here).
        members = [names] if not g.hybrid() else [sorted(group.layers, key=names.index) for group in g.groups]
        if g.hybrid() and sorted(n for m in members for n in m) != sorted(names):
            raise ValueError(f"kvstash: the KV-cache tensors {sorted(names)} are not the groups' layers")
        self._layer_index = {name: (group, i) for group, layers in enumerate(members) for i, name in enumerate(layers)}
        states = {n for group, layers in zip(g.groups, members) if group.state for n in layers}
        for name, t in kv_caches.items():
            if name in states:
                continue  # a Mamba layer's pages: _state_page_base
            # vLLM's view is [blocks, heads, tokens, content]; an attention kernel with smaller
            # blocks than the manager's sees each block as `split` kernel blocks, dense in a page.
            split = t.shape[0] // g.num_blocks if t.shape[0] % g.num_blocks == 0 else 0
            if split == 0 or t.stride(0) * t.element_size() * split != g.page_bytes:
                raise ValueError(
                    f"kvstash: layer {name}'s blocks are not dense and outermost (shape {tuple(t.shape)}, strides "
                    f"{t.stride()}): a block-compact KV-cache layout is needed (VLLM_KV_CACHE_LAYOUT=NHD)")
            # The layout's name is in the keys: the tensors must be laid out as it says, or the
            # scheduler's keys would name other bytes than this worker's.
            if t.dim() == 4 and t.shape[1] > 1 and t.shape[2] > 1:
                tokens_outer = t.stride(2) > t.stride(1)
                if tokens_outer != ("NH" in g.layout):
                    raise ValueError(f"kvstash: layer {name} is laid out {'NH' if tokens_outer else 'HN'} within a "
                                     f"block, but vLLM's resolved layout is {g.layout}")
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._tp_rank = get_tensor_model_parallel_rank()
        except (ImportError, AssertionError, AttributeError):
            self._tp_rank = 0  # no model-parallel groups (a single process)
        # The caches hold their addresses: keep them alive. With vLLM's hybrid allocator, layers
        # of different groups share a tensor, each group in blocks of its own.
        self._tensors = [[kv_caches[n] for n in layers] for layers in members]
        self._pointers = [[self._state_page_base(kv_caches[n], n) if n in states else kv_caches[n].data_ptr()
                           for n in layers] for layers in members]
        self._caches.clear()
        caches = self._caches_for("")
        for group, cache in enumerate(caches):
            if cache.layout_tag != g.layout_tag(self._stage, group):
                raise RuntimeError(f"kvstash: the cache's layout tag {cache.layout_tag} is not the scheduler's "
                                   f"{g.layout_tag(self._stage, group)}")
        self._open_direct(caches[0])
        self._connect_nodes()

    def _connect_nodes(self) -> None:
        """The cell's nodes connected now, at start, not on the first request that loads."""
        try:
            self.store.connect_nodes(timeout_ms=self.config.timeout_ms)
        except kvstash.Error as e:
            logger.warning("kvstash: the cell's nodes were not connected at start (the first load will): %s", e)

    def _open_direct(self, cache: kvstash.KvCache) -> None:
        """Direct P/D: the cache exported for decodes and importing from prefills, opened when
        the caches are registered, off any request's path. kv_both does both."""
        if not self._direct:
            return
        role = self._kv_role
        # A side that cannot open (no transport here serves this memory, Redis unreachable) is
        # left closed: its requests are then given back at once (start_load_kv), never held.
        try:
            if role != "kv_consumer" and self._export is None:
                self._export = _handoff.PrefillExport(self.store, cache, self._engine_id, self._tp_rank,
                                                      self.geometry.rank_readers(self._tp_rank),
                                                      self.config.timeout_ms)
            if role != "kv_producer" and self._import is None:
                rank = self._tp_rank
                self._import = _handoff.DecodeReads(self.store, cache,
                                                    lambda record: self.geometry.pd_reads(rank, record),
                                                    self.config.timeout_ms)
        except kvstash.Error as e:
            logger.warning("kvstash: the direct P/D path is closed on this worker (prefills free at once, "
                           "decodes compute): %s", e)

    # Caches over the same tensors for other request salts (cache_salt, LoRA adapter): a KvCache
    # salts its keys once, at open. The few most recent are kept open.
    _SALTED_CACHES = 8

    def _cache_for(self, request_salt: str) -> kvstash.KvCache:
        """The cache of a model of one KV-cache group (or a hybrid's first group)."""
        return self._caches_for(request_salt)[0]

    def _caches_for(self, request_salt: str) -> list[kvstash.KvCache]:
        """Each KV-cache group's cache for requests of `request_salt`."""
        caches = self._caches.get(request_salt)
        if caches is not None:
            self._caches.move_to_end(request_salt)
            return caches
        g = self.geometry
        if g.stored_once:
            shape = dict(num_kv_heads=1, head_dim=g.token_width, order="nhd", mla=True)
        else:
            shape = dict(num_kv_heads=g.rank_heads, head_dim=g.head_width, order=g.order, joint_kv=True,
                         heads_total=g.heads_total, head_first=g.rank_first_head(self._tp_rank),
                         head_count=g.heads_per_object)
        # A Mamba group: a rank's state shard, a page a block, moved as bytes.
        state = dict(num_kv_heads=1, head_dim=g.page_bytes // g.block_size, order="nhd", joint_kv=True,
                     dtype="int8")
        caches = [kvstash.KvCache(
            self.store, pointers, num_blocks=g.num_blocks, block_size=g.block_size, model=g.model,
            chunk_tokens=g.chunk_tokens, extra=g.extra(request_salt), memory_kind="cuda" if self._on_gpu() else "host",
            staging=self.config.staging,
            **(dict(**state, **g.state_options(group, self._tp_rank)) if g.groups[group].state
               else dict(dtype=g.dtype, **shape, **g.key_options(self._stage, group))))
            for group, pointers in enumerate(self._pointers)]
        self._caches[request_salt] = caches
        if len(self._caches) > self._SALTED_CACHES + 1:
            oldest = next(k for k in self._caches if k)  # never the unsalted one
            del self._caches[oldest]  # loads and saves in flight keep theirs alive
        return caches

    def _span(self, run: ChunkRun, group: int) -> tuple[int, int]:
        """The chunks of `run` that KV-cache group `group` moves, (first, count): the run's
        trailing chunks whose every block the group holds. A window's group holds only the
        blocks its window still reads; the others are vLLM's null block (0)."""
        per_chunk = self.geometry.chunk_tokens // self.geometry.block_size
        blocks = run.block_ids[group]
        first = end = run.first + run.count
        while first > run.first and 0 not in blocks[(first - 1) * per_chunk:first * per_chunk]:
            first -= 1
        return first, end - first

    def _primary(self) -> int:
        """The group whose chunks the counts and KV events follow: the first of full attention."""
        return next((i for i, group in enumerate(self.geometry.groups) if not group.partial), 0)

    # Sleep mode (vLLM's --enable-sleep-mode): the KV cache's memory is released and mapped
    # again on wake-up, so the caches registered over it (direct RDMA and GPU registrations)
    # are dropped before and opened again after. vLLM drains transfers before it calls these.
    def unregister_kv_caches(self) -> None:
        self._finish_loads()
        self._saves.clear()
        self._caches.clear()  # each KvCache deregisters its memory as it goes
        if self._import is not None:
            self._import.close()
        self._export = self._import = None  # so do the export and the import

    def restore_kv_caches(self) -> None:
        if self._tensors and not self._caches:
            self._open_direct(self._cache_for(""))  # registers the memory again, as mapped now

    def _on_gpu(self) -> bool:
        tensor = next((t for ts in self._tensors for t in ts if hasattr(t, "is_cuda")), None)
        return tensor is not None and tensor.is_cuda

    def _state_page_base(self, t: Any, name: str) -> int:
        """Where block 0 of Mamba layer `name` starts: vLLM hands the layer either its state views
        (each block a page apart) or the backing buffer it lies in (its place in it a
        KVCacheTensor's). Its blocks must be a page apart, as kvstash moves them."""
        if isinstance(t, (list, tuple)):
            base, stride = t[0].data_ptr(), t[0].stride(0) * t[0].element_size()
        else:
            tensors = self._kv_cache_config.kv_cache_tensors
            place = next((x for x in tensors if name in (getattr(x, "layers", None) or ())), None)
            if place is None or not hasattr(place, "block_stride"):
                raise ValueError(f"kvstash: Mamba layer {name}'s place in the KV cache is not known")
            base = t.data_ptr() + place.offset + place.layers.index(name) * place.layer_stride
            stride = place.block_stride
        if stride != self.geometry.page_bytes:
            raise ValueError(f"kvstash: Mamba layer {name}'s blocks are {stride} bytes apart, not a page "
                             f"({self.geometry.page_bytes}): a layer-compact KV-cache layout is needed")
        return base

    @staticmethod
    def _current_stream() -> int:
        """The stream vLLM's forward pass runs on now, as a raw handle: torch's default stream is
        0, which kvstash (as CUDA) reads as the legacy default stream, never as "nothing"."""
        import torch

        return torch.cuda.current_stream().cuda_stream

    def _after(self) -> kvstash.KvSync:
        """The engine's ordering point now: everything queued on its current stream (a GPU
        cache), or nothing (a CPU cache: the CPU attention wrote the layer before returning)."""
        return kvstash.KvSync.stream(self._current_stream()) if self._on_gpu() else kvstash.KvSync.none()

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """This step's loads begun (`meta`: the scheduler's, as vLLM bound it), and on the direct
        P/D path its holds and reads."""
        assert isinstance(meta, KvstashMetadata)
        for req_id, name, fence, block_ids in meta.holds:
            if self._export is not None:
                self._export.hold(req_id, name, fence, block_ids)
            else:
                self._unheld.add(req_id)  # nothing can read them: vLLM frees them now
        for read in meta.reads:
            if self._import is not None:
                self._import.start(read.req_id, read.handoff, read.first_block, read.block_ids)
            elif read.block_ids:
                self._unread.add(read.req_id)  # computed instead
                self._load_errors.update(read.block_ids)
        for run in meta.loads:
            try:
                loads, unfilled = self._begin_loads(run)
            except kvstash.Error as e:
                logger.warning("kvstash: load of %s did not start: %s", run.req_id, e)
                self._fail_load(run)
                continue
            self._loads.extend(loads)
            self._load_errors |= unfilled
        for run in meta.fetches:
            try:
                loads, unfilled = self._begin_loads(run)
            except kvstash.Error as e:
                logger.warning("kvstash: load of %s did not start: %s", run.req_id, e)
                loads, unfilled = [], {-1}
            self._fetches[run.req_id] = (loads, bool(unfilled))

    def _begin_loads(self, run: ChunkRun) -> tuple[list[tuple[ChunkRun, int, int, Any]], set[int]]:
        """Each KV-cache group's load of the chunks of `run` it holds, begun; and the blocks that
        no load fills (a window vLLM reads further back than the lookup asked for)."""
        per_chunk = self.geometry.chunk_tokens // self.geometry.block_size
        loads, unfilled = [], set()
        for group, cache in enumerate(self._caches_for(run.salt)):
            first, count = self._span(run, group)
            unfilled.update(b for b in run.block_ids[group][run.first * per_chunk:first * per_chunk] if b)
            if count:
                # The blocks may have been a finished request's, whose kernels vLLM queued before
                # this step: no byte is written into them before that work is done.
                loads.append((run, group, first, cache.begin_load_range(
                    run.tokens, run.block_ids[group], first, count, timeout_ms=self.config.timeout_ms,
                    after=self._after(), chunk_salts=run.chunk_salts, keep=run.keep_hint())))
        return loads, unfilled

    def _fail_load(self, run: ChunkRun) -> None:
        per_chunk = self.geometry.chunk_tokens // self.geometry.block_size
        for blocks in run.block_ids:
            self._load_errors.update(b for b in blocks[run.first * per_chunk:] if b)
        self._stats["chunks_load_failed"] += run.count

    def wait_for_layer_load(self, layer_name: str) -> None:
        if layer_name not in self._layer_index:
            return
        group, layer = self._layer_index[layer_name]
        stream = self._current_stream() if self._on_gpu() else None
        for _, load_group, _, load in self._loads:
            if load_group != group:
                continue
            if stream is not None:
                # The engine's stream waits on the GPU and places the layer itself; this thread
                # does not block (0, torch's default stream, is a stream like any other).
                try:
                    load.wait_layer_on(layer, stream)
                    continue
                except kvstash.Error as e:
                    # A stream the device cannot use (a CUDA graph being captured): the layer is
                    # placed on the host's side instead, before attention reads it.
                    logger.warning("kvstash: layer %d handed to the host, not the stream: %s", layer, e)
            try:
                load.wait_layer(layer)
            except kvstash.Error:
                pass  # reported per chunk once the load ends (_finish_loads)

    def save_kv_layer(self, layer_name: str, meta: KVConnectorMetadata) -> None:
        """Layer `layer_name` added to this step's saves (`meta`: the scheduler's, as vLLM bound
        it), once the attention that wrote it is done."""
        if layer_name not in self._layer_index or not isinstance(meta, KvstashMetadata) or not meta.saves:
            return
        group, layer = self._layer_index[layer_name]
        if not self._saving:  # the step's first layer: every group's saves begin
            self._saving = True
            for run in meta.saves:
                self._begin_save(run)
        after = self._after()  # the attention that wrote this layer, as queued
        for run, save_group, _, save in self._saves:
            if save_group != group:
                continue
            try:
                save.save_layer(layer, after=after)
            except kvstash.Error as e:
                logger.warning("kvstash: saving layer %d of %s failed: %s", layer, run.req_id, e)

    def _begin_save(self, run: ChunkRun) -> None:
        """Each group's save of the chunks of `run` it holds (a window's: those it still reads; a
        Mamba group's: the state at the step's end, when it ended on a chunk's last token)."""
        per_chunk = self.geometry.chunk_tokens // self.geometry.block_size
        for group, cache in enumerate(self._caches_for(run.salt)):
            if self.geometry.groups[group].state:
                first, count = run.state_chunk, 1
                blocks = run.block_ids[group][first * per_chunk:(first + 1) * per_chunk]
                if first < run.first or not blocks or 0 in blocks:
                    continue
            elif not self.geometry.saves_on(self._tp_rank):
                continue  # MLA, or heads several ranks hold: one of them stores them
            else:
                first, count = self._span(run, group)
            if count == 0:
                continue
            try:
                save = cache.begin_save(run.tokens, run.block_ids[group], first, count,
                                        timeout_ms=self.config.timeout_ms, chunk_salts=run.chunk_salts,
                                        keep=run.keep_hint(), events=self._events_of(run, group, first, count))
            except kvstash.Error as e:
                logger.warning("kvstash: save of %s did not start: %s", run.req_id, e)
                if group == self._primary():
                    self._stats["chunks_save_failed"] += run.count
                continue
            self._saves.append((run, group, first, save))

    def _events_of(self, run: ChunkRun, group: int, first: int, count: int) -> list[bytes]:
        """KV events: the event data the save of chunks [first, first + count) commits with its
        chunks (docs/events.md): rank 0's primary group's, so that a router hears of a chunk
        once, by the key of its first object. None while the cell's events were found off (a
        minute: the data would only travel to be dropped)."""
        if (not run.events or group != self._primary() or self._tp_rank != 0
                or time.monotonic() < self._events_off_until):
            return []
        return run.events[first - run.first:first - run.first + count]

    def wait_for_save(self):
        # Mamba layers call no save_kv_layer: their group's layers are saved now, the step done.
        after = self._after() if self._saves else None
        for run, group, _, save in self._saves:
            if self.geometry.groups[group].state:
                for layer in range(len(self.geometry.groups[group].layers)):
                    try:
                        save.save_layer(layer, after=after)
                    except kvstash.Error as e:
                        logger.warning("kvstash: saving state layer %d of %s failed: %s", layer, run.req_id, e)
        for run, group, first, save in self._saves:
            saved = 0
            for code, message in save.wait():
                if code != "ok":
                    logger.warning("kvstash: a chunk of %s was not saved: %s %s", run.req_id, code, message)
                if group != self._primary():
                    continue  # counted and announced by the primary group's chunks
                if code == "ok":
                    self._stats["chunks_saved"] += 1
                    saved += 1
                else:
                    self._stats["chunks_save_failed"] += 1
            announced = save.announced()
            self._announced += announced
            if saved and not announced and self._events_of(run, group, first, 1):
                self._events_off_until = time.monotonic() + 60  # the cell's events are off
        self._saves.clear()
        self._saving = False
        self._finish_loads()

    def _finish_loads(self) -> None:
        for run, group, first, load in self._loads:
            self._load_errors |= self._end_load(run, group, first, load)
        self._loads.clear()

    def _end_load(self, run: ChunkRun, group: int, first: int, load: Any) -> set[int]:
        """Waits for a load; counts its chunks, removes its corrupt objects from the cell.
        Returns the blocks it did not fill."""
        failed = set(load.failed_blocks())
        codes = [code for code, _ in load.wait()]
        if group == self._primary():
            self._stats["chunks_loaded"] += codes.count("ok")
            self._stats["chunks_load_failed"] += len(codes) - codes.count("ok")
        if "corrupt" in codes:
            self._remove_corrupt(run, group, first, [i for i, (code, _) in enumerate(load.object_statuses())
                                                     if code == "corrupt"])
        return failed

    def _finish_fetches(self) -> set[str]:
        """A hybrid model's loads (asynchronous: vLLM maps a failed block to its request only with
        one KV-cache group): every request's, ended. Returns the requests whose load failed
        (vLLM computes them from the start); all of them are finished receiving."""
        failed = set()
        for req_id, (loads, unfilled) in self._fetches.items():
            missed = [self._end_load(*load) for load in loads]  # every load ended, not the first failed
            if unfilled or any(missed):
                failed.add(req_id)
        self._fetches.clear()
        return failed

    def _remove_corrupt(self, run: ChunkRun, group: int, first: int, bad: list[int]) -> None:
        """Objects whose bytes did not match their checksum (`bad`: their indices in a load of
        `group`'s chunks from `first` on) leave the cell: a later lookup misses their chunk
        instead of failing every load, and the recompute's save puts it anew. The chunk's other
        objects stay as they are."""
        g = self.geometry
        cache = self._caches_for(run.salt)[group]
        keys = cache.keys(run.tokens[: (run.first + run.count) * g.chunk_tokens], chunk_salts=run.chunk_salts)
        per = cache.objects_per_chunk
        for i in bad:
            try:
                self.store.remove_corrupt(keys[first * per + i], timeout_ms=self.config.timeout_ms)
                self._stats["chunks_corrupt_removed"] += 1
                logger.warning("kvstash: object %d of chunk %d of %s was corrupt and is removed from the cell",
                               i % per, first + i // per, run.req_id)
            except kvstash.Error as e:
                logger.warning("kvstash: a corrupt chunk of %s could not be removed: %s", run.req_id, e)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finish_loads()  # a step with loads and no saves ends them here
        sending = self._export.released() if self._export is not None else set()
        receiving: set[str] = set(self._fetches)
        self._failed_fetches |= self._finish_fetches()
        if self._import is not None:
            read, failed = self._import.finished()
            receiving |= read
            self._load_errors |= failed
        sending |= self._unheld
        receiving |= self._unread
        self._unheld, self._unread = set(), set()
        return sending or None, receiving or None

    def take_failed_fetches(self) -> set[str]:
        """The hybrid model's requests whose load failed since the last call (get_transfer_results'
        failed_recving)."""
        out, self._failed_fetches = self._failed_fetches, set()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._import is not None:
            self._import.close()

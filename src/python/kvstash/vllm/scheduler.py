"""The scheduler's side of the connector (SchedulerRole): what it asks the cell when a request
comes in (how many leading chunks beyond vLLM's own prefix-cache hit are stored, on a thread or
inline), which chunks each step loads and saves (KvstashMetadata, built from vLLM's
SchedulerOutput), what it learns from the workers' results (failed loads), and on the direct P/D
path the handoffs a prefill publishes and a decode reads. Each request's names (its salt and its
chunks' salts) are computed here, once.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec.msgpack as _msgpack
import kvstash
from kvstash import _handoff, _vllm_keys
from kvstash.vllm.metadata import BlockRead, ChunkRun, Keep, KvstashMetadata
from kvstash.vllm.role import Role

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvstash.vllm.config import KvstashConfig
    from kvstash.vllm.geometry import Geometry

logger = logging.getLogger(__name__)


try:  # how vLLM's own KV events carry a block hash (bytes, or int when it is told to)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as _external_hash
except ImportError:  # a release that publishes its hashes as they are

    def _external_hash(h: Any) -> Any:
        return h


@dataclass
class _Tracked:
    request: Request  # the scheduler's own: its all_token_ids grow as decode runs
    block_ids: list[list[int]] = field(default_factory=list)  # each KV-cache group's
    stored: int = 0  # leading chunks known to be in the cell (found, loaded or saved)
    # Leading chunks whose presence in the cell was asked (the lookup, or a check before a
    # save): chunks past it are checked before they are saved, so none is put twice.
    asked: int = 0
    load: tuple[int, int] | None = None  # (first, count) to load in the next step
    keep: Keep | None = None  # from its first lookup (ChunkRun.keep)


def log_key_options(g: Geometry) -> None:
    """Says at start how the chunk keys name the model, as `kvstash explain` takes them (docs/cli.md)."""
    heads = "" if g.stored_once else f" --heads 0+{g.heads_per_object}/{g.heads_total}"
    for i, group in enumerate(g.groups):
        named = f" --group {group.name}" if group.name else ""
        logger.info("kvstash: chunk keys name the model as %s (`kvstash explain --tokens ... --model %s "
                    "--layout %s --salt %s --chunk-tokens %d%s%s` finds a prompt's chunks)", g.model, g.model,
                    g.layout_tag(0, i), g.extra(), g.chunk_tokens, heads, named)


class SchedulerRole(Role):
    """The scheduler's side of the connector, whose hooks vLLM's scheduler calls; with
    async_lookup its lookups (_found_chunks) run on a thread pool of their own."""

    def __init__(self, config: KvstashConfig, geometry: Geometry, stats: dict[str, int], vllm_config: VllmConfig,
                 kv_role: str, engine_id: str):
        super().__init__(config, geometry, stats, engine_id)
        lora_config = getattr(vllm_config, "lora_config", None)
        self._request_keys = _vllm_keys.RequestKeys(
            self.geometry.chunk_tokens, str(getattr(lora_config, "lora_dtype", "")) if lora_config else "")
        # Each request's (request salt, chunk salts), or None when its KV depends on what cannot
        # be named (then vLLM alone serves it).
        self._named: dict[str, tuple[str, list[bytes]] | None] = {}
        self._epoch = ""  # after reset_cache: this engine's keys are its own (see there)
        # kv_role (KvstashConnector): kv_both looks chunks up, loads and saves them; in P/D through
        # the cell a kv_producer only saves and a kv_consumer only loads; on the direct path
        # neither uses the cell.
        self._cell_load = kv_role == "kv_both" or (kv_role == "kv_consumer" and not self._direct)
        self._cell_save = kv_role == "kv_both" or (kv_role == "kv_producer" and not self._direct)
        self._remote: dict[str, int] = {}  # direct: decode requests with a handoff -> computed tokens
        self._reads: list[BlockRead] = []  # direct: for the next step's workers
        self._to_fetch: list[ChunkRun] = []  # a hybrid model's loads, for the next step's workers
        self._unloadable: set[str] = set()  # a hybrid model's requests whose load failed
        self._holds: list[tuple[str, str, int, list[int]]] = []
        # req -> (local computed, external, found, chunks asked about, its Keep)
        self._matched: dict[str, tuple[int, int, int, int, Keep | None]] = {}
        self._lookups: dict[str, tuple[tuple[int, int], Future]] = {}  # req -> ((computed, tokens), found)
        self._lookup_pool: ThreadPoolExecutor | None = None
        self._tracked: dict[str, _Tracked] = {}
        # Opened at start, not by the first request's lookup (the workers open theirs when
        # vLLM registers the caches, and connect to the cell's nodes then).
        try:
            self.store
        except kvstash.Error as e:
            logger.warning("kvstash: the cell could not be opened at start (the first lookup tries again): %s", e)

    def _naming(self, request: Request) -> tuple[str, list[bytes]] | None:
        """The request's salt and its chunks' salts (kvstash._vllm_keys), computed once per
        request; None when its KV depends on an input that cannot be named by its content."""
        req_id = request.request_id
        if req_id not in self._named:
            try:
                salt = self._request_keys.request_salt(request)
                if self._epoch:
                    salt = f"epoch={self._epoch}" + (f":{salt}" if salt else "")
                self._named[req_id] = (salt, self._request_keys.chunk_salts(request))
            except _vllm_keys.Unnameable as e:
                logger.warning("kvstash: request %s is neither looked up nor saved: %s", req_id, e)
                self._stats["requests_unnamed"] += 1
                self._named[req_id] = None
        return self._named[req_id]

    def reset_cache(self) -> bool:
        """vLLM resets its prefix cache and asks its connector to (reset_prefix_cache with
        reset_connector, and sleep by default): what an engine does once its weights were
        updated in place (an RL trainer's sleep, update, wake-up), which no key can name by their
        content. The cell is shared, so nothing is removed from it: this engine's keys become
        its own from now on (a new epoch in every request's salt), so it loads no chunk saved
        before, and no other engine loads one it saves after."""
        self._epoch = uuid.uuid4().hex
        self._named.clear()
        logger.info("kvstash: the connector's cache was reset: this engine no longer shares chunks with others")
        return True

    def _forget(self, req_id: str) -> None:
        self._unloadable.discard(req_id)
        self._tracked.pop(req_id, None)
        self._matched.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._named.pop(req_id, None)

    def _found_chunks(self, tokens: list[int], limit: int, naming: tuple[str, list[bytes]],
                      first: int = 0) -> tuple[int, Keep | None]:
        """Leading chunks of `tokens` stored whole, every head (at most `limit`): one round trip;
        and what the request's loads and saves tell a turn-ttl cell (ChunkRun.keep; None under
        another policy). A hybrid model's: what a hit from chunk `first` on needs of each group
        (Geometry.hit), and no keep. 0 when the cell cannot be asked (a miss, not a failed
        request)."""
        g = self.geometry
        try:
            keys = g.all_keys(tokens[: limit * g.chunk_tokens], *naming)
            if g.hybrid():
                return g.hit(self.store.contains_each(keys, timeout_ms=self.config.timeout_ms), first, limit), None
            if not keys:
                return 0, None
            hit, turn, clock = self.store.lookup_prefix(keys, timeout_ms=self.config.timeout_ms)
            found = hit // g.parts()
            if not clock:  # another policy than turn-ttl: no hints
                return found, None
            # The request's draw between a split class's keep-times: its first missing chunk's key.
            split = kvstash.keep_key_hash(keys[min(found, limit - 1) * g.parts()])
            return found, (turn, clock, limit, split)
        except kvstash.Error as e:
            logger.warning("kvstash: a lookup failed, computing instead: %s", e)
            return 0, None

    @staticmethod
    def _handoff_of(request: Request) -> str | None:
        """Direct P/D: the prefill's handoff a decode request is still to read."""
        params = getattr(request, "kv_transfer_params", None) or {}
        return params.get("kvstash_handoff") if params.get("do_remote_prefill") else None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit that the cell holds whole chunks of. Looks only: nothing
        in the cell or in vLLM changes. At least the last token is always left to compute.
        Direct P/D: every prompt token a prefill computed, read asynchronously."""
        if self._direct and self._handoff_of(request):
            self._remote[request.request_id] = num_computed_tokens
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        chunk = self.geometry.chunk_tokens
        if not self._cell_load or num_computed_tokens % chunk or request.request_id in self._unloadable:
            return 0, False
        naming = self._naming(request)
        if naming is None:
            return 0, False
        tokens = list(request.all_token_ids)
        limit = (len(tokens) - 1) // chunk
        first = num_computed_tokens // chunk
        if limit <= first:
            return 0, False
        if self.config.async_lookup:
            # The first ask starts the lookup on a thread and answers "not yet" (None): vLLM
            # skips the request for this step and asks again. The answer is kept until the
            # request's blocks are allocated, so asking again changes nothing.
            asked = (num_computed_tokens, len(tokens))
            pending = self._lookups.get(request.request_id)
            if pending is None or pending[0] != asked:
                if self._lookup_pool is None:
                    self._lookup_pool = ThreadPoolExecutor(2, thread_name_prefix="kvstash-lookup")
                self._lookups[request.request_id] = (
                    asked, self._lookup_pool.submit(self._found_chunks, tokens, limit, naming, first))
                self._stats["lookups"] += 1
                return None, False
            if not pending[1].done():
                return None, False
            found, keep = pending[1].result()
        else:
            found, keep = self._found_chunks(tokens, limit, naming, first)
            self._stats["lookups"] += 1
        external = max(0, found - first) * chunk
        self._matched[request.request_id] = (num_computed_tokens, external, found, limit, keep)
        return external, external > 0 and self.geometry.hybrid()

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        handoff = self._handoff_of(request) if self._direct else None
        if handoff:
            # One read per request, also when nothing is left to read: it ends the handoff, so the
            # prefill frees its blocks now rather than at the deadline.
            request.kv_transfer_params["do_remote_prefill"] = False
            computed = self._remote.pop(request.request_id, 0)
            size = self.geometry.block_size
            first, end = computed // size, -(-len(request.prompt_token_ids or []) // size)
            local = list(blocks.get_block_ids()[0][first:end]) if num_external_tokens > 0 else []
            self._reads.append(BlockRead(request.request_id, handoff, first, local))
            return
        if self._naming(request) is None:
            return
        t = self._tracked.setdefault(request.request_id, _Tracked(request))
        t.request = request
        computed, external, found, asked, keep = self._matched.pop(request.request_id, (0, 0, 0, 0, None))
        self._lookups.pop(request.request_id, None)
        t.stored = max(t.stored, found)
        t.asked = max(t.asked, asked)
        t.keep = t.keep or keep
        if num_external_tokens > 0:
            if num_external_tokens != external:
                raise RuntimeError(f"kvstash: vLLM allocated {num_external_tokens} external tokens for "
                                   f"{request.request_id}, the lookup offered {external}")
            chunk = self.geometry.chunk_tokens
            first, count = computed // chunk, external // chunk
            self._stats["chunks_found"] += count
            if self.geometry.hybrid():  # loaded now, while the request waits (KvstashMetadata.fetches)
                self._to_fetch.append(self._run(request.request_id, request.all_token_ids, blocks.get_block_ids(),
                                                first, count, self._naming(request), keep=t.keep))
            else:
                t.load = (first, count)

    def _run(self, req_id: str, tokens: Any, block_ids: Any, first: int, count: int,
             naming: tuple[str, list[bytes]], **more: Any) -> ChunkRun:
        """Chunks [first, first + count) of a request: its tokens and each group's blocks up to
        their end."""
        end = (first + count) * self.geometry.chunk_tokens
        blocks = end // self.geometry.block_size
        return ChunkRun(req_id, list(tokens[:end]), [list(b[:blocks]) for b in block_ids], first, count, *naming,
                        **more)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvstashMetadata(reads=self._reads, holds=self._holds, fetches=self._to_fetch)
        self._reads, self._holds, self._to_fetch = [], [], []
        computed_after: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.block_ids = [list(b) for b in new.block_ids]
                computed_after[new.req_id] = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
        cached = scheduler_output.scheduled_cached_reqs
        # vLLM 0.33 lists resumed requests among the cached ones (with their whole block list);
        # 0.34 sends them as new requests again.
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in resumed:
                t.block_ids = [list(b) for b in added] if added else []  # a resumed request's whole list
            elif added:
                if not t.block_ids:
                    t.block_ids = [[] for _ in added]
                for mine, more in zip(t.block_ids, added):
                    mine.extend(more)
            computed_after[req_id] = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]

        chunk, per_block = self.geometry.chunk_tokens, self.geometry.block_size
        for req_id, after in computed_after.items():
            t = self._tracked[req_id]
            tokens = t.request.all_token_ids
            naming = self._naming(t.request)
            assert naming is not None  # tracked only when named
            if t.load is not None:
                meta.loads.append(self._run(req_id, tokens, t.block_ids, *t.load, naming, keep=t.keep))
                t.load = None
            # The chunks whose every token has its KV in the cache once this step ran.
            ready = min(after, len(tokens)) // chunk
            if not self.config.save_decode:
                ready = min(ready, len(t.request.prompt_token_ids or []) // chunk)
            ready = min(ready, len(t.block_ids[0]) * per_block // chunk if t.block_ids else 0)
            if not self._cell_save:
                continue
            if ready > t.stored and ready > t.asked:
                # Chunks no lookup asked about (vLLM's own prefix cache had them, or decode
                # filled them): the cell may hold them already, put by this engine or another.
                found, keep = self._found_chunks(list(tokens[: ready * chunk]), ready, naming)
                t.asked = ready
                t.keep = t.keep or keep
                if found > t.stored:
                    self._stats["chunks_already_stored"] += found - t.stored
                    t.stored = found
            if ready > t.stored:
                meta.saves.append(self._run(req_id, tokens, t.block_ids, t.stored, ready - t.stored, naming,
                                            events=self._chunk_events(t.request, t.stored, ready - t.stored),
                                            state_chunk=ready - 1 if after == ready * chunk else -1, keep=t.keep))
                t.stored = ready
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in self._tracked:
                self._tracked[req_id].block_ids = []  # freed; a resumed request gets its list anew
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def _chunk_events(self, request: Request, first: int, count: int) -> list[bytes] | None:
        """Chunks [first, first + count)'s event data as vLLM's own BlockStored would name their
        blocks (its block hashes, converted as its publisher converts them, and the parent
        block's), msgpack-encoded for their save's commits (KvCache.begin_save's events); None
        without block hashes (no prefix caching) or with kv_events off."""
        if not self.config.kv_events:
            return None
        per_block = self.geometry.block_size
        blocks = self.geometry.chunk_tokens // per_block
        hashes = request.block_hashes
        if len(hashes) < (first + count) * blocks:
            return None
        lora = request.lora_request
        lora_id, lora_name = (lora.adapter_id, lora.name) if lora is not None else (None, None)
        tokens = request.all_token_ids
        out = []
        for c in range(first, first + count):
            b = c * blocks
            parent = _external_hash(hashes[b - 1]) if b > 0 else None
            out.append(_msgpack.encode([[_external_hash(h) for h in hashes[b : b + blocks]], parent,
                                        list(tokens[b * per_block : (b + blocks) * per_block]), per_block, lora_id,
                                        lora_name]))
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks whose load failed are computed again: their chunks are no longer known to be
        stored, so the recomputed ones are saved (replacing what failed to load). A hybrid
        model's request whose load failed is computed whole, and not looked up again (a chunk
        the cell lists but cannot serve would fail it again)."""
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self._unloadable.add(req_id)
            if req_id in self._tracked:
                self._tracked[req_id].stored = 0
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        per_chunk = self.geometry.chunk_tokens // self.geometry.block_size
        for t in self._tracked.values():
            for blocks in t.block_ids:
                for i, block in enumerate(blocks):
                    if block in invalid:
                        t.stored = min(t.stored, i // per_chunk)
                        break

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with its hybrid allocator (SupportsHMA): every group's blocks. Only the
        direct path hands blocks off, and it serves one group."""
        return self.request_finished(request, block_ids[0])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves run within the step that computed their chunks (wait_for_save), so no save is
        # in flight here and vLLM may free the blocks at once.
        self._forget(request.request_id)
        self._remote.pop(request.request_id, None)
        params = getattr(request, "kv_transfer_params", None) or {}
        if not self._direct or not params:
            return False, None
        handoff = self._handoff_of(request)
        if handoff:  # a decode request that ended before its read: the prefill may free now
            params["do_remote_prefill"] = False
            _handoff.end_unread(self.store, handoff, self.config.timeout_ms)
            return False, None
        from vllm.v1.request import RequestStatus

        if not params.get("do_remote_decode") or not block_ids or request.status not in (
                RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # not a prefill for a decode, or aborted: nothing to hand off
        try:
            name, fence = _handoff.publish_request(self.store, self._engine_id, request.request_id, block_ids,
                                                   self.geometry.tp_size, self.geometry.pd_readers(),
                                                   self.config.handoff_ttl_ms, self.config.timeout_ms)
        except kvstash.Error as e:
            logger.warning("kvstash: the handoff of %s was not published; its decode computes it: %s",
                           request.request_id, e)
            return False, None
        self._holds.append((request.request_id, name, fence, list(block_ids)))
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "kvstash_handoff": name,
                      "remote_num_tokens": request.num_computed_tokens}

    def shutdown(self) -> None:
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=True)

"""A vLLM KV connector (KVConnectorBase_V1) over kvstash: the worked example of
docs/integration.md, section 4.

Both halves of a connector in one class, as vLLM has it: the scheduler side decides what to
load and save (it needs only the token ids and a Store, no tensors), the worker side moves the
bytes layer by layer through a KvCache over the engine's own paged tensors.

Loads are synchronous to the step (get_num_new_matched_tokens answers load_async=False): the
worker starts every request's load in start_load_kv and each attention layer waits for its
own layer in wait_for_layer_load, so layer 0 computes while later layers still arrive. Saves
stream out as save_kv_layer is called and are committed in wait_for_save.

vLLM is not needed to import or test this file (tests/python_test.py drives it with
stand-ins for vLLM's request and scheduler-output objects). Inside vLLM, construct it from
the VllmConfig (model, block size, kv_connector_extra_config for the Redis URL) and register
it with KVConnectorFactory; the attribute names read from vLLM's objects are those of
vLLM 0.9-0.11 (request.request_id, request.prompt_token_ids, scheduler_output
.scheduled_new_reqs[i].req_id / .prompt_token_ids / .block_ids / .num_computed_tokens,
scheduler_output.num_scheduled_tokens).
"""

from dataclasses import dataclass, field

import kvstash

try:  # inside vLLM: a real connector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _Base,
        KVConnectorMetadata as _Metadata,
    )
except ImportError:  # anywhere else: the same class, stand-alone
    _Base = object

    class _Metadata:
        pass


@dataclass
class RequestPlan:
    """What the worker does for one request this step."""

    req_id: str
    tokens: list
    block_ids: list
    load_first: int = 0  # chunks [load_first, load_first + load_chunks) to load into block_ids
    load_chunks: int = 0
    save_first: int = 0  # chunks [save_first, save_first + save_count) to save
    save_count: int = 0


@dataclass
class KvstashMetadata(_Metadata):
    requests: list = field(default_factory=list)


def layout_tag(layers, num_kv_heads, head_dim, block_size, dtype="fp16", order="nhd", mla=False):
    """The layout tag a KvCache of this shape salts its keys with (docs/integration.md,
    section 2), so that the scheduler computes the same keys without any tensor."""
    parts = 1 if mla else 2
    return f"L{layers}.P{parts}.H{num_kv_heads}.D{head_dim}.B{block_size}.{dtype}.{order}"


class KvstashConnector(_Base):
    def __init__(self, store, *, model, layers, num_kv_heads, head_dim, block_size, dtype="fp16",
                 order="nhd", chunk_tokens=256, tp_rank=0, tp_size=1, memory_kind="host"):
        self.store = store
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shape = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                          dtype=dtype, order=order)
        self.tag = layout_tag(layers, num_kv_heads, head_dim, block_size, dtype, order)
        self.memory_kind = memory_kind  # "cuda" for torch tensors on a GPU
        # Scheduler side.
        self._hits = {}  # req_id -> (chunks vLLM holds locally, chunks stored remotely)
        self._to_load = {}  # req_id -> (first, count) of the chunks to load this step
        self._saved = {}  # req_id -> chunks already saved
        # Worker side.
        self.kv = None
        self._layer_index = {}
        self._meta = KvstashMetadata()
        self._loads = {}  # req_id -> (KvLoad, plan)
        self._saves = {}  # req_id -> KvSave
        self._failed_blocks = set()

    # ---- scheduler side ----------------------------------------------------------------

    def _keys(self, tokens):
        return kvstash.prefix_chunk_keys(list(tokens), self.model, self.tag, self.tp_rank,
                                         self.tp_size, self.chunk_tokens)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """Tokens beyond num_computed_tokens that a load provides: whole stored chunks, and
        never the whole prompt (vLLM must compute at least its last token)."""
        tokens = request.prompt_token_ids
        chunks = self.store.contains_prefix(self._keys(tokens))
        while chunks > 0 and chunks * self.chunk_tokens >= len(tokens):
            chunks -= 1
        # Chunks vLLM's own prefix cache holds whole are not loaded again; a chunk it holds in
        # part is (its blocks get the bytes they already have).
        local = num_computed_tokens // self.chunk_tokens
        self._hits[request.request_id] = (local, chunks)
        return max(0, chunks * self.chunk_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0:
            local, chunks = self._hits.get(request.request_id, (0, 0))
            self._to_load[request.request_id] = (local, chunks - local)

    def build_connector_meta(self, scheduler_output):
        meta = KvstashMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = list(new.block_ids[0] if isinstance(new.block_ids[0], (list, tuple))
                             else new.block_ids)
            tokens = list(new.prompt_token_ids)
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            full = min(done, len(tokens)) // self.chunk_tokens
            load_first, load_count = self._to_load.pop(new.req_id, (0, 0))
            first = max(self._saved.get(new.req_id, 0), load_first + load_count)
            plan = RequestPlan(new.req_id, tokens, block_ids, load_first=load_first,
                               load_chunks=load_count, save_first=first,
                               save_count=max(0, full - first))
            self._saved[new.req_id] = max(first, full)
            if plan.load_chunks or plan.save_count:
                meta.requests.append(plan)
        return meta

    def request_finished(self, request, block_ids):
        for d in (self._hits, self._to_load, self._saved):
            d.pop(request.request_id, None)
        return False, None  # saves are committed within the step: the blocks are free now

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        """kv_caches: layer name -> that layer's (2, num_blocks, block_size, heads, head_dim)
        tensor (torch: passed by data_ptr()), or a writable buffer, in layer order."""
        names = list(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(names)}
        tensors = [t.data_ptr() if hasattr(t, "data_ptr") else t for t in kv_caches.values()]
        first = kv_caches[names[0]]
        num_blocks = first.shape[1] if hasattr(first, "shape") else (
            len(first) // (2 * self.block_size * self.shape["num_kv_heads"] * self.shape["head_dim"]
                           * _dtype_bytes(self.shape["dtype"])))
        self.kv = kvstash.KvCache(self.store, tensors, num_blocks, model=self.model,
                                  tp_rank=self.tp_rank, tp_size=self.tp_size,
                                  chunk_tokens=self.chunk_tokens, memory_kind=self.memory_kind,
                                  **self.shape)
        assert self.kv.layout_tag == self.tag, "the scheduler's keys would not match the worker's"

    def bind_connector_metadata(self, meta):
        self._meta = meta

    def clear_connector_metadata(self):
        self._meta = KvstashMetadata()

    def start_load_kv(self, forward_context=None, **kwargs):
        for plan in self._meta.requests:
            if plan.load_chunks:
                load = self.kv.begin_load_range(plan.tokens, plan.block_ids, plan.load_first,
                                                plan.load_chunks)
                self._loads[plan.req_id] = (load, plan)

    def wait_for_layer_load(self, layer_name):
        layer = self._layer_index[layer_name]
        for load, _ in self._loads.values():
            try:
                load.wait_layer(layer)
            except kvstash.Error:
                pass  # the chunk's status below names the blocks to recompute

    def save_kv_layer(self, layer_name, kv_layer=None, attn_metadata=None, **kwargs):
        layer = self._layer_index[layer_name]
        if layer == 0:
            for plan in self._meta.requests:
                if plan.save_count:
                    self._saves[plan.req_id] = self.kv.begin_save(
                        plan.tokens, plan.block_ids, plan.save_first, plan.save_count)
        for save in self._saves.values():
            save.save_layer(layer)

    def wait_for_save(self):
        self._finish_loads()  # every layer has been computed, so every load has landed
        failed = {}
        for req_id, save in self._saves.items():
            bad = [i for i, (code, _) in enumerate(save.wait()) if code != "ok"]
            if bad:
                failed[req_id] = bad  # saved again next time the prefix is computed
        self._saves.clear()
        return failed

    def get_finished(self, finished_req_ids):
        self._finish_loads()
        return None, None  # nothing is asynchronous beyond the step

    def get_block_ids_with_load_errors(self):
        """Blocks whose chunk failed to load (evicted meanwhile, corrupt): vLLM recomputes
        them. A failed chunk taints the chunks after it too (the prefix is broken there)."""
        self._finish_loads()
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def _finish_loads(self):
        for load, plan in self._loads.values():
            failed = load.failed_blocks()  # the blocks of the chunks that did not load whole
            if failed:
                # vLLM recomputes from the first failed token on: report every later block too.
                first = plan.block_ids.index(failed[0])
                last = (plan.load_first + plan.load_chunks) * self.blocks_per_chunk
                self._failed_blocks.update(plan.block_ids[first:last])
        self._loads.clear()


def _dtype_bytes(dtype):
    return {"fp32": 4, "fp16": 2, "bf16": 2}.get(dtype, 1)

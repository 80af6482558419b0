"""The cache geometry: what the scheduler and every worker agree on from vLLM's config alone
(Geometry: the block's shape and dtype, the heads a rank and an object hold, the pipeline
stages, the KV-cache groups as Group), and how it names chunks: each object's key, the keys a
lookup asks for, what a hybrid model's hit needs of each group, and what a decode reads of a
prefill's blocks on the direct P/D path.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import kvstash
from kvstash import _vllm_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvstash.vllm.config import KvstashConfig


_DTYPES = {
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float32": "fp32",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
    "torch.int8": "int8",
    "torch.uint8": "int8",
}


@dataclass(frozen=True)
class Group:
    """One of vLLM's KV-cache groups (a hybrid model has several: sliding-window layers and full
    attention's, Mamba's, each group its own blocks): its layers, and which of a prefix's chunks
    a hit needs of it. Full attention reads every chunk; a window of W tokens only those holding
    the W - 1 tokens before the first one computed (vLLM frees, and nulls in the block table, the
    rest), so only those are stored and looked for; a Mamba state only the one at the hit's end
    (each block holds the state after its last token, vLLM's mamba_cache_mode "align")."""

    layers: tuple[str, ...]
    window: int = 0  # sliding window tokens; 0: full attention
    name: str = ""  # what keys name it by ("" for a model of one group)
    state: bool = False  # a Mamba (or linear-attention) state per block, not tokens' KV

    @classmethod
    def named(cls, layers: list[str], window: int = 0, state: bool = False) -> Group:
        """A group of a hybrid model, named by its kind and a digest of its layers' names: a
        key cannot be read by another group's layers, whatever order vLLM lists groups in."""
        digest = hashlib.sha256("\0".join(layers).encode()).hexdigest()[:8]
        kind = "state" if state else f"swa{window}" if window else "full"
        return cls(tuple(layers), window, f"{kind}.{digest}", state)

    @property
    def partial(self) -> bool:
        """Whether a hit needs only the last chunks of this group (a window, a state)."""
        return bool(self.window) or self.state

    def first_needed(self, end: int, chunk_tokens: int) -> int:
        """The first chunk a hit of `end` chunks needs of this group (vLLM's skipped tokens)."""
        if self.state:
            return max(0, end - 1)
        if not self.window:
            return 0
        return max(0, end * chunk_tokens - self.window + 1) // chunk_tokens


@dataclass(frozen=True)
class Geometry:
    """What the scheduler and every worker agree on, from vLLM's config alone: the shape kvstash
    sees and what salts the keys.

    kvstash is handed vLLM's block as it is in memory: one part (K and V side by side in each
    head: joint_kv), the rank's KV heads, each head's tokens as vLLM keeps them (its layout:
    heads outermost, LBHNC, or tokens outermost, LBNHC). Keys name the heads an object holds
    (kv_heads_per_object of them), not the rank, so an engine of any tensor-parallel degree
    reads what one of another degree saved. An MLA latent is one head that every rank holds
    alike: stored once, by rank 0. vLLM's layout name goes into the keys' salt, so caches that
    lay the same tokens out differently never share a chunk."""

    num_layers: int
    num_blocks: int
    block_size: int
    token_width: int  # elements per token per layer: the page's bytes / (block_size x itemsize)
    dtype: str
    page_bytes: int
    chunk_tokens: int
    model: str  # by content: kvstash._vllm_keys.model_identity
    salt: str  # the layout, MLA, the user's extra
    layout: str  # vLLM's KV-cache layout name ("LBNHC")
    tp_size: int
    stored_once: bool  # MLA: every rank holds the same latent cache, rank 0's is stored
    heads_total: int  # the model's KV heads (MLA: 0, keys by rank 0 of 1)
    rank_heads: int  # the heads a rank's blocks hold
    heads_per_object: int
    # Pipeline parallelism: each stage's (first layer, layers), as vLLM splits the model; its
    # objects hold its layers. One stage: ((0, num_layers),), and keys name no layers.
    stages: tuple[tuple[int, int], ...] = ((0, 0),)
    layers_total: int = 0  # the model's layers with several stages, else 0
    # vLLM's KV-cache groups (a hybrid model's, with its hybrid allocator on: several), each
    # stored as objects of its own, on one chain.
    groups: tuple[Group, ...] = ()

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KvstashConfig) -> Geometry:
        groups = cls.groups_of(kv_cache_config)
        spec = cls.attention_spec(kv_cache_config)
        item = spec.dtype.itemsize
        dtype = _DTYPES.get(str(spec.dtype))
        if dtype is None:
            raise ValueError(f"kvstash: KV-cache dtype {spec.dtype} is not one kvstash stores")
        page = spec.page_size_bytes
        if page % (spec.block_size * item):
            raise ValueError(f"kvstash: a page of {page} bytes is not whole tokens of block size {spec.block_size}")
        parallel = vllm_config.parallel_config
        num_layers = sum(len(group.layers) for group in groups)
        stages, layers_total = ((0, num_layers),), 0
        if parallel.pipeline_parallel_size > 1:
            if len(groups) > 1:
                raise ValueError("kvstash: a hybrid model (several KV-cache groups) is not served with pipeline "
                                 "parallelism")
            stages, layers_total = cls.pipeline_stages(vllm_config)
        mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        chunk = config.chunk_tokens or spec.block_size
        if chunk % spec.block_size:
            raise ValueError(f"kvstash: chunk_tokens {chunk} is not a multiple of the block size {spec.block_size}")
        if len(groups) > 1 and chunk != spec.block_size:
            raise ValueError(f"kvstash: a hybrid model's chunks are one block (chunk_tokens {chunk}, block size "
                             f"{spec.block_size}): a window's first block is freed while the rest of its chunk "
                             "is read")
        # The layout the engine core resolved (KVCacheConfig carries it to every worker), by
        # its canonical name: "NHD" is "LBNHC".
        layout = (getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
                  or "LBNHC")
        layout = {"NHD": "LBNHC", "HND": "LBHNC"}.get(layout, layout)
        _vllm_keys.check_servable(vllm_config)
        model = _vllm_keys.model_identity(vllm_config, config.weights_id, config.model)
        token_width = page // (spec.block_size * item)
        rank_heads = 1 if mla else getattr(spec, "num_kv_heads", 1)
        total = 0 if mla else vllm_config.model_config.get_total_num_kv_heads()
        per_object = 1
        if not mla:
            per_object = config.kv_heads_per_object or (total // 8 if total >= 8 and total % 8 == 0 else 1)
            if token_width % rank_heads or rank_heads % per_object:
                raise ValueError(f"kvstash: kv_heads_per_object {per_object} does not divide a rank's "
                                 f"{rank_heads} KV heads (of {total}): set kv_heads_per_object to a divisor")
        salt = f"vllm:{layout}:{'mla' if mla else 'kv'}" + (f":{config.extra}" if config.extra else "")
        return cls(num_layers=num_layers, num_blocks=kv_cache_config.num_blocks,
                   block_size=spec.block_size, token_width=token_width, dtype=dtype, page_bytes=page,
                   chunk_tokens=chunk, model=model, salt=salt, layout=layout,
                   tp_size=parallel.tensor_parallel_size, stored_once=mla, heads_total=total,
                   rank_heads=rank_heads, heads_per_object=per_object, stages=stages, layers_total=layers_total,
                   groups=groups)

    @staticmethod
    def groups_of(kv_cache_config: KVCacheConfig) -> tuple[Group, ...]:
        """vLLM's KV-cache groups as kvstash stores them: full attention and sliding windows,
        alike in every byte but their layers; any other kind refused by name."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

        groups = kv_cache_config.kv_cache_groups
        if len(groups) == 1:
            return (Group(tuple(groups[0].layer_names)),)
        first = Geometry.attention_spec(kv_cache_config)
        out = []
        for i, group in enumerate(groups):
            spec = group.kv_cache_spec
            kind = type(spec).__name__
            layers = list(group.layer_names)
            if isinstance(spec, MambaSpec):
                Geometry.check_state(i, spec, first)
                out.append(Group.named(layers, state=True))
                continue
            # By exact type: FullAttentionSpec's subclasses (MLA, attention sinks) are other kinds.
            if not (isinstance(spec, SlidingWindowSpec) or type(spec) is FullAttentionSpec):
                raise ValueError(f"kvstash: KV-cache group {i} ({kind}, layers {layers[:4]}...) is not one kvstash "
                                 "stores: it stores full-attention, sliding-window and Mamba groups (chunked local "
                                 "attention, MLA with other groups and any other kind are not served)")
            mine, theirs = ([getattr(s, a, None) for a in ("block_size", "num_kv_heads", "head_size", "dtype",
                                                           "page_size_bytes")] for s in (spec, first))
            if mine != theirs:
                raise ValueError(f"kvstash: KV-cache group {i} ({kind}) has blocks of another shape than the first "
                                 f"attention group's (block size, KV heads, head size, dtype, page bytes: {mine} vs "
                                 f"{theirs})")
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else 0
            out.append(Group.named(layers, window))
        return tuple(out)

    @staticmethod
    def attention_spec(kv_cache_config: KVCacheConfig) -> Any:
        """The first attention group's spec: the KV geometry (a hybrid's first group may be Mamba's)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        spec = next((s for s in specs if not isinstance(s, MambaSpec)), None)
        if spec is None:
            raise ValueError("kvstash: a model without attention layers (only Mamba state) is not served")
        return spec

    @staticmethod
    def check_state(i: int, spec: Any, attention: Any) -> None:
        """A Mamba group kvstash stores: each block the state after its last token (vLLM's
        mamba_cache_mode "align", where the state of block c is in block c only at the end of
        the step that ended on its last token), pages as the attention groups'."""
        why = None
        if getattr(spec, "mamba_cache_mode", "none") != "align":
            why = "its state is kept per block only with mamba_cache_mode 'align' (vLLM's prefix caching of Mamba)"
        elif getattr(spec, "num_speculative_blocks", 0) or getattr(spec, "num_prefill_checkpoint_blocks", 0):
            why = "speculative and prefill-checkpoint blocks move states between blocks"
        elif spec.block_size != attention.block_size or spec.page_size_bytes != attention.page_size_bytes:
            why = (f"its blocks ({spec.block_size} tokens, {spec.page_size_bytes} bytes) are not the attention "
                   f"groups' ({attention.block_size}, {attention.page_size_bytes})")
        elif spec.page_size_bytes % spec.block_size:
            why = f"its page of {spec.page_size_bytes} bytes is not whole bytes per token of {spec.block_size}"
        if why:
            raise ValueError(f"kvstash: KV-cache group {i} (MambaSpec) is not stored: {why}")

    @staticmethod
    def pipeline_stages(vllm_config: VllmConfig) -> tuple[tuple[tuple[int, int], ...], int]:
        """Each stage's (first layer, layers) as vLLM splits the model's hidden layers
        (get_pp_indices: VLLM_PP_LAYER_PARTITION, or evenly), and the model's layers."""
        from vllm.distributed.utils import get_pp_indices

        total = vllm_config.model_config.get_total_num_hidden_layers()
        size = vllm_config.parallel_config.pipeline_parallel_size
        stages = []
        for stage in range(size):
            start, end = get_pp_indices(total, stage, size)
            stages.append((start, end - start))
        return tuple(stages), total

    def stage_of(self, layer_indices: list[int]) -> int:
        """The stage whose layers a worker's KV-cache tensors are (by the layers' indices)."""
        if len(self.stages) == 1:
            return 0
        for stage, (first, count) in enumerate(self.stages):
            if sorted(layer_indices) == list(range(first, first + count)):
                return stage
        raise ValueError(f"kvstash: this worker's KV-cache layers {sorted(layer_indices)} are no pipeline stage's "
                         f"{list(self.stages)} (only models whose every hidden layer has one KV cache are served "
                         "with pipeline parallelism)")

    @property
    def order(self) -> str:
        """Within a block: heads outermost ("hnd", LBHNC) or tokens outermost ("nhd")."""
        return "hnd" if self.layout in ("LBHNC", "BLHNC") else "nhd"

    @property
    def head_width(self) -> int:
        """Elements of one token of one head: its K and V."""
        return self.token_width // self.rank_heads

    def layout_tag(self, stage: int = 0, group: int = 0) -> str:
        """KvLayout::tag() of one object of `stage` or `group`, as the worker's cache has it
        (checked by the tests)."""
        layers = self.stages[stage][1] if self.layers_total else len(self.groups[group].layers)
        if self.groups[group].state:  # a rank's state shard, a page a block, as bytes
            return f"L{layers}.P1.H1.D{self.page_bytes // self.block_size}.B{self.block_size}.int8.nhd"
        if self.stored_once:
            return f"L{layers}.P1.H1.D{self.token_width}.B{self.block_size}.{self.dtype}.nhd"
        return (f"L{layers}.P1.H{self.heads_per_object}.D{self.head_width}.B{self.block_size}."
                f"{self.dtype}.{self.order}")

    def head_groups(self) -> int:
        """Objects a stage's chunk is stored as, over every rank: the model's heads / heads per object."""
        return 1 if self.stored_once else self.heads_total // self.heads_per_object

    def group_objects(self, group: int) -> int:
        """Objects a chunk of KV-cache group `group` is stored as: its head groups (a Mamba state:
        each rank's shard)."""
        return self.tp_size if self.groups[group].state else self.head_groups()

    def parts(self) -> int:
        """Objects a chunk is stored as: every stage's (or KV-cache group's) objects."""
        return len(self.stages) * sum(self.group_objects(g) for g in range(len(self.groups)))

    def state_options(self, group: int, tp_rank: int = 0) -> dict[str, Any]:
        """A Mamba group's keys by rank shard (a state is split by the ranks' heads, and no other
        degree reads it): as heads `tp_rank` of tp_size, one chain with the attention objects."""
        return dict(heads_total=self.tp_size, head_first=tp_rank, head_count=1, **self.key_options(0, group))

    def hybrid(self) -> bool:
        """Several KV-cache groups (vLLM's hybrid allocator on a hybrid model)."""
        return len(self.groups) > 1

    def key_options(self, stage: int = 0, group: int = 0) -> dict[str, Any]:
        """The keys' layers of `stage` (several stages) or `group` (several groups), as KvCache and
        prefix_chunk_keys take them."""
        if self.hybrid():
            return dict(group=self.groups[group].name)
        if not self.layers_total:
            return {}
        return dict(layers_total=self.layers_total, layer_first=self.stages[stage][0])

    def hit(self, present: list[bool], first: int, limit: int) -> int:
        """A hybrid model's lookup: the leading chunks (at most `limit`) a request can load from
        chunk `first` on, given whether each object of all_keys() is stored: every full-attention
        group's chunks from 0, and each window's last chunks (those from `first` on)."""
        per_chunk = self.parts()
        chunks = min(limit, len(present) // per_chunk)
        # missing[g][c]: how many of group g's chunks before chunk c lack an object (a prefix
        # sum, so that each candidate hit is checked in constant time per group).
        missing, offset = [], 0
        for g in range(len(self.groups)):
            counts, per_group = [0], self.group_objects(g)
            for c in range(chunks):
                at = c * per_chunk + offset
                counts.append(counts[-1] + (not all(present[at:at + per_group])))
            missing.append(counts)
            offset += per_group
        full = [g for g, group in enumerate(self.groups) if not group.partial]
        end = 0
        while end < chunks and all(missing[g][end + 1] == 0 for g in full):
            end += 1
        for n in range(end, 0, -1):
            if all(missing[g][n] == missing[g][min(n, max(first, group.first_needed(n, self.chunk_tokens)))]
                   for g, group in enumerate(self.groups) if group.partial):
                return n
        return 0

    def rank_first_head(self, tp_rank: int) -> int:
        """The model's head that rank `tp_rank`'s blocks start with. With more ranks than KV heads,
        vLLM gives each rank one head and several ranks the same."""
        if self.tp_size <= self.heads_total:
            return tp_rank * self.rank_heads
        return tp_rank * self.heads_total // self.tp_size

    def by_heads(self) -> bool:
        """Whether the ranks divide the heads among them (keys and direct reads by heads)."""
        return not self.stored_once and self.tp_size <= self.heads_total

    def pd_readers(self) -> list[str]:
        """Direct P/D: the readers of a prefill's record: a reader per KV head (decodes of any
        degree), or per rank (MLA, replicated heads: decodes of this degree)."""
        if self.by_heads():
            return [f"h{h}" for h in range(self.heads_total)]
        return [str(r) for r in range(self.tp_size)]

    def rank_readers(self, tp_rank: int) -> list[str]:
        """Direct P/D, a prefill rank: the readers whose end frees its blocks."""
        if self.by_heads():
            first = self.rank_first_head(tp_rank)
            return [f"h{h}" for h in range(first, first + self.rank_heads)]
        return [str(tp_rank)]

    def pd_reads(self, tp_rank: int, record: dict[str, Any]) -> list[tuple[int, int, int, int, list[str]]]:
        """Direct P/D, a decode rank: what it reads of a prefill's record, as (prefill rank,
        heads (0: whole blocks), the prefill rank's first head read, this rank's first head
        written, the readers it ends). ValueError for a prefill it cannot read."""
        prefill_tp = int(record["tp"])
        if not all(str(r).startswith("h") for r in record.get("readers", [])) or not record.get("readers"):
            if prefill_tp != self.tp_size:
                raise ValueError(f"the prefill ran {prefill_tp} tensor-parallel ranks, this decode {self.tp_size}, "
                                 "and its heads are not divided among its ranks (MLA, or more ranks than heads)")
            return [(tp_rank, 0, 0, 0, [str(tp_rank)])]
        if not self.by_heads():
            raise ValueError("this decode's heads are not divided among its ranks (MLA, or more ranks than heads)")
        if len(record["readers"]) != self.heads_total:
            raise ValueError(f"the prefill's model has {len(record['readers'])} KV heads, this one {self.heads_total}")
        # At the same degree this is the rank of the same index, every head of its blocks.
        theirs = self.heads_total // prefill_tp
        first = self.rank_first_head(tp_rank)
        end = first + self.rank_heads
        plan = []
        for rank in range(prefill_tp):
            lo, hi = max(first, rank * theirs), min(end, (rank + 1) * theirs)
            if lo < hi:
                plan.append((rank, hi - lo, lo - rank * theirs, lo - first, [f"h{h}" for h in range(lo, hi)]))
        return plan

    def saves_on(self, tp_rank: int) -> bool:
        """Whether rank `tp_rank` stores its objects: one rank of those that hold the same heads."""
        if self.stored_once:
            return tp_rank == 0
        return self.tp_size <= self.heads_total or tp_rank % (self.tp_size // self.heads_total) == 0

    def extra(self, request_salt: str = "") -> str:
        """What salts the keys of requests whose request salt is `request_salt`
        (RequestKeys.request_salt: their cache_salt and LoRA adapter)."""
        return self.salt + (f":{request_salt}" if request_salt else "")

    def keys(self, tokens: list[int], part: int = 0, request_salt: str = "",
             chunk_salts: list[bytes] | None = None, objects: int = 1) -> list[str]:
        """The keys of object `part` (of parts(): stage by stage or KV-cache group by group, then
        head group by head group) of every full chunk of `tokens`; with `objects`, of that many
        objects from `part` on (in one stage or group), chunk by chunk."""
        layers, heads_group = divmod(part, self.head_groups())
        stage, group = (layers, 0) if len(self.stages) > 1 else (0, layers)
        heads = {} if self.stored_once else dict(heads_total=self.heads_total,
                                                 head_first=heads_group * self.heads_per_object,
                                                 head_count=self.heads_per_object)
        if self.layers_total:
            heads["layer_count"] = self.stages[stage][1]
        return kvstash.prefix_chunk_keys(tokens, model=self.model, layout_tag=self.layout_tag(stage, group),
                                         chunk_tokens=self.chunk_tokens, extra=self.extra(request_salt),
                                         chunk_salts=chunk_salts or [], groups=objects, **heads,
                                         **self.key_options(stage, group))

    def group_keys(self, tokens: list[int], group: int, request_salt: str = "",
                   chunk_salts: list[bytes] | None = None) -> list[str]:
        """Every object's key of KV-cache group `group` (of stage `group` with several stages),
        chunk by chunk: group_objects() per chunk."""
        if len(self.groups) > 1 and self.groups[group].state:
            return kvstash.prefix_chunk_keys(tokens, model=self.model, layout_tag=self.layout_tag(0, group),
                                             chunk_tokens=self.chunk_tokens, extra=self.extra(request_salt),
                                             chunk_salts=chunk_salts or [], groups=self.tp_size,
                                             **self.state_options(group))
        per = self.head_groups()
        return self.keys(tokens, group * per, request_salt, chunk_salts, per)

    def all_keys(self, tokens: list[int], request_salt: str = "", chunk_salts: list[bytes] | None = None) -> list[str]:
        """Every object's key, chunk by chunk: parts() per chunk (what a lookup asks for), the
        chain hashed once per stage or group."""
        each = [self.group_keys(tokens, i, request_salt, chunk_salts)
                for i in range(len(self.stages) * len(self.groups))]
        per = [self.group_objects(i) if len(self.stages) == 1 else self.head_groups() for i in range(len(each))]
        return [k for c in range(len(each[0]) // per[0]) for i, keys in enumerate(each)
                for k in keys[c * per[i]:(c + 1) * per[i]]]

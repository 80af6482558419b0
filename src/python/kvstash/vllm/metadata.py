"""What the scheduler hands the workers each step (KvstashMetadata): the chunk runs to load and
save (ChunkRun), a hybrid model's loads the request waits for, and on the direct P/D path the
blocks a decode reads (BlockRead) and those a prefill holds for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

import kvstash


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

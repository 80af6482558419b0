"""kvstash: KV-cache offload to remote memory.

The objects and the paged-cache API are the C++ library's, under the same names
(kvstash._native, a pybind11 module): Store, KvCache, KvSave, KvLoad, KvSync, KvExport,
KvImport, KvPeerRead, KvHandoffs, KvKeep, KeepHint, keep_key_hash, Error. The engine integrations are submodules:
kvstash.vllm (a vLLM KV connector), kvstash.sglang (SGLang HiCache storage).
"""

from ._native import *  # noqa: F401,F403 (the module's public names)
from ._native import (Error, KeepHint, KvCache, KvExport, KvHandoffs, KvImport, KvKeep, KvLoad,  # noqa: F401
                      KvPeerRead, KvSave, KvSync, Store, keep_key_hash)  # (named for readers and linters)

"""kvstash: KV-cache offload to remote memory.

The objects and the paged-cache API are the C++ library's, under the same names
(kvstash._native, a pybind11 module): Store, KvCache, KvSave, KvLoad, KvSync, KvExport,
KvImport, KvPeerRead, KvKeep, KeepHint, keep_key_hash, Error. The engine integrations are submodules:
kvstash.vllm (a vLLM KV connector), kvstash.sglang (SGLang HiCache storage).
"""

from ._native import *  # noqa: F401,F403 (the module's public names)
from ._native import (Error, KeepHint, KvCache, KvExport, KvImport, KvKeep, KvLoad, KvPeerRead,  # noqa: F401
                      KvSave, KvSync, Store, keep_key_hash)  # (named for readers and linters)

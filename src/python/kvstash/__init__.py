"""kvstash: KV-cache offload to remote memory.

The objects and the paged-cache API are the C++ library's, under the same names
(kvstash._native, a pybind11 module): Store, KvCache, KvSave, KvLoad, KvSync, KvExport,
KvImport, KvPeerRead, Error. The engine integrations are submodules: kvstash.vllm (a vLLM KV connector).
"""

from ._native import *  # noqa: F401,F403 (the module's public names)
from ._native import Error, KvCache, KvExport, KvImport, KvLoad, KvPeerRead, KvSave, KvSync, Store  # noqa: F401 (named for readers and linters)

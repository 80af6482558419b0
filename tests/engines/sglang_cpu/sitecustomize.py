"""Test-only patches to SGLang's hierarchical cache (HiCache) for tests/engines/sglang_e2e_test.py on a
CPU-only host, applied as the patched modules load in every process whose PYTHONPATH starts
with tests/engines/sglang_cpu (Python imports sitecustomize at start; SGLang's scheduler is a spawned
child, so it is patched too).

Replaces two things, both between SGLang's device KV pool and its host pool:
- sglang.srt.mem_cache.pool_host.base.HostKVCache: built with pin_memory=False (pinning host
  memory needs the CUDA driver);
- sglang.srt.mem_cache.pool_host.mha.transfer_kv_direct: SGLang imports it only on CUDA and HIP
  (a kernel of sgl_kernel.kvcacheio) and XPU, so on the CPU the name is undefined when HiCache's
  "direct" I/O calls it; here it is the same copy in torch: each layer's tokens at src_indices
  to dst_indices.
Everything else but the sgl_kernel stand-in beside this file is SGLang's own code, and pages
move between the host pool and the cell through kvstash.sglang unpatched.
"""

import importlib.abc
import importlib.util
import sys


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    import torch

    src = src_indices.to(device="cpu", dtype=torch.int64)
    dst = dst_indices.to(device="cpu", dtype=torch.int64)
    for s, d in zip(src_layers, dst_layers):
        d[dst] = s[src].to(d.device)


def _without_pinned_memory(cls):
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    cls.__init__ = __init__


_PATCHES = {
    "sglang.srt.mem_cache.pool_host.base": lambda m: _without_pinned_memory(m.HostKVCache),
    "sglang.srt.mem_cache.pool_host.mha": lambda m: setattr(m, "transfer_kv_direct", _transfer_kv_direct),
}


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds a patched module the ordinary way and runs its patch right after the module runs."""

    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnLoad())

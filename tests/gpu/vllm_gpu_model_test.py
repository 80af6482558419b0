"""kvstash.vllm as vLLM drives it on a GPU, on the CUDA model (tests/gpu/cuda_model).

vLLM runs its forward pass on torch's default stream, whose handle is 0: CUDA's legacy default
stream. The connector is called as vLLM's model runner calls it, in the real vLLM's venv, with
kvstash's Python package linked against the CPU model of the CUDA runtime (no GPU here):

- the paged caches are model GPU memory the host cannot touch (vLLM's per-layer view of it);
- each layer's "attention kernel" writes the layer 50 ms late, queued on stream 0, just before
  vLLM calls save_kv_layer for it;
- torch.cuda.current_stream() answers what torch answers for its default stream on a GPU: a
  stream whose cuda_stream is 0 (this venv's torch is CPU-only, so the test says it);
- a second worker loads the chunks into other blocks, each layer handed to stream 0.

What a load brings back must be the kernels' bytes. A connector that took that 0 as "nothing to
wait for" would store (and checksum) the bytes from before the kernels; this test catches it.

Usage (meson test `vllm_gpu_model`): VENV/bin/python tests/gpu/vllm_gpu_model_test.py BUILD_DIR
Exit 77 (skipped) when vLLM cannot be imported.
"""

import ctypes
import os
import sys
import types
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engines"))
import engine_fixture  # noqa: E402

BUILD = engine_fixture.build_dir()
# The package over the CUDA model, ahead of the build's own.
sys.path.insert(0, os.path.join(BUILD, "tests", "gpu", "cuda_model"))

try:
    import torch
    import vllm  # noqa: F401
except ImportError as e:
    engine_fixture.run_in_venv_or_skip("vllm", "vLLM", e, __file__)

import kvstash  # noqa: E402
import kvstash._native  # noqa: E402
from kvstash.vllm import ChunkRun, KvstashMetadata  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

import vllm_test  # noqa: E402  (its config and cache geometry)

BLOCK, HEADS, HEAD, NUM_BLOCKS, LAYERS = (vllm_test.BLOCK, vllm_test.HEADS, vllm_test.HEAD, vllm_test.NUM_BLOCKS,
                                          vllm_test.LAYERS)
PAGE = 2 * BLOCK * HEADS * HEAD * 2  # bytes of one block of one layer (fp16 K and V)
LAYER_BYTES = NUM_BLOCKS * PAGE

# The model's runtime, in this process: the extension module is one shared object, and dlopen of
# the same file returns it, so ctypes reaches the very model the package uses.
cuda = ctypes.CDLL(kvstash._native.__file__)
cuda.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
cuda.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
cuda.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
cuda.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
cuda.kvstash_cuda_model_fill_words.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
                                               ctypes.c_void_p]
DEVICE_TO_HOST = 2


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: cudaError {rc}")


def device_alloc(n, byte):
    p = ctypes.c_void_p()
    check(cuda.cudaMalloc(ctypes.byref(p), n), "cudaMalloc")
    check(cuda.cudaMemset(p, byte, n), "cudaMemset")
    return p.value


def device_read(ptr, n):
    out = ctypes.create_string_buffer(n)
    check(cuda.cudaMemcpy(out, ptr, n, DEVICE_TO_HOST), "cudaMemcpy")
    return out.raw


class GpuLayer:
    """vLLM's per-layer view of a paged cache in GPU memory, [blocks, heads, tokens, K and V of a
    head] over NHD storage: the attributes the connector reads of a torch tensor."""

    is_cuda = True

    def __init__(self, ptr):
        self.ptr = ptr
        self.shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
        self._strides = (BLOCK * HEADS * 2 * HEAD, 2 * HEAD, HEADS * 2 * HEAD, 1)

    def data_ptr(self):
        return self.ptr

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]

    def element_size(self):
        return 2

    def dim(self):
        return 4


def default_stream():
    """What torch.cuda.current_stream() is on a GPU while vLLM runs its forward pass."""
    return types.SimpleNamespace(cuda_stream=0)


class VllmOnTheDefaultStream(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cell = engine_fixture.Cell(BUILD)
        vllm_test.URL = cls.cell.url
        cls.saved_stream = torch.cuda.current_stream
        torch.cuda.current_stream = default_stream

    @classmethod
    def tearDownClass(cls):
        torch.cuda.current_stream = cls.saved_stream
        cls.cell.stop()

    def worker(self, layers):
        config = vllm_test.make_config()
        w = KVConnectorFactory.create_connector(config=config, role=KVConnectorRole.WORKER,
                                                kv_cache_config=vllm_test.make_kv_cache_config())
        w.register_kv_caches({name: GpuLayer(p) for name, p in zip(LAYERS, layers)})
        return w

    def test_saves_and_loads_on_torchs_default_stream_carry_the_kernels_bytes(self):
        self.assertEqual(torch.cuda.current_stream().cuda_stream, 0, "torch's default stream is handle 0")
        a = [device_alloc(LAYER_BYTES, 0x11) for _ in LAYERS]  # 0x11: what an unordered save stores
        b = [device_alloc(LAYER_BYTES, 0x5A) for _ in LAYERS]
        saver, loader = self.worker(a), self.worker(b)
        tokens = [(i * 37 + 11) % 1000 for i in range(3 * BLOCK)]
        from_blocks, to_blocks = [5, 9, 2], [11, 3, 7]

        # vLLM's step with saves: each layer's attention queued on stream 0, then save_kv_layer.
        saver.bind_connector_metadata(KvstashMetadata(saves=[ChunkRun("r1", tokens, [from_blocks], 0, 3)]))
        saver.start_load_kv(None)
        for i, name in enumerate(LAYERS):
            saver.wait_for_layer_load(name)
            check(cuda.kvstash_cuda_model_fill_words(a[i], LAYER_BYTES // 8, 1000 + i, 50_000_000, None),
                  "the attention kernel")
            saver.save_kv_layer(name, None, None)
        saver.wait_for_save()
        self.assertEqual(saver.get_block_ids_with_load_errors(), set())
        saver.clear_connector_metadata()
        self.assertEqual(saver._stats["chunks_saved"], 3, saver._stats)

        # vLLM's step with loads: each layer handed to stream 0 before its attention runs there.
        loader.bind_connector_metadata(KvstashMetadata(loads=[ChunkRun("r2", tokens, [to_blocks], 0, 3)]))
        loader.start_load_kv(None)
        for name in LAYERS:
            loader.wait_for_layer_load(name)
        check(cuda.cudaStreamSynchronize(None), "cudaStreamSynchronize")
        loader.wait_for_save()
        self.assertEqual(loader.get_block_ids_with_load_errors(), set())
        loader.clear_connector_metadata()
        self.assertEqual(loader._stats["chunks_loaded"], 3, loader._stats)

        for i in range(len(LAYERS)):
            written, loaded = device_read(a[i], LAYER_BYTES), device_read(b[i], LAYER_BYTES)
            for src, dst in zip(from_blocks, to_blocks):
                kernel_bytes = written[src * PAGE:(src + 1) * PAGE]
                self.assertNotEqual(kernel_bytes, b"\x11" * PAGE, "the kernel ran")
                self.assertEqual(loaded[dst * PAGE:(dst + 1) * PAGE], kernel_bytes,
                                 f"layer {i}, block {src} -> {dst}: the kernel's bytes, not the ones before it")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])

"""kvstash.sglang against the real SGLang (scripts/engines-setup installs it into a venv).

The backend is created the way SGLang creates it, by StorageBackendFactory from a
HiCacheStorageConfig naming the "dynamic" backend and its module, and its zero-copy page
variants move pages in and out of SGLang's own host KV pool (MHATokenToKVPoolHost over an
MHATokenToKVPool, both on the CPU), in both of its layouts: pages one engine stored come back
bit for bit into other slots of another engine's pool.

Usage (meson test `sglang`): [VENV/bin/]python tests/engines/sglang_test.py BUILD_DIR
Exit 77 (skipped) when SGLang cannot be imported.
"""

import os
import sys
import tempfile
import unittest

import engine_fixture

BUILD = engine_fixture.build_dir()

try:
    import sglang  # noqa: F401
    import torch
except ImportError as e:
    engine_fixture.run_in_venv_or_skip("sglang", "SGLang", e, __file__)

import kvstash  # noqa: E402
from sglang.srt.mem_cache import memory_pool  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvstash.sglang import KvstashHiCacheStorage  # noqa: E402

PAGE = 16  # tokens per page
URL = None


def setUpModule():
    global URL, _cell
    _cell = engine_fixture.Cell(BUILD)
    URL = _cell.url


def tearDownModule():
    _cell.stop()


def storage_config(tp_rank=0, tp_size=1, mla=False, attn_cp_rank=0, attn_cp_size=1, **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=attn_cp_rank, attn_cp_size=attn_cp_size,
        is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny-llama",
        extra_config={"backend_name": "kvstash", "module_path": "kvstash.sglang",
                      "class_name": "KvstashHiCacheStorage", "interface_v1": 1, "redis_url": URL,
                      "transports": "shm,tcp", "weights_id": "tiny-llama-test-weights", **extra})


def host_pool(layout, seed=None):
    """SGLang's own host KV pool (2 layers, 2 heads of 16, fp16) over its own device pool, both
    on the CPU; filled with random bytes when `seed` is given."""
    dev = memory_pool.MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.float16, head_num=2, head_dim=16,
                                       layer_num=2, device="cpu", enable_memory_saver=False,
                                       enable_alt_stream=False)
    host = MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=256, start_layer=0, end_layer=2)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        host.kv_buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, host.kv_buffer.shape, generator=g,
                                                             dtype=torch.int16))
    else:
        host.kv_buffer.zero_()
    return host


def mamba_pool(seed=None):
    """SGLang's own host pool of Mamba state (2 layers: a temporal state of 4x8 fp32, a conv state
    of 3x16 fp16, a state a page), page_first as its storage needs; random when `seed` is given."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros(2, 9, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(2, 9, 3, 16, dtype=torch.float16),))
    host = MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first")
    g = torch.Generator().manual_seed(seed or 0)
    for t in (host.temporal_buffer, *host.conv_buffer):
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.view(torch.int16).shape, generator=g,
                                                dtype=torch.int16) if seed is not None else 0)
    return host


def page_bytes(host, indices):
    """The bytes of the pages at `indices`, as SGLang's zero-copy metadata names them."""
    import ctypes

    ptrs, sizes = host.get_page_buffer_meta(indices)
    return [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)]


def make(config, host=None):
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    if host is not None:
        backend.register_mem_pool_host(host)
    return backend


class SglangBackend(unittest.TestCase):
    def test_sglangs_factory_creates_it_from_the_dynamic_config(self):
        b = make(storage_config())
        self.assertIsInstance(b, HiCacheStorage)
        self.assertIsInstance(b, KvstashHiCacheStorage)
        with self.assertRaisesRegex(ValueError, "unknown HiCache extra config keys.*redis_url"):
            make(storage_config(redis_host="x"))

    def test_the_model_is_named_by_content_and_a_clear_stops_sharing(self):
        """Outside a server (no SGLang server arguments) a backend needs weights_id; with it,
        other weights (another weights_id) share no page, and a clear() leaves this engine's
        keys its own from then on."""
        with self.assertRaisesRegex(ValueError, "weights_id"):
            make(storage_config(weights_id=""))
        host = host_pool("page_first", seed=11)
        a = make(storage_config(), host)
        keys = [f"content-{i}" for i in range(3)]
        self.assertEqual(a.batch_set_v1(keys, torch.arange(3 * PAGE)), [True] * 3)
        self.assertEqual(make(storage_config(), host_pool("page_first")).batch_exists(keys), 3)
        other = make(storage_config(weights_id="other-weights"), host_pool("page_first"))
        self.assertEqual(other.batch_exists(keys), 0, "other weights found this model's pages")
        a.clear()
        self.assertEqual(a.batch_exists(keys), 0, "a cleared engine found the pages stored before")
        self.assertEqual(make(storage_config(), host_pool("page_first")).batch_exists(keys), 3,
                         "a clear removed the shared cell's pages")

    def test_a_servers_model_and_adapters_are_named_by_content(self):
        """Inside a server: the weights' files and every --lora-paths adapter's, not their paths
        or names; the served name does not enter."""
        import types

        import kvstash.sglang as ks

        d = tempfile.mkdtemp(prefix="kvstash-sglang-identity-")

        def files(name, content):
            os.makedirs(os.path.join(d, name), exist_ok=True)
            with open(os.path.join(d, name, "weights.safetensors"), "wb") as f:
                f.write(content)
            return os.path.join(d, name)

        model, lora = files("model", b"W" * 4096), files("lora", b"A" * 512)
        args = types.SimpleNamespace(model_path=model, dtype="float16", quantization=None, kv_cache_dtype="auto",
                                     load_format="auto", json_model_override_args="{}", revision=None,
                                     served_model_name="x", lora_paths=[f"a={lora}"])
        saved = ks._server_args
        ks._server_args = lambda: args
        try:
            first = ks.engine_identity()
            args.served_model_name = "y"
            self.assertEqual(ks.engine_identity(), first, "the served name changed the keys")
            files("lora", b"B" * 512)  # the adapter rewritten under its name and path
            rewritten = ks.engine_identity()
            self.assertNotEqual(rewritten, first, "a rewritten adapter kept the keys")
            files("model", b"V" * 4096)  # the weights rewritten in place
            self.assertNotEqual(ks.engine_identity(), rewritten, "rewritten weights kept the keys")
            args.lora_paths = [f"a={os.path.join(d, 'nowhere')}"]
            with self.assertRaisesRegex(ValueError, "not on this host"):
                ks.engine_identity()
        finally:
            ks._server_args = saved

    def test_pages_move_in_place_between_two_engines_pools_bit_exact(self):
        for layout in ("page_first", "layer_first"):
            with self.subTest(layout=layout):
                keys = [f"{layout}-page-{i}" for i in range(4)]
                a_host = host_pool(layout, seed=1)
                a = make(storage_config(), a_host)
                src = torch.arange(2 * PAGE, 6 * PAGE)  # pages 2..5 of a's pool
                self.assertEqual(a.batch_exists(keys), 0)
                self.assertEqual(a.batch_set_v1(keys, src), [True] * 4)
                self.assertEqual(a.batch_exists(keys), 4)

                b_host = host_pool(layout)
                b = make(storage_config(), b_host)
                dst = torch.arange(10 * PAGE, 14 * PAGE)  # other slots of another pool
                self.assertEqual(b.batch_get_v1(keys, dst), [True] * 4)
                self.assertEqual(page_bytes(b_host, dst), page_bytes(a_host, src))
                self.assertNotEqual(page_bytes(b_host, dst)[0], bytes(len(page_bytes(b_host, dst)[0])))
                # SGLang's storage metrics: one batch each way, four pages. With them, the
                # store's own metrics go to what SGLang's /metrics serves (prometheus_client's
                # registry): a's four puts since it opened.
                import prometheus_client

                puts = 'sglang:kvstash_client_ops_total{model_name="tiny-llama",op="put",status="ok",tp_rank="0"}'
                samples = engine_fixture.prometheus_samples
                before = samples(prometheus_client.generate_latest().decode()).get(puts, 0)
                self.assertEqual(a.get_stats().backup_pgs, [4])
                self.assertEqual(samples(prometheus_client.generate_latest().decode())[puts], before + 4)
                self.assertEqual(samples(a.store.metrics_text())['kvstash_client_ops_total{op="put",status="ok"}'], 4)
                got = b.get_stats()
                self.assertEqual(got.prefetch_pgs, [4])
                self.assertEqual(len(got.prefetch_bandwidth), 1)
                self.assertEqual(b.get_stats().prefetch_pgs, [], "each interval starts empty")
                self.assertIn('sglang:kvstash_client_op_duration_seconds_bucket{le="0.01",model_name="tiny-llama",'
                              'op="get",tp_rank="0"}', samples(prometheus_client.generate_latest().decode()))

    def test_a_missing_page_ends_the_prefix_and_fails_its_get(self):
        keys = [f"gap-{i}" for i in range(3)]
        a_host = host_pool("page_first", seed=2)
        a = make(storage_config(), a_host)
        self.assertEqual(a.batch_set_v1(keys, torch.arange(0, 3 * PAGE)), [True] * 3)
        kvstash.Store(URL, transports="shm,tcp").remove(a.prefix + keys[1])
        self.assertEqual(a.batch_exists(keys), 1)
        b_host = host_pool("page_first")
        b = make(storage_config(), b_host)
        self.assertEqual(b.batch_get_v1(keys, torch.arange(PAGE, 4 * PAGE)), [True, False, True])
        # Set again: the stored leading page is skipped, the rest written.
        self.assertEqual(a.batch_set_v1(keys, torch.arange(0, 3 * PAGE)), [True] * 3)
        self.assertEqual(a.batch_exists(keys), 3)

    def test_under_turn_ttl_each_page_use_tells_the_cell_its_requests_turn_and_lookup(self):
        """A turn-ttl cell keeps a page for a time learned per class of use: a prefetch's lookup
        gives the request's turn (counted along the chain) and the cell's clock, and the gets
        and puts of its pages that follow name them (KeepHint), a page's place counted after
        SGLang's prefix_keys. Without hints no record would have a turn, and each page would be
        due when it was used."""
        import subprocess

        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        cli = [os.path.join(BUILD, "tools", "kvstash", "kvstash"), "--redis", URL]
        out = subprocess.run(cli + ["policy", "turn-ttl", "--yes"], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        try:
            keys = [f"turns-{i}" for i in range(5)]
            a = make(storage_config(), host_pool("page_first", seed=21))
            start = HiCacheStorageExtraInfo(prefix_keys=[])
            self.assertEqual(a.batch_exists(keys[:3], start), 0)  # the first turn's prefetch
            self.assertEqual(a.batch_set_v1(keys[:3], torch.arange(3 * PAGE), start), [True] * 3)
            b = make(storage_config(), host_pool("page_first"))
            self.assertEqual(b.batch_exists(keys, start), 3)  # the next turn's: the 3 pages, then 2 more
            self.assertEqual(b.batch_get_v1(keys[:3], torch.arange(3 * PAGE), start), [True] * 3)
            self.assertEqual(b.batch_set_v1(keys[3:], torch.arange(3 * PAGE, 5 * PAGE),
                                            HiCacheStorageExtraInfo(prefix_keys=keys[:3])), [True] * 2)

            def field(*args):
                return subprocess.run(["redis-cli", "-u", URL, *args], capture_output=True, text=True,
                                      check=True).stdout.strip()

            records = [f"{engine_fixture.CELL_PREFIX}:obj:{b.prefix}{k}" for k in keys]
            self.assertEqual([field("HGET", r, "turn") for r in records], ["1"] * 3 + ["2"] * 2,
                             "each page's record names the turn of the request that put it")
            due = [float(field("ZSCORE", f"{engine_fixture.CELL_PREFIX}:ttl:due", b.prefix + k)) for k in keys]
            # The next turn's gets and puts count from its lookup: each page due a microsecond of
            # the cell's clock before the one it leads to.
            for i in range(1, 5):
                self.assertAlmostEqual(due[i - 1] - due[i], 1e-6, delta=2e-7,
                                       msg=f"page {i} is not due just before page {i - 1}: {due}")
        finally:
            out = subprocess.run(cli + ["policy", "lru", "--yes"], capture_output=True, text=True)
            self.assertEqual(out.returncode, 0, out.stderr)

    def test_tensor_parallel_ranks_keep_their_own_pages_and_mla_one_copy(self):
        host0, host1 = host_pool("page_first", seed=3), host_pool("page_first", seed=4)
        r0 = make(storage_config(tp_rank=0, tp_size=2), host0)
        r1 = make(storage_config(tp_rank=1, tp_size=2), host1)
        self.assertEqual(r0.batch_set_v1(["tp-0"], torch.arange(0, PAGE)), [True])
        self.assertEqual(r1.batch_exists(["tp-0"]), 0, "rank 1 has its own shard of the page")
        # MLA: the storage writer (rank 0) stores, every rank reads that one copy.
        m0 = make(storage_config(tp_rank=0, tp_size=2, mla=True), host_pool("page_first", seed=5))
        m1_host = host_pool("page_first")
        m1 = make(storage_config(tp_rank=1, tp_size=2, mla=True), m1_host)
        self.assertEqual(m1.batch_set_v1(["mla-0"], torch.arange(0, PAGE)), [True])
        self.assertEqual(m1.batch_exists(["mla-0"]), 0, "a non-writer stores nothing")
        self.assertEqual(m0.batch_set_v1(["mla-0"], torch.arange(0, PAGE)), [True])
        self.assertEqual(m1.batch_get_v1(["mla-0"], torch.arange(PAGE, 2 * PAGE)), [True])
        self.assertEqual(page_bytes(m1_host, torch.arange(PAGE, 2 * PAGE)),
                         page_bytes(m0.mem_pool_host, torch.arange(0, PAGE)))

    def test_pools_of_other_layouts_never_share_a_page(self):
        """A layer_first page has the byte count of a page_first one: loaded into the other
        layout it would be scrambled, so the layout is in the keys."""
        first = make(storage_config(), host_pool("layer_first", seed=6))
        self.assertEqual(first.batch_set_v1(["layout-0"], torch.arange(0, PAGE)), [True])
        other = make(storage_config(), host_pool("page_first"))
        self.assertEqual(other.batch_exists(["layout-0"]), 0, "a page_first pool found a layer_first page")
        self.assertEqual(other.batch_get_v1(["layout-0"], torch.arange(PAGE, 2 * PAGE)), [False])
        same = make(storage_config(), host_pool("layer_first"))
        self.assertEqual(same.batch_exists(["layout-0"]), 1, "a pool of the same layout shares it")

    def test_context_parallel_ranks_of_an_mla_model_keep_their_own_shards(self):
        cp0 = make(storage_config(mla=True, attn_cp_rank=0, attn_cp_size=2), host_pool("page_first", seed=7))
        cp1 = make(storage_config(mla=True, attn_cp_rank=1, attn_cp_size=2), host_pool("page_first"))
        self.assertEqual(cp0.batch_set_v1(["cp-0"], torch.arange(0, PAGE)), [True])
        self.assertEqual(cp1.batch_exists(["cp-0"]), 0, "context-parallel ranks hold different shards")

    def test_a_hybrid_models_pools_are_stored_each_and_a_lookup_folds_them_as_hicache_does(self):
        """HiCache's v2 interface: a sliding window's KV pool and Mamba's state pool beside the KV
        pool, registered as SGLang's hybrid controller registers them. Each pool's pages are
        objects of their own under the same page hashes; a lookup needs the KV pool's pages
        and only the trailing ones of a window or a state; pages come back bit for bit into
        other slots of another engine's pools."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        kv, swa, mamba = host_pool("page_first", seed=21), host_pool("page_first", seed=22), mamba_pool(seed=23)
        a = make(storage_config(), kv)
        a.register_mem_host_pool_v2(swa, PoolName.SWA)
        a.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        keys = [f"hybrid-{i}" for i in range(4)]
        self.assertEqual(a.batch_set_v1(keys, torch.arange(4 * PAGE)), [True] * 4)
        # What a window of two pages still holds, and the state at pages 1 and 3.
        done = a.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=torch.arange(2 * PAGE, 4 * PAGE), keys=keys[2:]),
                               PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1, 3]),
                                            keys=[keys[1], keys[3]])])
        self.assertEqual(done, {PoolName.SWA: [True, True], PoolName.MAMBA: [True, True]})

        b = make(storage_config(), host_pool("page_first"))
        swa_b, mamba_b = host_pool("page_first"), mamba_pool()
        b.register_mem_host_pool_v2(swa_b, PoolName.SWA)
        b.register_mem_host_pool_v2(mamba_b, PoolName.MAMBA)

        def query():
            return b.batch_exists_v2(keys, [
                PoolTransfer(PoolName.SWA, keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
                PoolTransfer(PoolName.MAMBA, keys=keys[3:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])

        hit = query()
        self.assertEqual((hit.kv_hit_pages, hit.extra_pool_hit_pages),
                         (4, {PoolName.KV: 4, PoolName.SWA: 4, PoolName.MAMBA: 4}))
        got = b.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=torch.arange(6 * PAGE, 8 * PAGE), keys=keys[2:]),
                              PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([5]), keys=keys[3:])])
        self.assertEqual(got, {PoolName.SWA: [True, True], PoolName.MAMBA: [True]})
        self.assertEqual(page_bytes(swa_b, torch.arange(6 * PAGE, 8 * PAGE)),
                         page_bytes(swa, torch.arange(2 * PAGE, 4 * PAGE)))
        self.assertEqual(page_bytes(mamba_b, torch.tensor([5])), page_bytes(mamba, torch.tensor([3])))
        self.assertNotEqual(page_bytes(mamba, torch.tensor([3])), page_bytes(mamba, torch.tensor([1])))
        # Put again: nothing is written twice.
        self.assertEqual(a.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([3]),
                                                      keys=keys[3:])]), {PoolName.MAMBA: [True]})
        self.assertEqual(a.stats["pages_set"], 4 + 4)

        # The state at page 3 goes: the longest prefix with its state is 2 pages.
        store = kvstash.Store(URL, transports="shm,tcp")
        store.remove(a._pool_keys(PoolName.MAMBA, keys[3:])[0])
        hit = query()
        self.assertEqual((hit.kv_hit_pages, hit.extra_pool_hit_pages[PoolName.MAMBA]), (2, 2))
        # The window's last page goes: no prefix has its window.
        store.remove(a._pool_keys(PoolName.SWA, keys[3:])[0])
        self.assertEqual(query().kv_hit_pages, 0)
        self.assertEqual(b.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=torch.arange(2 * PAGE),
                                                      keys=keys[2:])]), {PoolName.SWA: [True, False]})
        with self.assertRaisesRegex(ValueError, "never registered"):
            b.batch_get_v2([PoolTransfer(PoolName.INDEXER, host_indices=torch.arange(PAGE), keys=keys[:1])])

    def test_the_generic_interface_moves_one_tensor(self):
        b = make(storage_config())
        value = torch.randint(0, 255, (4096,), dtype=torch.uint8)
        self.assertTrue(b.set("generic-0", value))
        self.assertTrue(b.exists("generic-0"))
        self.assertTrue(b.set("generic-0", value), "an existing page is not written again")
        out = torch.zeros(4096, dtype=torch.uint8)
        self.assertIs(b.get("generic-0", out), out)
        self.assertTrue(torch.equal(out, value))
        self.assertIsNone(b.get("generic-missing", torch.zeros(16, dtype=torch.uint8)))
        self.assertEqual(b.batch_get(["generic-0", "generic-missing"], [torch.zeros(4096, dtype=torch.uint8),
                                                                       torch.zeros(8, dtype=torch.uint8)])[1], None)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)

"""The kvstash Python module against a real cell (started by capi_test): plain objects,
a paged KV cache saved and loaded layer by layer, keys, errors, registered buffers held in
place, and the cluster token of the cell "secured" (whose node requires it).
Usage: python_test.py URL CLUSTER_TOKEN"""
import gc
import random
import sys
import unittest

import kvstash

URL = None
TOKEN = None


class KvstashPython(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.store = kvstash.Store(URL, transports="shm,tcp", timeout_ms=10000)

    def test_buffers_move_in_place_and_their_size_must_be_the_objects(self):
        import ctypes

        src = bytearray(random.Random(9).randbytes(3 * 4096 + 5))
        src_view = (ctypes.c_char * len(src)).from_buffer(src)
        a = ctypes.addressof(src_view)
        self.store.register_memory(a, len(src))
        self.store.put("py:buffers", [(a, 4096), (a + 4096, len(src) - 4096)], ttl_ms=60000)
        self.assertEqual(self.store.get("py:buffers"), bytes(src))
        dst = bytearray(len(src))
        view = memoryview(dst)  # not registered: the store registers it for the call
        self.assertEqual(self.store.get("py:buffers", into=[view[:100], view[100:]]), len(src))
        self.assertEqual(dst, src)
        dst2 = bytearray(len(src))
        self.store.register_memory(ctypes.addressof((ctypes.c_char * len(dst2)).from_buffer(dst2)), len(dst2))
        d2 = ctypes.addressof((ctypes.c_char * len(dst2)).from_buffer(dst2))
        self.assertEqual(self.store.get("py:buffers", into=[(d2, 100), (d2 + 100, len(dst2) - 100)]), len(src))
        self.assertEqual(dst2, src)
        big = bytearray(len(src) + 8)
        with self.assertRaises(kvstash.Error) as e:
            self.store.get("py:buffers", into=[big])
        self.assertEqual(e.exception.code, "invalid_argument")
        with self.assertRaises(kvstash.Error) as e:
            self.store.get("py:buffers", into=[view[:64]])  # too small: nothing is read
        self.assertEqual(e.exception.code, "invalid_argument")
        with self.assertRaises(kvstash.Error) as e:
            self.store.get("py:nothing", into=[view[:64]])
        self.assertEqual(e.exception.code, "not_found")
        with self.assertRaises(BufferError):
            self.store.get("py:buffers", into=[bytes(len(src))])  # read-only
        self.store.remove("py:buffers")
        del src_view, view

    def test_an_address_outside_registered_memory_is_refused_not_a_crash(self):
        # An integer is not memory: over shm a wrong one used to kill the interpreter (SIGSEGV).
        self.store.put("py:addr", b"x" * 4096, ttl_ms=60000)
        for bad in [(0x1000, 4096), (0, 4096), (2**63, 4096), (2**64 - 16, 4096)]:
            with self.assertRaises(kvstash.Error) as e:
                self.store.get("py:addr", into=[bad])
            self.assertEqual(e.exception.code, "invalid_argument")
            self.assertIn("register_memory", e.exception.message)
            with self.assertRaises(kvstash.Error) as e:
                self.store.put("py:addr2", [bad])
            self.assertEqual(e.exception.code, "invalid_argument")
        self.store.remove("py:addr")

    def test_objects_round_trip_and_errors_carry_their_code(self):
        self.store.put("py:k", b"\x00\x01hello", ttl_ms=60000)
        self.assertEqual(self.store.get("py:k"), b"\x00\x01hello")
        self.store.remove("py:k")
        with self.assertRaises(kvstash.Error) as e:
            self.store.get("py:k")
        self.assertEqual(e.exception.code, "not_found")
        with self.assertRaises(kvstash.Error) as e:
            kvstash.Store("not a url")
        self.assertEqual(e.exception.code, "invalid_argument")
        # Copies on distinct nodes: this cell has one node, so two copies cannot be kept apart.
        with self.assertRaises(kvstash.Error) as e:
            self.store.put("py:twice", b"copies", replicas=2)
        self.assertEqual(e.exception.code, "no_space")
        with self.assertRaises(kvstash.Error) as e:
            self.store.put("py:many", b"copies", replicas=9)
        self.assertEqual(e.exception.code, "invalid_argument")

    def test_kv_cache_layer_by_layer(self):
        layers, blocks, block_size, heads, head_dim = 3, 16, 4, 2, 16
        block_bytes = block_size * heads * head_dim * 2
        rng = random.Random(5)
        a = [bytearray(rng.getrandbits(8) for _ in range(2 * blocks * block_bytes)) for _ in range(layers)]
        b = [bytearray(2 * blocks * block_bytes) for _ in range(layers)]
        common = dict(num_blocks=blocks, block_size=block_size, num_kv_heads=heads, head_dim=head_dim,
                      dtype="fp16", model="py-model", chunk_tokens=8)
        kva = kvstash.KvCache(self.store, a, **common)
        kvb = kvstash.KvCache(self.store, b, **common)
        self.assertEqual(kva.chunk_tokens, 8)
        self.assertEqual(kva.chunk_bytes, layers * 2 * 2 * block_bytes)
        self.assertEqual(kva.layout_tag, "L3.P2.H2.D16.B4.fp16.nhd")
        tokens = [rng.randrange(32000) for _ in range(2 * 8 + 5)]
        self.assertEqual(kva.keys(tokens),
                         kvstash.prefix_chunk_keys(tokens, "py-model", kva.layout_tag, chunk_tokens=8))
        self.assertEqual(kva.contains_prefix(tokens), 0)

        blocks_a, blocks_b = [9, 2, 14, 5], [0, 11, 7, 3]
        save = kva.begin_save(tokens, blocks_a, 0, 2)
        with self.assertRaises(kvstash.Error) as e:
            save.save_layer(0, after=kvstash.KvSync.stream(1))  # a host cache has no streams to wait for
        self.assertEqual(e.exception.code, "invalid_argument")
        # KvSync() is CUDA's legacy default stream, never "nothing"; a host cache has no GPU work
        # to order after, so it passes, as does the explicit KvSync.none().
        self.assertEqual((kvstash.KvSync().kind, kvstash.KvSync().handle), ("stream", 0))
        self.assertEqual(kvstash.KvSync.none().kind, "none")
        self.assertEqual(repr(kvstash.KvSync.event(5)), "KvSync.event(5)")
        save.save_layer(0)
        save.save_layer(1, after=kvstash.KvSync())
        for layer in range(2, layers):
            save.save_layer(layer, after=kvstash.KvSync.none())
        self.assertEqual(save.wait(), [("ok", ""), ("ok", "")])
        self.assertEqual(kvb.contains_prefix(tokens), 2)
        keys = kvb.keys(tokens)
        hit = self.store.contains_prefix(keys)
        self.assertGreater(hit, 0)
        self.assertEqual(self.store.lookup_prefix(keys), (hit, 1, 0.0), "under lru: a first turn, no turn-ttl clock")

        load = kvb.begin_load(tokens, blocks_b, 2)
        for layer in range(layers):
            load.wait_layer(layer)
            self.assertTrue(load.layer_ready(layer))
            with self.assertRaises(kvstash.Error) as e:
                load.layer_event(layer)  # a host cache has no device events
            self.assertEqual(e.exception.code, "unsupported")
            with self.assertRaises(kvstash.Error) as e:
                load.wait_layer_on(layer, stream=1)
            self.assertEqual(e.exception.code, "unsupported")
            for i in range(4):
                for part in range(2):
                    src = (part * blocks + blocks_a[i]) * block_bytes
                    dst = (part * blocks + blocks_b[i]) * block_bytes
                    self.assertEqual(a[layer][src:src + block_bytes], b[layer][dst:dst + block_bytes])
        self.assertEqual([code for code, _ in load.wait()], ["ok", "ok"])

        # Through host bounce buffers: the same bytes.
        c = [bytearray(2 * blocks * block_bytes) for _ in range(layers)]
        kvc = kvstash.KvCache(self.store, c, staging="host", **common)
        self.assertEqual(kvc.data_path, "staged")
        self.assertEqual(kvc.device, "host")
        self.assertEqual(kva.data_path, "direct")
        self.assertEqual([code for code, _ in kvc.begin_load(tokens, blocks_b, 2).wait()], ["ok", "ok"])
        for layer in range(layers):
            self.assertEqual(c[layer], b[layer])
        with self.assertRaises(kvstash.Error):
            kvstash.KvCache(self.store, c, staging="floppy", **common)
        # Host memory marked as GPU memory: no transport registers it, and direct-only says so.
        with self.assertRaises(kvstash.Error) as e:
            kvstash.KvCache(self.store, c, memory_kind="cuda", staging="none", **common)
        self.assertIn("registering the KV cache", str(e.exception))

        # Cancelled: a load's chunks landed or were cancelled; a save leaves nothing.
        load = kvb.begin_load(tokens, blocks_b, 2)
        load.cancel()
        self.assertTrue(all(code in ("ok", "cancelled") for code, _ in load.wait()))
        other = [t + 1 for t in tokens]
        save = kva.begin_save(other, blocks_a, 0, 2)
        save.save_layer(0)
        save.cancel()
        self.assertEqual([code for code, _ in save.wait()], ["cancelled", "cancelled"])
        self.assertEqual(kva.contains_prefix(other), 0)

        # A chunk gone meanwhile fails alone.
        self.store.remove(kva.keys(tokens)[1])
        load = kvb.begin_load(tokens, blocks_b, 2)
        self.assertEqual([code for code, _ in load.wait()], ["ok", "not_found"])
        self.assertEqual(load.failed_blocks(), blocks_b[2:4])  # chunk 1's blocks: recompute them
        with self.assertRaises(kvstash.Error) as e:
            kvb.begin_load(tokens, blocks_b, 3)  # there is no third full chunk
        self.assertEqual(e.exception.code, "invalid_argument")

    def test_a_registered_buffer_stays_in_place_until_the_cache_is_gone(self):
        # A load writes into the registered bytes: a bytearray that could grow or shrink meanwhile
        # would move them, and the load would write into freed memory.
        layers, blocks, block_size, heads, head_dim = 2, 4, 4, 1, 8
        size = 2 * blocks * block_size * heads * head_dim * 2
        bufs = [bytearray(size) for _ in range(layers)]
        kv = kvstash.KvCache(self.store, bufs, num_blocks=blocks, block_size=block_size, num_kv_heads=heads,
                             head_dim=head_dim, model="py-resize", chunk_tokens=block_size)
        for b in bufs:
            with self.assertRaises(BufferError):
                b.extend(b"more")
            with self.assertRaises(BufferError):
                del b[:1]
        self.assertEqual([len(b) for b in bufs], [size] * layers)

        tokens = [7, 8, 9, 10]
        save = kv.begin_save(tokens, [1], 0, 1)
        for layer in range(layers):
            save.save_layer(layer)
        self.assertEqual(save.wait(), [("ok", "")])
        load = kv.begin_load(tokens, [2], 1)
        del kv, save
        gc.collect()
        with self.assertRaises(BufferError):
            bufs[0].extend(b"more")  # the load still writes into it
        self.assertEqual([code for code, _ in load.wait()], ["ok"])
        del load
        gc.collect()
        for b in bufs:
            b.extend(b"more")  # the cache is gone: the bytes are the bytearray's again
            del b[:4]
            self.assertEqual(len(b), size)

    def test_a_cross_layer_cache_loads_a_range_of_chunks(self):
        # A per-layer cache saves two chunks; a cross-layer cache over one region (block b of
        # layer l, part p at ((b * layers + l) * 2 + p) * block_bytes) loads chunk 1 alone.
        layers, blocks, block_size, heads, head_dim = 3, 8, 4, 2, 16
        bb = block_size * heads * head_dim * 2
        rng = random.Random(17)
        a = [bytearray(rng.getrandbits(8) for _ in range(2 * blocks * bb)) for _ in range(layers)]
        region = bytearray(blocks * layers * 2 * bb)
        common = dict(num_blocks=blocks, block_size=block_size, num_kv_heads=heads, head_dim=head_dim,
                      model="py-cross", chunk_tokens=8)
        kva = kvstash.KvCache(self.store, a, **common)
        kvx = kvstash.KvCache(self.store, arrangement="cross_layer", base=region, num_layers=layers, **common)
        self.assertEqual(kvx.layout_tag, kva.layout_tag)  # the same objects
        tokens = [rng.randrange(32000) for _ in range(2 * 8)]
        blocks_a, blocks_x = [1, 6, 3, 0], [7, 2, 5, 4]
        save = kva.begin_save(tokens, blocks_a, 0, 2)
        for layer in range(layers):
            save.save_layer(layer)
        self.assertEqual(save.wait(), [("ok", ""), ("ok", "")])
        load = kvx.begin_load_range(tokens, blocks_x, 1, 1)  # chunk 1: blocks 2 and 3
        self.assertEqual(load.wait(), [("ok", "")])
        for i in range(4):
            for layer in range(layers):
                for part in range(2):
                    src = (part * blocks + blocks_a[i]) * bb
                    dst = ((blocks_x[i] * layers + layer) * 2 + part) * bb
                    want = a[layer][src:src + bb] if i >= 2 else bytes(bb)  # chunk 0 is not loaded
                    self.assertEqual(region[dst:dst + bb], want, f"block {i} layer {layer} part {part}")
        for bad in (dict(layer_tensors=a, arrangement="cross_layer", base=region),  # both
                    dict(arrangement="cross_layer", num_layers=layers),  # no region
                    dict(layer_tensors=a, arrangement="diagonal")):
            with self.assertRaises(kvstash.Error) as e:
                kvstash.KvCache(self.store, **bad, **common)
            self.assertEqual(e.exception.code, "invalid_argument", bad.keys())

    def test_bad_layouts_are_refused(self):
        with self.assertRaises(kvstash.Error) as e:
            kvstash.KvCache(self.store, [bytearray(10)], num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8,
                            model="m")
        self.assertEqual(e.exception.code, "invalid_argument")  # the buffer is too small
        with self.assertRaises(kvstash.Error):
            kvstash.KvCache(self.store, [bytearray(1 << 12)], num_blocks=4, block_size=4, num_kv_heads=1,
                            head_dim=8, dtype="fp12", model="m")

    def test_an_export_is_read_where_the_store_listens(self):
        """P/D's direct path from Python: the prefill's store serves its memory where `listen`
        says (here another loopback address), and a reader gets the blocks from there."""
        width, blocks = 8, 4
        src = bytearray(random.Random(5).randbytes(blocks * 4 * width * 2))  # fp16: one layer, 4 tokens a block
        dst = bytearray(len(src))
        prefill = kvstash.Store(URL, transports="tcp", listen="127.0.0.2:0")
        out = kvstash.KvExport(kvstash.KvCache(prefill, [src], num_blocks=blocks, block_size=4, num_kv_heads=1,
                                               head_dim=width, mla=True, model="m"))
        self.assertIn("127.0.0.2".encode().hex(), out.descriptor.decode(), "the export names where it listens")
        read = kvstash.KvImport(kvstash.KvCache(self.store, [dst], num_blocks=blocks, block_size=4,
                                                num_kv_heads=1, head_dim=width, mla=True, model="m"))
        with self.assertRaises(kvstash.Error) as refused:
            read.begin_read(out.descriptor, [2, 3], [0, 1], fence=2**62, timeout_ms=5000).wait()
        self.assertEqual(refused.exception.code, "permission_denied", "a read without the exporter's grant")
        read.begin_read(out.descriptor, [2, 3], [0, 1], fence=2**62, timeout_ms=5000,
                        grant=out.grant([2, 3], 2**62)).wait()
        half = len(src) // 2
        self.assertEqual(dst[:half], src[half:])
        with self.assertRaises(kvstash.Error) as e:
            kvstash.Store(URL, listen="nowhere")
        self.assertEqual(e.exception.code, "invalid_argument")


class ClusterToken(unittest.TestCase):
    """The cell "secured" is served over tcp only, by a node that requires TOKEN."""

    def open(self, **kw):
        return kvstash.Store(URL, cell="secured", transports="tcp", timeout_ms=10000, **kw)

    def test_the_data_path_needs_the_token(self):
        plain, wrong = self.open(), self.open(cluster_token="guess-guess-guess-guess")
        for store in (plain, wrong):
            with self.assertRaises(kvstash.Error) as e:
                store.put("py:guarded", b"x")
            self.assertEqual(e.exception.code, "permission_denied")
            self.assertIn("cluster token", e.exception.message)
        store = self.open(cluster_token=TOKEN)
        store.put("py:guarded", b"bytes behind the token", ttl_ms=60000)
        self.assertEqual(store.get("py:guarded"), b"bytes behind the token")
        for other in (plain, wrong):
            with self.assertRaises(kvstash.Error) as e:
                other.get("py:guarded")
            self.assertEqual(e.exception.code, "permission_denied")

    def test_an_empty_token_is_refused_not_taken_as_none(self):
        for empty in ("", " \n"):
            with self.assertRaises(kvstash.Error) as e:
                self.open(cluster_token=empty)
            self.assertEqual(e.exception.code, "invalid_argument")
            self.assertIn("cluster_token", e.exception.message)

    def test_a_short_token_is_refused(self):
        with self.assertRaises(kvstash.Error) as e:
            self.open(cluster_token="guess")
        self.assertEqual(e.exception.code, "invalid_argument")
        self.assertIn("at least 16 bytes", e.exception.message)


if __name__ == "__main__":
    URL = sys.argv.pop(1)
    TOKEN = sys.argv.pop(1)
    unittest.main(verbosity=2)

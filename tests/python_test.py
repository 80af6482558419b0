"""The kvstash Python module against a real cell (started by capi_test): plain objects,
a paged KV cache saved and loaded layer by layer, keys, errors. Usage: python_test.py URL"""
import random
import sys
import unittest

import kvstash

URL = None


class KvstashPython(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.store = kvstash.Store(URL, transports="shm,tcp", timeout=10.0)

    def test_objects_round_trip_and_errors_carry_their_code(self):
        self.store.put("py:k", b"\x00\x01hello", ttl=60)
        self.assertEqual(self.store.get("py:k"), b"\x00\x01hello")
        self.store.remove("py:k")
        with self.assertRaises(kvstash.Error) as e:
            self.store.get("py:k")
        self.assertEqual(e.exception.code, "not_found")
        with self.assertRaises(kvstash.Error) as e:
            kvstash.Store("not a url")
        self.assertEqual(e.exception.code, "invalid_argument")

    def test_kv_cache_layer_by_layer(self):
        layers, blocks, block_size, heads, head_dim = 3, 16, 4, 2, 16
        block_bytes = block_size * heads * head_dim * 2
        rng = random.Random(5)
        a = [bytearray(rng.getrandbits(8) for _ in range(2 * blocks * block_bytes)) for _ in range(layers)]
        b = [bytearray(2 * blocks * block_bytes) for _ in range(layers)]
        common = dict(num_blocks=blocks, block_size=block_size, kv_heads=heads, head_dim=head_dim,
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
        for layer in range(layers):
            save.save_layer(layer)
        self.assertEqual(save.wait(), [("ok", ""), ("ok", "")])
        self.assertEqual(kvb.contains_prefix(tokens), 2)

        load = kvb.begin_load(tokens, blocks_b, 2)
        for layer in range(layers):
            load.wait_layer(layer)
            self.assertTrue(load.layer_ready(layer))
            for i in range(4):
                for part in range(2):
                    src = (part * blocks + blocks_a[i]) * block_bytes
                    dst = (part * blocks + blocks_b[i]) * block_bytes
                    self.assertEqual(a[layer][src:src + block_bytes], b[layer][dst:dst + block_bytes])
        self.assertEqual([code for code, _ in load.wait()], ["ok", "ok"])

        # Through host bounce buffers: the same bytes.
        c = [bytearray(2 * blocks * block_bytes) for _ in range(layers)]
        kvc = kvstash.KvCache(self.store, c, staging="host", **common)
        self.assertEqual(kvc.data_path, "host")
        self.assertEqual(kva.data_path, "direct")
        self.assertEqual([code for code, _ in kvc.begin_load(tokens, blocks_b, 2).wait()], ["ok", "ok"])
        for layer in range(layers):
            self.assertEqual(c[layer], b[layer])
        with self.assertRaises(kvstash.Error):
            kvstash.KvCache(self.store, c, staging="floppy", **common)
        # Host memory marked as GPU memory: no transport registers it, and direct-only says so.
        with self.assertRaises(kvstash.Error) as e:
            kvstash.KvCache(self.store, c, gpu=True, staging="none", **common)
        self.assertIn("registering the KV cache", str(e.exception))

        # A chunk gone meanwhile fails alone.
        self.store.remove(kva.keys(tokens)[1])
        load = kvb.begin_load(tokens, blocks_b, 2)
        self.assertEqual([code for code, _ in load.wait()], ["ok", "not_found"])
        with self.assertRaises(kvstash.Error) as e:
            kvb.begin_load(tokens, blocks_b, 3)  # there is no third full chunk
        self.assertEqual(e.exception.code, "invalid_argument")

    def test_bad_layouts_are_refused(self):
        with self.assertRaises(kvstash.Error) as e:
            kvstash.KvCache(self.store, [bytearray(10)], num_blocks=4, block_size=4, kv_heads=1, head_dim=8,
                            model="m")
        self.assertEqual(e.exception.code, "invalid_argument")  # the buffer is too small
        with self.assertRaises(kvstash.Error):
            kvstash.KvCache(self.store, [bytearray(1 << 12)], num_blocks=4, block_size=4, kv_heads=1,
                            head_dim=8, dtype="fp12", model="m")


if __name__ == "__main__":
    URL = sys.argv.pop(1)
    unittest.main(verbosity=2)

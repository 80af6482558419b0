"""kvstash.lmcache inside LMCache's own multiprocess-server machinery (scripts/engines-setup
installs LMCache into a venv).

Each LMCache instance here is the StorageManager that ``lmcache server`` builds, from the
server's own arguments (``--l2-adapter`` naming the plugin, exactly as an operator writes it):
its L1 in host memory, its store controller writing chunks through to the adapter, its prefetch
controller looking them up and loading them back. Chunks stored through one instance land in the
cell (Store.contains_each finds them under keys that map every field of LMCache's ObjectKey),
leave its L1 (the skip_l1 store policy), and come back bit for bit into it and into a fresh
instance; the same retrieval without the adapter misses; a chunk of another model, rank, group,
salt or layout misses; a memory node killed with kill -9 makes misses, not exceptions.

Usage (meson test `lmcache`): [VENV/bin/]python tests/engines/lmcache_test.py BUILD_DIR
Exit 77 (skipped) when LMCache cannot be imported.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import engine_fixture

BUILD = engine_fixture.build_dir()

try:
    import torch
    from lmcache.v1.distributed.storage_manager import StorageManager
except ImportError as e:
    engine_fixture.run_in_venv_or_skip("lmcache", "LMCache", e, __file__)

import kvstash  # noqa: E402
from lmcache.v1.distributed.api import (GroupedObjectKeys, MemoryLayoutDesc, ObjectKey,  # noqa: E402
                                        PrefetchTaskSpec)
from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config  # noqa: E402

from kvstash.lmcache import KvstashL2Adapter  # noqa: E402

LAYOUT = MemoryLayoutDesc(shapes=[torch.Size([2, 4, 16, 64])], dtypes=[torch.bfloat16])  # K/V, layers, tokens, h*d
CHUNKS = 6
URL = None


def setUpModule():
    global URL, _cell
    _cell = engine_fixture.Cell(BUILD)
    URL = _cell.url


def tearDownModule():
    _cell.stop()


def plugin(url, **params):
    """The --l2-adapter JSON an operator gives `lmcache server` for kvstash."""
    return json.dumps({"type": "plugin", "module_path": "kvstash.lmcache", "class_name": "KvstashL2Adapter",
                       "adapter_params": {"redis_url": url, "transports": "shm,tcp", "timeout_ms": 3000, **params}})


def instance(*l2_adapters):
    """An LMCache instance as `lmcache server` builds it from its arguments: 64 MiB of L1 in
    host memory, chunks leaving L1 once an L2 adapter holds them (skip_l1)."""
    parser = argparse.ArgumentParser()
    add_storage_manager_args(parser)
    argv = ["--l1-size-gb", "0.0625", "--no-l1-use-lazy", "--eviction-policy", "LRU", "--l2-store-policy", "skip_l1"]
    for spec in l2_adapters:
        argv += ["--l2-adapter", spec]
    return StorageManager(parse_args_to_config(parser.parse_args(argv)))


def keys_of(seed, model="tiny-llama", kv_rank=0, group=0, salt=""):
    return [ObjectKey(chunk_hash=bytes([seed, i]) * 8, model_name=model, kv_rank=kv_rank, object_group_id=group,
                      cache_salt=salt) for i in range(CHUNKS)]


def adapter(sm):
    (_, a), = sm.l2_adapters()
    return a


def store(sm, keys, seed):
    """Chunks written into L1 as an engine's store does, and their bytes."""
    gen = torch.Generator().manual_seed(seed)
    objs = sm.reserve_write(keys, LAYOUT)
    assert len(objs) == len(keys), f"L1 reserved {len(objs)} of {len(keys)}"
    want = []
    for k in keys:
        data = torch.randn(LAYOUT.shapes[0], generator=gen).to(LAYOUT.dtypes[0])
        objs[k].tensor.copy_(data)
        want.append(data)
    sm.finish_write(keys)
    return want


def retrieve(sm, keys, layout=LAYOUT):
    """An engine's retrieval: a prefetch of the chunks into L1 (from L2 where L1 misses), then
    their bytes read from L1. (l1 hits, l2 hits, the bytes of the hits)."""
    handle = sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[
        GroupedObjectKeys(keys=keys, object_group_id=keys[0].object_group_id, layout_desc=layout)]))
    assert sm.wait_prefetch_status(handle, 30), "the prefetch did not finish in 30 s"
    result = sm.query_prefetch_status(handle)
    hits = result.hit_cells[0].popcount()
    got = []
    if hits:
        hit_keys = keys[:hits]  # the prefix policy: the leading chunks
        with sm.read_prefetched_results(hit_keys, result.l1_owners) as objs:
            assert objs is not None, "a prefetched chunk is not in L1"
            got = [o.tensor.clone() for o in objs]
        sm.finish_read_prefetched(hit_keys, l1_owners=result.l1_owners)
    return result.l1_hit_count, result.l2_hit_count, got


def wait_in_cell(store_, cell_keys, seconds=20):
    """Whether each key is in the cell, once all are or `seconds` passed (LMCache writes
    through to L2 in the background)."""
    deadline = time.monotonic() + seconds
    while True:
        present = store_.contains_each(cell_keys, timeout_ms=2000)
        if all(present) or time.monotonic() > deadline:
            return present
        time.sleep(0.05)


class LMCacheTest(unittest.TestCase):
    def setUp(self):
        self.store = kvstash.Store(URL, transports="shm,tcp")

    def test_lmcaches_server_arguments_load_it_as_a_plugin_with_l1_registered(self):
        sm = instance(plugin(URL, threads=4))
        try:
            a = adapter(sm)
            self.assertIsInstance(a, KvstashL2Adapter)
            self.assertEqual((a.config.threads, a.config.timeout_ms, a.config.redis_url), (4, 3000, URL))
            # L1's arena is registered with the store once: chunks move in place.
            self.assertEqual(a.report_status()["arena_bytes"], sm.l1_memory_desc.size)
        finally:
            sm.close()
        with self.assertRaisesRegex(ValueError, "unknown LMCache adapter_params keys"):
            instance(plugin(URL, redis_uri=URL)).close()

    def test_lmcaches_server_process_starts_with_it_and_refuses_a_bad_config(self):
        """`python -m lmcache.v1.multiprocess.server` (what `lmcache server` runs, less its HTTP
        front) builds the adapter from its --l2-adapter at start: it serves with the cell's
        config, and exits naming the key of a config it cannot take."""
        env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "src", "python"))

        def server(spec):
            log = tempfile.TemporaryFile(mode="w+")
            p = subprocess.Popen([sys.executable, "-m", "lmcache.v1.multiprocess.server", "--port", "0",
                                  "--l1-size-gb", "0.0625", "--no-l1-use-lazy", "--eviction-policy", "LRU",
                                  "--l2-adapter", spec], env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and p.poll() is None:
                log.seek(0)
                if "cache server is running..." in log.read():
                    break
                time.sleep(0.2)
            running = p.poll() is None
            p.send_signal(signal.SIGINT)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.seek(0)
            return running, log.read()

        running, log = server(plugin(URL))
        self.assertTrue(running, log[-3000:])
        running, log = server(plugin(URL, redis_uri=URL))
        self.assertFalse(running, log[-3000:])
        self.assertIn("unknown LMCache adapter_params keys ['redis_uri']", log)

    def test_chunks_go_through_the_cell_back_into_l1_and_a_fresh_lmcache_bit_exact(self):
        keys = keys_of(1)
        writer = instance(plugin(URL))
        try:
            want = store(writer, keys, seed=1)
            cell_keys = [adapter(writer).cell_key(k) for k in keys]
            self.assertEqual(wait_in_cell(self.store, cell_keys), [True] * CHUNKS)
            self.assertTrue(cell_keys[0].startswith("lmc:@tiny-llama@00000000@0@0100"), cell_keys[0])
            # The object is the chunk's bytes after a 32-byte header naming their layout.
            self.assertEqual(len(self.store.get(cell_keys[0])), 32 + 2 * 4 * 16 * 64 * 2)
            # The store controller took them out of L1 once the cell held them (skip_l1):
            # the retrieval loads every chunk from the cell.
            l1, l2, got = retrieve(writer, keys)
            self.assertEqual((l1, l2), (0, CHUNKS))
            for w, g in zip(want, got):
                self.assertTrue(torch.equal(w.view(torch.uint8), g.view(torch.uint8)))
        finally:
            writer.close()
        reader = instance(plugin(URL))
        try:
            l1, l2, got = retrieve(reader, keys)
            self.assertEqual((l1, l2), (0, CHUNKS), "a fresh LMCache did not load the chunks from the cell")
            for w, g in zip(want, got):
                self.assertTrue(torch.equal(w.view(torch.uint8), g.view(torch.uint8)))
            status = adapter(reader).report_status()
            self.assertEqual((status["loaded"], status["load_failed"], status["is_healthy"]), (CHUNKS, 0, True))
        finally:
            reader.close()

    def test_without_kvstash_in_the_path_the_same_retrieval_misses(self):
        """The negative control: the chunks are in the cell, but an LMCache without the adapter
        cannot reach them."""
        keys = keys_of(2)
        writer = instance(plugin(URL))
        try:
            store(writer, keys, seed=2)
            self.assertEqual(wait_in_cell(self.store, [adapter(writer).cell_key(k) for k in keys]), [True] * CHUNKS)
        finally:
            writer.close()
        bare = instance()
        try:
            self.assertEqual(retrieve(bare, keys), (0, 0, []))
        finally:
            bare.close()

    def test_every_field_of_lmcaches_key_and_the_layout_tell_chunks_apart(self):
        keys = keys_of(3)
        writer = instance(plugin(URL))
        try:
            store(writer, keys, seed=3)
            self.assertEqual(wait_in_cell(self.store, [adapter(writer).cell_key(k) for k in keys]), [True] * CHUNKS)
        finally:
            writer.close()
        reader = instance(plugin(URL))
        try:
            for other in (keys_of(3, model="other-model"), keys_of(3, kv_rank=1), keys_of(3, group=1),
                          keys_of(3, salt="user-b")):
                self.assertEqual(retrieve(reader, other), (0, 0, []), other[0])
            # Bytes of the same size in another dtype: found, but the load refuses them.
            fp16 = MemoryLayoutDesc(shapes=LAYOUT.shapes, dtypes=[torch.float16])
            self.assertEqual(retrieve(reader, keys, fp16), (0, 0, []))
            self.assertEqual(adapter(reader).report_status()["load_failed"], CHUNKS)
        finally:
            reader.close()
        # Another model_id (other weights under the same served name) shares nothing.
        other_weights = instance(plugin(URL, model_id="sha256:other"))
        try:
            self.assertEqual(retrieve(other_weights, keys), (0, 0, []))
        finally:
            other_weights.close()
        reader = instance(plugin(URL))
        try:
            self.assertEqual(retrieve(reader, keys)[:2], (0, CHUNKS))
        finally:
            reader.close()

    def test_a_memory_node_killed_with_kill_9_means_misses_not_exceptions(self):
        """kill -9 of the cell's only node after the chunks were stored (its heartbeat has not
        lapsed, so Redis still lists them): every load fails within the task's deadline, the
        chunks are misses, a store fails as a task; LMCache never sees an exception."""
        cell = engine_fixture.Cell(BUILD)
        try:
            keys = keys_of(4)
            writer = instance(plugin(cell.url, timeout_ms=2000))
            try:
                store(writer, keys, seed=4)
                probe = kvstash.Store(cell.url, transports="shm,tcp")
                self.assertEqual(wait_in_cell(probe, [adapter(writer).cell_key(k) for k in keys]), [True] * CHUNKS)
            finally:
                writer.close()
            with open(os.path.join(cell.dir, "node-1.pid")) as f:
                os.kill(int(f.read().split()[0]), signal.SIGKILL)
            # Over shm a get that starts within the moment the client learns of the death still
            # reads the dead node's (right) bytes; past it every get fails.
            time.sleep(0.5)
            reader = instance(plugin(cell.url, timeout_ms=2000))
            try:
                t0 = time.monotonic()
                self.assertEqual(retrieve(reader, keys), (0, 0, []))
                self.assertLess(time.monotonic() - t0, 15, "the misses took longer than the deadline allows")
                store(reader, keys_of(5), seed=5)  # the write-through fails as a task
                a = adapter(reader)
                deadline = time.monotonic() + 15
                while a.report_status()["store_failed"] < CHUNKS and time.monotonic() < deadline:
                    time.sleep(0.05)
                status = a.report_status()
                self.assertEqual((status["loaded"], status["stored"], status["store_failed"]), (0, 0, CHUNKS), status)
                self.assertFalse(status["is_healthy"], status)
                # LMCache goes on: the chunks it could not write through are still in its L1.
                self.assertEqual(retrieve(reader, keys_of(5))[:2], (CHUNKS, 0))
            finally:
                reader.close()
        finally:
            cell.stop()


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]], verbosity=2)

"""kvstash.vllm_tier behind vLLM 0.34's own CPU offloading tier (scripts/engines-setup installs
vLLM into a venv).

vLLM's worker half of the OffloadingConnector copies blocks between the GPU and the CPU tier with
CUDA kernels, which these machines cannot run, so the test drives the scheduler half at vLLM's
own TieringOffloadingManager: vLLM's OffloadingSpecFactory builds it from a
kv_connector_extra_config naming "TieringOffloadingSpec", with its CPU tier on host memory (a
/dev/shm region, as in an engine) and the kvstash tier loaded by module path through vLLM's
SecondaryTierFactory, exactly as a user configures it. The GPU-to-CPU copy is the test writing
each chunk's bytes (a pattern derived from its key) into the CPU tier's slot between
prepare_store and complete_store, as the worker would; every other call is the manager's, in the
order the connector's scheduler makes them (lookups each step until HIT or MISS, on_schedule_end
ending each step, prepare_load of the hits). Chunk keys are vLLM's block hashes (SHA-256 chain).

Covered: chunks the CPU tier evicted come back from the cell bit-exact; a fresh engine (its own
CPU tier and store) loads what another one stored, a third one's cascade of the same chunks puts
nothing the cell holds, and an engine of other weights finds none of them; vLLM's tiering
metrics count the tier's bytes; a chunk removed from the cell or whose checksum is wrong after its lookup fails alone
(the others load, the corrupt one leaves the cell); the memory node killed (SIGKILL) after the
lookup found the chunks turns every load and every later store into a failed job, never an
exception. The negative control runs the first two scenarios with vLLM's example tier in place
of kvstash (it records presence and moves no byte): the promoted bytes are wrong, and a fresh
engine finds nothing, so the assertions of those scenarios hold only through kvstash.

Usage (meson test `vllm_tier`): VENV/bin/python tests/engines/vllm_tier_test.py BUILD_DIR
Exit 77 (skipped) when vLLM cannot be imported.
"""

import hashlib
import itertools
import os
import signal
import subprocess
import sys
import time
import unittest

import engine_fixture

BUILD = engine_fixture.build_dir()

try:
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
except ImportError as e:
    engine_fixture.run_in_venv_or_skip("vllm", "vLLM", e, __file__)

import kvstash  # noqa: E402
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics  # noqa: E402

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older layouts of vllm.utils
    from vllm.utils import sha256

BLOCK = 16  # tokens per block; a chunk is one block
CHUNK_BYTES = 8192  # a worker's KV bytes per block (page-aligned: the CPU tier's row is exactly this)
PRIMARY_CHUNKS = 8  # the CPU tier's slots
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY

URL = None  # the private cell's Redis, set up in setUpModule
_engine_ids = itertools.count()


def setUpModule():
    global URL, _cell
    _cell = engine_fixture.Cell(BUILD)
    URL = _cell.url
    init_none_hash(sha256)


def tearDownModule():
    _cell.stop()


def kvstash_tier(url, **more):
    return {"type": "KvstashTier", "module_path": "kvstash.vllm_tier", "redis_url": url, "timeout_ms": 5000,
            "weights_id": "test:random-weights", "io_threads": 4, **more}


EXAMPLE_TIER = {"type": "example"}  # vLLM's in-memory tier: presence only, no byte moved


def chain(prompt, blocks):
    """vLLM's offload keys of the first `blocks` blocks of a prompt (its block hashes, group 0)."""
    keys, parent = [], None
    for i in range(blocks):
        tokens = [(prompt * 7919 + i * BLOCK + t) % 32000 for t in range(BLOCK)]
        parent = hash_block_tokens(sha256, parent, tokens)
        keys.append(make_offload_key(parent, 0))
    return keys


def pattern(key):
    """The bytes the test's "GPU" writes for chunk `key`: derived from the key, so that any
    other chunk's bytes, or stale ones, differ."""
    return hashlib.shake_256(bytes(key)).digest(CHUNK_BYTES)


class Engine:
    """One engine's scheduler side: vLLM's TieringOffloadingManager with a fresh CPU tier."""

    def __init__(self, tier):
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": PRIMARY_CHUNKS * CHUNK_BYTES,
                 "secondary_tiers": [dict(tier)]}
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=("model.layers.0.self_attn.attn",),
                                          group_id=0),),
            worker_kv_bytes_per_block=CHUNK_BYTES, enable_kv_cache_events=False, extra_config=extra,
            engine_id=f"kvstash-tier-test-{os.getpid()}-{next(_engine_ids)}",
            model=OffloadingModelConfig(name="kvstash-tier-test-model", dtype="float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                              data_parallel_index=0, data_parallel_size=1,
                                              data_parallel_rank_local=None, is_parallelism_agnostic=False))
        self.spec = OffloadingSpecFactory.create_spec(config)
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.counters = {}  # (metric, labels) -> value, summed over get_stats()
        self.looked_up = []  # every lookup answer, in order

    def close(self):
        self.manager.shutdown()

    def _rows(self):
        return np.asarray(self.manager.primary_tier.get_kv_memoryview())

    def step(self):
        """The end of a scheduler step (the connector's build_connector_meta)."""
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            stats = self.manager.get_stats()
        if stats is not None:
            for name, values in stats.data["data"].items():
                for labels, v in values.items():
                    if isinstance(v, (int, float)):
                        self.counters[name, tuple(labels)] = self.counters.get((name, tuple(labels)), 0) + v

    def request(self, name):
        ctx = ReqContext(req_id=name)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx):
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
        self.settle()

    def store(self, ctx, keys):
        """A request's chunks offloaded: prepare_store, the worker's copy into the CPU tier,
        complete_store (which cascades them to the secondary tier), then steps until every
        cascade finished."""
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
        assert out is not None, "the CPU tier had no room"
        rows = self._rows()
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            rows[chunk] = np.frombuffer(pattern(key), dtype=np.int8)
        del rows
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, ctx, True)
        self.settle()

    def settle(self, seconds=60):
        deadline = time.monotonic() + seconds
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            assert time.monotonic() < deadline, "the manager's jobs did not finish"
            time.sleep(0.005)

    def lookup(self, ctx, keys, until=(HIT, MISS), seconds=60):
        """The scheduler's lookups of `keys`, a step apart, until every answer is in `until`
        (vLLM retries a request whose lookup said RETRY or HIT_PENDING the next step)."""
        deadline = time.monotonic() + seconds
        while True:
            with self.manager.lock:
                answers = [self.manager.lookup(k, ctx) for k in keys]
            self.looked_up += answers
            if all(a in until for a in answers):
                return answers
            assert time.monotonic() < deadline, f"lookups still {answers}"
            self.step()
            time.sleep(0.005)

    def load(self, ctx, keys):
        """The hits' bytes as the worker would copy them to the GPU (prepare_load's slots)."""
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
        rows = self._rows()
        out = [rows[c].tobytes() for c in spec.chunk_ids]
        del rows
        with self.manager.lock:
            self.manager.complete_load(keys, ctx)
        return out

    def counter(self, metric, *labels):
        return self.counters.get((metric, labels), 0)


def evicted_and_promoted(tier):
    """One engine offloads prompt A's chunks, then prompt B's, which evict A's from its full CPU
    tier; a third request looks A's chunks up. Returns (engine, A's keys, the answers, the
    bytes promoted into the CPU tier)."""
    engine = Engine(tier)
    a, b = chain(1, PRIMARY_CHUNKS), chain(2, PRIMARY_CHUNKS)
    for name, keys in (("a", a), ("b", b)):
        ctx = engine.request(name)
        engine.store(ctx, keys)
        engine.finish(ctx)
    with engine.manager.lock:
        resident = [engine.manager.primary_tier.lookup(k, ReqContext(req_id="peek")) for k in a]
    assert resident == [MISS] * len(a), f"A's chunks were not evicted from the CPU tier: {resident}"
    ctx = engine.request("c")
    answers = engine.lookup(ctx, a)
    loaded = engine.load(ctx, [k for k, x in zip(a, answers) if x is HIT])
    engine.finish(ctx)
    return engine, a, answers, loaded


def offload_and_close(tier, keys):
    """An engine offloads `keys` (one request's chunks) through `tier` and shuts down."""
    first = Engine(tier)
    ctx = first.request("p")
    first.store(ctx, keys)
    first.finish(ctx)
    first.close()


def stored_then_fresh_engine(tier):
    """An engine offloads prompt 3's chunks and shuts down; a fresh engine (its own CPU tier,
    its own tier instance) looks up the prompt with 3 more blocks. Returns (the fresh engine,
    the stored keys, the answers for all, the bytes loaded for the hits)."""
    keys = chain(3, 6)
    offload_and_close(tier, keys)
    engine = Engine(tier)
    ctx = engine.request("q")
    longer = chain(3, 9)
    answers = engine.lookup(ctx, longer)
    loaded = engine.load(ctx, [k for k, x in zip(longer, answers) if x is HIT])
    engine.finish(ctx)
    return engine, keys, answers, loaded


def record_field(url, key, field):
    """A field of the cell's record of object `key` ("" when it has none)."""
    return subprocess.run(["redis-cli", "-u", url, "HGET", engine_fixture.CELL_PREFIX + ":obj:" + key, field],
                          capture_output=True, text=True, check=True).stdout.strip()


def corrupt_checksum(url, key):
    """Makes the cell's record of object `key` name another checksum: its next get is corrupt."""
    obj = engine_fixture.CELL_PREFIX + ":obj:" + key
    cli = ["redis-cli", "-u", url]
    old = subprocess.run(cli + ["HGET", obj, "checksum"], capture_output=True, text=True, check=True).stdout.strip()
    assert "/" in old, f"no record of {key}: {old!r}"
    digits, _, segment = old.partition("/")
    subprocess.run(cli + ["HSET", obj, "checksum", format(int(digits, 16) ^ 1, "016x") + "/" + segment],
                   capture_output=True, check=True)


class TierTest(unittest.TestCase):
    def test_chunks_evicted_from_the_cpu_tier_come_back_from_the_cell_bit_exact(self):
        engine, keys, answers, loaded = evicted_and_promoted(kvstash_tier(URL))
        try:
            self.assertEqual(answers, [HIT] * len(keys))
            self.assertEqual(loaded, [pattern(k) for k in keys], "the promoted bytes are not the stored ones")
            self.assertIn(RETRY, engine.looked_up, "the tier's lookups did not go to the cell asynchronously")
            # Every chunk is in the cell under the tier's key (a store of the test's own).
            store = kvstash.Store(URL)
            both = keys + chain(2, PRIMARY_CHUNKS)
            self.assertEqual(store.contains_each([engine.tier.key(k) for k in both]), [True] * len(both))
            # vLLM's tiering metrics, for this tier: 16 chunks written, 8 read, with their times.
            label = "1:KvstashTier"
            self.assertEqual(engine.counter(TieringOffloadingMetrics.WRITE_BYTES, label), 16 * CHUNK_BYTES)
            self.assertEqual(engine.counter(TieringOffloadingMetrics.READ_BYTES, label), 8 * CHUNK_BYTES)
            self.assertGreater(engine.counter(TieringOffloadingMetrics.WRITE_TIME, label), 0)
            self.assertGreater(engine.counter(TieringOffloadingMetrics.READ_TIME, label), 0)
            self.assertEqual(engine.counter(TieringOffloadingMetrics.PROMOTION_JOB_FAILURES, label), 0)
        finally:
            engine.close()

    def test_a_fresh_engine_loads_what_another_stored(self):
        engine, keys, answers, loaded = stored_then_fresh_engine(kvstash_tier(URL))
        try:
            self.assertEqual(answers, [HIT] * 6 + [MISS] * 3)
            self.assertEqual(loaded, [pattern(k) for k in keys])
            names = [engine.tier.key(k) for k in keys]
        finally:
            engine.close()
        # A third engine offloads the same chunks: they cascade, and the cell, which holds them,
        # is not written again (each record keeps the token of the put that wrote it).
        before = [record_field(URL, n, "token") for n in names]
        third = Engine(kvstash_tier(URL))
        try:
            ctx = third.request("again")
            third.store(ctx, keys)
            third.finish(ctx)
            self.assertEqual(third.counter(TieringOffloadingMetrics.CASCADE_JOB_FAILURES, "1:KvstashTier"), 0)
        finally:
            third.close()
        self.assertEqual([record_field(URL, n, "token") for n in names], before, "chunks the cell held were put again")
        # An engine of other weights (weights_id) shares nothing with these.
        other = Engine(kvstash_tier(URL, weights_id="test:other-weights"))
        try:
            ctx = other.request("other")
            self.assertEqual(other.lookup(ctx, keys), [MISS] * 6)
            other.finish(ctx)
        finally:
            other.close()

    def test_without_kvstash_the_same_scenarios_fail(self):
        """The negative control: vLLM's example tier in kvstash's place. It says HIT for what it
        was given and moves no byte, so the promoted chunks hold another prompt's bytes; a fresh
        engine's example tier holds nothing."""
        engine, keys, answers, loaded = evicted_and_promoted(EXAMPLE_TIER)
        engine.close()
        self.assertEqual(answers, [HIT] * len(keys))
        self.assertTrue(all(got != pattern(k) for got, k in zip(loaded, keys)),
                        "the example tier's promotions hold the right bytes: the kvstash test proves nothing")
        engine, keys, answers, loaded = stored_then_fresh_engine(EXAMPLE_TIER)
        engine.close()
        self.assertEqual(answers, [MISS] * 9)

    def test_a_chunk_removed_or_corrupt_after_its_lookup_fails_alone(self):
        keys = chain(4, 6)
        offload_and_close(kvstash_tier(URL), keys)
        engine = Engine(kvstash_tier(URL))
        try:
            ctx = engine.request("q")
            found = engine.lookup(ctx, keys, until=(HIT, MISS, LookupResult.HIT_PENDING))
            self.assertEqual(found, [LookupResult.HIT_PENDING] * 6, "the promotions were not started")
            # Between the lookup and the load: chunk 2 evicted (removed), chunk 4's bytes bad.
            store = kvstash.Store(URL)
            store.remove(engine.tier.key(keys[2]))
            corrupt_checksum(URL, engine.tier.key(keys[4]))
            answers = engine.lookup(ctx, keys)
            self.assertEqual(answers, [HIT, HIT, MISS, HIT, MISS, HIT])
            hits = [k for k, a in zip(keys, answers) if a is HIT]
            self.assertEqual(engine.load(ctx, hits), [pattern(k) for k in hits])
            engine.finish(ctx)
            self.assertEqual(store.contains_each([engine.tier.key(keys[4])]), [False], "the corrupt chunk stayed")
            label = "1:KvstashTier"
            self.assertEqual(engine.counter(TieringOffloadingMetrics.PROMOTION_JOB_FAILURES, label), 1)
            self.assertEqual(engine.counter(TieringOffloadingMetrics.READ_BYTES, label), 4 * CHUNK_BYTES)
            self.assertEqual(engine.counter("vllm:kv_offload_kvstash_chunk_failures", "get", "not_found"), 1)
            self.assertEqual(engine.counter("vllm:kv_offload_kvstash_chunk_failures", "get", "corrupt"), 1)
            # Another request misses both (the corrupt one is gone from the cell).
            again = engine.request("r")
            self.assertEqual(engine.lookup(again, keys), [HIT, HIT, MISS, HIT, MISS, HIT])
            engine.finish(again)
        finally:
            engine.close()

    def test_the_memory_node_killed_before_the_load_means_misses_not_exceptions(self):
        """kill -9 of the cell's only node after the lookup found the chunks (its heartbeat has not
        lapsed, so Redis still lists them): every load fails, the chunks are misses, and a later
        store's cascade fails as a job; the manager never sees an exception."""
        cell = engine_fixture.Cell(BUILD)
        try:
            tier = kvstash_tier(cell.url, timeout_ms=2000)
            keys = chain(5, 4)
            offload_and_close(tier, keys)
            engine = Engine(tier)
            try:
                ctx = engine.request("q")
                found = engine.lookup(ctx, keys, until=(HIT, MISS, LookupResult.HIT_PENDING))
                self.assertEqual(found, [LookupResult.HIT_PENDING] * 4)
                with open(os.path.join(cell.dir, "node-1.pid")) as f:
                    os.kill(int(f.read().split()[0]), signal.SIGKILL)
                self.assertEqual(engine.lookup(ctx, keys), [MISS] * 4)
                engine.store(ctx, chain(6, 2))  # the cascade fails: no node to put to
                engine.finish(ctx)
                label = "1:KvstashTier"
                self.assertEqual(engine.counter(TieringOffloadingMetrics.PROMOTION_JOB_FAILURES, label), 1)
                self.assertEqual(engine.counter(TieringOffloadingMetrics.CASCADE_JOB_FAILURES, label), 1)
                self.assertEqual(engine.counter(TieringOffloadingMetrics.READ_BYTES, label), 0)
                self.assertEqual(engine.counter(TieringOffloadingMetrics.WRITE_BYTES, label), 0)
            finally:
                engine.close()
        finally:
            cell.stop()


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]], verbosity=2)

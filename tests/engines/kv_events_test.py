"""KV events for routers (docs/events.md), read by a subscriber made of vLLM's own event classes.

The connector runs in vLLM's own Scheduler with the workers' hooks driven as in vllm_test.py
(no model); `kvstash events serve` follows the cell and publishes on a ZMQ PUB socket; this
test subscribes as a router's indexer would, decoding every batch with vLLM's KVEventBatch
(vllm.distributed.kv_events) and checking each sequence number follows the last.

Covered: saved chunks arrive as BlockStored naming vLLM's own block hashes (as vLLM's publisher
converts them), their parents, tokens and block size; a chunk removed, evicted or whose TTL
ended arrives as BlockRemoved; a relay that starts over says AllBlocksCleared and then every
chunk still stored; a Redis that lost its data (the events epoch gone) and events trimmed before
the relay read them both lead to AllBlocksCleared and a restatement; the replay socket answers
vLLM's replay request.

Usage (meson test `events`): VENV/bin/python tests/engines/kv_events_test.py BUILD_DIR
Exit 77 (skipped) when vLLM cannot be imported.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import unittest

import engine_fixture

BUILD = engine_fixture.build_dir()

try:
    import vllm  # noqa: F401
except ImportError as e:
    engine_fixture.run_in_venv_or_skip("vllm", "vLLM", e, __file__)

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

import kvstash  # noqa: E402
import vllm_test  # noqa: E402  (its Engine: vLLM's Scheduler and the workers' hooks)

KVSTASH = os.path.join(BUILD, "tools", "kvstash", "kvstash")
BLOCK = vllm_test.BLOCK


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setUpModule():
    vllm_test.setUpModule()


def tearDownModule():
    vllm_test.tearDownModule()


def cli(*args):
    out = subprocess.run([KVSTASH, "--redis", vllm_test.URL, *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise AssertionError(f"kvstash {' '.join(args)}: {out.returncode}: {out.stderr}")
    return out.stdout


class Relay:
    """`kvstash events serve` on free loopback ports, and a subscriber on its PUB socket."""

    def __init__(self, extra=("--token-ids",)):
        self.pub = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.pub)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.last_seq = None
        self.proc = None
        self.extra = tuple(extra)
        self.start()

    def start(self, extra=None):
        extra = self.extra if extra is None else extra
        if getattr(self, "log", None) is not None:
            self.log.close()
        self.log = open(os.path.join(engine_fixture.tempfile.mkdtemp(prefix="kvstash-events-"), "relay.log"), "w+")
        self.proc = subprocess.Popen([KVSTASH, "--redis", vllm_test.URL, "events", "serve", "--pub", self.pub,
                                      "--replay", self.replay, *extra], stdout=self.log, stderr=subprocess.STDOUT)
        self.last_seq = None
        # The subscription reaches the new socket once it binds; the batches published before
        # that (the first AllBlocksCleared) are what replay is for.
        deadline = time.monotonic() + 20
        while "publishing" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the relay did not start:\n{self.output()}")
            time.sleep(0.05)
        time.sleep(0.5)

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=10)
        return self.output()

    def close(self):
        if self.proc.poll() is None:
            self.stop()
        self.sub.close(0)
        self.ctx.term()
        self.log.close()

    def replayed(self, start=0):
        """vLLM's replay request from sequence `start`: the batches, until the end marker."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        try:
            while True:
                if not dealer.poll(5000):
                    raise AssertionError("the replay did not end")
                _, _topic, seq, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq, "big", signed=True)
                if seq == -1:
                    return out
                out.append((seq, self.decoder.decode(payload)))
        finally:
            dealer.close(0)

    def events(self, until, seconds=20):
        """Events as they come, until `until(events so far)` holds."""
        got = []
        deadline = time.monotonic() + seconds
        while not until(got):
            left = deadline - time.monotonic()
            if left <= 0 or not self.sub.poll(int(left * 1000)):
                raise AssertionError(f"events so far: {got}\nrelay:\n{self.output()}")
            topic, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if self.last_seq is not None:
                assert seq == self.last_seq + 1, f"batch {seq} after {self.last_seq}"
            self.last_seq = seq
            batch = self.decoder.decode(payload)
            self.assert_batch(batch)
            got.extend(batch.events)
        return got

    @staticmethod
    def assert_batch(batch):
        assert isinstance(batch, KVEventBatch) and batch.ts > 1e9, batch
        for e in batch.events:
            assert isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)), e


def stored(events):
    return [e for e in events if isinstance(e, BlockStored)]


def removed(events):
    return [e for e in events if isinstance(e, BlockRemoved)]


class KvEvents(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cli("events", "on", "--maxlen", "100000")

    def setUp(self):
        self.relay = Relay()
        self.engine = vllm_test.Engine()

    def tearDown(self):
        self.relay.close()

    def saved_prompt(self, rid, chunks, seed):
        """A prompt of `chunks` full chunks (and a few tokens more) run through the engine:
        its tokens, its chunk keys and each chunk's event as vLLM would publish its blocks."""
        tokens = [(seed * 97 + i * 13) % 900 + 1 for i in range(chunks * BLOCK + 3)]
        self.engine.run(rid, tokens)
        hashes = [maybe_convert_block_hash(h) for h in self.engine.request(rid, tokens).block_hashes]
        keys = self.engine.workers[0][0].geometry.keys(tokens)
        want = {}
        for c in range(chunks):
            want[keys[c]] = (hashes[c], hashes[c - 1] if c else None, tokens[c * BLOCK:(c + 1) * BLOCK])
        return tokens, keys[:chunks], want

    def assert_stored(self, events, want):
        by_hash = {e.block_hashes[0]: e for e in stored(events)}
        for key, (h, parent, tokens) in want.items():
            self.assertIn(h, by_hash, f"no BlockStored for {key}")
            e = by_hash[h]
            self.assertEqual(e.block_hashes, [h])
            self.assertEqual(e.parent_block_hash, parent)
            self.assertEqual(list(e.token_ids), tokens)
            self.assertEqual(e.block_size, BLOCK)
            self.assertEqual(e.medium, "CPU")
            self.assertIsNone(e.lora_id)
            self.assertIsNone(e.lora_name)
            self.assertEqual(e.group_idx, 0)

    def test_saved_chunks_arrive_as_vllms_block_stored_and_leave_as_block_removed(self):
        # The relay's start: all cleared, then what the cell had (seen through replay: it went
        # out before this subscriber's subscription arrived).
        first = self.relay.replayed(0)
        self.assertIsInstance(first[0][1].events[0], AllBlocksCleared)

        _, keys, want = self.saved_prompt("a", 4, seed=1)
        events = self.relay.events(stored_all(want))
        self.assert_stored(events, want)
        worker = self.engine.workers[0][0]
        deadline = time.monotonic() + 5  # counted by the announcing thread once its script returned
        while worker._announced < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.get_kv_connector_stats()
        self.assertGreaterEqual(worker.totals()["chunks_announced"], 4)

        # Removed by a client.
        kvstash.Store(vllm_test.URL, transports="shm,tcp").remove(keys[3])
        self.relay.events(removed_one(want[keys[3]][0]))

        # Its TTL ended (seen by the next lookup of it).
        cli("touch", keys[2], "--ttl", "100ms")
        time.sleep(0.3)
        self.assertEqual(subprocess.run([KVSTASH, "--redis", vllm_test.URL, "show", keys[2]],
                                        capture_output=True).returncode, 3)
        self.relay.events(removed_one(want[keys[2]][0]))

        # Evicted: the least recently used goes first.
        chosen = json.loads(cli("--json", "evict", "--bytes", "1", "--limit", "1", "--yes"))
        evicted = chosen["objects"][0]["key"]
        if evicted in want:  # else an object of another test, announced or not
            self.relay.events(removed_one(want[evicted][0]))
        else:
            cli("evict", "--older-than", "1ms", "--limit", "100000", "--yes")  # all of them, ours among them
            self.relay.events(removed_one(want[keys[0]][0]))

        # The replay holds every batch this relay published, in order.
        seqs = [seq for seq, _ in self.relay.replayed(0)]
        self.assertEqual(seqs, list(range(len(seqs))))
        self.assertEqual(seqs[-1], self.relay.last_seq)

    def test_a_relay_that_starts_over_clears_all_then_restates_every_chunk_stored(self):
        _, keys, want = self.saved_prompt("b", 3, seed=2)
        self.relay.events(stored_all(want))
        out = self.relay.stop()
        self.assertIn("published", out)

        self.relay.start()
        batches = [b for _, b in self.relay.replayed(0)]
        events = [e for b in batches for e in b.events]
        self.assertIsInstance(events[0], AllBlocksCleared)
        self.assert_stored(events[1:], want)
        # Nothing but what the cell holds: every BlockStored is of an announced chunk present now.
        store = kvstash.Store(vllm_test.URL, transports="shm,tcp")
        present = int(json.loads(cli("--json", "events"))["announced_objects"])
        self.assertEqual(len(stored(events)), present)
        self.assertEqual(store.contains_prefix(keys), 3)

    def test_events_trimmed_before_the_relay_read_them_clear_all_and_restate(self):
        _, keys, want = self.saved_prompt("c", 2, seed=3)
        self.relay.events(stored_all(want))
        cli("events", "on", "--maxlen", "20")
        items = [(k, msgspec.msgpack.encode([[h], parent, tokens, BLOCK, None, None]))
                 for k, (h, parent, tokens) in want.items()]
        store = kvstash.Store(vllm_test.URL, transports="shm,tcp")
        self.relay.proc.send_signal(signal.SIGSTOP)  # a relay that falls behind
        try:
            for _ in range(150):
                self.assertEqual(store.announce(items), 2)
        finally:
            self.relay.proc.send_signal(signal.SIGCONT)
            cli("events", "on", "--maxlen", "100000")
        events = self.relay.events(restated(want), seconds=30)
        self.assert_stored(after_clear(events), want)
        self.assertIn("trimmed before they were read", self.relay.output())

    def test_a_failover_clears_all_then_restates_what_the_new_master_holds(self):
        _, _, want = self.saved_prompt("d", 2, seed=4)
        self.relay.events(stored_all(want))
        # What fence_master.lua does on the first contact with a new master (sentinel_test
        # runs a real failover): the events epoch moves on.
        subprocess.run(["redis-cli", "-u", vllm_test.URL, "HINCRBY", engine_fixture.CELL_PREFIX + ":events",
                        "epoch", "1"], check=True, capture_output=True)
        events = self.relay.events(restated(want))
        self.assert_stored(after_clear(events), want)
        self.assertIn("epoch changed", self.relay.output())

    def test_events_lost_with_redis_data_are_turned_on_again_and_clear_all(self):
        _, _, want = self.saved_prompt("e", 2, seed=5)
        self.relay.events(stored_all(want))
        cli("events", "off")  # P:events, its log and its set gone, as in a Redis that lost its data
        events = self.relay.events(lambda got: any(isinstance(e, AllBlocksCleared) for e in got))
        self.assertEqual(stored(after_clear(events)), [])
        state = json.loads(cli("--json", "events"))
        self.assertTrue(state["on"], "the relay turns the cell's events on again")
        # Chunks saved from now on are announced again (the connector asks again a minute after
        # it found the events off; this engine never did).
        _, _, more = self.saved_prompt("f", 2, seed=6)
        self.assert_stored(self.relay.events(stored_all(more)), more)

    def test_token_ids_go_out_only_when_asked_for(self):
        """The token ids are the prompt's text, near enough: a relay started without
        --token-ids publishes BlockStored with an empty list, the hashes as before."""
        _, _, want = self.saved_prompt("t", 2, seed=8)
        self.relay.events(stored_all(want))
        quiet = Relay(extra=())
        try:
            events = [e for _, b in quiet.replayed(0) for e in b.events]
            got = {e.block_hashes[0]: e for e in stored(events)}
            for h, parent, _tokens in want.values():
                self.assertEqual((got[h].parent_block_hash, list(got[h].token_ids), got[h].block_size),
                                 (parent, [], BLOCK))
        finally:
            quiet.close()

    def test_an_event_no_script_wrote_is_not_published(self):
        """The log is a Redis stream a client may XADD to: an entry claiming a chunk that does not
        exist, one giving an object data its record does not hold, and a removal of an object
        still held are skipped; the events scripts write still go out, in order."""
        _, keys, want = self.saved_prompt("x", 2, seed=9)
        self.relay.events(stored_all(want))
        log = f"{engine_fixture.CELL_PREFIX}:events:log"
        ev = subprocess.run(["redis-cli", "-u", vllm_test.URL, "HGET", f"{engine_fixture.CELL_PREFIX}:obj:{keys[0]}",
                             "ev"], capture_output=True, check=True).stdout.rstrip(b"\n")
        other = subprocess.run(["redis-cli", "-u", vllm_test.URL, "HGET",
                                f"{engine_fixture.CELL_PREFIX}:obj:{keys[1]}", "ev"],
                               capture_output=True, check=True).stdout.rstrip(b"\n")
        self.assertTrue(ev and other and ev != other)

        def xadd(kind, key, data):
            subprocess.run(["redis-cli", "-u", vllm_test.URL, "-x", "XADD", log, "*", "t", kind, "k", key, "why", "",
                            "ev"], input=data, capture_output=True, check=True)

        xadd("stored", "kvp:00000000000000000000000000000000", ev)  # no such chunk
        xadd("stored", keys[1], ev)  # another chunk's data under this key
        xadd("removed", keys[0], ev)  # still stored
        _, _, after = self.saved_prompt("y", 2, seed=10)
        events = self.relay.events(stored_all(after))
        h0 = want[keys[0]][0]
        self.assertFalse([e for e in removed(events) if e.block_hashes == [h0]], "a forged removal went out")
        self.assertEqual([e for e in stored(events) if e.block_hashes == [h0]], [], "a forged store went out")
        self.assertIn("not back", self.relay.stop())

    def test_a_relay_binds_beyond_loopback_only_when_told(self):
        """Its sockets have no authentication: a public endpoint needs --public."""
        port = free_port()
        out = subprocess.run([KVSTASH, "--redis", vllm_test.URL, "events", "serve", "--pub", f"tcp://0.0.0.0:{port}",
                              "--seconds", "0.5"], capture_output=True, text=True, timeout=30)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("--public", out.stderr)
        out = subprocess.run([KVSTASH, "--redis", vllm_test.URL, "events", "serve", "--pub", f"tcp://0.0.0.0:{port}",
                              "--public", "--seconds", "0.5"], capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 0, out.stderr)

    def test_the_array_format_of_earlier_vllm_releases_and_a_dp_rank(self):
        _, _, want = self.saved_prompt("g", 2, seed=7)
        self.relay.events(stored_all(want))
        old = Relay(extra=("--format", "array", "--dp-rank", "3", "--token-ids"))
        try:
            old.decoder = msgspec.msgpack.Decoder(type=_ArrayBatch)
            batches = [b for _, b in old.replayed(0)]
            self.assertTrue(all(b.data_parallel_rank == 3 for b in batches))
            events = [e for b in batches for e in b.events]
            self.assertIsInstance(events[0], _ArrayCleared)
            got = {e.block_hashes[0]: e for e in events if isinstance(e, _ArrayStored)}
            for h, parent, tokens in want.values():
                self.assertEqual((got[h].parent_block_hash, got[h].token_ids, got[h].block_size, got[h].medium),
                                 (parent, tokens, BLOCK, "CPU"))
        finally:
            old.close()

# vLLM's events before they became tagged maps (KVCacheEvent array_like, as in the subscriber
# example of those releases): what `--format array` publishes.
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: object
    medium: object


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list
    medium: object


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: object = None


def stored_all(want):
    """Until a BlockStored of every block in `want` came."""
    hashes = {h for h, _, _ in want.values()}
    return lambda got: hashes <= {e.block_hashes[0] for e in stored(got)}


def removed_one(h):
    """Until a BlockRemoved of block `h` came."""
    return lambda got: any(e.block_hashes == [h] for e in removed(got))


def after_clear(events):
    """The events from the last AllBlocksCleared on."""
    cut = max(i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared))
    return events[cut:]


def restated(want):
    """Until an AllBlocksCleared and, after it, a BlockStored of every block in `want`."""
    hashes = {h for h, _, _ in want.values()}

    def done(got):
        if not any(isinstance(e, AllBlocksCleared) for e in got):
            return False
        return hashes <= {e.block_hashes[0] for e in stored(after_clear(got))}

    return done


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)

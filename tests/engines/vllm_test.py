"""kvstash.vllm against the real vLLM (scripts/engines-setup installs it into a venv).

The connector is loaded the way vLLM loads it, by name through its own KVConnectorFactory from
a KVTransferConfig, and its scheduler half is driven by vLLM's own Scheduler (requests,
schedule(), update_from_output()) on the CPU, with no model: the "forward pass" is this test
calling the worker half's hooks in the order vLLM's model runner calls them, on torch CPU
tensors laid out as vLLM's paged caches ([blocks, heads, tokens, head bytes] per layer), and
writing each scheduled token's KV itself, a value derived from the token and its position, so
that what a load brings back can be checked bit for bit.

Covered: a request whose prefix another request stored loads it, bit-exact, into other blocks;
a preempted request resumes and loads again; a load error becomes recomputed blocks; two
tensor-parallel ranks each store their shard, and a lookup needs both.

Usage (meson test `vllm`): VENV/bin/python tests/engines/vllm_test.py BUILD_DIR
Exit 77 (skipped) when vLLM cannot be imported.
"""

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

import engine_fixture

BUILD = engine_fixture.build_dir()

try:
    import torch
    import vllm  # noqa: F401
except ImportError as e:
    engine_fixture.run_in_venv_or_skip("vllm", "vLLM", e, __file__)

import kvstash  # noqa: E402
from kvstash import _vllm_keys  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older layouts of vllm.utils
    from vllm.utils import sha256

BLOCK = 16  # tokens per vLLM block (and per kvstash chunk: chunk_tokens defaults to it)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, HEAD = 2, 16  # per rank
NUM_BLOCKS = 64
DTYPE = torch.float16

URL = None  # the private cell's Redis, set up in setUpModule


def setUpModule():
    global URL, _cell
    _cell = engine_fixture.Cell(BUILD)
    URL = _cell.url
    init_none_hash(sha256)


def tearDownModule():
    _cell.stop()


def model_dir(kv_heads=HEADS):
    """A tiny Llama's config.json with `kv_heads` KV heads: vLLM reads the model's geometry from
    it, never its weights."""
    d = tempfile.mkdtemp(prefix="kvstash-vllm-model-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
                   "head_dim": HEAD, "num_hidden_layers": len(LAYERS), "vocab_size": 1000,
                   "max_position_embeddings": 4096, "torch_dtype": "float16", "rms_norm_eps": 1e-5}, f)
    return d


MODEL_DIRS = {}  # by KV heads
MLA_DIR = None
LATENT = 48  # an MLA layer's bytes per token: the compressed KV (32) and the rotary key (16)


def mla_model_dir():
    """A tiny DeepSeek-V2's config.json: one latent cache per layer, the same on every rank."""
    d = tempfile.mkdtemp(prefix="kvstash-vllm-mla-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 64,
                   "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "num_hidden_layers": len(LAYERS), "vocab_size": 1000,
                   "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                   "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 2,
                   "max_position_embeddings": 4096, "torch_dtype": "float16", "rms_norm_eps": 1e-5}, f)
    return d


def make_config(tp_size=1, extra=None, policy="recompute", batch_tokens=1024, role="kv_both", mla=False, pp_size=1,
                heads=HEADS):
    global MLA_DIR
    if mla:
        MLA_DIR = MLA_DIR or mla_model_dir()
    elif heads * tp_size not in MODEL_DIRS:
        MODEL_DIRS[heads * tp_size] = model_dir(heads * tp_size)
    where = MLA_DIR if mla else MODEL_DIRS[heads * tp_size]
    model = ModelConfig(model=where, tokenizer=where, skip_tokenizer_init=True, dtype="float16",
                        max_model_len=1024, seed=0)
    cfg = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batch_tokens, max_model_len=1024,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvstashConnector", kv_connector_module_path="kvstash.vllm", kv_role=role,
            kv_load_failure_policy=policy,
            # Lookups in line, so that each test's first step loads; the default (async) has its test.
            kv_connector_extra_config={"redis_url": URL, "transports": "shm,tcp",
                                       "timeout_ms": 5000, "async_lookup": False, **(extra or {})}),
    )
    cfg.parallel_config.tensor_parallel_size = tp_size
    cfg.parallel_config.pipeline_parallel_size = pp_size
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return cfg


WINDOW = 2 * BLOCK  # a hybrid model's sliding window: a hit reads its last two chunks of that group


def page_bytes(heads=HEADS):
    """Bytes of a block of one layer of `heads` KV heads (fp16): every group's page."""
    return BLOCK * heads * 2 * HEAD * 2


def make_kv_cache_config(mla=False, layers=tuple(LAYERS), heads=HEADS, hybrid=False, mamba=False):
    if mamba:  # a Mamba hybrid (Granite-4-, Nemotron-H-like): layer 0 a Mamba layer, layer 1 attention
        from vllm.v1.kv_cache_interface import KVCacheTensor, MambaSpec

        page = page_bytes(heads)
        state = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 16, 16)), dtypes=(DTYPE, DTYPE),
                          page_size_padded=page, mamba_cache_mode="align")
        full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD, dtype=DTYPE)
        # The Mamba layer's place in its backing buffer (vLLM 0.34 hands the layer the buffer).
        place = KVCacheTensor(size=NUM_BLOCKS * page, layers=[LAYERS[0]], layer_stride=NUM_BLOCKS * page,
                              block_stride=page)
        return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[place],
                             kv_cache_groups=[KVCacheGroupSpec([LAYERS[0]], state),
                                              KVCacheGroupSpec([LAYERS[1]], full)])
    if hybrid:  # as vLLM's hybrid allocator groups a Gemma-like model: layer 0 a window's, layer 1 full
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD, dtype=DTYPE,
                                   sliding_window=WINDOW)
        full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD, dtype=DTYPE)
        return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([LAYERS[0]], window),
                                              KVCacheGroupSpec([LAYERS[1]], full)])
    if mla:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=DTYPE)
    else:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD, dtype=DTYPE)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)])


class Engine:
    """One engine: vLLM's scheduler with the connector it loads, and one worker per TP rank,
    each with its own connector (role WORKER) and its own paged cache on the CPU."""

    def __init__(self, tp_size=1, extra=None, policy="recompute", batch_tokens=1024, role="kv_both", mla=False,
                 pp_size=1, heads=HEADS, hybrid=False, mamba=False):
        """mla: a DeepSeek-like model, one latent cache per layer that every rank holds alike.
        pp_size: pipeline stages, each with its share of LAYERS (a worker per stage and rank, each
        with its stage's KV-cache config; the scheduler gets stage 0's, as vLLM's engine core
        gives it). heads: KV heads per rank (the model has heads x tp_size). hybrid: vLLM's hybrid
        allocator over a Gemma-like model, layer 0 a sliding window's group, layer 1 full
        attention's, both layers in one paged tensor (each group its own blocks of it). mamba: a
        Mamba hybrid, layer 0 a Mamba layer (its state a page a block, vLLM's mamba_cache_mode
        "align"), layer 1 full attention."""
        self.mla, self.heads, self.hybrid, self.mamba = mla, heads, hybrid or mamba, mamba
        self.page = page_bytes(heads)
        self.config = make_config(tp_size, extra, policy, batch_tokens, role, mla, pp_size, heads)
        if mamba:
            self.config.cache_config.mamba_cache_mode = "align"
        self.params = {}  # request -> the kv_transfer_params its output carried
        # Requests some ranks finished sending or receiving: how many ranks so far.
        self._finished = {"sending": collections.Counter(), "recving": collections.Counter()}
        per_stage = len(LAYERS) // pp_size
        stages = [LAYERS[s * per_stage:(s + 1) * per_stage] for s in range(pp_size)]
        self.kv_cache_config = make_kv_cache_config(mla, stages[0], heads, hybrid, mamba)
        self.scheduler = Scheduler(self.config, self.kv_cache_config, StructuredOutputManager(self.config),
                                   block_size=BLOCK)
        self.connector = self.scheduler.connector
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.workers = []
        for layers in stages:
            for rank in range(tp_size):
                w = KVConnectorFactory.create_connector(config=self.config, role=KVConnectorRole.WORKER,
                                                       kv_cache_config=make_kv_cache_config(mla, layers, heads,
                                                                                            hybrid, mamba))
                shared = self.paged_cache()
                caches = {name: shared if hybrid else self.paged_cache() for name in layers}
                if mamba:  # the Mamba layer gets its backing buffer, as vLLM 0.34 hands it
                    caches[LAYERS[0]] = torch.zeros(NUM_BLOCKS * self.page, dtype=torch.int8)
                _with_rank(rank, lambda: w.register_kv_caches(caches))
                self.workers.append((w, caches, rank))

    def paged_cache(self):
        if self.mla:  # vLLM's MLA view: [blocks, tokens, latent]
            return torch.zeros(NUM_BLOCKS, BLOCK, LATENT, dtype=DTYPE)
        # vLLM's per-layer view [blocks, heads, tokens, K and V of a head], NHD in memory.
        storage = torch.zeros(NUM_BLOCKS, BLOCK, self.heads, 2 * HEAD, dtype=DTYPE)
        return storage.permute(0, 2, 1, 3)

    def request(self, rid, tokens, max_tokens=4, cache_salt=None, **inputs):
        """inputs: Request's other inputs (mm_features, prompt_embeds, lora_request)."""
        return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                       cache_salt=cache_salt, block_hasher=self.hasher, **inputs)

    def step(self, fail_loads=False):
        """One scheduler step and its 'forward pass'. Returns the scheduler output."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        invalid, failed = set(), set()
        for w, caches, rank in self.workers:
            w.bind_connector_metadata(meta)
            if fail_loads:
                for run in meta.loads + meta.fetches:
                    run.tokens = [t + 1 for t in run.tokens]  # other keys: every chunk misses
            w.start_load_kv(None)
            for i, name in enumerate(LAYERS):
                if name not in caches:
                    continue  # another pipeline stage's
                if self.mamba and i == 0:  # vLLM calls no connector hook around a Mamba layer
                    self.compute_state(out, caches[name], rank)
                    continue
                w.wait_for_layer_load(name)
                self.compute(out, caches[name], i, rank)
                w.save_kv_layer(name, caches[name], None)
            w.wait_for_save()
            results = w.get_transfer_results(out.finished_req_ids)
            sent, received = results.finished_sending, results.finished_recving
            failed |= results.failed_recving
            invalid |= w.get_block_ids_with_load_errors()
            # As vLLM's output aggregator: a request is done once every rank said so, in
            # whichever steps each did.
            for req_id in sent or ():
                self._finished["sending"][req_id] += 1
            for req_id in received or ():
                self._finished["recving"][req_id] += 1
            w.clear_connector_metadata()
        sending, receiving = ({r for r, n in self._finished[k].items() if n == len(self.workers)}
                              for k in ("sending", "recving"))
        for k, done in (("sending", sending), ("recving", receiving)):
            for r in done:
                del self._finished[k][r]
        reqs = list(out.num_scheduled_tokens)
        fields = dict(req_ids=reqs, sampled_token_ids=[[7] for _ in reqs],
                      kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid, finished_sending=sending or None,
                                                            finished_recving=receiving or None,
                                                            failed_recving=failed))
        if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # vLLM 0.33 (0.34 dropped it)
            fields["req_id_to_index"] = {r: i for i, r in enumerate(reqs)}
        runner = ModelRunnerOutput(**fields)
        for outputs in self.scheduler.update_from_output(out, runner).values():
            for o in outputs.outputs:
                if o.kv_transfer_params:
                    self.params[o.request_id] = o.kv_transfer_params
        return out

    def free_blocks(self):
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def step_until(self, done, seconds=10):
        """Steps (as vLLM's busy loop does while requests or held blocks remain) until done()."""
        deadline = time.monotonic() + seconds
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {seconds} s of steps")
            self.step()
            time.sleep(0.002)

    def run(self, rid, tokens, max_tokens=2, steps=64):
        """Adds a request and steps until the scheduler has nothing left."""
        self.scheduler.add_request(self.request(rid, tokens, max_tokens=max_tokens))
        for _ in range(steps):
            if self.scheduler.get_num_unfinished_requests() == 0:
                return
            self.step()
        raise AssertionError(f"{rid} did not finish in {steps} steps")

    def saved(self):
        return sum(w._stats["chunks_saved"] for w, _, _ in self.workers)

    def compute_state(self, out, buffer, rank):
        """A Mamba layer's step, as vLLM's "align" mode keeps it: the state after the step's last
        token in the block of the group's table that holds that token."""
        for rid in out.num_scheduled_tokens:
            req = self.scheduler.requests[rid]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            end = min(req.num_computed_tokens, len(req.all_token_ids))
            block = blocks[(end - 1) // BLOCK]
            assert block != 0, "the block holding the step's last token is not the null block"
            buffer[block * self.page:(block + 1) * self.page] = state_page(req.all_token_ids[:end], rank, self.page)

    def compute(self, out, cache, layer, rank):
        """Writes the KV of every token scheduled this step: a value of the token, its position,
        the layer and the rank, so that a load can be checked against what compute would give."""
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            # Layer 1's group is the second with the hybrid allocator.
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[1 if self.hybrid and layer == 1 else 0]
            start = req.num_computed_tokens - n  # schedule() counted them computed already
            for pos in range(start, start + n):
                if pos >= len(req.all_token_ids):
                    break
                if self.mla:  # the same latent on every rank
                    cache[blocks[pos // BLOCK], pos % BLOCK, :] = kv_value(req.all_token_ids[pos], pos, layer, 0)
                else:  # each head its own value: the model's head rank x heads + h
                    for h in range(self.heads):
                        cache[blocks[pos // BLOCK], h, pos % BLOCK, :] = kv_value(
                            req.all_token_ids[pos], pos, layer, rank * self.heads + h)


def state_page(tokens, rank=0, page=page_bytes()):
    """Rank `rank`'s shard of the Mamba state after `tokens`, as compute_state writes it: a page of
    bytes of their digest."""
    import hashlib

    digest = hashlib.sha256(f"{rank}:{list(tokens)}".encode()).digest()
    return torch.frombuffer(bytearray(digest * (page // len(digest))), dtype=torch.int8)


def kv_value(token, pos, layer, head):
    return float((token * 31 + pos * 7 + layer * 3 + head * 5) % 251) / 8.0


def _with_rank(rank, fn):
    import vllm.distributed.parallel_state as ps

    saved = ps.get_tensor_model_parallel_rank
    ps.get_tensor_model_parallel_rank = lambda: rank
    try:
        return fn()
    finally:
        ps.get_tensor_model_parallel_rank = saved


def expected_block(tokens, block_index, layer, rank, heads=HEADS):
    """A block of rank `rank` of an engine of `heads` KV heads per rank, as compute() wrote it."""
    want = torch.empty(heads, BLOCK, 2 * HEAD, dtype=DTYPE)
    for h in range(heads):
        for j in range(BLOCK):
            pos = block_index * BLOCK + j
            want[h, j, :] = kv_value(tokens[pos], pos, layer, rank * heads + h)
    return want


class VllmConnector(unittest.TestCase):
    def test_loads_through_vllms_factory_and_keys_match_the_workers(self):
        e = Engine()
        self.assertEqual(type(e.connector).__name__, "KvstashConnector")
        self.assertEqual(type(e.connector).__module__, "kvstash.vllm")
        w = e.workers[0][0]
        self.assertEqual(w._cache_for("").layout_tag, e.connector.geometry.layout_tag())
        tokens = list(range(100, 100 + 3 * BLOCK))
        self.assertEqual(w._cache_for("").keys(tokens), e.connector.geometry.all_keys(tokens))

    def test_register_reads_vllms_views_and_refuses_what_it_cannot_move(self):
        e = Engine()
        w = KVConnectorFactory.create_connector(config=e.config, role=KVConnectorRole.WORKER,
                                               kv_cache_config=e.kv_cache_config)
        # An attention kernel with half-size blocks: twice the blocks, each half a page.
        split = {n: torch.zeros(2 * NUM_BLOCKS, BLOCK // 2, HEADS, 2 * HEAD, dtype=DTYPE).permute(0, 2, 1, 3)
                 for n in LAYERS}
        w.register_kv_caches(split)
        self.assertEqual(w._cache_for("").layout_tag, e.connector.geometry.layout_tag())
        # K and V outermost (an older layout): blocks are not dense pages.
        kv_first = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD, dtype=DTYPE) for n in LAYERS}
        with self.assertRaisesRegex(ValueError, "not dense and outermost"):
            w.register_kv_caches(kv_first)
        # HND in memory while vLLM resolved NHD: the keys would name other bytes.
        hnd = {n: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=DTYPE) for n in LAYERS}
        with self.assertRaisesRegex(ValueError, "laid out HN within a block, but vLLM's resolved layout is LBNHC"):
            w.register_kv_caches(hnd)
        with self.assertRaisesRegex(ValueError, "3 KV-cache tensors"):
            w.register_kv_caches({**split, "model.layers.2.self_attn.attn": split[LAYERS[0]]})

    def test_a_hybrid_model_with_what_kvstash_does_not_store_is_refused_at_start_by_name(self):
        from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

        hybrid = make_kv_cache_config(hybrid=True)
        page = hybrid.kv_cache_groups[1].kv_cache_spec.page_size_bytes
        mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 16, 16)), dtypes=(DTYPE, DTYPE),
                          page_size_padded=page)
        local = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE,
                                          attention_chunk_size=64)
        speculative = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 16, 16)), dtypes=(DTYPE, DTYPE),
                                page_size_padded=page, mamba_cache_mode="align", num_speculative_blocks=1)
        for spec, why in ((local, f"KV-cache group 1 \\(ChunkedLocalAttentionSpec, layers .*{LAYERS[0]}.*not one "
                                  "kvstash stores"),
                          (mamba, "KV-cache group 1 \\(MambaSpec\\) is not stored: .*mamba_cache_mode 'align'"),
                          (speculative, "KV-cache group 1 \\(MambaSpec\\) is not stored: speculative")):
            groups = [hybrid.kv_cache_groups[1], KVCacheGroupSpec([LAYERS[0]], spec)]
            config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
            with self.assertRaisesRegex(ValueError, why):
                KVConnectorFactory.create_connector(config=make_config(), role=KVConnectorRole.SCHEDULER,
                                                    kv_cache_config=config)
        for extra, what in (({"chunk_tokens": 2 * BLOCK}, "a hybrid model's chunks are one block"),
                            ({"pd": "direct"}, "a hybrid model is served with pd 'cell'")):
            with self.assertRaisesRegex(ValueError, what):
                KVConnectorFactory.create_connector(config=make_config(extra=extra), role=KVConnectorRole.SCHEDULER,
                                                    kv_cache_config=hybrid)
        with self.assertRaisesRegex(ValueError, "not served with pipeline parallelism"):
            KVConnectorFactory.create_connector(config=make_config(pp_size=2), role=KVConnectorRole.SCHEDULER,
                                                kv_cache_config=hybrid)

    def test_bad_config_is_refused_at_start_naming_the_keys(self):
        with self.assertRaisesRegex(ValueError, "unknown kv_connector_extra_config keys.*redis_url"):
            Engine(extra={"redis_host": "x"})
        with self.assertRaisesRegex(ValueError, "chunk_tokens 24 is not a multiple of the block size 16"):
            Engine(extra={"chunk_tokens": 24})
        # A rank of 1 head (TP=2 of a 2-head model) cannot hold objects of 2 heads.
        with self.assertRaisesRegex(ValueError, "kv_heads_per_object 2 does not divide a rank's 1 KV heads"):
            Engine(tp_size=2, heads=1, extra={"kv_heads_per_object": 2})
        self.assertEqual(Engine(extra={"kv_heads_per_object": 2}).connector.geometry.parts(), 1)
        with self.assertRaisesRegex(ValueError, "pd 'direct'.*pipeline parallelism"):
            Engine(pp_size=2, extra={"pd": "direct"}, role="kv_producer")

    def test_the_connector_and_store_metrics_appear_in_vllms_prometheus_endpoint(self):
        """vLLM's own Prometheus path (KVConnectorProm, as its PrometheusStatLogger builds it,
        fed the stats its scheduler aggregates): the connector's counts and the store's own
        metrics, under vLLM's labels, in what vLLM's /metrics serves."""
        import prometheus_client
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
        from vllm.v1.metrics.prometheus import unregister_vllm_metrics

        def interval_stats(engine):
            """What vLLM's scheduler gathers for one interval: every worker's and its own."""
            out = None
            for conn in [w for w, _, _ in engine.workers] + [engine.connector]:
                s = conn.get_kv_connector_stats()
                if s is not None:
                    out = s if out is None else out.aggregate(s)
            return out

        shared = [17 + (i * 7) % 800 for i in range(5 * BLOCK)]
        a = Engine()
        a.run("a", shared + [1, 2])
        b = Engine()
        b.run("b", shared + [3, 4])
        self.assertEqual(b.workers[0][0]._stats["chunks_loaded"], 5)
        unregister_vllm_metrics()
        prom = KVConnectorProm(b.config, ["model_name", "engine"], {0: ["kvstash-test", "0"]})
        for engine in (a, b):
            stats = interval_stats(engine)
            self.assertIsNotNone(stats)
            self.assertIn("chunks_saved", stats.reduce(), "vLLM's log line keeps the connector's counts")
            prom.observe(stats.to_dict(), 0)
        self.assertIsNone(interval_stats(b), "an interval with nothing done has nothing to say")
        text = prometheus_client.generate_latest().decode()
        key, samples = engine_fixture.series_key, engine_fixture.prometheus_samples
        served = {key(k): v for k, v in samples(text).items()}
        labels = 'model_name="kvstash-test",engine="0"'

        def value(series):
            got = served.get(key(series))
            if got is None:
                self.fail(f"{series} is not in vLLM's metrics:\n" + "\n".join(
                    line for line in text.splitlines() if "kvstash" in line))
            return got

        self.assertEqual(value(f"vllm:kvstash_connector_chunks_loaded_total{{{labels}}}"), 5)
        self.assertGreaterEqual(value(f"vllm:kvstash_connector_chunks_saved_total{{{labels}}}"), 5)
        self.assertEqual(value(f'vllm:kvstash_kvcache_chunks_total{{{labels},op="load",status="ok"}}'), 5)
        # The store's counts, as its own text says them: both engines' stores, summed.
        own = {}
        for engine in (a, b):
            for series, v in samples(engine.workers[0][0].store.metrics_text()).items():
                own[series] = own.get(series, 0) + v
        for series in ('kvstash_client_ops_total{op="get",status="ok"}',
                       'kvstash_client_transfer_bytes_total{op="write",transport="shm"}',
                       'kvstash_client_op_duration_seconds_count{op="get"}',
                       'kvstash_client_op_duration_seconds_bucket{op="get",le="0.01"}',
                       'kvstash_kvcache_chunks_total{op="save",status="ok"}'):
            name, _, rest = series.partition("{")
            self.assertGreater(own[series], 0, series)
            self.assertEqual(value(f"vllm:{name}{{{labels},{rest}"), own[series], series)
        # A histogram's sum comes through too (its observations placed inside their buckets).
        got = value(f'vllm:kvstash_client_op_duration_seconds_sum{{{labels},op="get"}}')
        self.assertAlmostEqual(got, own['kvstash_client_op_duration_seconds_sum{op="get"}'], places=4)

    def test_a_stored_prefix_loads_bit_exact_into_other_blocks(self):
        shared = [11 + (i * 13) % 900 for i in range(5 * BLOCK)]
        a = Engine()
        a.scheduler.add_request(a.request("a", shared + [1, 2, 3]))
        while a.scheduler.requests.get("a") is not None and not a.scheduler.requests["a"].is_finished():
            a.step()
            if a.connector._stats["chunks_found"] == 0 and a.workers[0][0]._stats["chunks_saved"] >= 5:
                break
        self.assertGreaterEqual(a.workers[0][0]._stats["chunks_saved"], 5)

        b = Engine()  # another engine: its own scheduler, prefix cache and blocks
        b.scheduler.add_request(b.request("b", shared + [9, 9]))
        first = b.step()
        w, caches, _ = b.workers[0]
        self.assertEqual(len(first.kv_connector_metadata.loads), 1)
        load = first.kv_connector_metadata.loads[0]
        self.assertEqual((load.first, load.count), (0, 5))
        self.assertEqual(first.num_scheduled_tokens["b"], 2, "only the tokens after the loaded prefix are computed")
        self.assertEqual(w._stats["chunks_loaded"], 5)
        blocks = load.block_ids[0]
        for layer, name in enumerate(LAYERS):
            for i in range(5):
                got = caches[name][blocks[i]]
                self.assertTrue(torch.equal(got, expected_block(shared, i, layer, 0)), f"layer {layer} block {i}")

    def test_by_default_the_lookup_runs_off_the_scheduler_and_the_request_waits_a_step(self):
        shared = [71 + (i * 37) % 900 for i in range(3 * BLOCK)]
        a = Engine()
        a.scheduler.add_request(a.request("a", shared + [1]))
        a.step()
        b = Engine(extra={"async_lookup": True})
        b.scheduler.add_request(b.request("b", shared + [2]))
        first = b.step()
        self.assertNotIn("b", first.num_scheduled_tokens, "vLLM was told to ask again (None)")
        for _ in range(50):
            out = b.step()
            if "b" in out.num_scheduled_tokens:
                break
            time.sleep(0.01)
        self.assertEqual([(r.first, r.count) for r in out.kv_connector_metadata.loads], [(0, 3)])
        self.assertEqual(out.num_scheduled_tokens["b"], 1)
        blocks = out.kv_connector_metadata.loads[0].block_ids[0]
        for layer, name in enumerate(LAYERS):
            for i in range(3):
                self.assertTrue(torch.equal(b.workers[0][1][name][blocks[i]], expected_block(shared, i, layer, 0)))

    def test_chunked_prefill_saves_each_chunk_as_its_step_completes_it(self):
        prompt = [51 + (i * 29) % 900 for i in range(6 * BLOCK + 3)]
        a = Engine(batch_tokens=2 * BLOCK + 8)  # a prefill step takes at most 40 tokens
        a.scheduler.add_request(a.request("a", prompt))
        saved_per_step = []
        for _ in range(3):
            out = a.step()
            saved_per_step.append([(r.first, r.count) for r in out.kv_connector_metadata.saves])
        self.assertEqual(saved_per_step, [[(0, 2)], [(2, 3)], [(5, 1)]],
                         "each step saves the chunks it completed, none before its tokens are computed")
        b = Engine()
        b.scheduler.add_request(b.request("b", prompt))
        out = b.step()
        self.assertEqual([(r.first, r.count) for r in out.kv_connector_metadata.loads], [(0, 6)])
        blocks = out.kv_connector_metadata.loads[0].block_ids[0]
        for layer, name in enumerate(LAYERS):
            for i in range(6):
                self.assertTrue(torch.equal(b.workers[0][1][name][blocks[i]], expected_block(prompt, i, layer, 0)))

    def test_decode_fills_chunks_that_are_saved_too(self):
        prompt = [61 + (i * 31) % 900 for i in range(BLOCK + BLOCK - 2)]
        a = Engine()
        a.scheduler.add_request(a.request("a", prompt, max_tokens=6))
        for _ in range(4):
            a.step()
        tokens = list(a.scheduler.requests["a"].all_token_ids)
        self.assertGreater(len(tokens), 2 * BLOCK)
        store = kvstash.Store(URL, transports="shm,tcp")
        keys = a.connector.geometry.keys(tokens[: 2 * BLOCK])
        self.assertEqual(store.contains_prefix(keys), 2, "the chunk decode completed is stored")
        quiet = Engine(extra={"save_decode": False})
        quiet.scheduler.add_request(quiet.request("q", [t + 1 for t in prompt], max_tokens=6))
        for _ in range(4):
            quiet.step()
        qtokens = list(quiet.scheduler.requests["q"].all_token_ids)
        self.assertEqual(store.contains_prefix(quiet.connector.geometry.keys(qtokens[: 2 * BLOCK])), 1)

    def test_a_cache_salt_keeps_tenants_apart(self):
        shared = [81 + (i * 41) % 900 for i in range(2 * BLOCK)]
        a = Engine()
        a.scheduler.add_request(a.request("a", shared + [1], cache_salt="tenant-a"))
        a.step()
        self.assertEqual(a.workers[0][0]._stats["chunks_saved"], 2)
        loads = {}
        for rid, salt in (("same", "tenant-a"), ("other", "tenant-b"), ("none", None)):
            b = Engine()
            b.scheduler.add_request(b.request(rid, shared + [2], cache_salt=salt))
            out = b.step()
            loads[rid] = [(r.first, r.count) for r in out.kv_connector_metadata.loads]
            if rid == "same":
                blocks = out.kv_connector_metadata.loads[0].block_ids[0]
                for layer, name in enumerate(LAYERS):
                    for i in range(2):
                        self.assertTrue(torch.equal(b.workers[0][1][name][blocks[i]],
                                                    expected_block(shared, i, layer, 0)))
        self.assertEqual(loads, {"same": [(0, 2)], "other": [], "none": []})
        g = a.connector.geometry
        self.assertNotEqual(g.keys(shared, 0, "tenant-a"), g.keys(shared))

    def test_multimodal_items_are_named_by_their_hash_and_placeholder(self):
        """Equal token ids (an image's placeholder tokens are alike whatever the image): a
        request with another image, or the same image at another place, shares the chunks
        before the image only; the same image at the same place shares them all."""
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        def image(ident, offset, length=20):
            return [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                          mm_position=PlaceholderRange(offset=offset, length=length))]

        tokens = [301 + (i * 13) % 600 for i in range(4 * BLOCK)]
        keys = _vllm_keys.RequestKeys(BLOCK)
        e = Engine()
        g = e.connector.geometry

        def chunk_keys(**inputs):
            req = e.request("r", tokens, **inputs)
            return g.keys(tokens, 0, keys.request_salt(req), keys.chunk_salts(req))

        plain, cat = chunk_keys(), chunk_keys(mm_features=image("cat", BLOCK + 3))
        dog, moved = chunk_keys(mm_features=image("dog", BLOCK + 3)), chunk_keys(mm_features=image("cat", BLOCK + 4))
        self.assertEqual(cat[0], plain[0], "the chunk before the image keeps its key")
        for other in (plain, dog, moved):
            self.assertTrue(all(a != b for a, b in zip(cat[1:], other[1:])), "a chunk from the image on is shared")
        self.assertEqual(chunk_keys(mm_features=image("cat", BLOCK + 3)), cat, "the same image, other keys")
        # The chunk salts come from the scheduler and name no rank: an engine of the same model
        # at TP=2 (a head a rank) names the image's chunks as TP=1 does, object for object.
        g2 = Engine(tp_size=2, heads=1).connector.geometry
        req = e.request("r", tokens, mm_features=image("cat", BLOCK + 3))
        self.assertEqual(g2.all_keys(tokens, keys.request_salt(req), keys.chunk_salts(req)),
                         g.all_keys(tokens, keys.request_salt(req), keys.chunk_salts(req)))
        # Through the connector: what one engine saved with the cat, another finds with the cat
        # only, and loads bit-exact.
        a = Engine()
        a.connector._naming(a.request("a", tokens + [1], mm_features=image("cat", BLOCK + 3)))
        naming = a.connector._named["a"]
        self.assertEqual(naming[1][:4], keys.chunk_salts(a.request("x", tokens, mm_features=image("cat", BLOCK + 3))))
        store = kvstash.Store(URL, transports="shm,tcp")
        w = a.workers[0][0]
        blocks = list(range(4))
        for i, name in enumerate(LAYERS):
            for b in blocks:
                a.workers[0][1][name][b] = expected_block(tokens, b, i, 0)
        save = w._cache_for(naming[0]).begin_save(tokens, blocks, 0, 4, chunk_salts=naming[1])
        for layer in range(len(LAYERS)):
            save.save_layer(layer)
        self.assertEqual([c for c, _ in save.wait()], ["ok"] * 4)
        self.assertEqual(store.contains_prefix(cat), 4)
        self.assertEqual(store.contains_prefix(dog), 1, "another image finds the chunk before it only")
        b = Engine()
        for rid, ident, want in (("dog", "dog", 1), ("cat", "cat", 4)):
            req = b.request(rid, tokens + [2], mm_features=image(ident, BLOCK + 3))
            self.assertEqual(b.connector.get_num_new_matched_tokens(req, 0), (want * BLOCK, False), rid)
        req = b.request("plain", tokens + [2])
        self.assertEqual(b.connector.get_num_new_matched_tokens(req, 0), (BLOCK, False))

    def test_prompt_embeddings_and_lora_adapters_are_named_by_content(self):
        """Prompt embeddings by their bytes, chunk by chunk; an adapter by its files, not by its
        name, id or path; a request whose adapter is not here to be read is not served."""
        from vllm.lora.request import LoRARequest

        tokens = [0] * (3 * BLOCK)  # vLLM's ids for a prompt of embeddings
        keys = _vllm_keys.RequestKeys(BLOCK)
        e = Engine()
        g = e.connector.geometry
        embeds = torch.randn(3 * BLOCK, 64, generator=torch.Generator().manual_seed(1))
        changed = embeds.clone()
        changed[BLOCK + 5, 7] += 1e-3

        def chunk_keys(**inputs):
            req = e.request("r", tokens, **inputs)
            return g.keys(tokens, 0, keys.request_salt(req), keys.chunk_salts(req))

        one, two = chunk_keys(prompt_embeds=embeds), chunk_keys(prompt_embeds=changed)
        self.assertEqual(one[0], two[0], "the chunk before the changed row keeps its key")
        self.assertTrue(one[1] != two[1] and one[2] != two[2], "one changed value in chunk 1 must change it")
        self.assertEqual(chunk_keys(prompt_embeds=embeds.clone()), one, "equal embeddings, other keys")
        self.assertNotEqual(chunk_keys()[0], one[0], "embeddings and ids [0, 0, ...] share a key")
        d = tempfile.mkdtemp(prefix="kvstash-lora-")
        paths = {n: os.path.join(d, n) for n in ("a", "b", "a2")}
        for n, content in (("a", b"A"), ("b", b"B"), ("a2", b"A")):
            os.makedirs(paths[n])
            with open(os.path.join(paths[n], "adapter_model.safetensors"), "wb") as f:
                f.write(content * 1000)
        lora_a = chunk_keys(lora_request=LoRARequest("a", 1, paths["a"]))
        lora_b = chunk_keys(lora_request=LoRARequest("a", 1, paths["b"]))  # A's name and id, B's files
        copy = _vllm_keys.RequestKeys(BLOCK)  # another engine: A's files under another name and id
        req = e.request("r", tokens, lora_request=LoRARequest("a-copy", 9, paths["a2"]))
        self.assertNotEqual(lora_a[0], lora_b[0])
        self.assertNotEqual(lora_a[0], chunk_keys()[0])
        self.assertEqual(g.keys(tokens, 0, copy.request_salt(req)), lora_a, "A's content under another name")
        missing = e.request("m", tokens, lora_request=LoRARequest("gone", 3, os.path.join(d, "nowhere")))
        self.assertEqual(e.connector.get_num_new_matched_tokens(missing, 0), (0, False))
        self.assertIsNone(e.connector._named["m"], "a request with an unreadable adapter was served")

    def test_the_model_is_named_by_content_and_resolved_config(self):
        """The same files under another path name the same model; a changed config value, an
        override, another KV-cache dtype or a vouched weights_id name another."""
        import shutil

        def identity(model_dir, weights_id="", **kwargs):
            cache = kwargs.pop("cache", {})
            model = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float16",
                                max_model_len=1024, seed=0, **kwargs)
            cfg = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK, **cache),
                             device_config=DeviceConfig("cpu"))
            return _vllm_keys.model_identity(cfg, weights_id)

        base = model_dir()
        first = identity(base)
        moved = os.path.join(tempfile.mkdtemp(prefix="kvstash-mounted-"), "current")
        shutil.copytree(base, moved)
        self.assertEqual(identity(moved), first, "the same files under another path")
        self.assertNotEqual(identity(base, hf_overrides={"rope_theta": 5e5}), first, "an override")
        self.assertNotEqual(identity(base, cache={"cache_dtype": "fp8"}), first, "the KV-cache dtype")
        self.assertNotEqual(identity(base, weights_id="sha256:vouched"), first, "a vouched weights_id")
        with open(os.path.join(moved, "config.json")) as f:
            config = json.load(f)
        config["rms_norm_eps"] = 1e-6
        with open(os.path.join(moved, "config.json"), "w") as f:
            json.dump(config, f)
        self.assertNotEqual(identity(moved), first, "a config value changed in place")

    def test_an_mla_model_is_stored_once_and_every_rank_loads_that_copy(self):
        """TP=2, MLA: rank 0 stores each chunk's latent cache, rank 1 stores nothing; a lookup
        asks for rank 0's copy only, and both ranks of another engine load it, bit-exact."""
        tokens = [71 + (i * 23) % 900 for i in range(2 * BLOCK)]
        a = Engine(tp_size=2, mla=True)
        self.assertTrue(a.connector.geometry.stored_once)
        a.run("a", tokens + [1])
        self.assertEqual([w._stats["chunks_saved"] for w, _, _ in a.workers], [2, 0], "rank 0 stores the one copy")
        b = Engine(tp_size=2, mla=True)
        b.scheduler.add_request(b.request("b", tokens + [2]))
        out = b.step()
        loads = out.kv_connector_metadata.loads
        self.assertEqual([(r.first, r.count) for r in loads], [(0, 2)])
        for w, caches, rank in b.workers:
            self.assertEqual(w._stats["chunks_loaded"], 2, f"rank {rank}")
            for layer, name in enumerate(LAYERS):
                for i in range(2):
                    want = torch.tensor([kv_value(tokens[i * BLOCK + j], i * BLOCK + j, layer, 0)
                                         for j in range(BLOCK)], dtype=DTYPE)[:, None].expand(BLOCK, LATENT)
                    self.assertTrue(torch.equal(caches[name][loads[0].block_ids[0][i]], want), f"rank {rank}")
        # The one copy names no rank: an engine at TP=1 loads it too; and with two pipeline
        # stages each stage's rank 0 stores its layer's copy, which another such engine loads.
        c = Engine(tp_size=1, mla=True)
        c.scheduler.add_request(c.request("c", tokens + [3]))
        self.assertEqual([(r.first, r.count) for r in c.step().kv_connector_metadata.loads], [(0, 2)])
        self.assertEqual(c.workers[0][0]._stats["chunks_loaded"], 2)
        d = Engine(tp_size=2, mla=True, pp_size=2)
        d.run("d", tokens + [4])
        self.assertEqual([w._stats["chunks_saved"] for w, _, _ in d.workers], [2, 0, 2, 0])
        f = Engine(tp_size=1, mla=True, pp_size=2)
        f.scheduler.add_request(f.request("f", tokens + [5]))
        out = f.step()
        self.assertEqual([(r.first, r.count) for r in out.kv_connector_metadata.loads], [(0, 2)])
        for w, caches, _ in f.workers:
            self.assertEqual(w._stats["chunks_loaded"], 2)
            for name, cache in caches.items():
                want = torch.tensor([kv_value(tokens[j], j, LAYERS.index(name), 0) for j in range(BLOCK)],
                                    dtype=DTYPE)[:, None].expand(BLOCK, LATENT)
                self.assertTrue(torch.equal(cache[out.kv_connector_metadata.loads[0].block_ids[0][0]], want), name)

    def test_a_reset_of_the_connectors_cache_stops_sharing(self):
        """After reset_prefix_cache(reset_connector=True) (weights updated in place, which no key
        names) the engine finds none of the chunks stored before; other engines still do."""
        shared = [53 + (i * 29) % 900 for i in range(2 * BLOCK)]
        a = Engine()
        a.run("a", shared + [1])
        self.assertEqual(a.saved(), 2)
        self.assertTrue(a.scheduler.reset_prefix_cache(reset_connector=True))
        a.scheduler.add_request(a.request("again", shared + [3]))
        self.assertEqual(a.connector.get_num_new_matched_tokens(a.scheduler.requests["again"], 0), (0, False),
                         "the reset engine found what was saved before")
        b = Engine()
        req = b.request("b", shared + [2])
        self.assertEqual(b.connector.get_num_new_matched_tokens(req, 0), (2 * BLOCK, False))

    def test_under_turn_ttl_each_use_tells_the_cell_its_requests_turn_and_lookup(self):
        """A turn-ttl cell keeps a chunk for a time learned per class of use: the connector's
        saves and loads name each chunk's class (KeepHint), the request's turn counted along the
        chain by its lookup, and count from that lookup's clock. Without hints every chunk's
        due time would be its use's (equal in one load's script) and no record would have a
        turn."""
        kvstash_cli = [os.path.join(BUILD, "tools", "kvstash", "kvstash"), "--redis", URL]
        out = subprocess.run(kvstash_cli + ["policy", "turn-ttl", "--yes"], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        try:
            first = [83 + (i * 41) % 900 for i in range(3 * BLOCK)]
            second = first + [97 + (i * 43) % 900 for i in range(2 * BLOCK)]
            a = Engine()
            a.run("turn-1", first + [1])
            self.assertEqual(a.saved(), 3)
            b = Engine()  # the conversation's next turn, on another engine: loads 3, saves 2
            b.run("turn-2", second + [2])
            self.assertEqual(b.workers[0][0]._stats["chunks_loaded"], 3)
            self.assertEqual(b.saved(), 2)
            g = b.connector.geometry
            keys = g.all_keys(second)
            self.assertEqual(len(keys), 5 * g.parts())

            def field(*args):
                return subprocess.run(["redis-cli", "-u", URL, *args], capture_output=True, text=True,
                                      check=True).stdout.strip()

            turns = [field("HGET", f"{engine_fixture.CELL_PREFIX}:obj:{k}", "turn") for k in keys]
            self.assertEqual(turns, ["1"] * 3 * g.parts() + ["2"] * 2 * g.parts(),
                             "each chunk's record names the turn of the request that put it")
            due = [float(field("ZSCORE", f"{engine_fixture.CELL_PREFIX}:ttl:due", k)) for k in keys]
            # The second request's uses, loads and saves alike, all count from its lookup: each
            # chunk due a microsecond of the cell's clock before the one it leads to.
            for c in range(5):
                chunk = due[c * g.parts():(c + 1) * g.parts()]
                self.assertEqual(len(set(chunk)), 1, f"chunk {c}'s objects are due at once")
                if c:
                    self.assertAlmostEqual(due[(c - 1) * g.parts()] - chunk[0], 1e-6, delta=2e-7,
                                           msg=f"chunk {c} is not due just before chunk {c - 1}: {due}")
        finally:
            out = subprocess.run(kvstash_cli + ["policy", "lru", "--yes"], capture_output=True, text=True)
            self.assertEqual(out.returncode, 0, out.stderr)

    def test_a_load_error_becomes_recomputed_blocks(self):
        shared = [21 + (i * 17) % 900 for i in range(3 * BLOCK)]
        a = Engine()
        a.scheduler.add_request(a.request("a", shared + [5]))
        a.step()
        b = Engine()
        b.scheduler.add_request(b.request("b", shared + [6]))
        out = b.step(fail_loads=True)
        self.assertEqual(len(out.kv_connector_metadata.loads), 1)
        req = b.scheduler.requests["b"]
        self.assertLess(req.num_computed_tokens, 3 * BLOCK, "the failed blocks are computed again, not trusted")
        b.step()
        w, caches, _ = b.workers[0]
        blocks = b.scheduler.kv_cache_manager.get_block_ids("b")[0]
        for layer, name in enumerate(LAYERS):
            for i in range(3):
                self.assertTrue(torch.equal(caches[name][blocks[i]], expected_block(shared, i, layer, 0)))
        # vLLM's default policy, "fail": the request ends with an error instead.
        c = Engine(policy="fail")
        c.scheduler.add_request(c.request("c", shared + [7]))
        out = c.step(fail_loads=True)
        self.assertEqual(len(out.kv_connector_metadata.loads), 1)
        self.assertNotIn("c", c.scheduler.requests, "the request failed and was removed")

    def test_chunks_the_cell_holds_are_not_put_again(self):
        prompt = [41 + (i * 23) % 900 for i in range(5 * BLOCK)] + [1, 2, 3]
        a = Engine()
        a.run("a1", prompt)
        self.assertEqual(a.saved(), 5)
        # The same prompt again: vLLM's own prefix cache holds its blocks, so no lookup asks the
        # cell; the chunks are there already and are not put again.
        a.run("a2", prompt)
        self.assertEqual(a.saved(), 5, "a chunk the cell holds was put again")
        # Another engine loads them and puts none.
        b = Engine()
        b.run("b1", prompt)
        self.assertEqual(b.workers[0][0]._stats["chunks_loaded"], 5)
        self.assertEqual(b.saved(), 0, "a loaded chunk was put again")
        # Decode that fills a chunk the cell already holds (the same greedy answer again).
        c = Engine()
        long_answer = [51 + (i * 29) % 900 for i in range(2 * BLOCK)]
        c.run("c1", long_answer, max_tokens=BLOCK + 2)
        first = c.saved()
        c.run("c2", long_answer, max_tokens=BLOCK + 2)
        self.assertEqual(c.saved(), first, "a decode chunk was put twice")

    def test_chunks_recomputed_after_a_failed_load_are_saved_again(self):
        shared = [61 + (i * 31) % 900 for i in range(3 * BLOCK)]
        a = Engine()
        a.run("a", shared + [5])
        self.assertEqual(a.saved(), 3)
        b = Engine()
        b.scheduler.add_request(b.request("b", shared + [6]))
        out = b.step(fail_loads=True)
        self.assertEqual(len(out.kv_connector_metadata.loads), 1)
        for _ in range(16):
            if b.scheduler.get_num_unfinished_requests() == 0:
                break
            b.step()
        self.assertEqual(b.saved(), 3, "the chunks computed again after the failed load were not saved")

    def test_a_corrupt_chunk_leaves_the_cell_and_is_saved_anew(self):
        shared = [71 + (i * 37) % 900 for i in range(3 * BLOCK)]
        a = Engine()
        a.run("a", shared + [5])
        self.assertEqual(a.saved(), 3)
        g = a.connector.geometry
        keys = g.keys(shared)
        engine_fixture.corrupt_layer_sum(URL, keys[1])
        b = Engine()
        b.run("b", shared + [6])
        w = b.workers[0][0]
        self.assertEqual(w._stats["chunks_corrupt_removed"], 1)
        self.assertGreaterEqual(b.saved(), 2, "the chunks after the corrupt one were computed and saved again")
        # A third engine finds every chunk whole again.
        c = Engine()
        c.run("c", shared + [7])
        self.assertEqual(c.workers[0][0]._stats["chunks_loaded"], 3)
        self.assertEqual(c.workers[0][0]._stats["chunks_load_failed"], 0)

    def prefill_for_decode(self, p, rid, prompt):
        """A prefill's request for a decode (kv_transfer_params do_remote_decode), run until it
        finished: the params its output carried."""
        req = p.request(rid, prompt, max_tokens=1)
        req.kv_transfer_params = {"do_remote_decode": True}
        p.scheduler.add_request(req)
        p.step_until(lambda: rid in p.params)
        p.step()  # vLLM steps on while blocks are held: the workers hold them (and grant them) now
        return p.params[rid]

    def test_direct_pd_the_decode_reads_the_prefills_blocks_which_the_prefill_then_frees(self):
        extra = {"pd": "direct", "handoff_ttl_ms": 5000}
        p, d = Engine(extra=extra, role="kv_producer"), Engine(extra=extra, role="kv_consumer")
        prompt = [5 + (i * 17) % 900 for i in range(5 * BLOCK + 3)]  # 6 blocks, the last partial
        free = p.free_blocks()
        params = self.prefill_for_decode(p, "pd", prompt)
        self.assertTrue(params.get("do_remote_prefill") and params.get("kvstash_handoff"), params)
        self.assertEqual(p.free_blocks(), free - 6, "the prefill holds the request's 6 blocks")
        self.assertEqual(p.workers[0][0]._stats["chunks_saved"], 0, "a direct prefill puts nothing in the cell")

        req = d.request("pd", prompt, max_tokens=2)
        req.kv_transfer_params = params
        d.scheduler.add_request(req)
        d.step_until(lambda: len(d.scheduler.requests["pd"].output_token_ids) >= 1)  # read, then its first token
        blocks = d.scheduler.kv_cache_manager.get_block_ids("pd")[0]
        _, caches, _ = d.workers[0]
        for layer, name in enumerate(LAYERS):
            for i in range(5):
                self.assertTrue(torch.equal(caches[name][blocks[i]], expected_block(prompt, i, layer, 0)),
                                f"layer {layer} block {i}")
            last = caches[name][blocks[5]][:, :3, :]  # the partial block: its 3 tokens
            self.assertTrue(torch.equal(last, expected_block(prompt + [0] * 13, 5, layer, 0)[:, :3, :]))
        self.assertEqual(d.workers[0][0]._import.stats, {"blocks_read": 6, "reads_failed": 0})
        p.step_until(lambda: p.free_blocks() == free)  # the decode ended the handoff: freed well before the ttl
        self.assertEqual(p.workers[0][0]._export.stats["handoffs_read"], 1)

    def test_direct_pd_between_tensor_parallel_degrees_reads_each_rank_its_heads(self):
        """A prefill at TP=2 (a head per rank) read by a decode at TP=1 (both heads), and the
        reverse: each decode rank reads its heads from the prefill ranks that hold them, and
        every prefill rank frees once the readers of its heads ended, well before the ttl."""
        extra = {"pd": "direct", "handoff_ttl_ms": 5000}
        for prefill_tp, decode_tp in ((2, 1), (1, 2)):
            p = Engine(tp_size=prefill_tp, heads=2 // prefill_tp, extra=extra, role="kv_producer")
            d = Engine(tp_size=decode_tp, heads=2 // decode_tp, extra=extra, role="kv_consumer")
            rid = f"pd{prefill_tp}{decode_tp}"
            prompt = [9 + (i * 23) % 900 for i in range(3 * BLOCK + 5)]  # 4 blocks, the last partial
            free = p.free_blocks()
            params = self.prefill_for_decode(p, rid, prompt)
            req = d.request(rid, prompt, max_tokens=2)
            req.kv_transfer_params = params
            d.scheduler.add_request(req)
            d.step_until(lambda: len(d.scheduler.requests[rid].output_token_ids) >= 1)
            blocks = d.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            for w, caches, rank in d.workers:
                self.assertEqual(w._import.stats, {"blocks_read": 4, "reads_failed": 0}, (prefill_tp, rank))
                for layer, name in enumerate(LAYERS):
                    for i in range(3):
                        self.assertTrue(torch.equal(caches[name][blocks[i]],
                                                    expected_block(prompt, i, layer, rank, d.heads)),
                                        f"TP={prefill_tp} to TP={decode_tp}: rank {rank} layer {layer} block {i}")
            p.step_until(lambda: p.free_blocks() == free, seconds=3)  # freed by the reads, not the 5 s ttl
            for w, _, rank in p.workers:
                self.assertEqual(w._export.stats["handoffs_read"], 1, f"prefill rank {rank}")

    def test_direct_pd_a_closed_path_frees_the_prefill_at_once_and_the_decode_computes(self):
        # shm alone cannot serve torch's (not fd-backed) memory: the export does not open.
        p = Engine(extra={"pd": "direct", "transports": "shm"}, role="kv_producer")
        d = Engine(extra={"pd": "direct"}, role="kv_consumer")
        self.assertIsNone(p.workers[0][0]._export)
        prompt = [7 + (i * 19) % 900 for i in range(3 * BLOCK)]
        free = p.free_blocks()
        params = self.prefill_for_decode(p, "closed", prompt)
        p.step_until(lambda: p.free_blocks() == free, seconds=2)  # not held until the ttl
        req = d.request("closed", prompt, max_tokens=2)
        req.kv_transfer_params = params
        d.scheduler.add_request(req)
        d.step_until(lambda: d.scheduler.get_num_unfinished_requests() == 0)
        self.assertEqual(d.workers[0][0]._import.stats["reads_failed"], 1, "the read failed (no export record)")

    def test_sleep_mode_drops_the_registrations_and_wake_up_restores_them(self):
        from vllm.config import KVTransferConfig as K

        self.assertTrue(KVConnectorFactory.get_connector_class(K(kv_connector="KvstashConnector",
                                                                 kv_connector_module_path="kvstash.vllm",
                                                                 kv_role="kv_both")).supports_sleep_mode(None))
        shared = [81 + (i * 43) % 900 for i in range(2 * BLOCK)]
        a = Engine()
        a.run("a", shared + [1])
        b = Engine()
        w, caches, _ = b.workers[0]
        w.unregister_kv_caches()
        self.assertEqual(len(w._caches), 0, "a registration outlived sleep")
        w.unregister_kv_caches()  # idempotent
        w.restore_kv_caches()
        w.restore_kv_caches()
        self.assertEqual(len(w._caches), 1)
        b.scheduler.add_request(b.request("b", shared + [2]))
        first = b.step()
        load = first.kv_connector_metadata.loads[0]
        self.assertEqual(w._stats["chunks_loaded"], 2)
        for layer, name in enumerate(LAYERS):
            for i in range(2):
                self.assertTrue(torch.equal(caches[name][load.block_ids[0][i]], expected_block(shared, i, layer, 0)))

    def test_an_untested_vllm_release_is_refused_by_name(self):
        from kvstash.vllm import TESTED_VLLM, check_vllm_version

        for tested in TESTED_VLLM:
            check_vllm_version(tested + ".0", False)
        check_vllm_version("0.32.0+cpu", False)
        with self.assertRaises(RuntimeError) as e:
            check_vllm_version("0.99.1", False)
        self.assertIn("0.99.1", str(e.exception))
        self.assertIn("allow_untested_vllm", str(e.exception))
        check_vllm_version("0.99.1", True)

    def test_a_preempted_request_resumes_and_loads_again(self):
        shared = [31 + (i * 19) % 900 for i in range(4 * BLOCK)]
        a = Engine()
        a.scheduler.add_request(a.request("a", shared + [1], max_tokens=8))
        a.step()
        self.assertGreaterEqual(a.workers[0][0]._stats["chunks_saved"], 4)
        # Preempt it as vLLM does when blocks run out, then let it run again.
        req = a.scheduler.requests["a"]
        a.scheduler.running.remove(req)
        a.scheduler._preempt_request(req, 0.0)
        # vLLM's own prefix cache would serve the freed blocks: empty it, so the chunks come back
        # from kvstash (a preemption under memory pressure loses them the same way).
        self.assertTrue(a.scheduler.kv_cache_manager.reset_prefix_cache())
        for name in LAYERS:
            a.workers[0][1][name].zero_()  # the freed blocks served other requests meanwhile
        resumed = None
        for _ in range(4):
            out = a.step()
            if out.kv_connector_metadata.loads:
                resumed = out
                break
        self.assertIsNotNone(resumed, "the resumed request loads its stored chunks")
        w, caches, _ = a.workers[0]
        blocks = a.scheduler.kv_cache_manager.get_block_ids("a")[0]
        for layer, name in enumerate(LAYERS):
            for i in range(4):
                self.assertTrue(torch.equal(caches[name][blocks[i]], expected_block(shared, i, layer, 0)))

    def test_two_tensor_parallel_ranks_store_their_heads_and_a_lookup_needs_both(self):
        shared = [41 + (i * 23) % 900 for i in range(2 * BLOCK)]
        a = Engine(tp_size=2)
        a.scheduler.add_request(a.request("a", shared + [1]))
        a.step()
        for w, _, rank in a.workers:
            self.assertEqual(w._stats["chunks_saved"], 2, f"rank {rank}")
        g = a.connector.geometry
        store = kvstash.Store(URL, transports="shm,tcp")
        k0, k1 = g.keys(shared, 0), g.keys(shared, g.parts() - 1)  # rank 0's first heads, rank 1's last
        self.assertNotEqual(k0, k1)
        self.assertEqual(store.contains_prefix(k0), 2)
        store.remove(k1[1])  # rank 1's second chunk goes: only one chunk is whole on every rank
        b = Engine(tp_size=2)
        b.scheduler.add_request(b.request("b", shared + [2]))
        out = b.step()
        self.assertEqual([(r.first, r.count) for r in out.kv_connector_metadata.loads], [(0, 1)])
        for w, caches, rank in b.workers:
            blocks = out.kv_connector_metadata.loads[0].block_ids[0]
            for layer, name in enumerate(LAYERS):
                self.assertTrue(torch.equal(caches[name][blocks[0]], expected_block(shared, 0, layer, rank)))

    def test_tensor_parallel_degrees_read_each_others_chunks_through_the_cell(self):
        shared = [47 + (i * 31) % 900 for i in range(2 * BLOCK)]
        a = Engine(tp_size=2, heads=1)  # a model of 2 KV heads: one a rank
        a.run("a", shared + [1])
        self.assertEqual(a.saved(), 4, "2 chunks, a head per rank")
        b = Engine(tp_size=1, heads=2)  # the same model at TP=1
        b.scheduler.add_request(b.request("b", shared + [2]))
        out = b.step()
        self.assertEqual([(r.first, r.count) for r in out.kv_connector_metadata.loads], [(0, 2)])
        blocks = out.kv_connector_metadata.loads[0].block_ids[0]
        _, caches, _ = b.workers[0]
        for layer, name in enumerate(LAYERS):
            for i in range(2):
                self.assertTrue(torch.equal(caches[name][blocks[i]], expected_block(shared, i, layer, 0, heads=2)),
                                f"layer {layer} block {i}: the heads TP=2's ranks saved, in their places")

    def test_pipeline_stages_store_their_own_layers_and_a_lookup_needs_every_stage(self):
        shared = [43 + (i * 29) % 900 for i in range(2 * BLOCK)]
        a = Engine(pp_size=2)
        a.scheduler.add_request(a.request("a", shared + [1]))
        a.step()
        for w, caches, _ in a.workers:
            self.assertEqual(w._stats["chunks_saved"], 2, f"stage of {list(caches)}")
        g = a.connector.geometry
        self.assertEqual(g.stages, ((0, 1), (1, 1)))
        store = kvstash.Store(URL, transports="shm,tcp")
        per_stage = g.head_groups()
        first, second = g.keys(shared, 0), g.keys(shared, per_stage)  # stage 0's and stage 1's first heads
        self.assertTrue(first[0].endswith(":l0+1/2:h0+1/2") and second[0].endswith(":l1+1/2:h0+1/2"), first[0])
        self.assertEqual(store.contains_prefix(g.all_keys(shared)) // g.parts(), 2)
        self.assertEqual(Engine().connector._found_chunks(shared + [2], 2, ("", []))[0], 0,
                         "one stage's objects are not a whole model's")
        store.remove(second[1])  # stage 1's second chunk goes: only the first is whole
        b = Engine(pp_size=2)
        b.scheduler.add_request(b.request("b", shared + [2]))
        out = b.step()
        self.assertEqual([(r.first, r.count) for r in out.kv_connector_metadata.loads], [(0, 1)])
        blocks = out.kv_connector_metadata.loads[0].block_ids[0]
        for w, caches, rank in b.workers:
            for name, cache in caches.items():
                self.assertTrue(torch.equal(cache[blocks[0]], expected_block(shared, 0, LAYERS.index(name), rank)),
                                f"{name} loaded another stage's layer")

    def test_a_hybrid_models_window_group_stores_and_loads_only_the_chunks_its_window_reads(self):
        """vLLM's hybrid allocator (SupportsHMA): a sliding window's group and full attention's, in
        one paged tensor. A chunk the window no longer reads (vLLM's null block in that group) is
        not stored; a lookup needs every full-attention chunk and the window's last ones only; a
        load fills exactly the blocks vLLM gives each group, bit for bit, while the request waits
        (vLLM takes a hybrid model's load failures per request, not per block)."""
        a = Engine(hybrid=True)
        g = a.connector.geometry
        self.assertEqual([group.window for group in g.groups], [WINDOW, 0])
        self.assertTrue(g.groups[0].name.startswith(f"swa{WINDOW}.") and g.groups[1].name.startswith("full."))
        self.assertIsInstance(a.connector, SupportsHMA)
        store = kvstash.Store(URL, transports="shm,tcp")
        head = [53 + (i * 41) % 900 for i in range(4 * BLOCK)]
        a.run("p1", head + [1, 2, 3])
        # The cell loses the first request's chunks; the engine's own prefix cache keeps them, and
        # its window's group holds only the last two of them (the first two are null blocks).
        for key in g.all_keys(head):
            store.remove(key)
        longer = head + [61 + (i * 43) % 900 for i in range(2 * BLOCK)]
        a.run("p2", longer + [4, 5, 6])
        per, objects = g.parts(), g.head_groups()
        present = store.contains_each(g.all_keys(longer))

        def stored(c, group):
            return all(present[c * per + group * objects:c * per + (group + 1) * objects])

        self.assertEqual([stored(c, 1) for c in range(6)], [True] * 6, "full attention: every chunk")
        self.assertEqual([stored(c, 0) for c in range(6)], [False, False, True, True, True, True],
                         "the window: only the chunks whose blocks it still held")

        def load(engine, rid, tokens):
            """The request's load (the step it runs in: the request waits), and its first step."""
            engine.scheduler.add_request(engine.request(rid, tokens))
            fetches = engine.step().kv_connector_metadata.fetches
            self.assertEqual(len(fetches), 1)
            return fetches[0], engine.step()

        b = Engine(hybrid=True)
        run, first = load(b, "q", longer + [9])
        self.assertEqual((run.first, run.count), (0, 6), "the window's last two chunks and every full one suffice")
        self.assertEqual(first.num_scheduled_tokens["q"], 1, "only the token after the loaded prefix is computed")
        window_blocks, full_blocks = run.block_ids
        self.assertEqual(window_blocks[:4], [0] * 4, "vLLM nulls the window's blocks it no longer reads")
        cache = b.workers[0][1][LAYERS[0]]  # both layers' tensor
        for i in range(6):
            self.assertTrue(torch.equal(cache[full_blocks[i]], expected_block(longer, i, 1, 0)), f"full block {i}")
        for i in (4, 5):
            self.assertTrue(torch.equal(cache[window_blocks[i]], expected_block(longer, i, 0, 0)), f"window block {i}")
        self.assertEqual(b.workers[0][0]._stats["chunks_loaded"], 6)

        # Without the window's last chunk a hit of 6 chunks lacks its window; one of 5 reads
        # chunks 3 and 4 of it, and is what loads, into the two blocks vLLM gives the window.
        store.remove(g.keys(longer, 0)[5])
        c = Engine(hybrid=True)
        run, first = load(c, "r", longer + [8])
        self.assertEqual((run.first, run.count), (0, 5))
        self.assertEqual(first.num_scheduled_tokens["r"], BLOCK + 1)
        window_blocks = run.block_ids[0]
        self.assertEqual([b != 0 for b in window_blocks[:5]], [False, False, False, True, True])
        cache = c.workers[0][1][LAYERS[0]]
        for i in (3, 4):
            self.assertTrue(torch.equal(cache[window_blocks[i]], expected_block(longer, i, 0, 0)), f"window block {i}")

    def test_a_hybrid_lookup_is_the_longest_hit_every_group_can_serve(self):
        """Geometry.hit (prefix sums, linear in the chunks) against the rule itself, checked chunk
        by chunk: full attention every chunk, each window the chunks holding its W - 1 tokens
        before the hit's end, none before `first`; on random presence."""
        import dataclasses
        import random

        from kvstash.vllm import Group

        g = Engine(hybrid=True).connector.geometry
        g = dataclasses.replace(g, groups=(Group(("w",), 5 * BLOCK + 3, "w"), Group(("f",), 0, "f")))
        per, objects = g.parts(), g.head_groups()

        def rule(present, first, limit):
            def has(c, group):
                return all(present[c * per + group * objects:(c + 1) * per][:objects])
            end = 0
            while end < limit and has(end, 1):
                end += 1
            for n in range(end, 0, -1):
                if all(has(c, 0) for c in range(max(first, g.groups[0].first_needed(n, g.chunk_tokens)), n)):
                    return n
            return 0

        rng = random.Random(7)
        for _ in range(300):
            chunks = rng.randint(0, 14)
            present = [rng.random() < 0.85 for _ in range(chunks * per)]
            first, limit = rng.randint(0, chunks), rng.randint(0, chunks)
            self.assertEqual(g.hit(present, first, limit), rule(present, first, limit), (present, first, limit))

    def test_a_mamba_hybrid_stores_the_state_a_step_ended_on_and_loads_it_at_the_hits_end(self):
        """A Mamba group (vLLM's mamba_cache_mode "align") beside full attention: a chunk's state
        is stored when a step ends on its last token (its block holds it then), a hit needs the
        state at its end, and the load puts it in the block vLLM gives it, bit for bit."""
        a = Engine(mamba=True)
        g = a.connector.geometry
        self.assertEqual([(group.state, group.name.split(".")[0]) for group in g.groups], [(True, "state"),
                                                                                           (False, "full")])
        prompt = [71 + (i * 31) % 900 for i in range(3 * BLOCK + 5)]
        a.run("a", prompt)  # its first step computes 3 blocks and ends on chunk 2's last token
        store = kvstash.Store(URL, transports="shm,tcp")
        states, full = g.group_keys(prompt, 0), g.group_keys(prompt, 1)
        self.assertEqual(store.contains_each(states), [False, False, True], "the state the step ended on only")
        self.assertEqual(store.contains_each(full), [True] * (3 * g.head_groups()))

        b = Engine(mamba=True)
        b.scheduler.add_request(b.request("b", prompt[:3 * BLOCK] + [9, 9]))
        fetches = b.step().kv_connector_metadata.fetches
        self.assertEqual([(r.first, r.count) for r in fetches], [(0, 3)])
        state_blocks, full_blocks = fetches[0].block_ids
        self.assertEqual(state_blocks[:2], [0, 0], "vLLM keeps only the state at the hit's end")
        _, caches, _ = b.workers[0]
        page = caches[LAYERS[0]][state_blocks[2] * b.page:(state_blocks[2] + 1) * b.page]
        self.assertTrue(torch.equal(page, state_page(prompt[:3 * BLOCK])), "the state after 3 chunks")
        for i in range(3):
            self.assertTrue(torch.equal(caches[LAYERS[1]][full_blocks[i]], expected_block(prompt, i, 1, 0)))
        self.assertEqual(b.step().num_scheduled_tokens["b"], 2, "computed from the loaded state on")

        # Without the state at its end no hit serves: the states before it were never stored.
        store.remove(states[2])
        c = Engine(mamba=True)
        c.scheduler.add_request(c.request("c", prompt[:3 * BLOCK] + [8]))
        out = c.step()
        self.assertEqual(out.kv_connector_metadata.fetches, [])
        self.assertEqual(out.num_scheduled_tokens["c"], 3 * BLOCK, "computed")

    def test_a_mamba_hybrids_state_is_each_ranks_shard_and_no_other_degree_reads_it(self):
        prompt = [83 + (i * 29) % 900 for i in range(2 * BLOCK + 3)]
        a = Engine(mamba=True, tp_size=2)
        a.run("a", prompt)
        g = a.connector.geometry
        states = g.group_keys(prompt, 0)
        self.assertTrue(states[2].endswith(":h0+1/2") and states[3].endswith(":h1+1/2"), states[2])
        store = kvstash.Store(URL, transports="shm,tcp")
        self.assertEqual(store.contains_each(states), [False, False, True, True], "each rank's shard of chunk 1")
        b = Engine(mamba=True, tp_size=2)
        b.scheduler.add_request(b.request("b", prompt[:2 * BLOCK] + [5]))
        fetch = b.step().kv_connector_metadata.fetches[0]
        block = fetch.block_ids[0][1]
        for _, caches, rank in b.workers:
            self.assertTrue(torch.equal(caches[LAYERS[0]][block * b.page:(block + 1) * b.page],
                                        state_page(prompt[:2 * BLOCK], rank)), f"rank {rank}'s shard")
        # A TP=1 engine holds the whole state: the shards are not its object, it computes.
        c = Engine(mamba=True, heads=2 * HEADS)
        c.scheduler.add_request(c.request("c", prompt[:2 * BLOCK] + [5]))
        self.assertEqual(c.step().kv_connector_metadata.fetches, [])

    def test_a_hybrid_models_failed_load_is_its_requests_and_vllm_computes_it_whole(self):
        shared = [67 + (i * 47) % 900 for i in range(3 * BLOCK)]
        a = Engine(hybrid=True)
        a.run("a", shared + [1])
        b = Engine(hybrid=True)
        b.scheduler.add_request(b.request("b", shared + [2]))
        out = b.step(fail_loads=True)  # every chunk misses: vLLM must not be handed blocks
        self.assertEqual(len(out.kv_connector_metadata.fetches), 1)
        self.assertEqual(b.workers[0][0]._stats["chunks_load_failed"], 3)
        out = b.step()
        self.assertEqual(out.num_scheduled_tokens["b"], 3 * BLOCK + 1, "computed from its first token")
        b.step_until(lambda: b.scheduler.get_num_unfinished_requests() == 0)

if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)

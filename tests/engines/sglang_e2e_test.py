"""kvstash.sglang inside a real forward pass: SGLang on the CPU (the sglang venv of
scripts/engines-setup), a small random-weight Llama made here (no download), HiCache with
kvstash.sglang as its storage tier (the "dynamic" backend, as a deployment configures it), and
a private cell.

PyPI's SGLang is built for CUDA. On a CPU-only host it runs here with the test-only shims of
tests/engines/sglang_cpu, each saying what it replaces: a stand-in for sgl_kernel (its compiled ops do
not load without libcuda.so.1; the CPU path calls none of them), and two patches to HiCache's
device-host copies (no pinned memory; the direct page copy in torch). The model's forward pass,
the scheduler, the radix tree, HiCache's backup to and prefetch from storage, and
kvstash.sglang run as shipped.

Each engine runs in a process of its own (this file with --engine), as a deployment's engines
do; the four start at once, so that their starts (mostly imports) overlap: about 2 minutes in
all and 11 GB of memory at the peak on 2 cores. The test checks:
- an engine without kvstash gives the reference greedy tokens of a 400-token prompt;
- an engine with kvstash stores the prompt's 25 pages of 16 tokens, one object each in the
  cell, and answers the same;
- a fresh engine gets 24 of them back from the cell (SGLang's cached_tokens: 384, all from
  storage; the last page is computed, as SGLang always computes a prompt's last token),
  answers the same, and puts none of them again;
- an engine with other weights under the same served model name finds none of the first
  model's pages (the model is named by its weights' content) and answers as it does alone;
- negative control: the same engine, its operator vouching (weights_id) that its weights are
  the first model's, loads them and answers otherwise than with its own: the loaded bytes are
  the ones used, and only the content naming kept them out.

Usage (meson test `sglang_e2e`): PYTHON tests/engines/sglang_e2e_test.py BUILD_DIR
Exit 77 (skipped) when SGLang cannot be imported.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import engine_fixture

BUILD = engine_fixture.build_dir()

from kvstash import _identity  # noqa: E402  (from BUILD)
from vllm_engine import VOCAB, make_model  # noqa: E402

SHIMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_cpu")
PAGE = 16  # tokens per HiCache page: one kvstash object
MAX_TOKENS = 8
MODEL_NAME = "tiny-llama"  # served_model_name: the same for every engine, whatever its weights
ENGINE_SECONDS = 300  # one command, the engine's start included (four starting at once: about 100 s here)
PAGE_RECORDS = engine_fixture.CELL_PREFIX + ":obj:sgl:"  # the cell's records of SGLang pages


class Engine(engine_fixture.EngineProcess):
    """One SGLang engine in a process of its own (this file with --engine SPEC), driven over its
    stdin and stdout by JSON lines: {"prompt": [ids]} answers RESULT {"tokens", "cached",
    "storage"} (cached: SGLang's cached_tokens; storage: those of them from the storage tier);
    {"flush": 1} answers FLUSHED; the end of its stdin shuts it down. With `url`, kvstash.sglang
    is its HiCache storage, with `extra` in its extra config."""

    def __init__(self, model, url=None, extra=None):
        # A temporary folder of its own: SGLang names its sockets there and leaves them behind.
        self.tmp = tempfile.mkdtemp(prefix="kvstash-sglang-engine-")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([SHIMS, os.path.join(BUILD, "src", "python")]),
                   SGLANG_USE_CPU_ENGINE="1", TMPDIR=self.tmp)
        self.err = tempfile.TemporaryFile("w+")
        # Its own process group: SGLang's scheduler and detokenizer processes go with it.
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), BUILD, "--engine",
                                   json.dumps({"model": model, "url": url, "extra": extra or {}})],
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                  start_new_session=True)

    def ask(self, command, answer="RESULT", seconds=ENGINE_SECONDS):
        return super().ask(command, answer, seconds)

    def generate(self, prompt):
        return self.ask({"prompt": prompt})

    def flush(self):
        """Drops the engine's device and host caches (SGLang's flush_cache); the cell keeps its pages."""
        self.ask({"flush": 1}, "FLUSHED")

    def stop(self, seconds=30):
        """Shuts the engine down (SGLang's shutdown), then kills its process group, so that
        nothing SGLang started outlives it, also when the engine did not exit within `seconds`.
        Once."""
        if self.p.stdin.closed:
            return
        with contextlib.suppress(BrokenPipeError):
            self.p.stdin.close()
        try:
            self.p.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(timeout=30)
        self.p.stdout.close()
        self.err.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def engine_main(spec):
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what SGLang prints goes to the log, not between the answers
    import sglang

    kwargs = {}
    if spec["url"]:
        kwargs = dict(
            served_model_name=MODEL_NAME, page_size=PAGE, enable_hierarchical_cache=True,
            hicache_io_backend="direct", hicache_mem_layout="layer_first", hicache_write_policy="write_through",
            # Every stored page is waited for, so that the counts are the same on every run.
            hicache_storage_prefetch_policy="wait_complete",
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps({
                "backend_name": "kvstash", "module_path": "kvstash.sglang", "class_name": "KvstashHiCacheStorage",
                "interface_v1": 1, "redis_url": spec["url"], "transports": "shm,tcp", **spec.get("extra", {})}))
    engine = sglang.Engine(model_path=spec["model"], device="cpu", dtype="float32", attention_backend="torch_native",
                           disable_cuda_graph=True, max_total_tokens=2048, skip_server_warmup=True, random_seed=0,
                           sleep_on_idle=True,  # the engines waiting for their turn leave the CPU to the others
                           log_level="info", **kwargs)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("flush"):
            if not engine.flush_cache().success:
                raise RuntimeError("flush_cache failed")
            print("FLUSHED", file=answers, flush=True)
            continue
        out = engine.generate(input_ids=command["prompt"], sampling_params={
            "max_new_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True})
        meta = out["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        print("RESULT " + json.dumps({"tokens": out["output_ids"], "cached": meta["cached_tokens"],
                                      "storage": details.get("storage", 0)}), file=answers, flush=True)
    engine.shutdown()
    # SGLang's shutdown kills its processes (SIGKILL): the load snapshot they shared stays behind.
    from sglang.srt.managers.load_snapshot import shm_path_for

    with contextlib.suppress(OSError):
        os.unlink(shm_path_for(engine.port_args.instance_id))
    sys.exit(0)


def page_records(url):
    """The cell's records of SGLang pages: key -> the put that wrote it (its token)."""
    cli = ["redis-cli", "-u", url]
    keys = subprocess.run(cli + ["--scan", "--pattern", PAGE_RECORDS + "*"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.split()
    tokens = subprocess.run(cli, input="".join(f"HGET {k} token\n" for k in keys), capture_output=True, text=True,
                            check=True, timeout=30).stdout.split() if keys else []
    return dict(zip(keys, tokens))


def new_pages(url, known, count, seconds=60):
    """The page records not in `known` once there are `count` of them (HiCache backs pages up
    after the answer), and 2 s more for any put beyond those; what there is at the deadline."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        new = {k: v for k, v in page_records(url).items() if known.get(k) != v}
        if len(new) >= count:
            break
        time.sleep(0.5)
    time.sleep(2)
    return {k: v for k, v in page_records(url).items() if known.get(k) != v}


class SglangForwardPass(unittest.TestCase):
    PROMPT = [(i * 37 + 11) % (VOCAB - 2) for i in range(400)]  # 25 pages
    OTHER = [(i * 41 + 3) % (VOCAB - 2) for i in range(320)]  # 20 pages
    # Both are longer than HiCache's prefetch threshold (256 tokens): shorter prompts do not
    # look in storage at all.

    @classmethod
    def setUpClass(cls):
        # Class cleanups run even when setUpClass fails half way.
        cls.cell = engine_fixture.Cell(BUILD)
        cls.addClassCleanup(cls.cell.stop)
        cls.models = tempfile.mkdtemp(prefix="kvstash-sglang-e2e-")
        cls.addClassCleanup(shutil.rmtree, cls.models, ignore_errors=True)
        model, other_weights = os.path.join(cls.models, "model"), os.path.join(cls.models, "other-weights")
        cls.model, cls.other_weights = model, other_weights
        # Seed 0's greedy answers repeat one token; seed 1's change from token to token.
        make_model(model, seed=1)
        make_model(other_weights, seed=2)
        # SGLang builds its page-hash extension on an engine's first request, under a lock in
        # the torch extensions cache: built here first, no engine's first request waits on a
        # build (or on a lock another suite's engine left when it was stopped mid-build).
        subprocess.run([sys.executable, "-c", "from sglang.srt.mem_cache.cpp_utils.native_hash import "
                        "_load_native_hash_module as load; load()"], check=False, timeout=600,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Every engine starts now (one alone takes about 40 s here, most of it imports); each is a
        # process of its own that sees no prompt before its turn.
        url = cls.cell.url
        cls.engines = {}
        for name, weights, cell in (("plain", model, None), ("storer", model, url), ("loader", model, url),
                                    ("other_weights", other_weights, url)):
            cls.engines[name] = Engine(weights, cell)
            cls.addClassCleanup(cls.engines[name].stop)
        # What an engine without kvstash (nor HiCache) answers: the reference.
        plain = cls.engines["plain"]
        cls.plain = {"prompt": plain.generate(cls.PROMPT)["tokens"], "other": plain.generate(cls.OTHER)["tokens"]}
        plain.stop()
        # The negative control's engine: other weights, vouched for as the first model's
        # (weights_id). It starts in the plain engine's place.
        cls.engines["vouched"] = Engine(other_weights, url, {"weights_id": _identity.weights_name(model)})
        cls.addClassCleanup(cls.engines["vouched"].stop)
        # An engine with kvstash stores both prompts' pages: what the tests below find in the cell.
        storer = cls.engines["storer"]
        cls.stored = {}
        known = page_records(url)
        for name, prompt in (("prompt", cls.PROMPT), ("other", cls.OTHER)):
            answer = storer.generate(prompt)
            pages = new_pages(url, known, len(prompt) // PAGE)
            cls.stored[name] = {"answer": answer, "records": pages}
            known.update(pages)
        storer.stop()

    def test_an_engine_with_kvstash_stores_one_object_per_page_and_answers_the_same(self):
        for name, prompt in (("prompt", self.PROMPT), ("other", self.OTHER)):
            with self.subTest(name):
                stored = self.stored[name]
                self.assertEqual(stored["answer"]["tokens"], self.plain[name], "kvstash changed the answer")
                self.assertEqual((stored["answer"]["cached"], stored["answer"]["storage"]), (0, 0))
                self.assertEqual(len(stored["records"]), len(prompt) // PAGE, "one object per page of 16 tokens")

    def test_a_fresh_engine_gets_the_pages_from_the_cell_and_answers_the_same(self):
        before = page_records(self.cell.url)
        loader = self.engines["loader"]
        got = loader.generate(self.PROMPT)
        self.assertEqual(got["tokens"], self.plain["prompt"], "tokens from loaded pages differ")
        self.assertEqual((got["cached"], got["storage"]), (384, 384),
                         f"24 pages from storage, the last one computed:\n{loader.log()[-3000:]}")
        self.assertEqual(new_pages(self.cell.url, before, 0), {}, "the engine that got the pages put pages again")

    def test_other_weights_under_the_same_name_share_no_page(self):
        # The negative control first: the same weights, vouched for as the first model's, load
        # its pages (and store none: they are there).
        vouched = self.engines["vouched"]
        theirs = vouched.generate(self.OTHER)
        self.assertEqual(theirs["storage"], 304, f"19 of the first model's pages loaded:\n{vouched.log()[-3000:]}")
        own = self.engines["other_weights"].generate(self.OTHER)
        self.assertEqual(own["storage"], 0, "other weights under the same name loaded the first model's pages")
        self.assertNotEqual(theirs["tokens"], own["tokens"],
                            "the first model's pages made no difference: were they used?")


if __name__ == "__main__":
    if "--engine" in sys.argv:
        engine_main(json.loads(sys.argv[sys.argv.index("--engine") + 1]))
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        engine_fixture.run_in_venv_or_skip("sglang", "SGLang", e, __file__)
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)

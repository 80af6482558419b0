"""What the tests of the engine integrations (vllm_test.py, sglang_test.py) share: running in
the venv scripts/engines-setup made for their engine, the built kvstash package on the path,
and a private cell (scripts/cluster) for the module's tests.

    BUILD = engine_fixture.build_dir()
    try:
        import vllm
    except ImportError as e:
        engine_fixture.run_in_venv_or_skip("vllm", "vLLM", e, __file__)
"""

import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_dir():
    """The build tree (argv[1], default "build"), its Python package put first on the path."""
    build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build")
    sys.path.insert(0, os.path.join(build, "src", "python"))
    return build


def run_in_venv_or_skip(engine, name, error, test_file):
    """The engine did not import: goes on in its venv (meson runs the test with the system's
    python3), or exits 77, meson's "skipped", saying why, when there is none."""
    venv = os.path.join(os.environ.get("KVSTASH_ENGINES_DIR", os.path.expanduser("~/.cache/kvstash")),
                        f"{engine}-venv")
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(python) and os.path.realpath(sys.prefix) != os.path.realpath(venv):
        os.execv(python, [python, os.path.abspath(test_file), *sys.argv[1:]])
    print(f"{os.path.basename(test_file)}: skipped: {name} is not installed in {sys.prefix} ({error}): "
          f"run scripts/engines-setup {engine}")
    sys.exit(77)


class Cell:
    """A private cell: a redis-server and one kvstashd on loopback, from scripts/cluster."""

    def __init__(self, build, capacity="256MiB"):
        self.dir = tempfile.mkdtemp(prefix="kvstash-engine-test-")
        self.env = dict(os.environ, KVSTASH_CLUSTER_DIR=self.dir, BUILD_DIR=build)
        out = subprocess.run([os.path.join(REPO, "scripts", "cluster"), "start", "--capacity", capacity],
                             env=self.env, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"scripts/cluster start failed: {out.stderr}")
        with open(os.path.join(self.dir, "url")) as f:
            self.url = f.read().strip()

    def stop(self):
        subprocess.run([os.path.join(REPO, "scripts", "cluster"), "stop"], env=self.env, capture_output=True,
                       timeout=60)


class EngineProcess:
    """An engine in a process of its own (`p`, its stderr in the file `err`), driven over its
    stdin and stdout by JSON lines: a command in, an answer line "<WORD> <json>" out."""

    p: subprocess.Popen
    err: Any

    def ask(self, command, answer, seconds):
        """Sends `command` and returns the payload of the first `answer` line (None when it has
        none). AssertionError with the engine's log when it exited or gave none in `seconds`."""
        try:
            self.p.stdin.write(json.dumps(command) + "\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            raise AssertionError(f"the engine has exited:\n{self.log()[-4000:]}") from None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.p.stdout], [], [], 1.0)
            if not ready:
                continue
            line = self.p.stdout.readline()
            if not line:
                break  # the engine exited without an answer
            word, _, payload = line.partition(" ")
            if word.strip() == answer:
                return json.loads(payload) if payload.strip() else None
        raise AssertionError(f"the engine gave no {answer} within {seconds} s:\n{self.log()[-4000:]}")

    def log(self):
        self.err.seek(0)
        return self.err.read()


CELL_PREFIX = "kvs:{kvs:default}"  # the keys of the default cell's records (metadata::cell_prefix)


def corrupt_layer_sum(url, key):
    """Makes the cell's record of KV chunk `key` name another checksum for its first layer (a
    chunk's layout carries one per layer, "...;xxh3=L0,L1"): its next load fails kCorrupt."""
    obj = CELL_PREFIX + ":obj:" + key
    cli = ["redis-cli", "-u", url]
    old = subprocess.run(cli + ["HGET", obj, "layout"], capture_output=True, text=True, check=True).stdout.strip()
    assert ";xxh3=" in old, f"no chunk record of {key}: {old!r}"
    head, sums = old.split(";xxh3=", 1)
    first, comma, rest = sums.partition(",")  # an object of one layer has one sum
    bad = head + ";xxh3=" + format(int(first, 16) ^ 1, "016x") + comma + rest
    subprocess.run(cli + ["HSET", obj, "layout", bad], capture_output=True, check=True)


def prometheus_samples(text):
    """A Prometheus text exposition's series ('name{a="x"}', as written) and their values."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, v = line.rpartition(" ")
            out[series] = float(v)
    return out


def series_key(series):
    """'name{a="x",b="y"}' -> (name, frozenset of its labels): a series, its labels in any order."""
    name, _, rest = series.partition("{")
    return name, frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))

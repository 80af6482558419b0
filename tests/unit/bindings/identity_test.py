"""kvstash._identity: weights and adapters named by their content, read once per host.

- a directory's digest changes with any file's bytes (the same size, rewritten in place), with
  a file added, and not with the directory's path;
- a restart reads no byte again (the digests' cache, keyed by each file's stat);
- processes that start at once read a checkpoint once between them (the cache's lock);
- a file of Hugging Face's cache is named by its blob's name, never read.

Usage (meson test `identity`): python3 tests/unit/bindings/identity_test.py BUILD_DIR
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

BUILD = sys.argv[1] if len(sys.argv) > 1 else "build"
sys.path.insert(0, os.path.join(BUILD, "src", "python"))

from kvstash import _identity  # noqa: E402


class Reads:
    """Counts the files _identity opens to read, by path."""

    def __init__(self):
        self.paths = []

    def __enter__(self):
        def counting_open(path, *args, **kwargs):
            if "b" in (args[0] if args else kwargs.get("mode", "")):
                self.paths.append(path)
            return open(path, *args, **kwargs)

        _identity.open = counting_open
        return self

    def __exit__(self, *exc):
        del _identity.open


def fresh_process_state():
    """As a new process: nothing known but what the cache file holds."""
    _identity._memo.clear()
    _identity._loaded = False


# Run as a child: digest DIR and print how many files this process read.
CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import identity_test as t
with t.Reads() as r:
    t._identity.content_digest(sys.argv[2])
print(len(r.paths))
"""


class ContentDigest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvstash-identity-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        os.environ["KVSTASH_DIGEST_CACHE"] = os.path.join(self.dir, "cache", "digests.json")
        fresh_process_state()
        self.model = os.path.join(self.dir, "model")
        os.makedirs(self.model)
        self.write("config.json", b'{"hidden_size": 64}')
        self.write("model.safetensors", os.urandom(1 << 20))

    def write(self, name, data, where=None):
        with open(os.path.join(where or self.model, name), "wb") as f:
            f.write(data)

    def test_names_the_bytes_not_the_path(self):
        first = _identity.content_digest(self.model)
        moved = os.path.join(self.dir, "mounted-elsewhere")
        shutil.copytree(self.model, moved)
        self.assertEqual(_identity.content_digest(moved), first, "the same files under another path")
        with open(os.path.join(self.model, "model.safetensors"), "r+b") as f:
            f.seek(4096)
            byte = f.read(1)
            f.seek(4096)
            f.write(bytes([byte[0] ^ 1]))  # one bit, in place, the same size
        rewritten = _identity.content_digest(self.model)
        self.assertNotEqual(rewritten, first, "one bit changed in place kept the name")
        self.write("extra.safetensors", b"x")
        self.assertNotEqual(_identity.content_digest(self.model), rewritten, "a file added kept the name")
        self.write(".hidden", b"y")  # a checkout's .git, a download's .cache
        self.assertEqual(_identity.weights_name(self.model), "sha256:" + _identity.content_digest(self.model))

    def test_a_restart_reads_no_byte_again(self):
        with Reads() as r:
            first = _identity.content_digest(self.model)
        self.assertEqual(len(r.paths), 2, "both files read the first time")
        fresh_process_state()
        with Reads() as r:
            self.assertEqual(_identity.content_digest(self.model), first)
        self.assertEqual(r.paths, [], "a restart read files again")

    def test_processes_that_start_at_once_read_a_checkpoint_once(self):
        self.write("model.safetensors", os.urandom(64 << 20))  # long enough to overlap
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "src", "python"))
        children = [subprocess.Popen([sys.executable, "-c", CHILD, here, self.model], env=env,
                                     stdout=subprocess.PIPE, text=True) for _ in range(3)]
        reads = [int(c.communicate(timeout=120)[0].strip()) for c in children]
        self.assertEqual(sum(reads), 2, f"files read per process: {reads}")

    def test_a_hub_blob_is_named_by_its_blob_name(self):
        blobs = os.path.join(self.dir, "hub", "blobs")
        snapshot = os.path.join(self.dir, "hub", "snapshots", "abc")
        os.makedirs(blobs)
        os.makedirs(snapshot)
        name = "ab" * 32
        self.write(name, b"weights", where=blobs)
        os.symlink(os.path.join(blobs, name), os.path.join(snapshot, "model.safetensors"))
        with Reads() as r:
            _identity.content_digest(snapshot)
        self.assertEqual(r.paths, [])


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)

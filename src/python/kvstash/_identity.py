"""What a stored chunk's KV was computed from, by content: the engines' connectors salt their
keys with it, so that two requests share a chunk only when their KV bytes are the same.

- ``content_digest(path)``: a file's or a directory's bytes, as one SHA-256 digest. A model's
  weights or a LoRA adapter are named by what they hold, never by their path: a checkpoint
  rewritten in place, or another one mounted at the same path, gets other keys. Digests are
  kept in a small cache beside the engines' venvs (``~/.cache/kvstash/digests.json``, or
  ``KVSTASH_DIGEST_CACHE``), each under the file's path and its stat (device, inode, size,
  modification and change times in ns), so a restart reads no weight byte again and a file
  rewritten in any way is read anew. The processes of one host that start at once (an
  engine's scheduler and its tensor-parallel workers) read a checkpoint once: one takes the
  cache's lock and reads, the others wait for it and take its digests. Hugging Face's cache
  names each blob by its content already (LFS blobs by their SHA-256): such a file's digest is
  its blob name, read from no byte.
- ``local_path(name)``: where a model or adapter named by a path or a hub id is on this host.
- ``tensor_digest(t)``: a tensor's dtype, shape and bytes (prompt embeddings).

``python -m kvstash._identity PATH`` prints the weights' name as the engines' keys take it
("sha256:<hex>"): what an operator who sets ``weights_id`` instead writes there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_CACHE_VERSION = 1
_lock = threading.Lock()
_memo: dict[str, tuple[list[int], str]] = {}  # path -> (stat signature, digest), this process's
_loaded = False
# A blob in Hugging Face's cache: .../blobs/<sha256 of an LFS file, or the git sha1 of another>.
_HUB_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _cache_path() -> str:
    return os.environ.get("KVSTASH_DIGEST_CACHE") or os.path.join(
        os.environ.get("KVSTASH_ENGINES_DIR") or os.path.expanduser("~/.cache/kvstash"), "digests.json")


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _load_cache(again: bool = False) -> None:
    """The cache file's digests into this process's (once, or `again`: what others wrote since)."""
    global _loaded
    if _loaded and not again:
        return
    _loaded = True
    try:
        with open(_cache_path()) as f:
            data = json.load(f)
        if data.get("version") == _CACHE_VERSION:
            with _lock:
                for path, (sig, digest) in data.get("files", {}).items():
                    _memo[path] = (list(sig), str(digest))
    except (OSError, ValueError, TypeError):
        pass  # no cache yet, or one this release does not read: digests are computed again


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    """The host's lock on reading checkpoints: one process reads, the others wait for its
    digests. Without a writable cache folder, no lock (each process reads for itself)."""
    path = _cache_path() + ".lock"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _load_cache(again=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def _at_hand(real: str, sig: list[int]) -> str | None:
    """The digest of the file at `real` (a resolved path) whose stat is `sig`, without reading
    it: a hub blob's name, or the digest known for that stat; None when it must be read."""
    name = os.path.basename(real)
    if os.path.basename(os.path.dirname(real)) == "blobs" and _HUB_BLOB.fullmatch(name):
        return f"hub:{name}"
    with _lock:
        known = _memo.get(real)
    return known[1] if known is not None and known[0] == sig else None


def _known(path: str) -> bool:
    """Whether the file's digest is at hand without reading it."""
    real = os.path.realpath(path)
    return _at_hand(real, _signature(os.stat(real))) is not None


def _save_cache() -> None:
    """Written whole to a temporary file and renamed: a reader sees the old cache or the new one;
    two processes that write at once lose one's entries, which are computed again later."""
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _lock:
            data = {"version": _CACHE_VERSION, "files": {p: [s, d] for p, (s, d) in _memo.items()}}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".digests-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the digests are this process's only


def _file_digest(path: str) -> tuple[str, bool]:
    """(digest, computed now) of one regular file."""
    real = os.path.realpath(path)
    sig = _signature(os.stat(real))
    known = _at_hand(real, sig)
    if known is not None:
        return known, False
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    after = _signature(os.stat(real))
    digest = h.hexdigest()
    if after == sig:  # not changed while it was read; else not kept, and read again next time
        with _lock:
            _memo[real] = (sig, digest)
    return digest, True


def _files(root: str) -> list[str]:
    """Every regular file under `root`, relative to it and in a fixed order, less hidden entries
    (a checkout's .git, a hub download's .cache): what a loader could read."""
    out = []
    for base, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if not name.startswith("."):
                p = os.path.join(base, name)
                if os.path.isfile(p):
                    out.append(os.path.relpath(p, root))
    return sorted(out)


def content_digest(path: str, threads: int = 4) -> str:
    """The SHA-256 (hex) of what `path` holds: a file's bytes, or a directory's files, each by
    its relative path and digest. Raises OSError when the path cannot be read."""
    if os.path.isfile(path):
        return hashlib.sha256(f"file:{_digests([path], threads)[0]}".encode()).hexdigest()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is neither a file nor a directory")
    files = _files(path)
    h = hashlib.sha256(b"kvstash.dir.v1\0")
    for rel, digest in zip(files, _digests([os.path.join(path, rel) for rel in files], threads)):
        h.update(f"{len(rel)}:{rel}={digest}\n".encode())
    return h.hexdigest()


def _digests(paths: list[str], threads: int) -> list[str]:
    """Each file's digest, reading (under the host's lock, `threads` at a time) those not at
    hand, and keeping what was read in the cache."""
    _load_cache()
    with _reading() if not all(_known(p) for p in paths) else contextlib.nullcontext():
        with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
            results = list(pool.map(_file_digest, paths))
        if any(computed for _, computed in results):
            _save_cache()
    return [digest for digest, _ in results]


def local_path(name: str, revision: str | None = None, cache_dir: str | None = None) -> str | None:
    """`name` itself when it is a path here, else the directory a hub id was downloaded to on
    this host (Hugging Face's cache, `cache_dir` or its default); None when neither."""
    if name and os.path.exists(name):
        return name
    if not name:
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=name, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except Exception:  # not a hub id, not downloaded, no huggingface_hub: not found
        return None


def weights_name(path: str) -> str:
    """The weights at `path` as keys name them: "sha256:" and their content_digest."""
    return "sha256:" + content_digest(path)


def weights_name_at(path: str | None, model: str, where: str) -> str:
    """weights_name of the files found for `model` at `path`; ValueError saying to set
    weights_id in `where` (the engine's config) when they are not on this host."""
    if path is None:
        raise ValueError(f"kvstash: the weights of {model} are not on this host to be named by their content; set "
                         f"weights_id in {where} to a string that names them (a digest of the checkpoint)")
    return weights_name(path)


def digest_of(parts: dict[str, Any]) -> str:
    """What names an engine's model in its keys: 128 bits of the SHA-256 of `parts` (JSON)."""
    return short(hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest())


def tensor_digest(t: Any, rows: slice | None = None) -> bytes:
    """A torch tensor's dtype, shape and bytes (`rows` of its first axis), as a 32-byte digest."""
    if rows is not None:
        t = t[rows]
    import torch

    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def short(digest: str) -> str:
    """What goes into a key's salt: 128 bits of a hex digest."""
    return digest[:32]


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m kvstash._identity PATH")
    print(weights_name(sys.argv[1]))

"""kvstash.lmcache: an LMCache L2 adapter that keeps LMCache's chunks in a kvstash cell.

LMCache's multiprocess server (``lmcache server``, the one ``LMCacheMPConnector`` talks to)
loads it as a plugin L2 adapter, LMCache's documented way to add a storage backend without
changing LMCache:

    lmcache server --l1-size-gb 20 --l2-adapter '{"type": "plugin",
        "module_path": "kvstash.lmcache", "class_name": "KvstashL2Adapter",
        "adapter_params": {"redis_url": "redis://10.0.0.5:6379"}}'

LMCache keeps chunks in its L1 (host memory of the server) and writes each one it stores
through to its L2 adapters; a lookup that misses L1 asks the adapters, and a hit is loaded back
into L1. Each chunk is one kvstash object. Its key maps LMCache's ``ObjectKey`` field for field:
the model name, the KV rank (a bitmap of the worker's place among ``world_size`` workers), the
object group, the chunk's hash over its tokens and their prefix, and the cache salt, after the
operator's ``model_id`` (LMCache names a model by the name its engine serves it under, not by
its weights: two deployments that serve different weights under one name need distinct
``model_id``s, "sha256:<hex>" as ``python -m kvstash._identity WEIGHTS`` prints it). The
object's first 32 bytes say what layout (shapes, dtypes) its bytes have: a load into a buffer
of another layout of the same size (bf16 against fp16) is a miss, not a scrambled cache.

The bytes move in place: L1's arena is registered with the store once, and each put or get
names the chunk's own memory (a chunk outside it moves from a view of its memory, registered
for the call). Every task has one deadline (``timeout_ms`` from its submission) that bounds
all of its keys; a failure of any kind is a miss (lookup, load) or a failed store task, logged,
never an exception into LMCache's controllers. The cell evicts by its own policy: a lookup's
"lock" cannot hold a chunk there, so a chunk evicted between lookup and load is a miss of
that load, which LMCache's interface allows.

Config keys (``adapter_params``): see ``KvstashL2AdapterConfig``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

import kvstash
from kvstash._cell import CellConfig

logger = logging.getLogger(__name__)


@dataclass
class KvstashL2AdapterConfig(CellConfig, L2AdapterConfigBase):
    """``adapter_params`` keys kvstash reads: where the cell is (CellConfig; its timeout_ms is
    the deadline of one whole task), how many chunks move at once, and what names the model."""

    threads: int = 8  # puts and gets in flight at once, over all tasks
    # Prefixed to every key: what names the model's weights beyond LMCache's model name
    # ("sha256:<hex>" from `python -m kvstash._identity WEIGHTS`, or a name the operator vouches
    # for). "": the served model name is trusted to name the weights.
    model_id: str = ""

    WHERE: ClassVar[str] = "LMCache adapter_params"

    def check(self) -> None:
        if self.threads < 1:
            raise ValueError("kvstash: threads must be > 0")
        if "@" in self.model_id:
            raise ValueError("kvstash: model_id must not contain '@' (the keys' field separator)")

    @classmethod
    def from_dict(cls, d: dict) -> "KvstashL2AdapterConfig":
        return cls.from_extra(d)

    @classmethod
    def help(cls) -> str:
        return ("kvstash L2 adapter (adapter_params): redis_url, redis_password_file, cell, transports, "
                "cluster_token_file, ttl_ms, timeout_ms (one task's deadline), listen, threads, model_id")


_MAGIC = b"KVSLMC1\0"
_HEADER = struct.Struct("<8s16sQ")  # magic, layout digest, payload bytes: 32 bytes


def _header(obj: Any) -> bytes:
    """What a chunk's bytes are, as its object's first 32 bytes: a digest of its tensors' shapes
    and dtypes, and its size."""
    meta = obj.metadata
    shapes, dtypes = meta.shapes or [meta.shape], meta.dtypes or [meta.dtype]  # older objects: one tensor
    layout = repr(([tuple(s) for s in shapes], [str(d) for d in dtypes]))
    return _HEADER.pack(_MAGIC, hashlib.blake2b(layout.encode(), digest_size=16).digest(), obj.get_size())


class _Task:
    """One submitted task: its keys' outcomes, filled by the pool's threads, and how many of its
    operations are still running."""

    __slots__ = ("id", "deadline", "pending", "done", "moved", "bytes")

    def __init__(self, task_id: int, n: int, deadline: float):
        self.id = task_id
        self.deadline = deadline
        self.pending = 0
        self.done = [False] * n
        self.moved = [False] * n  # a store's puts (the rest existed already), a load's gets
        self.bytes = 0


class KvstashL2Adapter(L2AdapterInterface):
    """LMCache's L2 adapter interface over a kvstash Store. Thread-safe: LMCache's store and
    prefetch controllers call it from their threads; each call returns at once, its work runs
    on the adapter's pool, and its outcome is signalled on the operation's event fd."""

    KEYS_SIZED: ClassVar[int] = 1 << 16  # stored chunks whose size delete() reports, the oldest forgotten

    def __init__(self, config: KvstashL2AdapterConfig | dict, l1_memory_desc: Any = None):
        super().__init__(max_capacity_bytes=0)  # the cell evicts by its own policy, not LMCache's
        if not isinstance(config, KvstashL2AdapterConfig):
            config = KvstashL2AdapterConfig.from_extra(config)
        self.config = config
        self._backend_name = "kvstash"
        self.store = config.open_store()
        self._prefix = f"lmc:{config.model_id}@"
        # L1's arena registered once: chunks in it move in place (RDMA from it, over verbs).
        self._arena = (0, 0)
        if l1_memory_desc is not None and l1_memory_desc.ptr and l1_memory_desc.size > 0:
            # A lazily grown arena exposes the prefix it has pinned so far; the rest moves by view.
            size = l1_memory_desc.stable_registration_size or l1_memory_desc.size
            try:
                self.store.register_memory(l1_memory_desc.ptr, size)
                self._arena = (l1_memory_desc.ptr, size)
            except kvstash.Error as e:
                logger.warning("kvstash: LMCache's L1 arena was not registered, chunks move from views: %s", e)
        self._efds = {op: create_event_notifier() for op in ("store", "lookup", "load")}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stored: dict[L2TaskId, L2StoreResult] = {}
        self._looked_up: dict[L2TaskId, Bitmap] = {}
        self._loaded: dict[L2TaskId, Bitmap] = {}
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self.stats = {"stored": 0, "existed": 0, "store_failed": 0, "hits": 0, "misses": 0, "loaded": 0,
                      "load_failed": 0}
        self._last_error = ""
        self._last_error_at = 0.0  # monotonic times: healthy while the last reply came after the last failure
        self._last_ok_at = 0.0
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="kvstash-lmcache")

    # ---- keys and buffers

    def cell_key(self, key: Any) -> str:
        """A chunk's key in the cell: every field of LMCache's ObjectKey, none of which holds
        '@' (LMCache refuses it in the model name and the salt), after the model_id."""
        return (f"{self._prefix}{key.model_name}@{key.kv_rank:08x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
                f"@{key.cache_salt}")

    def _buffer(self, obj: Any) -> Any:
        """The chunk's bytes where they are: (address, size) inside the registered arena, else a
        view of its memory (the store registers it for the call)."""
        size = obj.get_size()
        ptr = obj.data_ptr
        base, length = self._arena
        if base <= ptr and ptr - base + size <= length:
            return (ptr, size)
        return obj.byte_array

    @staticmethod
    def _left_ms(task: _Task) -> int:
        """The task's time left, for a call's timeout_ms (at least 1: a 0 there is the store's
        default, not "now")."""
        return max(1, int((task.deadline - time.monotonic()) * 1000))

    def _new_task(self, n: int) -> _Task:
        return _Task(next(self._ids), n, time.monotonic() + self.config.timeout_ms / 1000)

    def _failed(self, what: str, e: BaseException) -> None:
        self._last_error, self._last_error_at = f"{what}: {e}", time.monotonic()
        logger.warning("kvstash: %s: %s", what, e)

    def _replied(self) -> None:
        self._last_ok_at = time.monotonic()

    def _fan_out(self, task: _Task, indices: list[int], op: Callable[[int], None],
                 finish: Callable[[_Task], None]) -> None:
        """Runs op(i) for each index on the pool; the last to end finishes the task. No thread
        waits for another (a pool thread blocked on the pool could wait for ever)."""
        if not indices:
            finish(task)
            return
        task.pending = len(indices)

        def run(i: int) -> None:
            try:
                if time.monotonic() < task.deadline:
                    op(i)
            except Exception as e:  # noqa: BLE001 (a failure is a miss, never LMCache's exception)
                self._failed(f"task {task.id}", e)
            with self._lock:
                task.pending -= 1
                last = task.pending == 0
            if last:
                finish(task)

        for i in indices:
            self._submit(run, i)

    def _signal(self, op: str, listeners: Callable[[], None] | None = None) -> None:
        """LMCache's listeners told of a task's keys, then the op's event fd signalled whatever
        they did: a task whose fd stays quiet would hold its L1 objects locked for ever."""
        try:
            if listeners is not None:
                listeners()
        except Exception as e:  # noqa: BLE001
            self._failed(f"LMCache's {op} listeners", e)
        finally:
            self._efds[op].notify()

    def _submit(self, fn: Callable, *args: Any) -> None:
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # closed: the task never completes, as LMCache expects of a closed adapter
            pass

    # ---- event fds

    def get_store_event_fd(self) -> int:
        return self._efds["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efds["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efds["load"].fileno()

    # ---- store

    def submit_store_task(self, keys: list, objects: list) -> L2TaskId:
        """Puts each chunk the cell does not hold yet (one round trip finds them); the task
        succeeds when every chunk is in the cell. LMCache keeps the objects read-locked, so
        unchanged and in place, until the task completes."""
        task = self._new_task(len(keys))
        self._submit(self._store, task, list(keys), list(objects))
        return task.id

    def _store(self, task: _Task, keys: list, objects: list) -> None:
        cell_keys = [self.cell_key(k) for k in keys]
        if keys:
            try:
                task.done = list(self.store.contains_each(cell_keys, timeout_ms=self._left_ms(task)))
                self._replied()
            except Exception as e:  # noqa: BLE001
                self._failed(f"exists of {len(keys)} chunks (storing them all)", e)

        def put(i: int) -> None:
            obj = objects[i]
            try:
                self.store.put(cell_keys[i], [_header(obj), self._buffer(obj)], ttl_ms=self.config.ttl_ms,
                               timeout_ms=self._left_ms(task))
            except kvstash.Error as e:
                self._failed(f"chunk {cell_keys[i]} was not stored", e)
                return
            self._replied()
            with self._lock:
                task.done[i] = task.moved[i] = True
                task.bytes += obj.get_size()

        def finish(task: _Task) -> None:
            stored = [i for i in range(len(keys)) if task.moved[i]]
            with self._lock:
                for i in stored:
                    self._sizes[cell_keys[i]] = objects[i].get_size()
                    self._sizes.move_to_end(cell_keys[i])
                while len(self._sizes) > self.KEYS_SIZED:
                    self._sizes.popitem(last=False)
                ok = all(task.done)
                self.stats["stored"] += len(stored)
                self.stats["existed"] += sum(task.done) - len(stored)
                self.stats["store_failed"] += len(keys) - sum(task.done)
                self._stored[task.id] = L2StoreResult(ok, task.bytes)
            self._signal("store", (lambda: self._notify_keys_stored([keys[i] for i in stored],
                                                                     [objects[i].get_size() for i in stored]))
                         if stored else None)

        self._fan_out(task, [i for i, d in enumerate(task.done) if not d], put, finish)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            out, self._stored = self._stored, {}
        return out

    # ---- lookup

    def submit_lookup_and_lock_task(self, keys: list, group_layout_descs: dict) -> L2TaskId:
        """Which chunks the cell holds, in one round trip. Nothing is locked: the cell may evict
        a chunk before its load, which then misses it."""
        task = self._new_task(len(keys))
        self._submit(self._lookup, task, list(keys))
        return task.id

    def _lookup(self, task: _Task, keys: list) -> None:
        bitmap = Bitmap(len(keys))
        try:
            if keys:
                present = self.store.contains_each([self.cell_key(k) for k in keys],
                                                   timeout_ms=self._left_ms(task))
                self._replied()
                for i, p in enumerate(present):
                    if p:
                        bitmap.set(i)
        except Exception as e:  # noqa: BLE001
            self._failed(f"lookup of {len(keys)} chunks (missing them)", e)
        hits = bitmap.popcount()
        with self._lock:
            self.stats["hits"] += hits
            self.stats["misses"] += len(keys) - hits
            self._looked_up[task.id] = bitmap
        self._signal("lookup")

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._looked_up.pop(task_id, None)

    def submit_unlock(self, keys: list) -> None:
        """Nothing to release: lookups take no lock in the cell."""

    # ---- load

    def submit_load_task(self, keys: list, objects: list) -> L2TaskId:
        """Gets each chunk into its L1 object in place; a chunk that is gone, late, of another
        layout, or unreadable is a 0 in the task's bitmap."""
        task = self._new_task(len(keys))
        keys, objects = list(keys), list(objects)
        bitmap = Bitmap(len(keys))

        def get(i: int) -> None:
            obj = objects[i]
            key = self.cell_key(keys[i])
            header = bytearray(_HEADER.size)
            try:
                self.store.get(key, into=[header, self._buffer(obj)], timeout_ms=self._left_ms(task))
            except kvstash.Error as e:
                if e.code != "not_found":
                    self._failed(f"chunk {key} did not load", e)
                else:
                    self._replied()
                return
            self._replied()
            if bytes(header) != _header(obj):
                self._failed(f"chunk {key} did not load", ValueError("its layout is not the one LMCache asks for"))
                return
            with self._lock:
                task.done[i] = True
                bitmap.set(i)

        def finish(task: _Task) -> None:
            loaded = [keys[i] for i in range(len(keys)) if task.done[i]]
            with self._lock:
                self.stats["loaded"] += len(loaded)
                self.stats["load_failed"] += len(keys) - len(loaded)
                self._loaded[task.id] = bitmap
            self._signal("load", (lambda: self._notify_keys_accessed(loaded)) if loaded else None)

        self._fan_out(task, list(range(len(keys))), get, finish)
        return task.id

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    # ---- eviction (LMCache's, when configured; the cell evicts by its own policy anyway)

    def delete(self, keys: list) -> None:
        deadline = time.monotonic() + self.config.timeout_ms / 1000
        gone, sizes = [], []
        for k in keys:
            key = self.cell_key(k)
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                break
            try:
                self.store.remove(key, timeout_ms=left)
            except kvstash.Error as e:
                if e.code != "not_found":
                    self._failed(f"chunk {key} was not removed", e)
                    continue
            gone.append(k)
            with self._lock:
                sizes.append(self._sizes.pop(key, 0))
        if gone:
            self._notify_keys_deleted(gone, sizes)

    # ---- status and close

    def report_status(self) -> dict:
        with self._lock:
            return {"is_healthy": self._last_ok_at >= self._last_error_at, "type": "kvstash",
                    "cell": self.config.cell, "arena_bytes": self._arena[1], "last_error": self._last_error,
                    **self.stats}

    def close(self) -> None:
        """Waits for the tasks in flight (each bounded by its deadline), then closes the fds."""
        self._pool.shutdown(wait=True)
        for efd in self._efds.values():
            efd.close()

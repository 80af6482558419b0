"""Prefill/decode disaggregation's direct path (kvstash.vllm with ``pd: "direct"``): the decode
reads the prefill's KV blocks one-sided out of the prefill's memory (kvstash.KvExport and
KvImport), with no memory node in between. Redis holds only handoff records
(kvstash.KvHandoffs):

  <engine>:export:<rank>   a prefill worker's KvExport descriptor: its engine's address, its
                           cache's regions and keys. Published when the caches are registered.
  <engine>:req:<request>   a finished prefill's blocks: JSON {"engine", "blocks", "fence", "tp",
                           "readers"}, with one reader per KV head ("h0", "h1", ...: a decode of
                           any tensor-parallel degree reads them), or where heads are not
                           divided among the ranks (MLA's one latent, more ranks than heads)
                           one per rank ("0", "1", ...: a decode of the prefill's degree).
  <engine>:req:<request>:grant:<rank>
                           the prefill worker's grant for those blocks (KvExport.grant): its
                           export serves a read of them under it and serves nothing else.

What happens, and what each side does when the other fails:
- The prefill's scheduler publishes a request's record when the request ends, and vLLM holds
  the request's blocks (delayed free). The request's kv_transfer_params name the record.
- Each decode rank reads the heads it holds from the prefill ranks that hold them (at the same
  degree: the rank of the same index, whole blocks; at another: those heads of each block,
  KvImport's head ranges), under a lease whose fence tag is the record's "fence" (the prefill's
  deadline, ms of its clock), then ends its readers (its heads, or its rank). A read that fails,
  or does not finish by the decode's own deadline, is a load error: vLLM computes those tokens
  instead. A decode never waits for the prefill past it.
- Each prefill worker gives the blocks back once every reader of its heads (or its rank) ended,
  or at the deadline after fencing through it (KvExport.fence): from then on no read of the
  record can touch the blocks, so a stalled or dead decode never holds them, and none is leaked.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import kvstash

logger = logging.getLogger(__name__)

# Redis keeps a request's record this long past the prefill's deadline: the record outlives the
# blocks it names, so a decode that finds it still reads under the fence that guards them.
RECORD_SLACK_MS = 5000
EXPORT_TTL_MS = 3600 * 1000  # an export record's life; refreshed every EXPORT_REFRESH_S
EXPORT_REFRESH_S = 600
POLL_S = 0.005  # a prefill worker asks Redis about its held requests at most this often
GRANT_POLL_S = 0.002  # a decode asks this often for a grant its prefill has not published yet


def now_ms() -> int:
    return int(time.time() * 1000)


def export_name(engine_id: str, rank: int) -> str:
    return f"{engine_id}:export:{rank}"


def request_name(engine_id: str, request_id: str) -> str:
    return f"{engine_id}:req:{request_id}"


def grant_name(record: str, rank: int) -> str:
    """Where a prefill worker puts its grant for a request's blocks (KvExport.grant): the
    decode rank of the same number reads under it."""
    return f"{record}:grant:{rank}"


def publish_request(store: kvstash.Store, engine_id: str, request_id: str, block_ids: list[int], tp_size: int,
                    readers: list[str], ttl_ms: int, timeout_ms: int) -> tuple[str, int]:
    """The prefill scheduler's part: the record of a finished request's blocks, read by
    `readers` (Geometry.pd_readers). Returns its name and fence (the deadline by which every
    decode rank must have read)."""
    name = request_name(engine_id, request_id)
    fence = now_ms() + ttl_ms
    record = json.dumps({"engine": engine_id, "blocks": list(block_ids), "fence": fence, "tp": tp_size,
                         "readers": readers})
    kvstash.KvHandoffs(store).publish(name, record.encode(), readers, ttl_ms + RECORD_SLACK_MS,
                                      timeout_ms=timeout_ms)
    return name, fence


def end_readers(store: kvstash.Store, name: str, readers: list[str], timeout_ms: int) -> None:
    records = kvstash.KvHandoffs(store)
    for reader in readers:
        try:
            records.end(name, reader, timeout_ms=timeout_ms)
        except kvstash.Error as e:
            logger.warning("kvstash: could not end handoff %s (the prefill frees at its deadline): %s", name, e)


def end_unread(store: kvstash.Store, name: str, timeout_ms: int) -> None:
    """A decode request that ended before its read (aborted): the prefill may free at once."""
    try:
        record = json.loads(kvstash.KvHandoffs(store).descriptor(name, timeout_ms=timeout_ms))
    except (kvstash.Error, ValueError) as e:
        logger.warning("kvstash: handoff %s could not be read to end it (the prefill frees at its deadline): %s",
                       name, e)
        return
    end_readers(store, name, [str(r) for r in record.get("readers", [])], timeout_ms)


class _Counted:
    stats: dict[str, int]  # drained into the connector's stats

    def _count(self, name: str, n: int) -> None:
        self.stats[name] += n


class PrefillExport(_Counted):
    """A prefill worker's cache, readable by decodes, and the requests whose blocks it holds."""

    def __init__(self, store: kvstash.Store, cache: kvstash.KvCache, engine_id: str, rank: int, readers: list[str],
                 timeout_ms: int):
        """readers: those whose end frees this rank's blocks (its heads', or its rank's)."""
        self._store, self._rank, self._readers, self._timeout_ms = store, rank, readers, timeout_ms
        self._records = kvstash.KvHandoffs(store)
        self._export = kvstash.KvExport(cache)
        self._name = export_name(engine_id, rank)
        self._published = 0.0
        self._held: dict[str, tuple[str, int]] = {}  # request -> (record, fence)
        self._polled = 0.0
        self.stats = {"handoffs_read": 0, "handoffs_expired": 0}
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        """Publishes the export record again when it is old (it expires an hour after)."""
        if not force and time.monotonic() - self._published < EXPORT_REFRESH_S:
            return
        try:
            self._records.publish(self._name, self._export.descriptor, [], EXPORT_TTL_MS,
                                        timeout_ms=self._timeout_ms)
            self._published = time.monotonic()
        except kvstash.Error as e:
            if force:
                raise
            logger.warning("kvstash: the export record could not be refreshed: %s", e)

    def hold(self, request_id: str, name: str, fence: int, block_ids: list[int]) -> None:
        """Holds a finished request's blocks for its decode, and publishes the grant its read
        needs (the export serves nothing else). A grant that cannot be published leaves the
        decode computing; the blocks are freed at the deadline as ever."""
        self._held[request_id] = (name, fence)
        if not block_ids:
            return
        try:
            grant = self._export.grant(block_ids, fence)
            ttl_ms = max(1, fence - now_ms()) + RECORD_SLACK_MS
            self._records.publish(grant_name(name, self._rank), grant, [], ttl_ms, timeout_ms=self._timeout_ms)
        except kvstash.Error as e:
            logger.warning("kvstash: the grant for %s could not be published (its decode computes): %s", request_id, e)

    def released(self) -> set[str]:
        """Requests whose blocks vLLM may free now: read by every decode rank that reads this
        rank's heads, or expired (and fenced: no read can touch them any more)."""
        self.refresh()
        if not self._held or time.monotonic() - self._polled < POLL_S:
            return set()
        self._polled = time.monotonic()
        now = now_ms()
        expired = {r: f for r, (_, f) in self._held.items() if f <= now}
        if expired:
            self._export.fence(max(expired.values()))
            for request_id in expired:
                logger.warning("kvstash: no decode read the blocks of %s by its deadline; they are fenced and freed",
                               request_id)
            self._count("handoffs_expired", len(expired))
        done = set(expired)
        for request_id, (name, _) in self._held.items():
            if request_id in done:
                continue
            try:
                # In order, stopping at the first still pending: one round trip while unread.
                if not any(self._records.pending(name, r, timeout_ms=self._timeout_ms) for r in self._readers):
                    done.add(request_id)
                    self._count("handoffs_read", 1)
            except kvstash.Error as e:
                logger.warning("kvstash: handoff %s could not be checked (freed at its deadline): %s", name, e)
        for request_id in done:
            del self._held[request_id]
        return done


class DecodeReads(_Counted):
    """A decode worker's reads of prefills' blocks, each on a thread of its own, bounded by the
    connector's timeout."""

    _EXPORTS_KEPT = 64

    def __init__(self, store: kvstash.Store, cache: kvstash.KvCache, plan, timeout_ms: int):
        """plan(record) -> [(prefill rank, heads, its first head, this rank's first head, readers)]:
        what this rank reads of a record, and whose end it says (Geometry.pd_reads)."""
        self._store, self._plan, self._timeout_ms = store, plan, timeout_ms
        self._records = kvstash.KvHandoffs(store)
        self._import = kvstash.KvImport(cache)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvstash-pd-read")
        self._exports: dict[str, bytes] = {}  # export record name -> descriptor
        self._lock = threading.Lock()
        self._reads: dict[str, tuple[Future, list[int]]] = {}
        self.stats = {"blocks_read": 0, "reads_failed": 0}

    def start(self, request_id: str, name: str, first_block: int, local_blocks: list[int]) -> None:
        future = self._pool.submit(self._read, name, first_block, local_blocks)
        if local_blocks:  # else nothing waits for it: it only ends the handoff
            self._reads[request_id] = (future, local_blocks)

    def _descriptor(self, engine: str, rank: int) -> bytes:
        key = export_name(engine, rank)
        with self._lock:
            found = self._exports.get(key)
        if found is None:
            found = self._records.descriptor(key, timeout_ms=self._timeout_ms)
            with self._lock:
                if len(self._exports) >= self._EXPORTS_KEPT:
                    self._exports.clear()
                self._exports[key] = found
        return found

    def _grant(self, name: str, rank: int, left_ms) -> bytes:
        """Prefill rank `rank`'s grant for the request's blocks: it publishes it as it starts
        holding them (its next step), which may come a moment after the decode heard of them."""
        key = grant_name(name, rank)
        while True:
            try:
                return self._records.descriptor(key, timeout_ms=left_ms())
            except kvstash.Error as e:
                if getattr(e, "code", None) != "not_found":
                    raise
            time.sleep(GRANT_POLL_S)

    def _read(self, name: str, first_block: int, local_blocks: list[int]) -> None:
        start = time.monotonic()

        def left_ms() -> int:
            left = self._timeout_ms - int((time.monotonic() - start) * 1000)
            if left <= 0:
                raise kvstash.Error(f"timeout: the read of {name} ran out of its {self._timeout_ms} ms")
            return left

        engine, readers, plan = None, [], []
        try:
            record = json.loads(self._records.descriptor(name, timeout_ms=left_ms()))
            try:
                plan = self._plan(record)
            except ValueError:
                readers = [str(r) for r in record.get("readers", [])]  # no rank of this decode reads it
                raise
            readers = [r for *_, rs in plan for r in rs]
            if not local_blocks:
                return  # the decode's own prefix cache had every block: nothing to read
            engine = record["engine"]
            remote = record["blocks"][first_block:first_block + len(local_blocks)]
            if len(remote) != len(local_blocks):
                raise ValueError(f"the prefill holds {len(record['blocks'])} blocks, the decode reads "
                                 f"{first_block} + {len(local_blocks)}")
            reads = [self._import.begin_read(self._descriptor(engine, rank), remote, local_blocks,
                                             fence=record["fence"], ttl_ms=self._timeout_ms + 1000,
                                             timeout_ms=left_ms(), grant=self._grant(name, rank, left_ms),
                                             heads=heads, remote_head_first=theirs, local_head_first=ours)
                     for rank, heads, theirs, ours, _ in plan]
            for read in reads:
                read.wait()
        except Exception:
            if engine is not None:
                with self._lock:
                    for rank, *_ in plan:
                        self._exports.pop(export_name(engine, rank), None)  # the prefill may be gone
            raise
        finally:
            # Every reader this rank answers for, read or not: the prefill frees now, not at its
            # deadline (a record no rank can read: all of them).
            end_readers(self._store, name, readers, self._timeout_ms)

    def finished(self) -> tuple[set[str], set[int]]:
        """Requests whose read ended, and the blocks of those that failed (to recompute)."""
        done, failed = set(), set()
        for request_id, (future, blocks) in list(self._reads.items()):
            if not future.done():
                continue
            del self._reads[request_id]
            done.add(request_id)
            try:
                future.result()
                self._count("blocks_read", len(blocks))
            except Exception as e:  # noqa: BLE001 (every failure is a recompute)
                logger.warning("kvstash: reading the prefill's blocks of %s failed, computing them: %s", request_id, e)
                failed.update(blocks)
                self._count("reads_failed", 1)
        return done, failed

    def close(self) -> None:
        self._pool.shutdown(wait=True)

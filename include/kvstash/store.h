// kvstash/store.h: the object store that inference engines call.
//
// A Store offloads objects (a session's KV cache, a prefix chunk) to the memory nodes of a
// cell and loads them back. Redis holds the metadata only (docs/metadata.md); the bytes move
// one-sided between the caller's memory and the nodes' pools through an Engine.
//
//   auto store = Store::open({.redis_url = "redis://127.0.0.1:6379/0"}).value();
//   Slice s{kv.data(), kv.size()};
//   store->put("session/42", {&s, 1}, {.ttl = std::chrono::minutes(10)});
//   store->get("session/42", {&s, 1});
//
// Guarantees (each proven by tests/store_*_test.cc):
// - A get returns exactly the bytes the matching put wrote, or an error: an object removed,
//   evicted, expired or overwritten during the get ends kStale or kNotFound, never with
//   another object's bytes (read leases, page generations and an xxh3 checksum).
// - Every operation has a deadline (the caller's, else StoreOptions::timeout); a dead
//   memory node or Redis turns into an error by then.
// - Pages of removed, expired, evicted and half-written objects return to the pool.
//
// Thread safety: a Store is safe to use from many threads at once. The caller keeps the
// memory a Slice names valid (and, for put, unchanged) until the operation returns, or
// until an async operation's future is ready.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvstash/engine.h"
#include "kvstash/object.h"
#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash {

namespace store {
class CellRecords;  // src/store/cell_records.h: the records the KV layer keeps in the cell
}  // namespace store

namespace metrics {
class Registry;  // kvstash/metrics.h
}

struct StoreOptions {
  // The cell's Redis: redis://[user:password@]host[:port][/db],
  // unix://[user:password@]/path/to/socket[?db=N], redis+sentinel://[user:password@]s1[:port],
  // s2.../service[/db] (through Redis Sentinel) or redis+cluster://[user:password@]n1[:port],
  // n2... (a Redis Cluster: each cell lives in one hash slot).
  std::string redis_url = "redis://127.0.0.1:6379/0";
  // Overrides the URL's password when set (keeps it out of command lines and logs).
  std::string redis_password;
  // The cell: one Redis can hold several independent cells (key prefix kvs:{kvs:<cell>}).
  std::string cell = "default";
  // A deployment of several cells, instead of `cell` alone (docs/operations.md, Cells): each
  // object's metadata lives in the cell its key's route wins by rendezvous hashing (the text
  // inside the key's first {braces}, as a Redis hash tag; else the whole key; prefix-chunk
  // keys carry their chain's root there, so a chain stays in one cell). While
  // `previous_cells` is set (a change of the set not yet settled), gets, stat, touch and
  // remove look in its choice first: a change moves no bytes.
  std::vector<std::string> cells;
  std::vector<std::string> previous_cells;
  // Route over the cells the Redis's cell directory lists (`kvstash cells`), instead of
  // `cells`, reading it again every cell_directory_refresh.
  bool cell_directory = false;
  std::chrono::milliseconds cell_directory_refresh{10000};
  // The data path: transports, preferred transport, the cluster token.
  EngineOptions engine;
  // Deadline of an operation when the caller gives none.
  std::chrono::milliseconds timeout{30000};
  // A put not committed within this lease is abandoned: its pages go back to the pool once
  // its memory nodes have fenced it (no write of it can land any more), and the commit fails
  // with kStale. A put stops writing at its lease, whatever its deadline.
  std::chrono::milliseconds put_lease{60000};
  // Bytes of pages the client reserves ahead of its puts, under one put lease, so that a put
  // costs one Redis round trip (its commit) instead of two. Cells short of free pages grant
  // less (never more than a quarter of the free pages); pages no put took return when the
  // store closes, or with the lease. 0: every put allocates its own pages (begin_put).
  std::uint64_t put_reservation = 256u << 20;
  // After writes to a memory node fail because the node went away (kUnavailable), puts take
  // no pages from it for this long while other nodes have room, and a put whose writes failed
  // so is placed again on other nodes within its deadline (at most twice). Longer than the
  // nodes' heartbeat TTL (kvstashd --heartbeat-ttl, 3 s by default): by then the cell has
  // declared a dead node dead. 0: neither.
  std::chrono::milliseconds avoid_unreachable_nodes{5000};
  // A put that finds no free page while other pages are only held for now (by readers' leases,
  // other puts, clients' reservations, failed puts waiting for their fence) waits this long,
  // within its deadline, for them to come back, asking again with growing pauses (2 to 64 ms),
  // before it returns kNoSpace. A full cell evicts what no reader leases at once: the wait is
  // for a cell whose every page is busy. 0: refuse at once.
  std::chrono::milliseconds wait_for_pages{500};
  // Redis replicas that must hold a put's commit before the put returns OK (Redis WAIT, within
  // the put's deadline). With Sentinel, a failover then keeps every object whose put returned
  // OK, unless more replicas die with the master. When fewer replicas acknowledge in time the
  // put returns kUnavailable: committed on the master, maybe lost in a failover. 0: no wait
  // (replication stays asynchronous). Measured cost: docs/operations.md 2.6.
  std::uint32_t commit_replicas = 0;
  // A get holds a read lease this long: eviction, removal and overwrite keep the pages out
  // of reuse meanwhile. A get outliving it ends kStale if the pages were reused.
  std::chrono::milliseconds read_lease{60000};
  // Per Redis command (a reconnect after a broken connection may add up to the deadline).
  std::chrono::milliseconds redis_timeout{2000};
  // Redis connections kept for concurrent operations.
  std::uint32_t redis_connections = 4;
  // Threads running the *_async operations.
  std::uint32_t async_threads = 2;
  // Verify the checksum of every object read into host memory (a mismatch is kCorrupt; a
  // get into device memory with the check on is kInvalidArgument: the host reads no byte of
  // it, so such a caller checks on its device, as KvCache does).
  bool verify_checksum = true;
  // Overrides the cell's rkey scope for this client (benchmarks, tests); unset: the cell's,
  // read when the store opens.
  std::optional<RkeyScope> rkey_scope;
};

// A piece of the caller's memory. An object is the concatenation of its slices. `memory`
// may name a registration covering it (Store::register_memory; needed for zero-copy RDMA);
// without one the store registers the slice for the call (cheap for shm and tcp).
struct Slice {
  void* addr = nullptr;
  std::size_t length = 0;
  const MemoryHandle* memory = nullptr;
};

// Where the time of one operation went, for benchmarks and tracing.
struct OpTimings {
  std::chrono::nanoseconds metadata{0};  // Redis round trips (scripts)
  std::chrono::nanoseconds transfer{0};  // bytes on the data path
  std::chrono::nanoseconds checksum{0};  // xxh3 (a put's runs while its writes are in flight)
  // A put's bytes whose block digests the transport computed as it copied them (shm): one
  // pass over them instead of two; `checksum` is then only the rest and the folds.
  std::uint64_t checksummed_in_copy = 0;
  std::uint32_t redis_round_trips = 0;
  // Lease exchanges with memory nodes (verbs: the node binds windows), and the time in them.
  std::uint32_t node_round_trips = 0;
  std::chrono::nanoseconds node{0};
};

struct PutOptions {
  // The object expires this long after the put; 0: never (until removed or evicted).
  std::chrono::milliseconds ttl{0};
  // Opaque bytes stored with the object and returned by get and stat (at most 64 KiB): how
  // to read its bytes (KvCache stores its layout tag and a checksum per layer), a token
  // count... (Redis field `layout`; the CLI's --layout).
  std::string object_layout;
  std::optional<Deadline> deadline;
  OpTimings* timings = nullptr;  // filled when set
  // Compare-and-set: commit only if the key still holds this version of an object
  // (ObjectInfo::version, from a get or stat), or with "" only if it holds none. Otherwise
  // the put ends kStale and changes nothing. Unset: replace whatever is there.
  std::optional<std::string> if_version;
  // Bytes per checksum segment (docs/metadata.md); 0: 4 MiB. A PutStream whose pieces are
  // summed where they are (append_summed: one per segment) sets it to its piece size.
  std::uint64_t checksum_segment = 0;
  // Copies of the object, each on memory nodes none of the others uses (1 to 4; Store::put
  // only): a get reads the readable copy with the fewest readers, and the object stays
  // readable while one copy's nodes live. For objects many engines read at once (a shared
  // system prompt's prefix). kNoSpace when the live nodes cannot hold them apart. Each copy
  // is written and committed in turn, the object itself last; a put that fails midway may
  // leave copies of its bytes, as a failed put may have committed.
  std::uint32_t replicas = 1;
  // The use this put is, for a turn-ttl cell (KeepHint).
  std::optional<KeepHint> keep;
  // Event data for cache-aware routers (docs/events.md; at most 64 KiB; empty: none): while the
  // cell's events are on, the put's commit records it in its own script and the cell's
  // `kvstash events` relay publishes the object as stored, and its removal, whatever the reason,
  // with the same data. What announce does for an object stored earlier, without its second
  // round trip. The object's copies (replicas) carry none.
  std::string event;
};

// Cancels gets from another thread (GetOptions::cancel). A default token cancels nothing;
// CancelToken::make() makes a live one, and its copies share it. cancel() returns once no
// transfer of a get holding the token can touch that get's memory any more; those gets end
// kCancelled (one that already finished keeps its result), and later ones end kCancelled at
// once: a cancelled token stays cancelled. Thread-safe.
class CancelToken {
 public:
  static CancelToken make();
  void cancel() const;
  bool cancelled() const;
  explicit operator bool() const { return state_ != nullptr; }

 private:
  friend class Store;
  struct State;
  class Scope;  // a get's batches, registered with the token while they may run
  std::shared_ptr<State> state_;
};

// Read leases on many objects, taken in one Redis round trip (Store::lease_reads) for gets
// that follow at once: a KV load of many chunks. A get naming the batch (GetOptions::leases)
// uses its object's lease instead of taking one (and fails kNotFound at once for a key the
// batch found absent); once every leased object's get has ended, the batch ends their leases
// in one round trip, and when it goes, the leases no get used. Each lease serves one get.
// Destroy it before the store; thread-safe.
class ReadLeases {
 public:
  ReadLeases();
  ReadLeases(ReadLeases&&) noexcept;
  ReadLeases& operator=(ReadLeases&&) noexcept;
  ~ReadLeases();

 private:
  friend class Store;
  struct State;
  std::shared_ptr<State> state_;
};

struct GetOptions {
  std::optional<Deadline> deadline;
  OpTimings* timings = nullptr;  // filled when set
  // Overrides StoreOptions::verify_checksum for this get (a caller that checks every byte
  // itself, as KvCache does per layer, saves the second pass).
  std::optional<bool> verify_checksum;
  // Called on the thread running the get each time more of the object has landed, in order:
  // bytes [0, landed) are in `into`, and `object_layout` is the object's (what its put stored).
  // Before the get returns they are not yet checked against the object's checksum nor its
  // lease: act on them early only where the object layout lets you check them (KvCache stores a
  // checksum per layer there).
  std::function<void(std::uint64_t landed, std::string_view object_layout)> progress;
  // Lets another thread stop this get (CancelToken::cancel).
  CancelToken cancel;
  // A batch of read leases that holds this key's (Store::lease_reads): no Redis round trip.
  const ReadLeases* leases = nullptr;
  // An object on a memory node's NVMe tier is staged back into the node's pool first (one
  // round trip more, and the device's read: docs/nvme-tier.md). false: such an object is
  // kNotFound instead, its message saying it is on the tier (the caller would rather
  // recompute); Store::prefix_tiers tells beforehand.
  bool promote = true;
  // The use this get is, for a turn-ttl cell (KeepHint). A get that names a batch of leases
  // (`leases`) was hinted by Store::lease_reads instead.
  std::optional<KeepHint> keep;
};

// Where Store::get_unsized puts an object the caller did not know the size of: called once
// with the object's size, before any byte moves; returns slices holding at least `size`
// bytes, or an error, which the get then returns (nothing is read).
using GetInto = std::function<Result<std::vector<Slice>>(std::uint64_t size)>;

class Store;

// A put written in pieces, in order (a KV cache saved layer by layer as each layer's
// attention finishes). Store::begin_put reserves the pages under a put lease; append()
// starts writing the next bytes and returns once they are submitted; commit() waits for
// every write and makes the object visible (replacing an older one, as put does). Destroying
// an uncommitted stream aborts it: its pages return. Not thread-safe: one writer.
class PutStream {
 public:
  PutStream();
  PutStream(PutStream&&) noexcept;
  PutStream& operator=(PutStream&&) noexcept;
  ~PutStream();

  // Starts writing the next total_length(data) bytes of host memory, and sums them (the
  // object's checksum) while the writes fly; `data` must stay valid and unchanged until
  // commit() or abort() returned. With `segment_sum`, the piece must be exactly the object's
  // next checksum segment (PutOptions::checksum_segment; the last may be shorter), and its
  // sum is returned there. Errors: kInvalidArgument (past the object's size, after
  // commit/abort, device memory, not a segment), the failure of an earlier write (the stream
  // is then dead).
  Status append(std::span<const Slice> data, std::uint64_t* segment_sum = nullptr);
  // As append, for bytes the host must not read (GPU memory): `segment_sum` is their sum,
  // computed where they are (common/checksum_core.h on the device), and the piece must be
  // exactly the object's next checksum segment. The store touches none of the bytes.
  Status append_summed(std::span<const Slice> data, std::uint64_t segment_sum);
  std::uint64_t size() const;
  std::uint64_t written() const;
  // Waits until the bytes [0, end) appended so far have reached the memory nodes, so that
  // the memory they came from may be reused (a bounce buffer). Returns the stream's first
  // write failure, if any.
  Status wait_written(std::uint64_t end);
  // The sums of the object's checksum segments summed so far, in order. A piece appended
  // without `segment_sum` over shared memory is summed as it is copied: its segments' sums
  // are here once wait_written covered them (all of them after wait_written(size())).
  std::vector<std::uint64_t> segment_sums() const;
  // Replaces the object layout PutOptions gave (what is only known once the bytes are out, such as
  // per-part checksums); stored at commit. At most 64 KiB.
  void set_object_layout(std::string object_layout);
  // Waits for the writes, then commits. kInvalidArgument when fewer than size() bytes were
  // appended (the put is aborted); otherwise as Store::put.
  Status commit();
  // Drops the put; its pages return. Waits for writes in flight.
  void abort();
  // After a commit that succeeded: whether the cell recorded the put's event data
  // (PutOptions::event). False without event data, or while the cell's events are off.
  bool announced() const;

 private:
  friend class Store;
  struct State;
  Status check_append(std::uint64_t n, bool whole_segment) const;
  std::unique_ptr<State> state_;
};

class Store {
 public:
  // Connects to Redis (checking the schema version) and starts the engine. Errors:
  // kInvalidArgument (bad URL or options), kPermissionDenied (credentials), kUnavailable,
  // kTimeout, kCorrupt (the cell's schema is not one this build knows).
  static Result<std::unique_ptr<Store>> open(const StoreOptions& options);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Writes `data` as object `key`, replacing any previous object of that key once the new
  // one is complete (readers see the old or the new object, never a mix). Blocks until
  // committed or failed. Errors: kInvalidArgument (empty or oversize key, object layout over
  // 64 KiB), kNoSpace (the live nodes cannot hold it even after evicting every unleased
  // object), kTimeout, kUnavailable (a node or Redis unreachable), kStale (the put's lease
  // ran out before the commit), kPermissionDenied.
  Status put(std::string_view key, std::span<const Slice> data, const PutOptions& options = {});

  // Reads object `key` into `into` (filled in order; it may be longer than the object).
  // Returns what was read. Errors: kNotFound (absent, expired, or its node is gone),
  // kInvalidArgument (`into` shorter than the object: nothing is read), kStale (the pages
  // were reused during the read), kCorrupt (checksum mismatch or a malformed record),
  // kTimeout, kUnavailable.
  Result<ObjectInfo> get(std::string_view key, std::span<const Slice> into, const GetOptions& options = {});

  // Reads object `key` into the memory `into` returns once the object's size is known: for an
  // object of unknown size (small blobs; the C and Python get), in the same single Redis
  // script as get (a stat first would be a second one, and the object could be replaced in
  // between). Errors as get's, and `into`'s own.
  Result<ObjectInfo> get_unsized(std::string_view key, const GetInto& into, const GetOptions& options = {});

  // Starts a put of `size` bytes written in pieces (PutStream). The deadline and the put
  // lease count from now and cover every append and the commit. Errors as put's.
  Result<PutStream> begin_put(std::string_view key, std::uint64_t size, const PutOptions& options = {});

  // Leases `keys` for reading in one Redis round trip per cell (ReadLeases), for gets that
  // name the batch. Keys whose cell is not settled (previous_cells set) are left out: their
  // gets lease for themselves. Errors: kInvalidArgument (a bad key), kUnavailable, kTimeout.
  // `keep`: the uses they are, for a turn-ttl cell (KeepHint), one per key, or none.
  Result<ReadLeases> lease_reads(std::span<const std::string> keys, std::optional<Deadline> deadline = {},
                                 std::span<const KeepHint> keep = {});

  // Commits every stream (PutStream::commit each), those whose pages came from this client's
  // reservation in one Redis round trip per cell: a KV save's chunks, ready together. Per
  // stream, what its commit would have returned.
  std::vector<Status> commit_all(std::span<PutStream> streams);

  // The object's size, object layout and placement, without reading it. kNotFound when absent.
  Result<ObjectInfo> stat(std::string_view key, std::optional<Deadline> deadline = {});

  // How many of `keys`, from the first, are present: the length of the longest cached
  // prefix when keys are a sequence of prefix chunks. One Redis round trip.
  Result<std::size_t> contains_prefix(std::span<const std::string> keys,
                                      std::optional<Deadline> deadline = {});
  // contains_prefix, and the request's conversation turn, for the KeepHints of its loads and
  // saves. One round trip.
  Result<PrefixLookup> lookup_prefix(std::span<const std::string> keys,
                                     std::optional<Deadline> deadline = {});
  // contains_prefix, and where each of those leading keys is: a get of one on a node's NVMe
  // tier costs a promotion first (a load to weigh against a recompute). One round trip.
  Result<std::vector<Tier>> prefix_tiers(std::span<const std::string> keys,
                                         std::optional<Deadline> deadline = {});
  // Whether each of `keys` is present, one Redis round trip: a hybrid model's lookup, whose
  // KV-cache groups need different chunks of a prefix (a window's last ones, a state's last).
  // The keys share a route (one chain's objects).
  Result<std::vector<bool>> contains_each(std::span<const std::string> keys,
                                          std::optional<Deadline> deadline = {});

  // Deletes the object (its pages return to the pool once no reader holds them).
  // kNotFound when absent.
  Status remove(std::string_view key, std::optional<Deadline> deadline = {});
  // remove, of an object whose bytes the caller found bad (a load that failed its checksum):
  // `kvstash explain` then says the key was removed as corrupt.
  Status remove_corrupt(std::string_view key, std::optional<Deadline> deadline = {});

  // KV events for cache-aware routers (docs/events.md): each key of `items` present now
  // carries its event data (key, data: msgpack of its block hashes, parent hash, token ids,
  // block size and LoRA id) and is published as stored by the cell's `kvstash events` relay;
  // its removal, whatever the reason, is published with the same data. A key absent now is
  // skipped. Returns how many keys were announced; nullopt when the cell's events are off
  // (nothing was recorded). kInvalidArgument for data empty or over 64 KiB.
  Result<std::optional<std::size_t>> announce(std::span<const std::pair<std::string, std::string>> items,
                                              std::optional<Deadline> deadline = {});

  // Sets a new time to live from now (0: no expiry) and marks the object recently used.
  // kNotFound when absent.
  Status touch(std::string_view key, std::chrono::milliseconds ttl, std::optional<Deadline> deadline = {});

  // Connects to every live node of the cell now (each node's best transport, its pool's key
  // imported), which a put or get otherwise does on its first use of the node: an engine
  // calls it at start, off its first request's path (importing a pool over shm maps it: about
  // 0.1 s per GiB here). Returns how many nodes are connected; a node that cannot be reached
  // is left to the first operation that needs it (and logged). Errors: Redis's.
  Result<std::size_t> connect_nodes(std::optional<Deadline> deadline = {});

  // Async forms: run on the store's threads; the future holds what the sync form returns.
  // Slices are copied, not the memory they name.
  std::future<Status> put_async(std::string key, std::vector<Slice> data, PutOptions options = {});
  std::future<Result<ObjectInfo>> get_async(std::string key, std::vector<Slice> into,
                                            GetOptions options = {});
  std::future<Status> remove_async(std::string key, std::optional<Deadline> deadline = {});
  std::future<Status> touch_async(std::string key, std::chrono::milliseconds ttl,
                                  std::optional<Deadline> deadline = {});
  std::future<Result<std::size_t>> contains_prefix_async(std::vector<std::string> keys,
                                                         std::optional<Deadline> deadline = {});

  // Registers memory the caller will pass in Slices many times (zero-copy for RDMA).
  Result<MemoryHandle> register_memory(const MemoryRegion& region);

  // The engine moving the bytes (its transports, its address).
  Engine& engine();

  // This client's own metrics in Prometheus' text exposition format (docs/operations.md,
  // "Engine-side metrics"): its operations by outcome and latency, the bytes they moved, per
  // transport what its transfers moved, and its KvCaches' chunks, failed loads and layer
  // waits. For an engine to serve on its /metrics, or to hand to its own registry
  // (kvstash.vllm and kvstash.sglang do). Counts since open.
  std::string metrics_text() const;
  // The registry those metrics are kept in (kvstash/metrics.h): the layers above the store
  // (its KvCaches) and an engine count into it too, and metrics_text shows theirs with its own.
  metrics::Registry& metrics();

 private:
  friend class PutStream;
  friend class ReadLeases;          // its state ends leases through the store
  friend class store::CellRecords;  // runs the KV layer's records' scripts in the store's cells
  struct Impl;
  struct Copy;  // which copy of a put with replicas, and the nodes it keeps apart from
  explicit Store(std::unique_ptr<Impl> impl);
  Result<PutStream> begin_put(std::string_view key, std::uint64_t size, const PutOptions& options,
                              Copy* copy);
  Status put(std::string_view key, std::span<const Slice> data, const PutOptions& options, Copy* copy);
  Status put_all(std::string_view key, std::span<const Slice> data, const PutOptions& options);
  Status remove_as(std::string_view key, std::optional<Deadline> deadline, bool corrupt);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash

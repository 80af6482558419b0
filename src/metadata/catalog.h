// The metadata plane of a cell, behind one class: memory nodes and their page pools, objects
// and their extents, leases, LRU eviction, expiry and reclaim (docs/metadata.md).
//
// Every change is one Lua script (scripts.h), so each is atomic; time comes from Redis.
// Replies are parsed defensively: a record that was corrupted or written by something else
// gives kCorrupt, never a crash.
//
// Thread safety: as the RedisClient it uses (one thread at a time).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/checksum.h"
#include "kvstash/store.h"
#include "metadata/redis_client.h"

namespace kvstash::metadata {

// The schema this build reads and writes (the cell's `schema` field).
// 2: puts' pages return only through their memory nodes' fences (`fenced`), and a restarted
// or dead node's objects are swept in batches.
// 3: an object's checksum is the xxh3 tree (common/checksum.h), stored as "<hex>/<segment>".
inline constexpr int kSchemaVersion = 3;

struct NodeRecord {
  std::string id;     // stable across restarts: [A-Za-z0-9._-], at most 64 bytes
  std::string epoch;  // random per start: a new epoch means the old memory is gone
  std::uint64_t page_size = 0;
  std::uint64_t page_count = 0;
  std::string address;  // the node engine's address blob
  std::string key;      // the pool region's remote-key blob
};

// How to reach a node's pool.
struct NodeEndpoint {
  std::string id;
  std::string address;
  std::string key;
};

// One page of an object: which node, which page, and the page's generation at allocation.
struct Extent {
  std::string node;
  std::uint64_t page = 0;
  std::int64_t generation = 0;
  bool operator==(const Extent&) const = default;
};

// Where an object's pages are. `extents` is in object order: byte b of the object lives in
// extents[b / page_size] at offset b % page_size.
struct Placement {
  std::uint64_t page_size = 0;
  std::vector<Extent> extents;
  std::vector<NodeEndpoint> nodes;
  std::string extents_text;  // the record's own form, handed back to end_get
  // The put's or read's lease deadline, in ms of Redis's clock: the fence tag its transfers
  // carry to the nodes (LeaseOptions::fence).
  std::int64_t lease_deadline_ms = 0;
};

// A leased read: what the object is and where its pages are.
struct ReadLease {
  std::string object_token;  // the put that wrote it
  std::uint64_t size = 0;
  sum::ObjectSum checksum;
  std::string layout;
  Placement placement;
};

struct ObjectRecord {
  std::uint64_t size = 0;
  sum::ObjectSum checksum;
  std::string layout;
  std::uint64_t pages = 0;
  std::vector<std::string> nodes;
  std::int64_t ttl_ms = -1;     // time left; -1: no expiry
  std::string version;          // the token of the put that wrote it
  std::vector<Extent> extents;  // in object order
};

struct NodeStatus {
  std::string state;  // up, draining, dead, gone
  std::string epoch;
  std::uint64_t page_size = 0;
  std::uint64_t page_count = 0;
  std::uint64_t free_pages = 0;
  std::uint64_t objects = 0;
  std::int64_t heartbeat_in_ms = 0;  // until the heartbeat deadline; negative: past it
};

struct ReclaimCounts {
  std::uint64_t expired = 0;           // objects past their TTL
  std::uint64_t abandoned_puts = 0;    // pending puts past their lease
  std::uint64_t zombies = 0;           // released pages whose last read lease ran out
  std::uint64_t dead_nodes = 0;        // nodes past their heartbeat deadline
  std::uint64_t orphaned_objects = 0;  // objects dropped with them
  std::uint64_t fencing_puts = 0;      // puts past their lease, waiting for a node's fence
  std::uint64_t swept = 0;             // objects of dead or restarted nodes released
  bool more = false;                   // a limit was reached: run reclaim again
};

struct EvictCounts {
  std::uint64_t objects = 0;
  std::uint64_t pages = 0;
};

// The cell at a glance (the counters count since the cell's Redis was created).
struct CellSummary {
  std::uint64_t page_size = 0;
  std::uint64_t objects = 0;
  std::uint64_t bytes = 0;    // sum of the objects' sizes
  std::uint64_t hits = 0;     // gets that found their object
  std::uint64_t misses = 0;   // gets that did not
  std::uint64_t evicted = 0;  // objects evicted (for room, or by an operator)
  std::uint64_t expired = 0;  // objects released at their TTL
  std::int64_t now_ms = 0;    // Redis's clock
};

// One object as an operator sees it (read-only: looking does not touch it).
struct ObjectInfo {
  std::string key;
  bool exists = false;
  std::uint64_t size = 0;
  std::int64_t created_ms = 0;
  std::int64_t expires_ms = 0;  // 0: never
  std::int64_t last_access_ms = 0;
  std::vector<std::string> nodes;
  std::optional<sum::ObjectSum> checksum;  // none when the record's is malformed
  std::uint64_t readers = 0;               // live read leases
};

// A page of SCAN over object keys.
struct ObjectScan {
  std::vector<std::string> keys;
  std::string cursor;  // "0" when the scan is complete
};

struct EvictedObject {
  std::string key;
  std::uint64_t size = 0;
  std::int64_t last_access_ms = 0;
};

class Catalog {
 public:
  explicit Catalog(RedisClient& redis, std::string cell = "default");

  const std::string& prefix() const { return prefix_; }

  // kCorrupt when the cell was written by a schema this build does not know.
  Status check_schema();
  // The cell's rkey scope (kConnection when unset); kCorrupt for a value this build does not
  // know. set_rkey_scope changes it for clients that open their store from then on.
  Result<RkeyScope> rkey_scope();
  Status set_rkey_scope(RkeyScope scope);

  // --- Nodes ---------------------------------------------------------------------------
  // Creates or refreshes a node. A new epoch drops the objects of the previous incarnation
  // and resets its pool: the caller guarantees that nothing granted under an earlier epoch
  // can still write into the pool (a new process, or the pool deregistered from every
  // transport first). Returns Redis's clock (ms). Errors: kInvalidArgument (bad id, page size
  // differs from the cell's, zero pages), Redis errors.
  Result<std::int64_t> register_node(const NodeRecord& node, std::chrono::milliseconds heartbeat_ttl);
  // Keeps a node alive for `ttl` more and records that it has fenced every lease whose tag
  // (a put's or read's Redis deadline) is at most `fenced_ms`. Returns Redis's clock (ms).
  // kStale when it must register again (another epoch, or its deadline passed).
  Result<std::int64_t> heartbeat(std::string_view id, std::string_view epoch, std::chrono::milliseconds ttl,
                                 std::int64_t fenced_ms);
  // The node takes no new pages and its objects are dropped. Returns how many.
  Result<std::uint64_t> drain_node(std::string_view id, std::string_view epoch);
  // The node leaves the cell (after drain_node).
  Status deregister_node(std::string_view id, std::string_view epoch);
  Result<NodeStatus> node_status(std::string_view id);
  Result<std::vector<std::string>> list_nodes();
  // Free pages of one node. kNotFound for an unknown node.
  Result<std::uint64_t> free_pages(std::string_view node);

  // --- Objects -------------------------------------------------------------------------
  // Allocates pages for a `size`-byte object under a fresh put `token` (evicting when
  // short) and records a pending put leased for `lease`. kNoSpace when the live nodes
  // cannot hold it; kInvalidArgument for a bad key.
  Result<Placement> begin_put(std::string_view token, std::string_view key, std::uint64_t size,
                              std::chrono::milliseconds lease);
  // Makes the put visible (with its TTL; 0 = none), releasing an object it replaces.
  // kStale when the lease ran out and the pages were reclaimed, or a node of the put died,
  // or `if_version` is set and the key holds another object than the put token it names
  // ("": none at all); the put's pages are freed then.
  Status commit_put(std::string_view token, std::string_view key, const sum::ObjectSum& checksum,
                    std::string_view layout, std::chrono::milliseconds ttl,
                    const std::optional<std::string>& if_version = std::nullopt);
  // Ends a put that will not commit. Its pages on the nodes in `fenced` (those that confirmed
  // that none of its writes can land any more: Peer::revoke) and on dead nodes are freed now;
  // the others return once the lease has passed and their nodes have fenced through it
  // (reclaim). Returns how many pages wait for a fence.
  Result<std::uint64_t> abort_put(std::string_view token, std::span<const std::string> fenced);

  // Looks `key` up and leases it for reading under `reader` for `lease`. kNotFound when
  // absent, expired or on a dead node; kCorrupt for a malformed record.
  Result<ReadLease> begin_get(std::string_view key, std::string_view reader, std::chrono::milliseconds lease);
  // Ends the lease; kStale when a page was freed or reused while it was held.
  Status end_get(std::string_view reader, const ReadLease& lease);

  Result<ObjectRecord> stat(std::string_view key);
  Status remove(std::string_view key);  // kNotFound when absent
  Status touch(std::string_view key, std::chrono::milliseconds ttl);
  Result<std::size_t> contains_prefix(std::span<const std::string> keys);

  Result<EvictCounts> evict(std::uint64_t bytes);

  // Administration (the kvstash CLI).
  // An operator's drain: no new pages on the node, its objects stay until they leave on
  // their own. Returns the node's object count; kNotFound for an unknown node.
  Result<std::uint64_t> cordon_node(std::string_view id);
  // Every node the cell knows (live, draining, dead, not yet forgotten), sorted.
  Result<std::vector<std::string>> known_nodes();
  // Drops what a dead node left behind (its objects are released). Returns how many objects;
  // kNotFound for an unknown node, kInvalidArgument while it is alive.
  Result<std::uint64_t> forget_node(std::string_view id);
  Result<CellSummary> summary();
  // One SCAN step over object keys matching the glob `pattern` ("*" for all), from `cursor`
  // ("0" to start); `count` is SCAN's hint.
  Result<ObjectScan> scan_objects(std::string_view pattern, std::string_view cursor, std::uint32_t count);
  // One SSCAN step over the keys of the objects with a page on node `id`.
  Result<ObjectScan> scan_node_objects(std::string_view id, std::string_view cursor, std::uint32_t count);
  // Objects by key, in order; a key without an object has exists = false.
  Result<std::vector<ObjectInfo>> describe(std::span<const std::string> keys, std::int64_t* now_ms = nullptr);
  // Least recently used objects no reader leases, idle for at least `idle` (0: any), until
  // `max_bytes` (0: no bound) or `limit` objects are chosen; released unless `dry_run`.
  Result<std::vector<EvictedObject>> evict_lru(std::chrono::milliseconds idle, std::uint64_t max_bytes,
                                               bool dry_run, std::uint32_t limit,
                                               std::int64_t* now_ms = nullptr);
  // One bounded sweep (at most `limit` items of each kind, so that Redis is held about a
  // millisecond); run it again while the result says `more`.
  Result<ReclaimCounts> reclaim(std::uint32_t limit = 32);

 private:
  RedisClient& redis_;
  std::string prefix_;  // kvs:{kvs:<cell>}
};

// Object keys: 1..1024 bytes. kInvalidArgument otherwise.
Status validate_object_key(std::string_view key);
// Parses "node,page,generation;..." (kCorrupt when malformed).
Result<std::vector<Extent>> parse_extents(std::string_view text);

}  // namespace kvstash::metadata

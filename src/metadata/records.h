// The words of the metadata plane that every audience shares: the records the Lua scripts keep
// (nodes, objects and their extents, leases) as the catalogs hand them out, and the rules on
// keys and ids (docs/metadata.md). Plain values: no I/O, safe from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/checksum.h"
#include "kvstash/status.h"

namespace kvstash::metadata {

// The schema this build reads and writes (the cell's `schema` field).
// 2: puts' pages return only through their memory nodes' fences (`fenced`), and a restarted
// or dead node's objects are swept in batches.
// 3: an object's checksum is the xxh3 tree (common/checksum.h), stored as "<hex>/<segment>".
inline constexpr int kSchemaVersion = 4;

struct NodeRecord {
  std::string id;     // stable across restarts: [A-Za-z0-9._-], at most 64 bytes
  std::string epoch;  // random per start: a new epoch means the old memory is gone
  std::uint64_t page_size = 0;
  std::uint64_t page_count = 0;
  std::string address;               // the node engine's address blob
  std::string key;                   // the pool region's remote-key blob
  std::string grant_key;             // hex of the HMAC key the cell signs this node's grants with
  std::uint64_t tier_slots = 0;      // slots (of one page) of its NVMe tier; 0: none
  std::uint64_t tier_low_water = 0;  // pages: objects move down while fewer are free
  // The tier's identity (its superblock's): the same id at a new registration keeps the
  // tier's objects; another one starts the tier over.
  std::string tier_id;
};

// How to reach a node's pool.
struct NodeEndpoint {
  std::string id;
  std::string address;
  std::string key;
  // In a placement: the node's grant for the operation's lease over its pages (kvstash/grant.h);
  // empty from a node that registered no grant key.
  std::string grant;
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

// Pages a `size`-byte object spans (page_size > 0, as every parsed Placement has);
// `size + page_size - 1` would wrap for a size near 2^64 (a corrupt record's) and make zero
// extents look right.
inline std::uint64_t pages_for(std::uint64_t size, std::uint64_t page_size) {
  return size / page_size + (size % page_size != 0 ? 1 : 0);
}

// A run of a page reservation's pages (Catalog::reserve_pages): [first, first + count) in the
// order the reservation listed them.
struct ReservedPages {
  std::string_view reservation;  // its token
  std::uint64_t first = 0;
  std::uint64_t count = 0;
};

// A leased read: what the object is and where its pages are.
struct ReadLease {
  std::string object_token;  // the put that wrote it
  std::uint64_t size = 0;
  sum::ObjectSum checksum;
  std::string layout;
  Placement placement;
  // Set instead of a placement when the object is on this node's NVMe tier: its promotion
  // back into the pool is queued, and a get asks again (docs/nvme-tier.md).
  std::string promoting_node;
};

struct ObjectRecord {
  std::uint64_t size = 0;
  sum::ObjectSum checksum;
  std::string layout;
  std::uint64_t pages = 0;
  std::vector<std::string> nodes;
  std::int64_t ttl_ms = -1;     // time left; -1: no expiry
  std::string version;          // the token of the put that wrote it
  std::vector<Extent> extents;  // in object order (none while on the NVMe tier)
  std::string tier = "dram";    // or "ssd": on its node's NVMe tier
};

struct NodeStatus {
  std::string state;  // up, draining, dead, gone
  std::string epoch;
  std::uint64_t page_size = 0;
  std::uint64_t page_count = 0;
  std::uint64_t free_pages = 0;
  std::uint64_t objects = 0;
  std::int64_t heartbeat_in_ms = 0;  // until the heartbeat deadline; negative: past it
  // Pages of pending puts and reservations within their lease, and pages no object holds that
  // are not free yet (released under a reader's lease, or of a put past its lease or aborted,
  // until the node fences it). The rest of the used pages hold objects.
  std::uint64_t reserved_pages = 0;
  std::uint64_t limbo_pages = 0;
  // Its NVMe tier (all 0: none): slots of one page, free ones, objects on it.
  std::uint64_t tier_slots = 0;
  std::uint64_t tier_free_slots = 0;
  std::uint64_t tier_objects = 0;
  // Its tier's last recovery into the cell (docs/metadata.md, "A cell that lost its Redis"):
  // state pending, running or done ('' when none ran), the headers its node found on the
  // device, checked against their bytes, and found not matching, and the objects the cell
  // admitted or refused (a newer object under the key, expired, a copy).
  struct Recovery {
    std::string state;
    std::uint64_t found = 0, checked = 0, bad = 0, admitted = 0, refused = 0;
  };
  Recovery recovery;
  std::uint64_t object_pages() const {
    const std::uint64_t other = free_pages + reserved_pages + limbo_pages;
    return page_count > other ? page_count - other : 0;
  }
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
  // The nodes' NVMe tiers (docs/nvme-tier.md): objects and slots on them now; objects moved
  // down, promoted back, gets that found theirs there, evicted from a full tier, and lost
  // there (the device failed or the bytes did not match their sum).
  std::uint64_t tier_objects = 0;
  std::uint64_t tier_slots = 0;
  std::uint64_t tier_free_slots = 0;
  std::uint64_t written_down = 0;
  std::uint64_t promoted = 0;
  std::uint64_t tier_hits = 0;
  std::uint64_t tier_evicted = 0;
  std::uint64_t tier_lost = 0;
};

// The cell's eviction policy: "lru" or "arc", and ARC's lists (empty under lru).
struct EvictionPolicyState {
  std::string name = "lru";
  std::uint64_t t1 = 0;       // objects used once lately
  std::uint64_t t2 = 0;       // objects used at least twice
  std::uint64_t b1 = 0;       // keys evicted from T1 that ARC remembers
  std::uint64_t b2 = 0;       // and from T2
  double t1_target = 0;       // p: how many objects T1 should hold
  std::uint64_t ordered = 0;  // turn-ttl: objects it orders by when they are due
  std::uint64_t ghosts = 0;   // turn-ttl: evicted keys whose turn it remembers
  double clock_rate = 0;      // turn-ttl: its seconds per second (1 but in a replay)
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
  std::string tier = "dram";               // or "ssd": on its node's NVMe tier
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

// The prefix of every key of cell `cell`: kvs:{kvs:<cell>} (one hash tag for the whole cell).
std::string cell_prefix(std::string_view cell);

// Replicas (PutOptions::replicas): copy i > 0 of object `key` is the object key + '\x1f' + i,
// an object of its own; at most kMaxCopies copies in all. Keys holding '\x1f' followed by a
// digit are the copies' (docs/metadata.md, Replicas).
inline constexpr std::uint32_t kMaxCopies = 4;
std::string copy_key(std::string_view key, std::uint32_t i);
// Object keys: 1..1024 bytes. kInvalidArgument otherwise.
Status validate_object_key(std::string_view key);
// Node ids: 1..64 characters of [A-Za-z0-9._-].
bool valid_node_id(std::string_view id);
// The most pages one object may span (4 GiB in 4 KiB pages, 4 TiB in 4 MiB ones): a put of
// more is kInvalidArgument, a record naming more kCorrupt.
inline constexpr std::uint64_t kMaxObjectPages = 1ull << 20;
// Parses "node,page,generation[,count];..." (runs of `count` pages, 1 when absent) into one
// Extent per page, in order (kCorrupt when malformed, or past kMaxObjectPages).
Result<std::vector<Extent>> parse_extents(std::string_view text);

}  // namespace kvstash::metadata

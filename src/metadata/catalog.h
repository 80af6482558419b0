// The client's catalog: what a store does to the metadata of a cell (docs/metadata.md) around
// its one-sided transfers. A put is begin_put (pages and a put lease), the writes, commit_put
// (or abort_put); a get is begin_get (a read lease), the reads, end_get; and stat, remove,
// touch and contains_prefix on objects by key.
//
// Its audience is the client (src/store; the kvstash CLI's show, rm and touch). The memory
// node's scripts are in node_catalog.h, the operator's in cell_admin.h; metadata::Cell
// (cell.h) hands out all three over one connection. Every call is one Lua script (scripts.h),
// so each is atomic; time comes from Redis. Replies are parsed defensively: a record that was
// corrupted or written by something else gives kCorrupt, never a crash.
//
// Thread safety: as the RedisClient it uses (one thread at a time); every call blocks on one
// Redis round trip (two when Redis had to load the script), bounded by the client's timeouts
// and deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvstash/object.h"
#include "metadata/records.h"
#include "metadata/redis_client.h"

namespace kvstash::metadata {

// A KeepHint as the cell's scripts read it (prelude/policy.lua's ttl_hint): "turn chunks index tokens
// sampled draw looked_up"; "" for none.
std::string keep_hint_text(const std::optional<KeepHint>& hint);

// The most event data one object carries (announce): a chunk's block hashes and token ids.
inline constexpr std::size_t kMaxEventData = 64 * 1024;

class Catalog {
 public:
  // Over `redis`, which must outlive it; `cell` names the cell (key prefix kvs:{kvs:<cell>}).
  explicit Catalog(RedisClient& redis, std::string cell = "default");

  const std::string& prefix() const { return prefix_; }

  // kCorrupt when the cell was written by a schema this build does not know.
  Status check_schema();
  // The cell's rkey scope (kConnection when unset); kCorrupt for a value this build does not
  // know. The operator sets it (CellAdmin::set_rkey_scope); a store reads it when it opens.
  Result<RkeyScope> rkey_scope();

  // Allocates pages for a `size`-byte object under a fresh put `token` (evicting when
  // short) and records a pending put leased for `lease`. No page comes from a node in
  // `avoid` (ones the client just failed to reach: id and pool key; the address is not
  // looked at) while other nodes can hold the object, unless it registered again since.
  // kNoSpace when the live nodes cannot hold it; kInvalidArgument for a bad key.
  Result<Placement> begin_put(std::string_view token, std::string_view key, std::uint64_t size,
                              std::chrono::milliseconds lease, std::span<const NodeEndpoint> avoid = {}) {
    return place_put(token, key, size, lease, avoid, "spread");
  }
  // begin_put for a copy of an object put with replicas: all its pages on one node while one
  // can hold them (evicting there), so that each other copy finds a node apart; never on a
  // node in `apart` (the earlier copies'), however full the others are (kNoSpace then).
  Result<Placement> begin_copy(std::string_view token, std::string_view key, std::uint64_t size,
                               std::chrono::milliseconds lease, std::span<const NodeEndpoint> avoid,
                               std::span<const NodeEndpoint> apart);
  // Makes the put visible (with its TTL; 0 = none), releasing an object it replaces.
  // kStale when the lease ran out and the pages were reclaimed, or a node of the put died,
  // or `if_version` is set and the key holds another object than the put token it names
  // ("": none at all); the put's pages are freed then.
  // `copies`: how many copies of the object its put wrote (PutOptions::replicas; copy i > 0
  // is the object copy_key(key, i), committed before this one); copies numbered that or more,
  // left by an earlier put, are released.
  // `keep`: the put's keep_hint_text.
  // `commit_by_ms`: Redis's time (ms) after which the commit is refused kTimeout, changing
  // nothing: the client stopped waiting for it by then (Store::Impl::commit_by); 0: never.
  // `event`: the object's KV event data (PutOptions::event; empty: none), recorded in the same
  // script while the cell's events are on; `announced`, when given, says whether it was.
  Status commit_put(std::string_view token, std::string_view key, const sum::ObjectSum& checksum,
                    std::string_view layout, std::chrono::milliseconds ttl,
                    const std::optional<std::string>& if_version = std::nullopt, std::uint32_t copies = 1,
                    std::string_view keep = {}, std::int64_t commit_by_ms = 0, std::string_view event = {},
                    bool* announced = nullptr);
  // Ends a put that will not commit. Its pages on the nodes in `fenced` (those that confirmed
  // that none of its writes can land any more: Peer::revoke) and on dead nodes are freed now;
  // the others return once the lease has passed and their nodes have fenced through it
  // (reclaim). Returns how many pages wait for a fence.
  Result<std::uint64_t> abort_put(std::string_view token, std::span<const std::string> fenced);

  // Page reservations: a put in one round trip. reserve_pages allocates the pages of a
  // `size`-byte put as begin_put would (evicting when short) and up to `extra` bytes' more
  // from pages already free, as a
  // pending put of no key under `token`, leased for `lease`, avoiding nodes as begin_put.
  // The puts after it write into consecutive runs of its pages and commit with
  // commit_reserved; the pages no commit took return with release_reservation, or when the
  // lease has passed and the nodes fenced it. Its pages are charged to the quota of `for_key`
  // (the put's key) until puts commit them (each then to its own key's) or they return; its
  // extra pages stay within that quota.
  Result<Placement> reserve_pages(std::string_view token, std::uint64_t size, std::uint64_t extra,
                                  std::chrono::milliseconds lease, std::span<const NodeEndpoint> avoid = {},
                                  std::string_view for_key = {});
  // commit_put for put `token`, whose pages are `pages` of a reservation. kStale when the
  // reservation lost its lease, a node of the put died, or the condition does not hold;
  // kTimeout past `commit_by_ms`, as commit_put.
  Status commit_reserved(const ReservedPages& pages, std::string_view token, std::string_view key,
                         std::uint64_t size, const sum::ObjectSum& checksum, std::string_view layout,
                         std::chrono::milliseconds ttl,
                         const std::optional<std::string>& if_version = std::nullopt,
                         std::uint32_t copies = 1, std::string_view keep = {}, std::int64_t commit_by_ms = 0,
                         std::string_view event = {}, bool* announced = nullptr);
  // commit_reserved of many puts in one script (a KV save's chunks, ready together): per put,
  // what commit_reserved would have returned; `announced`, when given, per put whether its
  // event data was recorded.
  struct ReservedCommit {
    ReservedPages pages;
    std::string_view token, key;
    std::uint64_t size = 0;
    sum::ObjectSum checksum;
    std::string_view layout;
    std::chrono::milliseconds ttl{0};
    std::optional<std::string> if_version;
    std::uint32_t copies = 1;
    std::string_view keep;          // keep_hint_text
    std::int64_t commit_by_ms = 0;  // as commit_reserved's
    std::string_view event;         // as commit_reserved's
  };
  Result<std::vector<Status>> commit_reserveds(std::span<const ReservedCommit> puts,
                                               std::vector<bool>* announced = nullptr);
  // Whether a kStale from a commit is its condition (if_version) failing, rather than the
  // put's pages or nodes.
  static bool condition_failed(const Status& commit);
  // Whether a kNoSpace from a put's allocation (begin_put, reserve_pages, begin_copy) is for
  // now only: the pages it needs are held by leases, puts or reservations that end by
  // themselves, rather than beyond the cell's capacity or its quota's.
  static bool pages_held(const Status& refusal);
  // abort_put for a put into `pages`: its pages on `fenced` and dead nodes are freed now, the
  // others return with the reservation. Returns how many pages wait.
  Result<std::uint64_t> abort_reserved(const ReservedPages& pages, std::span<const std::string> fenced);
  // Frees the reservation's pages from `from` on (never handed to a put). Returns how many.
  // With `drop`, also ends the reservation's record, unless a page handed to a put is still
  // the reservation's (neither committed nor freed): the record then stays until reclaim.
  Result<std::uint64_t> release_reservation(std::string_view reservation, std::uint64_t from,
                                            bool drop = false);

  // Looks `key` up and leases it for reading under `reader` for `lease`. kNotFound when
  // absent, expired or on a dead node; kCorrupt for a malformed record. An object on a node's
  // NVMe tier gets no lease: its promotion is queued and the lease says `promoting_node` (ask
  // again), or, without `promote`, kNotFound that says it is on the tier. `keep`: the get's
  // keep_hint_text, or "".
  Result<ReadLease> begin_get(std::string_view key, std::string_view reader, std::chrono::milliseconds lease,
                              bool promote = true, std::string_view keep = {});
  // begin_get of many keys in one script (a KV load's chunks), `readers[i]` reading keys[i]:
  // per key its lease, or kNotFound (or kCorrupt for a malformed record). `keep`: each key's
  // keep_hint_text, or none.
  Result<std::vector<Result<ReadLease>>> begin_gets(std::span<const std::string> keys,
                                                    std::span<const std::string> readers,
                                                    std::chrono::milliseconds lease,
                                                    std::span<const std::string> keep = {});
  // For a begin_get that found its object promoting: waits up to `wait` (shorter than the
  // connection's command timeout) for the promotion to end, however it ends; ask again then.
  Status wait_promotion(const ReadLease& promoting, std::chrono::milliseconds wait);
  // Ends the lease; kStale when a page was freed or reused while it was held.
  Status end_get(std::string_view reader, const ReadLease& lease);
  // A read lease to end: who read, and the object token and extents its lease named (empty:
  // the reader ended it while it held, so no page can have moved, and Redis checks none).
  struct EndedRead {
    std::string reader;
    std::string object_token;
    std::string extents_text;
  };
  // end_get for each of `reads`, in one script: one status per read, in order.
  Result<std::vector<Status>> end_gets(std::span<const EndedRead> reads);

  // The object's record (kNotFound when absent or expired).
  Result<ObjectRecord> stat(std::string_view key);
  // kNotFound when absent. `corrupt`: the client found its bytes bad (kvstash explain says so).
  Status remove(std::string_view key, bool corrupt = false);
  // A new TTL (0: none) from now, and a touch of its LRU place. kNotFound when absent.
  Status touch(std::string_view key, std::chrono::milliseconds ttl);
  // How many of `keys`, from the first, are present (the first missing one ends the count).
  Result<std::size_t> contains_prefix(std::span<const std::string> keys);
  // contains_prefix, and the request's conversation turn as turn-ttl counts it.
  Result<PrefixLookup> lookup_prefix(std::span<const std::string> keys);
  // Per leading key present, whether it is on a node's NVMe tier (true) or in a pool (false).
  Result<std::vector<bool>> prefix_tiers(std::span<const std::string> keys);
  // Whether each key is present.
  Result<std::vector<bool>> contains_each(std::span<const std::string> keys);

  // KV events (docs/events.md): each present key of `items` (key, event data) carries its data
  // from now on and goes out as stored. How many were announced; nullopt when the cell's events
  // are off.
  Result<std::optional<std::size_t>> announce(std::span<const std::pair<std::string, std::string>> items);

  // The nodes a client may connect to now: live, and up or draining.
  Result<std::vector<NodeEndpoint>> live_nodes();

  // A grant over node `node`'s whole pool for `op` until `deadline_ms` (ms of Redis time; 0:
  // `ttl` from now), for a pool lease (rkey scope connection). The grant and its deadline.
  // kInvalidArgument under rkey scope lease; kNotFound for a node not serving.
  struct PoolGrant {
    std::string grant;
    std::int64_t deadline_ms = 0;
  };
  Result<PoolGrant> grant_pool(std::string_view node, TransferOp op, std::int64_t deadline_ms,
                               std::chrono::milliseconds ttl);

  // Handoff records (<P>:handoff:<name>, docs/metadata.md): Store::publish_handoff and the rest.
  Status publish_handoff(std::string_view name, std::string_view descriptor,
                         std::span<const std::string> readers, std::chrono::milliseconds ttl);
  Result<std::string> handoff(std::string_view name);  // kNotFound when gone
  Result<bool> end_handoff(std::string_view name, std::string_view reader);
  Result<bool> handoff_pending(std::string_view name, std::string_view reader);

 private:
  // begin_put.lua with its placement argument ("spread", or "one-node" and the nodes apart).
  Result<Placement> place_put(std::string_view token, std::string_view key, std::uint64_t size,
                              std::chrono::milliseconds lease, std::span<const NodeEndpoint> avoid,
                              const std::string& placement);
  RedisClient& redis_;
  std::string prefix_;  // kvs:{kvs:<cell>}
};

}  // namespace kvstash::metadata

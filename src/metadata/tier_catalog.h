// The NVMe tier's catalog: the scripts a memory node runs to move its cold objects down to its
// tier and back (docs/nvme-tier.md). The cell decides what moves and hands out slots as it
// hands out pages; the node moves the bytes (src/node/tier.h).
//
// Its audience is the memory node. Every call is one Lua script, atomic, timed by Redis's
// clock; replies are parsed defensively (kCorrupt for anything malformed).
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

#include "metadata/redis_client.h"

namespace kvstash::metadata {

// Runs of pages (or of a tier's slots) as a script wrote them: `count` from `first` on, in
// object order.
struct PageRun {
  std::uint64_t first = 0;
  std::uint64_t count = 0;
};

// An extent list's runs ("node,page,generation[,count];..."), all of which must be on `node`.
// kCorrupt for anything else.
Result<std::vector<PageRun>> parse_runs(std::string_view text, std::string_view node);

class TierCatalog {
 public:
  // Over `redis`, which must outlive it; `cell` names the cell.
  explicit TierCatalog(RedisClient& redis, std::string cell = "default");

  // One object a write-down moves: its pool pages (on this node) and the slots it got, and
  // what its header on the tier records of its record.
  struct WriteDown {
    std::string key, token;
    std::uint64_t size = 0;
    std::string checksum, layout;
    std::int64_t expires_ms = 0;  // Redis time; 0: never
    std::vector<PageRun> pages, slots;
    std::string slots_text;  // as the cell wrote them: commit and abort name them so
  };
  struct WriteDowns {
    std::int64_t deadline_ms = 0;  // Redis time: commit before it
    std::vector<WriteDown> objects;
  };
  // While node `id` has fewer than `low_water` free pages: its least recently used unleased
  // objects of up to `most_pages` pages, enough to bring its free pages up to `high_water`,
  // each with slots on its tier (the tier's own LRU objects evicted for them when it is full).
  // None when nothing needs to move. kStale when the node is not `epoch`, alive and up.
  Result<WriteDowns> begin_write_down(std::string_view id, std::string_view epoch, std::uint64_t low_water,
                                      std::uint64_t high_water, std::uint64_t most_pages,
                                      std::chrono::milliseconds lease);
  struct Written {
    std::string_view key, token, slots_text, sum;
  };
  // The objects now live on the tier (their pool pages returned): per object OK, or kStale
  // (replaced, leased by a reader, past the deadline: its slots are freed, it stays).
  Result<std::vector<Status>> commit_write_down(std::string_view id, std::string_view epoch,
                                                std::span<const Written> written);
  // Gives back the slots of write-downs that failed (the device's buffers are back). Returns
  // how many were still pending.
  Result<std::uint64_t> abort_write_down(std::string_view id, std::span<const WriteDown> failed);

  // A promotion: the object's slots, and pool pages on this node under a put lease.
  struct Promotion {
    std::string key, token, put_token;
    std::int64_t deadline_ms = 0;
    std::uint64_t size = 0;
    std::vector<PageRun> pages, slots;
    std::string slots_text;
    std::string sum;  // the node's, from the write-down
  };
  // Stages `key` back: nullopt when there is nothing to do (in the pool already, or gone).
  // kStale (the node), kNoSpace (no free pool page for it; with `evict`, not even after
  // evicting the pool's least recently used objects that no reader leases).
  Result<std::optional<Promotion>> begin_promote(std::string_view id, std::string_view epoch, std::string_view key,
                                                 std::string_view put_token, std::chrono::milliseconds lease,
                                                 bool evict);
  // The object lives in the pool again. kStale when it changed meanwhile (its pages are freed).
  Status commit_promote(std::string_view id, std::string_view epoch, const Promotion& p);
  // The promotion's pages go back; with `bad` (EIO, a sum that does not match) the object goes
  // too, if it is still the one promoted: whether it went.
  Result<bool> abort_promote(std::string_view id, const Promotion& p, bool bad);
  // The next key whose promotion a get queued at node `id`, waiting up to `wait` (0: not at
  // all; Redis may let a short wait last 100 ms); nullopt when none came. The connection's
  // command timeout must exceed `wait`.
  Result<std::optional<std::string>> next_promotion(std::string_view id, std::chrono::milliseconds wait);

  // Recovery (recover_tier.lua): a cell that started node `id`'s tier over gets back what the
  // device holds of its recoverable keys. begin: whether one is to run now (the cell started
  // the tier over, and nothing moves down until end).
  Result<bool> begin_recovery(std::string_view id, std::string_view epoch);
  // One object the node found whole on its device (its header, its bytes matching the sum).
  struct Recovered {
    std::string key, token, checksum, layout, runs, sum;  // runs: "first,count;..."
    std::uint64_t size = 0;
    std::int64_t expires_ms = 0;
  };
  enum class Offered { kAdmitted, kKept, kTaken, kExpired, kCopy };
  // The node's counts of headers so far, for `kvstash status`: found on the device, checked
  // against their bytes, and of those, not matching.
  struct RecoveryCounts {
    std::uint64_t found = 0, checked = 0, bad = 0;
  };
  // Per object, what the cell did with it: admitted (or kept, from a recovery before) under
  // this epoch, or refused. kStale when the node or the recovery is no longer current.
  Result<std::vector<Offered>> offer_recovered(std::string_view id, std::string_view epoch, RecoveryCounts counts,
                                               std::span<const Recovered> objects);
  // Ends the recovery: `claimed` (ascending "first,count;...") are the slots of what was
  // admitted or kept; every other slot is free again.
  Status end_recovery(std::string_view id, std::string_view epoch, RecoveryCounts counts, std::string_view claimed);

 private:
  RedisClient& redis_;
  std::string prefix_;  // kvs:{kvs:<cell>}
};

}  // namespace kvstash::metadata

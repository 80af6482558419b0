// Private to src/store: the state a Store shares between its files.
//
//   store.cc          open, the small operations (stat, remove, touch, contains_prefix), async
//   put_stream.cc     puts: begin_put, PutStream (append, commit, abort); Store::put is one
//   reservations.cc   a put's pages: from the client's page reservation, or a begin_put
//   get.cc            gets: begin_get, the reads in waves, checksum, end_get
//   node_links.*      connections to the memory nodes          leases.*    leases over pages
//   transfer_plan.*   what moves where (pure)                  transfers.*  submit and wait
//   slices.*          the caller's slices: length, host check, checksums
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "kvstash/store.h"
#include "metadata/catalog.h"
#include "metadata/cell_pool.h"
#include "metadata/read_releases.h"
#include "store/leases.h"
#include "store/node_links.h"

namespace kvstash {

namespace store {

// A put's or a reader's token in Redis: 128 random bits as hex.
std::string random_token();

// The largest object_layout a record takes.
inline constexpr std::size_t kMaxObjectLayout = 64u << 10;

// Time spent in the metadata plane, when the caller asked for timings.
class MetadataClock {
 public:
  explicit MetadataClock(OpTimings* t) : t_(t), start_(Clock::now()) {}
  ~MetadataClock() {
    if (t_ == nullptr) return;
    t_->metadata += Clock::now() - start_;
    ++t_->redis_round_trips;
  }
  MetadataClock(const MetadataClock&) = delete;
  MetadataClock& operator=(const MetadataClock&) = delete;

 private:
  OpTimings* t_;
  Clock::time_point start_;
};

// A page reservation this client holds (Catalog::reserve_pages): its puts take consecutive
// runs of its pages, and each commits with one Redis round trip.
struct Reservation {
  std::string token;
  metadata::Placement placement;  // every page, in the reservation's order
  Clock::time_point lease_until;  // local time by which every write into it has ended
  std::uint64_t next = 0;         // pages [0, next) went to puts (guarded by Impl::reserve_mu)
};

// A put's pages and how Redis knows the put.
struct PutPages {
  std::string token;                         // the put's (the object's, once committed)
  metadata::Placement placement;             // the put's pages only
  Clock::time_point lease_until;             // its writes end by then
  std::shared_ptr<Reservation> reservation;  // where the pages came from; null: its own begin_put
  std::uint64_t first = 0;                   // the reservation's [first, first + pages)
  bool held = false;  // taken from a reservation held before this put (no round trip): a
                      // node may have failed since, so a put that fails on it tries again once

  metadata::ReservedPages run() const { return {reservation->token, first, placement.extents.size()}; }
};

}  // namespace store

struct CancelToken::State {
  std::mutex mu;
  bool cancelled = false;
  std::vector<Batch*> waiting;  // batches of gets holding the token, while they may run
};

struct Store::Impl {
  StoreOptions options;
  RkeyScope scope = RkeyScope::kConnection;  // the cell's, or options.rkey_scope
  std::unique_ptr<Engine> engine;
  std::unique_ptr<store::NodeLinks> links;
  std::unique_ptr<store::AvoidedNodes> avoided;  // nodes puts take no pages from, for now

  std::unique_ptr<metadata::CellPool> cells;  // Redis connections, held only around metadata calls

  std::unique_ptr<ThreadPool> workers;
  std::unique_ptr<ThreadPool> hashers;  // help hash a large put's segments (sum_segments)
  unsigned hasher_count = 0;
  std::unique_ptr<ThreadPool> releaser;  // ends read leases off the gets' critical path
  metadata::ReadReleases read_releases;  // the read leases it has yet to end, in batches
  std::unique_ptr<ThreadPool> aborter;   // confirms failed puts' fences off the callers' path

  // A Redis connection for one operation, its commands bounded by the operation's deadline.
  Result<metadata::CellPool::Borrowed> borrow(Deadline deadline) { return cells->borrow(deadline); }

  template <typename Fn>
  auto with_catalog(std::optional<Deadline> deadline, Fn fn)
      -> decltype(fn(std::declval<metadata::Catalog&>())) {
    KVSTASH_ASSIGN_OR_RETURN(auto c, borrow(deadline.value_or(deadline_after(options.timeout))));
    return fn(*c);
  }

  store::LeasePolicy lease_policy() const { return {scope, options.put_lease}; }

  // After a commit on `redis`: waits, within `deadline`, until options.commit_replicas
  // replicas have its writes (Redis WAIT). kUnavailable, the object committed, when fewer did.
  Status wait_for_replicas(metadata::RedisClient& redis, Deadline deadline);

  // ---- a put's pages (reservations.cc)
  std::mutex reserve_mu;
  std::shared_ptr<store::Reservation> reservation;  // the one puts take pages from
  // Pages for a put of `size` bytes: a run of the reservation when it has enough and enough
  // lease left (no round trip), else a new reservation (or, with options.put_reservation 0, a
  // begin_put of the put's own). Errors name no key.
  Result<store::PutPages> put_pages(std::string_view key, std::uint64_t size, Deadline deadline,
                                    OpTimings* timings);
  // commit_put or commit_reserved. A reservation that came back kStale is no longer taken from.
  Status commit_pages(metadata::Catalog& c, const store::PutPages& pages, std::string_view key,
                      std::uint64_t size, const sum::ObjectSum& checksum, const PutOptions& o);
  // abort_put or abort_reserved.
  Result<std::uint64_t> abort_pages(metadata::Catalog& c, const store::PutPages& pages,
                                    std::span<const std::string> fenced);
  // Returns the pages of `r` no put was given, in Redis (errors only logged: the lease and the
  // nodes' fences reclaim them); release_unused_later does it on the releaser thread.
  void release_unused(const std::shared_ptr<store::Reservation>& r, Deadline deadline);
  void release_unused_later(std::shared_ptr<store::Reservation> r);
  // A put in `r` failed, or its commit came back stale (a node may be gone): when puts still
  // take pages from `r`, the next ones reserve afresh, and its unused pages go back.
  void retire(const std::shared_ptr<store::Reservation>& r);

  // ---- puts (put_stream.cc)
  // Ends a put that will not commit, once its batches have ended (see put_stream.cc).
  void abort_put(const std::string& key, const store::PutPages& pages, std::vector<store::HeldLease> leases,
                 Deadline deadline);
  // abort_put in Redis (errors only logged: the lease and the nodes' fences reclaim).
  void end_put(const std::string& key, const store::PutPages& pages, const std::vector<std::string>& fenced,
               Deadline deadline);
  // The sums of the `count` consecutive segments of `segment` bytes that the slices hold from
  // their start (the last one may be shorter, ending at `size`), computed by the calling
  // thread and the store's hashing threads in turn.
  std::vector<std::uint64_t> sum_segments(std::span<const Slice> slices, std::uint64_t size,
                                          std::uint64_t segment);

  // ---- gets (get.cc)
  // Reads into `into`, or (when `into_for` is set) into the slices it returns once the
  // object's size is known.
  Result<ObjectInfo> get(std::string_view key, std::span<const Slice> into, const GetInto* into_for,
                         const GetOptions& o);
  // Ends a read lease on the releaser thread (errors only logged: the lease expires anyway).
  void release_later(const std::string& reader, const metadata::ReadLease& lease);
};

}  // namespace kvstash

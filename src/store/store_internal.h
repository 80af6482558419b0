// Private to src/store: the state a Store shares between its files.
//
//   store.cc          open, the small operations (stat, remove, touch, contains_prefix), async
//   cells.cc          the deployment's cells: which one a key's metadata is in (metadata/cell_routes.h)
//   put_stream.cc     puts: begin_put, PutStream (append, commit, abort); Store::put is one
//   reservations.cc   a put's pages: from the client's page reservation, or a begin_put
//   get.cc            gets: begin_get, the reads in waves, checksum, end_get
//   node_links.*      connections to the memory nodes          leases.*    leases over pages
//   transfer_plan.*   what moves where (pure)                  transfers.*  submit and wait
//   slices.*          the caller's slices: length, host check, checksums
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "kvstash/metrics.h"
#include "kvstash/store.h"
#include "metadata/catalog.h"
#include "metadata/cell_pool.h"
#include "metadata/read_releases.h"
#include "store/leases.h"
#include "store/node_links.h"

namespace kvstash {

namespace store {

// The Store's metrics (Store::metrics_text; docs/operations.md, "Engine-side metrics"): every
// operation by its outcome and latency, the bytes it moved, and per transport the bytes the
// transfers moved.
enum class MeteredOp : std::uint8_t {
  kPut,
  kPutStream,
  kGet,
  kLookup,
  kRemove,
  kRemoveCorrupt,
  kTouch,
  kStat
};

struct Meters {
  metrics::Registry registry;
  // [read, write][TransportKind]: bytes of transfers that completed.
  std::array<std::array<metrics::Counter*, 4>, 2> moved{};
  Meters();
  // One operation `op` ended with `s` after `started`, moving `bytes` (OK only).
  void op(MeteredOp op, const Status& s, Clock::time_point started, std::uint64_t bytes = 0);

 private:
  // Each operation's series, made in the registry on first use (so that its text names only
  // what happened) and kept here: after that an operation takes no lock.
  struct OpSeries {
    std::atomic<metrics::Histogram*> duration{nullptr};
    std::atomic<metrics::Counter*> bytes{nullptr};
    std::array<std::atomic<metrics::Counter*>, static_cast<std::size_t>(StatusCode::kInternal) + 1>
        outcomes{};
  };
  std::array<OpSeries, static_cast<std::size_t>(MeteredOp::kStat) + 1> ops_;
};

// A put's or a reader's token in Redis: 128 random bits as hex.
std::string random_token();

// The status of an operation's outcome, whichever form it takes.
inline Status status_of(const Status& s) { return s; }
template <typename T>
Status status_of(const Result<T>& r) {
  return r.status();
}

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

struct Reservation;

// One cell of the deployment, as this store uses it: its Redis connections, the page
// reservation its puts take from, the read leases to end there. Opened on first use, kept
// until the store closes (a get may still look in a cell the directory dropped).
struct CellLink {
  std::string name;
  std::unique_ptr<metadata::CellPool> pool;
  std::shared_ptr<Reservation> reservation;  // the one puts take pages from (guarded by Impl::reserve_mu)
  metadata::ReadReleases read_releases;      // read leases yet to end there, in batches
};

// The cells the store routes over (metadata/cell_routes.h): puts go to `cells`' choice, gets look in
// `previous`' choice first while it is set. Immutable once built; a directory change builds a
// new one.
struct CellMap {
  std::vector<std::string> cells, previous;
  std::vector<CellLink*> links, previous_links;  // one per name, in the same order
  std::int64_t epoch = 0;
};

// A page reservation this client holds (Catalog::reserve_pages): its puts take consecutive
// runs of its pages, and each commits with one Redis round trip. Its record in Redis goes as
// soon as it is retired (no put takes from it any more) and every put that took pages from it
// has settled: committed, or aborted with every node confirming its fence. Only a put whose
// pages wait for a node's fence keeps the record until its lease has passed (reclaim).
struct Reservation {
  CellLink* cell = nullptr;  // where its pages are
  std::string token;
  metadata::Placement placement;  // every page, in the reservation's order
  Clock::time_point lease_until;  // local time by which every write into it has ended
  Clock::time_point answered_at;  // local time its placement came back (Impl::commit_by)
  // Guarded by Impl::reserve_mu:
  std::uint64_t next = 0;       // pages [0, next) went to puts
  std::uint32_t unsettled = 0;  // puts that took pages and have not settled yet
  bool retired = false;         // no put takes from it any more; its unused pages went back
  bool lingering = false;       // a put's pages wait for a node's fence: the record stays
  bool dropped = false;         // its record was asked to go
};

// A put's pages and how Redis knows the put.
struct PutPages {
  CellLink* cell = nullptr;                  // the cell the put's metadata is in
  std::string token;                         // the put's (the object's, once committed)
  metadata::Placement placement;             // the put's pages only
  Clock::time_point lease_until;             // its writes end by then
  Clock::time_point answered_at;             // local time its placement came back (Impl::commit_by)
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

// A batch of read leases (Store::lease_reads; get.cc). Each get that names it takes its key's
// lease once; the leases its gets hand back go to Redis together when the last one is back,
// and the ones no get took when the batch goes.
struct ReadLeases::State {
  struct Entry {
    Result<metadata::ReadLease> lease = Status::internal("unset");  // or the batch's kNotFound
    std::string reader;
    store::CellLink* cell = nullptr;
    bool taken = false;
  };
  // What a get takes: its lease (or kNotFound), its reader, its cell, when it was leased.
  struct Taken {
    Result<metadata::ReadLease> lease = Status::internal("unset");
    std::string reader;
    store::CellLink* cell = nullptr;
    Clock::time_point leased_at;
  };

  Store::Impl* impl = nullptr;
  Clock::time_point leased_at;
  std::mutex mu;
  std::map<std::string, Entry, std::less<>> entries;                             // guarded by mu
  std::size_t open = 0;                                                          // found, not yet handed back
  std::vector<std::pair<store::CellLink*, metadata::Catalog::EndedRead>> ended;  // guarded by mu

  ~State();
  // `key`'s lease, taken now; nullopt when the batch has none for this get (not in the batch,
  // or taken already).
  std::optional<Taken> take(std::string_view key);
  // A get that took a lease is done with it: `read` ends it in Redis (nullopt: the get ended it
  // itself). The last one hands every ended lease to Redis.
  void hand_back(store::CellLink& cell, std::optional<metadata::Catalog::EndedRead> read);
  // Sends `ended` to Redis on the releaser thread (mu held).
  void flush_locked();
};

struct Store::Copy {
  std::uint32_t copies = 1;                   // of the put in all
  std::vector<metadata::NodeEndpoint> apart;  // nodes the earlier copies are on
};

struct Store::Impl {
  StoreOptions options;
  store::Meters meters;
  RkeyScope scope = RkeyScope::kConnection;  // the cell's, or options.rkey_scope
  std::unique_ptr<Engine> engine;
  std::unique_ptr<store::NodeLinks> links;
  std::unique_ptr<store::AvoidedNodes> avoided;  // nodes puts take no pages from, for now

  // The deployment's cells (cells.cc): links by name, the map routed over now, and (with
  // options.cell_directory) a connection to the directory and when it was read.
  std::mutex cells_mu;
  std::map<std::string, std::unique_ptr<store::CellLink>, std::less<>> cell_links;  // guarded by cells_mu
  std::shared_ptr<const store::CellMap> map;                                        // guarded by cells_mu
  std::unique_ptr<metadata::RedisClient> directory;                                 // guarded by refresh_mu
  std::mutex refresh_mu;
  Clock::time_point map_read_at;  // guarded by refresh_mu

  std::unique_ptr<ThreadPool> workers;
  std::unique_ptr<ThreadPool> hashers;  // help hash a large put's segments (sum_segments)
  unsigned hasher_count = 0;
  std::unique_ptr<ThreadPool> releaser;  // ends read leases off the gets' critical path
  std::unique_ptr<ThreadPool> aborter;   // confirms failed puts' fences off the callers' path

  // ---- the cells (cells.cc)
  // Builds the map from the options (cells, or the one cell) or the directory, opening the
  // links it names; it replaces the current one only when every link opened.
  Status load_cell_map(Deadline deadline);
  // The map to route by now; with a directory, read again first when it is older than
  // options.cell_directory_refresh (a failed read keeps the old map, and is logged).
  std::shared_ptr<const store::CellMap> cell_map(Deadline deadline);
  // The cell a put of `key` goes to.
  store::CellLink& put_cell(std::string_view key, Deadline deadline);
  // The cells a get of `key` looks in, in order: the previous set's choice, then the current.
  std::vector<store::CellLink*> get_cells(std::string_view key, Deadline deadline);

  // After a put of `key` committed in `committed_in`: removes the copy an earlier put left in
  // the previous set's choice (gets look there first until the change settles, and would find
  // it). kUnavailable when it could not, the put committed.
  Status remove_older_copy(std::string_view key, store::CellLink& committed_in, Deadline deadline);

  // A Redis connection to `cell` for one operation, its commands bounded by its deadline.
  Result<metadata::CellPool::Borrowed> borrow(store::CellLink& cell, Deadline deadline) {
    return cell.pool->borrow(deadline);
  }

  // fn(catalog) in each cell a get of `key` looks in, until one answers other than kNotFound.
  template <typename Fn>
  auto with_catalog(std::string_view key, std::optional<Deadline> deadline, Fn fn)
      -> decltype(fn(std::declval<metadata::Catalog&>())) {
    const Deadline d = deadline.value_or(deadline_after(options.timeout));
    const auto cells = get_cells(key, d);
    for (std::size_t i = 0;; ++i) {
      KVSTASH_ASSIGN_OR_RETURN(auto c, borrow(*cells[i], d));
      auto r = fn(*c);
      if (i + 1 == cells.size() || store::status_of(r).code() != StatusCode::kNotFound) return r;
    }
  }

  // How an operation on objects of `cell` leases their pages.
  store::LeasePolicy lease_policy(store::CellLink& cell) {
    return {scope, options.put_lease,
            [this, &cell](const std::string& node, TransferOp op, std::int64_t deadline_ms,
                          std::chrono::milliseconds ttl, Deadline d) -> Result<metadata::Catalog::PoolGrant> {
              KVSTASH_ASSIGN_OR_RETURN(auto c, borrow(cell, d));
              return c->grant_pool(node, op, deadline_ms, ttl);
            }};
  }

  // After a commit on `redis`: waits, within `deadline`, until options.commit_replicas
  // replicas have its writes (Redis WAIT). kUnavailable, the object committed, when fewer did.
  Status wait_for_replicas(metadata::RedisClient& redis, Deadline deadline);

  // ---- a put's pages (reservations.cc)
  std::mutex reserve_mu;
  std::shared_ptr<store::Reservation> reservation;  // the one puts take pages from
  // Pages for a put of `size` bytes: a run of the reservation when it has enough and enough
  // lease left (no round trip), else a new reservation (or, with options.put_reservation 0, a
  // begin_put of the put's own). Errors name no key.
  // `apart`: nodes it must not use (the other copies'); `one_node`: a copy of a put with
  // replicas, all on one node where one can hold it, so that the other copies find nodes apart.
  // Either makes it a begin_put of its own. When every page the put could have is held for
  // now (Catalog::pages_held), asks again for up to options.wait_for_pages within `deadline`.
  Result<store::PutPages> put_pages(store::CellLink& cell, std::string_view key, std::uint64_t size,
                                    Deadline deadline, OpTimings* timings,
                                    std::span<const metadata::NodeEndpoint> apart = {},
                                    bool one_node = false);
  // One try of put_pages.
  Result<store::PutPages> place_pages(store::CellLink& cell, std::string_view key, std::uint64_t size,
                                      Deadline deadline, OpTimings* timings,
                                      std::span<const metadata::NodeEndpoint> apart, bool one_node);
  // The Redis time (ms) after which a commit of `pages` sent now must not take effect: when
  // this client stops waiting for its answer (the command's timeout or `deadline`, whichever
  // comes first), seen on Redis's clock through the placement's lease (its deadline, and when
  // its reply came back: the latest local time the script can have run). A commit delayed
  // past it in the network (a partition that heals, a stalled Redis) is refused, so that a
  // put that returned kTimeout never becomes the object after later puts of its key. 0: none.
  std::int64_t commit_by(const store::PutPages& pages, Deadline deadline) const;
  // commit_put or commit_reserved. A reservation that came back kStale is no longer taken from.
  Status commit_pages(metadata::Catalog& c, const store::PutPages& pages, std::string_view key,
                      std::uint64_t size, const sum::ObjectSum& checksum, const PutOptions& o,
                      std::uint32_t copies, Deadline deadline, bool* announced = nullptr);
  // After a commit of reserved pages answered `s`: a reservation that came back kStale is no
  // longer taken from.
  void reservation_committed(const store::PutPages& pages, const Status& s);
  // abort_put or abort_reserved.
  Result<std::uint64_t> abort_pages(metadata::Catalog& c, const store::PutPages& pages,
                                    std::span<const std::string> fenced);
  // Retires `r`: no put takes from it any more, the pages no put was given go back in its
  // cell, and its record goes too when every put from it has settled (errors only logged: the
  // lease and the nodes' fences reclaim them). end_reservation_later does it on the releaser
  // thread.
  void end_reservation(const std::shared_ptr<store::Reservation>& r, Deadline deadline);
  // Catalog::release_reservation of `r` from page `from` (with `drop`, its record too); a
  // failure is only logged: the lease and the nodes' fences reclaim.
  void release_reservation(const store::Reservation& r, std::uint64_t from, bool drop, Deadline deadline);
  void end_reservation_later(std::shared_ptr<store::Reservation> r);
  // A put in `r` failed, or its commit came back stale (a node may be gone): when puts still
  // take pages from `r`, the next ones reserve afresh, and its unused pages go back.
  void retire(std::shared_ptr<store::Reservation> r);  // a copy: it may be the cell's own pointer
  // A put from a reservation ended: committed, or aborted (`clean`: every page of it is free
  // again; otherwise some wait for a node's fence). The last put of a retired reservation drops
  // its record.
  void settle(const store::PutPages& pages, bool clean);

  // ---- puts (put_stream.cc)
  // Ends a put that will not commit, once its batches have ended (see put_stream.cc).
  void abort_put(const std::string& key, const store::PutPages& pages, std::vector<store::HeldLease> leases,
                 Deadline deadline);
  // abort_put in Redis (errors only logged: the lease and the nodes' fences reclaim), then
  // settles the put's reservation.
  void end_put(const std::string& key, const store::PutPages& pages, const std::vector<std::string>& fenced,
               Deadline deadline);
  // A put whose writes all completed but whose commit failed or may not have happened (a
  // timeout, Redis unreachable): on the aborter thread, abort_put with every node confirmed
  // (no write can land any more), which frees its pages unless the commit did happen.
  void end_uncommitted_later(const std::string& key, const store::PutPages& pages);
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
  // Ends read leases in `cell` on the releaser thread, as few scripts as the queue allows
  // (errors only logged: the leases expire anyway).
  void release_later(store::CellLink& cell, std::span<const metadata::Catalog::EndedRead> reads);
};

}  // namespace kvstash

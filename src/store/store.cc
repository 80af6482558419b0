// The Store: metadata scripts around one-sided transfers. A put is begin_put (pages), the
// writes, commit_put; a get is begin_get (read lease), the reads, end_get (generations),
// and the checksum. Redis connections are borrowed only around metadata calls, so a slow
// transfer never holds one.
#include "kvstash/store.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "common/checksum.h"
#include "common/log.h"
#include "common/system.h"
#include "common/thread_pool.h"
#include "common/turn.h"
#include "metadata/catalog.h"

namespace kvstash {

std::string_view to_string(RkeyScope s) { return s == RkeyScope::kLease ? "lease" : "connection"; }

std::optional<RkeyScope> parse_rkey_scope(std::string_view s) {
  if (s == "connection") return RkeyScope::kConnection;
  if (s == "lease") return RkeyScope::kLease;
  return std::nullopt;
}

struct CancelToken::State {
  std::mutex mu;
  bool cancelled = false;
  std::vector<Batch*> waiting;  // batches of gets holding the token, while they may run
};

namespace {

using metadata::Catalog;
using metadata::Placement;

constexpr std::size_t kMaxLayout = 64u << 10;

std::string random_token() {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::uint8_t raw[16];
  sys::random_bytes(raw, sizeof raw);
  std::string s;
  s.reserve(32);
  for (std::uint8_t b : raw) {
    s.push_back(kDigits[b >> 4]);
    s.push_back(kDigits[b & 0xf]);
  }
  return s;
}

std::uint64_t total_length(std::span<const Slice> slices) {
  std::uint64_t n = 0;
  for (const Slice& s : slices) n += s.length;
  return n;
}

// An object's checksum (common/checksum.h) over host slices, fed in order as the bytes
// become available.
class SliceHasher {
 public:
  SliceHasher(std::span<const Slice> slices, std::uint64_t segment) : slices_(slices), hash_(segment) {}

  // Hashes the object's bytes up to `end` (from where the last call stopped).
  void advance_to(std::uint64_t end) {
    while (hash_.bytes() < end && si_ < slices_.size()) {
      const Slice& s = slices_[si_];
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(s.length - soff_, end - hash_.bytes()));
      hash_.update(static_cast<const std::byte*>(s.addr) + soff_, n);
      soff_ += n;
      if (soff_ == s.length) ++si_, soff_ = 0;
    }
  }
  sum::ObjectSum digest() { return hash_.finish(); }

 private:
  std::span<const Slice> slices_;
  sum::ObjectHasher hash_;
  std::size_t si_ = 0, soff_ = 0;
};

// kInvalidArgument when a slice lies in device memory: the store reads no byte of it (a
// device sums it where it is: PutStream::append_summed, KvCache).
Status host_only(std::span<const Slice> slices, std::string_view what) {
  for (const Slice& s : slices) {
    if (s.memory != nullptr && s.memory->region().kind != MemoryKind::kHost) {
      return Status::invalid_argument("store: " + std::string(what) +
                                      " reads device memory, which the host must not touch: sum it on the "
                                      "device (PutStream::append_summed, KvCache) or turn the check off");
    }
  }
  return {};
}

// A get's reads go in waves of this many bytes so that each wave is checksummed while the
// next ones still move (and while its bytes are still in cache).
constexpr std::uint64_t kWaveBytes = 4u << 20;

// Time spent in the metadata plane, when the caller asked for timings.
class MetadataClock {
 public:
  explicit MetadataClock(OpTimings* t) : t_(t), start_(Clock::now()) {}
  ~MetadataClock() {
    if (t_ == nullptr) return;
    t_->metadata += Clock::now() - start_;
    ++t_->redis_round_trips;
  }

 private:
  OpTimings* t_;
  Clock::time_point start_;
};

// A connection to one memory node's pool, shared by every operation touching the node.
struct NodeLink {
  struct Path {
    std::unique_ptr<Peer> peer;
    RemoteMemory remote;  // the pool, imported through `peer`
  };

  std::string id;
  std::string address;
  std::string key;
  // Guards the fields below; never held while connecting: connecting is one caller's turn,
  // and the others wait for it only up to their own deadlines. Once connected they do not
  // change.
  std::mutex mu;
  Turn connecting;
  bool connected = false;
  // The best transport to the node; and for writes, when that one cannot be fenced at the
  // node (UCX), the best one that can: a put's writes must be stoppable at the node.
  Path main;
  Path fenced_writes;

  // rkey_scope connection: per path and op, a lease over the whole pool that operations share
  // (Store::Impl::pooled_lease says which it suits). Guarded by pool_mu; swapping one in
  // leaves the old one to the operations still holding it (the last releases it).
  struct PoolLease {
    std::shared_ptr<const RemoteMemory> lease;
    std::int64_t fence = 0;   // its fence tag: writes, the Redis deadline of the put that took it
    Clock::time_point until;  // when it ends by our clock, less a margin
  };
  std::mutex pool_mu;
  PoolLease pool[2][2];  // [&main, &fenced_writes][op]

  // Drops `lease` from the pool (the node refused it: it rejoined, or fenced it).
  void forget(const RemoteMemory* lease) {
    std::lock_guard lock(pool_mu);
    for (auto& by_path : pool) {
      for (PoolLease& p : by_path) {
        if (p.lease.get() == lease) p = {};
      }
    }
  }

  // How `op` reaches the pool. kUnsupported for a write when no transport to the node can
  // fence it.
  Result<const Path*> path(TransferOp op) const {
    if (op == TransferOp::kRead || main.peer->leases()) return &main;
    if (fenced_writes.peer) return &fenced_writes;
    return Status::unsupported(
        "memory node " + id + ": no transport to it can fence a put's writes at the node (" +
        std::string(to_string(main.peer->transport())) + " cannot); puts need tcp, shm or verbs");
  }
};

// How long a failed put may spend confirming at its nodes that none of its writes can land
// any more (Peer::revoke), off the caller's path. Unconfirmed, the pages wait for the nodes'
// fences instead.
constexpr auto kRevokeTimeout = std::chrono::seconds(2);

// How long a shared pool lease for reads lives (rkey_scope connection): taken again this
// often per node link, at most.
constexpr std::chrono::milliseconds kPoolReadLease = std::chrono::minutes(5);

}  // namespace

struct Store::Impl {
  struct Conn {
    std::unique_ptr<metadata::RedisClient> redis;
    std::unique_ptr<Catalog> catalog;
  };

  // A Redis connection borrowed from the pool for one metadata call.
  class Borrowed {
   public:
    Borrowed(Impl* impl, std::unique_ptr<Conn> c) : impl_(impl), c_(std::move(c)) {}
    Borrowed(Borrowed&&) = default;
    ~Borrowed() {
      if (c_) impl_->give_back(std::move(c_));
    }
    Catalog* operator->() { return c_->catalog.get(); }

   private:
    Impl* impl_;
    std::unique_ptr<Conn> c_;
  };

  StoreOptions options;
  RkeyScope scope = RkeyScope::kConnection;  // the cell's, or options.rkey_scope
  std::unique_ptr<Engine> engine;

  std::mutex pool_mu;
  std::condition_variable pool_cv;
  std::vector<std::unique_ptr<Conn>> idle;
  std::uint32_t open_conns = 0;

  std::mutex links_mu;
  std::map<std::string, std::shared_ptr<NodeLink>, std::less<>> links;

  std::unique_ptr<ThreadPool> workers;
  std::unique_ptr<ThreadPool> hashers;  // help hash a large put's segments (checksum_of)
  unsigned hasher_count = 0;
  std::unique_ptr<ThreadPool> releaser;  // ends read leases off the gets' critical path
  std::unique_ptr<ThreadPool> aborter;   // confirms failed puts' fences off the callers' path

  Result<std::unique_ptr<Conn>> connect() {
    metadata::RedisOptions ro;
    ro.url = options.redis_url;
    ro.password = options.redis_password;
    ro.command_timeout = options.redis_timeout;
    ro.connect_timeout = options.redis_timeout;
    KVSTASH_ASSIGN_OR_RETURN(auto redis, metadata::RedisClient::connect(ro));
    auto c = std::make_unique<Conn>();
    c->catalog = std::make_unique<Catalog>(*redis, options.cell);
    c->redis = std::move(redis);
    return c;
  }

  // A Redis connection for one operation, its commands bounded by the operation's deadline.
  Result<Borrowed> borrow(Deadline deadline) {
    std::unique_lock lock(pool_mu);
    for (;;) {
      if (!idle.empty()) {
        auto c = std::move(idle.back());
        idle.pop_back();
        c->redis->set_deadline(deadline);
        return Borrowed(this, std::move(c));
      }
      if (open_conns < std::max<std::uint32_t>(1, options.redis_connections)) break;
      if (pool_cv.wait_until(lock, deadline) == std::cv_status::timeout) {
        return Status::timeout("store: no Redis connection came free before the deadline");
      }
    }
    ++open_conns;
    lock.unlock();
    auto c = connect();
    if (!c.is_ok()) {
      std::lock_guard relock(pool_mu);
      --open_conns;
      pool_cv.notify_one();
      return c.status();
    }
    (*c)->redis->set_deadline(deadline);
    return Borrowed(this, std::move(c).value());
  }

  void give_back(std::unique_ptr<Conn> c) {
    c->redis->set_deadline(std::nullopt);
    {
      std::lock_guard lock(pool_mu);
      idle.push_back(std::move(c));
    }
    pool_cv.notify_one();
  }

  // The link to a node's pool, connected and its key imported.
  Result<std::shared_ptr<NodeLink>> link(const metadata::NodeEndpoint& n, Deadline deadline) {
    std::shared_ptr<NodeLink> l;
    {
      std::lock_guard lock(links_mu);
      auto& slot = links[n.id];
      if (!slot || slot->address != n.address || slot->key != n.key) {
        slot = std::make_shared<NodeLink>();
        slot->id = n.id;
        slot->address = n.address;
        slot->key = n.key;
      }
      l = slot;
    }
    {
      std::unique_lock lock(l->mu);
      auto ready = l->connecting.take(
          lock, deadline, [&] { return l->connected; }, "connect");
      if (!ready.is_ok()) return ready.status().with_context("memory node " + n.id);
      if (*ready) return l;
    }
    // Connecting without the lock: a caller with a shorter deadline is never held behind it.
    NodeLink::Path main, fenced;
    Status made = connect_path(*l, false, deadline, main);
    if (made.is_ok() && !main.peer->leases()) {
      Status second = connect_path(*l, true, deadline, fenced);
      if (second.code() == StatusCode::kUnsupported) {
        // No transport in common that holds leases: reads only (path() says why to puts).
        KVSTASH_LOG_INFO("memory node {}: puts cannot reach it: {}", n.id, second.to_string());
      } else if (!second.is_ok()) {
        made = second;  // a passing failure: the next operation connects both again
      }
    }
    std::lock_guard lock(l->mu);
    l->connecting.end();
    if (!made.is_ok()) return made.with_context("memory node " + n.id);
    l->main = std::move(main);
    l->fenced_writes = std::move(fenced);
    l->connected = true;
    return l;
  }

  // A node that refuses, once connected, the pool key Redis named (importing it, leasing
  // under it) no longer knows it: it registered its pool again (it rejoined the cell) since the
  // key was read. For the caller the object changed under it.
  static Status pool_changed_is_stale(const Status& s) {
    if (s.code() != StatusCode::kPermissionDenied) return s;
    return Status::stale("store: the node's pool changed (it rejoined the cell): " + s.message());
  }

  // Connects to the node and imports its pool key into `out`; on an error `out` stays empty.
  Status connect_path(const NodeLink& l, bool require_leases, Deadline deadline, NodeLink::Path& out) {
    KVSTASH_ASSIGN_OR_RETURN(auto peer, engine->connect(l.address, deadline, std::nullopt, require_leases));
    auto remote = peer->import_key(l.key, deadline);
    KVSTASH_RETURN_IF_ERROR(pool_changed_is_stale(remote.status()));
    out.peer = std::move(peer);
    out.remote = std::move(remote).value();
    return Status::ok();
  }

  // The transfers of one stretch of the object: a batch per node, and where the stretch ends.
  struct Wave {
    std::vector<Batch> batches;
    std::uint64_t end = 0;
  };

  // Registers a get's batches with its cancel token while they may run, so that
  // CancelToken::cancel can stop them from another thread; a token cancelled already
  // cancels them at once.
  class CancelScope {
   public:
    CancelScope(const CancelToken& token, std::vector<Wave>& waves) : token_(token.state()) {
      if (token_ == nullptr) return;
      std::lock_guard lock(token_->mu);
      for (auto& w : waves) {
        for (auto& b : w.batches) {
          if (token_->cancelled) {
            b.cancel();
          } else {
            token_->waiting.push_back(&b);
            mine_.push_back(&b);
          }
        }
      }
    }
    ~CancelScope() {
      if (token_ == nullptr || mine_.empty()) return;
      std::lock_guard lock(token_->mu);
      std::erase_if(token_->waiting, [&](Batch* b) { return std::ranges::find(mine_, b) != mine_.end(); });
    }
    CancelScope(const CancelScope&) = delete;
    CancelScope& operator=(const CancelScope&) = delete;

   private:
    CancelToken::State* token_;
    std::vector<Batch*> mine_;
  };

  // A lease an operation's transfers go through: the operation's own, or the node link's pool
  // lease that it shares with others (rkey_scope connection), which it must never revoke.
  struct HeldLease {
    std::shared_ptr<const RemoteMemory> lease;
    std::shared_ptr<NodeLink> link;  // the node link it was made through
    bool shared = false;
    Clock::time_point until = Clock::time_point::max();  // a shared write lease: transfers end by then
  };

  // An object's transfers: the leases over its pages (one or more per node) and the waves.
  // The leases must outlive the waves' batches: destroying one revokes its windows.
  struct Transfers {
    Status status;  // how starting them went: on an error, the waves submitted before it
    std::vector<HeldLease> leases;
    std::vector<Wave> waves;
  };

  // One node's pages of an object as leased ranges: [addr, end) -> index into leases.
  struct NodeLeases {
    std::vector<std::pair<RemoteRange, std::size_t>> ranges;  // sorted by address
    const RemoteMemory* find(const std::vector<HeldLease>& leases, std::uint64_t addr) const {
      auto it = std::upper_bound(ranges.begin(), ranges.end(), addr,
                                 [](std::uint64_t a, const auto& r) { return a < r.first.addr; });
      return it == ranges.begin() ? nullptr : leases[std::prev(it)->second].lease.get();
    }
  };

  // The link's pool lease for `op` through `path` when the operation may share it, else a
  // new one taken for the pool's whole range (a round trip to the node), kept for the
  // operations after it. Reads: a lease of five minutes without a fence tag, shared while it
  // outlives the operation's deadline. Writes: a lease whose fence tag is the Redis deadline
  // of the put that took it, shared by puts whose own deadline is at least that tag and at
  // most half a put lease past it, so that no window outlives a put it serves by more than
  // that put's own lease: a node fenced past a failed put's deadline has fenced every window
  // that could write into its pages.
  Result<NodeLink::PoolLease> pooled_lease(NodeLink& link, const NodeLink::Path* path, TransferOp op,
                                           const Placement& p, Clock::time_point until, Deadline deadline,
                                           OpTimings* timings) {
    const int pi = path == &link.main ? 0 : 1;
    const int oi = op == TransferOp::kRead ? 0 : 1;
    const auto half_put_lease = std::chrono::milliseconds(options.put_lease).count() / 2;
    auto suits = [&](const NodeLink::PoolLease& pl) {
      if (!pl.lease) return false;
      if (op == TransferOp::kRead) return pl.until >= deadline;
      return pl.fence <= p.lease_deadline_ms && p.lease_deadline_ms - pl.fence <= half_put_lease &&
             pl.until > Clock::now();
    };
    {
      std::lock_guard lock(link.pool_mu);
      if (suits(link.pool[pi][oi])) return link.pool[pi][oi];
    }
    NodeLink::PoolLease fresh;
    LeaseOptions lo{.op = op, .deadline = deadline};
    if (op == TransferOp::kRead) {
      lo.ttl = kPoolReadLease;
      fresh.until = Clock::now() + kPoolReadLease - kPoolReadLease / 10;
    } else {
      lo.ttl = std::max(std::chrono::milliseconds(1),
                        std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()));
      lo.fence = static_cast<std::uint64_t>(p.lease_deadline_ms);
      fresh.fence = p.lease_deadline_ms;
      fresh.until = until;
    }
    const RemoteRange whole{path->remote.base(), path->remote.length()};
    const auto t0 = Clock::now();
    auto l = path->peer->lease(path->remote, {&whole, 1}, lo);
    if (timings != nullptr) {
      ++timings->node_round_trips;
      timings->node += Clock::now() - t0;
    }
    if (!l.is_ok()) return l.status();
    fresh.lease = std::make_shared<const RemoteMemory>(std::move(l).value());
    std::lock_guard lock(link.pool_mu);
    link.pool[pi][oi] = fresh;
    return fresh;
  }

  // Leases every node's pages of the object for `op` until `until`, with the Redis lease's
  // deadline as the fence tag: a node that has fenced through it refuses the lease's requests
  // (tcp, verbs) or its copies (shm), so a put whose pages went back to the pool can no
  // longer write into them. verbs binds windows over exactly these pages, or with
  // rkey_scope connection shares a window over the whole pool (pooled_lease); elsewhere the
  // node checks the lease and the engine the ranges.
  Status lease_pages(const Placement& p, const std::vector<std::shared_ptr<NodeLink>>& links,
                     const std::vector<const NodeLink::Path*>& paths, TransferOp op, Clock::time_point until,
                     Deadline deadline, OpTimings* timings, std::vector<HeldLease>& leases,
                     std::vector<NodeLeases>& by_node) {
    // At least 1 ms: a read started after its lease ran out may still finish, and end_get's
    // generations decide whether its bytes are the object's (a revocable key keeps a reader
    // out of reused pages only from 1 ms on; the checksum and generations cover the rest).
    const auto ttl = std::max(std::chrono::milliseconds(1),
                              std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()));
    by_node.assign(p.nodes.size(), {});
    for (std::size_t ni = 0; ni < p.nodes.size(); ++ni) {
      const NodeLink::Path* path = paths[ni];
      if (scope == RkeyScope::kConnection && path->peer->lease_asks_peer()) {
        auto shared = pooled_lease(*links[ni], path, op, p, until, deadline, timings);
        if (!shared.is_ok())
          return pool_changed_is_stale(shared.status()).with_context("memory node " + p.nodes[ni].id);
        by_node[ni].ranges.emplace_back(RemoteRange{path->remote.base(), path->remote.length()},
                                        leases.size());
        // A write window's end caps the transfers (a read window outlives the operation).
        const Clock::time_point shared_until =
            op == TransferOp::kWrite ? shared->until : Clock::time_point::max();
        leases.push_back({std::move(shared->lease), links[ni], true, shared_until});
        continue;
      }
      std::vector<std::uint64_t> pages;
      for (const auto& e : p.extents) {
        if (e.node == p.nodes[ni].id) pages.push_back(e.page);
      }
      std::sort(pages.begin(), pages.end());
      pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
      std::vector<RemoteRange> runs;
      for (std::uint64_t page : pages) {
        const std::uint64_t addr = path->remote.base() + page * p.page_size;
        if (!runs.empty() && runs.back().addr + runs.back().length == addr) {
          runs.back().length += p.page_size;
        } else {
          runs.push_back({addr, p.page_size});
        }
      }
      for (std::size_t at = 0; at < runs.size(); at += kMaxLeaseRanges) {
        std::span<const RemoteRange> chunk(runs.data() + at, std::min(kMaxLeaseRanges, runs.size() - at));
        const auto t0 = Clock::now();
        auto l = path->peer->lease(path->remote, chunk,
                                   {.op = op,
                                    .ttl = ttl,
                                    .fence = static_cast<std::uint64_t>(p.lease_deadline_ms),
                                    .deadline = deadline});
        if (timings != nullptr && path->peer->lease_asks_peer()) {
          ++timings->node_round_trips;
          timings->node += Clock::now() - t0;
        }
        if (!l.is_ok())
          return pool_changed_is_stale(l.status()).with_context("memory node " + p.nodes[ni].id);
        if (op == TransferOp::kWrite && !l->revocable()) {
          // The node serves its pool without leases on this transport (verbs without memory
          // windows): a write of a failed put could land after its pages were reused.
          return Status::unsupported(
              "memory node " + p.nodes[ni].id + " cannot fence writes over " +
              std::string(to_string(path->peer->transport())) +
              " (its pool has no leases there): puts need tcp, shm or verbs with memory windows");
        }
        for (const RemoteRange& r : chunk) by_node[ni].ranges.emplace_back(r, leases.size());
        leases.push_back({std::make_shared<const RemoteMemory>(std::move(l).value()), links[ni], false});
      }
    }
    return Status::ok();
  }

  // An object's nodes connected and its pages leased for one operation. The leases must
  // outlive the batches: destroying one revokes it.
  struct Leased {
    std::vector<std::shared_ptr<NodeLink>> links;
    std::vector<const NodeLink::Path*> paths;  // how the operation reaches each link's pool
    std::vector<HeldLease> leases;
    std::vector<NodeLeases> by_node;
  };

  Result<Leased> connect_and_lease(TransferOp op, const Placement& p, Clock::time_point lease_until,
                                   Deadline deadline, OpTimings* timings) {
    Leased l;
    for (const auto& n : p.nodes) {
      KVSTASH_ASSIGN_OR_RETURN(auto link_to, link(n, deadline));
      KVSTASH_ASSIGN_OR_RETURN(const NodeLink::Path* path, link_to->path(op));
      l.links.push_back(std::move(link_to));
      l.paths.push_back(path);
    }
    KVSTASH_RETURN_IF_ERROR(
        lease_pages(p, l.links, l.paths, op, lease_until, deadline, timings, l.leases, l.by_node));
    return l;
  }

  // Drops the pool leases a failed operation went through when the node refused them (it
  // fenced them, or it rejoined the cell): the next operation takes fresh ones.
  static void forget_refused(const std::vector<HeldLease>& leases, const Status& failure) {
    if (failure.code() != StatusCode::kStale && failure.code() != StatusCode::kPermissionDenied) return;
    for (const HeldLease& h : leases) {
      if (h.shared) h.link->forget(h.lease.get());
    }
  }

  // Starts the transfers between the object's pages and the caller's slices, in waves of
  // `wave_bytes` of the object (a batch per node each), all submitted at once. A reader can
  // then checksum each wave as it lands while the later ones still move. Adjacent pieces that
  // are contiguous on both sides travel as one entry.
  Transfers start_transfers(TransferOp op, const Placement& p, std::uint64_t size,
                            std::span<const Slice> slices, std::vector<MemoryHandle>& temp,
                            Clock::time_point lease_until, Deadline deadline, std::uint64_t wave_bytes,
                            OpTimings* timings) {
    Transfers t;
    if (size == 0) return t;
    auto leased = connect_and_lease(op, p, lease_until, deadline, timings);
    if (!leased.is_ok()) {
      t.status = leased.status();
      return t;
    }
    t.status = submit_range(*leased, op, p, 0, size, slices, temp, deadline, wave_bytes, t.waves);
    t.leases = std::move(leased->leases);  // the batches reference them; they move, not their state
    return t;
  }

  // Submits the transfers of object bytes [begin, end) from or into `slices` (which hold
  // them in order), in waves as start_transfers, appended to `waves`. On an error the waves
  // submitted before it stay there (their batches may be moving).
  Status submit_range(const Leased& leased, TransferOp op, const Placement& p, std::uint64_t begin,
                      std::uint64_t end, std::span<const Slice> slices, std::vector<MemoryHandle>& temp,
                      Deadline deadline, std::uint64_t wave_bytes, std::vector<Wave>& waves) {
    for (const HeldLease& h : leased.leases)
      deadline = std::min(deadline, h.until);  // a shared write window's end
    std::vector<const MemoryHandle*> handles;
    temp.reserve(temp.size() + slices.size());  // handles point into it
    std::uint64_t left = end - begin;
    for (const Slice& s : slices) {
      if (left == 0) break;
      left -= std::min<std::uint64_t>(left, s.length);
      if (s.memory != nullptr) {
        handles.push_back(s.memory);
        continue;
      }
      auto h = engine->register_memory({s.addr, s.length}, Access::kLocal);
      if (!h.is_ok()) return h.status().with_context("registering a slice");
      temp.push_back(std::move(h).value());
      handles.push_back(&temp.back());
    }

    const auto& paths = leased.paths;
    auto node_index = [&](const std::string& id) {
      for (std::size_t i = 0; i < p.nodes.size(); ++i) {
        if (p.nodes[i].id == id) return i;
      }
      return p.nodes.size();
    };
    std::vector<std::vector<TransferEntry>> entries(p.nodes.size());
    std::uint64_t offset = begin;
    std::size_t si = 0, soff = 0;
    while (offset < end) {
      const std::uint64_t wave_end = std::min(end, (offset / wave_bytes + 1) * wave_bytes);
      for (auto& list : entries) list.clear();
      while (offset < wave_end) {
        while (slices[si].length == soff) ++si, soff = 0;
        const metadata::Extent& e = p.extents[offset / p.page_size];
        std::size_t ni = node_index(e.node);
        std::uint64_t in_page = offset % p.page_size;
        std::size_t n = static_cast<std::size_t>(
            std::min({p.page_size - in_page, static_cast<std::uint64_t>(slices[si].length - soff),
                      wave_end - offset}));
        auto* local = static_cast<std::byte*>(slices[si].addr) + soff;
        std::uint64_t remote = paths[ni]->remote.base() + e.page * p.page_size + in_page;
        const RemoteMemory* lease = leased.by_node[ni].find(leased.leases, remote);
        auto& list = entries[ni];
        if (!list.empty() && list.back().local == handles[si] && list.back().remote == lease &&
            static_cast<std::byte*>(list.back().local_addr) + list.back().length == local &&
            list.back().remote_addr + list.back().length == remote) {
          list.back().length += n;
        } else {
          list.push_back({op, handles[si], local, remote, lease, n});
        }
        offset += n;
        soff += n;
      }
      Wave& w = waves.emplace_back();
      w.end = wave_end;
      for (std::size_t i = 0; i < entries.size(); ++i) {
        if (entries[i].empty()) continue;
        auto b = paths[i]->peer->submit(entries[i], deadline);
        if (!b.is_ok()) return b.status().with_context("memory node " + p.nodes[i].id);
        w.batches.push_back(std::move(b).value());
      }
    }
    return Status::ok();
  }

  // A memory node refuses a transfer on its pool only when the transfer's lease has ended
  // there (fenced past its deadline, revoked) or the pool was registered again (the node
  // rejoined the cell): for the caller the object changed under it.
  static Status fenced_is_stale(const Status& s) {
    if (s.code() != StatusCode::kPermissionDenied) return s;
    return Status::stale(
        "store: the memory node ended this transfer's lease (past its deadline, or the node "
        "rejoined the cell): " +
        s.message());
  }

  static Status wait_all(std::vector<Batch>& batches) {
    Status first;
    for (auto& b : batches) {
      Status s = b.wait();
      if (first.is_ok() && !s.is_ok()) first = s;
    }
    return first;
  }

  // The transfer deadline: the caller's, but never past the lease (minus a margin for the
  // commit or end_get), so a slow put cannot write into pages that were reclaimed.
  static Deadline within_lease(Deadline deadline, Clock::time_point leased_at,
                               std::chrono::milliseconds lease) {
    return std::min(deadline, leased_at + lease - lease / 10);
  }

  // Asks every node of a failed put to confirm that none of its writes can land any more
  // (Peer::revoke of each of its leases), up to `by`. Returns the put's nodes that confirmed,
  // or that were never leased (no write of the put can have gone there). A pool lease other
  // puts share is not revoked (that would fail them too): its node stays unconfirmed, and the
  // put's pages wait for the node's fence.
  static std::vector<std::string> revoke_all(const std::string& key, const std::vector<std::string>& nodes,
                                             const std::vector<HeldLease>& leases, Deadline by) {
    std::vector<std::string> failed;
    for (const HeldLease& h : leases) {
      const std::string& id = h.link->id;
      if (std::ranges::find(failed, id) != failed.end()) continue;
      auto path = h.link->path(TransferOp::kWrite);
      Status s = !path.is_ok()       ? path.status()
                 : h.shared          ? Status::unsupported("a pool lease other puts share")
                 : Clock::now() < by ? (*path)->peer->revoke(*h.lease, by)
                                     : Status::timeout("no time left to confirm");
      if (!s.is_ok()) {
        KVSTASH_LOG_DEBUG("put {}: node {} did not confirm its fence: {}", key, id, s.to_string());
        failed.push_back(id);
      }
    }
    std::vector<std::string> confirmed;
    for (const auto& id : nodes) {
      if (std::ranges::find(failed, id) == failed.end()) confirmed.push_back(id);
    }
    return confirmed;
  }

  // Ends a put that will not commit; its batches have ended (finished, failed or cancelled),
  // so only writes already on their way to a node can still land. Each node is asked to
  // confirm that none can (Peer::revoke of the put's leases), within the caller's deadline
  // and then, if one did not answer in time, off the caller's path: when all confirm, the
  // pages return at once; otherwise they wait in Redis until the put's lease has passed and
  // its nodes have fenced through it, so a late write never lands in a page another put was
  // given.
  void abort_put(const std::string& key, const std::string& token, const Placement& placement,
                 std::vector<HeldLease> leases, Deadline deadline) {
    std::vector<std::string> nodes;
    for (const auto& n : placement.nodes) nodes.push_back(n.id);
    if (Clock::now() < deadline) {
      auto confirmed = revoke_all(key, nodes, leases, deadline);
      if (confirmed.size() == nodes.size()) {
        end_put(key, token, confirmed, deadline);
        return;
      }
      if (std::ranges::all_of(leases, [](const HeldLease& h) { return h.shared; })) {
        end_put(key, token, confirmed, deadline);  // no node can confirm more later
        return;
      }
    }
    const Deadline confirm_by = deadline_after(kRevokeTimeout);
    aborter->submit([this, key, token, confirm_by, nodes, leases = std::move(leases)] {
      // A queue that fell behind a stalled node does not wait again for each put.
      auto confirmed = revoke_all(key, nodes, leases, confirm_by);
      if (confirmed.size() < nodes.size()) {
        KVSTASH_LOG_INFO("put {}: its pages on an unconfirmed node return once the node fenced its lease",
                         key);
      }
      end_put(key, token, confirmed, deadline_after(options.redis_timeout * 2));
    });
  }

  // The checksum of the first `size` bytes of host slices, in segments of `segment`: the
  // tree's segments are independent, so the calling thread and the store's hashing threads
  // take them in turn, and the sums are folded in order.
  sum::ObjectSum checksum_of(std::span<const Slice> slices, std::uint64_t size, std::uint64_t segment) {
    const std::uint64_t n = (size + segment - 1) / segment;
    if (n < 2) {
      SliceHasher h(slices, segment);
      h.advance_to(size);
      return h.digest();
    }
    std::vector<std::uint64_t> sums(n);
    std::atomic<std::uint64_t> next{0};
    auto work = [&] {
      for (std::uint64_t i = next++; i < n; i = next++) {
        sums[i] = segment_sum_at(slices, i * segment, std::min(size, (i + 1) * segment));
      }
    };
    std::vector<std::future<void>> helpers;
    for (unsigned t = 0; t < hasher_count && t + 1 < n; ++t) helpers.push_back(hashers->submit(work));
    work();
    for (auto& h : helpers) h.wait();  // `work` and `sums` are this frame's
    sum::ObjectHasher object(segment);
    for (std::uint64_t i = 0; i < n; ++i)
      object.add_segment(sums[i], std::min(size, (i + 1) * segment) - i * segment);
    return object.finish();
  }

  // The sum of object bytes [begin, end) of `slices` as one segment.
  static std::uint64_t segment_sum_at(std::span<const Slice> slices, std::uint64_t begin, std::uint64_t end) {
    sum::ObjectHasher h(end - begin);
    std::uint64_t at = 0;
    for (const Slice& s : slices) {
      const std::uint64_t from = std::max(begin, at), to = std::min(end, at + s.length);
      if (from < to) h.update(static_cast<const std::byte*>(s.addr) + (from - at), to - from);
      at += s.length;
      if (at >= end) break;
    }
    return *h.last_segment_sum();
  }

  // abort_put in Redis (errors only logged: the lease and the nodes' fences reclaim).
  void end_put(const std::string& key, const std::string& token, const std::vector<std::string>& fenced,
               Deadline deadline) {
    auto c = borrow(deadline);
    Status aborted = c.is_ok() ? (*c)->abort_put(token, fenced).status() : c.status();
    if (!aborted.is_ok()) {
      KVSTASH_LOG_WARN("put {}: abort failed, the lease will reclaim: {}", key, aborted.to_string());
    }
  }

  Status put(std::string_view key, std::span<const Slice> data, const PutOptions& o) {
    KVSTASH_RETURN_IF_ERROR(metadata::validate_object_key(key));
    KVSTASH_RETURN_IF_ERROR(host_only(data, "put"));
    if (o.object_layout.size() > kMaxLayout) {
      return Status::invalid_argument("store: object_layout is larger than 64 KiB");
    }
    const Deadline deadline = o.deadline.value_or(deadline_after(options.timeout));
    const std::uint64_t size = total_length(data);
    const std::string token = random_token();

    const auto leased_at = Clock::now();
    Result<Placement> placement = Status::internal("unset");
    {
      KVSTASH_ASSIGN_OR_RETURN(auto c, borrow(deadline));
      MetadataClock mc(o.timings);
      placement = c->begin_put(token, key, size, options.put_lease);
    }
    if (!placement.is_ok()) return placement.status().with_context(std::string(key));

    std::vector<MemoryHandle> temp;
    temp.reserve(data.size());
    const auto t0 = Clock::now();
    const Clock::time_point lease_until = within_lease(Deadline::max(), leased_at, options.put_lease);
    Transfers transfers = start_transfers(TransferOp::kWrite, *placement, size, data, temp, lease_until,
                                          std::min(deadline, lease_until), size, o.timings);
    Status moved = transfers.status;
    sum::ObjectSum sum;
    if (moved.is_ok()) {
      const auto c0 = Clock::now();
      sum = checksum_of(data, size, sum::kDefaultSegmentBytes);  // overlaps the writes: both only read
      const auto c1 = Clock::now();
      for (auto& w : transfers.waves) {
        Status s = wait_all(w.batches);
        if (moved.is_ok()) moved = fenced_is_stale(s);
      }
      if (o.timings != nullptr) {
        o.timings->transfer += Clock::now() - t0;
        o.timings->checksum += c1 - c0;
      }
    }
    if (!moved.is_ok()) {
      transfers.waves.clear();  // cancels what still moves: returns once nothing reads `data`
      forget_refused(transfers.leases, moved);
      abort_put(std::string(key), token, *placement, std::move(transfers.leases), deadline);
      KVSTASH_LOG_DEBUG("put {} failed: {}", key, moved.to_string());
      return moved.with_context(std::string(key));
    }
    auto c = borrow(deadline);
    if (!c.is_ok()) return c.status().with_context(std::string(key));  // the fence returns the pages
    MetadataClock mc(o.timings);
    return (*c)
        ->commit_put(token, key, sum, o.object_layout, o.ttl, o.if_version)
        .with_context(std::string(key));
  }

  // Reads into `into`, or (when `into_for` is set) into the slices it returns once the object's
  // size is known.
  Result<ObjectInfo> get(std::string_view key, std::span<const Slice> into, const GetInto* into_for,
                         const GetOptions& o) {
    KVSTASH_RETURN_IF_ERROR(metadata::validate_object_key(key));
    if (o.cancel.cancelled()) return Status::cancelled("store: get of " + std::string(key) + " cancelled");
    const Deadline deadline = o.deadline.value_or(deadline_after(options.timeout));
    const std::string reader = random_token();
    const auto leased_at = Clock::now();
    Result<metadata::ReadLease> lease = Status::internal("unset");
    {
      KVSTASH_ASSIGN_OR_RETURN(auto c, borrow(deadline));
      MetadataClock mc(o.timings);
      lease = c->begin_get(key, reader, options.read_lease);
    }
    if (!lease.is_ok()) return lease.status().with_context(std::string(key));

    Status moved;
    std::vector<Slice> placed;
    if (into_for != nullptr) {
      auto p = (*into_for)(lease->size);
      if (p.is_ok()) {
        placed = std::move(p).value();
        into = placed;
      } else {
        moved = p.status();
      }
    }
    const bool verify = o.verify_checksum.value_or(options.verify_checksum);
    SliceHasher hasher(into, lease->checksum.segment);
    if (moved.is_ok() && verify) moved = host_only(into, "a get that verifies its checksum");
    if (!moved.is_ok()) {
      // into device memory with the check on: nothing is read
    } else if (total_length(into) < lease->size) {
      moved = Status::invalid_argument("store: buffers hold " + std::to_string(total_length(into)) +
                                       " bytes, object " + std::string(key) + " has " +
                                       std::to_string(lease->size));
    } else {
      std::vector<MemoryHandle> temp;
      temp.reserve(into.size());
      const auto t0 = Clock::now();
      // Not capped at the lease: a read that outlives it is caught by end_get's generations,
      // or fails at the node where its windows were revoked (then reported as kStale).
      const Clock::time_point lease_until = within_lease(Deadline::max(), leased_at, options.read_lease);
      Transfers transfers = start_transfers(TransferOp::kRead, lease->placement, lease->size, into, temp,
                                            lease_until, deadline, kWaveBytes, o.timings);
      moved = transfers.status;
      std::optional<CancelScope> cancellable;
      if (moved.is_ok()) cancellable.emplace(o.cancel, transfers.waves);
      std::chrono::nanoseconds hashing{0};
      for (std::size_t i = 0; moved.is_ok() && i < transfers.waves.size(); ++i) {
        // On an error the later waves are cancelled (their batches' destructors).
        moved = fenced_is_stale(wait_all(transfers.waves[i].batches));
        if (moved.is_ok() && verify) {
          const auto c0 = Clock::now();
          hasher.advance_to(transfers.waves[i].end);
          hashing += Clock::now() - c0;
        }
        if (moved.is_ok() && o.progress) o.progress(transfers.waves[i].end, lease->layout);
      }
      if (o.timings != nullptr) {
        o.timings->transfer += Clock::now() - t0 - hashing;
        o.timings->checksum += hashing;
      }
    }

    // While the read lease held, no page of the object could be freed, so no generation
    // could move: the lease is ended off the critical path. A read that outlived its lease
    // (less a margin for clock drift) asks Redis whether its pages were reused meanwhile.
    const bool lease_held = Clock::now() < leased_at + options.read_lease - options.read_lease / 10;
    if (!moved.is_ok() || lease_held) {
      release_later(reader, *lease);
      if (!moved.is_ok()) return moved.with_context(std::string(key));
    } else {
      auto c = borrow(deadline);
      if (!c.is_ok()) return c.status().with_context(std::string(key));
      MetadataClock mc(o.timings);
      KVSTASH_RETURN_IF_ERROR((*c)->end_get(reader, *lease).with_context(std::string(key)));
    }

    if (verify) {
      const sum::ObjectSum sum = hasher.digest();
      if (sum != lease->checksum) {
        KVSTASH_LOG_ERROR("get {}: checksum mismatch (record {}, bytes {})", key,
                          sum::to_text(lease->checksum), sum::to_text(sum));
        return Status::corrupt("store: object " + std::string(key) + " failed its checksum");
      }
    }
    ObjectInfo info;
    info.size = lease->size;
    info.object_layout = std::move(lease->layout);
    info.checksum = lease->checksum.value;
    info.checksum_segment = lease->checksum.segment;
    info.pages = lease->placement.extents.size();
    for (auto& n : lease->placement.nodes) info.nodes.push_back(std::move(n.id));
    info.version = lease->object_token;
    return info;
  }

  // Ends a read lease on the releaser thread (errors only logged: the lease expires anyway).
  void release_later(const std::string& reader, const metadata::ReadLease& lease) {
    releaser->submit([this, reader, token = lease.object_token, extents = lease.placement.extents_text] {
      metadata::ReadLease l;
      l.object_token = token;
      l.placement.extents_text = extents;
      auto c = borrow(deadline_after(options.redis_timeout * 2));
      Status s = c.is_ok() ? (*c)->end_get(reader, l) : c.status();
      if (!s.is_ok() && s.code() != StatusCode::kStale) {
        KVSTASH_LOG_DEBUG("ending read lease {} failed, it will expire: {}", reader, s.to_string());
      }
    });
  }

  template <typename Fn>
  auto with_catalog(std::optional<Deadline> deadline, Fn fn) -> decltype(fn(std::declval<Catalog&>())) {
    KVSTASH_ASSIGN_OR_RETURN(auto c, borrow(deadline.value_or(deadline_after(options.timeout))));
    return fn(*c.operator->());
  }
};

// ---- PutStream --------------------------------------------------------------------------------

struct PutStream::State {
  Store::Impl* impl = nullptr;
  std::string key;
  std::string token;
  PutOptions options;
  std::uint64_t size = 0;
  std::uint64_t written = 0;
  Placement placement;
  Deadline deadline;  // the caller's, capped inside the put lease
  Store::Impl::Leased leased;
  std::deque<std::vector<MemoryHandle>> temps;  // per append: slices registered for it
  std::vector<Store::Impl::Wave> waves;
  sum::ObjectHasher hash;
  Status failed;
  bool finished = false;

  explicit State(std::uint64_t segment) : hash(segment) {}

  // Cancels what still moves (returning once nothing reads the caller's buffers), then ends
  // the put at the nodes and in Redis (Store::Impl::abort_put).
  void abort_put() {
    waves.clear();
    Store::Impl::forget_refused(leased.leases, failed);
    impl->abort_put(key, token, placement, std::move(leased.leases), deadline);
  }

  // Waits for the writes of the object's bytes [0, end) (all of them by default); a failure
  // is kept, and the stream is dead from then on.
  Status wait_writes(std::uint64_t end = ~0ull) {
    std::size_t i = 0;
    // A wave holds the bytes from the previous one's end to its own: wait while it starts
    // before `end`.
    for (; i < waves.size() && (i == 0 ? waited_end : waves[i - 1].end) < end; ++i) {
      Status s = Store::Impl::wait_all(waves[i].batches);
      if (failed.is_ok() && !s.is_ok()) failed = Store::Impl::fenced_is_stale(s).with_context(key);
    }
    if (i > 0) waited_end = waves[i - 1].end;
    waves.erase(waves.begin(), waves.begin() + static_cast<std::ptrdiff_t>(i));
    return failed;
  }
  std::uint64_t waited_end = 0;  // the writes of [0, waited_end) are done
};

PutStream::PutStream() = default;
PutStream::PutStream(PutStream&&) noexcept = default;
PutStream& PutStream::operator=(PutStream&& other) noexcept {
  if (this != &other) {
    abort();
    state_ = std::move(other.state_);
  }
  return *this;
}
PutStream::~PutStream() { abort(); }

std::uint64_t PutStream::size() const { return state_ ? state_->size : 0; }
std::uint64_t PutStream::written() const { return state_ ? state_->written : 0; }

Status PutStream::wait_written(std::uint64_t end) {
  if (!state_) return Status::invalid_argument("store: wait on an empty put stream");
  return state_->wait_writes(end);
}

void PutStream::set_object_layout(std::string object_layout) {
  if (state_) state_->options.object_layout = std::move(object_layout);
}

// Checks an append of `n` bytes against the stream's state; with `whole_segment`, also that
// the piece is exactly the object's next checksum segment.
Status PutStream::check_append(std::uint64_t n, bool whole_segment) const {
  if (!state_ || state_->finished) return Status::invalid_argument("store: append to a finished put");
  const State& st = *state_;
  if (!st.failed.is_ok()) return st.failed;
  if (n > st.size - st.written) {
    return Status::invalid_argument("store: " + std::to_string(n) + " more bytes would pass the object's " +
                                    std::to_string(st.size));
  }
  if (whole_segment) {
    const std::uint64_t segment = st.hash.segment_bytes();
    if (!st.hash.at_segment_boundary() || (n != segment && st.written + n != st.size) || n > segment) {
      return Status::invalid_argument(
          "store: a summed piece must be the object's next checksum segment (" + std::to_string(segment) +
          " bytes at offset " + std::to_string(st.hash.bytes()) + "), not " + std::to_string(n) + " bytes");
    }
  }
  return {};
}

Status PutStream::submit(std::span<const Slice> data, std::uint64_t n) {
  State& st = *state_;
  auto& temp = st.temps.emplace_back();
  Status submitted = st.impl->submit_range(st.leased, TransferOp::kWrite, st.placement, st.written,
                                           st.written + n, data, temp, st.deadline, n, st.waves);
  if (!submitted.is_ok()) {
    st.failed = submitted.with_context(st.key);
    return st.failed;
  }
  st.written += n;
  return Status::ok();
}

Status PutStream::append(std::span<const Slice> data, std::uint64_t* segment_sum) {
  const std::uint64_t n = total_length(data);
  KVSTASH_RETURN_IF_ERROR(check_append(n, segment_sum != nullptr));
  KVSTASH_RETURN_IF_ERROR(host_only(data, "append"));
  if (n == 0) return Status::ok();
  KVSTASH_RETURN_IF_ERROR(submit(data, n));
  for (const Slice& s : data) state_->hash.update(s.addr, s.length);  // while the writes fly
  if (segment_sum != nullptr) *segment_sum = *state_->hash.last_segment_sum();
  return Status::ok();
}

Status PutStream::append_summed(std::span<const Slice> data, std::uint64_t segment_sum) {
  const std::uint64_t n = total_length(data);
  if (n == 0) return Status::invalid_argument("store: a summed piece must not be empty");
  KVSTASH_RETURN_IF_ERROR(check_append(n, true));
  KVSTASH_RETURN_IF_ERROR(submit(data, n));
  state_->hash.add_segment(segment_sum, n);  // check_append made it the next segment
  return Status::ok();
}

Status PutStream::commit() {
  if (!state_ || state_->finished) return Status::invalid_argument("store: commit of a finished put");
  State& st = *state_;
  Status moved = st.wait_writes();
  if (moved.is_ok() && st.options.object_layout.size() > kMaxLayout) {
    moved = Status::invalid_argument("store: object_layout is larger than 64 KiB");
  }
  if (moved.is_ok() && st.written != st.size) {
    moved =
        Status::invalid_argument("store: put of " + st.key + " committed with " + std::to_string(st.written) +
                                 " of its " + std::to_string(st.size) + " bytes");
  }
  st.finished = true;
  if (!moved.is_ok()) {
    st.abort_put();
    return moved.with_context(st.key);
  }
  auto c = st.impl->borrow(st.deadline);
  if (!c.is_ok()) return c.status().with_context(st.key);  // the fence returns the pages
  return (*c)
      ->commit_put(st.token, st.key, st.hash.finish(), st.options.object_layout, st.options.ttl,
                   st.options.if_version)
      .with_context(st.key);
}

void PutStream::abort() {
  if (!state_ || state_->finished) return;
  state_->finished = true;
  state_->abort_put();
}

Result<PutStream> Store::begin_put(std::string_view key, std::uint64_t size, const PutOptions& options) {
  KVSTASH_RETURN_IF_ERROR(metadata::validate_object_key(key));
  if (options.object_layout.size() > kMaxLayout)
    return Status::invalid_argument("store: object_layout is larger than 64 KiB");
  auto st = std::make_unique<PutStream::State>(options.checksum_segment);
  st->impl = impl_.get();
  st->key = std::string(key);
  st->token = random_token();
  st->options = options;
  st->size = size;
  const Deadline deadline = options.deadline.value_or(deadline_after(impl_->options.timeout));
  const auto leased_at = Clock::now();
  {
    KVSTASH_ASSIGN_OR_RETURN(auto c, impl_->borrow(deadline));
    auto placement = c->begin_put(st->token, key, size, impl_->options.put_lease);
    if (!placement.is_ok()) return placement.status().with_context(st->key);
    st->placement = std::move(placement).value();
  }
  const Clock::time_point lease_until =
      Impl::within_lease(Deadline::max(), leased_at, impl_->options.put_lease);
  st->deadline = std::min(deadline, lease_until);
  if (size > 0) {
    auto leased = impl_->connect_and_lease(TransferOp::kWrite, st->placement, lease_until, st->deadline,
                                           options.timings);
    if (!leased.is_ok()) {
      impl_->abort_put(st->key, st->token, st->placement, {}, st->deadline);  // nothing was written
      return leased.status().with_context(st->key);
    }
    st->leased = std::move(leased).value();
  }
  PutStream stream;
  stream.state_ = std::move(st);
  return stream;
}

Store::Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Store::~Store() {
  // Async operations, then lease releases and aborts, finish before the engine and
  // connections go away.
  impl_->workers.reset();
  impl_->releaser.reset();
  impl_->aborter.reset();
}

Result<std::unique_ptr<Store>> Store::open(const StoreOptions& options) {
  if (options.put_lease.count() <= 0 || options.read_lease.count() <= 0 || options.timeout.count() <= 0) {
    return Status::invalid_argument("store: leases and timeout must be positive");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  KVSTASH_ASSIGN_OR_RETURN(auto first, impl->connect());
  KVSTASH_RETURN_IF_ERROR(first->catalog->check_schema());
  if (options.rkey_scope) {
    impl->scope = *options.rkey_scope;
  } else {
    KVSTASH_ASSIGN_OR_RETURN(impl->scope, first->catalog->rkey_scope());
  }
  impl->open_conns = 1;
  impl->idle.push_back(std::move(first));
  KVSTASH_ASSIGN_OR_RETURN(impl->engine, Engine::create(options.engine));
  impl->workers = std::make_unique<ThreadPool>(std::max<std::uint32_t>(1, options.async_threads));
  // With the caller, one thread per core up to four: a put hashes while its writes fly.
  impl->hasher_count = std::clamp(std::thread::hardware_concurrency(), 2u, 4u) - 1;
  impl->hashers = std::make_unique<ThreadPool>(impl->hasher_count);
  impl->releaser = std::make_unique<ThreadPool>(1);
  impl->aborter = std::make_unique<ThreadPool>(1);
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}

Status Store::put(std::string_view key, std::span<const Slice> data, const PutOptions& options) {
  return impl_->put(key, data, options);
}

Result<ObjectInfo> Store::get(std::string_view key, std::span<const Slice> into, const GetOptions& options) {
  return impl_->get(key, into, nullptr, options);
}

Result<ObjectInfo> Store::get_unsized(std::string_view key, const GetInto& into, const GetOptions& options) {
  return impl_->get(key, {}, &into, options);
}

Result<ObjectInfo> Store::stat(std::string_view key, std::optional<Deadline> deadline) {
  return impl_->with_catalog(deadline, [&](Catalog& c) -> Result<ObjectInfo> {
    KVSTASH_ASSIGN_OR_RETURN(auto r, c.stat(key));
    ObjectInfo info;
    info.size = r.size;
    info.checksum = r.checksum.value;
    info.checksum_segment = r.checksum.segment;
    info.object_layout = std::move(r.layout);
    info.pages = r.pages;
    info.nodes = std::move(r.nodes);
    if (r.ttl_ms >= 0) info.ttl = std::chrono::milliseconds(r.ttl_ms);
    info.version = std::move(r.version);
    return info;
  });
}

Result<std::size_t> Store::contains_prefix(std::span<const std::string> keys,
                                           std::optional<Deadline> deadline) {
  return impl_->with_catalog(deadline, [&](Catalog& c) { return c.contains_prefix(keys); });
}

Status Store::remove(std::string_view key, std::optional<Deadline> deadline) {
  return impl_->with_catalog(deadline, [&](Catalog& c) { return c.remove(key); });
}

Status Store::touch(std::string_view key, std::chrono::milliseconds ttl, std::optional<Deadline> deadline) {
  return impl_->with_catalog(deadline, [&](Catalog& c) { return c.touch(key, ttl); });
}

std::future<Status> Store::put_async(std::string key, std::vector<Slice> data, PutOptions options) {
  return impl_->workers->submit([this, key = std::move(key), data = std::move(data),
                                 options = std::move(options)] { return put(key, data, options); });
}

std::future<Result<ObjectInfo>> Store::get_async(std::string key, std::vector<Slice> into,
                                                 GetOptions options) {
  return impl_->workers->submit(
      [this, key = std::move(key), into = std::move(into), options] { return get(key, into, options); });
}

std::future<Status> Store::remove_async(std::string key, std::optional<Deadline> deadline) {
  return impl_->workers->submit([this, key = std::move(key), deadline] { return remove(key, deadline); });
}

std::future<Status> Store::touch_async(std::string key, std::chrono::milliseconds ttl,
                                       std::optional<Deadline> deadline) {
  return impl_->workers->submit(
      [this, key = std::move(key), ttl, deadline] { return touch(key, ttl, deadline); });
}

std::future<Result<std::size_t>> Store::contains_prefix_async(std::vector<std::string> keys,
                                                              std::optional<Deadline> deadline) {
  return impl_->workers->submit(
      [this, keys = std::move(keys), deadline] { return contains_prefix(keys, deadline); });
}

Result<MemoryHandle> Store::register_memory(const MemoryRegion& region) {
  return impl_->engine->register_memory(region, Access::kLocal);
}

Engine& Store::engine() { return *impl_->engine; }

// ---- CancelToken ------------------------------------------------------------------------------

CancelToken CancelToken::make() {
  CancelToken t;
  t.state_ = std::make_shared<State>();
  return t;
}

void CancelToken::cancel() const {
  if (!state_) return;
  std::lock_guard lock(state_->mu);
  state_->cancelled = true;
  for (Batch* b : state_->waiting) b->cancel();  // each returns once its ops stopped
}

bool CancelToken::cancelled() const {
  if (!state_) return false;
  std::lock_guard lock(state_->mu);
  return state_->cancelled;
}

}  // namespace kvstash

#include "node/memory_node.h"

#include <unistd.h>

#include <condition_variable>
#include <mutex>

#include "common/log.h"
#include "common/system.h"
#include "metadata/cell.h"
#include "node/metrics.h"

namespace kvstash::node {

struct MemoryNode::Shared {
  // Guards cell, catalog, epoch, and the writes of state and last_error. The loop holds it
  // across Redis commands (which may take up to their timeout while Redis is slow), so the
  // readers that must answer at once, health() and metrics(), take only view_mu.
  std::mutex mu;
  std::condition_variable wake;
  bool stopping = false;
  std::unique_ptr<metadata::Cell> cell;
  metadata::NodeCatalog* catalog = nullptr;  // the node's, over `cell`
  std::string epoch;
  // Written under mu and view_mu both; read under either.
  mutable std::mutex view_mu;
  std::string state = "up";
  std::string last_error;  // empty while Redis answers

  void set_state(std::string to) {
    std::lock_guard lock(view_mu);
    state = std::move(to);
  }
  void set_error(std::string to) {
    std::lock_guard lock(view_mu);
    last_error = std::move(to);
  }

  std::atomic<std::uint64_t> heartbeats{0}, heartbeat_failures{0}, registrations{0};
  std::atomic<std::uint64_t> free_pages{0}, objects{0}, reserved_pages{0}, limbo_pages{0};
  std::atomic<std::uint64_t> expired{0}, abandoned_puts{0}, zombies{0}, dead_nodes{0}, orphaned{0};
  std::atomic<std::uint64_t> fencing_puts{0};  // at the last reclaim
  std::atomic<std::uint64_t> tier_free_slots{0}, tier_objects{0};
};

namespace {

std::string default_node_id() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') return "node";
  std::string id;
  for (const char* p = host; *p != '\0' && id.size() < 64; ++p) {
    char c = *p;
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-';
    id.push_back(ok ? c : '-');
  }
  return id;
}

std::string new_epoch() { return std::to_string(sys::random_u64()); }

// Peers copy to and from the pool over shm themselves: a copy that checked the fence (or the
// key) just before it moved runs on for the length of one memcpy (an op is at most a few MiB:
// about a millisecond). A fence is reported, and a fenced pool registered again, only this
// long after it was made.
constexpr auto kCopyGrace = std::chrono::milliseconds(100);

// How far the node's steady clock and Redis's clock may drift apart per ms between two
// readings (NTP slews at most 500 ppm): the fence stays behind Redis's clock by this much more.
constexpr double kClockDrift = 1e-3;

}  // namespace

Result<std::unique_ptr<MemoryNode>> MemoryNode::start(const MemoryNodeOptions& options) {
  if (options.page_size < 4096 || (options.page_size & (options.page_size - 1)) != 0) {
    return Status::invalid_argument("page size must be a power of two of at least 4 KiB");
  }
  if (options.capacity < options.page_size) {
    return Status::invalid_argument("capacity must hold at least one page");
  }
  if (options.heartbeat_ttl < std::chrono::milliseconds(100)) {
    return Status::invalid_argument("heartbeat TTL must be at least 100 ms");
  }
  if (options.grant_key_rotation < std::chrono::milliseconds(100)) {
    return Status::invalid_argument("the grant key rotation period must be at least 100 ms");
  }
  std::unique_ptr<MemoryNode> n(new MemoryNode());
  n->options_ = options;
  n->id_ = options.node_id.empty() ? default_node_id() : options.node_id;
  n->page_count_ = options.capacity / options.page_size;

  KVSTASH_ASSIGN_OR_RETURN(
      n->pool_, Buffer::allocate(n->page_count_ * options.page_size,
                                 {.shareable = true, .huge_pages = options.huge_pages, .populate = true}));
  if (options.require_huge_pages && !n->pool_.huge_pages()) {
    return Status::no_space("no huge pages available for the pool (see /proc/sys/vm/nr_hugepages)");
  }
  if (options.tier) {
    TierOptions tier = *options.tier;
    // The tier's headers are signed with the node's secret: a forged one is never recovered.
    if (tier.header_secret.empty()) tier.header_secret = options.engine.cluster_token;
    KVSTASH_ASSIGN_OR_RETURN(n->tier_, NodeTier::open(tier, options.page_size, n->id_));
  }
  KVSTASH_ASSIGN_OR_RETURN(n->engine_, Engine::create(options.engine));
  // Every lease on the pool needs a grant of the cell (before the pool is reachable at all).
  n->grants_ = std::make_shared<NodeGrants>(n->id_, reinterpret_cast<std::uint64_t>(n->pool_.region().addr),
                                            options.page_size, n->page_count_, options.grant_key_rotation);
  n->engine_->set_grant_check(n->grants_);
  KVSTASH_ASSIGN_OR_RETURN(n->handle_, n->engine_->register_memory(n->pool_.region(), Access::kLeased));
  n->transports_ = n->handle_.transports();

  n->shared_ = std::make_unique<Shared>();
  metadata::CellOptions co;
  co.redis.url = options.redis_url;
  co.redis.password = options.redis_password;
  // The loop must keep its heartbeat: never let one command outlast a third of the TTL.
  co.redis.command_timeout = std::max(std::chrono::milliseconds(50), options.heartbeat_ttl / 3);
  co.redis.reconnect_budget = co.redis.command_timeout;
  co.cell = options.cell;
  // A node (re)started while the cell's Redis is down or failing over waits for it: the pool
  // it allocated serves nobody if the daemon exits, and whatever restarts it would only try
  // again.
  const Deadline join_by = deadline_after(options.join_timeout);
  for (bool first = true;; first = false) {
    Status joined = n->open_and_join(co);
    if (joined.is_ok()) break;
    if (joined.code() != StatusCode::kUnavailable && joined.code() != StatusCode::kTimeout) return joined;
    if (Clock::now() >= join_by) return joined.with_context("gave up after --join-timeout");
    if (first) {
      KVSTASH_LOG_WARN("node {}: cannot join cell {} yet ({}); trying again for up to {} ms", n->id_,
                       options.cell, joined.to_string(), options.join_timeout.count());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  KVSTASH_LOG_INFO("node {}: joined cell {} with {} pages of {} bytes (huge pages: {}, transports: {})",
                   n->id_, options.cell, n->page_count_, options.page_size, n->pool_.huge_pages(),
                   n->transports());
  if (n->tier_) {
    KVSTASH_RETURN_IF_ERROR(
        n->tier_->start(co, n->id_, static_cast<std::byte*>(n->pool_.region().addr), n->page_count_));
    KVSTASH_LOG_INFO("node {}: NVMe tier {} ({}): {} slots, tier {} ({})", n->id_, options.tier->path,
                     n->tier_->device().kind(), n->tier_->slots(), n->tier_->id(),
                     n->tier_->found() ? "found: its objects in the cell are kept" : "new");
  }
  n->thread_ = std::thread([p = n.get()] { p->loop(); });
  return n;
}

MemoryNode::~MemoryNode() {
  tier_.reset();
  if (shared_) {
    {
      std::lock_guard lock(shared_->mu);
      shared_->stopping = true;
    }
    shared_->wake.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

Status MemoryNode::open_and_join(const metadata::CellOptions& co) {
  shared_->catalog = nullptr;
  shared_->cell.reset();
  KVSTASH_ASSIGN_OR_RETURN(shared_->cell, metadata::Cell::open(co));
  shared_->catalog = &shared_->cell->node_catalog();
  KVSTASH_RETURN_IF_ERROR(shared_->cell->check_schema());
  // A previous incarnation killed moments ago holds the id until its heartbeat deadline: wait
  // that long, then give up (a second daemon with this id is still running).
  std::lock_guard lock(shared_->mu);
  const Deadline give_up = deadline_after(options_.heartbeat_ttl + std::chrono::milliseconds(500));
  Status joined;
  while (!(joined = join()).is_ok() && joined.message().find("IN_USE") != std::string::npos &&
         Clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return joined;
}

// Caller holds shared_->mu.
Status MemoryNode::join() {
  auto& s = *shared_;
  s.epoch = new_epoch();
  // The cell signs this incarnation's grants with a fresh key: an earlier one's stop working.
  metadata::NodeRecord rec{id_,
                           s.epoch,
                           options_.page_size,
                           page_count_,
                           engine_->address(),
                           handle_.remote_key(),
                           grants_->rotate(s.epoch),
                           tier_ ? tier_->slots() : 0,
                           tier_ ? tier_->low_water(page_count_) : 0,
                           tier_ ? tier_->id() : std::string()};
  const auto asked = Clock::now();
  KVSTASH_ASSIGN_OR_RETURN(std::int64_t now, s.catalog->register_node(rec, options_.heartbeat_ttl));
  redis_clock_ = std::make_pair(now, Clock::now());
  grants_->set_clock(now, asked);
  ++s.registrations;
  s.free_pages = page_count_;
  s.objects = 0;
  s.set_state("up");
  if (tier_) tier_->set_epoch(s.epoch);
  return {};
}

// Caller holds shared_->mu.
Status MemoryNode::rejoin() {
  // Every lease and request under the old keys ends with the registration: tcp waits for
  // the syscall a request may be in, verbs deallocates the windows and the MR, shm zeroes the
  // key peers check before each copy (copies already moving get kCopyGrace to finish).
  handle_ = MemoryHandle();
  if (tier_) tier_->pause();  // its promotions write into the pool too
  std::this_thread::sleep_for(kCopyGrace);
  auto handle = engine_->register_memory(pool_.region(), Access::kLeased);
  if (!handle.is_ok()) return handle.status().with_context("registering the pool again");
  handle_ = std::move(handle).value();
  return join();
}

std::int64_t MemoryNode::fence() {
  const auto now = Clock::now();
  if (redis_clock_) {
    // Redis's clock read `ms` at some moment before `at`, so now it reads at least
    // ms + (now - at), less the drift: every lease with a deadline at or below that is over.
    const auto [ms, at] = *redis_clock_;
    const double elapsed = std::chrono::duration<double, std::milli>(now - at).count();
    const auto through = static_cast<std::int64_t>(static_cast<double>(ms) + elapsed * (1 - kClockDrift)) - 1;
    if (through > 0) {
      engine_->fence(static_cast<std::uint64_t>(through));
      fences_made_.emplace_back(through, now);
    }
  }
  std::erase_if(fences_made_, [&](const auto& f) {
    if (now - f.second < kCopyGrace) return false;
    fenced_ready_ = std::max(fenced_ready_, f.first);
    return true;
  });
  // The tier's promotion writes into pages of its own put lease: the cell must not free them
  // (by this fence) before it is done.
  if (tier_) return std::min(fenced_ready_, tier_->writing_until() - 1);
  return fenced_ready_;
}

void MemoryNode::loop() {
  auto& s = *shared_;
  const auto beat = std::max(std::chrono::milliseconds(20), options_.heartbeat_ttl / 3);
  auto next_reclaim = Clock::now();
  std::unique_lock lock(s.mu);
  while (!s.stopping) {
    const std::int64_t fenced = fence();
    const auto asked = Clock::now();
    // Every rotation period the beat hands the cell the next grant key.
    const auto next_key = grants_->next_key().value_or(NodeGrants::NextKey{});
    auto beat_reply =
        s.catalog->heartbeat(id_, s.epoch, options_.heartbeat_ttl, fenced, next_key.hex, next_key.word);
    Status st = beat_reply.status();
    if (st.is_ok()) {
      redis_clock_ = std::make_pair(*beat_reply, Clock::now());
      grants_->set_clock(*beat_reply, asked);
      if (!next_key.hex.empty()) grants_->installed(next_key.word, *beat_reply);
      fenced_reported_ = fenced;
    }
    if (st.code() == StatusCode::kStale && s.state != "gone") {
      // Declared dead (a long pause, Redis restarted empty) or displaced: the cell dropped
      // our objects, and may have freed pages of puts we never fenced; the pool starts over
      // under a new epoch once nothing granted before can reach it.
      KVSTASH_LOG_WARN("node {}: heartbeat refused ({}); fencing the pool and registering again", id_,
                       st.to_string());
      st = rejoin();
    }
    if (st.is_ok()) {
      ++s.heartbeats;
      if (!s.last_error.empty()) s.set_error({});
      if (Clock::now() >= next_reclaim) {
        next_reclaim = Clock::now() + options_.reclaim_interval;
        // Each reclaim holds Redis about a millisecond; while it says work is left (a dead
        // node's million objects), run it again, with a pause for other clients between, for
        // up to half a beat.
        const auto budget = Clock::now() + beat / 2;
        for (bool more = true; more && !s.stopping;) {
          auto r = s.catalog->reclaim();
          if (!r.is_ok()) break;
          s.expired += r->expired;
          s.abandoned_puts += r->abandoned_puts;
          s.zombies += r->zombies;
          s.dead_nodes += r->dead_nodes;
          s.orphaned += r->orphaned_objects;
          s.fencing_puts = r->fencing_puts;
          if (r->dead_nodes > 0) {
            KVSTASH_LOG_WARN("node {}: declared {} node(s) dead; {} of their objects are being swept", id_,
                             r->dead_nodes, r->orphaned_objects);
          }
          more = r->more && Clock::now() < budget;
          if (more) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
      if (auto ns = s.catalog->node_status(id_); ns.is_ok()) {
        s.free_pages = ns->free_pages;
        s.objects = ns->objects;
        s.reserved_pages = ns->reserved_pages;
        s.limbo_pages = ns->limbo_pages;
        s.tier_free_slots = ns->tier_free_slots;
        s.tier_objects = ns->tier_objects;
      }
    } else if (s.state != "gone") {
      ++s.heartbeat_failures;
      if (s.last_error.empty()) KVSTASH_LOG_WARN("node {}: heartbeat failed: {}", id_, st.to_string());
      s.set_error(st.to_string());
    }
    s.wake.wait_for(lock, beat, [&] { return s.stopping; });
  }
}

Result<std::uint64_t> MemoryNode::drain() {
  auto& s = *shared_;
  std::lock_guard lock(s.mu);
  s.set_state("draining");
  if (tier_) tier_->pause();
  KVSTASH_ASSIGN_OR_RETURN(std::uint64_t dropped, s.catalog->drain_node(id_, s.epoch));
  KVSTASH_RETURN_IF_ERROR(s.catalog->deregister_node(id_, s.epoch));
  s.set_state("gone");
  KVSTASH_LOG_INFO("node {}: drained, {} objects dropped, left the cell", id_, dropped);
  return dropped;
}

std::string MemoryNode::transports() const {
  std::string out;
  for (TransportKind k : transports_) {
    if (!out.empty()) out += ',';
    out += to_string(k);
  }
  return out;
}

std::string MemoryNode::metrics() const {
  auto& s = *shared_;
  std::string state;
  {
    std::lock_guard lock(s.view_mu);
    state = s.state;
  }
  const double secs = std::chrono::duration<double>(Clock::now() - started_).count();
  MetricsText m;
  m.gauge("kvstash_node_info", "Constant 1, labelled with the node id, cell and state", 1,
          {{"node", id_}, {"cell", options_.cell}, {"state", state}});
  m.gauge("kvstash_node_up", "1 while the node takes new pages, 0 while draining or gone",
          state == "up" ? 1 : 0);
  m.gauge("kvstash_node_pages", "Pages donated to the cell", static_cast<double>(page_count_));
  m.gauge("kvstash_node_page_size_bytes", "Bytes per page", static_cast<double>(options_.page_size));
  m.gauge("kvstash_node_capacity_bytes", "Bytes donated to the cell",
          static_cast<double>(page_count_ * options_.page_size));
  m.gauge("kvstash_node_huge_pages", "1 when the pool is backed by huge pages", pool_.huge_pages() ? 1 : 0);
  for (TransportKind k : transports_) {
    m.gauge("kvstash_node_transport", "Constant 1 per transport serving the pool", 1,
            {{"transport", to_string(k)}});
  }
  for (const TransportCounter& c : engine_->counters()) {
    m.counter("kvstash_transport_events_total", "What the transports counted (see event)",
              static_cast<double>(c.value), {{"transport", to_string(c.transport)}, {"event", c.name}});
  }
  m.gauge("kvstash_node_free_pages", "Free pages at the last heartbeat",
          static_cast<double>(s.free_pages.load()));
  m.gauge("kvstash_node_objects", "Objects with a page on this node at the last heartbeat",
          static_cast<double>(s.objects.load()));
  m.gauge("kvstash_node_reserved_pages",
          "Pages of pending puts and clients' page reservations within their lease, at the last heartbeat",
          static_cast<double>(s.reserved_pages.load()));
  m.gauge("kvstash_node_limbo_pages",
          "Pages no object holds that are not free yet (released under a read lease, or of a put past its "
          "lease or aborted, until fenced), at the last heartbeat",
          static_cast<double>(s.limbo_pages.load()));
  m.counter("kvstash_node_heartbeats_total", "Heartbeats Redis accepted",
            static_cast<double>(s.heartbeats.load()));
  m.counter("kvstash_node_heartbeat_failures_total", "Heartbeats that failed (Redis unreachable or slow)",
            static_cast<double>(s.heartbeat_failures.load()));
  m.counter("kvstash_node_registrations_total", "Times this node joined the cell under a new epoch",
            static_cast<double>(s.registrations.load()));
  m.counter("kvstash_reclaimed_total", "Things the reclaim sweep run by this node returned to the pool",
            static_cast<double>(s.expired.load()), {{"kind", "expired_object"}});
  m.counter("kvstash_reclaimed_total", "", static_cast<double>(s.abandoned_puts.load()),
            {{"kind", "abandoned_put"}});
  m.counter("kvstash_reclaimed_total", "", static_cast<double>(s.zombies.load()), {{"kind", "zombie"}});
  m.counter("kvstash_reclaimed_total", "", static_cast<double>(s.dead_nodes.load()), {{"kind", "dead_node"}});
  m.counter("kvstash_reclaimed_total", "", static_cast<double>(s.orphaned.load()),
            {{"kind", "orphaned_object"}});
  m.gauge("kvstash_node_fenced_ms",
          "How far (ms of Redis time) the node has fenced its leases and told the cell",
          static_cast<double>(fenced_reported_.load()));
  m.gauge("kvstash_cell_fencing_puts",
          "Failed puts past their lease waiting for a node's fence (last reclaim)",
          static_cast<double>(s.fencing_puts.load()));
  m.gauge("kvstash_node_uptime_seconds", "Seconds since the node started", secs);
  if (tier_) tier_metrics(m);
  return m.str();
}

void MemoryNode::tier_metrics(MetricsText& m) const {
  auto& s = *shared_;
  const NodeTier::Counters c = tier_->counters();
  const SsdDevice::Counters d = tier_->device().counters();
  const double page = static_cast<double>(options_.page_size);
  m.gauge("kvstash_tier_slots", "Slots (one page each) of the node's NVMe tier",
          static_cast<double>(tier_->slots()));
  m.gauge("kvstash_tier_capacity_bytes", "Bytes of the NVMe tier's slots",
          static_cast<double>(tier_->slots()) * page);
  m.gauge("kvstash_tier_free_slots", "Free slots of the NVMe tier at the last heartbeat",
          static_cast<double>(s.tier_free_slots.load()));
  m.gauge("kvstash_tier_objects", "Objects on the NVMe tier at the last heartbeat",
          static_cast<double>(s.tier_objects.load()));
  m.counter("kvstash_tier_write_downs_total", "Objects moved from the pool down to the NVMe tier",
            static_cast<double>(c.written_down));
  m.counter("kvstash_tier_write_down_bytes_total", "Bytes of the objects moved down",
            static_cast<double>(c.written_down_bytes));
  m.counter("kvstash_tier_write_down_failures_total",
            "Write-downs that did not move their object (device error, or it changed meanwhile)",
            static_cast<double>(c.write_down_failures));
  m.counter("kvstash_tier_promotions_total", "Objects staged back from the NVMe tier into the pool for a get",
            static_cast<double>(c.promoted));
  m.counter("kvstash_tier_promotion_bytes_total", "Bytes of the objects promoted",
            static_cast<double>(c.promoted_bytes));
  m.counter("kvstash_tier_promotion_failures_total",
            "Promotions that failed (the get sees an error, never bytes)",
            static_cast<double>(c.promotion_failures));
  m.counter("kvstash_tier_promotion_corrupt_total",
            "Promotions whose bytes did not match the tier's sum (the object was dropped)",
            static_cast<double>(c.promotion_corrupt));
  m.counter(
      "kvstash_tier_recovered_total",
      "Objects of the NVMe tier given back to a cell that had started the tier over (its Redis lost them)",
      static_cast<double>(c.recovered));
  m.counter("kvstash_tier_recovery_corrupt_total",
            "Objects found on the NVMe tier at a recovery whose bytes did not match their header's sum",
            static_cast<double>(c.recovery_bad));
  m.counter("kvstash_tier_device_ios_total", "I/Os the NVMe tier's device completed",
            static_cast<double>(d.reads), {{"op", "read"}});
  m.counter("kvstash_tier_device_ios_total", "", static_cast<double>(d.writes), {{"op", "write"}});
  m.counter("kvstash_tier_device_bytes_total", "Bytes the NVMe tier's device moved",
            static_cast<double>(d.read_bytes), {{"op", "read"}});
  m.counter("kvstash_tier_device_bytes_total", "", static_cast<double>(d.write_bytes), {{"op", "write"}});
  m.counter("kvstash_tier_device_errors_total", "I/Os the device failed (EIO, ENOSPC)",
            static_cast<double>(d.errors));
  m.counter("kvstash_tier_device_timeouts_total", "I/Os cancelled at their deadline",
            static_cast<double>(d.timeouts));
}

std::pair<bool, std::string> MemoryNode::health() const {
  auto& s = *shared_;
  std::lock_guard lock(s.view_mu);
  if (s.state != "up") return {false, s.state};
  if (!s.last_error.empty()) return {false, "redis unreachable: " + s.last_error};
  return {true, "ok"};
}

}  // namespace kvstash::node

// The Store: open, the operations that are one script each (stat,
// contains_prefix, remove, touch), the async wrappers and cancel tokens. Puts are in
// put_stream.cc, gets in get.cc; store_internal.h maps the rest. Redis connections come from
// a metadata::CellPool and are held only around metadata calls, so a slow transfer never
// holds one.
#include "kvstash/store.h"

#include <algorithm>
#include <thread>

#include <xxhash.h>

#include "common/grant.h"
#include "common/log.h"
#include "common/system.h"
#include "common/wire.h"
#include "store/store_internal.h"

namespace kvstash {

std::string_view to_string(RkeyScope s) { return s == RkeyScope::kLease ? "lease" : "connection"; }

std::optional<RkeyScope> parse_rkey_scope(std::string_view s) {
  if (s == "connection") return RkeyScope::kConnection;
  if (s == "lease") return RkeyScope::kLease;
  return std::nullopt;
}

store::Meters::Meters() {
  for (TransferOp op : {TransferOp::kRead, TransferOp::kWrite}) {
    for (TransportKind kind : kTransportKinds) {
      moved[op == TransferOp::kRead ? 0 : 1][static_cast<std::size_t>(kind)] = &registry.counter(
          "kvstash_client_transfer_bytes_total", "Bytes the client's transfers moved to or from memory nodes",
          {{"op", op == TransferOp::kRead ? "read" : "write"}, {"transport", std::string(to_string(kind))}});
    }
  }
}

namespace {

constexpr std::string_view kOpNames[] = {"put",    "put_stream",     "get",   "lookup",
                                         "remove", "remove_corrupt", "touch", "stat"};

// The series in `slot`, made by `make` (a registry lookup) the first time. Two threads that
// both make it get the same series from the registry.
template <typename T, typename Make>
T& kept(std::atomic<T*>& slot, Make make) {
  T* p = slot.load(std::memory_order_acquire);
  if (p == nullptr) {
    p = &make();
    slot.store(p, std::memory_order_release);
  }
  return *p;
}

}  // namespace

void store::Meters::op(MeteredOp op, const Status& s, Clock::time_point started, std::uint64_t bytes) {
  const std::string_view name = kOpNames[static_cast<std::size_t>(op)];
  OpSeries& series = ops_[static_cast<std::size_t>(op)];
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  kept(series.outcomes[static_cast<std::size_t>(s.code())], [&]() -> metrics::Counter& {
    return registry.counter("kvstash_client_ops_total", "Operations of this client, by outcome",
                            {{"op", std::string(name)}, {"status", std::string(to_string(s.code()))}});
  }).add();
  kept(series.duration, [&]() -> metrics::Histogram& {
    return registry.histogram("kvstash_client_op_duration_seconds",
                              "How long this client's operations took, any outcome",
                              {{"op", std::string(name)}});
  }).observe(seconds);
  if (s.is_ok() && bytes > 0) {
    kept(series.bytes, [&]() -> metrics::Counter& {
      return registry.counter("kvstash_client_op_bytes_total",
                              "Bytes of the objects this client's operations put or got",
                              {{"op", std::string(name)}});
    }).add(bytes);
  }
}

std::string Store::metrics_text() const { return impl_->meters.registry.text(); }

metrics::Registry& Store::metrics() { return impl_->meters.registry; }

std::string store::random_token() {
  char raw[16];
  sys::random_bytes(raw, sizeof raw);
  return wire::to_hex({raw, sizeof raw});
}

// ---- Store ----------------------------------------------------------------------------------

Store::Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Store::~Store() {
  // Async operations, then aborts, then lease and reservation releases finish before the
  // engine and connections go away; the reserved pages no put took go back.
  impl_->workers.reset();
  impl_->aborter.reset();  // its aborts settle reservations on the releaser thread
  for (auto& [name, cell] : impl_->cell_links) {
    if (cell->reservation) impl_->retire(cell->reservation);
  }
  impl_->releaser.reset();
}

Result<std::unique_ptr<Store>> Store::open(const StoreOptions& options) {
  if (options.put_lease.count() <= 0 || options.read_lease.count() <= 0 || options.timeout.count() <= 0) {
    return Status::invalid_argument("store: leases and timeout must be positive");
  }
  if (options.put_lease > grant::kMaxLease || options.read_lease > grant::kMaxLease) {
    return Status::invalid_argument("store: a lease lasts at most " +
                                    std::to_string(grant::kMaxLease.count() / 1000) +
                                    " s (the cell grants no longer)");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  const Deadline opening = deadline_after(options.timeout);
  KVSTASH_RETURN_IF_ERROR(impl->load_cell_map(opening));
  {
    // The rkey scope is the deployment's: its first cell's.
    KVSTASH_ASSIGN_OR_RETURN(auto c, impl->borrow(*impl->map->links.front(), opening));
    if (options.rkey_scope) {
      impl->scope = *options.rkey_scope;
    } else {
      KVSTASH_ASSIGN_OR_RETURN(impl->scope, c->rkey_scope());
    }
  }
  KVSTASH_ASSIGN_OR_RETURN(impl->engine, Engine::create(options.engine));
  impl->links = std::make_unique<store::NodeLinks>(*impl->engine);
  impl->avoided = std::make_unique<store::AvoidedNodes>(options.avoid_unreachable_nodes);
  impl->workers = std::make_unique<ThreadPool>(std::max<std::uint32_t>(1, options.async_threads));
  // With the caller, one thread per core up to four: a put hashes while its writes fly.
  impl->hasher_count = std::clamp(std::thread::hardware_concurrency(), 2u, 4u) - 1;
  impl->hashers = std::make_unique<ThreadPool>(impl->hasher_count);
  impl->releaser = std::make_unique<ThreadPool>(1);
  impl->aborter = std::make_unique<ThreadPool>(1);
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}

Result<ObjectInfo> Store::get(std::string_view key, std::span<const Slice> into, const GetOptions& options) {
  const auto started = Clock::now();
  auto r = impl_->get(key, into, nullptr, options);
  impl_->meters.op(store::MeteredOp::kGet, r.status(), started, r.is_ok() ? r->size : 0);
  return r;
}

Result<ObjectInfo> Store::get_unsized(std::string_view key, const GetInto& into, const GetOptions& options) {
  const auto started = Clock::now();
  auto r = impl_->get(key, {}, &into, options);
  impl_->meters.op(store::MeteredOp::kGet, r.status(), started, r.is_ok() ? r->size : 0);
  return r;
}

Result<ObjectInfo> Store::stat(std::string_view key, std::optional<Deadline> deadline) {
  const auto started = Clock::now();
  auto r = [&]() -> Result<ObjectInfo> {
    return impl_->with_catalog(key, deadline, [&](metadata::Catalog& c) -> Result<ObjectInfo> {
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
  }();
  impl_->meters.op(store::MeteredOp::kStat, r.status(), started);
  return r;
}

Result<std::vector<Tier>> Store::prefix_tiers(std::span<const std::string> keys,
                                              std::optional<Deadline> deadline) {
  const auto started = Clock::now();
  auto r = [&]() -> Result<std::vector<Tier>> {
    std::vector<Tier> out;
    if (keys.empty()) return out;
    const Deadline d = deadline.value_or(deadline_after(impl_->options.timeout));
    for (store::CellLink* cell : impl_->get_cells(keys.front(), d)) {
      KVSTASH_ASSIGN_OR_RETURN(auto c, impl_->borrow(*cell, d));
      KVSTASH_ASSIGN_OR_RETURN(std::vector<bool> more, c->prefix_tiers(keys.subspan(out.size())));
      for (bool ssd : more) out.push_back(ssd ? Tier::kSsd : Tier::kDram);
      if (out.size() == keys.size()) break;
    }
    return out;
  }();
  impl_->meters.op(store::MeteredOp::kLookup, r.status(), started);
  return r;
}

Result<std::vector<bool>> Store::contains_each(std::span<const std::string> keys,
                                               std::optional<Deadline> deadline) {
  const auto started = Clock::now();
  auto r = [&]() -> Result<std::vector<bool>> {
    std::vector<bool> out(keys.size(), false);
    if (keys.empty()) return out;
    // While a change of the cells settles, a key may be in the previous choice or the current.
    const Deadline d = deadline.value_or(deadline_after(impl_->options.timeout));
    for (store::CellLink* cell : impl_->get_cells(keys.front(), d)) {
      KVSTASH_ASSIGN_OR_RETURN(auto c, impl_->borrow(*cell, d));
      KVSTASH_ASSIGN_OR_RETURN(std::vector<bool> here, c->contains_each(keys));
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = out[i] || here[i];
    }
    return out;
  }();
  impl_->meters.op(store::MeteredOp::kLookup, r.status(), started);
  return r;
}

Result<std::size_t> Store::contains_prefix(std::span<const std::string> keys,
                                           std::optional<Deadline> deadline) {
  const auto started = Clock::now();
  auto r = [&]() -> Result<std::size_t> {
    if (keys.empty()) return std::size_t{0};
    // The chain lives where its first key routes (the keys share its route). While a change of
    // the cells settles, its start may be in the previous choice and the rest in the current.
    const Deadline d = deadline.value_or(deadline_after(impl_->options.timeout));
    std::size_t found = 0;
    for (store::CellLink* cell : impl_->get_cells(keys.front(), d)) {
      KVSTASH_ASSIGN_OR_RETURN(auto c, impl_->borrow(*cell, d));
      KVSTASH_ASSIGN_OR_RETURN(std::size_t more, c->contains_prefix(keys.subspan(found)));
      found += more;
      if (found == keys.size()) break;
    }
    return found;
  }();
  impl_->meters.op(store::MeteredOp::kLookup, r.status(), started);
  return r;
}

namespace {
// Fibonacci hashing: the top bits of the product mix every bit of the hash in.
std::uint64_t mix(std::uint64_t x) { return (x * 0x9E3779B97F4A7C15ULL) >> 40; }
}  // namespace

bool KeepHint::sampled() const { return mix(key_hash) % kSampleOneIn == 0; }
std::uint32_t KeepHint::draw() const { return static_cast<std::uint32_t>(mix(split_hash) & 0xFFFF); }
std::uint64_t KeepHint::hash_key(std::string_view key) { return XXH3_64bits(key.data(), key.size()); }

Result<PrefixLookup> Store::lookup_prefix(std::span<const std::string> keys,
                                          std::optional<Deadline> deadline) {
  const auto started = Clock::now();
  auto r = [&]() -> Result<PrefixLookup> {
    PrefixLookup found;
    if (keys.empty()) return found;
    // As contains_prefix; the turn is the answer of the cell the hit ends in.
    const Deadline d = deadline.value_or(deadline_after(impl_->options.timeout));
    for (store::CellLink* cell : impl_->get_cells(keys.front(), d)) {
      KVSTASH_ASSIGN_OR_RETURN(auto c, impl_->borrow(*cell, d));
      KVSTASH_ASSIGN_OR_RETURN(PrefixLookup more, c->lookup_prefix(keys.subspan(found.hit)));
      if (more.hit > 0 || found.hit == 0) found.turn = more.turn, found.clock = more.clock;
      found.hit += more.hit;
      if (found.hit == keys.size()) break;
    }
    return found;
  }();
  impl_->meters.op(store::MeteredOp::kLookup, r.status(), started);
  return r;
}

Result<std::optional<std::size_t>> Store::announce(std::span<const std::pair<std::string, std::string>> items,
                                                   std::optional<Deadline> deadline) {
  // Each key is announced wherever a get would look for it (one cell, or two while a change
  // of the cells settles); each cell gets its keys in one script.
  const Deadline d = deadline.value_or(deadline_after(impl_->options.timeout));
  std::vector<std::pair<store::CellLink*, std::vector<std::pair<std::string, std::string>>>> per_cell;
  for (const auto& item : items) {
    for (store::CellLink* cell : impl_->get_cells(item.first, d)) {
      auto at =
          std::find_if(per_cell.begin(), per_cell.end(), [&](const auto& p) { return p.first == cell; });
      if (at == per_cell.end()) at = per_cell.insert(per_cell.end(), {cell, {}});
      at->second.push_back(item);
    }
  }
  std::optional<std::size_t> announced;
  for (auto& [cell, mine] : per_cell) {
    KVSTASH_ASSIGN_OR_RETURN(auto c, impl_->borrow(*cell, d));
    KVSTASH_ASSIGN_OR_RETURN(std::optional<std::size_t> n, c->announce(mine));
    if (n) announced = announced.value_or(0) + *n;
  }
  if (per_cell.empty()) return std::optional<std::size_t>{0};
  return announced;
}

Status Store::remove(std::string_view key, std::optional<Deadline> deadline) {
  return remove_as(key, deadline, false);
}

Status Store::remove_corrupt(std::string_view key, std::optional<Deadline> deadline) {
  return remove_as(key, deadline, true);
}

Status Store::remove_as(std::string_view key, std::optional<Deadline> deadline, bool corrupt) {
  const auto started = Clock::now();
  auto r = [&]() -> Status {
    // From every cell a get would look in: OK when one held it and none failed (a failure may
    // have left a copy a get still finds).
    const Deadline d = deadline.value_or(deadline_after(impl_->options.timeout));
    Status failed, not_found;
    bool removed = false;
    for (store::CellLink* cell : impl_->get_cells(key, d)) {
      KVSTASH_ASSIGN_OR_RETURN(auto c, impl_->borrow(*cell, d));
      Status s = c->remove(key, corrupt);
      if (s.is_ok()) {
        removed = true;
      } else if (s.code() == StatusCode::kNotFound) {
        not_found = s;
      } else if (failed.is_ok()) {
        failed = s;
      }
    }
    if (!failed.is_ok()) return failed;
    return removed ? Status() : not_found;
  }();
  impl_->meters.op(corrupt ? store::MeteredOp::kRemoveCorrupt : store::MeteredOp::kRemove, r, started);
  return r;
}

Status Store::touch(std::string_view key, std::chrono::milliseconds ttl, std::optional<Deadline> deadline) {
  const auto started = Clock::now();
  auto r = [&]() -> Status {
    return impl_->with_catalog(key, deadline, [&](metadata::Catalog& c) { return c.touch(key, ttl); });
  }();
  impl_->meters.op(store::MeteredOp::kTouch, r, started);
  return r;
}

Result<std::size_t> Store::connect_nodes(std::optional<Deadline> deadline) {
  const Deadline d = deadline.value_or(deadline_after(impl_->options.timeout));
  std::size_t connected = 0;
  for (store::CellLink* cell : impl_->cell_map(d)->links) {
    KVSTASH_ASSIGN_OR_RETURN(auto c, impl_->borrow(*cell, d));
    KVSTASH_ASSIGN_OR_RETURN(auto nodes, c->live_nodes());
    for (const metadata::NodeEndpoint& n : nodes) {
      auto link = impl_->links->link(n, d);
      if (link.is_ok()) {
        ++connected;
      } else {
        KVSTASH_LOG_WARN_LIMITED("store: node {} not connected ahead of use: {}", n.id,
                                 link.status().to_string());
      }
    }
  }
  return connected;
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

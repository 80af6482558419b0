// The engine: transports, registration, addresses and keys, peer connection and submission.
#include <algorithm>

#include "common/checksum_core.h"
#include "common/log.h"
#include "common/ranges.h"
#include "common/system.h"
#include "common/wire.h"
#include "engine/blobs.h"
#include "engine/engine_internal.h"
#include "transport/registry.h"

namespace kvstash {
namespace {

using blobs::decode_parts;
using blobs::encode_parts;
using blobs::kAddressMagic;
using blobs::kKeyMagic;
using blobs::Parts;

// Lower is better, from capabilities alone: bytes that move without the peer's CPU first,
// among those a same-host-only transport (the cheapest path there is), and then one that
// holds leases at the peer ahead of one that does not. Today that orders shm, verbs, UCX over
// RDMA, tcp, UCX emulating RMA over TCP. Ties keep the order of EngineOptions::transports.
int rank(const transport::Transport& t) {
  const transport::Capabilities c = t.capabilities();
  return (c.one_sided ? 0 : 4) + (c.same_host_only ? 0 : 2) + (c.leases ? 0 : 1);
}

// Why a kind has no plugin here.
std::string not_built(TransportKind kind) {
  return "this build has no " + std::string(to_string(kind)) +
         " transport (its library was missing when it was built)";
}

Result<std::unique_ptr<transport::Transport>> start_transport(TransportKind kind,
                                                              const EngineOptions& options) {
  const transport::Plugin* plugin = transport::find_plugin(kind);
  if (plugin == nullptr) return Status::unsupported(not_built(kind));
  return plugin->start(options);
}

}  // namespace

std::vector<TransportFinding> probe_transports() {
  std::vector<TransportFinding> out;
  for (const transport::Plugin* p : transport::plugins()) {
    auto found = p->probe();
    out.insert(out.end(), std::make_move_iterator(found.begin()), std::make_move_iterator(found.end()));
  }
  for (TransportKind kind : kTransportKinds) {
    if (transport::find_plugin(kind) != nullptr) continue;
    out.push_back(
        {"transport " + std::string(to_string(kind)), TransportFinding::Level::kInfo, not_built(kind), ""});
  }
  return out;
}

std::string to_text(std::string_view blob) { return wire::to_hex(blob); }

Result<std::string> from_text(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  auto bytes = wire::from_hex(text);
  if (!bytes) return Status::invalid_argument("not a kvstash address or key: expected hex text");
  return std::move(*bytes);
}

// ---- Engine ---------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  Parts parts;
  for (const auto& t : impl_->transports) parts.emplace_back(t->kind(), t->local_address());
  address_ = encode_parts(kAddressMagic, 0, 0, parts, false);
}

Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options) {
  // Empty means "no token"; any other must be one a guesser cannot reach.
  if (!options.cluster_token.empty()) {
    KVSTASH_RETURN_IF_ERROR(sys::check_cluster_token(options.cluster_token, "EngineOptions::cluster_token"));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  std::vector<TransportKind> kinds = options.transports;
  const bool explicit_list = !kinds.empty();
  if (!explicit_list) {
    for (const transport::Plugin* p : transport::plugins()) kinds.push_back(p->kind);
  }
  for (TransportKind kind : kinds) {
    auto t = start_transport(kind, options);
    if (!t.is_ok()) {
      if (explicit_list) return t.status().with_context(std::string("start ") + std::string(to_string(kind)));
      if (t.status().code() != StatusCode::kUnsupported) {
        KVSTASH_LOG_WARN("transport {} not started: {}", to_string(kind), t.status().to_string());
      }
      continue;
    }
    impl->transports.push_back(std::move(t).value());
  }
  if (impl->transports.empty()) return Status::unavailable("no transport could start");
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

std::vector<TransportKind> Engine::transports() const {
  std::vector<TransportKind> out;
  for (const auto& t : impl_->transports) out.push_back(t->kind());
  return out;
}

void Engine::fence(std::uint64_t through) {
  for (const auto& t : impl_->transports) t->fence(through);
}

void Engine::set_grant_check(std::shared_ptr<const GrantCheck> check) {
  for (const auto& t : impl_->transports) t->set_grant_check(check);
}

std::vector<TransportCounter> Engine::counters() const {
  std::vector<TransportCounter> out;
  for (const auto& t : impl_->transports) {
    auto c = t->counters();
    out.insert(out.end(), std::make_move_iterator(c.begin()), std::make_move_iterator(c.end()));
  }
  return out;
}

Result<MemoryHandle> Engine::register_memory(const MemoryRegion& region, Access access,
                                             std::span<const TransportKind> only) {
  if (region.addr == nullptr || region.length == 0) {
    return Status::invalid_argument("cannot register an empty region");
  }
  MemoryHandle h;
  h.region_ = region;
  h.regs_ = std::make_unique<MemoryHandle::Registrations>();
  Status first_error;
  Parts keys;
  for (const auto& t : impl_->transports) {
    if (!only.empty() && std::find(only.begin(), only.end(), t->kind()) == only.end()) continue;
    auto reg = t->register_memory(region, access);
    if (!reg.is_ok()) {
      // One transport declining (shm without an fd, tcp with GPU memory) is normal; peers
      // reached through it then cannot use this region.
      if (first_error.is_ok()) first_error = reg.status().with_context(std::string(to_string(t->kind())));
      continue;
    }
    if (access != Access::kLocal) keys.emplace_back(t->kind(), (*reg)->packed_key());
    h.regs_->by_kind.emplace_back(t->kind(), std::move(reg).value());
  }
  if (h.regs_->by_kind.empty()) {
    return first_error.is_ok() ? Status::unsupported("register: none of the transports asked for runs here")
                               : first_error;
  }
  if (access != Access::kLocal) {
    h.remote_key_ =
        encode_parts(kKeyMagic, reinterpret_cast<std::uintptr_t>(region.addr), region.length, keys, true);
  }
  return h;
}

Result<std::unique_ptr<Peer>> Engine::connect(std::string_view peer_address, std::optional<Deadline> deadline,
                                              std::optional<TransportKind> force, bool require_leases) {
  auto decoded = decode_parts(peer_address, kAddressMagic, false);
  if (!decoded) return Status::invalid_argument("malformed peer address");
  const Deadline d = deadline.value_or(deadline_after(impl_->options.control_timeout));

  std::vector<std::pair<transport::Transport*, std::string>> candidates;
  for (const auto& t : impl_->transports) {
    if (force && t->kind() != *force) continue;
    if (require_leases && !t->capabilities().leases) continue;
    for (const auto& [kind, addr] : decoded->parts) {
      if (kind == t->kind() && t->can_reach(addr)) candidates.emplace_back(t.get(), addr);
    }
  }
  auto preferred = force ? force : impl_->options.prefer;
  std::stable_sort(candidates.begin(), candidates.end(), [&](const auto& a, const auto& b) {
    bool pa = preferred && a.first->kind() == *preferred;
    bool pb = preferred && b.first->kind() == *preferred;
    if (pa != pb) return pa;
    return rank(*a.first) < rank(*b.first);
  });
  if (candidates.empty()) {
    if (force) return Status::unsupported("peer cannot be reached over " + std::string(to_string(*force)));
    return Status::unsupported(require_leases ? "no transport in common with the peer that holds leases there"
                                              : "no transport in common with the peer");
  }
  Status last;
  for (auto& [t, addr] : candidates) {
    auto ep = t->connect(addr, d);
    if (!ep.is_ok()) {
      last = ep.status().with_context(std::string("connect over ") + std::string(to_string(t->kind())));
      KVSTASH_LOG_INFO_LIMITED("{}", last.to_string());
      if (last.code() == StatusCode::kPermissionDenied) return last;  // don't downgrade past a refusal
      continue;
    }
    auto state = std::make_shared<Peer::State>();
    state->transport = t;
    state->caps = t->capabilities();
    state->peer_address = addr;
    state->control_timeout = impl_->options.control_timeout;
    state->busy_poll = impl_->options.busy_poll;
    state->endpoint = std::move(ep).value();
    return std::unique_ptr<Peer>(new Peer(std::move(state)));
  }
  return last;
}

// ---- MemoryHandle, RemoteMemory -------------------------------------------------------------

MemoryHandle::MemoryHandle() = default;
MemoryHandle::MemoryHandle(MemoryHandle&&) noexcept = default;
MemoryHandle& MemoryHandle::operator=(MemoryHandle&&) noexcept = default;
MemoryHandle::~MemoryHandle() = default;

bool MemoryHandle::covers(const void* addr, std::size_t len) const {
  auto base = reinterpret_cast<std::uintptr_t>(region_.addr);
  auto a = reinterpret_cast<std::uintptr_t>(addr);
  return a >= base && a - base <= region_.length && len <= region_.length - (a - base);
}

std::vector<TransportKind> MemoryHandle::transports() const {
  std::vector<TransportKind> out;
  if (regs_) {
    for (const auto& r : regs_->by_kind) out.push_back(r.first);
  }
  return out;
}

RemoteMemory::RemoteMemory() = default;
RemoteMemory::RemoteMemory(RemoteMemory&&) noexcept = default;
RemoteMemory& RemoteMemory::operator=(RemoteMemory&&) noexcept = default;
RemoteMemory::~RemoteMemory() = default;

std::span<const RemoteRange> RemoteMemory::ranges() const {
  if (!state_ || !state_->lease) return {};
  return state_->lease->ranges;
}

bool RemoteMemory::revocable() const {
  if (!state_) return false;
  std::lock_guard lock(state_->mu);
  return state_->revocable;
}

Result<std::shared_ptr<transport::RemoteKey>> RemoteMemory::State::key_for(
    const std::shared_ptr<transport::Endpoint>& ep, std::uint64_t gen, std::uint64_t base,
    std::uint64_t length, Deadline deadline) {
  {
    std::unique_lock lock(mu);
    KVSTASH_ASSIGN_OR_RETURN(bool ready, making.take(
                                             lock, deadline, [&] { return generation == gen && key; },
                                             "remote key: import or lease"));
    if (ready) return key;
  }
  // The peer is asked without the lock held, so a caller with a shorter deadline is never
  // stuck behind this one.
  std::shared_ptr<transport::RemoteKey> made;
  bool made_revocable = false;
  Status failed;
  if (!lease) {
    auto k = ep->import_key(base, length, packed, deadline);
    if (k.is_ok()) {
      made = std::move(k).value();
    } else {
      failed = k.status();
    }
  } else {
    auto region_key = lease->region->key_for(ep, gen, lease->region_base, lease->region_length, deadline);
    const auto now = Clock::now();
    if (!region_key.is_ok()) {
      failed = region_key.status();
    } else if (now >= lease->until) {
      failed = Status::stale("lease: its time is up (lease again)");
    } else {
      transport::LeaseTerms terms = lease->terms;
      terms.ttl = std::chrono::ceil<std::chrono::milliseconds>(lease->until - now);
      auto k = ep->lease_key(**region_key, lease->ranges, terms, deadline);
      if (k.is_ok()) {
        made = std::move(k).value();
        made_revocable = true;
      } else if (k.status().code() == StatusCode::kUnsupported) {
        made = std::move(region_key).value();  // no leases here: the ranges are checked in submit
      } else {
        failed = k.status();
      }
    }
  }
  std::lock_guard lock(mu);
  making.end();
  if (!failed.is_ok()) return failed;
  key = std::move(made);
  revocable = made_revocable;
  generation = gen;
  return key;
}

// ---- Peer -----------------------------------------------------------------------------------

Peer::Peer(std::shared_ptr<State> state) : state_(std::move(state)) {}
Peer::~Peer() = default;

TransportKind Peer::transport() const { return state_->transport->kind(); }

bool Peer::leases() const { return state_->caps.leases; }
bool Peer::lease_asks_peer() const { return state_->caps.lease_asks_target; }

std::shared_ptr<Batch::State> Peer::State::batch_state(std::size_t entries, Deadline deadline) {
  constexpr std::size_t kBatchPool = 64;  // batches of one peer in flight at once, kept for reuse
  std::lock_guard lock(batches_mu);
  for (auto& s : batches) {
    if (s.use_count() == 1) {  // only the pool holds it: its batch has ended
      s->reset(entries, deadline);
      s->busy_poll = busy_poll;
      return s;
    }
  }
  auto fresh = std::make_shared<Batch::State>(entries, deadline);
  fresh->busy_poll = busy_poll;
  if (batches.size() < kBatchPool) batches.push_back(fresh);
  return fresh;
}
bool Peer::digests_writes() const {
  // Slices start on a block: each op's digests are the entry's from its first block.
  const auto& c = state_->caps;
  return c.digests_writes && c.slice_bytes % sum::kBlockBytes == 0;
}

Result<std::pair<std::shared_ptr<transport::Endpoint>, std::uint64_t>> Peer::State::current(
    Deadline deadline) {
  std::unique_lock lock(mu);
  KVSTASH_ASSIGN_OR_RETURN(
      bool ready, connecting.take(
                      lock, deadline, [&] { return endpoint && endpoint->healthy(); }, "peer: reconnect"));
  if (ready) return std::make_pair(endpoint, generation);
  endpoint.reset();
  lock.unlock();
  // Connecting without the lock: a caller with a shorter deadline waits only up to its own.
  auto ep = transport->connect(peer_address, std::min(deadline, deadline_after(control_timeout)));
  lock.lock();
  connecting.end();
  if (!ep.is_ok()) return ep.status();
  endpoint = std::move(ep).value();
  ++generation;
  KVSTASH_LOG_INFO_LIMITED("reconnected to peer over {}", to_string(transport->kind()));
  return std::make_pair(endpoint, generation);
}

Result<RemoteMemory> Peer::import_key(std::string_view remote_key, std::optional<Deadline> deadline) {
  auto decoded = decode_parts(remote_key, kKeyMagic, true);
  if (!decoded) return Status::invalid_argument("malformed remote key");
  const Deadline d = deadline.value_or(deadline_after(state_->control_timeout));
  const TransportKind kind = state_->transport->kind();
  auto part = std::find_if(decoded->parts.begin(), decoded->parts.end(),
                           [&](const auto& p) { return p.first == kind; });
  if (part == decoded->parts.end()) {
    return Status::unsupported(std::string("remote key has no part for transport ") +
                               std::string(to_string(kind)));
  }
  RemoteMemory rm;
  rm.base_ = decoded->base;
  rm.length_ = decoded->length;
  rm.state_ = std::make_shared<RemoteMemory::State>();
  rm.state_->peer = state_;
  rm.state_->packed = std::move(part->second);
  KVSTASH_ASSIGN_OR_RETURN(auto ep, state_->current(d));
  KVSTASH_RETURN_IF_ERROR(rm.state_->key_for(ep.first, ep.second, rm.base_, rm.length_, d).status());
  return rm;
}

Result<RemoteMemory> Peer::lease(const RemoteMemory& region, std::span<const RemoteRange> ranges,
                                 const LeaseOptions& options) {
  if (!region.state_ || region.state_->peer != state_) {
    return Status::invalid_argument("lease: the region was not imported through this peer");
  }
  if (region.state_->lease) return Status::invalid_argument("lease: a lease cannot be leased again");
  // One message to the peer carries a lease that asks it (verbs: kMaxLeaseRanges); elsewhere
  // it travels with the requests, as many ranges as an object has.
  constexpr std::size_t kMaxLeaseRangesLocal = 1u << 20;
  const std::size_t most = state_->caps.lease_asks_target ? kMaxLeaseRanges : kMaxLeaseRangesLocal;
  if (ranges.empty() || ranges.size() > most) {
    return Status::invalid_argument("lease: between 1 and " + std::to_string(most) + " ranges, not " +
                                    std::to_string(ranges.size()));
  }
  if (options.ttl.count() <= 0) return Status::invalid_argument("lease: ttl must be positive");
  RemoteMemory::State::Lease l;
  l.region = region.state_;
  l.region_base = region.base_;
  l.region_length = region.length_;
  l.ranges.assign(ranges.begin(), ranges.end());
  std::sort(l.ranges.begin(), l.ranges.end(), [](const auto& a, const auto& b) { return a.addr < b.addr; });
  for (std::size_t i = 0; i < l.ranges.size(); ++i) {
    const RemoteRange& r = l.ranges[i];
    if (r.length == 0 || r.addr < region.base_ || r.addr - region.base_ > region.length_ ||
        r.length > region.length_ - (r.addr - region.base_)) {
      return Status::invalid_argument("lease: range " + std::to_string(i) +
                                      " is empty or outside the region");
    }
    if (i > 0 && l.ranges[i - 1].addr + l.ranges[i - 1].length > r.addr) {
      return Status::invalid_argument("lease: ranges overlap");
    }
  }
  l.terms.id = sys::random_u64() | 1;  // never 0: on the wire 0 means "no lease"
  l.terms.op = options.op;
  l.terms.ttl = options.ttl;
  l.terms.fence = options.fence;
  if (!options.grant.empty()) {
    if (options.grant.size() > kMaxGrantBytes) {
      return Status::invalid_argument("lease: a grant of " + std::to_string(options.grant.size()) +
                                      " bytes, at most " + std::to_string(kMaxGrantBytes));
    }
    l.terms.grant = std::make_shared<const std::string>(options.grant);
  }
  l.until = Clock::now() + options.ttl;
  const Deadline d = options.deadline.value_or(deadline_after(state_->control_timeout));
  RemoteMemory rm;
  rm.base_ = region.base_;
  rm.length_ = region.length_;
  rm.state_ = std::make_shared<RemoteMemory::State>();
  rm.state_->peer = state_;
  rm.state_->lease = std::move(l);
  KVSTASH_ASSIGN_OR_RETURN(auto ep, state_->current(d));
  KVSTASH_RETURN_IF_ERROR(rm.state_->key_for(ep.first, ep.second, rm.base_, rm.length_, d).status());
  return rm;
}

Status Peer::revoke(const RemoteMemory& lease, Deadline deadline) {
  const auto& st = lease.state_;
  if (!st || !st->lease || st->peer != state_) {
    return Status::invalid_argument("revoke: not a lease made through this peer");
  }
  std::shared_ptr<transport::RemoteKey> key;
  {
    std::lock_guard lock(st->mu);
    if (!st->revocable) {
      return Status::unsupported(std::string("revoke: ") + std::string(to_string(state_->transport->kind())) +
                                 " has no leases; the lease was only checked on this side");
    }
    key = st->key;
  }
  // Through the current connection, also when the lease was used on one that broke since:
  // the peer revokes the lease id on every connection.
  KVSTASH_ASSIGN_OR_RETURN(auto ep, state_->current(deadline));
  return ep.first->revoke(*key, st->lease->terms, deadline);
}

namespace {

}  // namespace

namespace {

// The ops of one submit, in a list this thread keeps (the transport takes them by value, so a
// warm submit allocates none); a submit nested inside another's post gets a list of its own.
class OpList {
 public:
  OpList() : outer_(!t_busy), ops_(outer_ ? t_ops : own_) {
    t_busy = true;
    ops_.clear();
  }
  ~OpList() {
    if (outer_) t_busy = false;
  }
  OpList(const OpList&) = delete;
  OpList& operator=(const OpList&) = delete;
  std::vector<transport::Op>& operator*() { return ops_; }

 private:
  static thread_local std::vector<transport::Op> t_ops;
  static thread_local bool t_busy;
  bool outer_;
  std::vector<transport::Op> own_;
  std::vector<transport::Op>& ops_;
};
thread_local std::vector<transport::Op> OpList::t_ops;
thread_local bool OpList::t_busy = false;

}  // namespace

Result<Batch> Peer::submit(std::span<const TransferEntry> entries, Deadline deadline) {
  if (entries.empty()) return Status::invalid_argument("empty batch");
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const TransferEntry& e = entries[i];
    // The prefix is built only for an error: this loop runs on every submit.
    const auto where = [i] { return "entry " + std::to_string(i) + ": "; };
    if (e.length == 0) return Status::invalid_argument(where() + "length is 0");
    if (e.local == nullptr || !e.local->covers(e.local_addr, e.length)) {
      return Status::invalid_argument(where() + "local range is not inside its registered memory");
    }
    if (e.remote == nullptr || !e.remote->state_ || e.remote->state_->peer != state_) {
      return Status::invalid_argument(where() + "remote memory was not imported through this peer");
    }
    const std::uint64_t base = e.remote->base();
    if (e.remote_addr < base || e.remote_addr - base > e.remote->length() ||
        e.length > e.remote->length() - (e.remote_addr - base)) {
      return Status::invalid_argument(where() + "remote range is outside the remote key's region");
    }
    if (const auto& l = e.remote->state_->lease) {
      if (Clock::now() >= l->until) return Status::stale(where() + "the lease's time is up");
      if (!rangeset::covers(l->ranges, e.remote_addr, e.length)) {
        return Status::permission_denied(where() + "remote range is outside the lease's ranges");
      }
      if (e.op != l->terms.op) {
        return Status::permission_denied(where() + "the lease grants " + std::string(to_string(l->terms.op)) +
                                         ", not " + std::string(to_string(e.op)));
      }
    }
  }
  KVSTASH_ASSIGN_OR_RETURN(auto ep, state_->current(deadline));
  auto batch_state = state_->batch_state(entries.size(), deadline);
  batch_state->endpoint = ep.first;

  const auto& caps = state_->caps;
  const std::size_t slice = caps.slice_bytes == 0 ? SIZE_MAX : caps.slice_bytes;
  const TransportKind kind = state_->transport->kind();
  const bool digests = digests_writes();
  OpList list;
  std::vector<transport::Op>& ops = *list;
  ops.reserve(entries.size());
  // Lanes take slices in turn; pieces smaller than a slice that continue the previous one on
  // the remote side (a scattered local layer into one object) share its lane up to a slice's
  // worth, so the transport can send them as one request (tcp, verbs SGE lists).
  std::uint32_t lane = 0;
  std::size_t on_lane = 0;
  std::optional<transport::Op> prev;
  // Entries of one batch mostly share their remote region and local handle (a KV layer's
  // blocks): each is looked up once per run of equal ones, not once per entry.
  const RemoteMemory* key_of = nullptr;
  std::shared_ptr<transport::RemoteKey> key;
  const MemoryHandle* reg_of = nullptr;
  const transport::LocalRegistration* local_reg = nullptr;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const TransferEntry& e = entries[i];
    if (e.remote != key_of) {
      auto k = e.remote->state_->key_for(ep.first, ep.second, e.remote->base(), e.remote->length(), deadline);
      if (!k.is_ok()) return k.status();
      key = std::move(k).value();
      key_of = e.remote;
      if (batch_state->keys.empty() || batch_state->keys.back() != key) batch_state->keys.push_back(key);
    }
    if (e.local != reg_of) {
      local_reg = e.local->regs_->find(kind);
      reg_of = e.local;
    }
    const std::size_t parts = (e.length - 1) / slice + 1;  // e.length > 0; no overflow at SIZE_MAX
    batch_state->parts_left[i].store(static_cast<std::uint32_t>(parts), std::memory_order_relaxed);
    for (std::size_t off = 0; off < e.length; off += slice) {
      transport::Op op;
      op.op = e.op;
      op.local = static_cast<std::byte*>(e.local_addr) + off;
      op.local_reg = local_reg;
      op.remote_addr = e.remote_addr + off;
      op.remote_key = key.get();
      op.length = std::min(slice, e.length - off);
      const bool continues = prev && prev->op == op.op && prev->remote_key == op.remote_key &&
                             prev->remote_addr + prev->length == op.remote_addr;
      if (on_lane > 0 && (!continues || on_lane + op.length > slice)) {
        ++lane;
        on_lane = 0;
      }
      op.lane = lane % std::max<std::uint32_t>(1, caps.lanes);
      on_lane += op.length;
      op.sink = batch_state.get();
      op.tag = static_cast<std::uint32_t>(i);
      if (e.block_digests != nullptr && e.op == TransferOp::kWrite && digests) {
        op.digests = e.block_digests + off / sum::kBlockBytes;
      }
      ops.push_back(op);
      prev = op;
    }
  }
  ep.first->post(ops);
  Batch b;
  b.state_ = std::move(batch_state);
  return b;
}

Status Peer::transfer(std::span<const TransferEntry> entries, Deadline deadline) {
  KVSTASH_ASSIGN_OR_RETURN(Batch b, submit(entries, deadline));
  return b.wait();
}

}  // namespace kvstash

// KvExport and KvImport (include/kvstash/kvpeer.h): a cache's blocks read one-sided out of a
// peer's cache under leases.
//
// The descriptor, one field per line (numbers in decimal, blobs in hex):
//   kvstash-export 1
//   tag <KvLayout::tag()>      blocks <num_blocks>
//   address <Engine::address()>
//   strides <part_stride> <block_stride>
//   transports <kind> ...                   those that registered every region, best first
//   region <base> <length> <remote key>     one per region
//   layer <region> <base>                   one per layer
// A reader trusts none of it: the shape must be its own, and KvLayout::custom checks that every
// block lies inside a region the peer named; the peer's leases check the rest.
#include <algorithm>
#include <charconv>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "common/grant.h"
#include "common/ranges.h"
#include "common/system.h"
#include "kvstash/engine.h"
#include "kvstash/kvcache.h"
#include "kvstash/kvpeer.h"
#include "kvstash/store.h"

namespace kvstash {

namespace {

constexpr std::string_view kMagic = "kvstash-export 1";
constexpr std::size_t kMaxRegions = 4096;
constexpr std::size_t kMaxDescriptor = 4 << 20;
// Peers (and their imported keys) a reader keeps; past it they are all dropped and made anew.
constexpr std::size_t kMaxPeers = 64;

Status bad(std::string_view what) {
  return Status::invalid_argument("kvpeer descriptor: " + std::string(what));
}

// The KV heads a layout tag names ("L32.P2.H8.D128..." -> 8).
std::optional<std::uint32_t> heads_of(std::string_view tag) {
  const std::size_t at = tag.find(".H");
  if (at == std::string_view::npos) return std::nullopt;
  std::uint32_t n = 0;
  const char* end = tag.data() + tag.size();
  auto [p, ec] = std::from_chars(tag.data() + at + 2, end, n);
  if (ec != std::errc() || n == 0 || (p != end && *p != '.')) return std::nullopt;
  return n;
}

std::string_view next_line(std::string_view& text) {
  const std::size_t nl = text.find('\n');
  std::string_view line = text.substr(0, nl);
  text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
  return line;
}

std::vector<std::string_view> words(std::string_view line) {
  std::vector<std::string_view> out;
  while (!line.empty()) {
    const std::size_t sp = line.find(' ');
    if (sp != 0) out.push_back(line.substr(0, sp));
    line.remove_prefix(sp == std::string_view::npos ? line.size() : sp + 1);
  }
  return out;
}

std::optional<std::uint64_t> number(std::string_view s) {
  std::uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

// A peer's export, parsed.
struct Described {
  std::string tag;
  std::uint32_t num_blocks = 0;
  std::string address;  // binary
  std::vector<TransportKind> transports;
  std::uint64_t part_stride = 0, block_stride = 0;
  struct Region {
    std::uint64_t base = 0, length = 0;
    std::string key;  // binary
  };
  std::vector<Region> regions;
  std::vector<std::pair<std::uint32_t, std::uint64_t>> layers;  // region, base
};

Result<Described> parse(std::string_view text) {
  if (text.size() > kMaxDescriptor) return bad("too long");
  if (next_line(text) != kMagic) return bad("not a kvstash export (or another version)");
  Described d;
  while (!text.empty()) {
    const auto w = words(next_line(text));
    if (w.empty()) continue;
    auto num = [&](std::size_t i) { return i < w.size() ? number(w[i]) : std::nullopt; };
    if (w[0] == "tag" && w.size() == 4 && w[2] == "blocks" && num(3) && *num(3) > 0 &&
        *num(3) <= UINT32_MAX) {
      d.tag = std::string(w[1]);
      d.num_blocks = static_cast<std::uint32_t>(*num(3));
    } else if (w[0] == "address" && w.size() == 2) {
      KVSTASH_ASSIGN_OR_RETURN(d.address, from_text(w[1]));
    } else if (w[0] == "strides" && w.size() == 3 && num(1) && num(2)) {
      d.part_stride = *num(1);
      d.block_stride = *num(2);
    } else if (w[0] == "transports" && w.size() > 1 && w.size() <= 5) {
      for (std::size_t i = 1; i < w.size(); ++i) {
        auto kind = parse_transport_kind(w[i]);
        if (!kind) return bad("unknown transport '" + std::string(w[i]) + "'");
        d.transports.push_back(*kind);
      }
    } else if (w[0] == "region" && w.size() == 4 && num(1) && num(2) && *num(1) > 0 && *num(2) > 0 &&
               *num(1) + *num(2) > *num(1) && d.regions.size() < kMaxRegions) {
      KVSTASH_ASSIGN_OR_RETURN(std::string key, from_text(w[3]));
      d.regions.push_back({*num(1), *num(2), std::move(key)});
    } else if (w[0] == "layer" && w.size() == 3 && num(1) && num(2) && *num(1) < d.regions.size()) {
      d.layers.emplace_back(static_cast<std::uint32_t>(*num(1)), *num(2));
    } else {
      return bad("unexpected line '" + std::string(w[0]) + "...'");
    }
  }
  if (d.tag.empty() || d.address.empty() || d.transports.empty() || d.regions.empty() || d.layers.empty()) {
    return bad("a tag, an address, transports, regions and layers are needed");
  }
  return d;
}

// Pairs two run lists of the same bytes (object order on both sides), cut where either side's
// run ends.
template <typename Fn>
Status zip_runs(std::span<const KvRun> remote, std::span<const KvRun> local, Fn fn) {
  std::size_t i = 0, j = 0;
  std::uint64_t ri = 0, lj = 0;  // bytes of remote[i] / local[j] already paired
  while (i < remote.size() && j < local.size()) {
    const std::uint64_t n = std::min(remote[i].length - ri, local[j].length - lj);
    fn(remote[i], ri, local[j], lj, n);
    ri += n;
    lj += n;
    if (ri == remote[i].length) ++i, ri = 0;
    if (lj == local[j].length) ++j, lj = 0;
  }
  if (i != remote.size() || j != local.size())
    return Status::internal("kvpeer: the two sides' runs differ in size");
  return {};
}

std::uint64_t address_of(const KvRun& r) { return reinterpret_cast<std::uintptr_t>(r.addr); }

}  // namespace

// ---- KvExport -----------------------------------------------------------------------------

namespace {

// The grants of every KvExport of this process, by issuer: one check for all of them, since an
// engine holds one (several exports may share a store's engine).
class ExportGrants final : public GrantCheck {
 public:
  static const std::shared_ptr<ExportGrants>& instance() {
    static const auto grants = std::make_shared<ExportGrants>();
    return grants;
  }

  void add(const std::string& issuer, std::vector<std::uint8_t> key) {
    std::lock_guard lock(mu_);
    keys_[issuer] = std::move(key);
  }
  void remove(const std::string& issuer) {
    std::lock_guard lock(mu_);
    keys_.erase(issuer);
  }

  // Runs are byte ranges of the exporter's address space: first = address, count = length.
  Result<Grant> check(std::string_view text) const override {
    // The issuer is the text's second word; the MAC decides whether any of it holds.
    const auto a = text.find(' '), b = a == std::string_view::npos ? a : text.find(' ', a + 1);
    if (b == std::string_view::npos)
      return Status::permission_denied("kvpeer: a read needs the exporter's grant");
    grant::Terms t;
    {
      std::lock_guard lock(mu_);
      auto it = keys_.find(std::string(text.substr(a + 1, b - a - 1)));
      if (it == keys_.end()) return Status::permission_denied("kvpeer: a grant of no export of this process");
      KVSTASH_ASSIGN_OR_RETURN(t, grant::verify(it->second, text));
    }
    if (t.whole) return Status::permission_denied("kvpeer: an export grants blocks, never the whole cache");
    Grant g{t.op, t.deadline, {}};
    for (const auto& [addr, length] : t.runs) g.ranges.push_back({addr, length});
    return g;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::vector<std::uint8_t>, std::less<>> keys_;
};

}  // namespace

struct KvExport::Impl {
  ~Impl() {
    if (!issuer.empty()) ExportGrants::instance()->remove(issuer);
  }
  Engine* engine = nullptr;
  std::vector<MemoryHandle> handles;
  std::string descriptor;
  std::optional<KvLayout> layout;
  std::string issuer;  // this export's name in its grants
  std::vector<std::uint8_t> key;
};

Result<std::unique_ptr<KvExport>> KvExport::open(Store& store, const KvLayout& layout) {
  auto impl = std::make_unique<Impl>();
  impl->engine = &store.engine();
  impl->layout = layout;
  // A peer reads the cache under the grants this export signs (grant()), and nothing else: the
  // check is installed before any region can be reached.
  impl->issuer = "kvx-" + std::to_string(sys::random_u64());
  impl->key = grant::new_key();
  ExportGrants::instance()->add(impl->issuer, impl->key);
  impl->engine->set_grant_check(ExportGrants::instance());
  std::ostringstream d;
  d << kMagic << "\ntag " << layout.tag() << " blocks " << layout.shape().num_blocks << "\naddress "
    << to_text(impl->engine->address()) << "\nstrides " << layout.part_stride() << ' '
    << layout.block_stride() << '\n';
  std::ostringstream regions;
  std::vector<TransportKind> every = impl->engine->transports();  // those every region took
  for (const MemoryRegion& r : layout.regions()) {
    KVSTASH_ASSIGN_OR_RETURN(MemoryHandle h, impl->engine->register_memory(r, Access::kLeased));
    regions << "region " << reinterpret_cast<std::uintptr_t>(r.addr) << ' ' << r.length << ' '
            << to_text(h.remote_key()) << '\n';
    const auto took = h.transports();
    std::erase_if(every,
                  [&](TransportKind k) { return std::find(took.begin(), took.end(), k) == took.end(); });
    impl->handles.push_back(std::move(h));
  }
  if (every.empty()) return Status::unsupported("kvpeer: no transport of this engine serves every region");
  d << "transports";
  for (TransportKind k : every) d << ' ' << to_string(k);
  d << '\n' << regions.str();
  for (std::uint32_t l = 0; l < layout.shape().num_layers; ++l) {
    d << "layer " << layout.layer_region(l) << ' ' << reinterpret_cast<std::uintptr_t>(layout.layer_base(l))
      << '\n';
  }
  impl->descriptor = d.str();
  return std::unique_ptr<KvExport>(new KvExport(std::move(impl)));
}

KvExport::KvExport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvExport::~KvExport() = default;
const std::string& KvExport::descriptor() const { return impl_->descriptor; }
void KvExport::fence(std::uint64_t through) { impl_->engine->fence(through); }

Result<std::string> KvExport::grant(std::span<const std::uint32_t> blocks, std::uint64_t fence) const {
  if (blocks.empty()) return Status::invalid_argument("kvpeer: a grant of no blocks");
  if (fence == 0) return Status::invalid_argument("kvpeer: a grant needs a fence tag (its deadline)");
  std::vector<RemoteRange> ranges;
  std::vector<KvRun> runs;
  for (std::uint32_t l = 0; l < impl_->layout->shape().num_layers; ++l) {
    runs.clear();
    KVSTASH_RETURN_IF_ERROR(impl_->layout->layer_runs(l, blocks, runs));
    for (const KvRun& r : runs) ranges.push_back({reinterpret_cast<std::uintptr_t>(r.addr), r.length});
  }
  rangeset::merge(ranges);
  grant::Terms t{.issuer = impl_->issuer, .epoch = "0", .op = TransferOp::kRead, .deadline = fence};
  for (const RemoteRange& r : ranges) t.runs.emplace_back(r.addr, r.length);
  std::string text = grant::sign(impl_->key, t);
  if (text.size() > kMaxGrantBytes) return Status::invalid_argument("kvpeer: too many blocks for one grant");
  return text;
}

// ---- KvPeerRead ---------------------------------------------------------------------------

// Members go bottom up: the batch (cancelled and waited for) before the leases it runs under.
struct KvPeerRead::State {
  std::shared_ptr<Peer> peer;
  std::vector<std::shared_ptr<RemoteMemory>> regions;
  std::vector<RemoteMemory> leases;
  std::uint64_t bytes = 0;
  Batch batch;
};

KvPeerRead::KvPeerRead() = default;
KvPeerRead::KvPeerRead(KvPeerRead&&) noexcept = default;
KvPeerRead& KvPeerRead::operator=(KvPeerRead&&) noexcept = default;
KvPeerRead::~KvPeerRead() = default;
bool KvPeerRead::poll() { return !state_ || state_->batch.poll(); }
Status KvPeerRead::wait() {
  return state_ ? state_->batch.wait() : Status::invalid_argument("an empty read");
}
void KvPeerRead::cancel() {
  if (state_) state_->batch.cancel();
}
std::uint64_t KvPeerRead::bytes() const { return state_ ? state_->bytes : 0; }

// ---- KvImport -----------------------------------------------------------------------------

struct KvImport::Impl {
  Engine* engine = nullptr;
  KvLayout layout;
  std::vector<MemoryHandle> handles;  // one per layout region

  struct Known {
    std::shared_ptr<Peer> peer;
    std::map<std::string, std::shared_ptr<RemoteMemory>> keys;  // remote key -> imported region
  };
  std::mutex mu;
  std::map<std::string, Known> peers;  // by engine address

  // A connection over the best transport both engines run that registered the export's memory
  // (shm takes only fd-backed memory), whose leases the peer enforces: its fence must bind us.
  Result<std::shared_ptr<Peer>> peer(const std::string& address, std::span<const TransportKind> served,
                                     Deadline deadline) {
    {
      std::lock_guard lock(mu);
      auto it = peers.find(address);
      if (it != peers.end()) return it->second.peer;
    }
    Result<std::unique_ptr<Peer>> p = engine->connect(address, deadline, {}, true);
    const auto ours = engine->transports();
    for (TransportKind k : served) {
      if (p.is_ok() && std::find(served.begin(), served.end(), (*p)->transport()) != served.end()) break;
      if (std::find(ours.begin(), ours.end(), k) != ours.end())
        p = engine->connect(address, deadline, k, true);
    }
    if (p.is_ok() && std::find(served.begin(), served.end(), (*p)->transport()) == served.end()) {
      return Status::unsupported("kvpeer: no transport in common that serves the export's memory");
    }
    KVSTASH_RETURN_IF_ERROR(p.status());
    std::lock_guard lock(mu);
    if (peers.size() >= kMaxPeers) peers.clear();  // reads in flight keep theirs alive
    auto [it, _] = peers.try_emplace(address, Known{std::shared_ptr<Peer>(std::move(p).value()), {}});
    return it->second.peer;
  }

  Result<std::shared_ptr<RemoteMemory>> region(const std::string& address, Peer& peer, const std::string& key,
                                               Deadline deadline) {
    {
      std::lock_guard lock(mu);
      auto it = peers.find(address);
      if (it != peers.end()) {
        auto k = it->second.keys.find(key);
        if (k != it->second.keys.end()) return k->second;
      }
    }
    KVSTASH_ASSIGN_OR_RETURN(RemoteMemory m, peer.import_key(key, deadline));
    auto shared = std::make_shared<RemoteMemory>(std::move(m));
    std::lock_guard lock(mu);
    auto it = peers.find(address);
    if (it != peers.end()) it->second.keys.emplace(key, shared);
    return shared;
  }
};

Result<std::unique_ptr<KvImport>> KvImport::open(Store& store, const KvLayout& layout) {
  auto impl = std::make_unique<Impl>();
  impl->engine = &store.engine();
  impl->layout = layout;
  for (const MemoryRegion& r : layout.regions()) {
    KVSTASH_ASSIGN_OR_RETURN(MemoryHandle h, impl->engine->register_memory(r, Access::kLocal));
    impl->handles.push_back(std::move(h));
  }
  return std::unique_ptr<KvImport>(new KvImport(std::move(impl)));
}

KvImport::KvImport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvImport::~KvImport() = default;

Result<KvPeerRead> KvImport::begin_read(std::string_view descriptor,
                                        std::span<const std::uint32_t> remote_blocks,
                                        std::span<const std::uint32_t> local_blocks,
                                        const KvPeerReadOptions& options, Deadline deadline) {
  Impl& im = *impl_;
  if (remote_blocks.size() != local_blocks.size() || remote_blocks.empty()) {
    return Status::invalid_argument("kvpeer: " + std::to_string(remote_blocks.size()) +
                                    " remote blocks and " + std::to_string(local_blocks.size()) +
                                    " local ones");
  }
  KVSTASH_ASSIGN_OR_RETURN(Described d, parse(descriptor));
  // The peer's layout, in its addresses (never dereferenced here): this cache's shape, with
  // the peer's heads when only some heads are read.
  KvCacheShape shape = im.layout.shape();
  shape.num_blocks = d.num_blocks;
  if (options.heads != 0) {
    auto heads = heads_of(d.tag);
    if (!heads) return bad("its tag names no heads");
    shape.num_kv_heads = *heads;
  }
  if (d.layers.size() != shape.num_layers) return bad("its layers are not the tag's");
  std::vector<MemoryRegion> regions;
  for (const auto& r : d.regions) regions.push_back({reinterpret_cast<void*>(r.base), r.length});
  std::vector<std::byte*> bases;
  for (const auto& [region, base] : d.layers) bases.push_back(reinterpret_cast<std::byte*>(base));
  KVSTASH_ASSIGN_OR_RETURN(KvLayout remote,
                           KvLayout::custom(shape, bases, d.part_stride, d.block_stride, regions));
  // Every dimension but the heads (when some are read) is this cache's.
  if (remote.tag() != d.tag) {
    return Status::invalid_argument("kvpeer: the peer's cache is " + d.tag + ", this one " + im.layout.tag());
  }
  KvLayout local = im.layout;
  if (options.heads != 0) {
    KVSTASH_ASSIGN_OR_RETURN(remote, remote.heads(options.remote_head_first, options.heads));
    KVSTASH_ASSIGN_OR_RETURN(local, local.heads(options.local_head_first, options.heads));
  }
  if (remote.tag() != local.tag()) {
    return Status::invalid_argument("kvpeer: the peer's cache is " + d.tag + ", this one " + im.layout.tag() +
                                    (options.heads != 0 ? " (some heads of each)" : ""));
  }

  // Every layer's runs on both sides (both in object order).
  std::vector<std::vector<KvRun>> remote_runs(shape.num_layers), local_runs(shape.num_layers);
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    KVSTASH_RETURN_IF_ERROR(remote.layer_runs(l, remote_blocks, remote_runs[l]));
    KVSTASH_RETURN_IF_ERROR(local.layer_runs(l, local_blocks, local_runs[l]));
  }

  auto state = std::make_unique<KvPeerRead::State>();
  KVSTASH_ASSIGN_OR_RETURN(state->peer, im.peer(d.address, d.transports, deadline));
  // Every region the read touches, imported. The peer's address space for a region need not be
  // the addresses the descriptor names (verbs keys may count from their own base): a remote
  // address is translated by region, from the descriptor's base to the key's.
  std::vector<std::vector<RemoteRange>> ranges(d.regions.size());
  for (const auto& runs : remote_runs) {
    for (const KvRun& r : runs) ranges[r.region].push_back({address_of(r), r.length});
  }
  std::vector<std::shared_ptr<RemoteMemory>> imported(d.regions.size());
  for (std::size_t r = 0; r < ranges.size(); ++r) {
    if (ranges[r].empty()) continue;
    KVSTASH_ASSIGN_OR_RETURN(imported[r], im.region(d.address, *state->peer, d.regions[r].key, deadline));
    if (imported[r]->length() < d.regions[r].length) return bad("a region longer than its key grants");
    state->regions.push_back(imported[r]);
  }
  auto peer_address = [&](const KvRun& run) {
    return address_of(run) - d.regions[run.region].base + imported[run.region]->base();
  };
  // One lease per region's ranges (at most kMaxLeaseRanges each): the blocks read, nothing else.
  struct Leased {
    std::uint64_t lo;  // the lease's first range starts here (peer addresses)
    std::size_t lease;
  };
  std::vector<std::vector<Leased>> leased(d.regions.size());
  for (std::size_t r = 0; r < ranges.size(); ++r) {
    auto& rs = ranges[r];
    if (rs.empty()) continue;
    for (RemoteRange& x : rs) x.addr = x.addr - d.regions[r].base + imported[r]->base();
    rangeset::merge(rs);
    for (std::size_t at = 0; at < rs.size(); at += kMaxLeaseRanges) {
      const std::size_t n = std::min(kMaxLeaseRanges, rs.size() - at);
      std::span<const RemoteRange> part(rs.data() + at, n);
      LeaseOptions lo{.op = TransferOp::kRead,
                      .ttl = options.ttl,
                      .fence = options.fence,
                      .grant = options.grant,
                      .deadline = deadline};
      KVSTASH_ASSIGN_OR_RETURN(RemoteMemory lease, state->peer->lease(*imported[r], part, lo));
      leased[r].push_back({part.front().addr, state->leases.size()});
      state->leases.push_back(std::move(lease));
    }
  }
  auto lease_of = [&](const KvRun& r) -> const RemoteMemory* {
    const auto& ls = leased[r.region];
    auto it = std::upper_bound(ls.begin(), ls.end(), peer_address(r),
                               [](std::uint64_t a, const Leased& l) { return a < l.lo; });
    return it == ls.begin() ? nullptr : &state->leases[std::prev(it)->lease];
  };

  std::vector<TransferEntry> entries;
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    KVSTASH_RETURN_IF_ERROR(
        zip_runs(remote_runs[l], local_runs[l],
                 [&](const KvRun& r, std::uint64_t ro, const KvRun& loc, std::uint64_t lo, std::uint64_t n) {
                   entries.push_back({.op = TransferOp::kRead,
                                      .local = &im.handles[loc.region],
                                      .local_addr = loc.addr + lo,
                                      .remote_addr = peer_address(r) + ro,
                                      .remote = lease_of(r),
                                      .length = static_cast<std::size_t>(n)});
                   state->bytes += n;
                 }));
  }
  KVSTASH_ASSIGN_OR_RETURN(state->batch, state->peer->submit(entries, deadline));
  KvPeerRead out;
  out.state_ = std::move(state);
  return out;
}

}  // namespace kvstash

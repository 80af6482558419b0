// tcp control path: listening, the connection handshake, connecting, registration.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "common/log.h"
#include "common/net.h"
#include "common/system.h"
#include "common/wire.h"
#include "transport/tcp/tcp_internal.h"
#include "transport/tcp/tcp_tls.h"
#include "transport/tcp/tcp_transport.h"

namespace kvstash::transport::tcp {

namespace {

using net::HostPort;
using net::parse_host_port;

using asio::use_awaitable;

constexpr std::uint32_t kAddressMagic = 0x3154564b;  // "KVT1"
// 2: a flags byte follows the key (1: the region is reachable through leases only).
constexpr std::uint8_t kKeyVersion = 2;

std::string encode_address(const HostPort& hp) {
  wire::Writer w;
  w.u32(kAddressMagic);
  w.bytes(hp.host);
  w.u16(hp.port);
  return w.take();
}

std::optional<HostPort> decode_address(std::string_view blob) {
  wire::Reader r(blob);
  HostPort hp;
  if (r.u32() != kAddressMagic) return std::nullopt;
  hp.host = std::string(r.bytes());
  hp.port = r.u16();
  if (!r.at_end() || hp.host.empty() || hp.host.size() > 255 || hp.port == 0) return std::nullopt;
  return hp;
}

using net::connect_tcp;

// The client side of the handshake, each step bounded by the deadline.
Status send_all(int fd, const void* data, std::size_t n, Deadline deadline) {
  return net::send_all(fd, data, n, deadline, "tcp handshake send");
}

Status recv_all(int fd, void* data, std::size_t n, Deadline deadline) {
  return net::recv_all(fd, data, n, deadline, "tcp handshake receive");
}

// Client side: over TLS when `tls` is set (the target must serve it, and its certificate must
// verify as `host`), prove the token (when we have one) and require the target to prove it
// too. Returns the TLS session (null on plain tcp).
Result<std::unique_ptr<TlsSession>> client_handshake(int fd, const std::string& token, const TlsContext* tls,
                                                     const HostPort& hp, Deadline deadline) {
  ServerHello hello;
  KVSTASH_RETURN_IF_ERROR(recv_all(fd, &hello, sizeof hello, deadline));
  std::unique_ptr<TlsSession> session;
  if (hello.magic == kTlsServerMagic) {
    if (tls == nullptr) {
      return Status::unsupported(
          fmt::format("tcp: the node at {}:{} serves TLS only, and this engine connects without it (set "
                      "TcpOptions::tls.ca_file, or KVSTASH_TLS_CA, to the cluster's CA)",
                      hp.host, hp.port));
    }
    KVSTASH_ASSIGN_OR_RETURN(session, connect_tls(*tls, fd, hp.host, deadline));
    // The kvstash handshake, inside TLS.
    KVSTASH_RETURN_IF_ERROR(tls_recv_all(*session, fd, &hello, sizeof hello, deadline));
  } else if (hello.magic == kServerMagic && tls != nullptr) {
    return Status::unsupported(fmt::format(
        "tcp: the node at {}:{} serves plain tcp, and this engine connects with TLS only "
        "(TcpOptions::tls.ca_file or KVSTASH_TLS_CA is set): the node needs a certificate (kvstashd "
        "--tls-cert, --tls-key)",
        hp.host, hp.port));
  }
  if (hello.magic != kServerMagic) return Status::invalid_argument("peer is not a kvstash tcp target");
  if (hello.version != kProtocolVersion) {
    return Status::unsupported("peer speaks tcp protocol version " + std::to_string(hello.version) +
                               ", this build speaks " + std::to_string(kProtocolVersion));
  }
  handshake::Handshake proof(handshake::Role::kClient, token);
  KVSTASH_RETURN_IF_ERROR(proof.on_peer_hello(hello.nonce, hello.token_required != 0));
  ClientHello mine{};
  mine.magic = kClientMagic;
  mine.version = kProtocolVersion;
  mine.nonce = proof.nonce();
  mine.mac = proof.proof();
  ServerVerdict verdict;
  if (session) {
    KVSTASH_RETURN_IF_ERROR(tls_send_all(*session, fd, &mine, sizeof mine, deadline));
    KVSTASH_RETURN_IF_ERROR(tls_recv_all(*session, fd, &verdict, sizeof verdict, deadline));
  } else {
    KVSTASH_RETURN_IF_ERROR(send_all(fd, &mine, sizeof mine, deadline));
    KVSTASH_RETURN_IF_ERROR(recv_all(fd, &verdict, sizeof verdict, deadline));
  }
  if (verdict.status == static_cast<std::uint32_t>(StatusCode::kUnavailable)) {
    return Status::unavailable(
        "the target is serving its limit of connections (TcpOptions::max_connections)");
  }
  if (verdict.status != static_cast<std::uint32_t>(StatusCode::kOk)) {
    return Status::permission_denied(
        "target refused this client's cluster token (a wrong token, or the target is backing off "
        "after failed handshakes)");
  }
  KVSTASH_RETURN_IF_ERROR(proof.check_proof(verdict.mac));
  return session;
}

class Registration final : public LocalRegistration {
 public:
  Registration(std::shared_ptr<RegionTable> table, std::uint64_t key, bool leased = false)
      : table_(std::move(table)), key_(key), leased_(leased) {}
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  ~Registration() override {
    if (table_) table_->remove(key_);
  }
  std::string packed_key() const override {
    if (!table_) return {};
    wire::Writer w;
    w.u8(kKeyVersion);
    w.u64(key_);
    w.u8(leased_ ? 1 : 0);
    return w.take();
  }

 private:
  std::shared_ptr<RegionTable> table_;  // null: local use only
  std::uint64_t key_;
  bool leased_;
};

class TcpTransport final : public Transport {
 public:
  TcpTransport(const TcpOptions& options, std::string cluster_token, std::shared_ptr<IoRuntime> runtime,
               tcp::acceptor acceptor, std::string address, std::shared_ptr<TlsContext> serving_tls,
               std::shared_ptr<TlsContext> connecting_tls)
      : options_(options),
        cluster_token_(cluster_token),
        runtime_(std::move(runtime)),
        acceptor_(std::move(acceptor)),
        address_(std::move(address)),
        connecting_tls_(std::move(connecting_tls)),
        target_(std::make_shared<Target>()) {
    target_->token = std::move(cluster_token);
    target_->options = options;
    target_->unproven = admission::UnprovenBudget(options.max_unproven_connections);
    target_->tls = std::move(serving_tls);
    asio::co_spawn(acceptor_.get_executor(), accept_loop(), asio::detached);
  }
  ~TcpTransport() override {
    asio::post(acceptor_.get_executor(), [this] {
      boost::system::error_code ignored;
      acceptor_.close(ignored);
    });
    std::unique_lock lock(mu_);
    stopped_.wait(lock, [&] { return !accepting_; });
  }

  TransportKind kind() const override { return TransportKind::kTcp; }
  Capabilities capabilities() const override {
    Capabilities c;
    c.leases = true;
    c.lanes = stream_count();
    c.slice_bytes = options_.slice_bytes;
    return c;
  }
  std::string local_address() const override { return address_; }
  bool can_reach(std::string_view peer_address) const override {
    return decode_address(peer_address).has_value();
  }
  void fence(std::uint64_t through) override { target_->fences.fence(through); }

  void set_grant_check(std::shared_ptr<const GrantCheck> check) override {
    std::lock_guard lock(target_->grant_mu);
    target_->checks_grants.store(check != nullptr, std::memory_order_release);
    target_->grants = std::move(check);
  }

  std::vector<TransportCounter> counters() const override {
    const ConnectionCounters& c = target_->counters;
    auto one = [](const char* name, const char* help, const std::atomic<std::uint64_t>& v) {
      return TransportCounter{TransportKind::kTcp, name, help, v.load(std::memory_order_relaxed)};
    };
    return {
        one("connections_accepted", "connections that finished the handshake (proved the cluster token)",
            c.accepted),
        one("connections_refused", "connections closed at accept: a connection cap or a handshake backoff",
            c.refused),
        one("handshakes_failed", "handshakes that failed: a wrong, missing or unchecked token proof",
            c.handshakes_failed),
        one("handshake_timeouts", "connections closed for not finishing the handshake in time",
            c.handshake_timeouts),
        one("unproven_evicted",
            "handshakes in progress dropped for newer ones (the unproven budget was full)",
            c.unproven_evicted),
        one("connections_dropped_inactive", "connections closed for being idle or stalled", c.idle_dropped),
        one("connections_gave_way",
            "idle connections closed for a newly proven one (the connection limit was "
            "reached)",
            c.gave_way),
    };
  }

  Result<std::unique_ptr<LocalRegistration>> register_memory(const MemoryRegion& region,
                                                             Access access) override {
    if (region.kind != MemoryKind::kHost) return Status::unsupported("tcp moves host memory only");
    if (access == Access::kLocal) return std::unique_ptr<LocalRegistration>(new Registration(nullptr, 0));
    std::uint64_t key =
        target_->regions.add(static_cast<std::byte*>(region.addr), region.length, access == Access::kLeased);
    // The registration keeps the whole target alive through the table it points into.
    return std::unique_ptr<LocalRegistration>(new Registration(
        std::shared_ptr<RegionTable>(target_, &target_->regions), key, access == Access::kLeased));
  }

  Result<std::shared_ptr<transport::Endpoint>> connect(std::string_view peer_address,
                                                       Deadline deadline) override {
    auto hp = decode_address(peer_address);
    if (!hp) return Status::invalid_argument("malformed tcp peer address");
    std::vector<std::shared_ptr<Stream>> streams;
    const std::uint64_t endpoint_id = sys::random_u64();
    for (std::uint32_t i = 0; i < stream_count(); ++i) {
      KVSTASH_ASSIGN_OR_RETURN(UniqueFd guard, connect_tcp(*hp, deadline));
      const int fd = guard.get();
      KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<TlsSession> tls,
                               client_handshake(fd, cluster_token_, connecting_tls_.get(), *hp, deadline));
      tcp::socket sock(runtime_->io());
      boost::system::error_code ec;
      sock.assign(hp->host.find(':') == std::string::npos ? tcp::v4() : tcp::v6(), guard.release(), ec);
      if (ec) return Status::io_error("asio assign: " + ec.message());
      streams.push_back(std::make_shared<Stream>(runtime_, std::move(sock), std::move(tls)));
      streams.back()->index = i;
      streams.back()->endpoint_id = endpoint_id;
      streams.back()->start();
    }
    return std::shared_ptr<transport::Endpoint>(std::make_shared<Endpoint>(std::move(streams)));
  }

 private:
  // A lease key marks the streams it was presented on in a 64-bit mask.
  std::uint32_t stream_count() const { return std::clamp<std::uint32_t>(options_.streams, 1, 64); }

  asio::awaitable<void> accept_loop() {
    {
      std::lock_guard lock(mu_);
      accepting_ = true;
    }
    asio::steady_timer backoff(acceptor_.get_executor());
    for (;;) {
      boost::system::error_code ec;
      // The socket's own executor is the io_context's: an any_io_executor holds that without
      // allocating, where it would allocate a copy of a strand for every operation. The
      // connection's work runs on its strand, named by its handlers.
      tcp::socket sock(runtime_->io());
      co_await acceptor_.async_accept(sock, asio::redirect_error(use_awaitable, ec));
      if (ec == asio::error::operation_aborted || !acceptor_.is_open()) break;
      if (ec) {
        KVSTASH_LOG_WARN_LIMITED("tcp accept failed: {}", ec.message());
        // Out of descriptors or memory: the pending connection stays queued and would fail
        // again at once, so pause instead of spinning (closing connections frees some).
        backoff.expires_after(std::chrono::milliseconds(100));
        co_await backoff.async_wait(asio::redirect_error(use_awaitable, ec));
        continue;
      }
      Strand strand = asio::make_strand(runtime_->io());
      auto gate = std::make_shared<HandshakeGate>();
      auto slot = admit(sock, strand, gate);
      if (!slot) continue;
      sock.set_option(tcp::no_delay(true), ec);
      asio::co_spawn(strand, serve_connection(strand, std::move(sock), std::move(*slot), std::move(gate)),
                     asio::detached);
    }
    std::lock_guard lock(mu_);
    accepting_ = false;
    stopped_.notify_all();
    co_return;
  }

  // Takes the connection into the unproven budget (displacing a handshake in progress of the
  // source that holds the most when it is full: admission.h) and returns its slot, or closes
  // it when its address is over its cap, backing off after failed handshakes, or the budget
  // is full of handshakes of sources that proved the token.
  std::optional<ConnectionSlot> admit(tcp::socket& sock, const Strand& strand,
                                      const std::shared_ptr<HandshakeGate>& gate) {
    boost::system::error_code ec;
    auto remote = sock.remote_endpoint(ec);
    std::string peer = ec ? std::string("?") : remote.address().to_string();
    std::string refused;
    std::uint64_t id = 0;
    const admission::Verdict verdict = target_->token.empty() || !options_.guess_backoff
                                           ? admission::Verdict::kAdmit
                                           : target_->throttle.admit(peer);
    const bool known = !target_->token.empty() && target_->throttle.known(peer);
    if (verdict != admission::Verdict::kAdmit) {
      refused = admission::describe(verdict);
    } else {
      std::lock_guard lock(target_->peers_mu);
      auto& mine = target_->per_peer[peer];
      if (mine >= std::max<std::uint32_t>(1, options_.max_connections_per_peer)) {
        refused = "its per-peer connection limit (TcpOptions::max_connections_per_peer) is reached";
        if (mine == 0) target_->per_peer.erase(peer);
      } else {
        const std::uint64_t displaced = target_->unproven.displaced();
        id = target_->unproven.add(peer, known,
                                   [strand, gate] { asio::post(strand, [gate] { gate->drop(); }); });
        target_->counters.unproven_evicted += target_->unproven.displaced() - displaced;
        if (id == 0) {
          refused =
              "the handshakes in progress (TcpOptions::max_unproven_connections) are all of clients that "
              "proved the token";
          if (mine == 0) target_->per_peer.erase(peer);
        } else {
          ++mine;
        }
      }
    }
    if (!refused.empty()) {
      ++target_->counters.refused;
      KVSTASH_LOG_WARN_LIMITED("tcp: refused a connection from {}: {}", peer, refused);
      sock.close(ec);
      return std::nullopt;
    }
    return ConnectionSlot(target_, std::move(peer), id);
  }

  TcpOptions options_;
  std::string cluster_token_;
  std::shared_ptr<IoRuntime> runtime_;
  tcp::acceptor acceptor_;
  std::string address_;
  std::shared_ptr<TlsContext> connecting_tls_;  // null: plain tcp to peers
  std::shared_ptr<Target> target_;
  std::mutex mu_;
  std::condition_variable stopped_;
  bool accepting_ = true;
};

}  // namespace

IoRuntime::IoRuntime(std::uint32_t threads, std::chrono::microseconds busy_poll)
    : work_(asio::make_work_guard(io_)) {
  for (std::uint32_t i = 0; i < std::max<std::uint32_t>(1, threads); ++i) {
    threads_.emplace_back([this, busy_poll] {
      if (busy_poll.count() <= 0) {
        io_.run();
        return;
      }
      // Latency mode: poll() runs what is ready without sleeping (epoll with no timeout);
      // only after busy_poll without an event does the thread sleep in run_one().
      auto last = std::chrono::steady_clock::now();
      while (!io_.stopped()) {
        if (io_.poll() > 0) {
          last = std::chrono::steady_clock::now();
        } else if (std::chrono::steady_clock::now() - last >= busy_poll) {
          io_.run_one();
          last = std::chrono::steady_clock::now();
        } else {
          sys::cpu_relax();
        }
      }
    });
  }
}

std::shared_ptr<IoRuntime> IoRuntime::create(std::uint32_t threads, std::chrono::microseconds busy_poll) {
  return std::shared_ptr<IoRuntime>(new IoRuntime(threads, busy_poll), [](IoRuntime* r) {
    if (r->io_.get_executor().running_in_this_thread()) {
      std::thread([r] { delete r; }).detach();
    } else {
      delete r;
    }
  });
}

IoRuntime::~IoRuntime() {
  work_.reset();
  io_.stop();
  for (auto& t : threads_) t.join();
}

std::uint64_t RegionTable::add(std::byte* base, std::uint64_t length, bool leased) {
  auto region = std::make_shared<Region>();
  region->base = base;
  region->length = length;
  region->leased = leased;
  std::unique_lock lock(mu_);
  std::uint64_t key;
  do {
    key = sys::random_u64();
  } while (key == 0 || regions_.count(key) != 0);
  regions_.emplace(key, std::move(region));
  return key;
}

void RegionTable::remove(std::uint64_t key) {
  std::shared_ptr<Region> region;
  {
    std::unique_lock lock(mu_);
    auto it = regions_.find(key);
    if (it == regions_.end()) return;
    region = std::move(it->second);
    regions_.erase(it);
  }
  // Requests that found the region before it left the table may be inside a syscall on it:
  // from `dead` on, they start none, and the running one ends in microseconds (non-blocking).
  region->dead.store(true, std::memory_order_seq_cst);
  while (region->users.load(std::memory_order_seq_cst) != 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

std::shared_ptr<RegionTable::Region> RegionTable::find(std::uint64_t key) const {
  std::shared_lock lock(mu_);
  auto it = regions_.find(key);
  if (it == regions_.end()) return nullptr;
  return it->second;
}

std::shared_ptr<Fences::Mark> Fences::attach() {
  auto mark = std::make_shared<Mark>();
  std::lock_guard lock(mu_);
  std::erase_if(marks_, [](const std::weak_ptr<Mark>& m) { return m.expired(); });
  marks_.push_back(mark);
  return mark;
}

bool Fences::allowed(std::uint64_t lease, std::uint64_t fence) const {
  if (fence != 0 && fence <= fenced_.load(std::memory_order_seq_cst)) return false;
  if (revoked_count_.load(std::memory_order_seq_cst) == 0) return true;
  std::lock_guard lock(mu_);
  return revoked_.count(lease) == 0;
}

template <typename Busy>
void Fences::wait_marks(Busy busy) {
  std::vector<std::shared_ptr<Mark>> marks;
  {
    std::lock_guard lock(mu_);
    for (const auto& w : marks_) {
      if (auto m = w.lock()) marks.push_back(std::move(m));
    }
  }
  // A connection inside a syscall leaves it in microseconds: the syscall never blocks.
  for (const auto& m : marks) {
    while (busy(*m)) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void Fences::fence(std::uint64_t through) {
  {
    std::lock_guard lock(mu_);
    if (through <= fenced_.load()) return;
    fenced_.store(through, std::memory_order_seq_cst);
    // Revocations the fence now covers need no remembering.
    std::erase_if(revoked_, [&](const auto& e) { return e.second != 0 && e.second <= through; });
    revoked_count_.store(revoked_.size(), std::memory_order_seq_cst);
  }
  wait_marks([&](const Mark& m) {
    const std::uint64_t f = m.fence.load(std::memory_order_seq_cst);
    return f != 0 && f <= through;
  });
}

bool Fences::revoke(std::uint64_t lease, std::uint64_t fence) {
  {
    std::lock_guard lock(mu_);
    if (fence == 0 || fence > fenced_.load()) {
      // Without a fence tag (the engine's point-to-point users', where no grant is checked:
      // a granted lease always has one) the entry is kept kUntaggedLife, longer than any
      // request can last (io_timeout drops a stalled one), so that a flood of made-up revokes
      // fills the table only for that long.
      if (revoked_.size() >= kMaxRevoked && revoked_.count(lease) == 0) {
        const auto old = std::chrono::steady_clock::now() - kUntaggedLife;
        while (!untagged_.empty() && untagged_.front().second <= old) {
          revoked_.erase(untagged_.front().first);
          untagged_.pop_front();
        }
        if (revoked_.size() >= kMaxRevoked) return false;
      }
      if (revoked_.emplace(lease, fence).second && fence == 0) {
        untagged_.emplace_back(lease, std::chrono::steady_clock::now());
      }
      revoked_count_.store(revoked_.size(), std::memory_order_seq_cst);
    }
  }
  wait_marks([&](const Mark& m) { return m.lease.load(std::memory_order_seq_cst) == lease; });
  return true;
}

Result<std::unique_ptr<RemoteKey>> Endpoint::lease_key(const RemoteKey& region, std::span<const RemoteRange>,
                                                       const LeaseTerms& terms, Deadline) {
  // No round trip: the lease travels with every request, and the target checks it there.
  const auto& r = static_cast<const TcpRemoteKey&>(region);
  if (!r.leased) return Status::unsupported("tcp: the region was not registered for leases");
  auto k = std::make_unique<TcpRemoteKey>();
  k->base = r.base;
  k->length = r.length;
  k->key = r.key;
  k->lease = terms.id;
  k->fence = terms.fence;
  if (terms.grant) {
    k->grant = terms.grant;
    k->endpoint_id = streams_[0]->endpoint_id;
    for (const auto& s : streams_) k->streams.push_back(s);
  }
  return std::unique_ptr<RemoteKey>(std::move(k));
}

Result<std::unique_ptr<RemoteKey>> Endpoint::import_key(std::uint64_t base, std::uint64_t length,
                                                        std::string_view packed, Deadline) {
  wire::Reader r(packed);
  std::uint8_t version = r.u8();
  std::uint64_t key = r.u64();
  std::uint8_t flags = r.u8();
  if (!r.at_end() || version != kKeyVersion || flags > 1)
    return Status::invalid_argument("malformed tcp remote key");
  auto k = std::make_unique<TcpRemoteKey>();
  k->base = base;
  k->length = length;
  k->key = key;
  k->leased = flags == 1;
  return std::unique_ptr<RemoteKey>(std::move(k));
}

ConnectionSlot::~ConnectionSlot() {
  if (!target_) return;
  std::lock_guard lock(target_->peers_mu);
  if (proven_) {
    // A connection that gave way was taken off the count when it did.
    if (target_->proven.erase(proven_id_) > 0) --target_->connections;
  } else {
    target_->unproven.remove(unproven_id_);
  }
  auto it = target_->per_peer.find(peer_);
  if (it != target_->per_peer.end() && --it->second == 0) target_->per_peer.erase(it);
}

bool ConnectionSlot::promote() {
  std::lock_guard lock(target_->peers_mu);
  if (proven_) return true;
  const auto now = Clock::now();
  if (target_->connections.load() >= std::max<std::uint32_t>(1, target_->options.max_connections)) {
    // The connection idle longest gives way, if it has been idle long enough to be no one's
    // working connection: held slots cannot keep out a client that needs one.
    auto idlest = target_->proven.end();
    for (auto it = target_->proven.begin(); it != target_->proven.end(); ++it) {
      if (idlest == target_->proven.end() || it->second->last_useful < idlest->second->last_useful)
        idlest = it;
    }
    const auto before = (now - Target::kIdleToGiveWay).time_since_epoch().count();
    if (idlest == target_->proven.end() || idlest->second->last_useful.load() > before) return false;
    if (idlest->second->drop) idlest->second->drop();
    target_->proven.erase(idlest);
    --target_->connections;
    ++target_->counters.gave_way;
  }
  target_->unproven.remove(unproven_id_);
  ++target_->connections;
  proven_ = true;
  proven_id_ = ++target_->next_proven;
  seat_ = std::make_shared<Target::ProvenSeat>();
  seat_->last_useful = now.time_since_epoch().count();
  target_->proven.emplace(proven_id_, seat_);
  return true;
}

void ConnectionSlot::on_give_way(std::function<void()> drop) {
  if (!seat_) return;
  std::lock_guard lock(target_->peers_mu);
  seat_->drop = std::move(drop);
}

void ConnectionSlot::useful(Clock::time_point now) {
  if (seat_) seat_->last_useful.store(now.time_since_epoch().count(), std::memory_order_relaxed);
}

void HandshakeGate::drop() {
  dropped_ = true;
  if (socket_ != nullptr) {
    boost::system::error_code ignored;
    socket_->close(ignored);
  }
}

namespace {

// Moves exactly n bytes through the connection's TLS session (the handshake's messages),
// waiting for the socket as the session asks. The wait throws when the socket is closed (the
// handshake timed out, or was dropped). Returns the session's failure otherwise.
asio::awaitable<Status> tls_exchange(tcp::socket& socket, TlsSession& tls, bool sending, void* data,
                                     std::size_t n) {
  auto* p = static_cast<std::byte*>(data);
  while (n > 0) {
    const ssize_t k = sending ? tls.write(p, n) : tls.read(p, n);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k < 0 && errno == EAGAIN) {
      const auto wants = sending ? tls.write_wants() : tls.read_wants();
      co_await socket.async_wait(
          wants == TlsSession::Wait::kRead ? tcp::socket::wait_read : tcp::socket::wait_write, use_awaitable);
      continue;
    }
    co_return tls.failure();
  }
  co_return Status{};
}

}  // namespace

asio::awaitable<void> serve_connection(Strand strand, tcp::socket socket, ConnectionSlot slot,
                                       std::shared_ptr<HandshakeGate> gate) {
  Target& target = slot.target();
  // From here until the handshake ends, the accept loop may drop this connection for a newer
  // one (HandshakeGate::drop, on this strand).
  gate->watch(&socket);
  struct Unwatch {
    HandshakeGate& g;
    ~Unwatch() { g.watch(nullptr); }
  } unwatch{*gate};
  if (gate->dropped()) co_return;
  handshake::Handshake proof(handshake::Role::kServer, target.token);
  // A client that connects and says nothing is dropped after the handshake timeout.
  auto done = std::make_shared<bool>(false);
  auto timed_out = std::make_shared<bool>(false);
  asio::steady_timer timer(strand, target.options.handshake_timeout);
  timer.async_wait([&socket, done, timed_out](boost::system::error_code ec) {
    if (!ec && !*done) {
      *timed_out = true;
      boost::system::error_code ignored;
      socket.close(ignored);
    }
  });
  try {
    std::unique_ptr<TlsSession> tls;
    if (target.tls) {
      // In the clear first, so that a plain client learns at once that it needs TLS.
      ServerHello preamble{};
      preamble.magic = kTlsServerMagic;
      preamble.version = kProtocolVersion;
      co_await asio::async_write(socket, asio::buffer(&preamble, sizeof preamble), use_awaitable);
      auto made = TlsSession::make(*target.tls, socket.native_handle(), true);
      if (!made.is_ok()) {
        KVSTASH_LOG_WARN_LIMITED("tcp: {}", made.status().to_string());
        co_return;
      }
      tls = std::move(made).value();
      while (tls->handshake() != 1) {
        if (errno != EAGAIN) {
          ++target.counters.handshakes_failed;
          KVSTASH_LOG_INFO_LIMITED("tcp: TLS handshake with {} failed: {}", slot.peer(),
                                   tls->failure().to_string());
          co_return;
        }
        co_await socket.async_wait(
            tls->write_wants() == TlsSession::Wait::kRead ? tcp::socket::wait_read : tcp::socket::wait_write,
            use_awaitable);
      }
    }
    // The kvstash handshake, inside TLS where there is TLS.
    auto send = [&](void* data, std::size_t n) -> asio::awaitable<Status> {
      if (tls) co_return co_await tls_exchange(socket, *tls, true, data, n);
      co_await asio::async_write(socket, asio::buffer(data, n), use_awaitable);
      co_return Status{};
    };
    auto receive = [&](void* data, std::size_t n) -> asio::awaitable<Status> {
      if (tls) co_return co_await tls_exchange(socket, *tls, false, data, n);
      co_await asio::async_read(socket, asio::buffer(data, n), use_awaitable);
      co_return Status{};
    };
    ServerHello hello{};
    hello.magic = kServerMagic;
    hello.version = kProtocolVersion;
    hello.token_required = proof.token_required() ? 1 : 0;
    hello.nonce = proof.nonce();
    ClientHello client;
    Status moved = co_await send(&hello, sizeof hello);
    if (moved.is_ok()) moved = co_await receive(&client, sizeof client);
    if (!moved.is_ok()) {
      // A TLS client whose certificate or connection failed after the TLS handshake.
      ++target.counters.handshakes_failed;
      KVSTASH_LOG_INFO_LIMITED("tcp: handshake with {} failed: {}", slot.peer(), moved.to_string());
      co_return;
    }
    ServerVerdict verdict{};
    const bool well_formed = client.magic == kClientMagic && client.version == kProtocolVersion &&
                             proof.on_peer_hello(client.nonce, false).is_ok();
    // A proof is checked only within the listener's allowance (admission.h): beyond it the
    // answer is "denied" whatever the proof, so guessing the token costs time.
    const bool throttled = proof.token_required() && target.options.guess_backoff;
    bool spent = false;
    const bool checked = well_formed && (!throttled || target.throttle.may_check(slot.peer(), &spent));
    const bool ok = checked && proof.check_proof(client.mac).is_ok();
    bool full = false;
    if (ok) {
      if (throttled) target.throttle.proven(slot.peer(), spent);
      full = !slot.promote();
    } else if (throttled) {
      target.throttle.failed(slot.peer());
    }
    if (ok && !full) verdict.mac = proof.proof();
    verdict.status = static_cast<std::uint32_t>(!ok    ? StatusCode::kPermissionDenied
                                                : full ? StatusCode::kUnavailable
                                                       : StatusCode::kOk);
    moved = co_await send(&verdict, sizeof verdict);
    if (!moved.is_ok()) co_return;
    *done = true;
    timer.cancel();
    if (!ok) {
      ++target.counters.handshakes_failed;
      KVSTASH_LOG_WARN_LIMITED("tcp: refused a client at {}: {}", slot.peer(),
                               !well_formed ? "its hello is not a kvstash tcp client's"
                               : !checked   ? "too many failed cluster-token handshakes (backing off)"
                                            : "it failed the cluster-token handshake");
      co_return;
    }
    if (full) {
      ++target.counters.refused;
      KVSTASH_LOG_WARN_LIMITED(
          "tcp: refused a client at {}: the connection limit (TcpOptions::max_connections) "
          "is reached",
          slot.peer());
      co_return;
    }
    ++target.counters.accepted;
    serve_requests(strand, std::move(socket), std::move(slot), std::move(tls));
  } catch (const boost::system::system_error& e) {
    *done = true;
    if (*timed_out) {
      ++target.counters.handshake_timeouts;
      KVSTASH_LOG_INFO_LIMITED("tcp: dropped a connection from {} that did not finish its handshake in time",
                               slot.peer());
    } else if (gate->dropped()) {
      KVSTASH_LOG_INFO_LIMITED(
          "tcp: dropped a handshake in progress from {} for a newer connection "
          "(TcpOptions::max_unproven_connections)",
          slot.peer());
    } else if (e.code() != asio::error::eof) {
      // The initiator went away or broke protocol; its requests are its own to retry.
      KVSTASH_LOG_DEBUG_LIMITED("tcp: connection ended: {}", e.what());
    }
  }
}

namespace {

// The connecting side's TLS options: the engine's, and where they name no CA, the environment's
// (clients whose options are not plumbed: the C API, Python). The environment fills only what
// the options leave empty.
TcpTlsOptions connecting_tls_options(const TcpTlsOptions& options) {
  TcpTlsOptions o = options;
  if (!o.ca_file.empty()) return o;
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v != nullptr ? v : "");
  };
  o.ca_file = env("KVSTASH_TLS_CA");
  if (o.ca_file.empty()) return o;
  if (o.client_cert_file.empty()) o.client_cert_file = env("KVSTASH_TLS_CERT");
  if (o.client_key_file.empty()) o.client_key_file = env("KVSTASH_TLS_KEY");
  if (o.server_name.empty()) o.server_name = env("KVSTASH_TLS_SERVER_NAME");
  return o;
}

}  // namespace

Result<std::unique_ptr<Transport>> make_transport(const TcpOptions& options, std::string cluster_token,
                                                  std::chrono::microseconds busy_poll) {
  KVSTASH_ASSIGN_OR_RETURN(HostPort listen, parse_host_port(options.listen));
  std::uint32_t threads = options.io_threads;
  if (threads == 0) threads = std::thread::hardware_concurrency() <= 4 ? 1 : 2;
  auto runtime = IoRuntime::create(threads, busy_poll);
  boost::system::error_code ec;
  auto ip = asio::ip::make_address(listen.host, ec);
  if (ec) return Status::invalid_argument("tcp listen address must be numeric: '" + listen.host + "'");
  tcp::acceptor acceptor(asio::make_strand(runtime->io()));
  tcp::endpoint ep(ip, listen.port);
  acceptor.open(ep.protocol(), ec);
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(ep, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::unavailable("tcp listen on " + options.listen + ": " + ec.message());
  HostPort advertised = listen;
  if (!options.advertise.empty()) {
    KVSTASH_ASSIGN_OR_RETURN(advertised, parse_host_port(options.advertise));
  }
  if (advertised.port == 0 || options.advertise.empty()) advertised.port = acceptor.local_endpoint().port();
  std::shared_ptr<TlsContext> serving, connecting;
  if (!options.tls.cert_file.empty()) {
    KVSTASH_ASSIGN_OR_RETURN(serving, TlsContext::serving(options.tls));
  } else if (!options.tls.key_file.empty() || !options.tls.client_ca_file.empty()) {
    return Status::invalid_argument(
        "TcpTlsOptions: key_file and client_ca_file serve TLS only with a cert_file");
  }
  const TcpTlsOptions connect_with = connecting_tls_options(options.tls);
  if (!connect_with.ca_file.empty()) {
    KVSTASH_ASSIGN_OR_RETURN(connecting, TlsContext::connecting(connect_with));
  } else if (!connect_with.client_cert_file.empty() || !connect_with.server_name.empty()) {
    return Status::invalid_argument(
        "TcpTlsOptions: a client certificate or server_name needs ca_file (tcp never connects over TLS "
        "without "
        "verifying the node)");
  }
  return std::unique_ptr<Transport>(new TcpTransport(options, std::move(cluster_token), std::move(runtime),
                                                     std::move(acceptor), encode_address(advertised),
                                                     std::move(serving), std::move(connecting)));
}

}  // namespace kvstash::transport::tcp

namespace kvstash::transport {
Result<std::unique_ptr<Transport>> make_tcp_transport(const TcpOptions& options, std::string cluster_token,
                                                      std::chrono::microseconds busy_poll) {
  return tcp::make_transport(options, std::move(cluster_token), busy_poll);
}
}  // namespace kvstash::transport

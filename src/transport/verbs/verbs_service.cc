// The setup service: the target side of every setup connection, served at once by one thread
// with non-blocking sockets. Each connection is a small state machine:
//
//   hello  --its hello / our challenge-->  proof  --its token proof / our hello-->  up  --lease messages-->
//   ...
//
// In `hello` and `proof` the peer is not authenticated yet: its frames are small
// (kMaxSetupFrame), the whole handshake must end within handshake_timeout of the accept, and
// it holds nothing but its socket and a few hundred bytes: the queue pair is created, and our
// own proof of the token sent, only once the peer proved it (verbs_wire.h). Such connections
// have their own budget (max_unproven_connections): when it is full, the newcomer displaces a
// handshake of the source that holds the most (admission::UnprovenBudget), so a flood of them
// cannot keep out a client that proves the token, however far away. A
// failed proof backs the peer's address (and, bounded, the listener) off (admission.h).
// Once `up`, the queue pair is connected and the connection is in Target::accepted; each lease
// message may be as large as kMaxLeaseFrame, must arrive whole and have its answer taken within
// message_timeout, and is served before the next one is read (one answer in flight). Nothing
// here blocks on a peer: a silent or slow connection costs its socket and its slot under the
// caps until its deadline, and delays no other connection.
//
// Why one thread and not one per connection: the work per message is small and local (decode,
// bind windows, encode), the caps allow a thousand connections, and a thread each would let an
// unauthenticated flood buy a thread per socket; fence() and deregistration stay simple
// because only this thread adds or drops connections.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include "common/handshake.h"
#include "common/log.h"
#include "transport/verbs/verbs_internal.h"

namespace kvstash::transport::verbs {

struct SetupService::Conn {
  enum class Phase { kHello, kProof, kUp };
  UniqueFd socket;
  std::string peer;  // the remote address, without port: what the per-peer cap counts
  Phase phase = Phase::kHello;
  // When the connection is dropped unless it made progress: the handshake's end, or, once up,
  // the end of the message (or answer) in progress; none while an up connection is idle.
  std::optional<Clock::time_point> deadline;
  std::string in;          // received bytes not yet served
  std::string out;         // bytes to send
  std::size_t out_at = 0;  // of `out`, already sent
  bool closing = false;    // close once `out` is sent (the queue pair broke)
  // The handshake's state until the queue pair is up.
  std::uint64_t unproven_id = 0;  // its place in SetupService::unproven_; 0 once proven
  std::size_t dev = 0;
  QpConfig cfg;
  Qp qp;
  Hello mine, theirs;
  std::optional<handshake::Handshake> proof;  // the cluster-token exchange
  // Once up: the connection's entry in the target (its queue pair and leases).
  std::optional<std::list<Target::Accepted>::iterator> accepted;
};

namespace {

constexpr auto kAcceptPause = std::chrono::milliseconds(100);
constexpr std::size_t kReadChunk = 64u << 10;

std::string peer_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&a)->sin6_addr, host, sizeof host);
  } else if (a.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&a)->sin_addr, host, sizeof host);
  } else {
    return "?";
  }
  return host;
}

}  // namespace

SetupService::SetupService(UniqueFd listener, std::shared_ptr<Target> target, const VerbsOptions& options,
                           std::string token)
    : listener_(std::move(listener)),
      wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
      target_(std::move(target)),
      options_(options),
      token_(std::move(token)),
      unproven_(options.max_unproven_connections) {
  thread_ = std::thread([this] { run(); });
}

SetupService::~SetupService() {
  std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  for (Conn& c : conns_) close(c);
  conns_.clear();
}

void SetupService::warn(const std::string& line) {
  const auto now = Clock::now();
  if (now - last_warning_ < std::chrono::seconds(1)) {
    ++warnings_dropped_;
    return;
  }
  last_warning_ = now;
  if (warnings_dropped_ != 0) {
    KVSTASH_LOG_WARN("{} ({} more such lines in the last second not logged)", line, warnings_dropped_);
    warnings_dropped_ = 0;
  } else {
    KVSTASH_LOG_WARN("{}", line);
  }
}

void SetupService::run() {
  std::optional<Clock::time_point> next_expiry;
  std::vector<pollfd> fds;
  for (;;) {
    const auto now = Clock::now();
    const bool accepting = now >= accept_paused_until_;
    fds.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({accepting ? listener_.get() : -1, POLLIN, 0});
    Clock::time_point wake_at = now + std::chrono::seconds(60);
    if (next_expiry) wake_at = std::min(wake_at, *next_expiry);
    if (!accepting) wake_at = std::min(wake_at, accept_paused_until_);
    for (const Conn& c : conns_) {
      // One message at a time: its answer leaves before the next is read.
      const short events = c.out.empty() ? (c.closing ? 0 : POLLIN) : POLLOUT;
      fds.push_back({c.socket.get(), events, 0});
      if (c.deadline) wake_at = std::min(wake_at, *c.deadline);
    }
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(wake_at - now).count();
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<std::int64_t>(ms, 0, 60000))) < 0 &&
        errno != EINTR) {
      KVSTASH_LOG_ERROR("verbs: the setup service stopped: poll: {}", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    // Connections accepted below join the poll set on the next round; `fds` matches conns_
    // up to here.
    std::size_t i = 2;
    for (auto it = conns_.begin(); it != conns_.end(); ++i) {
      if (step(*it, fds[i].revents)) {
        ++it;
        continue;
      }
      close(*it);
      it = conns_.erase(it);
    }
    if (fds[1].revents != 0) accept_all();
    std::lock_guard lock(target_->mu);
    next_expiry = target_->expire(Clock::now());
  }
}

void SetupService::accept_all() {
  for (;;) {
    UniqueFd sock(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (sock.get() < 0) {
      const int e = errno;
      if (e == EAGAIN || e == EWOULDBLOCK) return;
      if (e == EINTR || e == ECONNABORTED) continue;
      // Out of descriptors or memory: the pending connection stays queued and would fail again
      // at once, so pause instead of spinning (closing connections frees some).
      warn(std::string("verbs: setup accept failed: ") + std::strerror(e));
      accept_paused_until_ = Clock::now() + kAcceptPause;
      return;
    }
    std::string peer = peer_address(sock.get());
    std::string refused;
    const admission::Verdict verdict = token_.empty() ? admission::Verdict::kAdmit : throttle_.admit(peer);
    auto& mine = per_peer_[peer];
    if (verdict != admission::Verdict::kAdmit) {
      refused = admission::describe(verdict);
    } else if (mine >= std::max<std::uint32_t>(1, options_.max_connections_per_peer)) {
      refused = "the per-peer connection limit (VerbsOptions::max_connections_per_peer) is reached";
    }
    if (!refused.empty()) {
      if (mine == 0) per_peer_.erase(peer);
      Counters::add(target_->counters().connections_refused);
      warn("verbs: refused a setup connection from " + peer + ": " + refused);
      continue;  // closing the socket tells the peer
    }
    Conn& c = conns_.emplace_back();
    const auto it = std::prev(conns_.end());
    c.unproven_id =
        unproven_.add(peer, !token_.empty() && throttle_.known(peer), [this, it] { displaced(it); });
    if (c.unproven_id == 0) {
      if (mine == 0) per_peer_.erase(peer);
      conns_.pop_back();
      Counters::add(target_->counters().connections_refused);
      warn("verbs: refused a setup connection from " + peer +
           ": the handshakes in progress (VerbsOptions::max_unproven_connections) are all of clients that "
           "proved "
           "the token");
      continue;
    }
    ++mine;
    int one = 1;
    ::setsockopt(sock.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c.socket = std::move(sock);
    c.peer = std::move(peer);
    c.deadline = Clock::now() + options_.handshake_timeout;
  }
}

bool SetupService::step(Conn& c, short revents) {
  if (revents & POLLNVAL) return false;
  if (!c.out.empty() && (revents & (POLLOUT | POLLERR | POLLHUP)) && !flush(c)) return false;
  if (c.out.empty() && !c.closing && (revents & (POLLIN | POLLERR | POLLHUP)) && !receive(c)) return false;
  if (!process(c)) return false;
  if (c.closing && c.out.empty()) return false;
  if (c.deadline && Clock::now() >= *c.deadline) {
    if (c.phase != Conn::Phase::kUp) {
      Counters::add(target_->counters().handshakes_failed);
      Counters::add(target_->counters().handshake_timeouts);
      warn("verbs: dropped a setup connection from " + c.peer + " that did not finish its handshake in time");
    } else {
      Counters::add(target_->counters().connections_dropped_stalled);
      KVSTASH_LOG_WARN_LIMITED("verbs: dropped the connection of {}: a lease message or its answer stalled",
                               c.peer);
    }
    return false;
  }
  return true;
}

bool SetupService::receive(Conn& c) {
  const std::size_t max = 4 + (c.phase == Conn::Phase::kUp ? kMaxLeaseFrame : kMaxSetupFrame);
  while (c.in.size() < max) {
    const std::size_t at = c.in.size();
    c.in.resize(at + std::min(kReadChunk, max - at));
    const ssize_t n = ::recv(c.socket.get(), c.in.data() + at, c.in.size() - at, 0);
    c.in.resize(at + static_cast<std::size_t>(std::max<ssize_t>(n, 0)));
    if (n > 0) continue;
    if (n == 0) return false;  // the peer closed: its queue pair and windows go
    if (errno == EAGAIN || errno == EWOULDBLOCK) break;
    if (errno != EINTR) return false;
  }
  return true;
}

bool SetupService::flush(Conn& c) {
  while (c.out_at < c.out.size()) {
    const ssize_t n = ::send(c.socket.get(), c.out.data() + c.out_at, c.out.size() - c.out_at, MSG_NOSIGNAL);
    if (n > 0) {
      c.out_at += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n < 0 && errno == EINTR) continue;
    return false;
  }
  c.out.clear();
  c.out_at = 0;
  return true;
}

bool SetupService::process(Conn& c) {
  while (c.out.empty() && !c.closing && c.in.size() >= 4) {
    std::uint32_t n = 0;
    std::memcpy(&n, c.in.data(), sizeof n);
    n = ntohl(n);
    const std::size_t max = c.phase == Conn::Phase::kUp ? kMaxLeaseFrame : kMaxSetupFrame;
    if (n > max) {
      if (c.phase != Conn::Phase::kUp) Counters::add(target_->counters().handshakes_failed);
      warn("verbs: dropped the setup connection of " + c.peer + ": a " + std::to_string(n) +
           "-byte message (at most " + std::to_string(max) + " here)");
      return false;
    }
    if (c.in.size() < 4 + n) break;
    const bool ok = on_frame(c, std::string_view(c.in).substr(4, n));
    c.in.erase(0, 4 + n);
    if (!ok) return false;
    if (!c.out.empty() && !flush(c)) return false;
  }
  if (c.phase == Conn::Phase::kUp) {
    // An idle connection has no deadline; a message (or an answer) in progress has one.
    if (c.in.empty() && c.out.empty()) {
      c.deadline.reset();
    } else if (!c.deadline) {
      c.deadline = Clock::now() + options_.message_timeout;
    }
  }
  return true;
}

bool SetupService::on_frame(Conn& c, std::string_view frame) {
  switch (c.phase) {
    case Conn::Phase::kHello: return on_hello(c, frame);
    case Conn::Phase::kProof: return on_proof(c, frame);
    case Conn::Phase::kUp: break;
  }
  // A message in full: the next one gets its own time.
  c.deadline = Clock::now() + options_.message_timeout;
  std::lock_guard lock(target_->mu);
  Target::Accepted& a = **c.accepted;
  auto answer = target_->serve(a, frame, *c.deadline);
  if (!answer.is_ok()) {
    KVSTASH_LOG_WARN_LIMITED("verbs: dropped the connection of {}: {}", c.peer, answer.status().to_string());
    return false;
  }
  if (!answer->empty()) append_frame(c.out, *answer);
  if (a.broken) c.closing = true;  // the answer says why; the queue pair is unusable
  return true;
}

bool SetupService::on_hello(Conn& c, std::string_view frame) {
  auto hello = decode_hello(frame);
  if (!hello.is_ok()) {
    Counters::add(target_->counters().handshakes_failed);
    warn("verbs: refused a queue-pair setup from " + c.peer + ": " + hello.status().to_string());
    return false;
  }
  c.theirs = *hello;
  // The device the client asked for (its rail); the first one for a client that named none.
  for (const auto& d : target_->devs) {
    if (d->device.node_guid == c.theirs.peer_guid) c.dev = d->index;
  }
  c.proof.emplace(handshake::Role::kServer, token_);
  if (Status heard = c.proof->on_peer_hello(c.theirs.nonce, false); !heard.is_ok()) {
    warn("verbs: queue-pair setup from " + c.peer + " abandoned: " + heard.to_string());
    return false;
  }
  // Nothing is created for the peer yet, and nothing proven to it: it proves first.
  Challenge challenge;
  challenge.node_guid = target_->devs[c.dev]->device.node_guid;
  challenge.nonce = c.proof->nonce();
  challenge.token_required = c.proof->token_required();
  append_frame(c.out, encode_challenge(challenge));
  c.phase = Conn::Phase::kProof;
  return true;
}

bool SetupService::on_proof(Conn& c, std::string_view frame) {
  if (frame.size() != handshake::kMacBytes) {
    Counters::add(target_->counters().handshakes_failed);
    if (!token_.empty()) throttle_.failed(c.peer);
    warn("verbs: queue-pair setup from " + c.peer + " abandoned: no token proof");
    return false;
  }
  // A proof is checked only within the listener's allowance (admission.h): beyond it, it is
  // refused unchecked, so guessing the token costs time however many addresses guess.
  bool spent = false;
  const bool checked = token_.empty() || throttle_.may_check(c.peer, &spent);
  if (!checked ||
      !c.proof->check_proof(reinterpret_cast<const std::uint8_t*>(frame.data()), frame.size()).is_ok()) {
    Counters::add(target_->counters().handshakes_failed);
    throttle_.failed(c.peer);
    warn("verbs: refused " + c.peer +
         (checked ? ": it failed the cluster-token handshake"
                  : ": too many failed cluster-token handshakes (backing off)"));
    return false;  // closing the socket tells it
  }
  if (!token_.empty()) throttle_.proven(c.peer, spent);
  if (conns_.size() - unproven_.size() >= std::max<std::uint32_t>(1, options_.max_connections)) {
    Counters::add(target_->counters().connections_refused);
    warn("verbs: refused " + c.peer + ": the connection limit (VerbsOptions::max_connections) is reached");
    return false;
  }
  const DeviceState& dev = *target_->devs[c.dev];
  c.cfg = qp_config(options_, dev);
  c.cfg.max_rd_atomic = std::min(c.cfg.max_rd_atomic, c.theirs.max_rd_atomic);
  auto qp = create_rc_qp(dev.pd.get(), target_->cqs[c.dev].get(), c.cfg);
  if (!qp.is_ok()) {
    warn("verbs: cannot create a QP for " + c.peer + ": " + qp.status().to_string());
    return false;
  }
  c.qp = std::move(qp).value();
  c.mine = hello_for(dev, *c.qp, c.cfg.max_rd_atomic, *c.proof);
  c.mine.mac = c.proof->proof();
  Status up = connect_rc_qp(c.qp.get(), dev.port, dev.gid, c.mine.qp.psn, c.theirs.qp, c.cfg);
  if (!up.is_ok()) {
    warn("verbs: queue-pair setup with " + c.peer + " failed: " + up.to_string());
    return false;
  }
  {
    std::lock_guard lock(target_->mu);
    Target::Accepted& a = target_->accepted.emplace_back();
    a.qp = std::move(c.qp);
    a.dev = c.dev;
    a.max_send_wr = c.cfg.max_send_wr;
    c.accepted = std::prev(target_->accepted.end());
  }
  Counters::add(target_->counters().connections_accepted);
  c.phase = Conn::Phase::kUp;
  unproven_.remove(std::exchange(c.unproven_id, 0));
  c.deadline.reset();
  append_frame(c.out, encode_hello(c.mine));
  return true;
}

void SetupService::displaced(std::list<Conn>::iterator it) {
  Counters::add(target_->counters().unproven_evicted);
  warn("verbs: dropped a setup handshake in progress from " + it->peer +
       " for a newer connection (VerbsOptions::max_unproven_connections)");
  close(*it);
  conns_.erase(it);
}

void SetupService::close(Conn& c) {
  if (c.accepted) {
    std::lock_guard lock(target_->mu);
    target_->drop(*c.accepted);
    c.accepted.reset();
  }
  if (c.unproven_id != 0) unproven_.remove(std::exchange(c.unproven_id, 0));
  auto it = per_peer_.find(c.peer);
  if (it != per_peer_.end() && --it->second == 0) per_peer_.erase(it);
  c.socket = UniqueFd();
}

}  // namespace kvstash::transport::verbs

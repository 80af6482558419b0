// tcp datapath, the target's side: one accepted connection's requests against this process's
// regions, each checked (key, range, op, lease) before a byte moves, payloads moved one
// syscall at a time under a Guard so that a fence, a revoke or a deregistration waits for at
// most one. The initiator's side is tcp_transport_datapath.cc.
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <deque>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <xxhash.h>

#include "common/handler_arena.h"
#include "common/log.h"
#include "common/ranges.h"
#include "transport/tcp/tcp_internal.h"

namespace kvstash::transport::tcp {
namespace {

using boost::system::error_code;

// A refused WRITE's payload is read and dropped to keep the stream in sync, up to this size;
// beyond it the connection is closed instead.
constexpr std::uint64_t kMaxDiscard = 64u << 20;

ResponseHeader refuse(StatusCode code, RefusalReason reason) {
  ResponseHeader r{};
  r.status = static_cast<std::uint32_t>(code);
  r.reason = static_cast<std::uint32_t>(reason);
  return r;
}

// Checks a request against its region: OK with `where` set, or the refusal to answer.
ResponseHeader check(const RequestHeader& h, const RegionTable::Region* region, std::byte** where) {
  if (h.op != static_cast<std::uint8_t>(TransferOp::kRead) &&
      h.op != static_cast<std::uint8_t>(TransferOp::kWrite) && h.op != kRevokeOp && h.op != kGrantOp &&
      h.op != kReleaseOp) {
    return refuse(StatusCode::kInvalidArgument, RefusalReason::kBadOp);
  }
  if (h.op == kReleaseOp) return ResponseHeader{};  // of a lease this connection may not hold: a no-op
  if (h.op == kGrantOp) {
    if (h.length > kMaxGrantBytes) return refuse(StatusCode::kInvalidArgument, RefusalReason::kBadOp);
    if (region == nullptr) return refuse(StatusCode::kPermissionDenied, RefusalReason::kUnknownKey);
    if (!region->leased) return refuse(StatusCode::kUnsupported, RefusalReason::kNotLeased);
    if (h.lease == 0) return refuse(StatusCode::kInvalidArgument, RefusalReason::kBadOp);
    return ResponseHeader{};
  }
  if (region == nullptr) return refuse(StatusCode::kPermissionDenied, RefusalReason::kUnknownKey);
  if (region->leased && h.lease == 0)
    return refuse(StatusCode::kPermissionDenied, RefusalReason::kLeaseRequired);
  if (h.op == kRevokeOp) {
    // A revoke names a lease. Lease 0 (none) is what every idle connection's mark holds, so
    // Fences::revoke would wait for all of them forever, on the io thread.
    if (h.lease == 0) return refuse(StatusCode::kInvalidArgument, RefusalReason::kBadOp);
    // Only a leased region's requests are checked against leases: nothing to revoke elsewhere.
    if (!region->leased) return refuse(StatusCode::kUnsupported, RefusalReason::kNotLeased);
    return ResponseHeader{};
  }
  const auto base = reinterpret_cast<std::uintptr_t>(region->base);
  if (h.addr < base || h.addr - base > region->length || h.length > region->length - (h.addr - base)) {
    return refuse(StatusCode::kPermissionDenied, RefusalReason::kOutOfRange);
  }
  *where = region->base + (h.addr - base);
  return ResponseHeader{};
}

// One syscall on a served region's memory, made only while the request may still touch it:
// the region registered and, for a leased region, its lease neither revoked nor fenced. The
// connection's mark and the region's user count say, while it runs, that a syscall is in
// progress: a fence, revoke or deregistration waits for it (never long: every syscall here is
// non-blocking), and every later one sees what they ended.
class Guard {
 public:
  Guard(Target& target, Fences::Mark& mark, RegionTable::Region& region, const RequestHeader& h)
      : mark_(mark), region_(region) {
    region_.users.fetch_add(1, std::memory_order_seq_cst);
    mark_.lease.store(h.lease, std::memory_order_seq_cst);
    mark_.fence.store(h.fence, std::memory_order_seq_cst);
    allowed_ = !region_.dead.load(std::memory_order_seq_cst) &&
               (!region_.leased || target.fences.allowed(h.lease, h.fence));
  }
  ~Guard() {
    mark_.fence.store(0, std::memory_order_seq_cst);
    mark_.lease.store(0, std::memory_order_seq_cst);
    region_.users.fetch_sub(1, std::memory_order_seq_cst);
  }
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;
  bool allowed() const { return allowed_; }

 private:
  Fences::Mark& mark_;
  RegionTable::Region& region_;
  bool allowed_ = false;
};

// One accepted connection's requests, as a state machine on the connection's strand. Each
// step moves what the socket takes without blocking (every syscall on a region's memory under
// a Guard) and waits for readiness only when the socket has nothing to give or take. Its
// waits, its watchdog's timer and its strand hops live in the connection's arena: a warm
// connection serves requests without allocating.
//
// The watchdog closes the connection when a request's payload stops moving for io_timeout,
// or when no request arrives for idle_timeout: a stalled initiator must not hold a connection
// slot, a region (and so its deregistration) hostage. A request only moves the deadline; the
// timer wakes at most once per min(io_timeout, idle_timeout) to look at it.
class RequestServer : public std::enable_shared_from_this<RequestServer> {
 public:
  RequestServer(Strand strand, tcp::socket socket, ConnectionSlot slot, std::unique_ptr<TlsSession> tls)
      : strand_(std::move(strand)),
        socket_(std::move(socket)),
        tls_(std::move(tls)),
        slot_(std::move(slot)),
        target_(slot_.target()),
        mark_(target_.fences.attach()),
        timer_(socket_.get_executor()),
        watch_period_(std::min(target_.options.io_timeout, target_.options.idle_timeout)) {}

  ~RequestServer() { count_ranges(-static_cast<std::ptrdiff_t>(granted_ranges_)); }

  void start() {
    // When the target's connections are all taken, an idle one gives way (ConnectionSlot).
    slot_.on_give_way([weak = weak_from_this(), strand = strand_] {
      asio::post(strand, [weak] {
        if (auto self = weak.lock()) self->close();
      });
    });
    deadline(target_.options.idle_timeout, "no request");
    watch();
    run();
  }

 private:
  enum class Step { kHeader, kPayloadIn, kGrantIn, kDiscard, kPayloadOut, kRespond };
  // A connection holds at most this many granted leases, of this many ranges in all (1 MiB of
  // them), and the target at most Target::kMaxGrantedRanges: the initiator releases each when
  // its key goes, and a fence ends them anyway.
  static constexpr std::size_t kMaxGrants = 16384;
  static constexpr std::size_t kMaxGrantedRanges = 1u << 16;
  enum class Next { kGoOn, kServed, kWaitRead, kWaitWrite, kClose };
  // Requests served in one go before the strand lets other handlers run.
  static constexpr int kFairShare = 16;

  template <typename F>
  auto handler(F f) {
    return on_arena(strand_, arena_, [self = shared_from_this(), f](auto&&... args) { f(*self, args...); });
  }

  void run() {
    for (int served = 0;;) {
      switch (advance()) {
        case Next::kGoOn: break;
        case Next::kServed:
          // Only a request that did something keeps the connection: one refused, or the
          // release of a lease it does not hold, changes nothing, so idle proven connections
          // cannot hold the target's slots by sending them.
          if (r_.status == static_cast<std::uint32_t>(StatusCode::kOk) && h_.op != kReleaseOp) {
            last_useful_ = Clock::now();
            slot_.useful(last_useful_);
          }
          deadline(target_.options.idle_timeout, "no request", last_useful_);
          step_ = Step::kHeader;
          header_got_ = 0;
          region_.reset();
          if (++served == kFairShare) {
            asio::post(handler([](RequestServer& s) { s.run(); }));
            return;
          }
          break;
        case Next::kWaitRead: wait(tcp::socket::wait_read); return;
        case Next::kWaitWrite: wait(tcp::socket::wait_write); return;
        case Next::kClose: close(); return;
      }
    }
  }

  void wait(tcp::socket::wait_type what) {
    socket_.async_wait(what, handler([](RequestServer& s, error_code ec) {
                         if (ec) return s.close();
                         s.run();
                       }));
  }

  // The watchdog closes the connection `timeout` after `from` unless something moves it on.
  void deadline(std::chrono::milliseconds timeout, const char* what, Clock::time_point from = Clock::now()) {
    deadline_ = from + timeout;
    timeout_ = timeout;
    deadline_what_ = what;
  }

  void watch() {
    timer_.expires_at(std::min(deadline_, Clock::now() + watch_period_));
    timer_.async_wait(handler([](RequestServer& s, error_code ec) {
      if (ec || s.closed_) return;
      if (Clock::now() >= s.deadline_) {
        ++s.target_.counters.idle_dropped;
        KVSTASH_LOG_INFO_LIMITED("tcp: {} for {} ms, dropping the connection", s.deadline_what_,
                                 s.timeout_.count());
        return s.close();
      }
      s.watch();
    }));
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    error_code ignored;
    socket_.close(ignored);  // its wait ends with an error
    timer_.cancel();
  }

  // What a failed syscall means: wait, try again, or the connection is over. `wait_for`: what
  // the syscall waits for (a receive: kWaitRead); through TLS, what the session asks instead.
  Next on_error(int err, Next wait_for) {
    if (err == EAGAIN || err == EWOULDBLOCK) {
      if (!tls_) return wait_for;
      const auto wants = wait_for == Next::kWaitRead ? tls_->read_wants() : tls_->write_wants();
      return wants == TlsSession::Wait::kRead ? Next::kWaitRead : Next::kWaitWrite;
    }
    if (err == EINTR) return Next::kGoOn;
    KVSTASH_LOG_DEBUG_LIMITED("tcp: connection ended: {}", tls_ ? tls_->error_text(err) : std::strerror(err));
    return Next::kClose;
  }

  // One non-blocking receive (send) on the socket, or through the connection's TLS session.
  ssize_t receive(void* into, std::size_t n) {
    if (tls_) return tls_->read(into, n);
    return ::recv(socket_.native_handle(), into, n, MSG_DONTWAIT);
  }
  ssize_t send(const void* from, std::size_t n) {
    if (tls_) return tls_->write(from, n);
    return ::send(socket_.native_handle(), from, n, MSG_DONTWAIT | MSG_NOSIGNAL);
  }

  Next advance() {
    switch (step_) {
      case Step::kHeader: return read_header();
      case Step::kPayloadIn: return receive_payload();
      case Step::kGrantIn: return receive_grant();
      case Step::kDiscard: return discard();
      case Step::kPayloadOut: return send_payload();
      case Step::kRespond: return respond();
    }
    return Next::kClose;
  }

  Next read_header() {
    auto* into = reinterpret_cast<std::byte*>(&h_) + header_got_;
    const ssize_t n = receive(into, sizeof h_ - header_got_);
    if (n == 0) return Next::kClose;  // the initiator went away between requests
    if (n < 0) return on_error(errno, Next::kWaitRead);
    header_got_ += static_cast<std::size_t>(n);
    if (header_got_ == sizeof h_) begin_request();
    return Next::kGoOn;
  }

  // A whole header arrived: check it and choose the request's first step.
  void begin_request() {
    deadline(target_.options.io_timeout, "a request stalled");
    region_ = target_.regions.find(h_.key);
    where_ = nullptr;
    r_ = check(h_, region_.get(), &where_);
    r_sent_ = 0;
    moved_ = 0;
    close_after_ = false;
    bool ok = r_.status == static_cast<std::uint32_t>(StatusCode::kOk);
    if (h_.op == kGrantOp) {
      if (ok) {
        grant_text_.clear();
        step_ = Step::kGrantIn;
      } else {
        close_after_ = h_.length > kMaxGrantBytes;
        drop(close_after_ ? 0 : h_.length);
      }
      return;
    }
    if (h_.op == kReleaseOp) {
      if (granted_ranges_ > 0 && forget_grant(h_.lease)) last_useful_ = Clock::now();
      step_ = Step::kRespond;
      return;
    }
    if (ok && region_->leased && target_.checks_grants.load(std::memory_order_acquire)) {
      r_ = within_grant();
      ok = r_.status == static_cast<std::uint32_t>(StatusCode::kOk);
    }
    if (h_.op == kRevokeOp) {
      // Answered once no request under the lease can move bytes, on any connection.
      if (ok && !revoke()) r_ = refuse(StatusCode::kNoSpace, RefusalReason::kTooManyRevoked);
      step_ = Step::kRespond;
    } else if (h_.op == static_cast<std::uint8_t>(TransferOp::kWrite)) {
      if (ok) {
        step_ = Step::kPayloadIn;
      } else {
        drop(h_.length);
      }
    } else if (ok) {
      r_.length = h_.length;  // the response header goes out with the payload
      step_ = Step::kPayloadOut;
    } else {
      close_after_ = r_.reason == static_cast<std::uint32_t>(RefusalReason::kBadOp);
      step_ = Step::kRespond;
    }
  }

  // A request under a lease where grants are checked: its lease must have been granted on this
  // connection, for this region and op, over a range that holds the request (a revoke names a
  // lease granted here). The grant's deadline becomes the request's fence tag, whatever the
  // initiator wrote.
  ResponseHeader within_grant() {
    auto it = grants_.find(h_.lease);
    if (it == grants_.end()) return refuse(StatusCode::kPermissionDenied, RefusalReason::kNoGrant);
    const Granted& g = it->second;
    h_.fence = g.grant.fence;
    h_.lease = g.bound;
    if (g.region != h_.key) return refuse(StatusCode::kPermissionDenied, RefusalReason::kOutsideGrant);
    if (h_.op == kRevokeOp) return ResponseHeader{};
    if (h_.op != static_cast<std::uint8_t>(g.grant.op) ||
        !rangeset::covers(g.grant.ranges, h_.addr, h_.length)) {
      return refuse(StatusCode::kPermissionDenied, RefusalReason::kOutsideGrant);
    }
    return ResponseHeader{};
  }

  // Revokes the lease of h_ at the target, within this connection's share of the target's
  // table of revoked leases (false: the share is full; the initiator's put then waits for the
  // fence instead): one client cannot fill the table for the others.
  bool revoke() {
    const std::uint64_t fenced = target_.fences.fenced();
    std::erase_if(revoked_tags_, [&](std::uint64_t tag) { return tag != 0 && tag <= fenced; });
    const std::size_t share = std::max<std::size_t>(
        16, Fences::kMaxRevoked / std::max<std::uint32_t>(1, target_.options.max_connections));
    if (revoked_tags_.size() >= share) return false;
    if (!target_.fences.revoke(h_.lease, h_.fence)) return false;
    revoked_tags_.push_back(h_.fence);
    return true;
  }

  // The lease id the fences know a granted lease by (Granted::bound): never 0, which means none.
  static std::uint64_t bound_lease(std::uint64_t lease, std::string_view grant) {
    const std::uint64_t b = XXH3_64bits_withSeed(grant.data(), grant.size(), lease);
    return b != 0 ? b : 1;
  }

  // A lease's grant, `h_.length` bytes (at most kMaxGrantBytes), then its verdict.
  Next receive_grant() {
    if (grant_text_.size() < h_.length) {
      const std::size_t had = grant_text_.size();
      grant_text_.resize(h_.length);
      const ssize_t n = receive(grant_text_.data() + had, h_.length - had);
      grant_text_.resize(had + (n > 0 ? static_cast<std::size_t>(n) : 0));
      if (n == 0) return Next::kClose;
      if (n < 0) return on_error(errno, Next::kWaitRead);
      if (grant_text_.size() < h_.length) return Next::kGoOn;
    }
    r_ = take_grant();
    step_ = Step::kRespond;
    return Next::kGoOn;
  }

  ResponseHeader take_grant() {
    auto checks = target_.grant_check();
    if (!checks) return ResponseHeader{};  // leases need no grant here: nothing to hold
    auto g = checks->check(grant_text_);
    const auto base = reinterpret_cast<std::uintptr_t>(region_->base);
    const std::uint64_t bound = bound_lease(h_.lease, grant_text_);
    const char* why = nullptr;
    if (!g.is_ok()) {
      why = "its grant does not verify";
    } else if (!target_.fences.allowed(bound, g->fence)) {
      why = "its grant is fenced already (or the lease revoked)";
    } else {
      // A grant may span several regions of its owner (a KvExport's layers): this lease keeps
      // what lies in its own.
      std::erase_if(g->ranges, [&](const RemoteRange& r) {
        return r.addr < base || r.addr - base > region_->length ||
               r.length > region_->length - (r.addr - base);
      });
      if (g->ranges.empty()) why = "its grant names nothing in the lease's region";
    }
    if (why != nullptr) {
      KVSTASH_LOG_INFO_LIMITED("tcp: refused lease {:#x}: {}{}", h_.lease, why,
                               g.is_ok() ? std::string() : ": " + g.status().to_string());
      return refuse(StatusCode::kPermissionDenied, RefusalReason::kGrantRefused);
    }
    const std::size_t weight = g->ranges.size() + 1;  // + 1: an empty grant still counts
    const auto full = [&] {
      return grants_.size() >= kMaxGrants || granted_ranges_ + weight > kMaxGrantedRanges ||
             target_.granted_ranges.load(std::memory_order_relaxed) + weight > Target::kMaxGrantedRanges;
    };
    if (full()) {
      std::erase_if(grants_, [&](const auto& e) {
        const bool ended = !target_.fences.allowed(e.second.bound, e.second.grant.fence);
        if (ended) count_ranges(-static_cast<std::ptrdiff_t>(e.second.grant.ranges.size() + 1));
        return ended;
      });
      if (full()) return refuse(StatusCode::kNoSpace, RefusalReason::kTooManyGrants);
    }
    forget_grant(h_.lease);
    count_ranges(static_cast<std::ptrdiff_t>(weight));
    grants_[h_.lease] = Granted{std::move(g).value(), h_.key, bound};
    return ResponseHeader{};
  }

  // Whether the connection held a grant for `lease` (it holds none now).
  bool forget_grant(std::uint64_t lease) {
    auto it = grants_.find(lease);
    if (it == grants_.end()) return false;
    count_ranges(-static_cast<std::ptrdiff_t>(it->second.grant.ranges.size() + 1));
    grants_.erase(it);
    return true;
  }

  // The ranges this connection's grants hold, here and in the target's total.
  void count_ranges(std::ptrdiff_t delta) {
    granted_ranges_ = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(granted_ranges_) + delta);
    target_.granted_ranges.fetch_add(static_cast<std::size_t>(delta), std::memory_order_relaxed);
  }

  // The rest of a WRITE's payload (`left` bytes) is read and dropped, keeping the stream in
  // sync, then the refusal goes out; beyond kMaxDiscard the connection closes after it.
  void drop(std::uint64_t left) {
    discard_left_ = left;
    if (left > kMaxDiscard) {
      close_after_ = true;
      step_ = Step::kRespond;
    } else {
      step_ = left > 0 ? Step::kDiscard : Step::kRespond;
    }
  }

  Next receive_payload() {
    if (moved_ == h_.length) {
      step_ = Step::kRespond;
      return Next::kGoOn;
    }
    ssize_t n;
    {
      Guard g(target_, *mark_, *region_, h_);
      if (!g.allowed()) {
        r_ = ended();
        drop(h_.length - moved_);
        return Next::kGoOn;
      }
      n = receive(where_ + moved_, h_.length - moved_);
    }
    if (n == 0) return Next::kClose;
    if (n < 0) return on_error(errno, Next::kWaitRead);
    moved_ += static_cast<std::uint64_t>(n);
    return Next::kGoOn;
  }

  Next discard() {
    if (scratch_.empty()) scratch_.resize(64u << 10);
    const std::size_t step = std::min<std::uint64_t>(discard_left_, scratch_.size());
    const ssize_t n = receive(scratch_.data(), step);
    if (n == 0) return Next::kClose;
    if (n < 0) return on_error(errno, Next::kWaitRead);
    discard_left_ -= static_cast<std::uint64_t>(n);
    if (discard_left_ == 0) step_ = Step::kRespond;
    return Next::kGoOn;
  }

  // A READ's response header and payload. When the lease or region ends before the first byte
  // the answer becomes a refusal; after it, only closing can tell the initiator.
  Next send_payload() {
    const std::uint64_t total = sizeof r_ + h_.length;
    if (moved_ == total) return Next::kServed;
    std::array<iovec, 2> iov;
    int count = 0;
    if (moved_ < sizeof r_) iov[count++] = {reinterpret_cast<std::byte*>(&r_) + moved_, sizeof r_ - moved_};
    const std::uint64_t off = moved_ < sizeof r_ ? 0 : moved_ - sizeof r_;
    iov[count++] = {where_ + off, h_.length - off};
    msghdr msg{};
    msg.msg_iov = iov.data();
    msg.msg_iovlen = count;
    ssize_t n;
    {
      Guard g(target_, *mark_, *region_, h_);
      if (!g.allowed()) {
        // Past the first byte (through TLS, past the first try: its record may be half out),
        // a refusal would land inside the payload the initiator is reading.
        if (moved_ > 0 || (tls_ && tls_->write_pending())) return Next::kClose;
        r_ = ended();
        step_ = Step::kRespond;
        return Next::kGoOn;
      }
      // Through TLS the header and the payload's first bytes go out as one record.
      n = tls_ ? tls_->writev(iov.data(), static_cast<std::size_t>(count))
               : ::sendmsg(socket_.native_handle(), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    if (n < 0) return on_error(errno, Next::kWaitWrite);
    moved_ += static_cast<std::uint64_t>(n);
    return Next::kGoOn;
  }

  Next respond() {
    if (r_sent_ == sizeof r_) return close_after_ ? Next::kClose : Next::kServed;
    const auto* from = reinterpret_cast<const std::byte*>(&r_) + r_sent_;
    const ssize_t n = send(from, sizeof r_ - r_sent_);
    if (n < 0) return on_error(errno, Next::kWaitWrite);
    r_sent_ += static_cast<std::size_t>(n);
    return Next::kGoOn;
  }

  static ResponseHeader ended() { return refuse(StatusCode::kPermissionDenied, RefusalReason::kLeaseEnded); }

  using Clock = std::chrono::steady_clock;

  Strand strand_;
  tcp::socket socket_;
  std::unique_ptr<TlsSession> tls_;  // null: plain tcp
  ConnectionSlot slot_;              // counts against the target's caps until the connection ends
  Target& target_;
  const std::shared_ptr<Fences::Mark> mark_;
  HandlerArena arena_;
  asio::steady_timer timer_;
  const std::chrono::milliseconds watch_period_;
  Clock::time_point deadline_{};
  Clock::time_point last_useful_ = Clock::now();  // the last request that did something
  std::chrono::milliseconds timeout_{};
  const char* deadline_what_ = "";
  bool closed_ = false;

  Step step_ = Step::kHeader;
  RequestHeader h_{};
  std::size_t header_got_ = 0;
  std::shared_ptr<RegionTable::Region> region_;
  std::byte* where_ = nullptr;
  ResponseHeader r_{};       // the answer (for a READ, the header in front of the payload)
  std::size_t r_sent_ = 0;   // of a separate answer
  std::uint64_t moved_ = 0;  // payload bytes received (WRITE) or header + payload sent (READ)
  std::uint64_t discard_left_ = 0;
  bool close_after_ = false;
  std::vector<std::byte> scratch_;  // a refused WRITE's payload lands here, dropped

  // The leases granted on this connection (where the target checks grants), by lease id.
  struct Granted {
    Grant grant;
    std::uint64_t region = 0;  // its region's key
    // The lease as the target's fences know it: the initiator's id bound to the grant's text,
    // so a revoke (or a fence check) under a lease id reaches only the leases granted by that
    // very grant, never another client's that happens to use, or learned, the same id.
    std::uint64_t bound = 0;
  };
  // Revokes this connection made whose fence tags the target has not passed yet (each is
  // remembered by the target until then): at most its share of the target's table.
  std::deque<std::uint64_t> revoked_tags_;
  std::unordered_map<std::uint64_t, Granted> grants_;
  std::size_t granted_ranges_ = 0;  // + 1 per grant
  std::string grant_text_;          // a grant being received
};

}  // namespace

void serve_requests(Strand strand, tcp::socket socket, ConnectionSlot slot, std::unique_ptr<TlsSession> tls) {
  std::make_shared<RequestServer>(std::move(strand), std::move(socket), std::move(slot), std::move(tls))
      ->start();
}

}  // namespace kvstash::transport::tcp

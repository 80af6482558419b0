// tcp datapath, the target's side: one accepted connection's requests against this process's
// regions, each checked (key, range, op, lease) before a byte moves, payloads moved one
// syscall at a time under a Guard so that a fence, a revoke or a deregistration waits for at
// most one. The initiator's side is tcp_transport_datapath.cc.
#include <array>
#include <limits>
#include <vector>

#include "common/log.h"
#include "transport/tcp/tcp_internal.h"

namespace kvstash::transport::tcp {
namespace {

using asio::redirect_error;
using asio::use_awaitable;
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
      h.op != static_cast<std::uint8_t>(TransferOp::kWrite) && h.op != kRevokeOp) {
    return refuse(StatusCode::kInvalidArgument, RefusalReason::kBadOp);
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

[[noreturn]] void throw_errno(int err) {
  throw boost::system::system_error(error_code(err, boost::system::system_category()));
}

// Closes the connection when a request's payload stops moving for `timeout`, or when no
// request arrives for the idle timeout: a stalled initiator must not hold a connection slot,
// a region (and so its deregistration) hostage. Runs on the connection's strand, like the
// request loop that arms it.
class Watchdog {
 public:
  explicit Watchdog(tcp::socket& socket) : socket_(socket), timer_(socket.get_executor()) {}
  ~Watchdog() { *alive_ = false; }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void arm(std::chrono::milliseconds timeout, const char* what) {
    const std::uint64_t generation = ++generation_;
    timer_.expires_after(timeout);
    timer_.async_wait([this, generation, timeout, what, alive = alive_](error_code ec) {
      if (ec || !*alive || generation != generation_) return;
      KVSTASH_LOG_INFO("tcp: {} for {} ms, dropping the connection", what, timeout.count());
      error_code ignored;
      socket_.close(ignored);
    });
  }

 private:
  tcp::socket& socket_;
  asio::steady_timer timer_;
  std::uint64_t generation_ = 0;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

// Reads and drops `n` payload bytes (a refused WRITE's), keeping the stream in sync.
asio::awaitable<void> discard(tcp::socket& socket, std::uint64_t n, std::vector<std::byte>& scratch) {
  scratch.resize(64u << 10);
  for (std::uint64_t left = n; left > 0;) {
    std::size_t step = std::min<std::uint64_t>(left, scratch.size());
    co_await asio::async_read(socket, asio::buffer(scratch.data(), step), kWhole, use_awaitable);
    left -= step;
  }
}

// Receives a WRITE's payload into `where`, one non-blocking recv at a time, each under a
// Guard. Returns how many bytes landed: fewer than h.length when the lease or region ended
// on the way (the caller drops the rest).
asio::awaitable<std::uint64_t> receive_payload(tcp::socket& socket, Target& target, Fences::Mark& mark,
                                               RegionTable::Region& region, const RequestHeader& h,
                                               std::byte* where) {
  const int fd = socket.native_handle();
  std::uint64_t got = 0;
  while (got < h.length) {
    ssize_t n;
    {
      Guard g(target, mark, region, h);
      if (!g.allowed()) co_return got;
      n = ::recv(fd, where + got, h.length - got, MSG_DONTWAIT);
    }
    if (n > 0) {
      got += static_cast<std::uint64_t>(n);
    } else if (n == 0) {
      throw boost::system::system_error(asio::error::eof);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      co_await socket.async_wait(tcp::socket::wait_read, use_awaitable);
    } else if (errno != EINTR) {
      throw_errno(errno);
    }
  }
  co_return got;
}

// Sends a READ's response header and payload from `where`, one non-blocking sendmsg at a
// time, each under a Guard. Returns false when the lease or region ended on the way: before
// the first byte the caller answers with a refusal; after it the connection must close.
asio::awaitable<std::pair<bool, std::uint64_t>> send_payload(tcp::socket& socket, Target& target,
                                                             Fences::Mark& mark, RegionTable::Region& region,
                                                             const RequestHeader& h, const std::byte* where) {
  ResponseHeader r{};
  r.length = h.length;
  const int fd = socket.native_handle();
  const std::uint64_t total = sizeof r + h.length;
  std::uint64_t sent = 0;
  while (sent < total) {
    std::array<iovec, 2> iov;
    int count = 0;
    if (sent < sizeof r) iov[count++] = {reinterpret_cast<std::byte*>(&r) + sent, sizeof r - sent};
    const std::uint64_t off = sent < sizeof r ? 0 : sent - sizeof r;
    iov[count++] = {const_cast<std::byte*>(where) + off, h.length - off};
    msghdr msg{};
    msg.msg_iov = iov.data();
    msg.msg_iovlen = count;
    ssize_t n;
    {
      Guard g(target, mark, region, h);
      if (!g.allowed()) co_return std::pair{false, sent};
      n = ::sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    if (n >= 0) {
      sent += static_cast<std::uint64_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      co_await socket.async_wait(tcp::socket::wait_write, use_awaitable);
    } else if (errno != EINTR) {
      throw_errno(errno);
    }
  }
  co_return std::pair{true, sent};
}

}  // namespace

asio::awaitable<void> serve_requests(tcp::socket& socket, Target& target) {
  std::vector<std::byte> scratch;
  Watchdog watchdog(socket);
  const auto mark = target.fences.attach();
  const auto& o = target.options;
  for (;;) {
    RequestHeader h;
    watchdog.arm(o.idle_timeout, "no request");
    co_await asio::async_read(socket, asio::buffer(&h, sizeof h), kWhole, use_awaitable);
    watchdog.arm(o.io_timeout, "a request stalled");
    const std::shared_ptr<RegionTable::Region> region = target.regions.find(h.key);
    std::byte* where = nullptr;
    ResponseHeader r = check(h, region.get(), &where);
    const bool ok = r.status == static_cast<std::uint32_t>(StatusCode::kOk);
    const auto ended = refuse(StatusCode::kPermissionDenied, RefusalReason::kLeaseEnded);
    if (h.op == kRevokeOp) {
      // Answered once no request under the lease can move bytes, on any connection.
      if (ok && !target.fences.revoke(h.lease, h.fence)) {
        r = refuse(StatusCode::kNoSpace, RefusalReason::kTooManyRevoked);
      }
      co_await asio::async_write(socket, asio::buffer(&r, sizeof r), kWhole, use_awaitable);
    } else if (h.op == static_cast<std::uint8_t>(TransferOp::kWrite)) {
      std::uint64_t landed = 0;
      if (ok) landed = co_await receive_payload(socket, target, *mark, *region, h, where);
      if (ok && landed < h.length) r = ended;
      if (landed < h.length) {
        if (h.length - landed > kMaxDiscard) {
          co_await asio::async_write(socket, asio::buffer(&r, sizeof r), kWhole, use_awaitable);
          co_return;
        }
        co_await discard(socket, h.length - landed, scratch);
      }
      co_await asio::async_write(socket, asio::buffer(&r, sizeof r), kWhole, use_awaitable);
    } else if (ok) {
      auto [whole, sent] = co_await send_payload(socket, target, *mark, *region, h, where);
      if (!whole) {
        if (sent > 0) co_return;  // mid-payload: only closing tells the initiator
        co_await asio::async_write(socket, asio::buffer(&ended, sizeof ended), kWhole, use_awaitable);
      }
    } else {
      co_await asio::async_write(socket, asio::buffer(&r, sizeof r), kWhole, use_awaitable);
      if (r.reason == static_cast<std::uint32_t>(RefusalReason::kBadOp)) co_return;
    }
  }
}

}  // namespace kvstash::transport::tcp

// tcp datapath, the initiator's side: streams (post, abort, responses) and the endpoint.
// Payloads go straight between sockets and registered memory: a WRITE is one gather write of
// header + payload, a READ's payload is read straight into the destination. The target's
// side is tcp_target_datapath.cc.
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

#include "common/log.h"
#include "transport/tcp/tcp_internal.h"

namespace kvstash::transport::tcp {
namespace {

using boost::system::error_code;

Status refusal(std::uint32_t code, std::uint32_t reason) {
  // Narrowed to StatusCode's byte, a foreign code such as 256 would read as OK: an op the
  // target refused would complete as done, a read with its buffer never filled.
  if (code == 0 || code > static_cast<std::uint32_t>(StatusCode::kInternal)) {
    return Status::corrupt("tcp protocol error: unknown status " + std::to_string(code) + " from peer");
  }
  auto c = static_cast<StatusCode>(code);
  switch (static_cast<RefusalReason>(reason)) {
    case RefusalReason::kUnknownKey: return {c, "target refused the request: unknown or revoked remote key"};
    case RefusalReason::kOutOfRange:
      return {c, "target refused the request: range outside the registered region"};
    case RefusalReason::kBadOp: return {c, "target refused the request: unknown operation"};
    case RefusalReason::kLeaseRequired:
      return {c, "target refused the request: the region is reachable through leases only"};
    case RefusalReason::kLeaseEnded:
      return {c, "target refused the request: its lease was revoked or fenced, or the region deregistered"};
    case RefusalReason::kNotLeased: return {c, "target refused the revoke: the region holds no leases"};
    case RefusalReason::kTooManyRevoked:
      return {c, "target refused the revoke: it remembers too many revoked leases (the fence will end it)"};
    case RefusalReason::kNoGrant:
      return {c,
              "target refused the request: it serves leases only under a grant, and this lease's was "
              "refused or never presented (the target's log says why)"};
    case RefusalReason::kGrantRefused:
      return {c,
              "target refused the lease's grant: forged, another node's or an earlier incarnation's, "
              "for another region, or fenced already"};
    case RefusalReason::kOutsideGrant:
      return {c,
              "target refused the request: it reaches past the ranges, or is not the op, that its "
              "lease's grant allows"};
    case RefusalReason::kTooManyGrants:
      return {c, "target refused the lease's grant: the connection holds too many granted leases"};
    case RefusalReason::kNone: break;
  }
  return {c, "target refused the request"};
}

}  // namespace

// ---- initiator ------------------------------------------------------------------------------

namespace {

// Responses taken (or requests sent) in one go before the strand lets other handlers run.
constexpr int kFairShare = 16;

// Adds a Pending to a ring, growing it when full.
void push(boost::circular_buffer<Pending>& ring, Pending&& p) {
  if (ring.full()) ring.set_capacity(std::max<std::size_t>(16, 2 * ring.capacity()));
  ring.push_back(std::move(p));
}

}  // namespace

Stream::Stream(std::shared_ptr<IoRuntime> runtime, tcp::socket socket, std::unique_ptr<TlsSession> tls)
    : runtime_(std::move(runtime)),
      strand_(asio::make_strand(runtime_->io())),
      socket_(std::move(socket)),
      tls_(std::move(tls)),
      queued_(64),
      on_wire_(64) {
  answered_.reserve(kMaxGroupOps);
}

ssize_t Stream::send_some(const iovec* iov, std::size_t count) {
  if (tls_) return tls_->writev(iov, count);
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = count;
  // MSG_NOSIGNAL: a peer that died must turn into an error, not a SIGPIPE for the process.
  return ::sendmsg(socket_.native_handle(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}

ssize_t Stream::receive_some(const iovec* iov, std::size_t count) {
  if (tls_) return tls_->readv(iov, count);
  if (count == 1) return ::recv(socket_.native_handle(), iov[0].iov_base, iov[0].iov_len, MSG_DONTWAIT);
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = count;
  return ::recvmsg(socket_.native_handle(), &msg, MSG_DONTWAIT);
}

tcp::socket::wait_type Stream::wait_kind(tcp::socket::wait_type plain) const {
  if (!tls_) return plain;
  const auto wants = plain == tcp::socket::wait_read ? tls_->read_wants() : tls_->write_wants();
  return wants == TlsSession::Wait::kRead ? tcp::socket::wait_read : tcp::socket::wait_write;
}

std::string Stream::error_text(int err) const { return tls_ ? tls_->error_text(err) : std::strerror(err); }

template <typename F>
auto Stream::on_strand(F f) {
  return on_arena(strand_, arena_, [self = shared_from_this(), f](auto&&... args) { f(*self, args...); });
}

void Stream::start() {
  asio::post(on_strand([](Stream& s) { s.read_more(); }));
}

void Stream::enqueue(std::span<const Op> ops) {
  std::unique_lock lock(mu_);
  if (failed_) {
    Status s = failure_;
    lock.unlock();
    for (const Op& op : ops) op.sink->complete(op.tag, s);
    return;
  }
  for (const Op& op : ops) queue(op);
  start_writing(std::move(lock));
}

void Stream::queue(const Op& op) {
  const auto* key = static_cast<const TcpRemoteKey*>(op.remote_key);
  if (key->grant) {
    // A key made through an earlier endpoint (the engine revokes through the one it has now)
    // knows nothing of this connection: its grant goes ahead of each such request.
    const std::uint64_t bit = std::uint64_t{1} << index;
    if (key->endpoint_id != endpoint_id ||
        (key->presented.fetch_or(bit, std::memory_order_relaxed) & bit) == 0) {
      Pending g;
      g.kind = Pending::Kind::kGrant;
      g.region = key->key;
      g.lease = key->lease;
      g.fence = key->fence;
      g.grant = key->grant;
      push(queued_, std::move(g));
    }
  }
  push(queued_, {op});
}

void Stream::enqueue_revoke(const Op& op) {
  std::unique_lock lock(mu_);
  if (failed_) {
    Status s = failure_;
    lock.unlock();
    op.sink->complete(op.tag, s);
    return;
  }
  queue(op);  // the target revokes only a lease granted on this connection
  queued_.back().kind = Pending::Kind::kRevoke;
  start_writing(std::move(lock));
}

void Stream::enqueue_release(std::uint64_t region, std::uint64_t lease) {
  std::unique_lock lock(mu_);
  if (failed_) return;  // the connection and its leases are gone at the target
  Pending r;
  r.kind = Pending::Kind::kRelease;
  r.region = region;
  r.lease = lease;
  push(queued_, std::move(r));
  start_writing(std::move(lock));
}

void Stream::start_writing(std::unique_lock<std::mutex> lock) {
  if (writing_) return;
  writing_ = true;
  // Send from this thread while the socket takes requests whole: no hop to an io thread.
  if (send_inline()) {
    writing_ = false;
    return;
  }
  lock.unlock();
  asio::post(on_strand([](Stream& s) { s.write_more(); }));
}

bool Stream::next_request(OutRequest& r) {
  if (queued_.empty() || failed_) return false;
  // Room for a whole group first: `first` and `op` below are references into the ring, which
  // a push that grew it would leave dangling.
  if (on_wire_.capacity() - on_wire_.size() < kMaxGroupOps)
    on_wire_.set_capacity(std::max(2 * on_wire_.capacity(), on_wire_.size() + kMaxGroupOps));
  // On the wire before the header is sent, so the response always finds it.
  push(on_wire_, std::move(queued_.front()));
  queued_.pop_front();
  Pending& first = on_wire_.back();
  const Op& op = first.op;
  // Only what this request uses is reset: pieces past `count` are never read.
  r.header = RequestHeader{};
  r.count = 0;
  r.sent = 0;
  if (first.kind == Pending::Kind::kGrant || first.kind == Pending::Kind::kRelease) {
    r.header.op = first.kind == Pending::Kind::kGrant ? kGrantOp : kReleaseOp;
    r.header.key = first.region;
    r.header.lease = first.lease;
    r.header.fence = first.fence;
    if (first.grant) {
      r.header.length = first.grant->size();
      r.pieces[r.count++] = {reinterpret_cast<const std::byte*>(first.grant->data()), first.grant->size()};
    }
    return true;
  }
  const bool revoke = first.kind == Pending::Kind::kRevoke;
  const bool write = op.op == TransferOp::kWrite && !revoke;
  const auto* key = static_cast<const TcpRemoteKey*>(op.remote_key);
  r.header.op = revoke ? kRevokeOp : static_cast<std::uint8_t>(op.op);
  r.header.key = key->key;
  r.header.lease = key->lease;
  r.header.fence = key->fence;
  if (revoke) return true;
  r.header.addr = op.remote_addr;
  r.header.length = op.length;
  if (write) r.pieces[r.count++] = {op.local, op.length};
  std::uint32_t group = 1;
  while (group < kMaxGroupOps && !queued_.empty()) {
    const Op& next = queued_.front().op;
    if (queued_.front().kind != Pending::Kind::kTransfer || next.sink != op.sink || next.op != op.op ||
        next.remote_key != op.remote_key || next.remote_addr != r.header.addr + r.header.length ||
        r.header.length + next.length > kMaxGroupBytes) {
      break;
    }
    r.header.length += next.length;
    if (write) r.pieces[r.count++] = {next.local, next.length};
    push(on_wire_, std::move(queued_.front()));
    queued_.pop_front();
    on_wire_.back().group = 0;
    ++group;
  }
  on_wire_[on_wire_.size() - group].group = group;
  return true;
}

bool Stream::send_inline() {
  // MSG_DONTWAIT (and the socket is non-blocking anyway): sendmsg never waits here. Holding mu_
  // keeps fail_all() from closing the descriptor under us.
  OutRequest& r = resume_;
  while (next_request(r)) {
    std::array<iovec, kMaxGroupOps + 1> iov;
    iov[0] = {&r.header, sizeof r.header};
    for (std::size_t i = 0; i < r.count; ++i) {
      iov[i + 1] = {const_cast<std::byte*>(r.pieces[i].first), r.pieces[i].second};
    }
    ssize_t n = send_some(iov.data(), r.count + 1);
    if (n == static_cast<ssize_t>(r.total())) continue;
    r.sent = n > 0 ? static_cast<std::size_t>(n) : 0;
    // Through TLS a write moves one record (16 KiB), not what the socket takes: go on from this
    // thread, up to kInlineTlsBytes, before handing the rest to the writer (a hop to the io
    // thread costs a small request more than its records).
    while (tls_ && n > 0 && r.sent < r.total() && r.sent <= kInlineTlsBytes) {
      n = send_some(iov.data(), unsent(r, iov));
      if (n > 0) r.sent += static_cast<std::size_t>(n);
    }
    if (r.sent == r.total()) continue;
    // Partly sent, would block, or failed: the writer coroutine finishes the job (and meets
    // the error itself, closing the stream on its strand).
    resume_pending_ = true;
    return false;
  }
  return true;
}

std::size_t Stream::unsent(const OutRequest& r, std::array<iovec, kMaxGroupOps + 1>& iov) {
  // The rest of the header, then the rest of the payload.
  std::size_t count = 0;
  std::size_t skip = r.sent;
  auto add = [&](const void* p, std::size_t len) {
    if (skip >= len) {
      skip -= len;
      return;
    }
    iov[count++] = {const_cast<std::byte*>(static_cast<const std::byte*>(p)) + skip, len - skip};
    skip = 0;
  };
  add(&r.header, sizeof r.header);
  for (std::size_t i = 0; i < r.count; ++i) add(r.pieces[i].first, r.pieces[i].second);
  return count;
}

void Stream::write_more() {
  for (int sent = 0; sent < kFairShare;) {
    OutRequest& r = resume_;
    {
      std::lock_guard lock(mu_);
      if (failed_) {
        writing_ = false;
        return;
      }
      if (!resume_pending_) {
        if (!next_request(r)) {
          writing_ = false;
          return;
        }
        resume_pending_ = true;
      }
    }
    // Unlocked: the request's ops are on the wire, and only this strand (the reader, a reset)
    // completes those, so their buffers stay put while the syscall runs.
    std::array<iovec, kMaxGroupOps + 1> iov;
    const ssize_t n = send_some(iov.data(), unsent(r, iov));
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        socket_.async_wait(wait_kind(tcp::socket::wait_write), on_strand([](Stream& s, error_code ec) {
                             if (ec) {
                               s.fail_all(Status::unavailable("tcp send to peer failed: " + ec.message()),
                                          ec == asio::error::operation_aborted);
                               std::lock_guard lock(s.mu_);
                               s.writing_ = false;
                               return;
                             }
                             s.write_more();
                           }));
        return;
      }
      fail_all(Status::unavailable("tcp send to peer failed: " + error_text(err)));
      std::lock_guard lock(mu_);
      writing_ = false;
      return;
    }
    r.sent += static_cast<std::size_t>(n);
    if (r.sent == r.total()) {
      std::lock_guard lock(mu_);
      resume_pending_ = false;
      ++sent;
    }
  }
  asio::post(on_strand([](Stream& s) { s.write_more(); }));
}

void Stream::read_more() {
  for (int answered = 0; answered < kFairShare;) {
    switch (read_response()) {
      case Read::kAnswered: ++answered; break;
      case Read::kWait:
        socket_.async_wait(wait_kind(tcp::socket::wait_read), on_strand([](Stream& s, error_code ec) {
                             if (ec) {
                               s.fail_all(Status::unavailable("tcp receive failed: " + ec.message()),
                                          ec == asio::error::operation_aborted);
                               return;
                             }
                             s.read_more();
                           }));
        return;
      case Read::kEnded: return;
    }
  }
  asio::post(on_strand([](Stream& s) { s.read_more(); }));
}

Stream::Read Stream::read_response() {
  // A receive that moved no bytes: try again (nullopt), wait for the socket, or the stream
  // failed (`during`: which part of the response).
  auto moved_nothing = [&](ssize_t n, std::string_view during) -> std::optional<Read> {
    if (n < 0 && errno == EINTR) return std::nullopt;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Read::kWait;
    std::string what = "tcp receive failed";
    what.append(during).append(": ").append(n == 0 ? "peer closed the connection" : error_text(errno));
    fail_all(Status::unavailable(std::move(what)));
    return Read::kEnded;
  };
  for (;;) {
    if (!in_payload_) {
      // The header, then the request it answers: the group of ops at the front of the wire.
      const iovec into{reinterpret_cast<std::byte*>(&response_) + response_got_,
                       sizeof response_ - response_got_};
      const ssize_t n = receive_some(&into, 1);
      if (n <= 0) {
        if (auto next = moved_nothing(n, "")) return *next;
        continue;
      }
      response_got_ += static_cast<std::size_t>(n);
      if (response_got_ < sizeof response_) continue;
      TransferOp op = TransferOp::kRead;
      bool transfer = true;
      std::uint64_t length = 0;
      group_ = 0;
      payload_first_ = payload_count_ = 0;
      {
        std::lock_guard lock(mu_);
        if (failed_) return Read::kEnded;  // reset meanwhile; its ops are already completed
        if (!on_wire_.empty() && on_wire_.front().group <= on_wire_.size()) {
          group_ = on_wire_.front().group;
          op = on_wire_.front().op.op;
          transfer = on_wire_.front().kind == Pending::Kind::kTransfer;
          for (std::uint32_t i = 0; transfer && i < group_; ++i) {
            const Op& o = on_wire_[i].op;
            length += o.length;
            if (o.length > 0) payload_[payload_count_++] = {o.local, o.length};
          }
        }
      }
      const bool ok = response_.status == static_cast<std::uint32_t>(StatusCode::kOk);
      const std::uint64_t expect = ok && op == TransferOp::kRead && transfer ? length : 0;
      if (group_ == 0 || response_.length != expect) {
        fail_all(Status::corrupt("tcp protocol error: unexpected response from peer"));
        return Read::kEnded;
      }
      in_payload_ = expect > 0;
    }
    if (in_payload_) {
      // A READ's payload, straight into its ops' buffers.
      const ssize_t n = receive_some(payload_.data() + payload_first_, payload_count_ - payload_first_);
      if (n <= 0) {
        if (auto next = moved_nothing(n, " mid-payload")) return *next;
        continue;
      }
      for (auto left = static_cast<std::size_t>(n); left > 0;) {
        iovec& v = payload_[payload_first_];
        const std::size_t take = std::min(left, v.iov_len);
        v.iov_base = static_cast<std::byte*>(v.iov_base) + take;
        v.iov_len -= take;
        left -= take;
        if (v.iov_len == 0) ++payload_first_;
      }
      if (payload_first_ < payload_count_) continue;
      in_payload_ = false;
    }
    response_got_ = 0;
    answered_.clear();
    {
      std::lock_guard lock(mu_);
      if (failed_) return Read::kEnded;
      for (std::uint32_t i = 0; i < group_; ++i) {
        answered_.push_back(std::move(on_wire_.front()));
        on_wire_.pop_front();
      }
      completing_ += group_;
    }
    const bool ok = response_.status == static_cast<std::uint32_t>(StatusCode::kOk);
    const Status status = ok ? Status() : refusal(response_.status, response_.reason);
    for (Pending& p : answered_) finish(p, status);
    return Read::kAnswered;
  }
}

void Stream::finish(Pending& p, Status status) {
  if (p.aborted) status = p.abort_reason;
  if (p.op.sink != nullptr) {
    p.op.sink->complete(p.op.tag, std::move(status));
  } else if (p.kind == Pending::Kind::kGrant && !status.is_ok()) {
    // The requests under the lease fail with kNoGrant and say where to look.
    KVSTASH_LOG_DEBUG("tcp: the target refused lease {:#x}'s grant: {}", p.lease, status.to_string());
  }
  std::lock_guard lock(mu_);
  --completing_;
  drained_.notify_all();
}

void Stream::fail_all(const Status& status, bool deliberate) {
  std::vector<Pending> dead;
  {
    std::lock_guard lock(mu_);
    if (!failed_) {
      failed_ = true;
      failure_ = status;
      healthy_.store(false, std::memory_order_release);
      if (deliberate) {
        KVSTASH_LOG_DEBUG_LIMITED("tcp stream closed: {}", status.to_string());
      } else {
        KVSTASH_LOG_WARN_LIMITED("tcp stream failed: {}", status.to_string());
      }
    }
    for (auto& p : on_wire_) dead.push_back(std::move(p));
    on_wire_.clear();
    for (auto& p : queued_) dead.push_back(std::move(p));
    queued_.clear();
    completing_ += dead.size();
  }
  // Closing on the strand stops every pending socket operation before the ops are reported
  // complete, so no byte of theirs is touched afterwards.
  error_code ignored;
  socket_.close(ignored);
  for (auto& p : dead) finish(p, status);
}

std::size_t Stream::abort_queued(CompletionSink* sink, const Status& reason) {
  std::vector<Pending> mine;
  std::size_t on_wire = 0;
  {
    std::lock_guard lock(mu_);
    for (auto it = queued_.begin(); it != queued_.end();) {
      if (it->op.sink == sink) {
        mine.push_back(std::move(*it));
        it = queued_.erase(it);
        ++completing_;
      } else {
        ++it;
      }
    }
    for (const auto& p : on_wire_) on_wire += p.op.sink == sink;
  }
  for (auto& p : mine) {
    p.aborted = true;
    p.abort_reason = reason;
    finish(p, reason);
  }
  return on_wire;
}

void Stream::reset(CompletionSink* sink, const Status& reason) {
  asio::post(strand_, [self = shared_from_this(), sink, reason] {
    {
      std::lock_guard lock(self->mu_);
      for (auto& p : self->on_wire_) {
        if (p.op.sink == sink) {
          p.aborted = true;
          p.abort_reason = reason;
        }
      }
    }
    self->fail_all(Status::unavailable("tcp connection reset to cancel an in-flight batch"), true);
  });
}

void Stream::wait_drained(CompletionSink* sink) {
  std::unique_lock lock(mu_);
  drained_.wait(lock, [&] {
    if (completing_ != 0) return false;
    for (const auto& p : queued_) {
      if (p.op.sink == sink) return false;
    }
    for (const auto& p : on_wire_) {
      if (p.op.sink == sink) return false;
    }
    return true;
  });
}

void Stream::close() {
  asio::post(strand_,
             [self = shared_from_this()] { self->fail_all(Status::cancelled("tcp endpoint closed"), true); });
}

void Endpoint::post(std::span<const Op> ops) {
  // Runs of consecutive ops on one lane (the engine keeps pieces that continue each other
  // together) go to their stream in one go, so it can send them as one request.
  for (std::size_t i = 0; i < ops.size();) {
    std::size_t j = i + 1;
    while (j < ops.size() && ops[j].lane == ops[i].lane) ++j;
    streams_[ops[i].lane % streams_.size()]->enqueue(ops.subspan(i, j - i));
    i = j;
  }
}

namespace {

// Waits for one op's completion (a revoke's answer).
class OneShot final : public CompletionSink {
 public:
  void complete(std::uint32_t, Status status) override {
    std::lock_guard lock(mu_);
    status_ = std::move(status);
    done_ = true;
    cv_.notify_all();
  }
  // The op's status, or nullopt at the deadline.
  std::optional<Status> wait(Deadline deadline) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return done_; })) return std::nullopt;
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

}  // namespace

Status Endpoint::revoke(const RemoteKey& key, const LeaseTerms& terms, Deadline deadline) {
  const auto& k = static_cast<const TcpRemoteKey&>(key);
  if (k.lease != terms.id) return Status::invalid_argument("tcp: revoke of another lease than the key's");
  OneShot sink;
  Op op;
  op.remote_key = &key;
  op.sink = &sink;
  // Any stream will do: the target ends the lease on every connection before it answers.
  streams_[0]->enqueue_revoke(op);
  if (auto s = sink.wait(deadline)) return s->with_context("tcp: revoke");
  abort(&sink, Status::timeout("tcp: revoke"));  // returns once the sink is no longer used
  return Status::timeout("tcp: the target did not confirm the revoke before the deadline");
}

TcpRemoteKey::~TcpRemoteKey() {
  const std::uint64_t presented_on = presented.load(std::memory_order_relaxed);
  for (std::size_t i = 0; i < streams.size(); ++i) {
    if ((presented_on & (std::uint64_t{1} << i)) == 0) continue;
    if (auto s = streams[i].lock()) s->enqueue_release(key, lease);
  }
}

void Endpoint::abort(CompletionSink* sink, const Status& reason) {
  for (auto& s : streams_) {
    if (s->abort_queued(sink, reason) > 0) s->reset(sink, reason);
  }
  for (auto& s : streams_) s->wait_drained(sink);
}

bool Endpoint::healthy() const {
  for (const auto& s : streams_) {
    if (!s->healthy()) return false;
  }
  return true;
}

Endpoint::~Endpoint() {
  for (auto& s : streams_) s->close();
}

}  // namespace kvstash::transport::tcp

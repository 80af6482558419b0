// Private to the tcp transport: wire protocol, region table, and the stream machinery.
//
// Protocol (little-endian, fixed-size headers, one request at a time per direction):
//   handshake  server -> client  ServerHello   (nonce_s, whether a token is required)
//              client -> server  ClientHello   (nonce_c, HMAC(token, "client", nonce_s, nonce_c))
//              server -> client  ServerVerdict (ok/denied, HMAC(token, "server", nonce_s, nonce_c))
//   requests   client -> server  RequestHeader [+ payload for WRITE]
//              server -> client  ResponseHeader [+ payload for a successful READ]
// Responses come back in request order on each stream, so no request ids are needed.
// Payloads move straight between the socket and the registered memory on both sides.
//
// Leases: a region registered Access::kLeased is reached only by requests that name a lease
// (id and fence tag, chosen by the initiator's engine; no round trip makes one). Where the
// target checks grants (Transport::set_grant_check), a lease must first be presented on the
// connection with its grant (kGrantOp, the grant as payload, pipelined ahead of the first
// request under it: no round trip either); the connection then serves that lease only over
// the grant's ranges, for its op, under its deadline as the fence tag, until the initiator
// releases it (kReleaseOp) or the fence passes it. The target
// moves a payload one non-blocking syscall at a time, each under a Guard that checks the
// lease is neither revoked nor fenced and the region still registered; a fence, a revoke
// request or a deregistration waits for the one syscall that may be running, so once it
// returns no byte of those requests reaches the region, including bytes still queued in a
// socket that an initiator abandoned.
#pragma once

#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sys/uio.h>

#include <boost/circular_buffer.hpp>

#include "common/asio.h"
#include "common/handler_arena.h"

#include "common/admission.h"
#include "common/handshake.h"
#include "kvstash/transfer.h"
#include "transport/tcp/tcp_tls.h"
#include "transport/transport.h"

namespace kvstash::transport::tcp {

namespace asio = boost::asio;
using asio::ip::tcp;

using Strand = asio::strand<asio::io_context::executor_type>;

static_assert(std::endian::native == std::endian::little, "the tcp protocol is little-endian");

// asio's transfer_all() moves at most 64 KiB per read/write syscall; a 1 MiB payload then
// costs 16 trips through the reactor. Let each syscall take all that is left.
struct WholeBuffers {
  std::size_t operator()(const boost::system::error_code& ec, std::size_t) const {
    return ec ? 0 : std::numeric_limits<std::size_t>::max();
  }
};
constexpr WholeBuffers kWhole{};

inline constexpr std::uint32_t kServerMagic = 0x5354564b;  // "KVTS"
inline constexpr std::uint32_t kClientMagic = 0x4354564b;  // "KVTC"
inline constexpr std::uint8_t kProtocolVersion = 3;

struct ServerHello {
  std::uint32_t magic;
  std::uint8_t version;
  std::uint8_t token_required;
  std::uint8_t reserved[2];
  handshake::Nonce nonce;
};
struct ClientHello {
  std::uint32_t magic;
  std::uint8_t version;
  std::uint8_t reserved[3];
  handshake::Nonce nonce;
  handshake::Mac mac;
};
struct ServerVerdict {
  std::uint32_t status;  // a StatusCode
  handshake::Mac mac;
};

// RequestHeader::op: a TransferOp, a revoke of the lease the header names (answered once no
// request under it can touch the region any more), a lease's grant (its text as the payload,
// `length` bytes, at most kMaxGrantBytes) or the end of a lease on this connection.
inline constexpr std::uint8_t kRevokeOp = 2;
inline constexpr std::uint8_t kGrantOp = 3;
inline constexpr std::uint8_t kReleaseOp = 4;

struct RequestHeader {
  std::uint8_t op;  // TransferOp, kRevokeOp, kGrantOp or kReleaseOp
  std::uint8_t reserved[7];
  std::uint64_t key;
  std::uint64_t addr;
  std::uint64_t length;
  std::uint64_t lease;  // 0: none
  std::uint64_t fence;  // the lease's fence tag; 0: none
};
struct ResponseHeader {
  std::uint32_t status;  // a StatusCode
  std::uint32_t reason;  // a RefusalReason when status is not OK
  std::uint64_t length;  // payload bytes that follow
};
enum class RefusalReason : std::uint32_t {
  kNone = 0,
  kUnknownKey,
  kOutOfRange,
  kBadOp,
  kLeaseRequired,   // the region is reachable through leases only
  kLeaseEnded,      // the lease was revoked or fenced, or the region deregistered meanwhile
  kNotLeased,       // a revoke for a region that holds no leases
  kTooManyRevoked,  // a revoke the target cannot remember: it has too many pending already
  kNoGrant,         // the target checks grants and none was presented for the lease here
  kGrantRefused,    // the grant does not prove what the lease asks (forged, expired, another node's)
  kOutsideGrant,    // the request reaches past the ranges, or is not the op, its grant allows
  kTooManyGrants,   // the connection holds too many granted leases (release them)
};
static_assert(sizeof(RequestHeader) == 48 && sizeof(ResponseHeader) == 16);

// Regions this process serves. A request holds its Region while it runs, but touches the
// memory only inside a Guard: removal marks the region dead and waits for the syscall a Guard
// may be running, so memory is never touched after deregistration returns.
class RegionTable {
 public:
  struct Region {
    std::byte* base = nullptr;
    std::uint64_t length = 0;
    bool leased = false;  // reachable through leases only (Access::kLeased)
    std::atomic<bool> dead{false};
    std::atomic<std::uint32_t> users{0};  // Guards inside a syscall on it
  };

  std::uint64_t add(std::byte* base, std::uint64_t length, bool leased);
  // Removes the key; returns once no request can touch the region any more.
  void remove(std::uint64_t key);
  // Null when the key is unknown.
  std::shared_ptr<Region> find(std::uint64_t key) const;

 private:
  mutable std::shared_mutex mu_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Region>> regions_;
};

// The target's lease fence (Transport::fence) and revocations (kRevokeOp). Each served
// connection publishes, in its Mark, the lease of the syscall it is about to run; a fence or
// revoke first publishes itself, then waits for marks naming what it ended. Either the
// connection sees the fence (and refuses) or the fence sees the connection (and waits): the
// stores and loads on both sides are sequentially consistent.
class Fences {
 public:
  struct Mark {
    std::atomic<std::uint64_t> lease{0};
    std::atomic<std::uint64_t> fence{0};
  };
  // A mark for one connection, watched until the connection drops it.
  std::shared_ptr<Mark> attach();
  // Whether a request under lease (`lease`, `fence`) may still move bytes. Call it after
  // storing them in the connection's mark.
  bool allowed(std::uint64_t lease, std::uint64_t fence) const;
  // Ends every lease with a fence tag <= through (tags only move up); returns once no
  // connection is inside a syscall under one.
  void fence(std::uint64_t through);
  // Ends lease `lease` (fence tag `fence`) on every connection; returns once no connection is
  // inside a syscall under it. Remembered until a fence passes its tag. False, having changed
  // nothing, when kMaxRevoked leases are remembered already (the caller's put then waits for
  // the fence instead): a client cannot grow the target's memory without bound.
  bool revoke(std::uint64_t lease, std::uint64_t fence);
  // The fence so far: revokes with a tag at or below it are no longer remembered.
  std::uint64_t fenced() const { return fenced_.load(std::memory_order_seq_cst); }
  static constexpr std::size_t kMaxRevoked = 65536;
  // How long a revoke without a fence tag is remembered once the table is full.
  static constexpr std::chrono::minutes kUntaggedLife{10};

 private:
  template <typename Busy>
  void wait_marks(Busy busy);

  std::atomic<std::uint64_t> fenced_{0};
  std::atomic<std::size_t> revoked_count_{0};
  mutable std::mutex mu_;                                     // revoked_, marks_
  std::unordered_map<std::uint64_t, std::uint64_t> revoked_;  // lease -> fence tag
  std::deque<std::pair<std::uint64_t, std::chrono::steady_clock::time_point>>
      untagged_;  // fence 0, oldest first
  std::vector<std::weak_ptr<Mark>> marks_;
};

// The target's counts of what happened to connections, for Transport::counters().
struct ConnectionCounters {
  std::atomic<std::uint64_t> accepted{0};            // proved the token (or needed none)
  std::atomic<std::uint64_t> refused{0};             // closed at accept: a cap or a backoff
  std::atomic<std::uint64_t> handshakes_failed{0};   // a wrong or unchecked proof, bad hello
  std::atomic<std::uint64_t> handshake_timeouts{0};  // no handshake within handshake_timeout
  std::atomic<std::uint64_t> unproven_evicted{0};    // dropped for a newer handshake
  std::atomic<std::uint64_t> idle_dropped{0};        // idle for idle_timeout, or stalled for io_timeout
  std::atomic<std::uint64_t> gave_way{0};            // idle, closed for a newly proven connection
};

// What a transport serves: its regions, their fences, and the rules for connections.
struct Target {
  RegionTable regions;
  Fences fences;
  // Null: leases need no grant.
  std::shared_ptr<const GrantCheck> grant_check() const {
    std::lock_guard lock(grant_mu);
    return grants;
  }
  mutable std::mutex grant_mu;
  std::shared_ptr<const GrantCheck> grants;  // grant_mu
  // Whether `grants` is set: what every request on a leased region asks, without the lock.
  std::atomic<bool> checks_grants{false};
  std::string token;  // cluster token; empty: none required
  TcpOptions options;
  std::shared_ptr<TlsContext> tls;            // null: plain tcp; else TLS only
  std::atomic<std::uint32_t> connections{0};  // proven ones
  std::mutex peers_mu;
  std::unordered_map<std::string, std::uint32_t> per_peer;  // address -> connections (peers_mu)
  // Connections in the handshake, each with what drops it (peers_mu).
  admission::UnprovenBudget unproven{64};
  // Proven connections by id (peers_mu): when max_connections are, a newly proven one takes
  // the place of the one idle longest, if that has done nothing useful for kIdleToGiveWay.
  struct ProvenSeat {
    std::atomic<std::int64_t> last_useful{0};  // Clock ticks of its last useful request
    std::function<void()> drop;                // closes the connection (peers_mu)
  };
  std::map<std::uint64_t, std::shared_ptr<ProvenSeat>> proven;
  std::uint64_t next_proven = 0;  // peers_mu
  static constexpr std::chrono::seconds kIdleToGiveWay{1};
  admission::GuessThrottle throttle;
  ConnectionCounters counters;
  // The ranges every connection's grants hold (each grant counts one more): at most
  // kMaxGrantedRanges (64 MiB of them), however many connections hold some.
  std::atomic<std::size_t> granted_ranges{0};
  static constexpr std::size_t kMaxGrantedRanges = 1u << 22;
};

// An accepted connection's place under the target's caps, taken by the accept loop and
// given back when the connection ends: first in the unproven budget
// (TcpOptions::max_unproven_connections), then, once the peer proved the token, in the main
// one (max_connections). max_connections_per_peer counts both.
class ConnectionSlot {
 public:
  ConnectionSlot(std::shared_ptr<Target> target, std::string peer, std::uint64_t unproven_id)
      : target_(std::move(target)), peer_(std::move(peer)), unproven_id_(unproven_id) {}
  ConnectionSlot(ConnectionSlot&&) = default;
  ConnectionSlot& operator=(ConnectionSlot&&) = delete;
  ~ConnectionSlot();
  Target& target() const { return *target_; }
  const std::string& peer() const { return peer_; }
  // Moves the connection from the unproven budget to the main one; false (the connection is
  // to be refused) when the main one is full of connections that did something useful within
  // Target::kIdleToGiveWay (the one idle longest gives way otherwise).
  bool promote();
  // Once proven: what closes the connection when it gives way, and its last useful request.
  void on_give_way(std::function<void()> drop);
  void useful(Clock::time_point now);

 private:
  std::shared_ptr<Target> target_;  // null once moved from
  std::string peer_;
  std::uint64_t unproven_id_;
  bool proven_ = false;
  std::uint64_t proven_id_ = 0;
  std::shared_ptr<Target::ProvenSeat> seat_;
};

// One op in flight on a client stream, or a control request (no sink): a lease's grant or its
// release, which carry what their header needs themselves (the key may be gone by then).
struct Pending {
  enum class Kind : std::uint8_t { kTransfer, kRevoke, kGrant, kRelease };
  Op op{};
  Kind kind = Kind::kTransfer;  // kRevoke: for the lease op.remote_key names
  // Ops that continue each other on the remote side go out as one request: the first carries
  // how many it stands for, the others 0.
  std::uint32_t group = 1;
  bool aborted = false;
  Status abort_reason{};
  // kGrant and kRelease: the header's key, lease and fence, and a grant's text.
  std::uint64_t region = 0, lease = 0, fence = 0;
  std::shared_ptr<const std::string> grant;
};

// At most this many ops, and this many bytes, in one request.
inline constexpr std::size_t kMaxGroupOps = 64;
inline constexpr std::uint64_t kMaxGroupBytes = 4u << 20;

// A request on its way out: the header, a WRITE's payload pieces, and how much has been sent.
struct OutRequest {
  RequestHeader header{};
  std::array<std::pair<const std::byte*, std::size_t>, kMaxGroupOps> pieces{};
  std::size_t count = 0;  // payload pieces (0 for a READ)
  std::size_t sent = 0;   // bytes of header + payload already sent
  std::size_t total() const { return sizeof header + (count > 0 ? header.length : 0); }
};

// The io_context and its threads, shared by the transport, its endpoints and streams so that
// whichever goes last stops it.
class IoRuntime {
 public:
  // The last owner often lets go inside a completion handler, on one of the runtime's own
  // threads, which is still inside io_context::run(): destroying the io_context there would
  // pull it from under that thread. The deleter hands such a destruction to a fresh thread.
  // `busy_poll` > 0: each thread spins that long after its last event before it sleeps
  // (EngineOptions::busy_poll).
  static std::shared_ptr<IoRuntime> create(std::uint32_t threads, std::chrono::microseconds busy_poll = {});
  ~IoRuntime();
  asio::io_context& io() { return io_; }

 private:
  IoRuntime(std::uint32_t threads, std::chrono::microseconds busy_poll);
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::vector<std::thread> threads_;
};

// One TCP connection of a client endpoint: a writer sends queued requests, a reader takes
// the responses in order. Requests go out from the caller's thread while the socket takes
// them whole; the rest of the socket work runs on the stream's strand, as non-blocking
// syscalls with a readiness wait (from the stream's arena) when the socket is not ready: a
// warm stream allocates nothing per op.
class Stream : public std::enable_shared_from_this<Stream> {
 public:
  // `tls`: the connection's TLS session, past its handshake; null: plain tcp.
  Stream(std::shared_ptr<IoRuntime> runtime, tcp::socket socket, std::unique_ptr<TlsSession> tls = nullptr);
  void start();
  // Queues `ops` (in order) and sends what the socket takes at once from this thread.
  void enqueue(std::span<const Op> ops);
  // Queues a revoke of the lease `op.remote_key` names (op.length 0); completes through op.sink
  // once the target answered it.
  void enqueue_revoke(const Op& op);
  // Queues the end of lease `lease` on this connection (the lease key is gone). Unanswered
  // as far as any caller is concerned.
  void enqueue_release(std::uint64_t region, std::uint64_t lease);
  // This stream's index among its endpoint's (which bit of a key's `presented` is its), and
  // that endpoint's id (a key made through another endpoint presents its grant every time).
  std::uint32_t index = 0;
  std::uint64_t endpoint_id = 0;
  // Completes queued ops of `sink` with `reason`; returns the number still on the wire.
  std::size_t abort_queued(CompletionSink* sink, const Status& reason);
  // Closes the socket so every op on the wire fails; ops of `sink` end with `reason`.
  void reset(CompletionSink* sink, const Status& reason);
  // Blocks until no op of `sink` is on this stream.
  void wait_drained(CompletionSink* sink);
  bool healthy() const { return healthy_.load(std::memory_order_acquire); }
  void close();

 private:
  // Queues `op`, after its lease's grant when the lease has one not yet presented here.
  // Needs mu_.
  void queue(const Op& op);
  // Moves the next queued op on the wire, with the queued ops that continue it remotely
  // (same sink, key and direction), and fills the request; false when none. Needs mu_.
  bool next_request(OutRequest& r);
  // With the ops queued (under `lock`, on mu_): sends from this thread what the socket takes
  // whole, and hands the rest to the writer coroutine, unless a writer is busy already.
  void start_writing(std::unique_lock<std::mutex> lock);
  // Sends queued requests from the calling thread while the socket takes them whole.
  // Needs mu_ and writing_. Returns false when a request is left (partly) unsent in resume_.
  bool send_inline();
  // Through TLS, send_inline() encrypts and sends this much of a request from the caller's
  // thread before it hands the rest to the writer (which holds no lock while it sends).
  static constexpr std::size_t kInlineTlsBytes = 256u << 10;
  // The bytes of `r` not sent yet, as iovecs into `iov`; returns how many.
  static std::size_t unsent(const OutRequest& r, std::array<iovec, kMaxGroupOps + 1>& iov);
  // The writer, on the strand while writing_: sends resume_'s rest and the queued requests,
  // waiting for the socket when it is full; clears writing_ when nothing is left.
  void write_more();
  // The reader, on the strand: takes responses (header, then a READ's payload straight into
  // its ops' buffers) and completes their ops, waiting for the socket when it is empty.
  void read_more();
  enum class Read { kAnswered, kWait, kEnded };
  Read read_response();
  template <typename F>
  auto on_strand(F f);
  // `deliberate`: a reset or close we asked for, logged quietly.
  void fail_all(const Status& status, bool deliberate = false);
  void finish(Pending& p, Status status);

  // A send or receive of up to n bytes, without blocking, on the socket or through TLS: the
  // syscall's convention (bytes moved, 0 at the peer's close, -1 and errno).
  ssize_t send_some(const iovec* iov, std::size_t count);
  ssize_t receive_some(const iovec* iov, std::size_t count);
  // What to wait for after EAGAIN (`plain`: what the syscall waited for).
  tcp::socket::wait_type wait_kind(tcp::socket::wait_type plain) const;
  std::string error_text(int err) const;

  std::shared_ptr<IoRuntime> runtime_;
  Strand strand_;
  tcp::socket socket_;
  std::unique_ptr<TlsSession> tls_;  // null: plain tcp
  std::mutex mu_;
  std::condition_variable drained_;
  // Rings, grown on demand and never shrunk: a warm stream queues ops without allocating.
  boost::circular_buffer<Pending> queued_;   // not yet sent
  boost::circular_buffer<Pending> on_wire_;  // sent, waiting for the response
  // Ops taken out of the queues whose sink->complete() has not returned yet: abort may not
  // return (and let the sink be destroyed) while one of them is being delivered.
  std::size_t completing_ = 0;
  bool writing_ = false;
  // A request send_inline() could not finish: the writer sends its remaining bytes first.
  OutRequest resume_;
  bool resume_pending_ = false;
  bool failed_ = false;
  Status failure_;
  std::atomic<bool> healthy_{true};

  // The reader's response in progress (strand only).
  ResponseHeader response_{};
  std::size_t response_got_ = 0;
  std::array<iovec, kMaxGroupOps> payload_{};  // a READ's destinations still to fill
  std::size_t payload_first_ = 0, payload_count_ = 0;
  std::uint32_t group_ = 0;  // ops the response answers
  bool in_payload_ = false;
  std::vector<Pending> answered_;  // reused; capacity kMaxGroupOps

  HandlerArena arena_;
};

class Endpoint final : public transport::Endpoint {
 public:
  explicit Endpoint(std::vector<std::shared_ptr<Stream>> streams) : streams_(std::move(streams)) {}
  ~Endpoint() override;
  Result<std::unique_ptr<RemoteKey>> import_key(std::uint64_t base, std::uint64_t length,
                                                std::string_view packed, Deadline deadline) override;
  Result<std::unique_ptr<RemoteKey>> lease_key(const RemoteKey& region, std::span<const RemoteRange> ranges,
                                               const LeaseTerms& terms, Deadline deadline) override;
  Status revoke(const RemoteKey& key, const LeaseTerms& terms, Deadline deadline) override;
  void post(std::span<const Op> ops) override;
  void abort(CompletionSink* sink, const Status& reason) override;
  bool healthy() const override;

 private:
  std::vector<std::shared_ptr<Stream>> streams_;
};

struct TcpRemoteKey final : RemoteKey {
  ~TcpRemoteKey() override;
  std::uint64_t key = 0;
  bool leased = false;      // the region is reachable through leases only (Access::kLeased)
  std::uint64_t lease = 0;  // a lease's id and fence tag, sent with every request; 0: none
  std::uint64_t fence = 0;
  // A lease's grant, presented on each stream ahead of its first request there (bit i of
  // `presented`: on stream i, set under that stream's lock) and released on those streams
  // when the key goes.
  std::shared_ptr<const std::string> grant;
  mutable std::atomic<std::uint64_t> presented{0};
  std::uint64_t endpoint_id = 0;  // of the endpoint that made it, whose streams are `streams`
  std::vector<std::weak_ptr<Stream>> streams;
};

// How the accept loop drops a connection still in its handshake (for a newer one, when the
// unproven budget is full). Used on the connection's strand only.
class HandshakeGate {
 public:
  // Closes the socket being watched, or the one about to be.
  void drop();
  bool dropped() const { return dropped_; }
  // The socket to close; null once the handshake is over.
  void watch(tcp::socket* socket) { socket_ = socket; }

 private:
  tcp::socket* socket_ = nullptr;
  bool dropped_ = false;
};

// Serves one accepted connection: handshake, then requests against the target's regions.
// Runs on `strand`, the connection's.
asio::awaitable<void> serve_connection(Strand strand, tcp::socket socket, ConnectionSlot slot,
                                       std::shared_ptr<HandshakeGate> gate);
// Serves a connection's requests once its handshake passed, until it closes. Call on
// `strand`; returns at once (the connection owns itself meanwhile).
// `tls`: the connection's TLS session, past its handshake; null: plain tcp.
void serve_requests(Strand strand, tcp::socket socket, ConnectionSlot slot, std::unique_ptr<TlsSession> tls);

}  // namespace kvstash::transport::tcp

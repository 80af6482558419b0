// Private to src/transport/verbs/: the state the control path (verbs_transport.cc, the setup
// service in verbs_service.cc, leases in verbs_leases.cc) and the datapath
// (verbs_transport_datapath.cc) share.
//
// Shape: one device context and protection domain per transport; per connection, on the
// initiating side, a CQ with a completion channel, an RC QP, the TCP socket that set it up
// (kept open: it carries lease messages, and its hang-up is the fastest sign of a dead peer)
// and a poller thread that reaps completions in bulk. The target side holds QPs and the
// memory windows of leases: RDMA READ and WRITE need nothing from its CPU, a lease one
// message, served with every other setup connection by one thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/admission.h"
#include "common/net.h"
#include "kvstash/transfer.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_device.h"
#include "transport/verbs/verbs_qp.h"
#include "transport/verbs/verbs_wire.h"
#include "transport/verbs/verbs_wr.h"

namespace kvstash::transport::verbs {

// What a transport counts, updated with relaxed atomics (off the datapath's lock).
struct Counters {
  std::atomic<std::uint64_t> connections_opened{0}, connections_accepted{0}, connections_broken{0};
  std::atomic<std::uint64_t> connections_refused{0}, handshakes_failed{0};
  std::atomic<std::uint64_t> handshake_timeouts{0}, unproven_evicted{0}, connections_dropped_stalled{0};
  std::atomic<std::uint64_t> ops_posted{0}, bytes_read{0}, bytes_written{0};
  std::atomic<std::uint64_t> remote_access_errors{0}, retries_exhausted{0};
  std::atomic<std::uint64_t> leases_granted{0}, leases_refused{0}, leases_expired{0}, leases_released{0};
  std::atomic<std::uint64_t> leases_revoked{0}, leases_fenced{0};
  std::atomic<std::uint64_t> windows_bound{0}, windows_revoked{0};

  static void add(std::atomic<std::uint64_t>& c, std::uint64_t n = 1) {
    c.fetch_add(n, std::memory_order_relaxed);
  }
  std::vector<TransportCounter> snapshot() const;
};

// One device (and the port) a transport runs on. Shared by the transport and its endpoints.
struct DeviceState {
  std::size_t index = 0;  // in the transport's device list, which is its address's port order
  Device device;
  Port port;
  Gid gid;
  Context ctx;
  Pd pd;
  std::shared_ptr<Counters> counters;  // the transport's, one for all its devices
};

// Lease ids a client revoked (Endpoint::revoke), so that a late request under one is refused.
// An id is forgotten once a fence passed its tag (the tag refuses it from then on); past
// kMaxRevokedLeases ids the oldest go first, which bounds what fence-0 revokes can hold.
class RevokedLeases {
 public:
  static constexpr std::size_t kMaxRevokedLeases = 65536;
  void add(std::uint64_t id, std::uint64_t fence);
  bool contains(std::uint64_t id) const { return tags_.count(id) != 0; }
  // Forgets the ids whose nonzero tag is <= `through`.
  void fence(std::uint64_t through);
  std::size_t size() const { return tags_.size(); }

 private:
  std::unordered_map<std::uint64_t, std::uint64_t> tags_;  // id -> fence tag
  std::deque<std::uint64_t> order_;                        // ids in the order they came
};

// The target side: the connections a transport accepted, the leases bound on them, and the
// regions leases may be cut from. The setup service's thread adds and drops connections and
// serves their messages; fence() and a Registration that goes away revoke leases from other
// threads. Every member is guarded by `mu`.
struct Target {
  struct Lease {
    Clock::time_point until;
    const ibv_mr* mr = nullptr;
    std::uint64_t fence = 0;  // the owner's fence tag; 0: none
    std::vector<Mw> windows;
  };
  using LeaseMap = std::map<std::uint64_t, Lease>;  // by the client's lease id
  // A connection whose queue pair is up (its socket belongs to the setup service).
  struct Accepted {
    Qp qp;
    std::size_t dev = 0;  // index into devs
    std::uint32_t max_send_wr = 1;
    bool broken = false;      // a bind failed on the QP: drop the connection
    std::size_t windows = 0;  // bound now, over all leases
    LeaseMap leases;          // destroyed before the QP
  };

  std::vector<std::shared_ptr<DeviceState>> devs;
  std::vector<Cq> cqs;  // per device: window binds (the target's queue pairs post nothing else)
  std::mutex mu;
  // (device index, MR rkey) -> a region registered kLeased, on that device.
  std::map<std::pair<std::size_t, std::uint32_t>, const ibv_mr*> leasable;
  std::list<Accepted> accepted;
  std::uint64_t next_wr_id = 1;
  std::uint64_t fenced_through = 0;  // Transport::fence's highest value: tags up to it are refused
  RevokedLeases revoked;
  std::shared_ptr<const GrantCheck> grants;  // Transport::set_grant_check's; null: none needed

  Counters& counters() { return *devs[0]->counters; }
  // Serves one lease message that arrived on `a`: the answer to send (empty: none), or an
  // error when the connection must go (a malformed message).
  Result<std::string> serve(Accepted& a, std::string_view frame, Deadline deadline);
  // Binds one window per range of `q` on `a`'s queue pair; their rkeys in request order.
  // kStale for a fenced tag or a revoked id.
  Result<std::vector<std::uint32_t>> bind(Accepted& a, const LeaseRequest& q, Deadline deadline);
  // Revokes the lease at `it` (its windows are deallocated); the lease after it.
  LeaseMap::iterator revoke(Accepted& a, LeaseMap::iterator it);
  // Revokes one lease of `a` (a no-op for an unknown id: it may have expired already).
  void release(Accepted& a, std::uint64_t lease_id);
  // Revokes lease `id` on every connection and remembers it as revoked.
  void revoke_everywhere(std::uint64_t id, std::uint64_t fence);
  // Transport::fence: takes `mu`, revokes every lease tagged 1..through on every connection.
  void fence(std::uint64_t through);
  // Revokes leases whose time is up; the next expiry, or nullopt when none is bound.
  std::optional<Clock::time_point> expire(Clock::time_point now);
  // A region goes away: its leases are revoked and no new ones are cut from it.
  void forget(const ibv_mr* mr);
  // A connection goes: its windows, then its queue pair.
  void drop(std::list<Accepted>::iterator it);
};

// The setup listener's service: accepts TCP connections, runs each one's handshake (hellos,
// cluster token, the target queue pair brought up) and then its lease messages, all at once on
// one thread with non-blocking sockets, so that a silent or slow client delays no one.
// Bounds: the handshake must end within VerbsOptions::handshake_timeout of the accept, each
// later message (and its answer) within message_timeout; at most max_connections in all and
// max_connections_per_peer from one address, closed at accept beyond that. Connections in the
// handshake have their own budget (max_unproven_connections; when it is full the newcomer
// displaces a handshake of the source holding the most: admission::UnprovenBudget), and cost
// no queue pair or memory until the peer proved the token.
class SetupService {
 public:
  // Serves `listener` (listening, non-blocking) on its own thread until destroyed.
  SetupService(UniqueFd listener, std::shared_ptr<Target> target, const VerbsOptions& options,
               std::string token);
  ~SetupService();  // stops the thread; every connection, its queue pair and windows go
  SetupService(const SetupService&) = delete;
  SetupService& operator=(const SetupService&) = delete;

 private:
  struct Conn;
  void run();
  void accept_all();
  // Advances one connection after poll; false when it must be closed.
  bool step(Conn& c, short revents);
  bool receive(Conn& c);
  bool flush(Conn& c);
  bool process(Conn& c);
  bool on_frame(Conn& c, std::string_view frame);
  bool on_hello(Conn& c, std::string_view frame);
  bool on_proof(Conn& c, std::string_view frame);
  // Drops a connection still in its handshake that a newer one displaced.
  void displaced(std::list<Conn>::iterator it);
  void close(Conn& c);
  // Logs at most one such line a second: a flood of refusals must not flood the log.
  void warn(const std::string& line);

  UniqueFd listener_;
  UniqueFd wake_;  // eventfd that stops the thread
  std::shared_ptr<Target> target_;
  VerbsOptions options_;
  std::string token_;
  std::list<Conn> conns_;  // the service thread's alone
  std::unordered_map<std::string, std::uint32_t> per_peer_;
  admission::UnprovenBudget unproven_;  // connections of conns_ still in the handshake
  admission::GuessThrottle throttle_;
  Clock::time_point accept_paused_until_{};  // out of file descriptors: accept again later
  Clock::time_point last_warning_{};
  std::uint64_t warnings_dropped_ = 0;
  std::thread thread_;
};

// The queue-pair settings `options` ask for, within `dev`'s limits.
QpConfig qp_config(const VerbsOptions& options, const DeviceState& dev);
// This side's hello for `qp` on `dev`: a fresh random PSN and nonce; whether we require the
// cluster token.
// This side's hello for a queue pair of `dev`, with the handshake's nonce and token requirement.
Hello hello_for(const DeviceState& dev, const ibv_qp& qp, std::uint8_t max_rd_atomic,
                const handshake::Handshake& handshake);

// A region registered on every device of a transport: one MR each, in device order.
class Registration final : public LocalRegistration {
 public:
  struct Part {
    std::shared_ptr<DeviceState> dev;  // kept open while its MR exists (it may outlive the transport)
    std::uint64_t guid = 0;            // the device's
    Mr mr;                             // deregistered before `dev` can close
  };
  // `target` is set for a region registered for leases only (its MRs grant no remote access).
  // `preferred`: bit d set for each device d (DeviceState::index, below 64) that should move
  // this memory (GPU memory: the NICs nearest its GPU); 0: any.
  Registration(std::vector<Part> parts, bool remote, std::shared_ptr<Target> target = nullptr,
               std::uint64_t preferred = 0);
  ~Registration() override;
  std::string packed_key() const override;
  // The id a leased region goes by in lease requests (verbs_leases.cc).
  static std::uint32_t region_id(const ibv_mr& mr);
  // The devices ops on this memory go through when a connection has lanes on them (pick_lane).
  std::uint64_t preferred_devices() const { return preferred_; }
  // The lkey on the device with `guid`, or nullopt when the region is not registered there.
  std::optional<std::uint32_t> lkey(std::uint64_t guid) const {
    for (const Part& p : parts_) {
      if (p.guid == guid) return p.mr->lkey;
    }
    return std::nullopt;
  }

 private:
  // Declared first, destroyed last: the MRs go before the target (and its devices) can.
  std::shared_ptr<Target> target_;
  std::vector<Part> parts_;
  bool remote_;
  std::uint64_t preferred_;
};

class VerbsEndpoint;

// A peer's key as one endpoint uses it: the region's rkey, or for a lease the rkey of the
// window over each range (a lease tells the peer when it is dropped).
class ImportedKey final : public RemoteKey {
 public:
  struct Window {
    std::uint64_t addr = 0, length = 0;
    std::uint32_t rkey = 0;
  };
  ~ImportedKey() override;
  // The rkey that grants [addr, addr + length), or nullopt when this key grants none.
  std::optional<std::uint32_t> rkey_for(std::uint64_t addr, std::uint64_t length) const;

  std::uint32_t rkey = 0;
  bool leases_only = false;     // the region's rkey grants nothing remote by itself
  std::vector<Window> windows;  // a lease's, sorted by address
  std::uint64_t lease_id = 0;
  std::weak_ptr<VerbsEndpoint> owner;
};

// Length-prefixed frames on the setup socket (a u32 length in network order, then the
// message), bounded by a deadline; read_frame refuses one longer than `max` (kInvalidArgument).
void append_frame(std::string& out, std::string_view message);
Status write_frame(int fd, std::string_view message, Deadline deadline);
Result<std::string> read_frame(int fd, std::size_t max, Deadline deadline);

// Completion status -> kvstash status.
Status from_wc(ibv_wc_status status);

// The initiating side of one connection: posts READ/WRITE, reaps completions.
class VerbsEndpoint final : public Endpoint, public std::enable_shared_from_this<VerbsEndpoint> {
 public:
  // Takes a connected QP (RTS) with its CQ and channel, and the setup socket. `peer_guid` is
  // the peer's device at the other end of the QP: the part of a peer's key this lane uses.
  VerbsEndpoint(std::shared_ptr<DeviceState> dev, std::uint64_t peer_guid, ibv_comp_channel* channel, Cq cq,
                Qp qp, UniqueFd control, const VerbsOptions& options);
  ~VerbsEndpoint() override;

  Result<std::unique_ptr<RemoteKey>> import_key(std::uint64_t base, std::uint64_t length,
                                                std::string_view packed, Deadline deadline) override;
  Result<std::unique_ptr<RemoteKey>> lease_key(const RemoteKey& region, std::span<const RemoteRange> ranges,
                                               const LeaseTerms& terms, Deadline deadline) override;
  // Asks the peer to end lease terms.id on every connection it accepted (every lane, and any
  // that broke), and returns once it confirmed. `key` is not used: the id names the lease.
  Status revoke(const RemoteKey& key, const LeaseTerms& terms, Deadline deadline) override;
  // Tells the peer a lease is dropped (best effort: its ttl revokes it anyway). Waits for the
  // setup socket at most kReleaseTimeout; a release that cannot go then goes with the next
  // lease message.
  void release(std::uint64_t lease_id);
  void post(std::span<const Op> ops) override;
  void abort(CompletionSink* sink, const Status& reason) override;
  bool healthy() const override;
  // The index of this lane's device in the transport's device list.
  std::size_t device_index() const { return dev_->index; }

 private:
  struct Slot {
    CompletionSink* sink = nullptr;
    std::uint32_t tag = 0;
    std::uint32_t wrs = 0;
    std::uint32_t generation = 0;
    bool busy = false;
  };
  struct Done {
    CompletionSink* sink;
    std::uint32_t tag;
    Status status;
  };

  // With mu_ held: posts `op` now, or returns false when the send queue or the slots are full.
  bool try_post(const Op& op, std::vector<Done>& done);
  void post_pending(std::vector<Done>& done);
  // With mu_ held: the QP goes to ERROR (every posted request flushes) and nothing new posts.
  void fail(const Status& why);
  void poll_loop();
  // Reaps completions into `done`; abort() waits until deliver() handed them to their sinks.
  void reap(std::vector<Done>& done);
  void deliver(std::vector<Done>& done);
  // One message and its answer on the setup socket, sent after any queued releases. Waits
  // for the socket (another caller's exchange) only up to `deadline`: kTimeout, the socket
  // untouched. An exchange that fails once begun leaves the stream out of step: the
  // connection is broken (kUnavailable or kTimeout).
  Result<std::string> exchange(std::string_view message, Deadline deadline);
  // The setup stream cannot carry more messages: the connection is marked broken.
  void break_control(const Status& why);

  std::shared_ptr<DeviceState> dev_;
  std::uint64_t peer_guid_;  // the peer's device this lane's QP reaches
  ibv_comp_channel* channel_;
  Cq cq_;
  Qp qp_;
  UniqueFd control_;  // the setup socket: lease messages, and its hang-up means the peer is gone
  UniqueFd wake_;     // eventfd that stops the poller
  // control_ carries one exchange at a time: its user holds control_busy_ (not a lock held
  // across I/O, so that a waiting caller gives up at its own deadline).
  std::mutex control_mu_;
  std::condition_variable control_cv_;
  bool control_busy_ = false;
  bool control_broken_ = false;                  // out of step or closed: nothing more is sent
  std::vector<std::uint64_t> pending_releases_;  // releases waiting for the socket
  const std::uint32_t depth_;
  WrBuilder builder_;

  mutable std::mutex mu_;
  std::condition_variable idle_;
  std::vector<Slot> slots_;
  std::vector<std::uint32_t> free_slots_;
  std::uint32_t in_flight_wrs_ = 0;
  // Completions the poller reaped but has not delivered yet (it delivers outside mu_):
  // abort() waits for them, since the engine may free a sink as soon as abort returns.
  std::uint64_t undelivered_ = 0;
  std::deque<Op> pending_;
  Status broken_;                                            // set once the connection failed
  std::vector<std::pair<CompletionSink*, Status>> aborted_;  // sinks being aborted and why
  bool stopping_ = false;
  bool peer_closed_ = false;  // control_ hung up: the poller stops watching it
  std::thread poller_;
};

// One endpoint over several lanes (one per device pair): ops go to the lane the engine
// chose (op.lane, modulo the lanes) or, for memory that prefers some devices (GPU memory),
// to the lanes on those devices (pick_lane); keys and leases are made on every lane.
std::shared_ptr<Endpoint> make_striped_endpoint(std::vector<std::shared_ptr<VerbsEndpoint>> lanes);

}  // namespace kvstash::transport::verbs

// kvstash/engine.h: the point-to-point transfer engine.
//
// One Engine per process owns the transports built into this binary (shm, tcp, ucx, ...),
// registers memory with each, publishes one address blob for peers, connects to a peer by
// its blob over the best transport both sides share, and runs batches of one-sided
// READ/WRITE between registered local memory and a peer's registered memory.
//
//   auto engine = Engine::create({}).value();
//   auto mem = engine->register_memory(buffer.region(), Access::kRemote).value();
//   publish(engine->address(), mem.remote_key());        // out of band: Redis, a pipe, ...
//   auto peer = engine->connect(peer_address, deadline).value();
//   auto remote = peer->import_key(peer_key, deadline).value();
//   TransferEntry e{TransferOp::kWrite, &mem, buffer.data(), remote.base(), &remote, n};
//   auto batch = peer->submit({&e, 1}, deadline).value();
//   Status s = batch.wait();
//
// Thread safety: Engine, Peer and RemoteMemory are safe to use from many threads at once
// (submit from several threads is the expected use). A MemoryHandle must outlive every
// batch that uses it; a Batch is one caller's handle (move it, don't share it).
// Lifetimes: Peers, handles and batches must not outlive the Engine that made them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/memory.h"
#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash {

namespace transport {
class Transport;
class LocalRegistration;
class RemoteKey;
}  // namespace transport

struct TcpOptions {
  // host:port the engine serves one-sided requests on. Port 0 picks a free port. Loopback
  // by default: serving the LAN is the operator's explicit choice.
  std::string listen = "127.0.0.1:0";
  // Address peers should connect to, when it differs from `listen` (0.0.0.0, NAT). Empty:
  // the listening address.
  std::string advertise;
  // Parallel TCP connections per peer; a large transfer is striped across them.
  std::uint32_t streams = 4;
  // Threads running the socket I/O (both the serving and the initiating side).
  std::uint32_t io_threads = 2;
  // Transfers longer than this are cut into slices spread over the streams (512 KiB: a
  // 1 MiB transfer already uses two streams; measured in docs/benchmarks.md).
  std::size_t slice_bytes = 512u << 10;
  // A target drops a connection whose request payload does not move for this long, so a
  // stalled initiator cannot hold a region (and its deregistration) hostage.
  std::chrono::milliseconds io_timeout{30000};
  // A target drops a connection that sent no request for this long; initiators connect again
  // when they next need one.
  std::chrono::milliseconds idle_timeout{300000};
  // A target serves at most this many connections in all, and this many from one peer
  // address; more are closed as soon as they are accepted, so neither an unauthenticated
  // flood nor one client can take every file descriptor. Each initiator opens `streams`.
  std::uint32_t max_connections = 1024;
  std::uint32_t max_connections_per_peer = 256;
};

struct ShmOptions {
  // Directory of the UNIX socket peers fetch region file descriptors from; created 0700.
  // Empty: $XDG_RUNTIME_DIR/kvstash, else /tmp/kvstash-<uid>.
  std::string socket_dir;
  // Threads copying bytes; a large transfer is split over them.
  std::uint32_t copy_threads = 2;
  // Transfers longer than this are split over the copy threads.
  std::size_t slice_bytes = 4u << 20;
  // A batch whose ops are all at most this long is copied by the submitting thread:
  // handing it to a copy thread and back costs more than the copy.
  std::size_t inline_bytes = 2u << 20;
};

struct UcxOptions {
  // Run UCP progress on a dedicated thread (true) or from the thread that waits (false).
  bool progress_thread = true;
  // Optional UCX_TLS-style transport list for this context ("" = UCX's default choice).
  std::string transports;
  // Without RDMA hardware UCX 1.13 emulates put/get over TCP and checks no remote key: a
  // connected peer could write anywhere in this process. Regions are then registered for
  // local use only unless this is set (tests and benchmarks on machines without RDMA).
  bool allow_emulated_rma = false;
};

struct VerbsOptions {
  // RDMA devices to use ("mlx5_0"); empty: KVSTASH_RDMA_DEVICES, else every device with an
  // active port. A connection gets one queue pair (lane) per device that reaches the peer,
  // paired rail by rail (our i-th device with the peer's i-th), and stripes large ops over
  // them.
  std::vector<std::string> devices;
  // At most this many devices (0: all), those on the NUMA node of the thread that creates
  // the engine first.
  std::size_t max_devices = 0;
  // With several devices, ops longer than this are cut into slices spread over the lanes.
  std::size_t stripe_bytes = 1u << 20;
  // host:port of the TCP listener that sets up queue pairs (the bytes themselves go over
  // RDMA). Port 0 picks a free port. Loopback by default, like tcp.
  std::string listen = "127.0.0.1:0";
  // Address peers should connect to for queue-pair setup, when it differs from `listen`.
  std::string advertise;
  // The setup listener serves every connection at once. A connection that has not finished
  // the handshake (hellos and the cluster token) this long after it was accepted is closed,
  // so silent or slow clients cost a socket for at most this long and delay no one else.
  std::chrono::milliseconds handshake_timeout{2000};
  // Once a queue pair is up, a lease message must arrive whole, and its answer be taken,
  // within this from its first byte; else the connection (and its leases) is dropped.
  std::chrono::milliseconds message_timeout{2000};
  // The listener keeps at most this many setup connections in all, and this many from one
  // peer address, handshakes included; more are closed as soon as they are accepted. Each
  // connection that is up holds a queue pair; an engine opens one per device pair to a peer.
  std::uint32_t max_connections = 1024;
  std::uint32_t max_connections_per_peer = 256;
  // Work requests in flight per connection; more wait in a queue inside the transport.
  std::uint32_t send_queue_depth = 256;
  // RDMA READs in flight per connection (bounded by the device's max_qp_rd_atom).
  std::uint32_t max_rd_atomic = 16;
  // A dead peer fails requests after about 4.096 us x 2^retry_timeout x retry_count (default
  // ~0.5 s); closing the setup connection fails them at once.
  std::uint32_t retry_timeout = 14;
  std::uint32_t retry_count = 7;
  // Revocable keys for regions registered Access::kLeased: each lease binds a type-2 memory
  // window per range, and the region's own key grants nothing remote. Used where the device
  // has type-2 windows; false (or a device without them) exposes such regions whole through
  // their key, and the store's generation fencing is the guard.
  bool memory_windows = true;
  // Registers MemoryKind::kCuda regions with ibv_reg_mr on their address where neither
  // dma-buf nor nvidia-peermem can (as nvidia-peermem would): only for device memory mapped
  // into this process, the tests' device stand-in (tests/device_standin.h). Off, GPU memory
  // the driver cannot export is refused, and the KV-cache layer stages it.
  bool device_memory_by_address = false;
  // Register host memory with on-demand paging (not pinned; the NIC faults pages in). Where
  // the device cannot do ODP for RC READ and WRITE, registration fails with kUnsupported.
  bool on_demand_paging = false;
};

struct EngineOptions {
  // Transports to start, in no particular order; empty: every one built in that starts here.
  std::vector<TransportKind> transports;
  // Force one transport for every peer (when both sides have it) instead of the automatic
  // choice: shm on the same host, then RDMA-capable verbs/UCX, then tcp, then UCX over TCP.
  std::optional<TransportKind> prefer;
  // Deadline for connect() and import_key() when the caller gives none.
  std::chrono::milliseconds control_timeout{5000};
  // Shared cluster secret. When set, both sides of every tcp connection and every verbs
  // queue-pair setup prove they know it (HMAC-SHA256 challenge-response; the token itself
  // never crosses the wire). UCX cannot prove it, so UCX does not start while one is set.
  // shm needs none: its peers are processes of this user on this host.
  std::string cluster_token;
  TcpOptions tcp;
  ShmOptions shm;
  UcxOptions ucx;
  VerbsOptions verbs;
};

enum class Access : std::uint8_t {
  kLocal,   // source or destination of this process's own transfers only
  kRemote,  // peers holding the remote key may also READ and WRITE it
  // Peers reach it only through leases (Peer::lease), which this process can fence
  // (Engine::fence) and peers can revoke with confirmation (Peer::revoke): tcp checks the
  // lease on every request, verbs binds a memory window per leased range (the region's own
  // rkey grants nothing remote), shm checks it before every copy. UCX has no leases and
  // serves such a region only with UcxOptions::allow_emulated_rma (tests), unfenced. Memory
  // nodes register their pools this way.
  kLeased,
};

// What Peer::lease asks of the peer.
struct LeaseOptions {
  TransferOp op = TransferOp::kRead;
  // The lease ends after this long by the peer's clock (at most 10 minutes).
  std::chrono::milliseconds ttl{1000};
  // The owner's fence tag: the lease dies once the owner has fenced through a value at least
  // this large (Engine::fence), and the owner refuses to grant one it has fenced already. A
  // memory node's leases carry the Redis deadline (ms) of the put or read lease they serve,
  // so that a node fenced past it has no write of that put left to land. 0: never fenced by
  // tag (only by ttl, revoke or deregistration).
  std::uint64_t fence = 0;
  // For asking the peer (verbs binds windows); default EngineOptions::control_timeout.
  std::optional<Deadline> deadline;
};

// A range of a peer's address space, inside a region it registered.
struct RemoteRange {
  std::uint64_t addr = 0;
  std::uint64_t length = 0;
};

// The most ranges one Peer::lease may carry (one message to the peer).
inline constexpr std::size_t kMaxLeaseRanges = 1024;

class Engine;
class Peer;

// One monotonic count a transport keeps ("remote_access_errors", "leases_granted", ...).
struct TransportCounter {
  TransportKind transport{};
  std::string name;  // snake_case, unique within the transport
  std::string help;  // one line, for /metrics
  std::uint64_t value = 0;
};

// A registration of one region with every transport of an engine. Move-only; destroying it
// deregisters (peers can no longer reach the region). Must outlive batches that use it.
class MemoryHandle {
 public:
  MemoryHandle();
  MemoryHandle(MemoryHandle&&) noexcept;
  MemoryHandle& operator=(MemoryHandle&&) noexcept;
  ~MemoryHandle();

  const MemoryRegion& region() const { return region_; }
  // The serialized remote key: what a peer passes to Peer::import_key. Empty for kLocal.
  const std::string& remote_key() const { return remote_key_; }
  // Whether [addr, addr+len) lies inside the region.
  bool covers(const void* addr, std::size_t len) const;
  // The transports that registered the region (a transport may decline one: UCX without
  // RDMA for remote access, tcp for GPU memory).
  std::vector<TransportKind> transports() const;

 private:
  friend class Engine;
  friend class Peer;
  const transport::LocalRegistration* registration(TransportKind kind) const;

  MemoryRegion region_;
  std::string remote_key_;
  std::vector<std::pair<TransportKind, std::unique_ptr<transport::LocalRegistration>>> regs_;
};

// A peer's region, imported from its remote key through one Peer.
class RemoteMemory {
 public:
  RemoteMemory();
  RemoteMemory(RemoteMemory&&) noexcept;
  RemoteMemory& operator=(RemoteMemory&&) noexcept;
  ~RemoteMemory();

  std::uint64_t base() const { return base_; }  // remote address of the region's first byte
  std::uint64_t length() const { return length_; }
  // For a lease: the ranges it grants (transfers must lie inside one of them), and whether
  // the peer revokes it by itself (a revocable key: a request after expiry or release fails
  // with kPermissionDenied at the peer) or it is only checked here. Empty / false for a
  // region imported by Peer::import_key.
  std::span<const RemoteRange> ranges() const;
  bool revocable() const;

 private:
  friend class Peer;
  struct State;
  std::uint64_t base_ = 0;
  std::uint64_t length_ = 0;
  std::shared_ptr<State> state_;
};

struct TransferEntry {
  TransferOp op = TransferOp::kRead;
  const MemoryHandle* local = nullptr;  // registration covering [local_addr, +length)
  void* local_addr = nullptr;
  std::uint64_t remote_addr = 0;         // inside remote's [base, base + length)
  const RemoteMemory* remote = nullptr;  // imported through the Peer that submits
  std::size_t length = 0;
};

// A submitted batch. wait() or poll() until done; statuses() then holds one Status per
// entry. Destroying an unfinished batch cancels it and waits for its ops to stop.
class Batch {
 public:
  Batch();
  Batch(Batch&&) noexcept;
  Batch& operator=(Batch&&) noexcept;
  ~Batch();

  // True once every entry has completed. Cancels the batch when its deadline has passed.
  bool poll();
  // Blocks until every entry completed, or until the batch's deadline (then the rest is
  // cancelled and ends with kTimeout). Returns OK or the first entry's error.
  Status wait();
  // Ends every unfinished entry with kCancelled; returns when none can touch memory.
  void cancel();
  // One status per entry, in submission order. Valid once poll() or wait() said done.
  std::span<const Status> statuses() const;

 private:
  friend class Peer;
  struct State;
  std::shared_ptr<State> state_;
};

// A connection to one peer engine. Reconnects by itself after the transport broke.
class Peer {
 public:
  ~Peer();
  TransportKind transport() const;
  // Whether the peer holds this connection's leases itself (tcp, shm, verbs with memory
  // windows): it refuses their ops once fenced or revoked, so a writer can be stopped at the
  // peer. False for UCX, whose leases are checked on this side only.
  bool leases() const;
  // Whether lease() and revoke() ask the peer (verbs binds memory windows there): a round
  // trip and the peer's CPU each. False where a lease is made here (tcp, shm, UCX).
  bool lease_asks_peer() const;

  // Imports a remote key the peer's MemoryHandle::remote_key() produced.
  // Errors: kInvalidArgument (malformed), kPermissionDenied (peer refused the key),
  // kUnsupported (the key has no part for this peer's transport), kUnavailable, kTimeout.
  Result<RemoteMemory> import_key(std::string_view remote_key, std::optional<Deadline> deadline = {});

  // Leases `ranges` of `region` (imported through this peer) for `options.op` during
  // `options.ttl`. The ranges and the op are checked here before anything moves, and again
  // by the peer where it takes part: tcp checks the lease on every request, verbs binds one
  // memory window per range to this connection, shm checks it before every copy. The lease
  // dies when the ttl has passed by the peer's clock, when the peer fenced through
  // `options.fence`, when it is revoked, or when the returned RemoteMemory is destroyed (a
  // reconnect leases again for what is left of the ttl). A transport without leases (UCX)
  // narrows the region's key here only (revocable() false). Errors: kInvalidArgument (a
  // range outside the region, empty or too many ranges, ttl <= 0), kPermissionDenied (the
  // peer refused), kStale (the peer fenced the tag already), kNoSpace (the peer is out of
  // windows), kUnavailable, kTimeout.
  Result<RemoteMemory> lease(const RemoteMemory& region, std::span<const RemoteRange> ranges,
                             const LeaseOptions& options);

  // Ends `lease` (made by this peer's lease()) at the peer, and returns OK only once the peer
  // has confirmed that no op under it can touch the peer's memory any more: ops still queued
  // or in flight, on this connection or on one that broke, are refused from then on. Call it
  // after the batches using the lease were cancelled or finished. Blocks up to `deadline`.
  // Errors: kUnavailable or kTimeout when the peer could not confirm (dead, stopped,
  // unreachable): ops under the lease may then still land until the peer fences through its
  // tag; kUnsupported when the transport has no leases (UCX); kInvalidArgument for a
  // RemoteMemory that is not a lease of this peer.
  Status revoke(const RemoteMemory& lease, Deadline deadline);

  // Starts the entries as one batch with `deadline`. Entries are checked first: a local
  // range outside its handle or a remote range outside its key fails with
  // kInvalidArgument before anything moves (the Result's status), as does an empty batch.
  // Never blocks on the network. Thread-safe.
  Result<Batch> submit(std::span<const TransferEntry> entries, Deadline deadline);

  // Convenience: submit and wait.
  Status transfer(std::span<const TransferEntry> entries, Deadline deadline);

 private:
  friend class Engine;
  friend struct RemoteMemory::State;
  struct State;
  explicit Peer(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

class Engine {
 public:
  // Starts the requested transports. A transport that cannot start here (no UCX device,
  // no socket dir) is left out with a warning unless it was asked for by name, in which case
  // create fails with its error.
  static Result<std::unique_ptr<Engine>> create(const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Serialized addresses of every transport; what peers pass to connect(). Hex text form
  // through address_text().
  const std::string& address() const { return address_; }
  std::vector<TransportKind> transports() const;
  // Every transport's counters (see Transport::counters), for metrics and diagnostics.
  std::vector<TransportCounter> counters() const;

  // Ends every lease peers hold on this process's memory with a fence tag <= `through`, and
  // refuses such leases from now on (tags only move up: a lower value than before fences
  // nothing new). Returns once no op under them can touch this process's memory, except on
  // shm, whose copies peers run themselves: they check the fence before each copy, so one
  // that began before this call may still be finishing (a copy takes milliseconds; a memory
  // node reports a fence to the cell one heartbeat after making it). Thread-safe.
  void fence(std::uint64_t through);

  // Registers a region with every transport (that can take it). Errors: kInvalidArgument
  // (null or empty region), or the first transport's error when none could register it.
  Result<MemoryHandle> register_memory(const MemoryRegion& region, Access access);

  // Connects to a peer by its address blob. With `force`, only that transport is tried; with
  // `require_leases`, only transports whose leases the peer holds and fences (Peer::leases).
  // Errors: kInvalidArgument (malformed blob), kUnsupported (no transport in common),
  // kUnavailable, kPermissionDenied, kTimeout.
  Result<std::unique_ptr<Peer>> connect(std::string_view peer_address, std::optional<Deadline> deadline = {},
                                        std::optional<TransportKind> force = {}, bool require_leases = false);

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::string address_;
};

// Text forms for pipes, files and command lines (hex of the binary blob).
std::string to_text(std::string_view blob);
Result<std::string> from_text(std::string_view text);

}  // namespace kvstash

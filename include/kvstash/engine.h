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

#include "kvstash/grant.h"
#include "kvstash/memory.h"
#include "kvstash/status.h"
#include "kvstash/transfer.h"
#include "kvstash/types.h"

namespace kvstash {

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
  // The peer's grant for these ranges (kvstash/grant.h), presented to the peer with the lease
  // where the peer checks grants: a memory node's comes from its cell's metadata plane
  // (metadata::Placement), a KvExport's from the export. Empty: none (the peer then serves
  // the lease only if it checks no grants).
  std::string grant;
  // For asking the peer (verbs binds windows); default EngineOptions::control_timeout.
  std::optional<Deadline> deadline;
};

class Engine;
class Peer;

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
  struct Registrations;  // the region as each transport that took it registered it

  MemoryRegion region_;
  std::string remote_key_;
  std::unique_ptr<Registrations> regs_;
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
  // A write's, where the Peer digests writes (Peer::digests_writes): the 4 KiB block digest
  // of each block of [local_addr, +length) goes here as the bytes move (common/checksum.h;
  // the last may be short), valid once the entry completed OK. Ignored elsewhere.
  std::uint64_t* block_digests = nullptr;
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
  // Whether a write entry's block_digests are filled as its bytes move (shm copies them).
  bool digests_writes() const;

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

  // From now on peers' leases on this process's leased regions are served only under grants
  // `check` accepts (kvstash/grant.h), on the transports that hold leases at the target (tcp
  // checks every request against the grant's ranges, verbs binds windows only over them).
  // shm peers of this host and user map the region themselves and UCX has no leases: neither
  // can be confined to a grant (docs/operations.md, "Threat model"). Null: leases need no
  // grant. Thread-safe.
  void set_grant_check(std::shared_ptr<const GrantCheck> check);

  // Registers a region with every transport (that can take it), or with only those in `only`
  // (empty: every one) for memory used once through peers of known transports, which every
  // other transport would register in vain (verbs pins the pages and asks the NIC). Errors:
  // kInvalidArgument (null or empty region), the first transport's error when none could
  // register it, kUnsupported when none of `only` runs here.
  Result<MemoryHandle> register_memory(const MemoryRegion& region, Access access,
                                       std::span<const TransportKind> only = {});

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

// What every transport finds on this host, without starting one (`kvstash doctor`): each
// transport built into this binary reports its library, devices and what stops it, with the
// fix; a kind this build lacks gets one kInfo line saying so. Blocks while transports query
// their devices (milliseconds). Thread-safe.
std::vector<TransportFinding> probe_transports();

// Text forms for pipes, files and command lines (hex of the binary blob).
std::string to_text(std::string_view blob);
Result<std::string> from_text(std::string_view text);

}  // namespace kvstash

// The transport interface: what the engine needs from shm, tcp, ucx and verbs.
//
// Control path (Transport): describe capabilities, publish a local address, register memory,
// connect to a peer. Datapath (Endpoint::post): post one-sided READ/WRITE ops that complete
// asynchronously through a CompletionSink. A transport never special-cases another; the
// engine chooses between them through capabilities() and can_reach().
//
// Internal header: only src/engine and the transports include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/grant.h"
#include "kvstash/memory.h"
#include "kvstash/status.h"
#include "kvstash/transfer.h"
#include "kvstash/types.h"

namespace kvstash::transport {

struct Capabilities {
  // Only peers on this host can be reached (shm).
  bool same_host_only = false;
  // Bytes move without the target's CPU (shared memory, RDMA). False where a target thread
  // serves requests (tcp, UCX emulating RMA over active messages).
  bool one_sided = false;
  // Reaches RDMA hardware (verbs, UCX over rc/dc/ud).
  bool rdma = false;
  // Can register MemoryKind::kCuda regions.
  bool cuda_memory = false;
  // Holds leases at the target (Endpoint::lease_key, revoke, Transport::fence), so that a
  // writer can be stopped there. False where leases are only checked by the initiator.
  bool leases = false;
  // Leasing and revoking ask the target (verbs binds memory windows): a round trip and the
  // target's CPU. False where a lease is made here and travels with the requests (tcp, shm).
  bool lease_asks_target = false;
  // Independent lanes (streams, copy threads, QPs) the engine may stripe a large op across.
  std::uint32_t lanes = 1;
  // The engine splits an op longer than this into slices spread over the lanes (0: never).
  std::size_t slice_bytes = 0;
  // Computes a write's 4 KiB block digests (Op::digests) as it copies the bytes (shm): the
  // writer's checksum costs no second pass over them.
  bool digests_writes = false;
};

// Receives completions. Implemented by the engine's batches. Transports call complete()
// exactly once per posted op, from any thread, also for ops that fail or are aborted.
class CompletionSink {
 public:
  virtual void complete(std::uint32_t tag, Status status) = 0;

 protected:
  ~CompletionSink() = default;
};

// A region registered with one transport. Destroying it deregisters: ops that start
// afterwards can no longer reach the region (an op already moving bytes may finish). What a
// key exposes beyond its region is the transport's to document: shm hands peers of the same
// uid the whole file behind the region; UCX emulating RMA over TCP checks no key at all.
class LocalRegistration {
 public:
  virtual ~LocalRegistration() = default;
  // Bytes a peer passes to Endpoint::import_key; empty when the region was registered for
  // local use only or this transport cannot expose it.
  virtual std::string packed_key() const = 0;
};

// A peer's key, unpacked for one endpoint. [base, base + length) is the remote range it
// grants, in the peer's address space.
class RemoteKey {
 public:
  virtual ~RemoteKey() = default;
  std::uint64_t base = 0;
  std::uint64_t length = 0;
};

// A lease's terms as the engine hands them to a transport (Peer::lease).
struct LeaseTerms {
  // Chosen by the engine at random, and the same on every connection the lease is used
  // through (a reconnect leases again under it), so the peer can revoke it everywhere.
  std::uint64_t id = 0;
  TransferOp op = TransferOp::kRead;
  std::chrono::milliseconds ttl{0};
  std::uint64_t fence = 0;  // the owner's fence tag; 0: none
  // What the owner granted (LeaseOptions::grant), shared by every key made under the lease;
  // empty: none. A transport whose target holds leases presents it there.
  std::shared_ptr<const std::string> grant;
};

struct Op {
  TransferOp op = TransferOp::kRead;
  std::byte* local = nullptr;                    // source of a write, destination of a read
  const LocalRegistration* local_reg = nullptr;  // covers [local, local+length), or nullptr
  std::uint64_t remote_addr = 0;                 // in the peer's address space
  const RemoteKey* remote_key = nullptr;         // imported through the same endpoint
  std::size_t length = 0;
  std::uint32_t lane = 0;          // < capabilities().lanes
  CompletionSink* sink = nullptr;  // required
  std::uint32_t tag = 0;           // passed back to sink->complete()
  // A write's: where the block digest of each 4 KiB of [local, local + length) goes (the
  // last block may be short), or null. Only where capabilities().digests_writes.
  std::uint64_t* digests = nullptr;
};

// A connection to one peer through one transport. Thread-safe.
class Endpoint {
 public:
  virtual ~Endpoint() = default;

  // Unpacks a key the peer's LocalRegistration::packed_key() produced, granting
  // [base, base + length). Errors: kInvalidArgument for malformed bytes, kPermissionDenied
  // when the peer refuses the key, kUnavailable when the peer is gone. May block up to the
  // deadline (shm asks the peer for the region's file descriptor).
  virtual Result<std::unique_ptr<RemoteKey>> import_key(std::uint64_t base, std::uint64_t length,
                                                        std::string_view packed, Deadline deadline) = 0;

  // A key over exactly `ranges` of the region `region` grants, on `terms` (op, ttl by the
  // peer's clock, the peer's fence tag), usable through this endpoint only, that the peer
  // checks and can fence (Transport::fence) and revoke (revoke()). It also stops working when destroyed and
  // with the connection. kUnsupported where this transport has no leases (the engine then narrows the
  // region's key itself). Other errors as import_key, plus kNoSpace and kStale (the peer fenced `fence`
  // already).
  virtual Result<std::unique_ptr<RemoteKey>> lease_key(const RemoteKey& region,
                                                       std::span<const RemoteRange> ranges,
                                                       const LeaseTerms& terms, Deadline deadline) {
    (void)region, (void)ranges, (void)terms, (void)deadline;
    return Status::unsupported("this transport has no leases");
  }

  // Ends lease `terms.id` at the peer (`key` is the one lease_key() made for it through this
  // endpoint) and returns OK once the peer confirmed that no op under it can touch the
  // peer's memory any more, including ops of it still in flight on a connection that broke.
  // The caller has ended the batches that used it. Blocks up to the deadline.
  // kUnavailable/kTimeout when the peer cannot confirm; kUnsupported without leases.
  virtual Status revoke(const RemoteKey& key, const LeaseTerms& terms, Deadline deadline) {
    (void)key, (void)terms, (void)deadline;
    return Status::unsupported("this transport has no leases");
  }

  // Datapath: starts every op; never blocks on the network. Each op completes exactly once
  // through op.sink, possibly before post() returns. The engine has checked ranges against
  // the keys; the target (where a target takes part) checks them again.
  virtual void post(std::span<const Op> ops) = 0;

  // Completes every op of `sink` that has not completed yet (with `reason`), and returns only
  // when none of them can touch local memory any more. May break the connection for ops of
  // other sinks (they complete with kUnavailable) when the transport cannot stop one
  // in-flight op alone; healthy() is then false.
  virtual void abort(CompletionSink* sink, const Status& reason) = 0;

  // False once the peer is known dead or the connection broke; the engine reconnects.
  virtual bool healthy() const = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // What this transport has counted since it started (connections, errors by kind, leases):
  // monotonic, for /metrics and `kvstash doctor`. Empty where it counts nothing.
  virtual std::vector<TransportCounter> counters() const { return {}; }

  // The target side of Engine::fence: ends every lease of this process's regions whose
  // fence tag is <= `through` and refuses such leases from now on; returns once no op under
  // them can touch our memory (shm: once peers' copies that start from now on see it).
  // Nothing to do where the transport has no leases.
  virtual void fence(std::uint64_t through) { (void)through; }

  // The target side of Engine::set_grant_check: from now on a lease on this process's leased
  // regions is served only under a grant `check` accepts, over the grant's ranges, for its op,
  // with its deadline as the fence tag. Null: leases need no grant. A transport whose leases
  // cannot be checked at the target (shm: peers copy themselves; UCX: none) ignores it and
  // says so in its documentation.
  virtual void set_grant_check(std::shared_ptr<const GrantCheck> check) { (void)check; }

  virtual TransportKind kind() const = 0;
  virtual Capabilities capabilities() const = 0;

  // This transport's part of the engine's address blob: what a peer passes to connect().
  virtual std::string local_address() const = 0;

  // Whether connect() to this address may succeed from here (shm: same host and user).
  // Cheap, no I/O; false for malformed addresses.
  virtual bool can_reach(std::string_view peer_address) const = 0;

  // Registers [region.addr, +length). With Access::kRemote peers may READ and WRITE it
  // through the packed key; with kLeased only through Endpoint::lease_key where this
  // transport has revocable keys (elsewhere kLeased is kRemote). Errors: kUnsupported (e.g.
  // shm and a region without fd, or a memory kind this transport cannot reach),
  // kInvalidArgument, kNoSpace.
  virtual Result<std::unique_ptr<LocalRegistration>> register_memory(const MemoryRegion& region,
                                                                     Access access) = 0;

  // Connects to a peer. Errors: kInvalidArgument (malformed address), kUnavailable
  // (unreachable), kPermissionDenied (handshake refused), kTimeout.
  virtual Result<std::shared_ptr<Endpoint>> connect(std::string_view peer_address, Deadline deadline) = 0;
};

}  // namespace kvstash::transport

// Internals of the shm transport, shared by its control path (shm_transport.cc, with the
// server in shm_server.cc and the key registry in shm_registry.cc) and its datapath
// (shm_transport_datapath.cc); the codecs (shm_wire.h) and the socket helpers (shm_socket.h)
// come with it. Nothing outside src/transport/shm/ includes this, except
// shm_transport_test.cc, which crafts foreign addresses with encode_address(), and the shm
// fuzz targets.
//
// How it works, in one paragraph: every transport runs a server thread on a UNIX
// SOCK_SEQPACKET socket in a private directory. A peer connects (both sides check the other's
// uid with SO_PEERCRED), says hello and receives the "key table": a small sealed memfd of
// 64-bit slots that it maps read-only. A remote-access registration takes a slot and writes a
// random key into it; its packed key names (slot, key). To import a key, the peer asks the
// server for the region's file descriptor (SCM_RIGHTS) and maps it MAP_SHARED. From then on
// a READ or WRITE is a memcpy on the initiator's own copy thread, preceded by an acquire load
// of the slot (revocation) and a zero-timeout poll of the socket (peer death).
//
// Leases: a region registered Access::kLeased is reached only through lease keys (made on
// this side, no round trip) that carry the owner's fence tag; slot 1 of the table holds what
// the owner has fenced through (Transport::fence), and each copy under a lease first checks
// that its tag lies above it. Copies are the initiator's own, so the owner cannot wait for
// one in progress: a copy takes milliseconds, and a memory node reports a fence to the cell
// one heartbeat after making it.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "kvstash/status.h"
#include "kvstash/transfer.h"
#include "transport/shm/shm_socket.h"
#include "transport/shm/shm_wire.h"
#include "transport/transport.h"

namespace kvstash::transport::shm {

// ---- RAII for mappings (descriptors are UniqueFd, common/fd.h) ----------------------------------

class Mapping {
 public:
  Mapping() = default;
  Mapping(void* addr, std::size_t length) : addr_(addr), length_(length) {}
  Mapping(Mapping&& o) noexcept
      : addr_(std::exchange(o.addr_, nullptr)), length_(std::exchange(o.length_, 0)) {}
  Mapping& operator=(Mapping&& o) noexcept {
    if (this != &o) {
      reset();
      addr_ = std::exchange(o.addr_, nullptr);
      length_ = std::exchange(o.length_, 0);
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { reset(); }

  std::byte* data() const { return static_cast<std::byte*>(addr_); }
  std::size_t size() const { return length_; }
  void reset();

 private:
  void* addr_ = nullptr;
  std::size_t length_ = 0;
};

// Acquire load of a key-table slot. The peer's table is mapped read-only, and
// std::atomic_ref needs a non-const object, hence the builtin (a plain load on x86/arm64).
inline std::uint64_t load_slot(const std::uint64_t* slot) { return __atomic_load_n(slot, __ATOMIC_ACQUIRE); }

// ---- initiator side: one connection to a peer ----------------------------------------------

// Shared by the endpoint and every region imported through it, so a queued op keeps the
// socket and the peer's key table alive even if the endpoint goes first.
struct PeerConnection {
  UniqueFd socket;
  Mapping key_table;  // the peer's, read-only
  std::uint32_t slots = 0;
  std::string peer;  // socket path, for messages
  std::atomic<bool> healthy{true};

  // Serializes request/response exchanges (import_key from several threads): one
  // exchange at a time holds `request_busy`, the others wait for it up to their deadline.
  // (A flag and a condvar rather than std::timed_mutex, which TSan cannot follow.)
  std::mutex request_mu;
  std::condition_variable request_cv;
  bool request_busy = false;       // guarded by request_mu
  std::uint64_t next_request = 1;  // guarded by request_busy

  const std::uint64_t* slot(std::uint32_t i) const {
    return reinterpret_cast<const std::uint64_t*>(key_table.data()) + i;
  }
  // True once the peer hung up (its process died or its transport closed); cheap: one
  // zero-timeout poll. Marks the connection unhealthy.
  bool gone();
};

// A peer's region mapped into this process: [base, base + length) in the peer's address
// space is [data, data + length) here.
struct RemoteRegion {
  std::shared_ptr<PeerConnection> conn;
  Mapping mapping;
  std::byte* data = nullptr;
  std::uint64_t base = 0;
  std::uint64_t length = 0;
  std::uint32_t slot = 0;
  std::uint64_t key = 0;
  bool leased = false;  // the owner registered it Access::kLeased
};

// A region's key, or a lease over it (lease != 0) with the owner's fence tag.
class ShmRemoteKey final : public RemoteKey {
 public:
  explicit ShmRemoteKey(std::shared_ptr<const RemoteRegion> region, std::uint64_t lease = 0,
                        std::uint64_t fence = 0)
      : region_(std::move(region)), lease_(lease), fence_(fence) {
    base = region_->base;
    length = region_->length;
  }
  const std::shared_ptr<const RemoteRegion>& region() const { return region_; }
  std::uint64_t lease() const { return lease_; }
  std::uint64_t fence() const { return fence_; }
  // Copies that have not started are refused from now on (Endpoint::revoke).
  void revoke() const { revoked_.store(true, std::memory_order_seq_cst); }
  bool revoked() const { return revoked_.load(std::memory_order_seq_cst); }

 private:
  std::shared_ptr<const RemoteRegion> region_;
  std::uint64_t lease_;
  std::uint64_t fence_;
  mutable std::atomic<bool> revoked_{false};
};

// ---- datapath: copy lanes ------------------------------------------------------------------

// One worker thread and a FIFO per lane. The queue lock is taken once per batch by post()
// and once per op by the worker, never during a copy.
class Datapath {
 public:
  // Ops of at most `inline_bytes` are copied on the posting thread (no hand-off latency).
  Datapath(std::uint32_t lanes, std::size_t inline_bytes);
  ~Datapath();
  Datapath(const Datapath&) = delete;
  Datapath& operator=(const Datapath&) = delete;

  std::uint32_t lanes() const { return static_cast<std::uint32_t>(lanes_.size()); }

  // Validates and enqueues; ops that fail validation complete inline.
  void post(const PeerConnection* conn, std::span<const Op> ops);
  // See Endpoint::abort.
  void abort(CompletionSink* sink, const Status& reason);
  // Completes every queued op with kUnavailable and joins the workers; later posts complete
  // inline with kUnavailable. Idempotent.
  void stop();

 private:
  struct Job {
    Op op;
    std::shared_ptr<const RemoteRegion> region;
  };
  // A lane's FIFO: a vector and the index of its front, so that a warm lane allocates
  // nothing (a std::deque gives chunks back and takes new ones as its ends move).
  class JobQueue {
   public:
    bool empty() const { return head_ == jobs_.size(); }
    void push_back(Job job) { jobs_.push_back(std::move(job)); }
    Job pop_front() {
      Job job = std::move(jobs_[head_++]);
      if (empty()) {
        jobs_.clear();
        head_ = 0;
      } else if (head_ >= 64 && head_ * 2 >= jobs_.size()) {  // a queue that never drains
        jobs_.erase(jobs_.begin(), jobs_.begin() + static_cast<std::ptrdiff_t>(head_));
        head_ = 0;
      }
      return job;
    }
    // Moves the queued jobs `take(job)` says to `out`, in order.
    template <typename Take>
    void take_if(Take take, std::vector<Job>& out) {
      auto kept = jobs_.begin() + static_cast<std::ptrdiff_t>(head_);
      for (auto it = kept; it != jobs_.end(); ++it) {
        if (take(*it)) {
          out.push_back(std::move(*it));
        } else {
          *kept++ = std::move(*it);
        }
      }
      jobs_.erase(kept, jobs_.end());
    }

   private:
    std::vector<Job> jobs_;
    std::size_t head_ = 0;
  };
  std::size_t inline_bytes_;
  struct Lane {
    std::mutex mu;
    std::condition_variable work_cv;  // a job arrived or stop
    std::condition_variable idle_cv;  // busy_sink changed
    JobQueue queue;
    CompletionSink* busy_sink = nullptr;  // sink of the op being copied (until completed)
    bool stopping = false;
    std::thread thread;
  };

  void run(Lane& lane);
  static Status execute(const Job& job);
  // Completes `op` on the calling thread: its validation error, OK for an empty op, else the
  // copy itself when `copy`, or kUnavailable (shut down) when not.
  static void complete_here(const PeerConnection* conn, const Op& op, std::uint32_t lanes, bool copy);
  // The key the op may use (nullptr: nothing to copy), or the error to complete it with.
  static Result<const ShmRemoteKey*> validate(const PeerConnection* conn, const Op& op, std::uint32_t lanes);

  std::vector<std::unique_ptr<Lane>> lanes_;
  std::mutex stop_mu_;
  bool stopped_ = false;  // guarded by stop_mu_
};

class ShmEndpoint final : public Endpoint {
 public:
  ShmEndpoint(std::shared_ptr<PeerConnection> conn, std::shared_ptr<Datapath> datapath)
      : conn_(std::move(conn)), datapath_(std::move(datapath)) {}

  Result<std::unique_ptr<RemoteKey>> import_key(std::uint64_t base, std::uint64_t length,
                                                std::string_view packed, Deadline deadline) override;
  Result<std::unique_ptr<RemoteKey>> lease_key(const RemoteKey& region, std::span<const RemoteRange> ranges,
                                               const LeaseTerms& terms, Deadline deadline) override;
  Status revoke(const RemoteKey& key, const LeaseTerms& terms, Deadline deadline) override;
  void post(std::span<const Op> ops) override;
  void abort(CompletionSink* sink, const Status& reason) override;
  bool healthy() const override;

 private:
  std::shared_ptr<PeerConnection> conn_;
  std::shared_ptr<Datapath> datapath_;
};

}  // namespace kvstash::transport::shm

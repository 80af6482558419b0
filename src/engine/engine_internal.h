// Private to src/engine: the shared state behind Engine, Peer, RemoteMemory and Batch.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "common/turn.h"
#include "kvstash/engine.h"
#include "transport/transport.h"

namespace kvstash {

struct Engine::Impl {
  EngineOptions options;
  std::vector<std::unique_ptr<transport::Transport>> transports;
};

struct MemoryHandle::Registrations {
  std::vector<std::pair<TransportKind, std::unique_ptr<transport::LocalRegistration>>> by_kind;

  // The registration of transport `kind`, or nullptr when it declined the region.
  const transport::LocalRegistration* find(TransportKind kind) const {
    for (const auto& [k, reg] : by_kind) {
      if (k == kind) return reg.get();
    }
    return nullptr;
  }
};

struct Peer::State {
  transport::Transport* transport = nullptr;
  transport::Capabilities caps;
  std::string peer_address;  // the chosen transport's part of the peer's blob
  std::chrono::milliseconds control_timeout{};
  std::chrono::microseconds busy_poll{};

  // Guards the fields below. Never held across network I/O: a reconnect is one caller's
  // turn, and the others wait for it up to their own deadlines.
  std::mutex mu;
  Turn connecting;
  std::shared_ptr<transport::Endpoint> endpoint;  // replaced after the connection broke
  std::uint64_t generation = 0;                   // bumps with every new endpoint

  // The current endpoint, connecting anew when there is none or it broke. kTimeout when
  // another caller's connect is still running at `deadline`.
  Result<std::pair<std::shared_ptr<transport::Endpoint>, std::uint64_t>> current(Deadline deadline);

  // A batch's state for `entries` entries: one whose batch has ended, reused, or a new one.
  // A warm peer's submit allocates nothing (tests/unit/memory/alloc_test.cc).
  std::shared_ptr<Batch::State> batch_state(std::size_t entries, Deadline deadline);
  std::mutex batches_mu;
  std::vector<std::shared_ptr<Batch::State>> batches;  // the pool: at most kBatchPool
};

struct RemoteMemory::State {
  std::shared_ptr<Peer::State> peer;
  std::string packed;  // this transport's part of the key blob

  // A lease (Peer::lease) narrows `region` to `ranges` for `terms.op` until `until`.
  struct Lease {
    std::shared_ptr<State> region;
    std::uint64_t region_base = 0, region_length = 0;
    std::vector<RemoteRange> ranges;  // sorted by address, disjoint
    transport::LeaseTerms terms;      // ttl as asked; each (re)lease asks for what is left
    Clock::time_point until;
  };
  std::optional<Lease> lease;

  // Guards the fields below. Never held across network I/O (importing or leasing asks the
  // peer): that is one caller's turn, and the others wait for it up to their own deadlines.
  std::mutex mu;
  Turn making;
  bool revocable = false;            // the current key is the peer's lease
  std::uint64_t generation = ~0ull;  // endpoint generation `key` was imported through
  std::shared_ptr<transport::RemoteKey> key;

  // The key unpacked for endpoint `generation`, importing it again after a reconnect (a
  // lease asks the peer again for what is left of its time).
  Result<std::shared_ptr<transport::RemoteKey>> key_for(const std::shared_ptr<transport::Endpoint>& ep,
                                                        std::uint64_t generation, std::uint64_t base,
                                                        std::uint64_t length, Deadline deadline);
};

struct Batch::State final : transport::CompletionSink {
  State(std::size_t entries, Deadline deadline);
  // Ready for a new batch of `entries` entries (keeping its buffers when they are large
  // enough). Only while no op of the last batch can still complete.
  void reset(std::size_t entries, Deadline deadline);
  // The batch ended: what it kept alive (endpoint, keys) goes.
  void release();
  void complete(std::uint32_t tag, Status status) override;
  bool done_locked() const { return entries_left == 0; }
  void abort(const Status& reason);

  Deadline deadline;
  std::chrono::microseconds busy_poll{0};  // wait() spins this long first (EngineOptions)
  std::atomic<bool> finished{false};       // entries_left reached 0; set under mu
  std::vector<Status> statuses;
  std::unique_ptr<std::atomic<std::uint32_t>[]> parts_left;  // per entry: ops not complete
  std::size_t parts_capacity = 0;
  std::shared_ptr<transport::Endpoint> endpoint;
  std::vector<std::shared_ptr<transport::RemoteKey>> keys;  // kept alive while ops run

  mutable std::mutex mu;
  std::condition_variable cv;
  std::size_t entries_left;  // guarded by mu
};

}  // namespace kvstash

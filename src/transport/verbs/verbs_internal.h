// Private to src/transport/verbs/: the state the control path (verbs_transport.cc) and the
// datapath (verbs_transport_datapath.cc) share.
//
// Shape: one device context and protection domain per transport; per connection, on the
// initiating side, a CQ with a completion channel, an RC QP, the TCP socket that set it up
// (kept open: its hang-up is the fastest sign of a dead peer) and a poller thread that reaps
// completions in bulk. The target side holds only QPs: RDMA READ and WRITE need nothing from
// its CPU.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/net.h"
#include "kvstash/engine.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_device.h"
#include "transport/verbs/verbs_qp.h"
#include "transport/verbs/verbs_wr.h"

namespace kvstash::transport::verbs {

// The device a transport runs on. Shared by the transport and its endpoints.
struct DeviceState {
  Device device;
  Port port;
  Gid gid;
  Context ctx;
  Pd pd;
};

class Registration final : public LocalRegistration {
 public:
  Registration(Mr mr, std::uint64_t guid, bool remote) : mr_(std::move(mr)), guid_(guid), remote_(remote) {}
  std::string packed_key() const override;
  std::uint32_t lkey() const { return mr_->lkey; }

 private:
  Mr mr_;
  std::uint64_t guid_;
  bool remote_;
};

class ImportedKey final : public RemoteKey {
 public:
  std::uint32_t rkey = 0;
};

using net::Fd;

// Length-prefixed frames on the setup socket, bounded by a deadline.
Status write_frame(int fd, std::string_view bytes, Deadline deadline);
Result<std::string> read_frame(int fd, Deadline deadline);

// Completion status -> kvstash status.
Status from_wc(ibv_wc_status status);

// The initiating side of one connection: posts READ/WRITE, reaps completions.
class VerbsEndpoint final : public Endpoint {
 public:
  // Takes a connected QP (RTS) with its CQ and channel, and the setup socket.
  VerbsEndpoint(std::shared_ptr<DeviceState> dev, ibv_comp_channel* channel, Cq cq, Qp qp, Fd control,
                const VerbsOptions& options);
  ~VerbsEndpoint() override;

  Result<std::unique_ptr<RemoteKey>> import_key(std::uint64_t base, std::uint64_t length,
                                                std::string_view packed, Deadline deadline) override;
  void post(std::span<const Op> ops) override;
  void abort(CompletionSink* sink, const Status& reason) override;
  bool healthy() const override;

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

  std::shared_ptr<DeviceState> dev_;
  ibv_comp_channel* channel_;
  Cq cq_;
  Qp qp_;
  Fd control_;
  Fd wake_;  // eventfd that stops the poller
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
  std::thread poller_;
};

}  // namespace kvstash::transport::verbs

// Private to src/transport/ucx/: the shared core (UCP context + worker + the thread that owns
// them), the endpoint state the datapath works on, and the wire records.
//
// Threading: exactly one thread at a time touches UCX (context and worker). With a progress
// thread that is always the progress thread: everything else hands it closures through
// Core::submit() (asynchronous, never blocks on the network) or Core::run() (waits until the
// closure ran). Without one, the caller that takes worker_mu_ acts as the owner for the
// duration of its call; ops queued by others are run by whoever owns the worker next.
// Methods marked "owner only" must run with that ownership.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kvstash/transfer.h"
#include "transport/transport.h"

namespace kvstash::transport::ucx {

// ---- wire records -------------------------------------------------------------------------
// Both records: u16 magic, u8 version, fields, then a u64 FNV-1a hash of everything before it,
// so a truncated or bit-flipped record is refused before UCX ever parses the bytes inside
// (UCX 1.13 trusts its own packed formats and may crash on garbage).
inline constexpr std::uint16_t kAddressMagic = 0x4155;  // "UA"
inline constexpr std::uint16_t kKeyMagic = 0x4b55;      // "UK"
inline constexpr std::uint8_t kRecordVersion = 1;
// Larger than any UCX 1.13 worker address / packed rkey we have seen (~200 / ~20 bytes), small
// enough that a forged length cannot make us allocate much.
inline constexpr std::size_t kMaxBlob = 16 * 1024;

std::string encode_address(std::string_view worker_address);
// The worker address inside, or nullopt for anything malformed.
std::optional<std::string> decode_address(std::string_view record);

struct KeyRecord {
  std::uint64_t base = 0;
  std::uint64_t length = 0;
  std::string rkey;  // ucp_rkey_pack output
};
std::string encode_key(const KeyRecord& key);
std::optional<KeyRecord> decode_key(std::string_view record);

// UCX status -> kvstash status (peer/connection failures become kUnavailable).
Status from_ucs(ucs_status_t status, std::string_view what);

// The RMA lanes on RDMA transports in a ucp_ep_print_info dump ("rc_verbs/rxe0:1", several
// joined by ','), or "" when UCX emulates put/get for the endpoint (UCX 1.13 has no query).
std::string rdma_lanes_from_ep_info(std::string_view info);

// ---- core ---------------------------------------------------------------------------------
class Core;
// Marks the calling thread as `core`'s worker owner (nullptr: none); for ~Core's final passes.
void tl_owner_for_teardown(const Core* core);

class Core : public std::enable_shared_from_this<Core> {
 public:
  // Creates context + worker and, with options.progress_thread, starts the thread.
  static Result<std::shared_ptr<Core>> create(const UcxOptions& options);
  ~Core();
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  // Queues `fn` to run as worker owner, in FIFO order with everything else submitted. Never
  // blocks on the network; thread-safe. Without a progress thread it runs now if the worker
  // is free, else the current owner runs it before releasing the worker.
  void submit(std::function<void()> fn);
  // Runs `fn` as worker owner and returns after it ran (inline when already the owner).
  // Blocks only for the owner's current pass, never on the network.
  void run(const std::function<void()>& fn);
  // Waits until `done()` (which must read atomics) is true or the deadline passes, driving
  // progress when there is no progress thread. Returns done().
  bool wait_until(const std::function<bool()>& done, Deadline deadline);

  // Owner only: records a completion, delivered once UCX calls have returned (so a sink may
  // re-enter the transport).
  void defer_completion(CompletionSink* sink, std::uint32_t tag, Status status);

  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  const std::string& worker_address() const { return worker_address_; }
  bool rdma_device() const { return rdma_device_; }
  // Whether this UCX registers and moves CUDA memory (its cuda module is loaded).
  bool cuda_memory() const { return cuda_memory_; }
  bool threaded() const { return threaded_; }
  bool is_owner() const;
  // Owner only: an endpoint was closed by force; see ~Core.
  void note_forced_close() { last_forced_close_ = Clock::now(); }
  // Without a progress thread: one bounded progress pass from the calling thread, if no other
  // thread owns the worker right now. A no-op with a progress thread.
  void progress();

 private:
  struct Deleter {
    void operator()(Core* core) const;
  };
  struct Completion {
    CompletionSink* sink;
    std::uint32_t tag;
    Status status;
  };

  Core() = default;
  Status init(const UcxOptions& options);
  void thread_main();
  // Owner only: runs queued closures and progresses the worker; true if anything happened.
  bool pass();
  // Owner only: hands over the completions collected so far.
  std::vector<Completion> take_completions();
  // Tells the sinks, outside UCX calls and (without a thread) outside worker ownership.
  static void deliver(std::vector<Completion>& completions);
  // Without a thread: takes the worker if free, runs a pass (more while work is queued) and
  // delivers. True if anything happened.
  bool try_drive();
  void notify_waiters();
  void wake();

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string worker_address_;
  bool rdma_device_ = false;
  bool cuda_memory_ = false;
  bool threaded_ = true;

  std::mutex queue_mu_;
  std::vector<std::function<void()>> queue_;

  // Without a progress thread: held by whoever currently owns the worker.
  std::mutex worker_mu_;
  std::vector<Completion> completions_;  // owner only

  std::mutex wait_mu_;
  std::condition_variable wait_cv_;
  std::atomic<int> waiters_{0};

  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  Clock::time_point last_forced_close_{};  // owner only
  bool delete_on_exit_ = false;            // the last reference dropped on the progress thread itself
  int event_fd_ = -1;                      // wakes the progress thread for new work
  int ucp_efd_ = -1;                       // the worker's event fd, -1 when UCX offers none
};

// ---- endpoint state (datapath) ------------------------------------------------------------
class EpState;

// One posted op, from post() until its sink hears about it. Records live in a deque so their
// addresses stay valid as UCX user_data while the pool grows.
struct OpRecord {
  EpState* ep = nullptr;
  CompletionSink* sink = nullptr;
  std::uint32_t tag = 0;
  std::uint32_t index = 0;
  int pending = 0;  // UCX callbacks still to come (the op, plus its batch flush if a write)
  bool in_use = false;
  bool write = false;
  bool reported = false;         // the sink has been told
  Status status;                 // first error seen
  std::optional<Status> forced;  // set by abort / peer failure: what the sink will be told
};

class EpState : public std::enable_shared_from_this<EpState> {
 public:
  // `core` outlives the state: every object that can reach an EpState holds the core.
  explicit EpState(Core* core) : core_(core) {}

  // Owner only. Creates the UCP endpoint and starts the flush that proves it usable.
  Status create(std::string_view worker_address);
  // Owner only: posts ops (the datapath).
  void post_now(const std::vector<Op>& ops);
  // Owner only: starts abort of `sink`'s ops (nullptr: every op). Returns false when the sink
  // had nothing outstanding, so the connection was left alone.
  bool begin_abort(CompletionSink* sink, const Status& reason, bool force_all);
  // Owner only: closes the endpoint (graceful when healthy and idle, else forced).
  void begin_close(bool force);
  // Owner only: after the close completed, tells sinks of records UCX never completed.
  void sweep();
  // Owner only, once connected: fills one_sided and rdma_lanes from the lanes UCX chose.
  void detect_rma_lanes();

  void on_op_callback(OpRecord* rec, ucs_status_t status);
  void on_peer_failure(ucs_status_t status);

  ucp_ep_h ep() const { return ep_; }
  std::atomic<bool> healthy{true};
  std::atomic<bool> connected{false};  // the connect flush completed
  std::atomic<int> connect_status{0};  // its ucs_status_t
  std::atomic<bool> closed{false};     // no UCP endpoint left (never created, or closed)
  // Set once at connect: the RMA lanes on RDMA transports ("rc_verbs/rxe0:1"), which move
  // bytes without the peer's CPU and with keys its NIC checks; empty when UCX emulates
  // put/get with active messages that the peer's worker serves.
  std::string rdma_lanes;
  bool one_sided = false;  // !rdma_lanes.empty()

 private:
  OpRecord* alloc_record();
  void finish(OpRecord* rec);
  void release(OpRecord* rec);

  friend struct EpCallbacks;
  Core* core_;
  ucp_ep_h ep_ = nullptr;  // owner only
  bool close_pending_ = false;
  std::deque<OpRecord> records_;
  std::vector<std::uint32_t> free_;
  std::size_t in_use_ = 0;
};

// ---- interface objects --------------------------------------------------------------------
class UcxRemoteKey final : public RemoteKey {
 public:
  UcxRemoteKey(std::shared_ptr<Core> core, std::shared_ptr<EpState> ep, ucp_rkey_h rkey)
      : core_(std::move(core)), ep_(std::move(ep)), rkey_(rkey) {}
  ~UcxRemoteKey() override;
  ucp_rkey_h rkey() const { return rkey_; }
  const EpState* ep() const { return ep_.get(); }

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<EpState> ep_;
  ucp_rkey_h rkey_;
};

class UcxEndpoint final : public Endpoint {
 public:
  UcxEndpoint(std::shared_ptr<Core> core, std::shared_ptr<EpState> state)
      : core_(std::move(core)), state_(std::move(state)) {}
  ~UcxEndpoint() override;

  Result<std::unique_ptr<RemoteKey>> import_key(std::uint64_t base, std::uint64_t length,
                                                std::string_view packed, Deadline deadline) override;
  void post(std::span<const Op> ops) override;
  void abort(CompletionSink* sink, const Status& reason) override;
  bool healthy() const override { return state_->healthy.load(); }

  // Whether UCX moves bytes to this peer without its CPU, over RDMA lanes whose keys the
  // peer's NIC checks, and which lanes ("rc_verbs/rxe0:1"; empty when put/get are emulated
  // with active messages). Not part of the Transport interface, whose capabilities() cannot
  // vary by peer; the transport counts connections of each kind (counters()).
  bool one_sided() const { return state_->one_sided; }
  const std::string& rdma_lanes() const { return state_->rdma_lanes; }
  // Without a progress thread: one progress pass from the calling thread (tests, waiters).
  void progress();

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<EpState> state_;
};

}  // namespace kvstash::transport::ucx

// The ucx transport's datapath: handing ops to the worker owner, posting put/get, completing
// writes at the batch's flush, abort by force-closing, and the progress loop.
//
// Write completion: each put gets its own callback (local completion, errors), and after a
// batch of puts one ucp_ep_flush_nbx; a write is reported only when both its put and that
// flush completed, so "complete" means remotely complete. Reads complete at their callback.
#include <poll.h>
#include <unistd.h>

#include <chrono>

#include "common/log.h"
#include "transport/ucx/ucx_internal.h"

namespace kvstash::transport::ucx {
namespace {

// The core whose worker this thread owns right now (nullptr: none).
thread_local const Core* tl_owner = nullptr;

// Busy passes before the progress thread arms the worker and sleeps: a spin keeps latency
// low between back-to-back batches without burning a core when idle.
constexpr int kSpinPasses = 64;
// Bounds one pass so queued work is not starved by a worker that always has something to do.
constexpr int kMaxProgressPerPass = 64;

struct FlushBatch {
  std::vector<OpRecord*> writes;
};

}  // namespace

void tl_owner_for_teardown(const Core* core) { tl_owner = core; }

// UCX's C callbacks, befriended by EpState.
struct EpCallbacks {
  static void op_done(void* request, ucs_status_t status, void* user_data) {
    ucp_request_free(request);
    auto* rec = static_cast<OpRecord*>(user_data);
    rec->ep->on_op_callback(rec, status);
  }
  static void flush_done(void* request, ucs_status_t status, void* user_data) {
    if (request != nullptr) ucp_request_free(request);
    auto* batch = static_cast<FlushBatch*>(user_data);
    for (OpRecord* rec : batch->writes) rec->ep->on_op_callback(rec, status);
    delete batch;
  }
  static void connect_flush_done(void* request, ucs_status_t status, void* user_data) {
    if (request != nullptr) ucp_request_free(request);
    auto* ep = static_cast<EpState*>(user_data);
    ep->connect_status = status;
    ep->connected = true;
  }
  static void close_done(void* request, ucs_status_t /*status*/, void* user_data) {
    if (request != nullptr) ucp_request_free(request);
    auto* ref = static_cast<std::shared_ptr<EpState>*>(user_data);
    (*ref)->close_pending_ = false;
    (*ref)->closed = true;
    delete ref;
  }
  static void peer_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    static_cast<EpState*>(arg)->on_peer_failure(status);
  }
};

// ---- core: ownership, queue, progress --------------------------------------------------------

bool Core::is_owner() const { return tl_owner == this; }

void Core::defer_completion(CompletionSink* sink, std::uint32_t tag, Status status) {
  completions_.push_back({sink, tag, std::move(status)});
}

std::vector<Core::Completion> Core::take_completions() {
  std::vector<Completion> out;
  out.swap(completions_);
  return out;
}

void Core::deliver(std::vector<Completion>& completions) {
  for (Completion& c : completions) c.sink->complete(c.tag, std::move(c.status));
}

bool Core::pass() {
  std::vector<std::function<void()>> commands;
  {
    std::lock_guard lock(queue_mu_);
    commands.swap(queue_);
  }
  for (auto& fn : commands) fn();
  int events = 0;
  while (events < kMaxProgressPerPass && ucp_worker_progress(worker_) != 0) ++events;
  return !commands.empty() || events > 0;
}

void Core::wake() {
  std::uint64_t one = 1;
  if (write(event_fd_, &one, sizeof(one)) < 0) {
    // EAGAIN: the counter is already non-zero, so the thread wakes anyway.
  }
}

void Core::notify_waiters() {
  if (waiters_.load() == 0) return;
  std::lock_guard lock(wait_mu_);
  wait_cv_.notify_all();
}

void Core::submit(std::function<void()> fn) {
  {
    std::lock_guard lock(queue_mu_);
    queue_.push_back(std::move(fn));
  }
  if (is_owner()) return;  // the owner drains the queue before it lets go of the worker
  if (threaded_) {
    if (sleeping_.load()) wake();
    return;
  }
  try_drive();
}

bool Core::try_drive() {
  std::shared_ptr<Core> self = shared_from_this();  // a completion may drop the last reference
  bool any = false;
  for (;;) {
    if (!worker_mu_.try_lock()) return any;  // the owner will run what is queued
    tl_owner = this;
    bool did = pass();
    std::vector<Completion> done = take_completions();
    tl_owner = nullptr;
    worker_mu_.unlock();
    deliver(done);
    any = any || did || !done.empty();
    std::lock_guard lock(queue_mu_);
    if (queue_.empty()) return any;
  }
}

void Core::progress() {
  if (!threaded_ && !is_owner()) try_drive();
}

void Core::run(const std::function<void()>& fn) {
  if (is_owner()) {
    fn();
    return;
  }
  if (!threaded_) {
    std::shared_ptr<Core> self = shared_from_this();
    std::vector<Completion> done;
    {
      std::lock_guard lock(worker_mu_);
      tl_owner = this;
      pass();  // what was queued before us runs first, as with a progress thread
      fn();
      pass();
      done = take_completions();
      tl_owner = nullptr;
    }
    deliver(done);
    return;
  }
  std::atomic<bool> ran{false};
  submit([&] {
    fn();
    // Completions `fn` produced (abort's sweep, for one) reach their sinks before the caller
    // resumes, as they do without a progress thread: abort() promises that every op of the
    // sink has completed when it returns. Safe here: we own the worker, outside UCX calls.
    std::vector<Completion> done = take_completions();
    deliver(done);
    ran = true;
  });
  wait_until([&] { return ran.load(); }, Deadline::max());
}

bool Core::wait_until(const std::function<bool()>& done, Deadline deadline) {
  using namespace std::chrono_literals;
  if (!threaded_ || is_owner()) {
    // Nobody else progresses for us (no thread, or we are the thread, inside a completion).
    while (!done()) {
      if (Clock::now() >= deadline) return done();
      bool did = false;
      if (is_owner()) {
        did = pass();
        std::vector<Completion> c = take_completions();
        deliver(c);
        did = did || !c.empty();
      } else {
        did = try_drive();
      }
      if (!did) std::this_thread::yield();
    }
    return true;
  }
  waiters_.fetch_add(1);
  std::unique_lock lock(wait_mu_);
  while (!done()) {
    Deadline now = Clock::now();
    if (now >= deadline) break;
    // Bounded waits: Deadline::max() would overflow inside wait_until.
    wait_cv_.wait_until(lock, std::min(deadline, now + 50ms));
  }
  waiters_.fetch_sub(1);
  return done();
}

void Core::thread_main() {
  tl_owner = this;
  int idle = 0;
  while (!stop_.load()) {
    bool did = pass();
    std::vector<Completion> done = take_completions();
    deliver(done);
    if (did || !done.empty()) {
      notify_waiters();
      idle = 0;
      continue;
    }
    if (++idle < kSpinPasses) continue;
    idle = 0;
    // Sleep until UCX or submit() has something: arm first, so an event that arrives between
    // the last pass and poll() still makes the fd readable.
    if (ucp_efd_ >= 0 && ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
    sleeping_ = true;
    bool queued;
    {
      std::lock_guard lock(queue_mu_);
      queued = !queue_.empty();
    }
    if (!queued && !stop_.load()) {
      pollfd fds[2] = {{event_fd_, POLLIN, 0}, {ucp_efd_, POLLIN, 0}};
      // Without a worker fd, a short timeout keeps the worker progressing.
      poll(fds, ucp_efd_ >= 0 ? 2 : 1, ucp_efd_ >= 0 ? 100 : 1);
    }
    sleeping_ = false;
    std::uint64_t counter;
    while (read(event_fd_, &counter, sizeof(counter)) > 0) {
    }
  }
  tl_owner = nullptr;
  if (delete_on_exit_) {
    thread_.detach();
    delete this;
  }
}

// ---- endpoint state ----------------------------------------------------------------------------

Status EpState::create(std::string_view worker_address) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
  // PEER mode: a dead peer fails our requests instead of hanging them. It also makes UCX
  // 1.13 drop posix/sysv (no peer-failure support there) and use tcp here.
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &EpCallbacks::peer_error;
  params.err_handler.arg = this;
  ucs_status_t s = ucp_ep_create(core_->worker(), &params, &ep_);
  if (s != UCS_OK) {
    ep_ = nullptr;
    closed = true;
    return from_ucs(s, "ucx: ucp_ep_create");
  }
  // Wireup is asynchronous; a flush completes once the lanes to the peer are up.
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &EpCallbacks::connect_flush_done;
  param.user_data = this;
  ucs_status_ptr_t sp = ucp_ep_flush_nbx(ep_, &param);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {
    connect_status = sp == nullptr ? UCS_OK : UCS_PTR_STATUS(sp);
    connected = true;
  }
  return Status::ok();
}

OpRecord* EpState::alloc_record() {
  OpRecord* rec;
  if (free_.empty()) {
    rec = &records_.emplace_back();
    rec->index = static_cast<std::uint32_t>(records_.size() - 1);
  } else {
    rec = &records_[free_.back()];
    free_.pop_back();
  }
  rec->ep = this;
  rec->in_use = true;
  rec->reported = false;
  rec->status = Status::ok();
  rec->forced.reset();
  ++in_use_;
  return rec;
}

void EpState::release(OpRecord* rec) {
  rec->in_use = false;
  rec->sink = nullptr;
  free_.push_back(rec->index);
  --in_use_;
}

void EpState::finish(OpRecord* rec) {
  if (!rec->reported) {
    rec->reported = true;
    core_->defer_completion(rec->sink, rec->tag, rec->forced ? *rec->forced : rec->status);
  }
  release(rec);
}

void EpState::on_op_callback(OpRecord* rec, ucs_status_t status) {
  if (status != UCS_OK && rec->status.is_ok()) {
    rec->status = from_ucs(status, rec->write ? "ucx: put" : "ucx: get");
  }
  if (--rec->pending == 0) finish(rec);
}

void EpState::post_now(const std::vector<Op>& ops) {
  if (ep_ == nullptr || !healthy.load()) {
    for (const Op& op : ops) {
      core_->defer_completion(op.sink, op.tag, Status::unavailable("ucx: endpoint is broken"));
    }
    return;
  }
  FlushBatch* batch = nullptr;
  for (const Op& op : ops) {
    const auto* key = dynamic_cast<const UcxRemoteKey*>(op.remote_key);
    if (key == nullptr || key->ep() != this || (op.local == nullptr && op.length != 0)) {
      core_->defer_completion(op.sink, op.tag,
                              Status::invalid_argument("ucx: op without a key of this endpoint"));
      continue;
    }
    OpRecord* rec = alloc_record();
    rec->sink = op.sink;
    rec->tag = op.tag;
    rec->write = op.op == TransferOp::kWrite;
    rec->pending = rec->write ? 2 : 1;  // a write also waits for its batch's flush
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &EpCallbacks::op_done;
    param.user_data = rec;
    ucs_status_ptr_t sp;
    if (rec->write) {
      if (batch == nullptr) batch = new FlushBatch;
      batch->writes.push_back(rec);
      sp = ucp_put_nbx(ep_, op.local, op.length, op.remote_addr, key->rkey(), &param);
    } else {
      sp = ucp_get_nbx(ep_, op.local, op.length, op.remote_addr, key->rkey(), &param);
    }
    // NULL: done already, and UCX will not call back; an error pointer: failed at once.
    if (sp == nullptr) {
      on_op_callback(rec, UCS_OK);
    } else if (UCS_PTR_IS_ERR(sp)) {
      on_op_callback(rec, UCS_PTR_STATUS(sp));
    }
  }
  if (batch == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &EpCallbacks::flush_done;
  param.user_data = batch;
  ucs_status_ptr_t sp = ucp_ep_flush_nbx(ep_, &param);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {
    EpCallbacks::flush_done(nullptr, sp == nullptr ? UCS_OK : UCS_PTR_STATUS(sp), batch);
  }
}

bool EpState::begin_abort(CompletionSink* sink, const Status& reason, bool force_all) {
  bool mine = false;
  for (OpRecord& rec : records_) {
    if (rec.in_use && !rec.reported && (force_all || rec.sink == sink)) {
      rec.forced = reason;
      mine = true;
    }
  }
  if (!mine) return false;
  // UCX 1.13 cannot cancel one RMA request: closing the endpoint by force completes every
  // request on it, so the other sinks' ops on this endpoint end too.
  for (OpRecord& rec : records_) {
    if (rec.in_use && !rec.reported && !rec.forced) {
      rec.forced = Status::unavailable("ucx: connection closed to abort another batch");
    }
  }
  healthy = false;
  begin_close(/*force=*/true);
  return true;
}

void EpState::begin_close(bool force) {
  if (ep_ == nullptr) {
    if (!close_pending_) closed = true;
    return;
  }
  if (in_use_ > 0) force = true;  // a graceful close would wait for ops we are abandoning
  healthy = false;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  if (force) core_->note_forced_close();
  param.cb.send = &EpCallbacks::close_done;
  // Keeps this state (records, flags) alive until UCX is done with the endpoint.
  param.user_data = new std::shared_ptr<EpState>(shared_from_this());
  ucp_ep_h ep = ep_;
  ep_ = nullptr;  // the handle is invalid from here on, whatever the outcome
  ucs_status_ptr_t sp = ucp_ep_close_nbx(ep, &param);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {
    if (UCS_PTR_IS_ERR(sp)) {
      KVSTASH_LOG_DEBUG("ucx: ucp_ep_close_nbx: {}", ucs_status_string(UCS_PTR_STATUS(sp)));
    }
    EpCallbacks::close_done(nullptr, UCS_OK, param.user_data);
  } else {
    close_pending_ = true;
  }
}

void EpState::sweep() {
  // Records UCX never completed (it should have, once the endpoint is closed): tell their
  // sinks now; a record still awaiting a callback stays allocated until it arrives.
  for (OpRecord& rec : records_) {
    if (!rec.in_use || rec.reported) continue;
    rec.reported = true;
    core_->defer_completion(rec.sink, rec.tag,
                            rec.forced ? *rec.forced : Status::unavailable("ucx: endpoint closed"));
  }
}

void EpState::on_peer_failure(ucs_status_t status) {
  KVSTASH_LOG_WARN_LIMITED("ucx: peer failed: {}", ucs_status_string(status));
  healthy = false;
  Status why = from_ucs(status, "ucx: peer failed");
  if (why.code() != StatusCode::kUnavailable) why = Status::unavailable(why.message());
  for (OpRecord& rec : records_) {
    if (rec.in_use && !rec.reported && !rec.forced) rec.forced = why;
  }
  // The failed endpoint still has to be closed (forced); not from inside UCX's callback.
  std::shared_ptr<EpState> self = shared_from_this();
  core_->submit([self] { self->begin_close(/*force=*/true); });
}

// ---- endpoint datapath ---------------------------------------------------------------------------

void UcxEndpoint::post(std::span<const Op> ops) {
  if (ops.empty()) return;
  std::shared_ptr<Core> core = core_;  // a completion may destroy this endpoint
  core->submit([state = state_, batch = std::vector<Op>(ops.begin(), ops.end())] { state->post_now(batch); });
}

void UcxEndpoint::abort(CompletionSink* sink, const Status& reason) {
  std::shared_ptr<Core> core = core_;
  std::shared_ptr<EpState> state = state_;
  bool closing = false;
  // Runs after every op queued before it has been posted, so those are covered too.
  core->run([&] { closing = state->begin_abort(sink, reason, /*force_all=*/false); });
  if (!closing) return;
  // The close completes once UCX has completed (and stopped) every request on the endpoint.
  if (!core->wait_until([&] { return state->closed.load(); }, deadline_after(std::chrono::seconds(30)))) {
    KVSTASH_LOG_ERROR("ucx: forced endpoint close did not complete in 30 s");
  }
  core->run([&] { state->sweep(); });
}

void UcxEndpoint::progress() { core_->progress(); }

}  // namespace kvstash::transport::ucx

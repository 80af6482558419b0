// The ucx transport's control path: UCP context/worker set-up, addresses, registration,
// connection, key import, teardown. The datapath (post, abort, progress) is in
// ucx_transport_datapath.cc.
#include "transport/ucx/ucx_transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "common/log.h"
#include "common/wire.h"
#include "transport/ucx/ucx_internal.h"

namespace kvstash::transport::ucx {
namespace {

std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string seal(wire::Writer w) {
  std::string body = w.take();
  wire::Writer tail;
  tail.u64(fnv1a(body));
  return body + tail.take();
}

// Checks magic, version and hash; returns a reader positioned after the version.
std::optional<wire::Reader> open_record(std::string_view record, std::uint16_t magic) {
  if (record.size() < 2 + 1 + 8) return std::nullopt;
  std::string_view body = record.substr(0, record.size() - 8);
  wire::Reader hash_reader(record.substr(record.size() - 8));
  if (hash_reader.u64() != fnv1a(body)) return std::nullopt;
  wire::Reader r(body);
  if (r.u16() != magic || r.u8() != kRecordVersion || !r.ok()) return std::nullopt;
  return r;
}

// Captures one of UCX's print_info dumps as text (the only way 1.13 tells which transports
// it chose; ucp_ep_query and friends arrived later).
template <class Fn>
std::string capture(Fn&& print) {
  char* buf = nullptr;
  std::size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return {};
  print(f);
  std::fclose(f);
  std::string out(buf, len);
  std::free(buf);
  return out;
}

// Whether the context has a resource that does RMA on RDMA hardware: UCX names those
// transports rc_* and dc_* (verbs/mlx5); "resource N : md M dev D flags -- rc_verbs/mlx5_0:1".
// ud_* reaches the same NICs but has no RMA: over it put/get are emulated like over tcp.
bool has_rdma_resource(ucp_context_h context) {
  std::string info = capture([&](FILE* f) { ucp_context_print_info(context, f); });
  std::size_t pos = 0;
  while ((pos = info.find("flags -- ", pos)) != std::string::npos) {
    pos += 9;
    std::string_view tl(info.data() + pos, info.find('/', pos) - pos);
    if (tl.starts_with("rc") || tl.starts_with("dc")) return true;
  }
  return false;
}

// Whether the kernel lists an RDMA device (what UCX's ib component opens).
bool host_has_rdma_device() {
  std::error_code ec;
  return std::filesystem::directory_iterator("/sys/class/infiniband", ec) !=
         std::filesystem::directory_iterator();
}

// ---- registration --------------------------------------------------------------------------

class UcxRegistration final : public LocalRegistration {
 public:
  UcxRegistration(std::shared_ptr<Core> core, ucp_mem_h memh, std::string packed)
      : core_(std::move(core)), memh_(memh), packed_(std::move(packed)) {}
  ~UcxRegistration() override {
    // Unmapping drops UCX's registration; with true RMA the peer's key stops working (the
    // NIC's registration goes with it because Core::init turns UCX's cache off).
    core_->run([this] {
      ucs_status_t s = ucp_mem_unmap(core_->context(), memh_);
      if (s != UCS_OK) KVSTASH_LOG_WARN("ucx: ucp_mem_unmap: {}", ucs_status_string(s));
    });
  }
  std::string packed_key() const override { return packed_; }

 private:
  std::shared_ptr<Core> core_;
  ucp_mem_h memh_;
  std::string packed_;
};

// ---- transport -----------------------------------------------------------------------------

class UcxTransport final : public Transport {
 public:
  UcxTransport(std::shared_ptr<Core> core, bool allow_emulated_rma)
      : core_(std::move(core)), allow_emulated_rma_(allow_emulated_rma) {}

  TransportKind kind() const override { return TransportKind::kUcx; }

  std::vector<TransportCounter> counters() const override {
    return {{TransportKind::kUcx, "connections_one_sided",
             "connections whose put/get UCX runs over RDMA lanes (one-sided, keys checked by the peer's NIC)",
             connections_one_sided_.load(std::memory_order_relaxed)},
            {TransportKind::kUcx, "connections_emulated",
             "connections whose put/get UCX emulates with active messages served by the peer's CPU",
             connections_emulated_.load(std::memory_order_relaxed)}};
  }

  Capabilities capabilities() const override {
    Capabilities c;
    // Per-peer truth is UcxEndpoint::one_sided(). Here, where the answer must hold for every
    // peer, only RDMA hardware guarantees true RMA: on this host UCX emulates put/get with
    // active messages over tcp for caller-owned memory (see README.md).
    c.one_sided = core_->rdma_device();
    c.rdma = core_->rdma_device();
    c.cuda_memory = core_->cuda_memory();  // Debian's UCX 1.13 has no CUDA module
    c.lanes = 1;
    c.slice_bytes = 0;  // UCX fragments (and stripes over its own lanes) by itself
    return c;
  }

  std::string local_address() const override { return encode_address(core_->worker_address()); }

  bool can_reach(std::string_view peer_address) const override {
    return decode_address(peer_address).has_value();
  }

  Result<std::unique_ptr<LocalRegistration>> register_memory(const MemoryRegion& region,
                                                             Access access) override {
    const bool remote_access = access != Access::kLocal;  // no revocable keys: kLeased is kRemote
    // GPU memory only where this UCX was built with its CUDA module (Debian's is not); then
    // UCX moves it zero-copy (GPUDirect RDMA where the NIC reaches the GPU, else its own
    // pipelined staging).
    const bool cuda = region.kind == MemoryKind::kCuda;
    if (cuda && !core_->cuda_memory()) {
      return Status::unsupported("ucx: this UCX build has no CUDA memory type (built without --with-cuda)");
    }
    if (region.addr == nullptr || region.length == 0) {
      return Status::invalid_argument("ucx: empty memory region");
    }
    // Without an RDMA resource UCX emulates put/get with active messages that write to
    // whatever address the peer names, key or no key: exposing a region would expose the
    // whole process. Only an explicit opt-in (tests, benchmarks) accepts that.
    if (remote_access && !core_->rdma_device() && !allow_emulated_rma_) {
      return Status::unsupported(
          "ucx: no RDMA device, and UCX's emulated RMA checks no remote key (a peer could reach "
          "any address of this process); set UcxOptions::allow_emulated_rma to accept that");
    }
    Status status;
    ucp_mem_h memh = nullptr;
    std::string packed;
    core_->run([&] {
      ucp_mem_map_params_t params{};
      params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      params.address = region.addr;  // no ALLOCATE: the caller owns the memory
      params.length = region.length;
      if (cuda) {
        params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        params.memory_type = UCS_MEMORY_TYPE_CUDA;
      }
      ucs_status_t s = ucp_mem_map(core_->context(), &params, &memh);
      if (s != UCS_OK) {
        status = from_ucs(s, "ucp_mem_map");
        return;
      }
      if (!remote_access) return;
      void* buf = nullptr;
      std::size_t len = 0;
      s = ucp_rkey_pack(core_->context(), memh, &buf, &len);
      if (s != UCS_OK) {
        status = from_ucs(s, "ucp_rkey_pack");
        ucp_mem_unmap(core_->context(), memh);
        memh = nullptr;
        return;
      }
      packed = encode_key({reinterpret_cast<std::uint64_t>(region.addr), region.length,
                           std::string(static_cast<const char*>(buf), len)});
      ucp_rkey_buffer_release(buf);
    });
    KVSTASH_RETURN_IF_ERROR(status);
    return std::unique_ptr<LocalRegistration>(
        std::make_unique<UcxRegistration>(core_, memh, std::move(packed)));
  }

  Result<std::shared_ptr<Endpoint>> connect(std::string_view peer_address, Deadline deadline) override {
    std::optional<std::string> addr = decode_address(peer_address);
    if (!addr) return Status::invalid_argument("ucx: malformed peer address");
    auto state = std::make_shared<EpState>(core_.get());
    Status status;
    core_->run([&] { status = state->create(*addr); });
    KVSTASH_RETURN_IF_ERROR(status);
    // The ep flush started by create() completes once wireup with the peer is done.
    bool done = core_->wait_until([&] { return state->connected.load(); }, deadline);
    if (done && state->connect_status.load() == UCS_OK) {
      core_->run([&] { state->detect_rma_lanes(); });
      (state->one_sided ? connections_one_sided_ : connections_emulated_)
          .fetch_add(1, std::memory_order_relaxed);
      KVSTASH_LOG_DEBUG("ucx: connected, {}",
                        state->one_sided ? "RMA over " + state->rdma_lanes : std::string("RMA emulated"));
      return std::shared_ptr<Endpoint>(std::make_shared<UcxEndpoint>(core_, state));
    }
    // Give up: the UcxEndpoint destructor force-closes, which also ends the pending flush.
    auto cs = static_cast<ucs_status_t>(state->connect_status.load());
    UcxEndpoint failed(core_, state);
    state->healthy = false;
    if (!done) return Status::timeout("ucx: connect did not complete before the deadline");
    return from_ucs(cs, "ucx: connect");
  }

 private:
  std::shared_ptr<Core> core_;
  bool allow_emulated_rma_;
  std::atomic<std::uint64_t> connections_one_sided_{0};
  std::atomic<std::uint64_t> connections_emulated_{0};
};

}  // namespace

// ---- records ---------------------------------------------------------------------------------

std::string encode_address(std::string_view worker_address) {
  wire::Writer w;
  w.u16(kAddressMagic);
  w.u8(kRecordVersion);
  w.bytes(worker_address);
  return seal(std::move(w));
}

std::optional<std::string> decode_address(std::string_view record) {
  auto r = open_record(record, kAddressMagic);
  if (!r) return std::nullopt;
  std::uint32_t len = r->u32();
  if (len == 0 || len > kMaxBlob) return std::nullopt;
  std::string_view addr = r->raw(len);
  if (!r->at_end()) return std::nullopt;
  return std::string(addr);
}

std::string encode_key(const KeyRecord& key) {
  wire::Writer w;
  w.u16(kKeyMagic);
  w.u8(kRecordVersion);
  w.u64(key.base);
  w.u64(key.length);
  w.bytes(key.rkey);
  return seal(std::move(w));
}

std::optional<KeyRecord> decode_key(std::string_view record) {
  auto r = open_record(record, kKeyMagic);
  if (!r) return std::nullopt;
  KeyRecord key;
  key.base = r->u64();
  key.length = r->u64();
  std::uint32_t len = r->u32();
  if (len == 0 || len > kMaxBlob) return std::nullopt;
  key.rkey = std::string(r->raw(len));
  if (!r->at_end() || key.base + key.length < key.base) return std::nullopt;
  return key;
}

Status from_ucs(ucs_status_t status, std::string_view what) {
  std::string m = std::string(what) + ": " + ucs_status_string(status);
  switch (status) {
    case UCS_OK: return Status::ok();
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT: return Status::no_space(std::move(m));
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR: return Status::invalid_argument(std::move(m));
    case UCS_ERR_TIMED_OUT: return Status::timeout(std::move(m));
    case UCS_ERR_UNSUPPORTED: return Status::unsupported(std::move(m));
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED: return Status::permission_denied(std::move(m));
    case UCS_ERR_IO_ERROR: return Status::io_error(std::move(m));
    default:
      // Unreachable peer, reset/timed-out endpoint, cancelled request: the connection is
      // the problem, and a reconnect may help.
      return Status::unavailable(std::move(m));
  }
}

// ---- core set-up and teardown ----------------------------------------------------------------

void Core::Deleter::operator()(Core* core) const {
  if (core->thread_.joinable() && std::this_thread::get_id() == core->thread_.get_id()) {
    // The last reference went away inside a completion on the progress thread: the thread
    // cannot join itself, so it finishes its loop and deletes the core on the way out.
    core->delete_on_exit_ = true;
    core->stop_ = true;
    return;
  }
  delete core;
}

Result<std::shared_ptr<Core>> Core::create(const UcxOptions& options) {
  std::shared_ptr<Core> core(new Core, Deleter{});
  KVSTASH_RETURN_IF_ERROR(core->init(options));
  return core;
}

Status Core::init(const UcxOptions& options) {
  threaded_ = options.progress_thread;
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return from_ucs(s, "ucp_config_read").with_context("ucx");
  struct ConfigGuard {
    ucp_config_t* c;
    ~ConfigGuard() { ucp_config_release(c); }
  } guard{config};
  if (!options.transports.empty()) {
    s = ucp_config_modify(config, "TLS", options.transports.c_str());
    if (s != UCS_OK) {
      return Status::invalid_argument("ucx: bad transport list '" + options.transports + "'");
    }
  }
  // UCX caches RDMA registrations (IB_REG_METHODS=rcache,...) and keeps a region registered
  // after ucp_mem_unmap until the memory itself is unmapped: a peer's old rkey would go on
  // reaching a region we deregistered. Registering directly makes ucp_mem_unmap deregister
  // at the NIC. (An operator who sets UCX_IB_REG_METHODS chooses otherwise knowingly. Only
  // where there is an RDMA device: elsewhere UCX warns that no component took the setting.)
  if (std::getenv("UCX_IB_REG_METHODS") == nullptr && host_has_rdma_device() &&
      ucp_config_modify(config, "REG_METHODS", "direct") != UCS_OK) {
    return Status::io_error("ucx: cannot turn off UCX's registration cache (REG_METHODS=direct)");
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | (threaded_ ? UCP_FEATURE_WAKEUP : 0);
  s = ucp_init(&params, config, &context_);
  if (s != UCS_OK) return from_ucs(s, "ucp_init").with_context("ucx");
  rdma_device_ = has_rdma_resource(context_);
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  cuda_memory_ = ucp_context_query(context_, &attr) == UCS_OK &&
                 (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // One owner at a time, not always the creating thread (see ucx_internal.h).
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  s = ucp_worker_create(context_, &wparams, &worker_);
  if (s != UCS_OK) return from_ucs(s, "ucp_worker_create").with_context("ucx");

  ucp_address_t* addr = nullptr;
  std::size_t addr_len = 0;
  s = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (s != UCS_OK) return from_ucs(s, "ucp_worker_get_address").with_context("ucx");
  worker_address_.assign(reinterpret_cast<const char*>(addr), addr_len);
  ucp_worker_release_address(worker_, addr);

  if (!threaded_) return Status::ok();
  event_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event_fd_ < 0) return Status::from_errno("ucx: eventfd", errno);
  if (ucp_worker_get_efd(worker_, &ucp_efd_) != UCS_OK) ucp_efd_ = -1;  // poll with a timeout
  thread_ = std::thread([this] { thread_main(); });
  return Status::ok();
}

Core::~Core() {
  if (thread_.joinable()) {
    stop_ = true;
    wake();
    thread_.join();
  }
  // Every endpoint, key and registration held a reference, so none is left; what remains are
  // closures still queued (e.g. a peer-failure close for an endpoint already gone).
  if (worker_ != nullptr) {
    tl_owner_for_teardown(this);
    // UCX 1.13 (Debian, assertions on) aborts the process when a worker is destroyed, or a
    // peer's worker vanishes, while a wireup message is still queued on an endpoint
    // (ucp_request_send_state_ff: "got REP message"). Wireup runs in the background after
    // connect(), so progress until the worker has been quiet for a while before destroying
    // it; longer after a forced close, whose teardown the peer performs with us.
    const Deadline start = Clock::now();
    const Deadline hard_stop = start + std::chrono::milliseconds(1000);
    const Deadline min_linger = last_forced_close_ + std::chrono::milliseconds(300);
    Deadline quiet_since = start;
    while (Clock::now() < hard_stop) {
      if (pass()) {
        quiet_since = Clock::now();
      } else if (Clock::now() - quiet_since > std::chrono::milliseconds(50) && Clock::now() >= min_linger) {
        break;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    tl_owner_for_teardown(nullptr);
    completions_.clear();  // their sinks belong to endpoints that no longer exist
    ucp_worker_destroy(worker_);
  }
  if (context_ != nullptr) ucp_cleanup(context_);
  if (event_fd_ >= 0) close(event_fd_);
}

// ---- interface objects: control parts ----------------------------------------------------------

UcxRemoteKey::~UcxRemoteKey() {
  core_->run([this] { ucp_rkey_destroy(rkey_); });
}

UcxEndpoint::~UcxEndpoint() {
  std::shared_ptr<Core> core = core_;
  std::shared_ptr<EpState> state = state_;
  // Graceful when healthy and idle (the peer releases its side cleanly), forced otherwise
  // (begin_close decides). A graceful close cannot be upgraded later (the ep handle is gone
  // once ucp_ep_close_nbx was called), so a peer that never answers leaves it pending; the
  // state stays alive through the close callback's reference.
  core->run([&] { state->begin_close(/*force=*/!state->healthy.load()); });
  if (!core->wait_until([&] { return state->closed.load(); }, deadline_after(std::chrono::seconds(2)))) {
    KVSTASH_LOG_WARN("ucx: endpoint close still pending after 2 s");
  }
  core->run([&] { state->sweep(); });
}

void EpState::detect_rma_lanes() {
  rdma_lanes.clear();
  if (ep_ != nullptr)
    rdma_lanes = rdma_lanes_from_ep_info(capture([&](FILE* f) { ucp_ep_print_info(ep_, f); }));
  one_sided = !rdma_lanes.empty();
}

std::string rdma_lanes_from_ep_info(std::string_view info) {
  // UCX 1.13 prints one line per lane, then a put[N]/get[N] line per RMA lane N:
  //   lane[0]:  6:rc_verbs/rxe0:1.0 md[4]  -> md[4]/ib/sysdev[255] am am_bw#0
  //   lane[1]:  7:ud_verbs/rxe0:1.0 md[4]  -> md[4]/ib/sysdev[255] keepalive wireup
  //   put[0]: 0..<short>..81..<bcopy>..16384..<zcopy>..(inf)
  // (lanes tagged rma_bw#N carry large RMA too). Without an RMA lane UCX emulates put/get
  // with active messages. Only RMA lanes on RDMA transports (rc, dc) count: posix/sysv RMA
  // lanes serve only memory UCX allocated itself, never the caller-owned regions used here.
  std::map<int, std::string> resource;  // lane -> "tl/device"
  std::set<int> rma;
  std::istringstream lines{std::string(info)};
  for (std::string line; std::getline(lines, line);) {
    int lane = 0, index = 0;
    char name[128] = {};
    if (std::sscanf(line.c_str(), " # lane[%d]: %d:%127s", &lane, &index, name) == 3) {
      std::string tl(name);
      const std::size_t dot = tl.find_last_of('.');  // "rxe0:1.0": the path index
      if (dot != std::string::npos && tl.find_first_not_of("0123456789", dot + 1) == std::string::npos) {
        tl.resize(dot);
      }
      resource[lane] = tl;
      if (line.find("rma_bw#") != std::string::npos) rma.insert(lane);
    } else if (std::sscanf(line.c_str(), " # put[%d]", &lane) == 1) {
      rma.insert(lane);
    }
  }
  std::string out;
  std::set<std::string> listed;
  for (int lane : rma) {
    auto it = resource.find(lane);
    if (it == resource.end() || !(it->second.starts_with("rc") || it->second.starts_with("dc"))) continue;
    if (!listed.insert(it->second).second) continue;
    if (!out.empty()) out += ',';
    out += it->second;
  }
  return out;
}

Result<std::unique_ptr<RemoteKey>> UcxEndpoint::import_key(std::uint64_t base, std::uint64_t length,
                                                           std::string_view packed, Deadline deadline) {
  std::optional<KeyRecord> key = decode_key(packed);
  if (!key) return Status::invalid_argument("ucx: malformed remote key");
  if (base < key->base || base + length < base || base + length > key->base + key->length) {
    return Status::invalid_argument("ucx: requested range lies outside the key's region");
  }
  if (Clock::now() > deadline) return Status::timeout("ucx: import_key deadline passed");
  Status status;
  ucp_rkey_h rkey = nullptr;
  core_->run([&] {
    if (state_->ep() == nullptr || !state_->healthy.load()) {
      status = Status::unavailable("ucx: endpoint is closed");
      return;
    }
    ucs_status_t s = ucp_ep_rkey_unpack(state_->ep(), key->rkey.data(), &rkey);
    if (s != UCS_OK) status = from_ucs(s, "ucp_ep_rkey_unpack");
  });
  if (!status.is_ok()) {
    // A well-framed record UCX still refuses is a bad key, not a broken connection.
    if (status.code() != StatusCode::kUnavailable) {
      return Status::invalid_argument(status.message());
    }
    return status;
  }
  auto out = std::make_unique<UcxRemoteKey>(core_, state_, rkey);
  out->base = base;
  out->length = length;
  return std::unique_ptr<RemoteKey>(std::move(out));
}

}  // namespace kvstash::transport::ucx

namespace kvstash::transport {

Result<std::unique_ptr<Transport>> make_ucx_transport(const UcxOptions& options,
                                                      std::string_view cluster_token) {
  if (!cluster_token.empty()) {
    return Status::unsupported(
        "ucx cannot prove a cluster token (UCX connects peers without a handshake of ours): not started "
        "while one is set; tcp and verbs carry the token");
  }
  auto core = ucx::Core::create(options);
  if (!core.is_ok()) {
    Status s = core.status();
    if (s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kIoError) return s;
    return Status::unavailable(s.message());
  }
  return std::unique_ptr<Transport>(
      std::make_unique<ucx::UcxTransport>(std::move(*core), options.allow_emulated_rma));
}

}  // namespace kvstash::transport

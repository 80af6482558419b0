// The verbs transport's control path: device and port selection, memory registration, the
// setup listener (served by verbs_service.cc), and connect().
#include "transport/verbs/verbs_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <list>

#include "common/handshake.h"
#include "common/log.h"
#include "common/net.h"
#include "common/pci_topology.h"
#include "common/system.h"
#include "transport/verbs/verbs_gpu.h"
#include "transport/verbs/verbs_internal.h"
#include "transport/verbs/verbs_wire.h"

namespace kvstash::transport::verbs {

// ---- small pieces shared with the datapath -----------------------------------------------

std::vector<TransportCounter> Counters::snapshot() const {
  auto c = [](const char* name, const char* help, const std::atomic<std::uint64_t>& v) {
    return TransportCounter{TransportKind::kVerbs, name, help, v.load(std::memory_order_relaxed)};
  };
  return {
      c("connections_opened", "Queue pairs this side connected to a peer", connections_opened),
      c("connections_accepted", "Queue pairs peers connected to this side", connections_accepted),
      c("connections_broken", "Connections torn down by an error, a dead peer or a cancel",
        connections_broken),
      c("connections_refused", "Setup connections closed at accept: a connection cap was reached",
        connections_refused),
      c("handshakes_failed",
        "Setup connections dropped before their queue pair came up (timeout, malformed hello, wrong token)",
        handshakes_failed),
      c("handshake_timeouts", "Setup connections that did not finish the handshake in time (also in "
        "handshakes_failed)", handshake_timeouts),
      c("unproven_evicted", "Setup connections in the handshake dropped for newer ones (the unproven budget "
        "was full)", unproven_evicted),
      c("connections_dropped_stalled", "Connections dropped because a lease message or its answer stalled",
        connections_dropped_stalled),
      c("ops_posted", "READ/WRITE ops posted", ops_posted),
      c("bytes_read", "Bytes asked for by posted READs", bytes_read),
      c("bytes_written", "Bytes sent by posted WRITEs", bytes_written),
      c("remote_access_errors", "Requests the peer's NIC refused (revoked, wrong or foreign key)",
        remote_access_errors),
      c("retries_exhausted", "Requests that failed because the peer stopped answering", retries_exhausted),
      c("leases_granted", "Leases this side bound memory windows for", leases_granted),
      c("leases_refused", "Lease requests this side refused", leases_refused),
      c("leases_expired", "Leases revoked because their time was up", leases_expired),
      c("leases_released", "Leases revoked because the client dropped them", leases_released),
      c("leases_revoked", "Leases revoked on every connection at a client's request, and confirmed",
        leases_revoked),
      c("leases_fenced", "Leases revoked because a fence passed their tag", leases_fenced),
      c("windows_bound", "Memory windows bound", windows_bound),
      c("windows_revoked", "Memory windows deallocated (their lease or connection ended)", windows_revoked),
  };
}

namespace {

constexpr std::string_view kSetup = "verbs setup connection";
constexpr int kTargetCqDepth = 256;  // memory-window binds, each waited for as it is posted

}  // namespace

void append_frame(std::string& out, std::string_view message) {
  const std::uint32_t n = htonl(static_cast<std::uint32_t>(message.size()));
  out.append(reinterpret_cast<const char*>(&n), sizeof n).append(message);
}

Status write_frame(int fd, std::string_view message, Deadline deadline) {
  std::string out;
  append_frame(out, message);
  return net::send_all(fd, out.data(), out.size(), deadline, kSetup);
}

Result<std::string> read_frame(int fd, std::size_t max, Deadline deadline) {
  std::uint32_t n = 0;
  KVSTASH_RETURN_IF_ERROR(net::recv_all(fd, &n, sizeof n, deadline, kSetup));
  n = ntohl(n);
  if (n > max) {
    return Status::invalid_argument("verbs: oversize setup message (" + std::to_string(n) +
                                    " bytes, at most " + std::to_string(max) + ")");
  }
  std::string s(n, '\0');
  KVSTASH_RETURN_IF_ERROR(net::recv_all(fd, s.data(), n, deadline, kSetup));
  return s;
}

QpConfig qp_config(const VerbsOptions& options, const DeviceState& dev) {
  QpConfig c;
  c.max_send_wr =
      std::min<std::uint32_t>(options.send_queue_depth, static_cast<std::uint32_t>(dev.device.max_qp_wr));
  c.max_send_sge = static_cast<std::uint32_t>(std::max(1, std::min(dev.device.max_sge, 16)));
  c.max_rd_atomic = static_cast<std::uint8_t>(
      std::clamp<int>(static_cast<int>(options.max_rd_atomic), 1, std::max(1, dev.device.max_qp_rd_atom)));
  c.timeout = static_cast<std::uint8_t>(std::min<std::uint32_t>(options.retry_timeout, 31));
  c.retry_cnt = static_cast<std::uint8_t>(std::min<std::uint32_t>(options.retry_count, 7));
  return c;
}

Hello hello_for(const DeviceState& dev, const ibv_qp& qp, std::uint8_t max_rd_atomic,
                const handshake::Handshake& handshake) {
  Hello h;
  h.node_guid = dev.device.node_guid;
  h.qp = {qp.qp_num, random_psn(), dev.gid.gid, dev.port.lid, dev.port.active_mtu};
  h.max_rd_atomic = max_rd_atomic;
  h.nonce = handshake.nonce();
  h.token_required = handshake.token_required();
  return h;
}

namespace {

// ---- the transport ---------------------------------------------------------------------------

class VerbsTransport final : public Transport {
 public:
  static Result<std::unique_ptr<VerbsTransport>> create(const VerbsOptions& options,
                                                        std::string cluster_token);
  ~VerbsTransport() override;

  TransportKind kind() const override { return TransportKind::kVerbs; }
  Capabilities capabilities() const override {
    // With several devices, an op is cut into slices spread over them (one lane per device).
    const auto lanes = static_cast<std::uint32_t>(devs_.size());
    return {.same_host_only = false,
            .one_sided = true,
            .rdma = true,
            .cuda_memory = true,
            .leases = windows(),
            .lease_asks_target = windows(),
            .lanes = lanes,
            .slice_bytes = lanes > 1 ? options_.stripe_bytes : 0};
  }
  std::string local_address() const override { return address_; }
  std::vector<TransportCounter> counters() const override { return counters_->snapshot(); }
  void fence(std::uint64_t through) override { target_->fence(through); }
  void set_grant_check(std::shared_ptr<const GrantCheck> check) override {
    std::lock_guard lock(target_->mu);
    target_->grants = std::move(check);
  }
  bool can_reach(std::string_view peer_address) const override;
  Result<std::unique_ptr<LocalRegistration>> register_memory(const MemoryRegion& region,
                                                             Access access) override;
  Result<std::shared_ptr<Endpoint>> connect(std::string_view peer_address, Deadline deadline) override;

 private:
  VerbsTransport() = default;
  std::vector<PortAddress> port_addresses() const;
  // Whether leased regions get memory windows (every device has type-2 windows, and the
  // options want them): then leases are held, fenced and revoked here, at the target.
  bool windows() const {
    return options_.memory_windows &&
           std::all_of(devs_.begin(), devs_.end(), [](const auto& d) { return d->device.mw_type2; });
  }
  // The devices nearest (on PCIe) the GPU that owns `dptr`, bit i for devs_[i]: the only ones
  // that register its memory (unless leased); 0 when none is nearer than another (one device, no
  // CUDA driver, the GPU or the NICs not in sysfs), and then every device registers it.
  std::uint64_t nearest_devices(const void* dptr) const;
  // One lane: a queue pair from our device `dev` to the peer's `port`, set up over `control`.
  Result<std::shared_ptr<VerbsEndpoint>> connect_lane(const std::shared_ptr<DeviceState>& dev,
                                                      const std::string& control, const PortAddress& theirs,
                                                      Deadline deadline);

  VerbsOptions options_;
  std::string cluster_token_;
  std::vector<std::shared_ptr<DeviceState>> devs_;  // the devices in use, in address order
  std::shared_ptr<Counters> counters_ = std::make_shared<Counters>();
  std::shared_ptr<Target> target_;  // accepted connections and their leases
  std::string address_;
  std::unique_ptr<SetupService> service_;  // serves the setup listener
};

Result<std::unique_ptr<VerbsTransport>> VerbsTransport::create(const VerbsOptions& options,
                                                               std::string cluster_token) {
  KVSTASH_ASSIGN_OR_RETURN(auto devices, discover(options.devices));
  std::unique_ptr<VerbsTransport> t(new VerbsTransport());
  t->options_ = options;
  t->cluster_token_ = std::move(cluster_token);
  t->target_ = std::make_shared<Target>();
  // Every device with an active port that has a usable GID (its first such port), the ones
  // on this thread's NUMA node first when only some are wanted; kept in the order verbs
  // lists them, which is the rail order peers pair by.
  std::vector<Device> usable;
  for (auto& d : devices) {
    if (std::any_of(d.ports.begin(), d.ports.end(), [](const Port& p) { return p.active && pick_gid(p); })) {
      usable.push_back(d);
    }
  }
  for (std::size_t i : choose_devices(usable, numa_node_of_this_thread(), options.max_devices)) {
    const Device& d = usable[i];
    for (const Port& p : d.ports) {
      auto gid = p.active ? pick_gid(p) : std::nullopt;
      if (!gid) continue;
      auto dev = std::make_shared<DeviceState>();
      dev->index = t->devs_.size();
      dev->device = d;
      dev->port = p;
      dev->gid = *gid;
      dev->counters = t->counters_;
      KVSTASH_ASSIGN_OR_RETURN(dev->ctx, open_device(d.name));
      dev->pd.reset(ibv_alloc_pd(dev->ctx.get()));
      if (!dev->pd) return Status::from_errno("verbs: allocate a protection domain", errno);
      Cq cq(ibv_create_cq(dev->ctx.get(), kTargetCqDepth, nullptr, nullptr, 0));
      if (!cq) return Status::from_errno("verbs: create CQ", errno);
      if (options.memory_windows && !d.mw_type2) {
        KVSTASH_LOG_INFO(
            "verbs: {} has no type-2 memory windows: leased regions are reachable whole through "
            "their key (generation fencing guards them)",
            d.name);
      }
      t->target_->devs.push_back(dev);
      t->target_->cqs.push_back(std::move(cq));
      t->devs_.push_back(std::move(dev));
      break;
    }
  }
  if (t->devs_.empty()) return Status::unsupported("verbs: no RDMA device with an active port here");

  KVSTASH_ASSIGN_OR_RETURN(net::HostPort listen, net::parse_host_port(options.listen));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string port = std::to_string(listen.port);
  if (getaddrinfo(listen.host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
    return Status::invalid_argument("verbs: listen address '" + options.listen +
                                    "' is not a numeric host:port");
  }
  UniqueFd fd(::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc = ::bind(fd.get(), res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (rc != 0 || ::listen(fd.get(), SOMAXCONN) != 0) {
    return Status::unavailable("verbs: cannot listen on " + options.listen + ": " + std::strerror(errno));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  char host[INET6_ADDRSTRLEN] = {};
  std::uint16_t bound_port = 0;
  if (bound.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&bound);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    bound_port = ntohs(a->sin6_port);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&bound);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    bound_port = ntohs(a->sin_port);
  }
  std::string control = options.advertise;
  if (control.empty()) {
    const bool v6 = bound.ss_family == AF_INET6;
    control.append(v6 ? "[" : "").append(host).append(v6 ? "]:" : ":").append(std::to_string(bound_port));
  }
  t->address_ = encode_address({control, t->port_addresses()});
  t->service_ = std::make_unique<SetupService>(std::move(fd), t->target_, options, t->cluster_token_);
  for (const auto& dev : t->devs_) {
    KVSTASH_LOG_INFO("verbs: serving {} port {} (GID {}, NUMA node {}) for setup on {}", dev->device.name,
                     dev->port.number, dev->gid.to_string(), dev->device.numa_node, control);
  }
  return t;
}

VerbsTransport::~VerbsTransport() {
  service_.reset();      // every accepted connection goes with it
  if (!target_) return;  // create() gave up before it existed
  std::lock_guard lock(target_->mu);
  target_->accepted.clear();
}

std::vector<PortAddress> VerbsTransport::port_addresses() const {
  std::vector<PortAddress> out;
  for (const auto& d : devs_) {
    out.push_back({d->device.name, d->device.node_guid, d->port.number, d->port.ethernet, d->gid.gid,
                   d->port.lid, d->port.active_mtu});
  }
  return out;
}

bool VerbsTransport::can_reach(std::string_view peer_address) const {
  auto peer = decode_address(peer_address);
  if (!peer.is_ok()) return false;
  return !pair_rails(port_addresses(), peer->ports).empty();
}

Result<std::unique_ptr<LocalRegistration>> VerbsTransport::register_memory(const MemoryRegion& region,
                                                                           Access exposure) {
  if (region.addr == nullptr || region.length == 0) return Status::invalid_argument("verbs: empty region");
  // A leased region's MRs only let windows be bound over them: their own rkeys grant nothing.
  const bool leased = exposure == Access::kLeased && windows();
  int access = IBV_ACCESS_LOCAL_WRITE;
  if (leased) {
    access |= IBV_ACCESS_MW_BIND;
  } else if (exposure != Access::kLocal) {
    access |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  }
  if (options_.on_demand_paging && region.kind == MemoryKind::kHost) {
    for (const auto& d : devs_) {
      if (d->device.odp_rc) continue;
      std::string why = "verbs: ";
      why.append(d->device.name)
          .append(" cannot page RC READ/WRITE on demand (VerbsOptions::on_demand_paging)");
      return Status::unsupported(std::move(why));
    }
    access |= IBV_ACCESS_ON_DEMAND;
  }
  // One MR per device, so that every lane of a connection can reach the region; but GPU memory
  // only on the devices nearest its GPU on PCIe when the topology names some: the others get no
  // MR for it, so their lanes never carry it (the striped endpoint picks among the nearest lanes,
  // and a lane without the MR completes an op with an error rather than post it), and the key a
  // peer imports names only the nearest devices (its lanes to the others are left out for this
  // region). With no device nearer than another, every device registers it, as host memory.
  // A region leased through memory windows is registered on every device all the same (the
  // nearest are then only preferred): the target finds a leased MR by device index and rkey,
  // and its table takes a part's position in the list for the device index (verbs_leases.cc).
  const std::uint64_t nearest = region.kind == MemoryKind::kCuda ? nearest_devices(region.addr) : 0;
  const std::uint64_t only = leased ? 0 : nearest;
  std::vector<Registration::Part> parts;
  for (const auto& d : devs_) {
    if (only != 0 && (d->index >= 64 || (only >> d->index & 1) == 0)) continue;
    Registration::Part part{d, d->device.node_guid, nullptr};
    Result<GpuRegistration> gpu = Status::unsupported("host memory");
    if (region.kind == MemoryKind::kCuda) {
      // GPUDirect: the NIC reaches GPU memory itself (dma-buf, else nvidia-peermem).
      gpu = register_gpu_memory(d->pd.get(), region.addr, region.length, access);
      if (!gpu.is_ok() && !options_.device_memory_by_address) return gpu.status();
    }
    if (gpu.is_ok()) {
      KVSTASH_LOG_INFO("verbs: registered {} bytes of GPU memory on {} through {}", region.length,
                       d->device.name, to_string(gpu->path));
      part.mr = std::move(gpu->mr);
    } else {
      part.mr.reset(ibv_reg_mr(d->pd.get(), region.addr, region.length, access));
      if (!part.mr) {
        int e = errno;
        if (e == ENOMEM) {
          return Status::no_space("verbs: cannot register " + std::to_string(region.length) +
                                  " bytes (RLIMIT_MEMLOCK too low?)");
        }
        return Status::from_errno("verbs: register memory on " + d->device.name, e);
      }
    }
    parts.push_back(std::move(part));
  }
  // The lanes on the NICs nearest the GPU move its memory (the only ones that can, unless leased).
  return std::unique_ptr<LocalRegistration>(std::make_unique<Registration>(
      std::move(parts), exposure != Access::kLocal, leased ? target_ : nullptr, nearest));
}

std::uint64_t VerbsTransport::nearest_devices(const void* dptr) const {
  if (devs_.size() < 2) return 0;
  const std::optional<std::string> bus_id = gpu_pci_bus_id(dptr);
  const std::optional<pci::Address> gpu = bus_id ? pci::parse_address(*bus_id) : std::nullopt;
  if (!gpu) {
    KVSTASH_LOG_INFO("verbs: the CUDA driver does not say which GPU owns {}: every device registers it",
                     dptr);
    return 0;
  }
  std::vector<std::string> names;
  for (const auto& d : devs_) names.push_back(d->device.name);
  const std::vector<pci::Distance> distance = pci::distances(*gpu, names);
  std::uint64_t preferred = 0;
  std::string chosen;
  for (std::size_t i : pci::nearest(distance)) {
    if (i >= 64) break;  // the mask's width; such a device moves it only without a preference
    preferred |= std::uint64_t{1} << i;
    chosen.append(chosen.empty() ? "" : ", ").append(names[i]);
  }
  if (preferred == 0) {
    KVSTASH_LOG_INFO(
        "verbs: no device is nearer GPU {} than another ({}): every device registers and moves its memory",
        pci::to_string(*gpu), pci::to_string(distance.front()));
  } else {
    KVSTASH_LOG_INFO("verbs: GPU {}'s memory is registered on and moves through {} only ({} on PCIe)",
                     pci::to_string(*gpu), chosen,
                     pci::to_string(distance[static_cast<std::size_t>(std::countr_zero(preferred))]));
  }
  return preferred;
}

Result<std::shared_ptr<Endpoint>> VerbsTransport::connect(std::string_view peer_address, Deadline deadline) {
  KVSTASH_ASSIGN_OR_RETURN(Address peer, decode_address(peer_address));
  const auto rails = pair_rails(port_addresses(), peer.ports);
  if (rails.empty()) return Status::unsupported("verbs: no RDMA port of ours can reach the peer's");
  // One lane per device of ours that reaches the peer. A lane that cannot come up is left
  // out (a device may be down); a refusal (the cluster token) ends it.
  std::vector<std::shared_ptr<VerbsEndpoint>> lanes;
  Status first;
  for (const auto& [ours, theirs] : rails) {
    auto lane = connect_lane(devs_[ours], peer.control, peer.ports[theirs], deadline);
    if (lane.is_ok()) {
      lanes.push_back(std::move(lane).value());
      continue;
    }
    if (lane.status().code() == StatusCode::kPermissionDenied) return lane.status();
    KVSTASH_LOG_WARN_LIMITED("verbs: no lane from {}: {}", devs_[ours]->device.name, lane.status().to_string());
    if (first.is_ok()) first = lane.status();
  }
  if (lanes.empty()) return first;
  if (lanes.size() == 1) return std::shared_ptr<Endpoint>(std::move(lanes.front()));
  return make_striped_endpoint(std::move(lanes));
}

Result<std::shared_ptr<VerbsEndpoint>> VerbsTransport::connect_lane(const std::shared_ptr<DeviceState>& dev,
                                                                    const std::string& control,
                                                                    const PortAddress& theirs,
                                                                    Deadline deadline) {
  KVSTASH_ASSIGN_OR_RETURN(net::HostPort hp, net::parse_host_port(control));
  auto connected = net::connect_tcp(hp, deadline);
  if (!connected.is_ok()) return connected.status().with_context("verbs: queue-pair setup with " + control);
  UniqueFd sock = std::move(connected).value();

  ibv_comp_channel* channel = ibv_create_comp_channel(dev->ctx.get());
  if (channel == nullptr) return Status::from_errno("verbs: create completion channel", errno);
  const QpConfig cfg = qp_config(options_, *dev);
  Cq cq(ibv_create_cq(dev->ctx.get(), static_cast<int>(cfg.max_send_wr) + 1, nullptr, channel, 0));
  if (!cq) {
    ibv_destroy_comp_channel(channel);
    return Status::from_errno("verbs: create CQ", errno);
  }
  auto qp = create_rc_qp(dev->pd.get(), cq.get(), cfg);
  auto cleanup = [&] {
    cq.reset();
    ibv_destroy_comp_channel(channel);
  };
  if (!qp.is_ok()) {
    cleanup();
    return qp.status();
  }
  handshake::Handshake proof(handshake::Role::kClient, cluster_token_);
  Hello mine = hello_for(*dev, **qp, cfg.max_rd_atomic, proof);
  mine.peer_guid = theirs.node_guid;
  // The handshake (verbs_wire.h): our hello, the target's challenge, our proof, then the
  // target's hello with its queue pair and its proof.
  Status s = write_frame(sock.get(), encode_hello(mine), deadline);
  Result<std::string> reply =
      s.is_ok() ? read_frame(sock.get(), kMaxSetupFrame, deadline) : Result<std::string>(s);
  Result<Challenge> challenge = reply.is_ok() ? decode_challenge(*reply) : Result<Challenge>(reply.status());
  if (challenge.is_ok() && challenge->node_guid != theirs.node_guid) {
    challenge = Status::invalid_argument("verbs: the peer answered from another device than it advertises");
  }
  Result<Hello> theirs_hello = challenge.status();
  if (challenge.is_ok()) {
    Status heard = proof.on_peer_hello(challenge->nonce, challenge->token_required);
    const handshake::Mac mine_proof = proof.proof();
    Status sent = heard.is_ok() ? write_frame(sock.get(),
                                              {reinterpret_cast<const char*>(mine_proof.data()), mine_proof.size()},
                                              deadline)
                                : heard.with_context("verbs");
    auto answer = sent.is_ok() ? read_frame(sock.get(), kMaxSetupFrame, deadline) : Result<std::string>(sent);
    if (!answer.is_ok()) {
      // The target closes the connection on a proof it refused.
      theirs_hello = sent.is_ok() && answer.status().code() == StatusCode::kUnavailable
                         ? Status::permission_denied(
                               "verbs: the target refused this client's cluster token (a wrong token, the "
                               "target backing off after failed handshakes, or its connection limit)")
                         : answer.status();
    } else {
      theirs_hello = decode_hello(*answer);
      if (theirs_hello.is_ok() && theirs_hello->node_guid != theirs.node_guid) {
        theirs_hello = Status::invalid_argument("verbs: the peer answered from another device than it advertises");
      }
      if (theirs_hello.is_ok()) {
        Status proven = proof.check_proof(theirs_hello->mac);
        if (!proven.is_ok()) theirs_hello = proven.with_context("verbs");
      }
    }
  }
  if (!theirs_hello.is_ok()) {
    qp->reset();
    cleanup();
    return theirs_hello.status().with_context("verbs setup with " + control);
  }
  QpConfig peer_cfg = cfg;
  peer_cfg.max_rd_atomic = std::min(cfg.max_rd_atomic, theirs_hello->max_rd_atomic);
  Status up = connect_rc_qp(qp->get(), dev->port, dev->gid, mine.qp.psn, theirs_hello->qp, peer_cfg);
  if (!up.is_ok()) {
    qp->reset();
    cleanup();
    return up;
  }
  Counters::add(counters_->connections_opened);
  return std::make_shared<VerbsEndpoint>(dev, theirs.node_guid, channel, std::move(cq), std::move(qp).value(),
                                         std::move(sock), options_);
}

}  // namespace
}  // namespace kvstash::transport::verbs

namespace kvstash::transport {

Result<std::unique_ptr<Transport>> make_verbs_transport(const VerbsOptions& options,
                                                        std::string cluster_token) {
  KVSTASH_ASSIGN_OR_RETURN(auto t, verbs::VerbsTransport::create(options, std::move(cluster_token)));
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace kvstash::transport

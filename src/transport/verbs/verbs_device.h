// RDMA devices as the verbs transport sees them: discovery of devices, ports, link layers and
// GID tables, the choice of a port and GID for a connection, and RAII owners for every verbs
// handle. Control path only; nothing here is on the datapath.
//
// Thread safety: discovery is a pure function of the system; the owners are plain values.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/status.h"

namespace kvstash::transport::verbs {

// ---- RAII owners ----------------------------------------------------------------------------

struct ContextCloser {
  void operator()(ibv_context* c) const { ibv_close_device(c); }
};
struct PdDeleter {
  void operator()(ibv_pd* p) const { ibv_dealloc_pd(p); }
};
struct MrDeleter {
  void operator()(ibv_mr* m) const { ibv_dereg_mr(m); }
};
struct CqDeleter {
  void operator()(ibv_cq* c) const { ibv_destroy_cq(c); }
};
struct QpDeleter {
  void operator()(ibv_qp* q) const { ibv_destroy_qp(q); }
};
struct MwDeleter {
  void operator()(ibv_mw* w) const { ibv_dealloc_mw(w); }
};
using Context = std::unique_ptr<ibv_context, ContextCloser>;
using Pd = std::unique_ptr<ibv_pd, PdDeleter>;
using Mr = std::unique_ptr<ibv_mr, MrDeleter>;
using Cq = std::unique_ptr<ibv_cq, CqDeleter>;
using Qp = std::unique_ptr<ibv_qp, QpDeleter>;
using Mw = std::unique_ptr<ibv_mw, MwDeleter>;

// ---- discovery ------------------------------------------------------------------------------

enum class GidType : std::uint8_t { kIb, kRoceV1, kRoceV2 };

struct Gid {
  std::uint32_t index = 0;
  GidType type = GidType::kIb;
  ibv_gid gid{};
  bool ipv4_mapped() const;       // ::ffff:a.b.c.d
  std::string to_string() const;  // "::ffff:192.168.77.1"
};

struct Port {
  std::uint8_t number = 0;  // 1-based, as verbs counts
  bool active = false;
  bool ethernet = false;  // RoCE; otherwise InfiniBand
  std::uint16_t lid = 0;  // InfiniBand only
  ibv_mtu active_mtu = IBV_MTU_1024;
  std::vector<Gid> gids;  // the populated entries
};

struct Device {
  std::string name;  // "mlx5_0", "rxe0"
  std::uint64_t node_guid = 0;
  int numa_node = -1;  // from sysfs; -1 when unknown
  // The limits the datapath sizes itself by.
  int max_qp_wr = 0;
  int max_sge = 0;
  int max_sge_rd = 0;
  int max_qp_rd_atom = 0;
  int max_mw = 0;         // memory windows
  bool mw_type2 = false;  // type-2B windows (bound per queue pair): revocable keys per lease
  bool odp_rc = false;    // on-demand paging for RC READ and WRITE
  std::uint64_t max_mr_size = 0;
  std::uint32_t max_msg_sz = 0;  // of the first active port
  std::vector<Port> ports;
};

// Every device with at least one port, in the order verbs lists them. `only`: device names to
// keep (empty: all); KVSTASH_RDMA_DEVICES ("mlx5_0,mlx5_1" or "auto") applies when `only` is
// empty. A machine without RDMA gives an empty list, not an error. Errors: kIoError when a
// device cannot be opened or queried.
Result<std::vector<Device>> discover(const std::vector<std::string>& only = {});

// Which GID a connection from this port should use. RoCE: a RoCE v2 GID of the wanted family
// (IPv4-mapped unless `ipv6`), the one whose address is `ip` when given; InfiniBand: index 0.
// nullopt when the port has none that fits.
std::optional<Gid> pick_gid(const Port& port, bool ipv6 = false, std::string_view ip = {});

// Which devices to use, as indices into `devices` in their own order: all of them, or with
// `max` > 0 the first `max` preferring those on NUMA node `numa` (-1: unknown, no preference).
std::vector<std::size_t> choose_devices(const std::vector<Device>& devices, int numa, std::size_t max);

// Which lane of a striped connection carries an op the engine dealt to lane `lane`.
// `lane_devices[i]` is the index (in the transport's device list) of lane i's device;
// `preferred` has bit d set for each device d the op's local memory prefers (the NICs nearest
// the GPU that owns it; 0: none). Without a preference, or when no lane runs on a preferred
// device, lane `lane` modulo the lanes; otherwise the preferred lanes take the engine's lanes
// in turn. Allocates nothing: called on the datapath. Precondition: lane_devices is not empty.
std::size_t pick_lane(std::span<const std::size_t> lane_devices, std::uint64_t preferred, std::uint32_t lane);

// The NUMA node of the CPU this thread runs on, from sysfs; -1 when unknown.
int numa_node_of_this_thread();

// Opens a device by name. kNotFound when there is none of that name.
Result<Context> open_device(std::string_view name);

// Whether a GID is an IPv4-mapped address (::ffff:a.b.c.d): a RoCE v2 IPv4 GID.
bool ipv4_mapped(const ibv_gid& gid);

// "1024" for IBV_MTU_1024, ...
int mtu_bytes(ibv_mtu mtu);

// A 24-bit packet sequence number from the kernel's CSPRNG: a connection's PSNs must not be
// guessable or repeat across connections.
std::uint32_t random_psn();

}  // namespace kvstash::transport::verbs

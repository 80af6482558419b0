// The verbs transport in the registry: its start and its look at this host (each RDMA
// device's ports: link layer, state, NUMA node, GID, memory windows).
#include <filesystem>

#include "transport/registry.h"
#include "transport/verbs/verbs_device.h"
#include "transport/verbs/verbs_library.h"
#include "transport/verbs/verbs_transport.h"

namespace kvstash::transport::verbs {
namespace {

Result<std::unique_ptr<Transport>> start(const EngineOptions& options) {
  if (!library().available()) return Status::unsupported("verbs transport unavailable: " + library().error());
  return make_verbs_transport(options.verbs, options.cluster_token);
}

std::vector<TransportFinding> probe() {
  using Level = TransportFinding::Level;
  if (!library().available()) {
    return {{"rdma", Level::kWarn, "verbs transport unavailable: " + library().error(),
             "without RDMA hardware tcp is the transport to use; with it, install rdma-core"}};
  }
  auto devices = discover();
  if (!devices.is_ok()) {
    return {{"rdma", Level::kWarn, "cannot query RDMA devices: " + devices.status().message(),
             "check permissions on /dev/infiniband (group rdma) and the rdma-core providers"}};
  }
  if (devices->empty()) {
    return {
        {"rdma", Level::kWarn,
         "no RDMA device: this host reaches memory nodes over shm and tcp only (no one-sided transfers, no "
         "GPUDirect)",
         std::filesystem::exists("/sys/class/infiniband")
             ? "load the NIC's RDMA driver (mlx5_ib, irdma, bnxt_re) or Soft-RoCE: rdma link add rxe0 type "
               "rxe "
               "netdev eth0"
             : "this kernel has no InfiniBand/RDMA support loaded (modprobe ib_core); without RDMA hardware "
               "tcp is the transport to use"}};
  }
  std::vector<TransportFinding> out;
  for (const auto& d : *devices) {
    for (const auto& p : d.ports) {
      std::string detail = std::string(p.ethernet ? "RoCE" : "InfiniBand") + ", " +
                           (p.active ? "active" : "down") + ", NUMA " + std::to_string(d.numa_node);
      if (auto g = pick_gid(p); g) {
        detail += ", GID " + std::to_string(g->index) + " " + g->to_string();
      } else if (p.ethernet) {
        detail += ", no RoCE v2 IPv4 GID";
      }
      detail += d.mw_type2 ? ", type-2 memory windows (per-lease keys)" : ", no type-2 memory windows";
      out.push_back(
          {"rdma " + d.name + " port " + std::to_string(p.number), p.active ? Level::kOk : Level::kWarn,
           detail,
           p.active ? "" : "bring the link up (ip link set <netdev> up; check the cable and switch port)"});
    }
  }
  return out;
}

}  // namespace

const Plugin& plugin() {
  static const Plugin p{TransportKind::kVerbs, &start, &probe};
  return p;
}

}  // namespace kvstash::transport::verbs

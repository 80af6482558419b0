#include "transport/verbs/verbs_device.h"

#include <arpa/inet.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/system.h"

namespace kvstash::transport::verbs {
namespace {

struct DeviceListDeleter {
  void operator()(ibv_device** l) const { ibv_free_device_list(l); }
};

std::vector<std::string> split_names(std::string_view list) {
  std::vector<std::string> out;
  std::stringstream in{std::string(list)};
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int numa_node_of(const char* ibdev_path) {
  std::ifstream f(std::string(ibdev_path) + "/device/numa_node");
  int node = -1;
  if (f >> node) return node;
  return -1;
}

bool wanted(const std::vector<std::string>& only, const char* name) {
  if (only.empty()) return true;
  for (const auto& n : only) {
    if (n == name) return true;
  }
  return false;
}

Status query_device(ibv_context* ctx, Device& d) {
  ibv_device_attr attr{};
  if (int rc = ibv_query_device(ctx, &attr); rc != 0)
    return Status::from_errno("verbs: query device " + d.name, rc);
  d.node_guid = attr.node_guid;
  d.max_qp_wr = attr.max_qp_wr;
  d.max_sge = attr.max_sge;
  d.max_sge_rd = attr.max_sge_rd;
  d.max_qp_rd_atom = attr.max_qp_rd_atom;
  d.max_mw = attr.max_mw;
  d.mw_type2 = d.max_mw > 0 && (attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0;
  d.max_mr_size = attr.max_mr_size;
  ibv_device_attr_ex ex{};
  if (ibv_query_device_ex(ctx, nullptr, &ex) == 0) {
    const std::uint32_t rc_odp = ex.odp_caps.per_transport_caps.rc_odp_caps;
    const std::uint32_t need = IBV_ODP_SUPPORT_READ | IBV_ODP_SUPPORT_WRITE;
    d.odp_rc = (ex.odp_caps.general_caps & IBV_ODP_SUPPORT) != 0 && (rc_odp & need) == need;
  }
  for (std::uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
    ibv_port_attr pa{};
    if (int rc = ibv_query_port(ctx, p, &pa); rc != 0) return Status::from_errno("verbs: query port", rc);
    Port port;
    port.number = p;
    port.active = pa.state == IBV_PORT_ACTIVE;
    port.ethernet = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
    port.lid = pa.lid;
    port.active_mtu = pa.active_mtu;
    if (d.max_msg_sz == 0 && port.active) d.max_msg_sz = pa.max_msg_sz;
    for (int i = 0; i < pa.gid_tbl_len; ++i) {
      ibv_gid_entry e{};
      if (ibv_query_gid_ex(ctx, p, static_cast<std::uint32_t>(i), &e, 0) != 0) continue;  // empty slot
      Gid g;
      g.index = e.gid_index;
      g.gid = e.gid;
      g.type = e.gid_type == IBV_GID_TYPE_ROCE_V2   ? GidType::kRoceV2
               : e.gid_type == IBV_GID_TYPE_ROCE_V1 ? GidType::kRoceV1
                                                    : GidType::kIb;
      port.gids.push_back(g);
    }
    d.ports.push_back(std::move(port));
  }
  return {};
}

}  // namespace

bool ipv4_mapped(const ibv_gid& gid) {
  static constexpr std::uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(gid.raw, kPrefix, sizeof kPrefix) == 0;
}

bool Gid::ipv4_mapped() const { return verbs::ipv4_mapped(gid); }

std::string Gid::to_string() const {
  char buf[INET6_ADDRSTRLEN] = {};
  inet_ntop(AF_INET6, gid.raw, buf, sizeof buf);
  return buf;
}

Result<std::vector<Device>> discover(const std::vector<std::string>& only_in) {
  std::vector<std::string> only = only_in;
  if (only.empty()) {
    if (const char* env = std::getenv("KVSTASH_RDMA_DEVICES");
        env != nullptr && std::string_view(env) != "auto") {
      only = split_names(env);
    }
  }
  int n = 0;
  std::unique_ptr<ibv_device*, DeviceListDeleter> list(ibv_get_device_list(&n));
  std::vector<Device> out;
  if (!list) {
    // No verbs kernel support at all (ENOSYS) is the same as no device here.
    if (errno == ENOSYS || errno == 0) return out;
    return Status::from_errno("verbs: list devices", errno);
  }
  for (int i = 0; i < n; ++i) {
    ibv_device* dev = list.get()[i];
    const char* name = ibv_get_device_name(dev);
    if (!wanted(only, name)) continue;
    Context ctx(ibv_open_device(dev));
    if (!ctx) return Status::from_errno(std::string("verbs: open ") + name, errno);
    Device d;
    d.name = name;
    d.numa_node = numa_node_of(dev->ibdev_path);
    KVSTASH_RETURN_IF_ERROR(query_device(ctx.get(), d));
    if (!d.ports.empty()) out.push_back(std::move(d));
  }
  return out;
}

std::optional<Gid> pick_gid(const Port& port, bool ipv6, std::string_view ip) {
  if (!port.ethernet) {
    for (const Gid& g : port.gids) {
      if (g.index == 0) return g;
    }
    return std::nullopt;
  }
  std::optional<Gid> best;
  for (const Gid& g : port.gids) {
    if (g.type != GidType::kRoceV2 || g.ipv4_mapped() == ipv6) continue;
    if (!ip.empty()) {
      std::string s = g.to_string();
      // The IPv4-mapped form prints as ::ffff:a.b.c.d.
      if (s != ip && s != "::ffff:" + std::string(ip)) continue;
      return g;
    }
    if (!best) best = g;
  }
  return best;
}

std::vector<std::size_t> choose_devices(const std::vector<Device>& devices, int numa, std::size_t max) {
  std::vector<std::size_t> all(devices.size());
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
  if (max == 0 || max >= all.size()) return all;
  // The local node's devices first (stable), the first `max` of those kept in list order:
  // the list order is the rail order peers pair devices by.
  std::vector<std::size_t> ranked = all;
  std::stable_sort(ranked.begin(), ranked.end(), [&](std::size_t a, std::size_t b) {
    return (numa >= 0 && devices[a].numa_node == numa) > (numa >= 0 && devices[b].numa_node == numa);
  });
  ranked.resize(max);
  std::sort(ranked.begin(), ranked.end());
  return ranked;
}

std::size_t pick_lane(std::span<const std::size_t> lane_devices, std::uint64_t preferred,
                      std::uint32_t lane) {
  auto is_preferred = [&](std::size_t dev) { return dev < 64 && (preferred >> dev & 1) != 0; };
  std::size_t n = 0;
  for (std::size_t d : lane_devices) n += is_preferred(d);
  if (n == 0) return lane % lane_devices.size();
  std::size_t k = lane % n;
  for (std::size_t i = 0; i < lane_devices.size(); ++i) {
    if (is_preferred(lane_devices[i]) && k-- == 0) return i;
  }
  return lane % lane_devices.size();  // not reached
}

int numa_node_of_this_thread() {
  const int cpu = sched_getcpu();
  if (cpu < 0) return -1;
  const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 4 && name.compare(0, 4, "node") == 0 &&
        name.find_first_not_of("0123456789", 4) == std::string::npos) {
      return std::stoi(name.substr(4));
    }
  }
  return -1;
}

Result<Context> open_device(std::string_view name) {
  int n = 0;
  std::unique_ptr<ibv_device*, DeviceListDeleter> list(ibv_get_device_list(&n));
  for (int i = 0; list && i < n; ++i) {
    if (name == ibv_get_device_name(list.get()[i])) {
      Context ctx(ibv_open_device(list.get()[i]));
      if (!ctx) return Status::from_errno("verbs: open " + std::string(name), errno);
      return ctx;
    }
  }
  return Status::not_found("verbs: no RDMA device named " + std::string(name));
}

int mtu_bytes(ibv_mtu mtu) {
  switch (mtu) {
    case IBV_MTU_256: return 256;
    case IBV_MTU_512: return 512;
    case IBV_MTU_1024: return 1024;
    case IBV_MTU_2048: return 2048;
    case IBV_MTU_4096: return 4096;
  }
  return 0;
}

std::uint32_t random_psn() { return static_cast<std::uint32_t>(sys::random_u64()) & 0xffffff; }

}  // namespace kvstash::transport::verbs

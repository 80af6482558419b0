// Where PCI devices sit relative to each other, read from sysfs: how far an RDMA NIC is from
// the GPU whose memory it moves, so that each GPU's memory goes through its nearest NIC(s).
//
// Every function takes the sysfs root as a parameter ("/sys" by default) so that tests pass a
// synthetic tree under a temporary directory. Only files are read (no verbs, no CUDA); a file
// or link that is missing or malformed makes the answer unknown, never an error.
//
// Thread safety: pure functions of the file system; call them from any thread.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvstash::pci {

inline constexpr std::string_view kSysfs = "/sys";

// A PCI function's address: domain:bus:device.function. Ordered as the bus enumerates.
struct Address {
  std::uint32_t domain = 0;
  std::uint8_t bus = 0;
  std::uint8_t device = 0;    // 0..31
  std::uint8_t function = 0;  // 0..7
  auto operator<=>(const Address&) const = default;
};

// Parses "0000:3b:00.0" (sysfs), "00000000:3B:00.0" (CUDA, nvidia-smi) or "3b:00.0" (domain
// 0); hex digits of either case. nullopt for anything else.
std::optional<Address> parse_address(std::string_view text);
// "0000:3b:00.0": lowercase, the domain in at least four digits, as sysfs names devices.
std::string to_string(const Address& a);

// How far apart two PCI devices are, nearest first; the classes of NCCL and `nvidia-smi topo`.
enum class Distance : std::uint8_t {
  kSelf,     // the same device
  kPix,      // at most one PCIe bridge between them (the same PCIe switch)
  kPxb,      // several bridges (switches behind switches), but not the host bridge
  kPhb,      // through the PCIe host bridge (the same root complex, different root ports)
  kNode,     // through the interconnect between host bridges of one NUMA node
  kSys,      // through the interconnect between NUMA nodes (or a node is not known)
  kUnknown,  // a device's place in the PCI tree is not known (virtual, missing from sysfs)
};
// "X", "PIX", "PXB", "PHB", "NODE", "SYS", "?": the names `nvidia-smi topo -m` prints.
std::string_view to_string(Distance d);

// The canonical sysfs path of PCI device `a` (/sys/bus/pci/devices/<bdf> resolved, e.g.
// /sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0); nullopt when sysfs has no such device.
std::optional<std::filesystem::path> device_path(const Address& a,
                                                 const std::filesystem::path& sysfs = kSysfs);

// The canonical sysfs path of the PCI device behind RDMA device `name`
// (/sys/class/infiniband/<name>/device resolved). A software device (rxe, siw) has none of its
// own: the PCI device of the network interface it runs on (its `parent`) stands for it. The
// path ends at the PCI function (a virtio device's own node below it is dropped). nullopt
// when neither leads to a PCI device.
std::optional<std::filesystem::path> rdma_device_path(std::string_view name,
                                                      const std::filesystem::path& sysfs = kSysfs);

// The NUMA node in `device`/numa_node (a sysfs device directory); -1 when unknown.
int numa_node(const std::filesystem::path& device);

// The distance between two devices given by their canonical sysfs paths (device_path,
// rdma_device_path). Same host bridge (the /sys/devices/pciDDDD:BB directory): PIX when each
// is at most one bridge below the deepest bridge they share, PXB when they share a bridge but
// one is further below it, PHB when they share none. Different host bridges: NODE when both
// numa_node files name the same node (both -1 counts as one node: a machine without NUMA),
// SYS otherwise. kUnknown when a path is not under a PCI host bridge.
Distance distance(const std::filesystem::path& a, const std::filesystem::path& b);

// The NVIDIA GPUs sysfs lists (vendor 0x10de, class 0x0302xx 3D controller or 0x0300xx VGA),
// sorted by address: the order CUDA numbers devices in with CUDA_DEVICE_ORDER=PCI_BUS_ID and
// no CUDA_VISIBLE_DEVICES (CUDA's default order puts the fastest first instead).
std::vector<Address> gpus(const std::filesystem::path& sysfs = kSysfs);

// The RDMA devices sysfs lists (/sys/class/infiniband), sorted by name.
std::vector<std::string> rdma_devices(const std::filesystem::path& sysfs = kSysfs);

// The distance from GPU `gpu` to each RDMA device of `nics`, in their order (kUnknown for one
// whose PCI device, or the GPU's, is not found).
std::vector<Distance> distances(const Address& gpu, std::span<const std::string> nics,
                                const std::filesystem::path& sysfs = kSysfs);

struct Ranked {
  std::string name;
  Distance distance = Distance::kUnknown;
};
// `nics` nearest to `gpu` first; ties keep their order in `nics`.
std::vector<Ranked> rank_nics(const Address& gpu, std::span<const std::string> nics,
                              const std::filesystem::path& sysfs = kSysfs);

// The NICs to prefer, given each one's distance: the indices of those in the nearest class
// when that class is known and strictly nearer than some other NIC's, ascending. Empty when
// there is nothing to prefer (no NICs, all equally far, or the nearest is unknown): then every
// NIC is as good as another.
std::vector<std::size_t> nearest(std::span<const Distance> d);

}  // namespace kvstash::pci

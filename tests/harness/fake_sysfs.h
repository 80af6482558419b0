// A fake sysfs tree for tests of common/pci_topology.h and `kvstash doctor`'s GPU x NIC matrix:
// directories, relative symlinks and attribute files laid out as the kernel lays them out
// (/sys/devices/pci<domain>:<bus>/<root port>/.../<device>, /sys/bus/pci/devices/<bdf>,
// /sys/class/infiniband/<name>, /sys/class/net/<name>), with no device behind any of it.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

namespace kvstash::test {

class FakeSysfs {
 public:
  // PCI class codes as sysfs prints them.
  static constexpr const char* kBridge = "0x060400";
  static constexpr const char* k3dController = "0x030200";
  static constexpr const char* kVga = "0x030000";
  static constexpr const char* kEthernet = "0x020000";
  static constexpr const char* kInfiniband = "0x020700";
  static constexpr const char* kNvidia = "0x10de";
  static constexpr const char* kMellanox = "0x15b3";
  static constexpr const char* kIntel = "0x8086";

  // Creates an empty tree at `root` (removed first if it exists), removed again on destruction.
  explicit FakeSysfs(std::filesystem::path root) : root_(std::move(root)) {
    std::error_code ignored;
    std::filesystem::remove_all(root_, ignored);
    std::filesystem::create_directories(root_);
  }
  ~FakeSysfs() {
    std::error_code ignored;
    std::filesystem::remove_all(root_, ignored);
  }
  FakeSysfs(const FakeSysfs&) = delete;
  FakeSysfs& operator=(const FakeSysfs&) = delete;

  const std::filesystem::path& root() const { return root_; }

  // A PCI device below host bridge `bridge` ("pci0000:3a"): `chain` names the functions from
  // the root port down to the device ({"0000:3a:00.0", "0000:3b:00.0", ...}). Each gets its
  // directory, its /sys/bus/pci/devices link and, unless it has them already, class, vendor
  // and numa_node files (the ones above the device are Intel bridges). Returns the device's
  // directory.
  std::filesystem::path pci(const std::string& bridge, const std::vector<std::string>& chain, const char* cls,
                            const char* vendor, int numa) {
    std::filesystem::path dir = root_ / "devices" / bridge;
    for (std::size_t i = 0; i < chain.size(); ++i) {
      dir /= chain[i];
      std::filesystem::create_directories(dir);
      const bool last = i + 1 == chain.size();
      if (!std::filesystem::exists(dir / "class")) {
        write(dir / "class", last ? cls : kBridge);
        write(dir / "vendor", last ? vendor : kIntel);
        write(dir / "numa_node", std::to_string(numa));
      }
      link(root_ / "bus/pci/devices" / chain[i], dir);
    }
    return dir;
  }

  // RDMA device `name` of PCI device `device` (a directory pci() returned), as mlx5_ib makes it.
  void rdma(const std::string& name, const std::filesystem::path& device) {
    const auto dir = device / "infiniband" / name;
    std::filesystem::create_directories(dir);
    link(dir / "device", device);
    link(root_ / "class/infiniband" / name, dir);
  }

  // Network interface `name` of `device` (a directory pci() returned, or below one: virtio).
  void net(const std::string& name, const std::filesystem::path& device) {
    const auto dir = device / "net" / name;
    std::filesystem::create_directories(dir);
    link(dir / "device", device);
    link(root_ / "class/net" / name, dir);
  }

  // A software RDMA device (rxe, siw) on network interface `parent` ("" for none), as the
  // kernel makes it: a virtual device with no PCI device of its own.
  void soft_rdma(const std::string& name, const std::string& parent) {
    const auto dir = root_ / "devices/virtual/infiniband" / name;
    std::filesystem::create_directories(dir);
    if (!parent.empty()) write(dir / "parent", parent);
    link(root_ / "class/infiniband" / name, dir);
  }

  static void write(const std::filesystem::path& file, const std::string& line) {
    std::ofstream(file) << line << "\n";
  }

 private:
  // A relative link, as sysfs has them (so that the tree still resolves wherever it lies).
  static void link(const std::filesystem::path& at, const std::filesystem::path& target) {
    std::filesystem::create_directories(at.parent_path());
    std::error_code ignored;
    std::filesystem::remove(at, ignored);
    std::filesystem::create_directory_symlink(std::filesystem::relative(target, at.parent_path()), at);
  }

  std::filesystem::path root_;
};

}  // namespace kvstash::test

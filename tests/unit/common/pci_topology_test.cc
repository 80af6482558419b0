// PCIe distances between GPUs and RDMA NICs (common/pci_topology.h), on fake sysfs trees laid
// out as real two-socket servers lay them out. Pure logic over files: runs on every machine.
#include "common/pci_topology.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include "fake_sysfs.h"

namespace kvstash::pci {
namespace {

using test::FakeSysfs;
using D = Distance;

Address at(const char* text) {
  const auto a = parse_address(text);
  EXPECT_TRUE(a) << text;
  return a.value_or(Address{});
}

// Two sockets, GPUs and NICs as on a typical 4-GPU server:
//   socket 0 (node 0): host bridge pci0000:17, root port 17:00.0 -> switch (18:00.0, downstream
//     ports 19:00.0 and 19:04.0) -> GPU0 1a:00.0 and mlx5_0 1b:00.0; root port 17:02.0 ->
//     mlx5_1 1c:00.0. Host bridge pci0000:3a: root port 3a:00.0 -> GPU1 3b:00.0.
//   socket 1 (node 1): host bridge pci0000:85, root port 85:00.0 -> switch (86:00.0 / 87:00.0,
//     87:08.0) -> a second switch (88:00.0 / 89:00.0) -> GPU2 8a:00.0, and mlx5_2 8b:00.0 on
//     87:08.0. Host bridge pci0000:ae: switch (af:00.0 / b0:00.0, b0:04.0) -> GPU3 b1:00.0 and
//     mlx5_3 b2:00.0.
//   Also: the BMC's VGA (ASPEED), an NVSwitch (NVIDIA, class 0x0680) and GPU0's audio function,
//   none of them a GPU; rxe0 on a virtio NIC, siw0 on no interface.
class PciTopology : public ::testing::Test {
 protected:
  PciTopology() : sys_(std::filesystem::temp_directory_path() / ("kvstash-pci-" + std::to_string(getpid()))) {
    gpu0_ = sys_.pci("pci0000:17", {"0000:17:00.0", "0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"},
                     FakeSysfs::k3dController, FakeSysfs::kNvidia, 0);
    sys_.pci("pci0000:17", {"0000:17:00.0", "0000:18:00.0", "0000:19:00.0", "0000:1a:00.1"}, "0x040300",
             FakeSysfs::kNvidia, 0);
    sys_.rdma("mlx5_0",
              sys_.pci("pci0000:17", {"0000:17:00.0", "0000:18:00.0", "0000:19:04.0", "0000:1b:00.0"},
                       FakeSysfs::kInfiniband, FakeSysfs::kMellanox, 0));
    sys_.rdma("mlx5_1", sys_.pci("pci0000:17", {"0000:17:02.0", "0000:1c:00.0"}, FakeSysfs::kEthernet,
                                 FakeSysfs::kMellanox, 0));
    gpu1_ = sys_.pci("pci0000:3a", {"0000:3a:00.0", "0000:3b:00.0"}, FakeSysfs::k3dController,
                     FakeSysfs::kNvidia, 0);
    gpu2_ = sys_.pci(
        "pci0000:85",
        {"0000:85:00.0", "0000:86:00.0", "0000:87:00.0", "0000:88:00.0", "0000:89:00.0", "0000:8a:00.0"},
        FakeSysfs::k3dController, FakeSysfs::kNvidia, 1);
    sys_.rdma("mlx5_2",
              sys_.pci("pci0000:85", {"0000:85:00.0", "0000:86:00.0", "0000:87:08.0", "0000:8b:00.0"},
                       FakeSysfs::kInfiniband, FakeSysfs::kMellanox, 1));
    gpu3_ = sys_.pci("pci0000:ae", {"0000:ae:00.0", "0000:af:00.0", "0000:b0:00.0", "0000:b1:00.0"},
                     FakeSysfs::kVga, FakeSysfs::kNvidia, 1);
    sys_.rdma("mlx5_3",
              sys_.pci("pci0000:ae", {"0000:ae:00.0", "0000:af:00.0", "0000:b0:04.0", "0000:b2:00.0"},
                       FakeSysfs::kInfiniband, FakeSysfs::kMellanox, 1));
    sys_.pci("pci0000:00", {"0000:00:1c.0", "0000:02:00.0"}, FakeSysfs::kVga, "0x1a03", 0);
    sys_.pci("pci0000:17", {"0000:17:04.0", "0000:1d:00.0"}, "0x068000", FakeSysfs::kNvidia, 0);
    const auto virtio =
        sys_.pci("pci0000:00", {"0000:00:03.0"}, FakeSysfs::kEthernet, "0x1af4", 0) / "virtio2";
    std::filesystem::create_directories(virtio);
    sys_.net("eth0", virtio);
    sys_.soft_rdma("rxe0", "eth0");
    sys_.soft_rdma("siw0", "");
  }

  const std::filesystem::path& root() const { return sys_.root(); }
  std::filesystem::path canonical(const std::filesystem::path& p) const {
    return std::filesystem::canonical(p);
  }

  FakeSysfs sys_;
  std::filesystem::path gpu0_, gpu1_, gpu2_, gpu3_;
  const std::vector<std::string> nics_{"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"};
};

TEST(PciAddress, ParsesTheSysfsAndCudaFormsAndPrintsTheSysfsOne) {
  const auto a = parse_address("0000:3b:00.0");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->domain, 0u);
  EXPECT_EQ(a->bus, 0x3b);
  EXPECT_EQ(a->device, 0);
  EXPECT_EQ(a->function, 0);
  EXPECT_EQ(parse_address("00000000:3B:00.0"), a) << "cuDeviceGetPCIBusId, nvidia-smi";
  EXPECT_EQ(parse_address("3b:00.0"), a) << "lspci without -D: domain 0";
  EXPECT_EQ(to_string(*a), "0000:3b:00.0");
  EXPECT_EQ(to_string(at("10000:e1:1f.7")), "10000:e1:1f.7") << "VMD domains are wider";
  EXPECT_EQ(at("0001:00:00.1"), (Address{1, 0, 0, 1}));
  EXPECT_LT(at("0000:3b:00.0"), at("0000:3b:00.1"));
  EXPECT_LT(at("0000:3b:1f.0"), at("0000:86:00.0"));
  EXPECT_LT(at("0000:ff:00.0"), at("0001:00:00.0"));
  for (const char* bad :
       {"", "3b:00", "0000:3b:00.8", "0000:3b:20.0", "0000:3b:00.", "000:3b:00.0", "0000:3b:00.0.0",
        "0000:3g:00.0", "0000:3b:0.0", "pci0000:3a", "000000000:3b:00.0"}) {
    EXPECT_FALSE(parse_address(bad)) << bad;
  }
}

TEST(PciDistance, NamesAreNvidiaSmiTopos) {
  EXPECT_EQ(to_string(D::kSelf), "X");
  EXPECT_EQ(to_string(D::kPix), "PIX");
  EXPECT_EQ(to_string(D::kPxb), "PXB");
  EXPECT_EQ(to_string(D::kPhb), "PHB");
  EXPECT_EQ(to_string(D::kNode), "NODE");
  EXPECT_EQ(to_string(D::kSys), "SYS");
  EXPECT_EQ(to_string(D::kUnknown), "?");
}

TEST_F(PciTopology, DevicePathsResolveTheBusLinksAndTheRdmaDevices) {
  EXPECT_EQ(device_path(at("0000:1a:00.0"), root()), canonical(gpu0_));
  EXPECT_EQ(device_path(at("00000000:8A:00.0"), root()), canonical(gpu2_));
  EXPECT_FALSE(device_path(at("0000:99:00.0"), root())) << "no such device";
  EXPECT_EQ(rdma_device_path("mlx5_0", root()), canonical(root() / "bus/pci/devices/0000:1b:00.0"));
  EXPECT_EQ(rdma_device_path("rxe0", root()), canonical(root() / "bus/pci/devices/0000:00:03.0"))
      << "a soft device stands where its interface's PCI function is (not the virtio node below it)";
  EXPECT_FALSE(rdma_device_path("siw0", root())) << "no interface, no PCI device";
  EXPECT_FALSE(rdma_device_path("mlx5_9", root()));
  EXPECT_FALSE(rdma_device_path("../infiniband/mlx5_0", root())) << "a name cannot walk out of its directory";
  EXPECT_FALSE(rdma_device_path("..", root()));
  EXPECT_EQ(numa_node(gpu2_), 1);
  EXPECT_EQ(numa_node(root() / "devices/virtual/infiniband/siw0"), -1);
}

TEST_F(PciTopology, DistancesFollowThePciTreeAndTheNumaNodes) {
  auto nic = [&](const char* name) { return *rdma_device_path(name, root()); };
  const auto g0 = canonical(gpu0_), g1 = canonical(gpu1_), g2 = canonical(gpu2_), g3 = canonical(gpu3_);
  EXPECT_EQ(distance(g0, g0), D::kSelf);
  EXPECT_EQ(distance(g0, nic("mlx5_0")), D::kPix) << "one switch";
  EXPECT_EQ(distance(nic("mlx5_0"), g0), D::kPix) << "symmetric";
  EXPECT_EQ(distance(g0, nic("mlx5_1")), D::kPhb) << "another root port of the same host bridge";
  EXPECT_EQ(distance(g1, nic("mlx5_0")), D::kNode) << "another host bridge on the same socket";
  EXPECT_EQ(distance(g0, nic("mlx5_2")), D::kSys) << "the other socket";
  EXPECT_EQ(distance(g2, nic("mlx5_2")), D::kPxb) << "a switch behind a switch";
  EXPECT_EQ(distance(g2, nic("mlx5_3")), D::kNode);
  EXPECT_EQ(distance(g3, nic("mlx5_3")), D::kPix);
  EXPECT_EQ(distance(g3, nic("mlx5_0")), D::kSys);
  EXPECT_EQ(distance(g0, canonical(root() / "bus/pci/devices/0000:1a:00.1")), D::kPix)
      << "another function of the same device";
  EXPECT_EQ(distance(g0, canonical(root() / "bus/pci/devices/0000:18:00.0")), D::kPix)
      << "the switch above it";
  EXPECT_EQ(distance(g0, canonical(root() / "devices/virtual/infiniband/siw0")), D::kUnknown);
  EXPECT_EQ(distance(g0, canonical(root() / "devices")), D::kUnknown);

  // A machine whose kernel knows no NUMA (every numa_node -1) is one node: NODE, not SYS.
  FakeSysfs flat(root().string() + "-flat");
  const auto a = flat.pci("pci0000:00", {"0000:00:01.0", "0000:01:00.0"}, FakeSysfs::k3dController,
                          FakeSysfs::kNvidia, -1);
  const auto b = flat.pci("pci0000:40", {"0000:40:01.0", "0000:41:00.0"}, FakeSysfs::kInfiniband,
                          FakeSysfs::kMellanox, -1);
  EXPECT_EQ(distance(canonical(a), canonical(b)), D::kNode);
  FakeSysfs::write(b / "numa_node", "0");
  EXPECT_EQ(distance(canonical(a), canonical(b)), D::kSys) << "one node unknown: not known to be near";
}

TEST_F(PciTopology, GpusAreTheNvidiaDisplayAndThreeDControllersInBusOrder) {
  EXPECT_EQ(gpus(root()), (std::vector<Address>{at("0000:1a:00.0"), at("0000:3b:00.0"), at("0000:8a:00.0"),
                                                at("0000:b1:00.0")}))
      << "not the BMC's VGA, the NVSwitch or the GPU's audio function";
  EXPECT_TRUE(gpus(root() / "nowhere").empty());
  EXPECT_EQ(rdma_devices(root()),
            (std::vector<std::string>{"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "rxe0", "siw0"}));
  EXPECT_TRUE(rdma_devices(root() / "nowhere").empty());
}

TEST_F(PciTopology, RankingPutsTheNearestFirstAndKeepsTiesInTheirOrder) {
  const std::vector<std::string> given{"mlx5_3", "mlx5_2", "mlx5_1", "mlx5_0"};
  const auto r = rank_nics(at("0000:1a:00.0"), given, root());
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0].name, "mlx5_0");
  EXPECT_EQ(r[0].distance, D::kPix);
  EXPECT_EQ(r[1].name, "mlx5_1");
  EXPECT_EQ(r[1].distance, D::kPhb);
  EXPECT_EQ(r[2].name, "mlx5_3") << "SYS ties stay in the given order";
  EXPECT_EQ(r[3].name, "mlx5_2");
  EXPECT_EQ(r[3].distance, D::kSys);

  EXPECT_EQ(distances(at("0000:8a:00.0"), nics_, root()),
            (std::vector<D>{D::kSys, D::kSys, D::kPxb, D::kNode}));
  EXPECT_EQ(distances(at("0000:99:00.0"), nics_, root()), std::vector<D>(4, D::kUnknown)) << "no such GPU";
  const std::vector<std::string> soft{"mlx5_0", "siw0"};
  EXPECT_EQ(distances(at("0000:1a:00.0"), soft, root()), (std::vector<D>{D::kPix, D::kUnknown}));
}

TEST_F(PciTopology, TwoGpusInOneProcessEachGetTheirOwnNearestNic) {
  using Idx = std::vector<std::size_t>;
  EXPECT_EQ(nearest(distances(at("0000:1a:00.0"), nics_, root())), (Idx{0})) << "GPU0: mlx5_0 on its switch";
  EXPECT_EQ(nearest(distances(at("0000:b1:00.0"), nics_, root())), (Idx{3})) << "GPU3: mlx5_3 on its switch";
  EXPECT_EQ(nearest(distances(at("0000:8a:00.0"), nics_, root())), (Idx{2}))
      << "GPU2: mlx5_2, PXB beats NODE";
  EXPECT_EQ(nearest(distances(at("0000:3b:00.0"), nics_, root())), (Idx{0, 1})) << "GPU1: both NODE NICs";
}

TEST(PciNearest, PrefersOnlyAClassStrictlyNearerThanAnother) {
  using Idx = std::vector<std::size_t>;
  EXPECT_EQ(nearest(std::vector<D>{D::kSys, D::kPix, D::kNode, D::kPix}), (Idx{1, 3}));
  EXPECT_TRUE(nearest(std::vector<D>{D::kSys, D::kSys}).empty()) << "all alike: nothing to prefer";
  EXPECT_TRUE(nearest(std::vector<D>{D::kPix}).empty()) << "one NIC: nothing to prefer";
  EXPECT_TRUE(nearest(std::vector<D>{D::kUnknown, D::kUnknown}).empty());
  EXPECT_EQ(nearest(std::vector<D>{D::kUnknown, D::kNode}), (Idx{1})) << "known beats unknown";
  EXPECT_TRUE(nearest(std::vector<D>{}).empty());
}

}  // namespace
}  // namespace kvstash::pci

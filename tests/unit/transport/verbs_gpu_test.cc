// GPUDirect registration up to the NIC, which needs neither a GPU nor an RDMA device: the page
// span a range of GPU memory is exported as (dma-buf takes whole pages only), what the dma-buf
// path asks of the CUDA driver for cudaMalloc memory and for virtual-memory mappings (PyTorch's
// expandable segments), against a fake driver since these machines have none, and the lane that
// carries an op when the peer registered GPU memory on the NICs nearest its GPU only. The
// registration itself (ibv_reg_dmabuf_mr) runs only on a GPU host with a NIC; verbs_test checks
// its refusal on an RDMA device without a GPU.
#include "transport/verbs/verbs_gpu.h"

#include <gtest/gtest.h>
#include <sys/eventfd.h>

#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace kvstash::transport::verbs {
namespace {

constexpr std::uint64_t kPage = 4096;
constexpr std::uint64_t kBase = 0x7f0000000000;  // an allocation on a 2 MiB boundary
constexpr std::uint64_t kSize = 8u << 20;

DmaBufSpan span_of(std::uint64_t addr, std::uint64_t length, std::uint64_t base = kBase,
                   std::uint64_t size = kSize, std::uint64_t page = kPage) {
  auto s = dmabuf_span(addr, length, base, size, page);
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return s.is_ok() ? *s : DmaBufSpan{};
}

void expect_span(const DmaBufSpan& s, std::uint64_t start, std::uint64_t length, std::uint64_t offset) {
  EXPECT_EQ(s.start, start);
  EXPECT_EQ(s.length, length);
  EXPECT_EQ(s.offset, offset);
}

TEST(VerbsGpu, APageAlignedRangeIsExportedAsItIsAtOffsetZero) {
  expect_span(span_of(kBase, kSize), kBase, kSize, 0);  // the whole allocation
  expect_span(span_of(kBase + 3 * kPage, 5 * kPage), kBase + 3 * kPage, 5 * kPage, 0);
}

TEST(VerbsGpu, AnUnalignedRangeIsRoundedOutToPagesAndRegisteredAtItsOffset) {
  // An MLA cache with an odd block count: 576-byte rows, 7 of them, from the allocation's start.
  expect_span(span_of(kBase, 7 * 576), kBase, kPage, 0);
  // Starting and ending inside pages: the export covers both whole pages, the MR starts 0x10 in.
  expect_span(span_of(kBase + 0x10, 0x100), kBase, kPage, 0x10);
  expect_span(span_of(kBase + kPage - 0x10, 0x20), kBase, 2 * kPage, kPage - 0x10);
  // Aligned start, unaligned end; unaligned start, aligned end.
  expect_span(span_of(kBase + kPage, kPage + 1), kBase + kPage, 2 * kPage, 0);
  expect_span(span_of(kBase + kPage + 1, kPage - 1), kBase + kPage, kPage, 1);
  // The caller's bytes always lie inside the export.
  const DmaBufSpan s = span_of(kBase + 12345, 67890);
  EXPECT_LE(s.start, kBase + 12345);
  EXPECT_EQ(s.start + s.offset, kBase + 12345);
  EXPECT_GE(s.start + s.length, kBase + 12345 + 67890);
  EXPECT_EQ(s.start % kPage, 0u);
  EXPECT_EQ(s.length % kPage, 0u);
}

TEST(VerbsGpu, TheSpanStaysInThePagesOfAnAllocationWhoseBoundsAreNotPageAligned) {
  // An allocation of 3.5 pages (its size was not a page multiple): a range in its last, partial
  // page is exported as that whole page (the driver exports whole pages only) and no further.
  const std::uint64_t size = 3 * kPage + kPage / 2;
  expect_span(span_of(kBase + 3 * kPage + 0x100, 0x200, kBase, size), kBase + 3 * kPage, kPage, 0x100);
  // The range that ends exactly at the allocation's end.
  expect_span(span_of(kBase + 2 * kPage + 8, kPage + kPage / 2 - 8, kBase, size), kBase + 2 * kPage,
              2 * kPage, 8);
  // An allocation that starts inside a page (the driver packed it with others): the export starts
  // on that page, and the MR at the range's offset into it.
  expect_span(span_of(kBase + 0x300, 0x40, kBase + 0x200, 0x1000), kBase, kPage, 0x300);
  // Whatever the bounds, the export is whole pages within the allocation's pages.
  for (std::uint64_t a = kBase + 0x200; a < kBase + 0x1200; a += 0x1f0) {
    const DmaBufSpan s = span_of(a, kBase + 0x1200 - a, kBase + 0x200, 0x1000);
    EXPECT_EQ(s.start % kPage, 0u);
    EXPECT_EQ(s.length % kPage, 0u);
    EXPECT_GE(s.start, kBase);
    EXPECT_LE(s.start + s.length, kBase + 2 * kPage);
    EXPECT_EQ(s.start + s.offset, a);
  }
}

TEST(VerbsGpu, ARangeOverSeveralMappingsIsOneSpanOfTheirRun) {
  // PyTorch's expandable segments: 20 MiB chunks mapped back to back; the run of three is the
  // allocation the range is clamped to.
  const std::uint64_t chunk = 20u << 20;
  expect_span(span_of(kBase + chunk - 100, chunk + 200, kBase, 3 * chunk), kBase + chunk - kPage,
              chunk + 2 * kPage, kPage - 100);
}

TEST(VerbsGpu, SixtyFourKibPagesRoundToTheirOwnSize) {
  const std::uint64_t page = 64u << 10;  // aarch64 kernels with 64 KiB pages
  expect_span(span_of(kBase + 0x11000, 0x2000, kBase, kSize, page), kBase + 0x10000, page, 0x1000);
}

TEST(VerbsGpu, RangesOutsideTheAllocationEmptyOrWrappingAreRefused) {
  auto code = [](std::uint64_t addr, std::uint64_t length, std::uint64_t base = kBase,
                 std::uint64_t size = kSize, std::uint64_t page = kPage) {
    return dmabuf_span(addr, length, base, size, page).status().code();
  };
  EXPECT_EQ(code(kBase, 0), StatusCode::kInvalidArgument) << "zero length";
  EXPECT_EQ(code(kBase - 1, 16), StatusCode::kInvalidArgument) << "starts before the allocation";
  EXPECT_EQ(code(kBase + kSize - 8, 16), StatusCode::kInvalidArgument) << "ends past it";
  EXPECT_EQ(code(kBase + kSize, 1), StatusCode::kInvalidArgument) << "lies after it";
  EXPECT_EQ(code(kBase - kPage, kSize + 2 * kPage), StatusCode::kInvalidArgument) << "holds it";
  const std::uint64_t top = std::numeric_limits<std::uint64_t>::max();
  EXPECT_EQ(code(top - 10, 100, top - 20, 15), StatusCode::kInvalidArgument) << "wraps";
  EXPECT_EQ(code(kBase, 16, kBase, kSize, 3000), StatusCode::kInvalidArgument) << "page not a power of 2";
  EXPECT_EQ(code(kBase, 16, kBase, kSize, 0), StatusCode::kInvalidArgument);
  const std::string m = dmabuf_span(kBase + kSize - 8, 16, kBase, kSize, kPage).status().message();
  EXPECT_NE(m.find("runs past the CUDA allocation"), std::string::npos) << m;
}

TEST(VerbsGpu, ARangeInTheLastPageOfTheAddressSpaceIsRefusedNotWrapped) {
  // Rounding its end up to the page would pass 2^64.
  const std::uint64_t top = std::numeric_limits<std::uint64_t>::max();
  const std::uint64_t base = top - 2 * kPage + 1;  // page-aligned
  EXPECT_EQ(dmabuf_span(base + kPage + 5, 10, base, 2 * kPage - 1, kPage).status().code(),
            StatusCode::kInvalidArgument);
  expect_span(span_of(base + 5, 10, base, 2 * kPage - 1), base, kPage, 5);  // the page before is fine
}

// ---- a fake CUDA driver: these machines have no GPU ------------------------------------------

// The memory it knows: cudaMalloc allocations, or virtual-memory mappings (cuMemCreate +
// cuMemMap, one per physical chunk), each reported alone by cuMemGetAddressRange as the real
// driver does; and the exports asked of it.
struct FakeMapping {
  std::uint64_t base = 0, size = 0;
  bool vmm = false;
  bool rdma_capable = true;
};
struct FakeDriver {
  std::vector<FakeMapping> mappings;
  int export_result = 0;  // what cuMemGetHandleForAddressRange returns
  std::vector<std::tuple<std::uint64_t, std::size_t, int, unsigned long long>> exports;
  int handles = 0;  // retained and not released
};
FakeDriver fake;
constexpr int kInvalidValue = 1;    // CUDA_ERROR_INVALID_VALUE
constexpr int kNotSupported = 801;  // CUDA_ERROR_NOT_SUPPORTED

const FakeMapping* fake_find(std::uint64_t p) {
  for (const FakeMapping& m : fake.mappings) {
    if (p >= m.base && p - m.base < m.size) return &m;
  }
  return nullptr;
}

CudaDriver fake_driver() {
  CudaDriver d;
  d.mem_get_address_range = [](unsigned long long* base, std::size_t* size, unsigned long long p) {
    const FakeMapping* m = fake_find(p);
    if (m == nullptr) return kInvalidValue;
    *base = m->base;
    *size = m->size;
    return 0;
  };
  d.mem_retain_allocation_handle = [](unsigned long long* handle, void* addr) {
    const FakeMapping* m = fake_find(reinterpret_cast<std::uintptr_t>(addr));
    if (m == nullptr || !m->vmm) return kInvalidValue;  // cudaMalloc memory has no such handle
    *handle = static_cast<unsigned long long>(m - fake.mappings.data()) + 1;
    ++fake.handles;
    return 0;
  };
  d.mem_get_allocation_properties_from_handle = [](CuMemAllocationProp* prop, unsigned long long handle) {
    prop->gpu_direct_rdma_capable = fake.mappings[handle - 1].rdma_capable ? 1 : 0;
    return 0;
  };
  d.mem_release = [](unsigned long long) {
    --fake.handles;
    return 0;
  };
  d.mem_get_handle_for_address_range = [](void* handle, unsigned long long p, std::size_t size, int type,
                                          unsigned long long flags) {
    fake.exports.emplace_back(p, size, type, flags);
    if (fake.export_result != 0) return fake.export_result;
    *static_cast<int*>(handle) = ::eventfd(0, EFD_CLOEXEC);  // stands in for the dma-buf
    return 0;
  };
  d.get_error_name = [](int error, const char** name) {
    *name = error == kInvalidValue ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_NOT_SUPPORTED";
    return 0;
  };
  return d;
}

class VerbsGpuDriver : public ::testing::Test {
 protected:
  void SetUp() override { fake = FakeDriver{}; }
  void TearDown() override { EXPECT_EQ(fake.handles, 0) << "every retained handle is released"; }
  static constexpr std::uint64_t kChunk = 20u << 20;  // an expandable segment's growth step
};

bool has(const Status& s, std::string_view text) { return s.message().find(text) != std::string::npos; }

TEST_F(VerbsGpuDriver, CudaMallocMemoryIsExportedAsTheWholePagesOfTheRange) {
  fake.mappings = {{kBase, kSize}};
  const CudaDriver d = fake_driver();
  auto plan = plan_dmabuf(d, kBase + 0x10, 0x100, kPage);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_FALSE(plan->vmm);
  EXPECT_EQ(plan->mappings, 1u);
  expect_span(plan->span, kBase, kPage, 0x10);
  auto fd = export_dmabuf(d, *plan);
  ASSERT_TRUE(fd.is_ok()) << fd.status().to_string();
  EXPECT_TRUE(fd->valid());
  ASSERT_EQ(fake.exports.size(), 1u);
  EXPECT_EQ(fake.exports[0], std::make_tuple(kBase, std::size_t{kPage}, 1, 0ull)) << "DMA_BUF_FD, no flags";
}

TEST_F(VerbsGpuDriver, ARangeOverAnExpandableSegmentsChunksIsExportedAsOne) {
  // Three 20 MiB chunks mapped back to back (a fourth elsewhere); the driver reports one at a time.
  fake.mappings = {{kBase, kChunk, true},
                   {kBase + kChunk, kChunk, true},
                   {kBase + 2 * kChunk, kChunk, true},
                   {kBase + 8 * kChunk, kChunk, true}};
  const CudaDriver d = fake_driver();
  auto plan = plan_dmabuf(d, kBase + kChunk / 2, 2 * kChunk, kPage);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_TRUE(plan->vmm);
  EXPECT_EQ(plan->rdma_capable, true);
  EXPECT_EQ(plan->mappings, 3u);
  expect_span(plan->span, kBase + kChunk / 2, 2 * kChunk, 0);
  ASSERT_TRUE(export_dmabuf(d, *plan).is_ok());
  ASSERT_EQ(fake.exports.size(), 1u) << "one dma-buf for the run";
  // A range inside one chunk is one mapping.
  auto one = plan_dmabuf(d, kBase + 8 * kChunk + 3, 10, kPage);
  ASSERT_TRUE(one.is_ok());
  EXPECT_EQ(one->mappings, 1u);
  expect_span(one->span, kBase + 8 * kChunk, kPage, 3);
}

TEST_F(VerbsGpuDriver, AVirtualMemoryRangeWithAHoleIsRefusedNamingTheAllocatorSetting) {
  fake.mappings = {{kBase, kChunk, true}, {kBase + 2 * kChunk, kChunk, true}};  // the middle is unmapped
  auto plan = plan_dmabuf(fake_driver(), kBase + 100, 3 * kChunk - 200, kPage);
  ASSERT_EQ(plan.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(has(plan.status(), "hole")) << plan.status().message();
  EXPECT_TRUE(has(plan.status(), "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"))
      << plan.status().message();
  EXPECT_TRUE(has(plan.status(), "stage")) << plan.status().message();
  EXPECT_TRUE(fake.exports.empty());
}

TEST_F(VerbsGpuDriver, ARangePastItsCudaMallocAllocationIsRefused) {
  // Two cudaMalloc allocations side by side: not one allocation, whatever their addresses.
  fake.mappings = {{kBase, kChunk}, {kBase + kChunk, kChunk}};
  auto plan = plan_dmabuf(fake_driver(), kBase + kChunk - 8, 16, kPage);
  ASSERT_EQ(plan.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(has(plan.status(), "runs past the CUDA allocation")) << plan.status().message();
}

TEST_F(VerbsGpuDriver, AnUnknownAddressOrNoDriverIsRefusedSayingSo) {
  auto unknown = plan_dmabuf(fake_driver(), kBase, 16, kPage);
  ASSERT_EQ(unknown.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(has(unknown.status(), "CUDA_ERROR_INVALID_VALUE")) << unknown.status().message();
  auto none = plan_dmabuf(CudaDriver{}, kBase, 16, kPage);
  ASSERT_EQ(none.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(has(none.status(), "no CUDA driver")) << none.status().message();
}

TEST_F(VerbsGpuDriver, ARefusedExportSaysWhatTheMemoryIs) {
  fake.export_result = kNotSupported;
  fake.mappings = {
      {kBase, kChunk, true}, {kBase + kChunk, kChunk, true}, {kBase + 4 * kChunk, kChunk, true, false}};
  const CudaDriver d = fake_driver();
  // Over two chunks: the allocator setting is named.
  auto run = plan_dmabuf(d, kBase, 2 * kChunk, kPage);
  ASSERT_TRUE(run.is_ok());
  auto refused = export_dmabuf(d, *run);
  ASSERT_EQ(refused.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(has(refused.status(), "CUDA_ERROR_NOT_SUPPORTED")) << refused.status().message();
  EXPECT_TRUE(has(refused.status(), "2 virtual-memory mappings")) << refused.status().message();
  EXPECT_TRUE(has(refused.status(), "expandable_segments:False")) << refused.status().message();
  // One chunk not made GPUDirect-RDMA capable: that is named.
  auto plain = plan_dmabuf(d, kBase + 4 * kChunk, kPage, kPage);
  ASSERT_TRUE(plain.is_ok());
  EXPECT_EQ(plain->rdma_capable, false);
  auto not_capable = export_dmabuf(d, *plain);
  EXPECT_TRUE(has(not_capable.status(), "gpuDirectRDMACapable")) << not_capable.status().message();
}

TEST(VerbsGpu, OpsGoOnlyToLanesTheKeyIsValidOnPreferringTheNearestDevices) {
  const std::vector<std::size_t> four{0, 1, 2, 3};  // lane i on device i
  for (std::uint32_t lane = 0; lane < 8; ++lane) {
    // The peer registered its GPU memory on its devices 1 and 3: our lanes 1 and 3 in turn.
    EXPECT_EQ(pick_keyed_lane(four, 0, 0b1010, lane), lane % 2 == 0 ? 1u : 3u);
    // Our GPU memory is nearest device 3: of those two, lane 3 only.
    EXPECT_EQ(pick_keyed_lane(four, 0b1000, 0b1010, lane), 3u);
    // Nearest device 0, which the key does not reach: the keyed lanes still (the lane's datapath
    // refuses the op should our memory not be registered there).
    EXPECT_EQ(pick_keyed_lane(four, 0b0001, 0b1010, lane), lane % 2 == 0 ? 1u : 3u);
    // A key valid on one lane only.
    EXPECT_EQ(pick_keyed_lane(four, 0b0110, 0b0100, lane), 2u);
  }
  // Lanes whose devices are not in lane order: lane i runs on device lane_devices[i].
  const std::vector<std::size_t> mixed{2, 0, 3};
  EXPECT_EQ(pick_keyed_lane(mixed, 0b0001, 0b011, 7), 1u) << "device 0 is lane 1";
  EXPECT_EQ(pick_keyed_lane(mixed, 0b1000, 0b011, 7), 1u) << "device 3's lane holds no key: lanes 0, 1";
  // No lane keyed (the precondition broken): the engine's lane, never out of range.
  EXPECT_LT(pick_keyed_lane(four, 0, 0, 9), four.size());
  // A key on lanes past the 64th cannot be named: those lanes are never picked.
  std::vector<std::size_t> wide(70);
  for (std::size_t i = 0; i < wide.size(); ++i) wide[i] = i;
  EXPECT_EQ(pick_keyed_lane(wide, 0, std::uint64_t{1} << 63, 5), 63u);
}

}  // namespace
}  // namespace kvstash::transport::verbs

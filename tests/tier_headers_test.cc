// The NVMe tier's headers (src/node/tier_headers.h) on a file tier of this machine's disk: a
// header round-trips as bytes and through the device, a scan after a reopen finds exactly the
// headers written whole (not an erased one, not a torn one, not one with a flipped byte), and
// the header area's blocks are reused once freed.
#include "node/tier_headers.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <optional>
#include <set>

#include "kvstash/memory.h"
#include "node/ssd_device.h"

namespace kvstash::node {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kCapacity = 256 << 20, kPage = 64 << 10;  // a header area of 1 MiB

TierHeader header_of(int i, std::size_t layout_bytes = 100) {
  TierHeader h;
  h.sequence = static_cast<std::uint64_t>(i) + 1;
  h.cell = "default";
  h.key = "session:" + std::to_string(i);
  h.token = "put-" + std::to_string(i * 7);
  h.size = 3 * kPage - 5;
  h.checksum = "0123456789abcdef/1048576";
  h.layout = std::string(layout_bytes, static_cast<char>('a' + i % 26));
  h.epoch = "e1";
  h.generation = 40 + static_cast<std::uint64_t>(i);
  h.runs = {{static_cast<std::uint64_t>(i) * 3, 2}, {1000, 1}};
  return h;
}

class TierHeadersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::current_path() / ("tier-headers-test-" + std::to_string(::getpid()))).string();
    open();
  }
  void TearDown() override {
    area_.reset();
    device_.reset();
    ::unlink(path_.c_str());
  }
  void open() {
    area_.reset();
    device_.reset();
    auto d = SsdDevice::open({.path = path_, .capacity = kCapacity});
    if (d.status().code() == StatusCode::kUnsupported) GTEST_SKIP() << d.status().to_string();
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    device_ = std::move(d).value();
    layout_.emplace(device_->capacity(), kPage, device_->block_size());
    area_ = std::make_unique<HeaderArea>(*device_, *layout_);
  }

  std::string path_;
  std::unique_ptr<SsdDevice> device_;
  std::optional<TierLayout> layout_;
  std::unique_ptr<HeaderArea> area_;
};

TEST(TierHeader, BytesRoundTripAndAnyFlippedByteIsNoHeader) {
  const TierHeader h = header_of(3);
  const std::string bytes = encode_tier_header(h).value();
  auto back = decode_tier_header(bytes + std::string(4096, '\0'));
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->first, h);
  EXPECT_EQ(back->second, bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] = static_cast<char>(bad[i] ^ 0x01);
    EXPECT_FALSE(decode_tier_header(bad).has_value()) << "byte " << i;
  }
  EXPECT_FALSE(decode_tier_header(bytes.substr(0, bytes.size() - 1)).has_value()) << "cut short";
  EXPECT_FALSE(decode_tier_header(std::string(4096, '\0')).has_value());
  TierHeader huge = h;
  huge.layout.assign(kMaxTierHeaderBytes, 'x');
  EXPECT_EQ(encode_tier_header(huge).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(TierHeadersTest, AScanFindsWhatWasWrittenWholeAndNothingElse) {
  EXPECT_EQ(layout_->slots, (kCapacity - layout_->header_blocks * 4096) / kPage);
  std::vector<std::uint64_t> at;
  for (int i = 0; i < 40; ++i) {
    // Some headers span many blocks (a 64 KiB layout): they must survive the scan's chunking.
    auto first = area_->write(header_of(i, i % 5 == 0 ? 64 << 10 : 100), deadline_after(10s));
    ASSERT_TRUE(first.is_ok()) << first.status().to_string();
    at.push_back(*first);
  }
  ASSERT_TRUE(area_->erase(at[7], deadline_after(10s)).is_ok());
  // A torn header: #10 (64 KiB, 17 blocks) written again as a newer header, of which only the
  // first block reached the device; the other 16 are the older header's.
  {
    TierHeader newer = header_of(10, 64 << 10);
    newer.sequence = 999;
    const std::string bytes = encode_tier_header(newer).value();
    Buffer one = Buffer::allocate(4096).value();
    std::memcpy(one.data(), bytes.data(), 4096);
    ASSERT_TRUE(device_->run({{.write = true, .offset = layout_->header_offset(at[10]), .buffer = one.data(),
                               .length = 4096}},
                             deadline_after(10s))
                    .is_ok());
  }
  // A flipped byte in #20's header on the device.
  {
    Buffer block = Buffer::allocate(4096).value();
    ASSERT_TRUE(device_->run({{.write = false, .offset = layout_->header_offset(at[20]), .buffer = block.data(),
                               .length = 4096}},
                             deadline_after(10s))
                    .is_ok());
    block.data()[40] = static_cast<std::byte>(static_cast<unsigned char>(block.data()[40]) ^ 0x80);
    ASSERT_TRUE(device_->run({{.write = true, .offset = layout_->header_offset(at[20]), .buffer = block.data(),
                               .length = 4096}},
                             deadline_after(10s))
                    .is_ok());
  }
  open();  // a restart
  auto found = area_->scan(deadline_after(30s));
  ASSERT_TRUE(found.is_ok()) << found.status().to_string();
  std::set<std::string> keys;
  for (const auto& [h, first] : *found) {
    const int i = std::stoi(h.key.substr(8));
    EXPECT_EQ(h, header_of(i, i % 5 == 0 ? 64 << 10 : 100)) << h.key;
    EXPECT_EQ(first, at[static_cast<std::size_t>(i)]) << h.key;
    keys.insert(h.key);
  }
  EXPECT_EQ(keys.size(), 37u);
  for (int gone : {7, 10, 20}) EXPECT_EQ(keys.count("session:" + std::to_string(gone)), 0u) << gone;

  // The scan marked what it found: new headers go where nothing is, and erased blocks return.
  const std::uint64_t used = area_->used_blocks();
  auto next = area_->write(header_of(99), deadline_after(10s));
  ASSERT_TRUE(next.is_ok());
  for (const auto& [h, first] : *found) EXPECT_NE(*next, first);
  EXPECT_EQ(area_->used_blocks(), used + 1);
  ASSERT_TRUE(area_->erase(*next, deadline_after(10s)).is_ok());
  EXPECT_EQ(area_->used_blocks(), used);
  EXPECT_EQ(area_->erase(*next, deadline_after(10s)).code(), StatusCode::kNotFound);
}

TEST_F(TierHeadersTest, AFullAreaIsNoSpaceAndAFailedWriteGivesItsBlocksBack) {
  std::uint64_t written = 0;
  for (;; ++written) {
    auto r = area_->write(header_of(static_cast<int>(written), 64 << 10), deadline_after(10s));
    if (!r.is_ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kNoSpace) << r.status().to_string();
      break;
    }
  }
  EXPECT_GT(written, 0u);
  const std::uint64_t used = area_->used_blocks();
  device_->set_fault([](const SsdIo&) { return EIO; });
  ASSERT_TRUE(area_->erase(0, deadline_after(10s)).code() == StatusCode::kIoError);
  EXPECT_EQ(area_->used_blocks(), used) << "an erase that failed keeps its blocks";
  device_->set_fault(nullptr);
  ASSERT_TRUE(area_->erase(0, deadline_after(10s)).is_ok());
  device_->set_fault([](const SsdIo&) { return EIO; });
  EXPECT_EQ(area_->write(header_of(1), deadline_after(10s)).status().code(), StatusCode::kIoError);
  EXPECT_EQ(area_->used_blocks(), used - 17) << "a write that failed gives its blocks back";
}

}  // namespace
}  // namespace kvstash::node

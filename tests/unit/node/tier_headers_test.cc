// The NVMe tier's headers (src/node/tier_headers.h) on a file tier of this machine's disk: a
// header round-trips as bytes, the layout puts one header place per slot before the slots, and
// a scan after a reopen finds exactly the headers written whole, each at its slot (not a zeroed
// one, not a torn one, not one with a flipped byte).
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

constexpr std::uint64_t kCapacity = 64 << 20, kPage = 64 << 10;

TierHeader header_of(int i, std::size_t layout_bytes = 100) {
  TierHeader h;
  h.sequence = static_cast<std::uint64_t>(i) + 1;
  h.cell = "default";
  h.key = "session:" + std::to_string(i);
  h.token = "put-" + std::to_string(i * 7);
  h.size = 3 * kPage - 5;
  h.checksum = "0123456789abcdef/1048576";
  h.layout = std::string(layout_bytes, static_cast<char>('a' + i % 26));
  h.sum = "00112233445566" + std::to_string(10 + i % 90);
  h.expires_ms = i % 2 ? 0 : 1700000000000 + i;
  h.runs = {{static_cast<std::uint64_t>(i) * 3, 2}, {900, 1}};
  return h;
}

TEST(TierHeader, BytesRoundTripAndAnyFlippedByteIsNoHeader) {
  const TierHeader h = header_of(3);
  const std::string bytes = encode_tier_header(h, 4096).value();
  auto back = decode_tier_header(bytes + std::string(4096, '\0'));
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, h);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] = static_cast<char>(bad[i] ^ 0x01);
    EXPECT_FALSE(decode_tier_header(bad).has_value()) << "byte " << i;
  }
  EXPECT_FALSE(decode_tier_header(bytes.substr(0, bytes.size() - 1)).has_value()) << "cut short";
  EXPECT_FALSE(decode_tier_header(std::string(4096, '\0')).has_value());
  TierHeader huge = h;
  huge.layout.assign(4096, 'x');
  EXPECT_EQ(encode_tier_header(huge, 4096).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(encode_tier_header(huge, 8192).is_ok());
}

// With the node's key a header is signed: only that key reads it back; an unkeyed header, or
// one signed with another key, is no header to it (whoever can write the device forges those).
TEST(TierHeader, ASignedHeaderVerifiesOnlyUnderItsNodesKey) {
  const TierHeader h = header_of(4);
  const auto key = tier_header_key("a-cluster-token-of-32-characters");
  const auto other = tier_header_key("another-token-of-thirty-two-chars");
  ASSERT_EQ(key.size(), 32u);
  EXPECT_NE(key, other);
  EXPECT_TRUE(tier_header_key("").empty());
  const std::string pad(4096, '\0');
  const std::string signed_bytes = encode_tier_header(h, 4096, key).value();
  auto back = decode_tier_header(signed_bytes + pad, key);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, h);
  EXPECT_FALSE(decode_tier_header(signed_bytes + pad, other).has_value()) << "another node's key";
  EXPECT_FALSE(decode_tier_header(signed_bytes + pad).has_value()) << "read as unkeyed";
  EXPECT_FALSE(decode_tier_header(encode_tier_header(h, 4096).value() + pad, key).has_value())
      << "an unkeyed header, to a node with a key";
  EXPECT_FALSE(decode_tier_header(encode_tier_header(h, 4096, other).value() + pad, key).has_value());
  for (std::size_t i = 0; i < signed_bytes.size(); i += 7) {
    std::string bad = signed_bytes;
    bad[i] = static_cast<char>(bad[i] ^ 0x01);
    EXPECT_FALSE(decode_tier_header(bad + pad, key).has_value()) << "byte " << i;
  }
}

TEST(TierLayout, OneHeaderPlacePerSlotThenTheSlots) {
  const TierLayout l(kCapacity, kPage, 512);
  EXPECT_EQ(l.header_unit, 4096u);
  EXPECT_EQ(l.slots, (kCapacity - 4096) / (kPage + 4096));
  EXPECT_EQ(l.header_offset(0), 4096u) << "block 0 is the superblock's";
  EXPECT_EQ(l.slot_offset(0), 4096 * (1 + l.slots));
  EXPECT_LE(l.slot_offset(l.slots - 1) + kPage, kCapacity);
  EXPECT_EQ(l.slot_offset(0) % 4096, 0u) << "slots stay aligned for O_DIRECT";
  EXPECT_EQ(TierLayout(4096 + kPage, kPage, 4096).slots, 0u);
}

class TierHeadersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::current_path() / ("tier-headers-test-" + std::to_string(::getpid()))).string();
    open();
  }
  void TearDown() override {
    device_.reset();
    ::unlink(path_.c_str());
  }
  void open() {
    device_.reset();
    auto d = SsdDevice::open({.path = path_, .capacity = kCapacity});
    if (d.status().code() == StatusCode::kUnsupported) GTEST_SKIP() << d.status().to_string();
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    device_ = std::move(d).value();
    layout_.emplace(device_->capacity(), kPage, device_->block_size());
  }
  // Writes `bytes` (at most a header place) at slot `slot`'s header place, zero-padded.
  void put_place(std::uint64_t slot, std::string_view bytes) {
    Buffer b = Buffer::allocate(layout_->header_unit).value();
    std::memset(b.data(), 0, b.size());
    std::memcpy(b.data(), bytes.data(), bytes.size());
    ASSERT_TRUE(device_
                    ->run({{.write = true,
                            .offset = layout_->header_offset(slot),
                            .buffer = b.data(),
                            .length = b.size()}},
                          deadline_after(10s))
                    .is_ok());
  }

  std::string path_;
  std::unique_ptr<SsdDevice> device_;
  std::optional<TierLayout> layout_;
};

TEST_F(TierHeadersTest, AScanFindsWhatWasWrittenWholeAtItsSlotAndNothingElse) {
  ASSERT_GT(layout_->slots, 300u);
  for (int i = 0; i < 100; ++i)
    put_place(static_cast<std::uint64_t>(i) * 3, encode_tier_header(header_of(i), 4096).value());
  put_place(21, "");  // #7's place zeroed (another object took the slot, without a header)
  {
    // A torn header: #10 written again as a newer one, of which only its first 512 bytes
    // reached the device (a 4 KiB place of a 512-byte-sector disk); the rest is zeros.
    TierHeader newer = header_of(10, 1000);
    newer.sequence = 999;
    put_place(30, std::string_view(encode_tier_header(newer, 4096).value()).substr(0, 512));
  }
  {
    std::string flipped = encode_tier_header(header_of(20), 4096).value();
    flipped[40] = static_cast<char>(flipped[40] ^ 0x80);
    put_place(60, flipped);
  }
  // One at the last slot: the scan reads every place, to the end.
  put_place(layout_->slots - 1, encode_tier_header(header_of(500), 4096).value());
  open();  // a restart
  auto found = scan_tier_headers(*device_, *layout_, deadline_after(30s));
  ASSERT_TRUE(found.is_ok()) << found.status().to_string();
  std::set<std::string> keys;
  for (const auto& [h, slot] : *found) {
    const int i = std::stoi(h.key.substr(8));
    EXPECT_EQ(h, header_of(i)) << h.key;
    EXPECT_EQ(slot, i == 500 ? layout_->slots - 1 : static_cast<std::uint64_t>(i) * 3) << h.key;
    keys.insert(h.key);
  }
  EXPECT_EQ(keys.size(), 98u);
  for (int gone : {7, 10, 20}) EXPECT_EQ(keys.count("session:" + std::to_string(gone)), 0u) << gone;

  device_->set_fault([](const SsdIo&) { return EIO; });
  EXPECT_EQ(scan_tier_headers(*device_, *layout_, deadline_after(10s)).status().code(), StatusCode::kIoError);
}

}  // namespace
}  // namespace kvstash::node

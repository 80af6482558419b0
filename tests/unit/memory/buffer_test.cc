#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "kvstash/memory.h"

namespace kvstash {
namespace {

TEST(Buffer, ShareableBufferIsBackedByAFileOtherMappingsSee) {
  auto b = Buffer::allocate(10000);
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  ASSERT_GE(b->fd(), 0);
  EXPECT_EQ(b->size(), 10000u);
  b->data()[9999] = std::byte{42};
  // A second mapping of the same fd (what a same-host peer does) sees the bytes.
  void* p = mmap(nullptr, 10000, PROT_READ, MAP_SHARED, b->fd(), 0);
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_EQ(static_cast<std::byte*>(p)[9999], std::byte{42});
  munmap(p, 10000);
  EXPECT_EQ(b->region().fd, b->fd());
}

TEST(Buffer, PrivateBufferHasNoFd) {
  auto b = Buffer::allocate(4096, {.shareable = false});
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(b->fd(), -1);
  EXPECT_EQ(b->data()[0], std::byte{0});
}

TEST(Buffer, HugePagesFallBackWhenNoneReserved) {
  auto b = Buffer::allocate(3u << 20, {.shareable = true, .huge_pages = true});
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  b->data()[(3u << 20) - 1] = std::byte{1};  // usable either way
  SUCCEED() << (b->huge_pages() ? "huge pages" : "normal pages");
}

TEST(Buffer, ZeroSizeIsRefused) {
  auto b = Buffer::allocate(0);
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
}

TEST(Buffer, MoveTransfersOwnership) {
  auto b = Buffer::allocate(4096);
  ASSERT_TRUE(b.is_ok());
  std::byte* data = b->data();
  Buffer moved = std::move(b).value();
  EXPECT_EQ(moved.data(), data);
  Buffer other;
  other = std::move(moved);
  EXPECT_EQ(other.data(), data);
  EXPECT_EQ(moved.data(), nullptr);  // NOLINT(bugprone-use-after-move)
}

TEST(MemoryRegion, SliceKeepsTheFileOffset) {
  auto b = Buffer::allocate(8192);
  ASSERT_TRUE(b.is_ok());
  MemoryRegion s = b->region().slice(4096, 100);
  EXPECT_EQ(s.addr, b->data() + 4096);
  EXPECT_EQ(s.length, 100u);
  EXPECT_EQ(s.fd_offset, 4096u);
}

}  // namespace
}  // namespace kvstash

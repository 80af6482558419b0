#include "common/wire.h"

#include <gtest/gtest.h>

namespace kvstash::wire {
namespace {

TEST(Wire, RoundTrip) {
  Writer w;
  w.u8(7);
  w.u16(0xbeef);
  w.u32(0xdeadbeef);
  w.u64(0x0123456789abcdefull);
  w.bytes("hello");
  std::string blob = w.take();
  Reader r(blob);
  EXPECT_EQ(r.u8(), 7);
  EXPECT_EQ(r.u16(), 0xbeef);
  EXPECT_EQ(r.u32(), 0xdeadbeefu);
  EXPECT_EQ(r.u64(), 0x0123456789abcdefull);
  EXPECT_EQ(r.bytes(), "hello");
  EXPECT_TRUE(r.at_end());
}

TEST(Wire, LittleEndianOnTheWire) {
  Writer w;
  w.u32(0x01020304);
  EXPECT_EQ(w.take(), std::string("\x04\x03\x02\x01", 4));
}

TEST(Wire, TruncatedInputFailsSoftly) {
  Writer w;
  w.bytes("hello");
  std::string blob = w.take();
  for (std::size_t n = 0; n < blob.size(); ++n) {
    Reader r(std::string_view(blob).substr(0, n));
    r.bytes();
    EXPECT_FALSE(r.ok()) << "prefix of " << n << " bytes";
    EXPECT_EQ(r.u64(), 0u);
  }
  // A length prefix claiming more than there is must not read past the end.
  const std::string lying(
      "\xff\xff\xff\x7f"
      "abc",
      7);
  Reader r(lying);
  EXPECT_TRUE(r.bytes().empty());
  EXPECT_FALSE(r.ok());
}

TEST(Wire, Hex) {
  EXPECT_EQ(to_hex(std::string("\x00\xff\x10", 3)), "00ff10");
  EXPECT_EQ(to_hex64(0x0123456789abcdefull), "0123456789abcdef");
  EXPECT_EQ(to_hex64(0), "0000000000000000");
  EXPECT_EQ(from_hex("00FF10"), std::string("\x00\xff\x10", 3));
  EXPECT_FALSE(from_hex("abc").has_value());
  EXPECT_FALSE(from_hex("zz").has_value());
}

}  // namespace
}  // namespace kvstash::wire

#include "common/units.h"

#include <gtest/gtest.h>

namespace kvstash::units {
namespace {

TEST(Units, ParsesBinaryAndDecimalSizes) {
  EXPECT_EQ(*parse_size("4096"), 4096u);
  EXPECT_EQ(*parse_size("64KiB"), 64u << 10);
  EXPECT_EQ(*parse_size("256MiB"), 256u << 20);
  EXPECT_EQ(*parse_size("8GiB"), 8ull << 30);
  EXPECT_EQ(*parse_size("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*parse_size("10GB"), 10'000'000'000ull);
  EXPECT_EQ(*parse_size("4k"), 4096u);
}

TEST(Units, RefusesNonsense) {
  for (const char* bad : {"", "abc", "-1", "12XB", "1.3B", "99999999999TiB"}) {
    auto r = parse_size(bad);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(Units, Formats) {
  EXPECT_EQ(format_size(512), "512 B");
  EXPECT_EQ(format_size(4096), "4 KiB");
  EXPECT_EQ(format_size(3ull << 29), "1.5 GiB");
}

}  // namespace
}  // namespace kvstash::units

namespace kvstash::units {
namespace {

TEST(Units, ParsesDurations) {
  using std::chrono::milliseconds;
  EXPECT_EQ(parse_duration("250").value(), milliseconds(250));
  EXPECT_EQ(parse_duration("250ms").value(), milliseconds(250));
  EXPECT_EQ(parse_duration("3s").value(), milliseconds(3000));
  EXPECT_EQ(parse_duration("1.5s").value(), milliseconds(1500));
  EXPECT_EQ(parse_duration("2m").value(), milliseconds(120000));
  EXPECT_EQ(parse_duration("1h").value(), milliseconds(3600000));
  for (const char* bad : {"", "s", "-1s", "3 parsecs", "0.0001ms", "1e3"}) {
    EXPECT_EQ(parse_duration(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace kvstash::units

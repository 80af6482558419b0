#include "kvstash/status.h"

#include <gtest/gtest.h>

#include <set>

namespace kvstash {
namespace {

TEST(Status, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.to_string(), "ok");
}

TEST(Status, CodesHaveDistinctStableNames) {
  std::set<std::string_view> names;
  for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
    names.insert(to_string(static_cast<StatusCode>(c)));
  }
  EXPECT_EQ(names.size(), static_cast<std::size_t>(StatusCode::kInternal) + 1);
  EXPECT_EQ(to_string(StatusCode::kNotFound), "not_found");
  EXPECT_EQ(to_string(StatusCode::kPermissionDenied), "permission_denied");
}

TEST(Status, MessageAndContext) {
  Status s = Status::not_found("no object 'a'").with_context("get");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.to_string(), "not_found: get: no object 'a'");
  EXPECT_TRUE(Status().with_context("x").is_ok());
}

TEST(Status, FromErrnoNamesTheCall) {
  Status s = Status::from_errno("open /x", ENOENT);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("open /x"), std::string::npos);
  EXPECT_NE(s.message().find("No such file"), std::string::npos);
}

Result<int> half(int v) {
  if (v % 2 != 0) return Status::invalid_argument("odd");
  return v / 2;
}

Result<int> quarter(int v) {
  KVSTASH_ASSIGN_OR_RETURN(int h, half(v));
  return half(h);
}

TEST(Result, CarriesValueOrError) {
  auto ok = quarter(8);
  ASSERT_TRUE(ok.is_ok());
  EXPECT_EQ(*ok, 2);
  auto bad = quarter(6);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstash

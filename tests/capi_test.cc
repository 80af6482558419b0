// The C API as a C program (tests/capi_client.c), and the Python module (tests/python_test.py),
// against a real redis-server and kvstashd.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include "command.h"
#include "tools/common/local_cluster.h"

namespace kvstash {
namespace {

TEST(CApi, ACProgramSavesAndLoadsLayerByLayer) {
  const char* client = std::getenv("KVSTASH_CAPI_CLIENT");
  if (client == nullptr) GTEST_SKIP() << "KVSTASH_CAPI_CLIENT not set (run via meson test)";
  auto redis = tools::LocalRedis::start({});
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  auto node = tools::LocalNode::start(
      {.redis_url = (*redis)->url(), .capacity = "8MiB", .page_size = "1MiB", .node_id = "c1"});
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  int status = -1;
  const std::string out = test::run(std::string(client) + " " + (*redis)->url(), &status);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("ok"), std::string::npos) << out;
  test::run(std::string(client), &status);
  EXPECT_EQ(WEXITSTATUS(status), 2) << "usage";
}

TEST(Python, TheModuleSavesAndLoadsLayerByLayer) {
  const char* dir = std::getenv("KVSTASH_PYTHON_MODULE_DIR");
  const char* script = std::getenv("KVSTASH_PYTHON_TEST");
  if (dir == nullptr || script == nullptr)
    GTEST_SKIP() << "the Python bindings were not built (pybind11-dev missing)";
  auto redis = tools::LocalRedis::start({});
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  auto node = tools::LocalNode::start(
      {.redis_url = (*redis)->url(), .capacity = "8MiB", .page_size = "1MiB", .node_id = "p1"});
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  int status = -1;
  const std::string out = test::run(
      std::string("PYTHONPATH=") + dir + " python3 " + script + " " + (*redis)->url() + " 2>&1", &status);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("OK"), std::string::npos) << out;
}

}  // namespace
}  // namespace kvstash

// The C API as a C program (tests/system/store/capi_client.c), and the Python module
// (tests/system/store/python_test.py), against a real redis-server and two kvstashd: one in the cell
// "default", and one in the cell "secured" that serves tcp only and requires a cluster token.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "command.h"
#include "tests/harness/local_cluster.h"

namespace kvstash {
namespace {

constexpr const char* kToken = "capi-cluster-t0ken";

struct Cells {
  std::unique_ptr<harness::LocalRedis> redis;
  std::unique_ptr<harness::LocalNode> open;     // cell "default"
  std::unique_ptr<harness::LocalNode> secured;  // cell "secured", requires kToken
};

// Started from the test body's thread (the children die with it).
void start_cells(Cells& c, const std::string& prefix) {
  auto redis = harness::LocalRedis::start({});
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  c.redis = std::move(redis).value();
  auto node = harness::LocalNode::start(
      {.redis_url = c.redis->url(), .capacity = "8MiB", .page_size = "1MiB", .node_id = prefix + "1"});
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  c.open = std::move(node).value();

  std::string token_file = "/tmp/kvstash-capi-token-XXXXXX";
  const int fd = ::mkstemp(token_file.data());  // 0600, as kvstashd requires
  ASSERT_GE(fd, 0);
  const std::string content = std::string(kToken) + "\n";
  ASSERT_EQ(::write(fd, content.data(), content.size()), static_cast<ssize_t>(content.size()));
  ::close(fd);
  auto secured = harness::LocalNode::start(
      {.redis_url = c.redis->url(),
       .capacity = "4MiB",
       .page_size = "1MiB",
       .node_id = prefix + "2",
       .extra_args = {"--cell", "secured", "--transports", "tcp", "--cluster-token-file", token_file}});
  ::unlink(token_file.c_str());
  ASSERT_TRUE(secured.is_ok()) << secured.status().to_string();
  c.secured = std::move(secured).value();
}

TEST(CApi, ACProgramSavesAndLoadsLayerByLayer) {
  const char* client = std::getenv("KVSTASH_CAPI_CLIENT");
  if (client == nullptr) GTEST_SKIP() << "KVSTASH_CAPI_CLIENT not set (run via meson test)";
  Cells cells;
  start_cells(cells, "c");
  if (HasFatalFailure()) return;
  int status = -1;
  const std::string out =
      test::run(std::string(client) + " " + cells.redis->url() + " " + kToken + " 2>&1", &status);
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
  Cells cells;
  start_cells(cells, "p");
  if (HasFatalFailure()) return;
  int status = -1;
  const std::string out = test::run(std::string("PYTHONPATH=") + dir + " python3 " + script + " " +
                                        cells.redis->url() + " " + kToken + " 2>&1",
                                    &status);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("OK"), std::string::npos) << out;
}

}  // namespace
}  // namespace kvstash

// The network faults of kvstash-history's nemesis, and the commands that make them.
#include "history/cell.h"

//   kvstash-history --minutes 30 --json r.json what scripts/chaos runs
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <hiredis/hiredis.h>

#include "kvstash/status.h"
#include "kvstash/store.h"
#include "metadata/cell_admin.h"
#include "metadata/records.h"
#include "metadata/redis_client.h"
#include "node/ssd_device.h"
#include "tests/harness/local_cluster.h"

namespace kvstash::history {

using namespace std::chrono_literals;
using nlohmann::json;

bool run_command(std::vector<std::string> argv) {
  auto child = harness::ChildProcess::start(
      {.argv = std::move(argv), .capture_stdout = false, .discard_stderr = true});
  if (!child.is_ok()) return false;
  auto status = child->wait(deadline_after(10s));
  if (!status) child->kill();
  return status && *status == 0;
}

// The network nemesis of the netns hosts: a host's link down (a partition from every other
// host), or its link degraded for a while: netem delay and loss where the kernel has netem;
// else a token bucket of 2 Mbit/s (a slow link, its queue the delay) and nftables dropping
// 3% of the host's packets each way (random loss). Returns the fault's name; empty when the
// commands failed.
std::string network_fault(const Hosts& hosts, int host, bool partition, std::chrono::milliseconds lasting) {
  const std::string sw = std::string(hosts.prefix).append("-sw");
  const std::string port = std::string("h").append(std::to_string(host));
  if (partition) {
    if (!run_command({"ip", "-n", sw, "link", "set", port, "down"})) return {};
    std::this_thread::sleep_for(lasting);
    run_command({"ip", "-n", sw, "link", "set", port, "up"});
    return "host partitioned (link down)";
  }
  const std::string ns = hosts.ns(host);
  std::string what = "link degraded (netem 20 ms +-10 ms, 3% loss)";
  bool nft = false;
  if (!run_command({"tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "20ms", "10ms",
                    "loss", "3%"})) {
    if (!run_command({"tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "2mbit", "burst",
                      "32kbit", "latency", "400ms"})) {
      return {};
    }
    const std::vector<std::string> in_ns{"ip", "netns", "exec", ns, "nft"};
    auto nft_cmd = [&](std::vector<std::string> words) {
      std::vector<std::string> argv = in_ns;
      argv.insert(argv.end(), words.begin(), words.end());
      return run_command(std::move(argv));
    };
    nft = nft_cmd({"add", "table", "inet", "kvs_nemesis"});
    for (const char* hook : {"input", "output"}) {
      nft =
          nft &&
          nft_cmd({"add", "chain", "inet", "kvs_nemesis", hook,
                   std::string("{ type filter hook ").append(hook).append(" priority 0; policy accept; }")});
      nft = nft && nft_cmd({"add", "rule", "inet", "kvs_nemesis", hook, "numgen", "random", "mod", "100", "<",
                            "3", "drop"});
    }
    what = nft ? "link degraded (tbf 2 Mbit/s and nft 3% loss: this kernel has no netem)"
               : "link slowed (tbf 2 Mbit/s; no netem in this kernel, no nft for loss)";
    if (!nft) nft_cmd({"delete", "table", "inet", "kvs_nemesis"});
  }
  std::this_thread::sleep_for(lasting);
  run_command({"tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"});
  if (nft) run_command({"ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "kvs_nemesis"});
  return what;
}

}  // namespace kvstash::history

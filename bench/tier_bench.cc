#include "tier_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include "kvstash/memory.h"
#include "node/ssd_device.h"
#include "tests/harness/child_process.h"

namespace kvstash::bench {
namespace {

using namespace std::chrono_literals;

struct Row {
  std::string engine, op;
  double gbps = 0;
  std::string note;
};

// One sequential pass over the file with `depth` I/Os in flight all along (a slot frees, the
// next I/O goes), as fio keeps its queue full. GB/s, or the device's first error.
Result<double> pass(node::SsdDevice& device, bool write, const TierBenchOptions& o, Buffer& buffer) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::uint32_t> free_slots;
  for (std::uint32_t i = 0; i < o.depth; ++i) free_slots.push_back(i);
  Status failed;
  std::uint32_t in_flight = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t at = 0; at < o.bytes; at += o.io_bytes) {
    std::uint32_t slot;
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return !free_slots.empty(); });
      if (!failed.is_ok()) break;
      slot = free_slots.back();
      free_slots.pop_back();
      ++in_flight;
    }
    device.submit({{.write = write,
                    .offset = at,
                    .buffer = buffer.data() + static_cast<std::size_t>(slot) * o.io_bytes,
                    .length = static_cast<std::size_t>(std::min(o.io_bytes, o.bytes - at))}},
                  deadline_after(60s), [&, slot](Status s) {
                    std::lock_guard lock(mu);
                    if (!s.is_ok() && failed.is_ok()) failed = std::move(s);
                    free_slots.push_back(slot);
                    --in_flight;
                    cv.notify_all();
                  });
  }
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return in_flight == 0; });
  KVSTASH_RETURN_IF_ERROR(failed);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(o.bytes) / s / 1e9;
}

std::pair<double, std::string> fio(const TierBenchOptions& o, const char* rw) {
  return fio_gbps(o.path, rw, o.bytes, o.io_bytes, o.depth, o.rounds);
}

}  // namespace

std::pair<double, std::string> fio_gbps(const std::string& path, const char* rw, std::uint64_t bytes,
                                        std::uint64_t io_bytes, std::uint32_t depth, std::uint32_t loops) {
  char cmd[1024];
  std::snprintf(cmd, sizeof cmd,
                "fio --name=kvstash-tier --filename='%s' --rw=%s --bs=%llu --iodepth=%u --ioengine=io_uring "
                "--direct=1 --size=%llu --loops=%u --output-format=json 2>/dev/null",
                path.c_str(), rw, static_cast<unsigned long long>(io_bytes), depth,
                static_cast<unsigned long long>(bytes), loops);
  std::FILE* p = ::popen(cmd, "r");
  if (p == nullptr) return {0, "fio could not be started"};
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int rc = ::pclose(p);
  if (rc != 0 || out.empty()) return {0, "fio is not installed or failed (apt-get install fio)"};
  auto j = nlohmann::json::parse(out.substr(std::min(out.find('{'), out.size())), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty()) return {0, "fio's output was not JSON"};
  const double bytes_per_s = j["jobs"][0][rw]["bw_bytes"].get<double>();
  return {bytes_per_s / 1e9, ""};
}

int run_tier(const TierBenchOptions& o) {
  if (o.path.empty()) {
    std::cerr << "tier: --path names a file on the tier's file system\n";
    return 2;
  }
  auto device = node::SsdDevice::open({.path = o.path, .capacity = o.bytes, .queue_depth = o.depth * 2});
  if (!device.is_ok()) {
    std::cerr << "tier: " << device.status().to_string() << "\n";
    return 1;
  }
  auto buffer = Buffer::allocate(static_cast<std::size_t>(o.io_bytes) * o.depth);
  if (!buffer.is_ok()) {
    std::cerr << "tier: " << buffer.status().to_string() << "\n";
    return 1;
  }
  for (std::size_t i = 0; i < buffer->size(); ++i) buffer->data()[i] = static_cast<std::byte>(i * 131);
  std::vector<Row> rows;
  for (bool write : {true, false}) {
    double best = 0;
    for (std::uint32_t r = 0; r < o.rounds; ++r) {
      auto g = pass(**device, write, o, *buffer);
      if (!g.is_ok()) {
        std::cerr << "tier: " << g.status().to_string() << "\n";
        ::unlink(o.path.c_str());
        return 1;
      }
      best = std::max(best, *g);
    }
    rows.push_back({"kvstash-ssd", write ? "write" : "read", best, ""});
  }
  device->reset();
  for (const char* rw : {"write", "read"}) {
    auto [gbps, why] = fio(o, rw);
    rows.push_back({"fio", rw, gbps, why});
  }
  ::unlink(o.path.c_str());

  auto fio_of = [&](const std::string& op) {
    for (const Row& r : rows) {
      if (r.engine == "fio" && r.op == op) return r.gbps;
    }
    return 0.0;
  };
  if (!o.json) {
    std::printf(
        "%s, %s sequential in %llu KiB I/Os, %u in flight, best of %u passes; fio: the same file, "
        "O_DIRECT, io_uring, same block size and depth\n",
        o.path.c_str(), (std::to_string(o.bytes >> 20) + " MiB").c_str(),
        static_cast<unsigned long long>(o.io_bytes >> 10), o.depth, o.rounds);
    std::printf("%-12s %-6s %8s %8s\n", "engine", "op", "GB/s", "x fio");
  }
  for (const Row& r : rows) {
    const double ref = fio_of(r.op);
    if (o.json) {
      nlohmann::json j{{"engine", r.engine},     {"op", r.op},       {"gbps", r.gbps},
                       {"io_bytes", o.io_bytes}, {"depth", o.depth}, {"bytes", o.bytes}};
      if (ref > 0) j["vs_fio"] = r.gbps / ref;
      if (!r.note.empty()) j["note"] = r.note;
      std::cout << j.dump() << "\n";
      continue;
    }
    if (!r.note.empty()) {
      std::printf("%-12s %-6s   %s\n", r.engine.c_str(), r.op.c_str(), r.note.c_str());
      continue;
    }
    std::printf("%-12s %-6s %8.2f %7.2fx\n", r.engine.c_str(), r.op.c_str(), r.gbps,
                ref > 0 ? r.gbps / ref : 0);
  }
  return 0;
}

}  // namespace kvstash::bench

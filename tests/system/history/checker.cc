#include "history/checker.h"

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

#include "history/codec.h"

namespace kvstash::history {

using namespace std::chrono_literals;
using nlohmann::json;

// The run from `from` to `to` cut into phases by the nemesis's faults (each [start, end]); a
// put belongs to a quiet phase only when it began and returned inside it.
std::vector<Phase> phases_of(std::int64_t from, std::int64_t to,
                             std::vector<std::tuple<std::int64_t, std::int64_t, std::string>> faults,
                             const std::vector<Report::PutCall>& puts) {
  std::sort(faults.begin(), faults.end());
  std::vector<Phase> out;
  std::int64_t at = from;
  for (const auto& [start, end, name] : faults) {
    const bool short_gap = !out.empty() && !out.back().faults.empty() && start - at < kMinQuietNs;
    if (start > at && !short_gap) out.push_back({at, start, {}});
    if (out.empty() || out.back().faults.empty()) out.push_back({start, start, {}});
    Phase& d = out.back();
    const std::int64_t settle = name.find("redis") != std::string::npos ? kRedisSettleNs : kSettleNs;
    d.to_ns = std::max(d.to_ns, std::min(to, end + settle));
    if (std::find(d.faults.begin(), d.faults.end(), name) == d.faults.end()) d.faults.push_back(name);
    at = std::max(at, d.to_ns);
  }
  if (at < to) out.push_back({at, to, {}});
  for (const auto& p : puts) {
    for (Phase& ph : out) {
      const bool in = ph.faults.empty() ? p.t_inv >= ph.from_ns && p.t_ret <= ph.to_ns
                                        : p.t_inv >= ph.from_ns && p.t_inv < ph.to_ns;
      if (in) {
        ++ph.puts;
        ph.puts_ok += p.ok;
        if (!p.ok && ph.failed[p.code]++ == 0) ph.first_why[p.code] = p.why;
        break;
      }
    }
  }
  return out;
}

std::string code_name(int code) { return std::string(to_string(static_cast<StatusCode>(code))); }

// `losses`: when ([from, to]) the cell's Redis lost writes (restarted empty, failed over) while
// the nodes' tiers could give recoverable keys back. A get of a recoverable key may then return
// the bytes of a put that a change replaced, if a loss ended after that change was invoked (it
// may have undone the change) and began before the get returned: the contract of keys that
// name their content (docs/metadata.md, "A cell that lost its Redis"). Every other rule holds
// for them too.
void check(const std::vector<std::string>& logs, Report& report,
           const std::vector<std::pair<std::int64_t, std::int64_t>>& losses) {
  std::unordered_map<std::uint64_t, Put> puts;
  std::map<std::string, std::vector<Change>> changes;
  std::vector<Get> gets;
  for (const auto& path : logs) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream f(line);
      char kind = 0;
      f >> kind;
      long long deadline_ms = 0;
      std::int64_t t0 = 0, t1 = 0;
      int code = 0;
      if (kind == 'P' || kind == 'A') {
        Put p;
        std::uint64_t id = 0;
        f >> p.key >> id >> p.size >> p.t_inv >> p.t_ret;
        std::string why;
        if (kind == 'P') f >> p.code >> deadline_ms, std::getline(f >> std::ws, why);
        p.dropped = kind == 'A';
        t0 = p.t_inv, t1 = p.t_ret, code = p.code;
        if (kind == 'P' && p.code == 0) changes[p.key].push_back({p.t_inv, p.t_ret});
        report.ops[kind == 'P' ? "put " + code_name(p.code) : std::string("put stream dropped")]++;
        if (kind == 'P') report.put_calls.push_back({p.t_inv, p.t_ret, p.code == 0, p.code, std::move(why)});
        puts.emplace(id, std::move(p));
      } else if (kind == 'G') {
        Get g;
        f >> g.key >> g.t_inv >> g.t_ret >> code >> deadline_ms >> g.size >> g.put_id;
        std::getline(f >> std::ws, g.problem);
        if (g.problem == "-") g.problem.clear();
        g.client = path;
        t0 = g.t_inv, t1 = g.t_ret;
        report.ops[std::string("get ") + code_name(code)]++;
        if (code == 0) gets.push_back(std::move(g));
      } else if (kind == 'R') {
        std::string key;
        f >> key >> t0 >> t1 >> code >> deadline_ms;
        if (code == 0) changes[key].push_back({t0, t1});
        report.ops[std::string("remove ") + code_name(code)]++;
      } else if (kind == 'O') {
        char what = 0;
        f >> what >> t0 >> t1 >> code >> deadline_ms;
        report.ops[std::string(what == 'T' ? "touch " : "contains_prefix ") + code_name(code)]++;
      } else {
        continue;
      }
      if (deadline_ms > 0 && t1 - t0 > (deadline_ms + 1000) * 1000000) {
        report.overdue.push_back("`" + line + "` took " + std::to_string((t1 - t0) / 1000000) +
                                 " ms with a deadline of " + std::to_string(deadline_ms) + " ms");
      }
    }
  }
  for (auto& [key, list] : changes) {
    std::sort(list.begin(), list.end(), [](const Change& a, const Change& b) { return a.t_ret < b.t_ret; });
  }
  for (const Get& g : gets) {
    ++report.gets_checked;
    auto fail = [&](const std::string& why) {
      if (report.wrong.size() < 200)
        report.wrong.push_back("get of " + g.key + " (" + g.client + "): " + why);
    };
    if (!g.problem.empty()) {
      fail(g.problem);
      continue;
    }
    auto it = puts.find(static_cast<std::uint64_t>(g.put_id));
    if (it == puts.end()) {
      fail("bytes of put " + std::to_string(g.put_id) + ", which no client made");
      continue;
    }
    const Put& p = it->second;
    if (p.key != g.key) {
      fail("bytes of a put of " + p.key);
    } else if (p.dropped) {
      fail("bytes of put " + std::to_string(g.put_id) + ", a stream its client dropped before commit");
    } else if (p.size != g.size) {
      fail("size " + std::to_string(g.size) + ", but put " + std::to_string(g.put_id) + " wrote " +
           std::to_string(p.size));
    } else if (p.t_inv >= g.t_ret) {
      fail("bytes of put " + std::to_string(g.put_id) + ", invoked after the get returned");
    } else {
      // Replaced for sure before the get began: a change invoked after P returned that
      // returned before the get was invoked (and that no loss may have undone).
      bool brought_back = false;
      for (const Change& c : changes[g.key]) {
        if (c.t_ret >= g.t_inv) break;
        if (c.t_inv <= p.t_ret) continue;
        if (recoverable(g.key) && std::ranges::any_of(losses, [&](const auto& r) {
              return r.second > c.t_inv && r.first < g.t_ret;
            })) {
          brought_back = true;
          continue;
        }
        fail("bytes of put " + std::to_string(g.put_id) + ", replaced or removed " +
             std::to_string((g.t_inv - c.t_ret) / 1000000) + " ms before the get began");
        brought_back = false;
        break;
      }
      report.gets_recovered += brought_back;
    }
  }
}

}  // namespace kvstash::history

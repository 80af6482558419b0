// `kvstash-bench metadata --scripts`: how long each metadata script holds Redis in a big cell.
//
// Starts a private redis-server, fills a cell with N one-page objects on two (fake) memory
// nodes through the real scripts, then measures, with Redis's own SLOWLOG (the time the
// server spent in one FCALL or EVALSHA, so the client and the loopback do not count), the scripts that
// could scale with the cell: a get and a put, a put that must evict, a put that cannot get
// room because leased objects block the LRU's head, contains_prefix, the sweep of a dead node
// holding half the objects, a node registering again over its earlier life, and the CLI's
// LRU eviction. Redis runs one script at a time: what one holds, every client waits.
#include "metadata_bench.h"

#include <algorithm>
#include <atomic>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include <hiredis/hiredis.h>

#include <nlohmann/json.hpp>

#include "measure.h"
#include "metadata/cell.h"
#include "tests/harness/local_cluster.h"

namespace kvstash::bench {
namespace {

using namespace std::chrono_literals;
using metadata::Cell;
using metadata::RedisClient;

constexpr std::uint64_t kPage = 4096;

struct Sample {
  std::string what;
  std::vector<double> us;  // server time of each run
  double commands = 0;     // Redis commands the scripts ran, per run: a cost the machine's noise leaves alone
};

// The server time of the last command (SLOWLOG with a threshold of 0 logs every command).
class ServerClock {
 public:
  explicit ServerClock(RedisClient& r) : r_(r) {
    (void)r_.command({"CONFIG", "SET", "slowlog-log-slower-than", "0"});
    (void)r_.command({"CONFIG", "SET", "slowlog-max-len", "100000"});
  }
  void reset() { (void)r_.command({"SLOWLOG", "RESET"}); }
  // Commands Redis ran since it started (INFO commandstats: the scripts' own redis.call()s
  // included), leaving out the scripts themselves and this clock's.
  std::uint64_t commands() {
    auto r = r_.command({"INFO", "commandstats"});
    if (!r.is_ok() || r->type() != metadata::Reply::Type::kString) return 0;
    std::uint64_t calls = 0;
    std::istringstream in(std::string(r->str()));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("cmdstat_", 0) != 0) continue;
      const std::string name = line.substr(8, line.find(':') - 8);
      if (name == "fcall" || name == "evalsha" || name == "eval" || name == "slowlog" || name == "info" ||
          name == "config" || name.rfind("script", 0) == 0 || name.rfind("function", 0) == 0) {
        continue;
      }
      const auto at = line.find("calls=");
      if (at != std::string::npos) calls += std::strtoull(line.c_str() + at + 6, nullptr, 10);
    }
    return calls;
  }
  // The longest script (FCALL or EVALSHA) since reset(), in microseconds.
  double longest_eval() { return evals(false); }
  // Every script since reset(), summed, in microseconds.
  double total_evals() { return evals(true); }

 private:
  double evals(bool sum) {
    auto r = r_.command({"SLOWLOG", "GET", "100000"});
    double out = 0;
    if (!r.is_ok()) return out;
    for (std::size_t i = 0; i < r->size(); ++i) {
      const redisReply* e = r->element(i);
      if (e->elements < 4 || e->element[3]->elements == 0) continue;
      const redisReply* cmd = e->element[3]->element[0];
      const std::string_view verb(cmd->str, cmd->len);
      if (verb != "FCALL" && verb != "EVALSHA") continue;
      const auto us = static_cast<double>(e->element[2]->integer);
      out = sum ? out + us : std::max(out, us);
    }
    return out;
  }

 public:
 private:
  RedisClient& r_;
};

}  // namespace

int run_metadata(const MetadataBenchOptions& o) {
  if (o.scripts) return run_metadata_scripts(o);
  return o.shards.empty() ? run_metadata_load(o) : run_metadata_shards(o);
}

int run_metadata_scripts(const MetadataBenchOptions& o) {
  auto redis = harness::LocalRedis::start({});
  if (!redis.is_ok()) {
    std::cerr << "metadata: " << redis.status().to_string() << "\n";
    return 1;
  }
  auto connect = [&] {
    // Field by field: GCC 12 warns falsely (-Wmaybe-uninitialized) on the nested designated form.
    metadata::CellOptions o;
    o.redis.url = (*redis)->url();
    o.redis.command_timeout = 60s;
    return Cell::open(o);
  };
  auto opened = connect();
  if (!opened.is_ok()) {
    std::cerr << "metadata: " << opened.status().to_string() << "\n";
    return 1;
  }
  // The scripts of every audience, as their callers run them: the client's (cat), the memory
  // node's (node) and the operator's (op).
  Cell& cell = **opened;
  metadata::Catalog& cat = cell.catalog();
  metadata::NodeCatalog& node = cell.node_catalog();
  metadata::CellAdmin& op = cell.admin();
  const std::uint64_t per_node = o.objects / 2 + 4096;
  if (auto p = op.set_policy(o.policy); !p.is_ok()) {
    std::cerr << "metadata: " << p.status().to_string() << "\n";
    return 1;
  }
  for (const char* id : {"n1", "n2"}) {
    if (auto s = node.register_node({id, "e1", kPage, per_node, "addr", "key"}, 3600s); !s.is_ok()) {
      std::cerr << "metadata: " << s.status().to_string() << "\n";
      return 1;
    }
  }

  // Fill: N one-page objects through begin_put + commit_put, on a few connections at once.
  std::cout << "filling the cell with " << o.objects << " objects..." << std::flush;
  const auto fill_start = Clock::now();
  std::atomic<std::uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<std::thread> fillers;
  for (int t = 0; t < 4; ++t) {
    fillers.emplace_back([&] {
      auto r = connect();
      if (!r.is_ok()) {
        failed = true;
        return;
      }
      metadata::Catalog& c = (*r)->catalog();
      for (std::uint64_t i; (i = next++) < o.objects;) {
        const std::string key = "obj/" + std::to_string(i), token = "fill-" + std::to_string(i);
        if (!c.begin_put(token, key, kPage, 600s).is_ok() ||
            !c.commit_put(token, key, {1}, "", 0ms).is_ok()) {
          failed = true;
          return;
        }
      }
    });
  }
  for (auto& t : fillers) t.join();
  if (failed) {
    std::cerr << "\nmetadata: filling the cell failed\n";
    return 1;
  }
  std::cout << " " << std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - fill_start).count()
            << " s\n";

  ServerClock clock(cell.redis());
  std::vector<Sample> samples;
  auto measure = [&](const std::string& what, int runs, auto op) {
    Sample s{what, {}};
    const std::uint64_t commands_before = clock.commands();
    for (int i = 0; i < runs; ++i) {
      clock.reset();
      op(i);
      s.us.push_back(clock.longest_eval());
    }
    s.commands = static_cast<double>(clock.commands() - commands_before) / runs;
    samples.push_back(std::move(s));
  };

  // Under turn-ttl, the hints a KV cache's requests carry (a 32-chunk prompt's chunks; one in
  // eight sampled to learn from); other policies get none.
  const auto hint = [&](std::uint64_t key_hash, std::uint32_t index) {
    if (o.policy != "turn-ttl") return std::string();
    return metadata::keep_hint_text(KeepHint{
        .turn = 2, .chunks = 32, .index = index, .tokens = 512, .key_hash = key_hash, .split_hash = 1});
  };
  measure("begin_get + end_get", 200, [&](int i) {
    auto g = cat.begin_get("obj/" + std::to_string(i * 7919 % o.objects), "reader", 30s, true,
                           hint(static_cast<std::uint64_t>(i), static_cast<std::uint32_t>(i % 32)));
    if (g.is_ok()) (void)cat.end_get("reader", *g);
  });
  measure("begin_put + commit_put (room free)", 200, [&](int i) {
    const std::string token = "m-" + std::to_string(i);
    if (cat.begin_put(token, "fresh/" + std::to_string(i), kPage, 30s).is_ok()) {
      (void)cat.commit_put(token, "fresh/" + std::to_string(i), {1}, "", 0ms, std::nullopt, 1,
                           hint(static_cast<std::uint64_t>(i), static_cast<std::uint32_t>(i % 32)));
    }
  });
  // A KV request of 32 chunks of 32 pages each (128 MiB chunks in 4 MiB pages), saved and
  // loaded as KvCache did (a script per chunk) and does (one per request): Redis's time per chunk.
  constexpr int kChunks = 32;
  constexpr std::uint64_t kChunkPages = 32;
  std::vector<std::string> chunks, readers, hints;
  for (int i = 0; i < kChunks; ++i) {
    chunks.push_back("chunk/" + std::to_string(i));
    readers.push_back("reader-" + std::to_string(i));
    hints.push_back(hint(static_cast<std::uint64_t>(i), static_cast<std::uint32_t>(i)));
  }
  auto per_chunk = [&](const std::string& what, int runs, auto op) {
    Sample s{what, {}};
    const std::uint64_t commands_before = clock.commands();
    for (int i = 0; i < runs; ++i) {
      clock.reset();
      op(i);
      s.us.push_back(clock.total_evals() / kChunks);
    }
    s.commands = static_cast<double>(clock.commands() - commands_before) / runs / kChunks;
    samples.push_back(std::move(s));
  };
  // A save: pages from reservations (each at most 256 pages beyond its first put's), each
  // chunk committed by itself or all in one script.
  std::string event_data;  // each chunk's KV events' data, from the events rows on
  auto save = [&](int run, bool together) {
    struct Run {
      std::string res, token;
      std::uint64_t first = 0;
    };
    std::vector<Run> runs;
    std::string res;
    std::uint64_t have = 0, next = 0;
    for (int c = 0; c < kChunks; ++c) {
      if (have - next < kChunkPages) {
        res = "res-" + std::to_string(run) + "-" + std::to_string(c);
        auto p = cat.reserve_pages(res, kChunkPages * kPage, (kChunks - c - 1) * kChunkPages * kPage, 30s);
        have = p.is_ok() ? p->extents.size() : 0;
        next = 0;
      }
      runs.push_back({res, "put-" + std::to_string(run) + "-" + std::to_string(c), next});
      next += kChunkPages;
    }
    std::vector<metadata::Catalog::ReservedCommit> puts;
    for (int c = 0; c < kChunks; ++c) {
      puts.push_back({.pages = {runs[c].res, runs[c].first, kChunkPages},
                      .token = runs[c].token,
                      .key = chunks[c],
                      .size = kChunkPages * kPage,
                      .checksum = {1},
                      .keep = hints[c],
                      .event = event_data});
    }
    if (together) {
      (void)cat.commit_reserveds(puts);
    } else {
      for (const auto& p : puts)
        (void)cat.commit_reserved(p.pages, p.token, p.key, p.size, p.checksum, "", 0ms, std::nullopt, 1,
                                  p.keep);
    }
    for (const auto& r : runs) (void)cat.release_reservation(r.res, 1u << 20, true);
  };
  per_chunk("KV save, 32 chunks of 32 pages: a commit per chunk (per chunk)", 20,
            [&](int i) { save(i, false); });
  per_chunk("KV save, 32 chunks of 32 pages: one commit (per chunk)", 20,
            [&](int i) { save(100 + i, true); });
  per_chunk("KV load, 32 chunks: begin_get per chunk, end_gets (per chunk)", 20, [&](int) {
    std::vector<metadata::Catalog::EndedRead> ended;
    for (int c = 0; c < kChunks; ++c) {
      auto g = cat.begin_get(chunks[c], readers[c], 30s);
      if (g.is_ok()) ended.push_back({readers[c], g->object_token, g->placement.extents_text});
    }
    (void)cat.end_gets(ended);
  });
  per_chunk("KV load, 32 chunks: begin_gets, end_gets (per chunk)", 20, [&](int) {
    auto leases =
        cat.begin_gets(chunks, readers, 30s, o.policy == "turn-ttl" ? hints : std::vector<std::string>{});
    std::vector<metadata::Catalog::EndedRead> ended;
    for (int c = 0; leases.is_ok() && c < kChunks; ++c) {
      if ((*leases)[c].is_ok()) ended.push_back({readers[c], (*leases)[c]->object_token, ""});
    }
    (void)cat.end_gets(ended);
  });

  // KV events on (docs/events.md): an engine announces a save's chunks, each with its event
  // data (a 256-token chunk's block hashes and token ids: about 1.3 KB).
  (void)cell.redis().command({"HSET", cell.prefix() + ":events", "maxlen", "100000"});
  std::vector<std::pair<std::string, std::string>> announced;
  for (const auto& c : chunks) announced.emplace_back(c, std::string(1300, 'e'));
  per_chunk("KV events on: announce of a save's 32 chunks (per chunk)", 20,
            [&](int) { (void)cat.announce(announced); });
  // What a KV save costs with its event data in its one commit (PutOptions::event), against the
  // commit and the announce above: one script instead of two.
  event_data = std::string(1300, 'e');
  per_chunk("KV events on: a save's 32 chunks, their event data in the one commit (per chunk)", 20,
            [&](int i) { save(200 + i, true); });
  event_data.clear();

  std::vector<std::string> chain;
  for (int i = 0; i < 64; ++i) chain.push_back("obj/" + std::to_string(i));
  measure("contains_prefix (64 keys)", 200, [&](int) { (void)cat.contains_prefix(chain); });
  // A hybrid model's lookup: each key's presence (every group's objects of 8 chunks).
  measure("contains_each (64 keys)", 200, [&](int) { (void)cat.contains_each(chain); });

  // The pool full: every further put evicts (the object the cell's policy gives up first). The
  // free pages go to leases of puts that never commit, of at most 4,096 pages each (an
  // object's most).
  for (int part = 0;; ++part) {
    std::uint64_t left = 0;
    for (const char* id : {"n1", "n2"}) {
      auto f = op.free_pages(id);
      if (f.is_ok()) left += *f;
    }
    if (left == 0) break;
    const std::uint64_t pages = std::min<std::uint64_t>(left, 4096);
    if (auto hog =
            cat.begin_put("hog-" + std::to_string(part), "hog/" + std::to_string(part), pages * kPage, 600s);
        !hog.is_ok()) {
      std::cerr << "metadata: filling the pool: " << hog.status().to_string() << "\n";
      return 1;
    }
  }
  auto evicted_now = [&] {
    auto sum = op.summary();
    return sum.is_ok() ? sum->evicted : 0;
  };
  const std::uint64_t evicted_before = evicted_now();
  measure("begin_put evicting one object", 100, [&](int i) {
    (void)cat.begin_put("e-" + std::to_string(i), "evicting/" + std::to_string(i), kPage, 30s);
  });
  if (evicted_now() < evicted_before + 100) {
    std::cerr << "metadata: the puts into a full pool did not evict\n";
    return 1;
  }
  // The same with the objects next in the LRU announced: each eviction logs a removed event.
  {
    auto head = cell.redis().command({"ZRANGE", cell.prefix() + ":lru", "0", "99"});
    std::vector<std::pair<std::string, std::string>> next;
    for (std::size_t i = 0; head.is_ok() && i < head->size(); ++i) {
      next.emplace_back(std::string(head->element(i)->str, head->element(i)->len), std::string(1300, 'e'));
    }
    (void)cat.announce(next);
  }
  measure("KV events on: begin_put evicting one announced object", 100, [&](int i) {
    (void)cat.begin_put("ea-" + std::to_string(i), "evicting-announced/" + std::to_string(i), kPage, 30s);
  });
  // The LRU's head leased by readers: a put that cannot find room within its bounded walk.
  {
    auto r = cell.redis().command({"ZRANGE", cell.prefix() + ":lru", "0", "2999"});
    for (std::size_t i = 0; r.is_ok() && i < r->size(); ++i) {
      (void)cat.begin_get(std::string(r->element(i)->str, r->element(i)->len), "blocker", 600s);
    }
  }
  measure("begin_put blocked by 3,000 leased objects (no space)", 50, [&](int i) {
    (void)cat.begin_put("b-" + std::to_string(i), "blocked/" + std::to_string(i), 16 * kPage, 30s);
  });
  measure("evict_lru (CLI, 100 objects)", 20, [&](int) { (void)op.evict_lru(0ms, 0, true, 100); });

  // A node dies holding half the cell: each reclaim sweeps a bounded batch.
  std::uint64_t sweeps = 0;
  {
    (void)node.register_node({"n3", "e1", kPage, 16, "addr", "key"}, 3600s);  // keeps reclaim busy elsewhere
    (void)cell.redis().command({"ZADD", cell.prefix() + ":nodes", "1", "n1"});  // n1's deadline long passed
    Sample s{"reclaim (limit 32) sweeping a dead node's objects", {}};
    for (;;) {
      clock.reset();
      auto r = node.reclaim();
      s.us.push_back(clock.longest_eval());
      ++sweeps;
      auto left = cell.redis().command({"LLEN", cell.prefix() + ":sweep"});
      if (!r.is_ok() || !left.is_ok() || left->integer() == 0 || sweeps > o.objects) break;
    }
    samples.push_back(std::move(s));
  }
  measure("register_node over an earlier life (new epoch)", 5, [&](int i) {
    (void)node.register_node({"n2", "e" + std::to_string(i + 2), kPage, per_node, "addr", "key"}, 3600s);
  });

  nlohmann::json rows = nlohmann::json::array();
  std::cout << "\n"
            << std::left << std::setw(58) << "script (server time per run)" << std::right << std::setw(10)
            << "p50 us" << std::setw(10) << "p99 us" << std::setw(10) << "max us" << std::setw(8) << "runs"
            << std::setw(10) << "commands"
            << "\n";
  for (const auto& s : samples) {
    const double p50 = percentile(s.us, 0.5), p99 = percentile(s.us, 0.99),
                 max = s.us.empty() ? 0 : *std::max_element(s.us.begin(), s.us.end());
    std::cout << std::left << std::setw(58) << s.what << std::right << std::fixed << std::setprecision(0)
              << std::setw(10) << p50 << std::setw(10) << p99 << std::setw(10) << max << std::setw(8)
              << s.us.size() << std::setw(10) << std::setprecision(1) << s.commands << "\n";
    rows.push_back({{"script", s.what},
                    {"p50_us", p50},
                    {"p99_us", p99},
                    {"max_us", max},
                    {"runs", s.us.size()},
                    {"commands", s.commands}});
  }
  std::cout << "(cell of " << o.objects << " objects, eviction policy " << o.policy
            << "; the dead node's were swept in " << sweeps << " reclaims)\n";
  if (o.json) {
    std::cout << nlohmann::json{{"objects", o.objects}, {"policy", o.policy}, {"rows", rows}}.dump() << "\n";
  }
  return 0;
}

}  // namespace kvstash::bench

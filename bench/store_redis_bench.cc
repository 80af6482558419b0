// `kvstash-bench store`'s baseline: the KV bytes themselves through Redis.
#include <hiredis/hiredis.h>

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "common/units.h"
#include "metadata/redis_client.h"
#include "store_bench_internal.h"

namespace kvstash::bench {

using namespace std::chrono_literals;

// The tutorial's approach: the bytes themselves through Redis, HSET and HGET, landing in the
// same buffers. The copy out of hiredis' reply into the restore buffer is part of a get: an
// engine needs the bytes in its KV cache, not in a reply object.
std::pair<Row, Row> StoreBench::measure_redis(const std::string& url, std::uint64_t backend_index) {
  Row put{.backend = std::string(kRedisBytes), .op = "put"};
  Row get{.backend = std::string(kRedisBytes), .op = "get"};
  metadata::RedisOptions ro;
  ro.url = url;
  ro.password = o_.redis_password;
  // A 512 MB value takes seconds through Redis; the default 2 s per command is for metadata.
  ro.command_timeout = 120s;
  auto client = metadata::RedisClient::connect(ro);
  auto fail = [&](const std::string& what) {
    progress_.clear();
    put.error = get.error = what;
    return std::pair{put, get};
  };
  if (!client.is_ok()) return fail("cannot connect: " + client.status().to_string());
  auto& redis = **client;
  auto key_of = [](std::uint32_t session) { return "bench:redis-bytes:" + std::to_string(session); };
  auto cleanup = [&] {
    std::vector<std::string> keys;
    for (std::uint32_t i = 0; i < o_.sessions; ++i) keys.push_back(key_of(i));
    std::vector<std::string_view> del{"DEL"};
    del.insert(del.end(), keys.begin(), keys.end());
    return redis.command(del).status();
  };

  // Redis refuses bulk values over proto-max-bulk-len (512 MB unless configured otherwise).
  std::uint64_t limit = 512ull << 20;
  if (auto cfg = redis.command({"CONFIG", "GET", "proto-max-bulk-len"}); cfg.is_ok() && cfg->size() == 2) {
    const redisReply* v = cfg->element(1);
    if (v != nullptr && v->str != nullptr) {
      const std::uint64_t n = std::strtoull(std::string(v->str, v->len).c_str(), nullptr, 10);
      if (n > 0) limit = n;
    }
  }
  if (s_.largest > limit) {
    put.skipped = get.skipped = "a session of " + units::format_size(s_.largest) +
                                " exceeds Redis's proto-max-bulk-len (" + units::format_size(limit) +
                                "): Redis cannot hold a value that large";
    return {put, get};
  }

  for (std::uint32_t round = 0; round < o_.rounds; ++round) {
    for (std::uint32_t i = 0; i < o_.sessions; ++i) {
      fill_pattern(s_.source[i].data(), s_.sizes[i], backend_index, round, i);
    }
    for (std::uint32_t i = 0; i < o_.sessions; ++i) {
      if (interrupted()) {
        (void)cleanup();
        return fail("interrupted");
      }
      progress_.show(
          fmt::format("{}: round {}/{}, HSET {}/{}", kRedisBytes, round + 1, o_.rounds, i + 1, o_.sessions));
      const std::string key = key_of(i);
      const std::string_view bytes(reinterpret_cast<const char*>(s_.source[i].data()), s_.sizes[i]);
      const auto t0 = Clock::now();
      auto r = redis.command({"HSET", key, "kv", bytes});
      const double us = us_since(t0);
      if (!r.is_ok()) {
        (void)cleanup();
        return fail("HSET " + key + ": " + r.status().to_string());
      }
      put.stats.latency_us.push_back(us);
      put.stats.bytes += s_.sizes[i];
      put.stats.seconds += us / 1e6;
    }
    for (std::uint32_t i = 0; i < o_.sessions; ++i) {
      if (interrupted()) {
        (void)cleanup();
        return fail("interrupted");
      }
      progress_.show(
          fmt::format("{}: round {}/{}, HGET {}/{}", kRedisBytes, round + 1, o_.rounds, i + 1, o_.sessions));
      const std::string key = key_of(i);
      const std::size_t size = s_.sizes[i];
      std::memset(s_.restore.data(), 0, size);
      const auto t0 = Clock::now();
      auto r = redis.command({"HGET", key, "kv"});
      if (r.is_ok() && r->type() == metadata::Reply::Type::kString && r->str().size() == size) {
        std::memcpy(s_.restore.data(), r->str().data(), size);
      }
      const double us = us_since(t0);
      if (!r.is_ok()) {
        (void)cleanup();
        return fail("HGET " + key + ": " + r.status().to_string());
      }
      if (r->type() != metadata::Reply::Type::kString || r->str().size() != size) {
        (void)cleanup();
        return fail("HGET " + key + ": " +
                    (r->type() == metadata::Reply::Type::kString ? std::to_string(r->str().size()) + " bytes"
                                                                 : std::string("no value")) +
                    ", " + std::to_string(size) + " were put");
      }
      if (std::memcmp(s_.restore.data(), s_.source[i].data(), size) != 0) {
        (void)cleanup();
        const std::size_t at = first_difference(s_.restore.data(), s_.source[i].data(), size);
        return fail("HGET " + key + ": wrong bytes (byte " + std::to_string(at) + " of " +
                    std::to_string(size) + " differs from what was put)");
      }
      get.stats.latency_us.push_back(us);
      get.stats.bytes += size;
      get.stats.seconds += us / 1e6;
    }
    if (Status st = cleanup(); !st.is_ok()) return fail("DEL: " + st.to_string());
  }
  progress_.clear();
  put.verified = get.verified = true;
  return {put, get};
}

}  // namespace kvstash::bench

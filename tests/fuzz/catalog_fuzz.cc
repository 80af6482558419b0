// The metadata plane's reply parsers (src/metadata: catalog.cc, node_catalog.cc, cell_admin.cc)
// behind a real RedisClient: a fake Redis on a loopback socket answers each command the client
// sends with the next reply from the input, and the three catalogs of a Cell call every one of
// their methods in turn (node records, placements of begin_put and begin_get, stat,
// node_status, describe, scans, reclaim, ...),
// each with its script's NOSCRIPT reload when the input answers so. Every call must come back
// with a Status; what comes back OK must keep the promises the headers make (a placement's
// extents cover the object exactly and name only listed nodes, contains_prefix counts at most
// the keys it was given, describe answers one record per key).
//
// Input: byte 0 says which method the calls start at (bits 0-6; the rest follow in order,
// wrapping) and whether the client logs in as an ACL user into database 3 (bit 7: AUTH and
// SELECT then take the first two replies); then RESP replies back to back (tests/fuzz/resp.h
// says where one ends; an incomplete or malformed rest is the last reply). The fake Redis hangs up after the
// last one, so the remaining calls fail at once with kUnavailable.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "fuzz_util.h"
#include "metadata/cell.h"
#include "metadata/quotas.h"
#include "metadata/redis_client.h"
#include "resp.h"

namespace kvstash {
namespace {

using metadata::Cell;

struct World {
  int listener = -1;
  std::uint16_t port = 0;
};

World& world() {
  static World* w = [] {
    fuzz::quiet_logs();
    auto* w = new World;
    w->listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    FUZZ_CHECK(::bind(w->listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                   ::listen(w->listener, 4) == 0 &&
                   ::getsockname(w->listener, reinterpret_cast<sockaddr*>(&a), &len) == 0,
               "fake redis: %s", std::strerror(errno));
    w->port = ntohs(a.sin_port);
    return w;
  }();
  return *w;
}

// The fake Redis: one connection; each complete command gets the next reply. After the last
// one it sends FIN and reads until the client closes (closing with the client's bytes unread
// would reset the connection, and the reset can overtake the last reply).
void serve(int listener, const std::vector<std::string>& replies) {
  const auto deadline = fuzz::Clock::now() + std::chrono::seconds(5);
  const int c = fuzz::accept_until(listener, deadline);
  if (c < 0) return;
  std::string in;
  std::size_t next = 0;
  bool done = replies.empty();
  if (done) ::shutdown(c, SHUT_WR);
  char buf[8192];
  for (;;) {
    const ssize_t n = fuzz::recv_some(c, buf, sizeof buf, deadline);
    if (n <= 0) break;
    if (done) continue;
    in.append(buf, static_cast<std::size_t>(n));
    fuzz::Framing f;
    while (!done) {
      const std::size_t len = fuzz::resp_length(in, f);
      if (len == 0) break;
      in.erase(0, len);
      (void)fuzz::send_all(c, replies[next++], deadline);
      if (next == replies.size()) {
        done = true;
        ::shutdown(c, SHUT_WR);
      }
    }
  }
  ::close(c);
}

bool covers_exactly(std::uint64_t size, std::uint64_t page_size, std::size_t extents) {
  const unsigned __int128 need = (static_cast<unsigned __int128>(size) + page_size - 1) / page_size;
  return need == extents;
}

void check_placement(const metadata::Placement& p, std::uint64_t size, const char* what) {
  FUZZ_CHECK(p.page_size > 0, "%s: page size 0", what);
  FUZZ_CHECK(covers_exactly(size, p.page_size, p.extents.size()),
             "%s: %zu extents of %llu bytes for %llu bytes", what, p.extents.size(),
             static_cast<unsigned long long>(p.page_size), static_cast<unsigned long long>(size));
  for (const auto& e : p.extents) {
    bool listed = false;
    for (const auto& n : p.nodes) listed = listed || n.id == e.node;
    FUZZ_CHECK(listed, "%s: an extent names an unlisted node", what);
  }
  FUZZ_CHECK(p.lease_deadline_ms > 0, "%s: lease without a deadline", what);
}

const std::vector<std::string> kKeys = {"chunk/0", "chunk/1", "chunk/2"};

// Every method of the three catalogs, with arguments a caller would pass (the order is the
// seeds' too: make_seeds.cc names each call by its index).
const std::vector<std::function<void(Cell&)>>& calls() {
  using namespace std::chrono_literals;
  static const std::vector<std::function<void(Cell&)>> all = {
      [](Cell& c) { (void)c.catalog().check_schema(); },
      [](Cell& c) {
        (void)c.node_catalog().register_node({"node-1", "epoch-1", 4096, 64, "address", "key"}, 10s);
      },
      [](Cell& c) { (void)c.node_catalog().heartbeat("node-1", "epoch-1", 10s, 1000); },
      [](Cell& c) { (void)c.node_catalog().drain_node("node-1", "epoch-1"); },
      [](Cell& c) { (void)c.node_catalog().deregister_node("node-1", "epoch-1"); },
      [](Cell& c) { (void)c.admin().node_status("node-1"); },
      [](Cell& c) { (void)c.admin().list_nodes(); },
      [](Cell& c) { (void)c.admin().free_pages("node-1"); },
      [](Cell& c) {
        constexpr std::uint64_t kSize = 10000;
        if (auto p = c.catalog().begin_put("put-token", "object", kSize, 5s); p.is_ok())
          check_placement(*p, kSize, "begin_put");
      },
      [](Cell& c) {
        (void)c.catalog().commit_put("put-token", "object", {0x0123456789abcdefull, 4096}, "layout", 0ms,
                                     std::string("old"));
      },
      [](Cell& c) {
        const std::vector<std::string> fenced = {"node-1"};
        (void)c.catalog().abort_put("put-token", fenced);
      },
      [](Cell& c) {
        auto g = c.catalog().begin_get("object", "reader-1", 5s);
        if (!g.is_ok()) return;
        check_placement(g->placement, g->size, "begin_get");
        FUZZ_CHECK(!g->object_token.empty(), "begin_get: no object token");
        (void)c.catalog().end_get("reader-1", *g);
      },
      [](Cell& c) {
        if (auto o = c.catalog().stat("object"); o.is_ok())
          FUZZ_CHECK(o->pages == o->extents.size(), "stat: page count");
      },
      [](Cell& c) { (void)c.catalog().remove("object"); },
      [](Cell& c) { (void)c.catalog().touch("object", 1s); },
      [](Cell& c) {
        if (auto n = c.catalog().contains_prefix(kKeys); n.is_ok()) {
          FUZZ_CHECK(*n <= kKeys.size(), "contains_prefix: %zu of %zu keys", *n, kKeys.size());
        }
      },
      [](Cell& c) { (void)c.admin().evict(1 << 20); },
      [](Cell& c) { (void)c.admin().cordon_node("node-1"); },
      [](Cell& c) { (void)c.admin().known_nodes(); },
      [](Cell& c) { (void)c.admin().forget_node("node-1"); },
      [](Cell& c) { (void)c.admin().summary(); },
      [](Cell& c) { (void)c.admin().scan_objects("*", "0", 10); },
      [](Cell& c) { (void)c.admin().scan_node_objects("node-1", "0", 10); },
      [](Cell& c) {
        std::int64_t now = 0;
        if (auto d = c.admin().describe(kKeys, &now); d.is_ok())
          FUZZ_CHECK(d->size() == kKeys.size(), "describe: count");
      },
      [](Cell& c) {
        std::int64_t now = 0;
        (void)c.admin().evict_lru(0ms, 1 << 20, true, 16, &now);
      },
      [](Cell& c) { (void)c.node_catalog().reclaim(64); },
      [](Cell& c) {
        if (auto q = metadata::CellQuotas(c.redis(), c.admin().prefix()).list(); q.is_ok()) {
          for (std::size_t i = 1; i < q->size(); ++i) {
            FUZZ_CHECK((*q)[i - 1].prefix <= (*q)[i].prefix, "list_quotas: not by prefix");
          }
        }
      },
      [](Cell& c) {
        // set_quota, then quota_scan steps until the replies say the pass is done (or run out).
        (void)metadata::CellQuotas(c.redis(), c.admin().prefix())
            .set("tenant/", {10, 1 << 20}, deadline_after(std::chrono::seconds(1)));
      },
  };
  return all;
}

}  // namespace
}  // namespace kvstash

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvstash;
  World& w = world();
  if (size == 0) return -1;
  const auto& all = calls();
  const std::size_t start = (data[0] & 0x7f) % all.size();
  const bool acl = (data[0] & 0x80) != 0;
  fuzz::Framing framing;
  const auto replies =
      fuzz::split_replies(std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1), framing);
  if (framing.huge) return -1;  // see resp.h: hiredis's allocation, not ours

  std::thread redis(serve, w.listener, std::cref(replies));
  {
    metadata::RedisOptions o;
    // An ACL user and a database: AUTH and SELECT take the first two replies.
    o.url = acl ? "redis://kvstash:secret@127.0.0.1:" + std::to_string(w.port) + "/3"
                : "redis://127.0.0.1:" + std::to_string(w.port) + "/0";
    o.connect_timeout = std::chrono::seconds(2);
    o.command_timeout = std::chrono::seconds(2);
    o.reconnect_budget = std::chrono::milliseconds(0);  // a hang-up ends the run of calls
    auto cell = metadata::Cell::open({.redis = o, .cell = "fuzz"});
    FUZZ_CHECK(cell.is_ok() || acl, "connect without credentials: %s", cell.status().to_string().c_str());
    if (cell.is_ok()) {
      for (std::size_t i = 0; i < all.size(); ++i) all[(start + i) % all.size()](**cell);
    }
  }
  redis.join();
  return 0;
}

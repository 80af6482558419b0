// The Store end to end: a real redis-server and real kvstashd processes on loopback, started
// per test on free ports, and this process as the client.
#include "kvstash/store.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "common/checksum.h"
#include "http_get.h"
#include "kvstash_config.h"
#include "metadata/cell.h"
#include "rdma_lane.h"
#include "test_util.h"
#include "tests/harness/local_cluster.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;
using harness::LocalNode;
using harness::LocalRedis;

constexpr std::uint64_t kPage = 1u << 20;

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override { start_redis({}); }

  void start_redis(harness::LocalRedisOptions o) {
    auto r = LocalRedis::start(std::move(o));
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    redis_ = std::move(r).value();
    auto c = metadata::Cell::open({.redis = {.url = redis_->url(), .password = redis_->password()}});
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    cell_ = std::move(c).value();
  }

  // Pages a store reserves ahead of its puts (StoreOptions::put_reservation).
  std::uint64_t put_reservation_ = StoreOptions{}.put_reservation;
  // How long puts avoid a node they failed to reach (StoreOptions::avoid_unreachable_nodes).
  std::chrono::milliseconds avoid_unreachable_ = StoreOptions{}.avoid_unreachable_nodes;
  // How long a put waits for busy pages (StoreOptions::wait_for_pages).
  std::chrono::milliseconds wait_for_pages_ = StoreOptions{}.wait_for_pages;

  std::unique_ptr<LocalNode> node(const std::string& id, const std::string& capacity = "16MiB",
                                  std::vector<std::string> extra = {},
                                  const std::string& heartbeat_ttl = "1s") {
    std::vector<std::string> args{"--heartbeat-ttl", heartbeat_ttl,  "--reclaim-interval",
                                  "100ms",           "--huge-pages", "off"};
    // Loopback test nodes accept UCX's emulated RMA, except in the Soft-RoCE lane, where UCX
    // has RDMA and serves the pool only under keys the NIC checks.
    if (!test::in_rdma_lane()) args.emplace_back("--ucx-allow-emulated-rma");
    args.insert(args.end(), extra.begin(), extra.end());
    auto n = LocalNode::start({.redis_url = redis_->url(),
                               .redis_password = redis_->password(),
                               .capacity = capacity,
                               .page_size = "1MiB",
                               .node_id = id,
                               .extra_args = args});
    EXPECT_TRUE(n.is_ok()) << n.status().to_string();
    return n.is_ok() ? std::move(n).value() : nullptr;
  }

  std::unique_ptr<Store> open(std::optional<TransportKind> prefer = TransportKind::kShm,
                              std::chrono::milliseconds put_lease = 60s,
                              std::chrono::milliseconds read_lease = 60s) {
    StoreOptions o;
    o.redis_url = redis_->url();
    o.redis_password = redis_->password();
    o.engine.prefer = prefer;
    o.engine.ucx.allow_emulated_rma = !test::in_rdma_lane();
    o.timeout = 10s;
    o.put_lease = put_lease;
    o.read_lease = read_lease;
    o.put_reservation = put_reservation_;
    o.avoid_unreachable_nodes = avoid_unreachable_;
    o.wait_for_pages = wait_for_pages_;
    auto s = Store::open(o);
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    return s.is_ok() ? std::move(s).value() : nullptr;
  }

  std::uint64_t free_pages(const std::string& node) {
    auto f = cell_->admin().free_pages(node);
    EXPECT_TRUE(f.is_ok()) << f.status().to_string();
    return f.is_ok() ? *f : 0;
  }

  // Waits until `pred` holds, up to `limit`.
  template <typename Pred>
  static bool eventually(Pred pred, std::chrono::milliseconds limit = 5s) {
    for (auto end = Clock::now() + limit; Clock::now() < end; std::this_thread::sleep_for(20ms)) {
      if (pred()) return true;
    }
    return pred();
  }

  std::unique_ptr<LocalRedis> redis_;
  std::unique_ptr<metadata::Cell> cell_;  // the test's own connection, as an operator and a node
};

// "<prefix><i>". (Not "a" + std::to_string(i): GCC 12 at -O3 can warn -Wrestrict about that,
// wrongly, depending on what it inlines.)
std::string numbered(char prefix, std::size_t i) {
  std::string s = std::to_string(i);
  s.insert(s.begin(), prefix);
  return s;
}

void fill(std::vector<std::byte>& v) {
  static std::atomic<std::uint64_t> seed{1};
  test::fill_random(v, seed++);
}

// Words that only version `version` of an object holds, its number first: a reader can tell
// from the bytes alone whether it got one whole version.
void versioned(std::uint64_t version, std::vector<std::uint64_t>& words) {
  std::uint64_t x = version * 0x9e3779b97f4a7c15ull + 1;
  for (auto& w : words) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    w = x;
  }
  words[0] = version;
}

Status put_bytes(Store& s, const std::string& key, const std::vector<std::byte>& data, PutOptions o = {}) {
  Slice slice{const_cast<std::byte*>(data.data()), data.size()};
  return s.put(key, {&slice, 1}, o);
}

Result<std::vector<std::byte>> get_bytes(Store& s, const std::string& key, std::size_t capacity) {
  std::vector<std::byte> out(capacity);
  Slice slice{out.data(), out.size()};
  KVSTASH_ASSIGN_OR_RETURN(ObjectInfo info, s.get(key, {&slice, 1}));
  out.resize(info.size);
  return out;
}

TEST_F(StoreTest, RoundTripsAreBitExactAcrossSizesAndTransports) {
  auto n = node("n1", "24MiB");
  ASSERT_TRUE(n);
  std::vector<TransportKind> kinds{TransportKind::kShm, TransportKind::kTcp};
#if KVSTASH_HAVE_UCX
  kinds.push_back(TransportKind::kUcx);
#endif
  for (TransportKind kind : kinds) {
    SCOPED_TRACE(std::string(to_string(kind)));
    auto store = open(kind);
    ASSERT_TRUE(store);
    for (std::size_t size :
         {std::size_t{0}, std::size_t{1}, std::size_t{4095}, std::size_t{kPage}, std::size_t{kPage + 1},
          std::size_t{3 * kPage + 12345}, std::size_t{9 * kPage}}) {
      SCOPED_TRACE(size);
      std::vector<std::byte> data(size);
      fill(data);
      std::string key = "obj/" + std::to_string(size);
      ASSERT_TRUE(put_bytes(*store, key, data, {.object_layout = "L" + key}).is_ok());
      auto back = get_bytes(*store, key, size + 100);
      ASSERT_TRUE(back.is_ok()) << back.status().to_string();
      ASSERT_EQ(back->size(), size);
      EXPECT_EQ(test::first_mismatch(back->data(), data.data(), size), -1);
      auto st = store->stat(key);
      ASSERT_TRUE(st.is_ok());
      EXPECT_EQ(st->object_layout, "L" + key);
      EXPECT_EQ(st->pages, (size + kPage - 1) / kPage);
    }

    // Scattered slices at odd offsets on both sides, registered and not.
    std::vector<std::byte> a(kPage + 7), b(333), c(2 * kPage - 5);
    for (auto* v : {&a, &b, &c}) fill(*v);
    Buffer reg = Buffer::allocate(c.size()).value();
    std::memcpy(reg.data(), c.data(), c.size());
    auto handle = store->register_memory(reg.region());
    ASSERT_TRUE(handle.is_ok());
    std::vector<Slice> parts{{a.data(), a.size()}, {b.data(), b.size()}, {reg.data(), reg.size(), &*handle}};
    ASSERT_TRUE(store->put("scatter", parts).is_ok());
    std::vector<std::byte> whole(a.size() + b.size() + c.size());
    auto got = get_bytes(*store, "scatter", whole.size());
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    std::memcpy(whole.data(), a.data(), a.size());
    std::memcpy(whole.data() + a.size(), b.data(), b.size());
    std::memcpy(whole.data() + a.size() + b.size(), c.data(), c.size());
    EXPECT_EQ(test::first_mismatch(got->data(), whole.data(), whole.size()), -1);
    std::vector<std::byte> x(1000), y(whole.size() - 1000);
    std::vector<Slice> into{{x.data(), x.size()}, {y.data(), y.size()}};
    ASSERT_TRUE(store->get("scatter", into).is_ok());
    EXPECT_EQ(test::first_mismatch(x.data(), whole.data(), x.size()), -1);
    EXPECT_EQ(test::first_mismatch(y.data(), whole.data() + 1000, y.size()), -1);
    for (const char* k : {"scatter"}) ASSERT_TRUE(store->remove(k).is_ok());
  }
}

// The cell grants no lease longer than 10 minutes (grant::kMaxLease): a store that would ask
// for one is refused at open, with a message that says so.
TEST_F(StoreTest, AStoreThatWouldAskForLeasesLongerThanTheCellGrantsIsRefused) {
  StoreOptions o;
  o.redis_url = redis_->url();
  o.redis_password = redis_->password();
  for (auto [put, read] : {std::pair{601s, 60s}, std::pair{60s, 601s}, std::pair{0s, 60s}}) {
    o.put_lease = put;
    o.read_lease = read;
    auto s = Store::open(o);
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument)
        << put.count() << " s, " << read.count() << " s";
  }
  o.put_lease = o.read_lease = 600s;
  EXPECT_TRUE(Store::open(o).is_ok()) << "the longest lease the cell grants";
}

TEST_F(StoreTest, APutStreamWritesInPiecesAndBecomesVisibleAtCommit) {
  auto n = node("n1", "16MiB");
  ASSERT_TRUE(n);
  put_reservation_ = 0;  // the pool's count below is exact while the store is open
  auto store = open(TransportKind::kTcp);
  ASSERT_TRUE(store);
  const std::uint64_t all_free = free_pages("n1");
  std::vector<std::byte> old(1000), data(3 * kPage + 5);
  fill(old);
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "k", old).is_ok());

  auto stream = store->begin_put("k", data.size(), {.object_layout = "layer-wise"});
  ASSERT_TRUE(stream.is_ok()) << stream.status().to_string();
  EXPECT_EQ(stream->size(), data.size());
  // Three appends, the last of two slices; readers see the old object until the commit.
  Slice first{data.data(), kPage};
  ASSERT_TRUE(stream->append({&first, 1}).is_ok());
  EXPECT_EQ(get_bytes(*store, "k", data.size()).value(), old);
  Slice second{data.data() + kPage, kPage + 3};
  ASSERT_TRUE(stream->append({&second, 1}).is_ok());
  Slice rest[] = {{data.data() + 2 * kPage + 3, 1}, {data.data() + 2 * kPage + 4, kPage + 1}};
  Slice one_too_many[] = {{data.data(), kPage + 3}};
  EXPECT_EQ(stream->append(one_too_many).code(), StatusCode::kInvalidArgument) << "past the object's size";
  ASSERT_TRUE(stream->append(rest).is_ok());
  EXPECT_EQ(stream->written(), data.size());
  ASSERT_TRUE(stream->commit().is_ok());
  EXPECT_EQ(stream->append(rest).code(), StatusCode::kInvalidArgument) << "after commit";
  auto back = get_bytes(*store, "k", data.size());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(test::first_mismatch(back->data(), data.data(), data.size()), -1)
      << "checksum verified by the get";
  EXPECT_EQ(store->stat("k")->object_layout, "layer-wise");

  // Committed short, or dropped: aborted, pages back, the object unchanged.
  {
    auto short_stream = store->begin_put("k", 2 * kPage);
    ASSERT_TRUE(short_stream.is_ok());
    Slice part{data.data(), kPage};
    ASSERT_TRUE(short_stream->append({&part, 1}).is_ok());
    EXPECT_EQ(short_stream->commit().code(), StatusCode::kInvalidArgument);
    auto dropped = store->begin_put("other", 2 * kPage);
    ASSERT_TRUE(dropped.is_ok());
    ASSERT_TRUE(dropped->append({&part, 1}).is_ok());
  }  // `dropped` destroyed uncommitted
  EXPECT_EQ(free_pages("n1"), all_free - 4) << "only the committed object's 4 pages are taken";
  EXPECT_EQ(store->stat("other").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(get_bytes(*store, "k", data.size())->size(), data.size());
}

TEST_F(StoreTest, PiecesSummedWhereTheyAreMakeTheSameChecksumAsTheHostsAndAreChecked) {
  // A device sums each segment (here the host stands in for it through the same core);
  // the object's checksum equals a host-summed put of the same bytes, and a get checks it.
  auto n = node("n1", "16MiB");
  ASSERT_TRUE(n);
  auto store = open(TransportKind::kTcp);
  ASSERT_TRUE(store);
  const std::uint64_t segment = 10000;
  std::vector<std::byte> data(3 * segment + 123);
  fill(data);
  auto stream = store->begin_put("summed", data.size(), {.checksum_segment = segment});
  ASSERT_TRUE(stream.is_ok()) << stream.status().to_string();
  Slice half{data.data(), segment / 2};
  EXPECT_EQ(stream->append_summed({&half, 1}, 1).code(), StatusCode::kInvalidArgument) << "half a segment";
  std::uint64_t host_sum = 0;
  Slice first{data.data(), segment};
  ASSERT_TRUE(stream->append({&first, 1}, &host_sum).is_ok()) << "hashed here, its sum returned";
  EXPECT_EQ(host_sum, sum::segment_sum(data.data(), segment));
  for (std::uint64_t off = segment; off < data.size(); off += segment) {
    Slice s{data.data() + off, std::min<std::size_t>(segment, data.size() - off)};
    ASSERT_TRUE(stream->append_summed({&s, 1}, sum::segment_sum(s.addr, s.length)).is_ok()) << off;
  }
  ASSERT_TRUE(stream->commit().is_ok());
  auto info = store->stat("summed");
  ASSERT_TRUE(info.is_ok());
  EXPECT_EQ(info->checksum_segment, segment);
  sum::ObjectHasher host(segment);
  host.update(data.data(), data.size());
  EXPECT_EQ(info->checksum, host.finish().value);
  auto back = get_bytes(*store, "summed", data.size());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(*back, data);

  // A wrong sum from the device is caught by the get.
  auto lying = store->begin_put("lying", 2 * segment, {.checksum_segment = segment});
  ASSERT_TRUE(lying.is_ok());
  for (std::uint64_t off = 0; off < 2 * segment; off += segment) {
    Slice s{data.data() + off, segment};
    ASSERT_TRUE(lying->append_summed({&s, 1}, sum::segment_sum(s.addr, s.length) + off).is_ok());
  }
  ASSERT_TRUE(lying->commit().is_ok());
  EXPECT_EQ(get_bytes(*store, "lying", 2 * segment).status().code(), StatusCode::kCorrupt);
}

TEST_F(StoreTest, AShmPutsChecksumComesOutOfItsCopyAndIsTheDefinedOne) {
  // shm digests each 4 KiB block as it copies it; the slices' edges cut some blocks, which
  // the store hashes itself. The object's sum must be the xxh3 tree of its bytes, whatever
  // did the hashing, at the default segment and at one that is not a multiple of a page.
  auto n = node("n1", "16MiB");
  ASSERT_TRUE(n);
  auto store = open(TransportKind::kShm);
  ASSERT_TRUE(store);
  std::vector<std::byte> data(3 * kPage + 4097 + 777);
  fill(data);
  const std::vector<std::size_t> cuts{5000, kPage + 3, 2 * kPage + 4096 * 3, data.size()};
  std::vector<Slice> slices;
  for (std::size_t at = 0; const std::size_t cut : cuts) {
    slices.push_back({data.data() + at, cut - at});
    at = cut;
  }
  for (const std::uint64_t segment :
       {sum::kDefaultSegmentBytes, std::uint64_t{3} * 4096, std::uint64_t{1000000}}) {
    SCOPED_TRACE(segment);
    OpTimings t;
    ASSERT_TRUE(store->put("fused", slices, {.timings = &t, .checksum_segment = segment}).is_ok());
    if (segment % 4096 != 0) {
      EXPECT_EQ(t.checksummed_in_copy, 0u) << "segments that cut blocks: the blocks restart per segment";
    } else {
      // The two blocks the slices' edges cut (at 5000 and 3 bytes into a page) are the
      // store's; the rest came out of the copy.
      EXPECT_EQ(t.checksummed_in_copy, data.size() - 2 * 4096);
    }
    auto info = store->stat("fused");
    ASSERT_TRUE(info.is_ok());
    sum::ObjectHasher host(segment);
    host.update(data.data(), data.size());
    EXPECT_EQ(info->checksum, host.finish().value);
    auto back = get_bytes(*store, "fused", data.size());
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(*back, data);
  }

  // A stream of segments (a KV layer each): summed in the copy, folded as their writes are
  // waited for, in order also when a piece whose sum the caller wants comes between.
  const std::uint64_t segment = 64 * 1024;
  OpTimings t;
  auto stream = store->begin_put("streamed", data.size(), {.timings = &t, .checksum_segment = segment});
  ASSERT_TRUE(stream.is_ok()) << stream.status().to_string();
  std::uint64_t at = 0, asked = 0;
  for (int piece = 0; at < data.size(); ++piece) {
    const std::uint64_t n = std::min<std::uint64_t>(piece % 3 == 2 ? segment : 3 * segment, data.size() - at);
    Slice s{data.data() + at, n};
    ASSERT_TRUE(stream->append({&s, 1}, piece % 3 == 2 ? &asked : nullptr).is_ok()) << piece;
    if (piece % 3 == 2) {
      EXPECT_EQ(asked, sum::segment_sum(data.data() + at, n)) << piece;
    }
    at += n;
  }
  ASSERT_TRUE(stream->wait_written(data.size()).is_ok());
  sum::ObjectHasher host(segment);
  host.update(data.data(), data.size());
  host.end_object();
  EXPECT_EQ(stream->segment_sums(), host.segment_sums());
  ASSERT_TRUE(stream->commit().is_ok());
  EXPECT_GT(t.checksummed_in_copy, data.size() / 2);
  EXPECT_EQ(store->stat("streamed")->checksum, host.finish().value);
  EXPECT_EQ(get_bytes(*store, "streamed", data.size()).value(), data);
}

TEST_F(StoreTest, AGetReportsItsProgressInOrder) {
  auto n = node("n1", "24MiB");
  ASSERT_TRUE(n);
  auto store = open(TransportKind::kShm);
  ASSERT_TRUE(store);
  std::vector<std::byte> data(9 * kPage + 77), into(data.size());
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "p", data, {.object_layout = "with layout"}).is_ok());
  std::vector<std::uint64_t> seen;
  Slice s{into.data(), into.size()};
  GetOptions o;
  o.progress = [&](std::uint64_t landed, std::string_view object_layout) {
    EXPECT_EQ(object_layout, "with layout");
    // What is reported as landed is in place already.
    EXPECT_EQ(std::memcmp(into.data(), data.data(), landed), 0);
    seen.push_back(landed);
  };
  ASSERT_TRUE(store->get("p", {&s, 1}, o).is_ok());
  ASSERT_GE(seen.size(), 2u) << "a 9 MiB object lands in more than one step";
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
  EXPECT_EQ(seen.back(), data.size());
}

TEST_F(StoreTest, AGetOfUnknownSizeLearnsItInTheScriptThatReadsIt) {
  auto n = node("n1", "24MiB");
  ASSERT_TRUE(n);
  auto store = open(TransportKind::kShm);
  ASSERT_TRUE(store);
  std::vector<std::byte> data(3 * kPage + 5);
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "u", data, {.object_layout = "u-layout"}).is_ok());
  std::vector<std::byte> into;
  std::vector<std::uint64_t> asked;
  const GetInto place = [&](std::uint64_t size) -> Result<std::vector<Slice>> {
    asked.push_back(size);
    into.resize(size);
    return std::vector<Slice>{{into.data(), into.size()}};
  };
  OpTimings t;
  auto got = store->get_unsized("u", place, {.timings = &t});
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(asked, std::vector<std::uint64_t>{data.size()});
  EXPECT_EQ(got->size, data.size());
  EXPECT_EQ(got->object_layout, "u-layout");
  EXPECT_EQ(into, data);
  EXPECT_EQ(t.redis_round_trips, 1u) << "no stat before the get";

  // `into` refusing: its error; offering too little: get's; an absent object: never asked.
  auto refused = store->get_unsized(
      "u", [](std::uint64_t) -> Result<std::vector<Slice>> { return Status::no_space("not that much"); });
  EXPECT_EQ(refused.status().code(), StatusCode::kNoSpace);
  auto short_of_it = store->get_unsized("u", [&](std::uint64_t size) -> Result<std::vector<Slice>> {
    into.assign(size - 1, std::byte{0});
    return std::vector<Slice>{{into.data(), into.size()}};
  });
  EXPECT_EQ(short_of_it.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->get_unsized("absent", place).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(asked.size(), 1u);
  ASSERT_TRUE(store->get_unsized("u", place).is_ok()) << "the failed gets changed nothing";
  EXPECT_EQ(into, data);
}

// A client that has only the verbs transport: every byte goes over RDMA to the node's pool
// (in the Soft-RoCE lane, over rxe0). Skips where there is no RDMA device.
TEST_F(StoreTest, RoundTripsOverVerbs) {
  StoreOptions o;
  o.redis_url = redis_->url();
  o.engine.transports = {TransportKind::kVerbs};
  o.timeout = 30s;
  o.rkey_scope = RkeyScope::kLease;  // a window per operation (the next test: per connection)
  const Status verbs = test::verbs_available();
  KVSTASH_REQUIRE_RDMA(verbs.is_ok(), verbs.to_string());
  auto n = node("n1", "24MiB");
  ASSERT_TRUE(n);
  auto store = Store::open(o);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  for (std::size_t size : {std::size_t{1}, std::size_t{kPage + 4097}, std::size_t{5 * kPage}}) {
    SCOPED_TRACE(size);
    std::vector<std::byte> data(size);
    fill(data);
    std::string key = "v";
    key += std::to_string(size);
    ASSERT_TRUE(put_bytes(**store, key, data).is_ok());
    auto back = get_bytes(**store, key, size);
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(test::first_mismatch(back->data(), data.data(), size), -1);
  }
  // Every put and get went through leases: the node bound windows for each (one lease per
  // operation and device lane) and revoked them as they were released.
  const std::string text = test::http_get(n->admin(), "/metrics").second;
  auto event = [&](const char* name) {
    return test::metric(text, "kvstash_transport_events_total",
                        std::string("{transport=\"verbs\",event=\"") + name + "\"}");
  };
  EXPECT_GE(event("leases_granted"), 6) << text;
  EXPECT_GE(event("windows_bound"), 6);
  EXPECT_EQ(event("leases_refused"), 0);
  EXPECT_GE(event("leases_released") + event("leases_expired"), 1);
  // The node dies: the next get fails within its deadline instead of hanging.
  n->kill();
  std::vector<std::byte> out(kPage + 4097);
  Slice s{out.data(), out.size()};
  auto start = Clock::now();
  std::string key = "v";
  key += std::to_string(kPage + 4097);
  auto r = (*store)->get(key, {&s, 1}, {.deadline = deadline_after(5s)});
  EXPECT_LT(Clock::now() - start, 7s);
  EXPECT_FALSE(r.is_ok());
}

// The node's CPU off the hot path: with rkey_scope connection a client takes one window over
// the pool for reads and one for writes, then every get and put goes without a round trip to
// the node or any of its CPU; with lease, each costs a round trip and window binds. Counted
// on both sides: the client's OpTimings and the node's own counters.
TEST_F(StoreTest, OverVerbsConnectionScopedWindowsTakeTheNodesCpuOffEachOperation) {
  const Status verbs = test::verbs_available();
  KVSTASH_REQUIRE_RDMA(verbs.is_ok(), verbs.to_string());
  auto n = node("n1", "24MiB");
  ASSERT_TRUE(n);
  auto granted = [&] {
    return test::metric(test::http_get(n->admin(), "/metrics").second, "kvstash_transport_events_total",
                        "{transport=\"verbs\",event=\"leases_granted\"}");
  };
  // The cell's policy is connection unless set: this client reads it at open.
  ASSERT_EQ(cell_->admin().rkey_scope().value(), RkeyScope::kConnection);
  constexpr int kOps = 10;
  for (RkeyScope scope : {RkeyScope::kConnection, RkeyScope::kLease}) {
    SCOPED_TRACE(to_string(scope));
    ASSERT_TRUE(cell_->admin().set_rkey_scope(scope).is_ok());
    StoreOptions o;
    o.redis_url = redis_->url();
    o.engine.transports = {TransportKind::kVerbs};
    o.timeout = 30s;
    auto store = Store::open(o);
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    const double before = granted();
    std::uint32_t put_trips = 0, get_trips = 0, first_put = 0, first_get = 0;
    for (int i = 0; i < kOps; ++i) {
      std::vector<std::byte> data(kPage + 100 * i);
      fill(data);
      const std::string key = std::string(to_string(scope)) + std::to_string(i);
      OpTimings pt, gt;
      Slice s{data.data(), data.size()};
      ASSERT_TRUE((*store)->put(key, {&s, 1}, {.timings = &pt}).is_ok());
      std::vector<std::byte> back(data.size());
      Slice into{back.data(), back.size()};
      ASSERT_TRUE((*store)->get(key, {&into, 1}, {.timings = &gt}).is_ok());
      EXPECT_EQ(back, data);
      put_trips += pt.node_round_trips;
      get_trips += gt.node_round_trips;
      if (i == 0) first_put = pt.node_round_trips, first_get = gt.node_round_trips;
    }
    const double grants = granted() - before;
    if (scope == RkeyScope::kConnection) {
      EXPECT_EQ(first_put, 1u) << "the first put takes the pool's write window";
      EXPECT_EQ(first_get, 1u) << "the first get the read window";
      EXPECT_EQ(put_trips, 1u) << "no other put asked the node";
      EXPECT_EQ(get_trips, 1u) << "no other get asked the node";
      EXPECT_LE(grants, 2 * 2) << "two windows per lane (the lane has two rxe devices at most)";
    } else {
      EXPECT_EQ(put_trips, static_cast<std::uint32_t>(kOps));
      EXPECT_EQ(get_trips, static_cast<std::uint32_t>(kOps));
      EXPECT_GE(grants, 2 * kOps) << "the node bound windows for every operation";
    }
  }
  ASSERT_TRUE(cell_->admin().set_rkey_scope(RkeyScope::kConnection).is_ok());
}

// A put that fails mid-way with a shared window cannot have it revoked (other puts use it),
// so its pages return only once the node fenced past the put's deadline, never while a late
// write could land; a fresh put meanwhile gets other pages, and reads what it wrote.
TEST_F(StoreTest, OverVerbsAPutThatFailsWithASharedWindowLeavesItsPagesToTheFence) {
  const Status verbs = test::verbs_available();
  KVSTASH_REQUIRE_RDMA(verbs.is_ok(), verbs.to_string());
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  StoreOptions o;
  o.redis_url = redis_->url();
  o.engine.transports = {TransportKind::kVerbs};
  o.timeout = 30s;
  o.put_lease = 3s;
  o.rkey_scope = RkeyScope::kConnection;
  o.put_reservation = 0;  // the pool's count below is exact while the store is open
  auto store = Store::open(o);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  const std::uint64_t all_free = free_pages("n1");
  std::vector<std::byte> data(2 * kPage);
  fill(data);
  {
    auto stream = (*store)->begin_put("dropped", data.size());
    ASSERT_TRUE(stream.is_ok()) << stream.status().to_string();
    Slice half{data.data(), kPage};
    ASSERT_TRUE(stream->append({&half, 1}).is_ok());
    ASSERT_TRUE(stream->wait_written(kPage).is_ok());
  }  // dropped: aborted while holding the shared write window
  EXPECT_EQ(free_pages("n1"), all_free - 2) << "not freed at once: the window was not revoked";
  Slice whole{data.data(), data.size()};
  ASSERT_TRUE((*store)->put("kept", {&whole, 1}).is_ok());
  EXPECT_EQ(get_bytes(**store, "kept", data.size()).value(), data);
  EXPECT_TRUE(test::eventually([&] { return free_pages("n1") == all_free - 2; }, 20s))
      << "the fence past the dropped put's deadline returned its pages";
}

// A client whose reads go over UCX. With RDMA (the Soft-RoCE lane: rc_verbs on rxe) the
// node's NIC serves them from its pool, under keys it checks, and the node's CPU takes no
// part: they complete while the node is stopped. Puts go over tcp, which can fence them at
// the node (UCX holds no leases there). Skips where there is no RDMA device.
TEST_F(StoreTest, ReadsOverUcxWithRdmaNeedNoNodeCpu) {
#if !KVSTASH_HAVE_UCX
  GTEST_SKIP() << "built without UCX";
#else
  KVSTASH_REQUIRE_RDMA(test::rdma_device_listed(), "/sys/class/infiniband lists no device");
  auto n = node("n1", "24MiB", {}, "30s");  // a heartbeat that outlives the stop below
  ASSERT_TRUE(n);
  StoreOptions o;
  o.redis_url = redis_->url();
  o.redis_password = redis_->password();
  o.engine.transports = {TransportKind::kUcx, TransportKind::kTcp};
  o.engine.prefer = TransportKind::kUcx;
  o.timeout = 30s;
  auto opened = Store::open(o);
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  Store& store = **opened;
  std::vector<std::vector<std::byte>> objects;
  for (std::size_t size : {std::size_t{1}, std::size_t{kPage + 4097}, std::size_t{5 * kPage}}) {
    SCOPED_TRACE(size);
    auto& data = objects.emplace_back(size);
    fill(data);
    const std::string key = numbered('u', size);
    ASSERT_TRUE(put_bytes(store, key, data).is_ok());
    auto back = get_bytes(store, key, size);
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(test::first_mismatch(back->data(), data.data(), size), -1);
  }
  auto ucx_counter = [&](std::string_view name) {
    for (const auto& c : store.engine().counters()) {
      if (c.transport == TransportKind::kUcx && c.name == name) return c.value;
    }
    return std::uint64_t{0};
  };
  EXPECT_GE(ucx_counter("connections_one_sided"), 1u) << "no UCX connection over RDMA lanes";
  EXPECT_EQ(ucx_counter("connections_emulated"), 0u);

  // The node stopped: a get still lands, bit-exact (over tcp it would time out).
  ASSERT_EQ(kill(n->pid(), SIGSTOP), 0);
  const std::string key = numbered('u', 5 * kPage);
  auto back = get_bytes(store, key, 5 * kPage);
  kill(n->pid(), SIGCONT);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(test::first_mismatch(back->data(), objects.back().data(), 5 * kPage), -1);
#endif
}

TEST_F(StoreTest, ObjectsSpanPagesAndTwoNodes) {
  auto a = node("a", "8MiB");
  auto b = node("b", "8MiB");
  ASSERT_TRUE(a && b);
  auto store = open(TransportKind::kTcp);
  ASSERT_TRUE(store);
  std::vector<std::byte> data(12 * kPage + 99);
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "big", data).is_ok());
  auto st = store->stat("big").value();
  EXPECT_EQ(st.pages, 13u);
  EXPECT_EQ(st.nodes.size(), 2u) << "13 pages cannot fit one 8-page node";
  EXPECT_EQ(free_pages("a") + free_pages("b"), 3u);
  auto back = get_bytes(*store, "big", data.size());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(test::first_mismatch(back->data(), data.data(), data.size()), -1);
  // Too big for the cell: a clear no-space error, nothing evicted.
  std::vector<std::byte> huge(17 * kPage);
  EXPECT_EQ(put_bytes(*store, "huge", huge).code(), StatusCode::kNoSpace);
  EXPECT_TRUE(store->stat("big").is_ok());
}

TEST_F(StoreTest, ConnectingToTheNodesAheadOfUseReachesEveryLiveOne) {
  auto store = open(TransportKind::kShm);
  ASSERT_TRUE(store);
  EXPECT_EQ(store->connect_nodes().value(), 0u) << "a cell without nodes";
  auto a = node("a", "8MiB");
  auto b = node("b", "8MiB");
  ASSERT_TRUE(a && b);
  EXPECT_EQ(store->connect_nodes().value(), 2u);
  EXPECT_EQ(store->connect_nodes().value(), 2u) << "connected already: the same links";
  b.reset();  // stopped: it leaves the cell
  EXPECT_EQ(store->connect_nodes().value(), 1u);
  std::vector<std::byte> data(kPage);
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "k", data).is_ok());
  EXPECT_EQ(test::first_mismatch(get_bytes(*store, "k", data.size())->data(), data.data(), data.size()), -1);
}

TEST_F(StoreTest, APutConditionalOnAVersionNeverOverwritesANewerObject) {
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  auto store = open();
  ASSERT_TRUE(store);
  const std::uint64_t all_free = free_pages("n1");
  std::vector<std::byte> v1(kPage + 1), v2(100), v3(kPage);
  fill(v1);
  fill(v2);
  fill(v3);
  // "": only if absent.
  ASSERT_TRUE(put_bytes(*store, "cas", v1, {.if_version = ""}).is_ok());
  EXPECT_EQ(put_bytes(*store, "cas", v2, {.if_version = ""}).code(), StatusCode::kStale) << "it exists now";
  std::vector<std::byte> back(v1.size());
  Slice into{back.data(), back.size()};
  auto got = store->get("cas", {&into, 1});
  ASSERT_TRUE(got.is_ok());
  const std::string seen = got->version;
  EXPECT_FALSE(seen.empty());
  EXPECT_EQ(store->stat("cas")->version, seen) << "stat and get name the same version";
  // A writer replaces it; a put based on the version read before must not undo that.
  ASSERT_TRUE(put_bytes(*store, "cas", v2).is_ok());
  EXPECT_NE(store->stat("cas")->version, seen);
  auto stale = put_bytes(*store, "cas", v3, {.if_version = seen});
  EXPECT_EQ(stale.code(), StatusCode::kStale) << stale.to_string();
  EXPECT_EQ(get_bytes(*store, "cas", v2.size()).value(), v2) << "the newer object stays";
  // Based on the current version it goes through; a stream honours it too.
  ASSERT_TRUE(put_bytes(*store, "cas", v3, {.if_version = store->stat("cas")->version}).is_ok());
  EXPECT_EQ(get_bytes(*store, "cas", v3.size()).value(), v3);
  auto stream = store->begin_put("cas", v1.size(), {.if_version = seen});
  ASSERT_TRUE(stream.is_ok());
  Slice all{v1.data(), v1.size()};
  ASSERT_TRUE(stream->append({&all, 1}).is_ok());
  EXPECT_EQ(stream->commit().code(), StatusCode::kStale);
  store.reset();  // what it reserved and did not use goes back
  EXPECT_EQ(free_pages("n1"), all_free - 1) << "refused puts gave their pages back; v3 holds one";
}

TEST_F(StoreTest, ExpiryRemoveAndOverwriteReturnPagesToThePool) {
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  put_reservation_ = 0;  // the pool's count after each step is exact (reservations: below)
  auto store = open();
  ASSERT_TRUE(store);
  std::vector<std::byte> data(2 * kPage);
  fill(data);

  ASSERT_TRUE(put_bytes(*store, "ttl", data, {.ttl = 300ms}).is_ok());
  EXPECT_EQ(free_pages("n1"), 6u);
  EXPECT_TRUE(store->stat("ttl")->ttl.has_value());
  // Nobody reads it: kvstashd's reclaim sweep must return the pages by itself.
  EXPECT_TRUE(eventually([&] { return free_pages("n1") == 8u; })) << "expired pages did not come back";
  EXPECT_EQ(get_bytes(*store, "ttl", data.size()).status().code(), StatusCode::kNotFound);

  ASSERT_TRUE(put_bytes(*store, "k", data).is_ok());
  ASSERT_TRUE(put_bytes(*store, "k", data).is_ok());
  EXPECT_EQ(free_pages("n1"), 6u) << "an overwrite must free the old pages";
  ASSERT_TRUE(store->remove("k").is_ok());
  EXPECT_EQ(free_pages("n1"), 8u);
  EXPECT_EQ(store->remove("k").code(), StatusCode::kNotFound);

  ASSERT_TRUE(put_bytes(*store, "t", data, {.ttl = 200ms}).is_ok());
  ASSERT_TRUE(store->touch("t", 60s).is_ok());
  std::this_thread::sleep_for(400ms);
  EXPECT_TRUE(get_bytes(*store, "t", data.size()).is_ok()) << "touch must extend the TTL";
  EXPECT_EQ(store->touch("absent", 1s).code(), StatusCode::kNotFound);
}

TEST_F(StoreTest, PutsFromAReservationCostOneRoundTripAndItsUnusedPagesReturn) {
  auto n = node("n1", "64MiB");
  ASSERT_TRUE(n);
  put_reservation_ = 8 * kPage;
  auto store = open();
  ASSERT_TRUE(store);
  std::vector<std::byte> data(2 * kPage);
  std::vector<std::uint32_t> trips;
  for (int i = 0; i < 5; ++i) {
    fill(data);
    OpTimings t;
    ASSERT_TRUE(put_bytes(*store, "r" + std::to_string(i), data, {.timings = &t}).is_ok());
    trips.push_back(t.redis_round_trips);
    EXPECT_EQ(get_bytes(*store, "r" + std::to_string(i), data.size()).value(), data);
  }
  // The first put reserves 2 + 8 pages: it and the next four commit in one round trip each.
  EXPECT_EQ(trips, (std::vector<std::uint32_t>{2, 1, 1, 1, 1}));
  EXPECT_EQ(free_pages("n1"), 54u) << "ten pages reserved, all of them now objects";
  fill(data);
  OpTimings t;
  ASSERT_TRUE(put_bytes(*store, "r5", data, {.timings = &t}).is_ok());
  EXPECT_EQ(t.redis_round_trips, 2u) << "the reservation ran out: a new one";
  EXPECT_EQ(free_pages("n1"), 44u);
  ASSERT_TRUE(put_bytes(*store, "r0", data).is_ok());  // an overwrite frees the old object's
  EXPECT_EQ(free_pages("n1"), 46u);
  // A failed put's pages go back; so does what no put took, when the store closes.
  auto stream = store->begin_put("unfinished", data.size());
  ASSERT_TRUE(stream.is_ok());
  stream->abort();
  store.reset();
  EXPECT_EQ(free_pages("n1"), 64u - 12u) << "six objects of two pages each hold the pool";
}

TEST_F(StoreTest, AReservationNeverEvictsAndTakesAtMostAQuarterOfTheFreePages) {
  auto n = node("n1", "16MiB");
  ASSERT_TRUE(n);
  put_reservation_ = 64 * kPage;
  auto store = open();
  ASSERT_TRUE(store);
  std::vector<std::byte> data(4 * kPage);
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "a", data).is_ok());
  EXPECT_EQ(free_pages("n1"), 16u - 4u - 3u) << "4 pages for the put, a quarter of the other 12 reserved";
  auto other = open();
  ASSERT_TRUE(other);
  for (const char* k : {"b", "c"}) ASSERT_TRUE(put_bytes(*other, k, data).is_ok()) << k;
  // The pool holds a, b, c and the two reservations' spare pages: d must evict, and only
  // the least recently used object, however many pages sit reserved.
  ASSERT_TRUE(put_bytes(*other, "d", data).is_ok());
  EXPECT_EQ(store->stat("a").status().code(), StatusCode::kNotFound);
  for (const char* k : {"b", "c", "d"}) EXPECT_TRUE(store->stat(k).is_ok()) << k;
  store.reset();
  other.reset();
  EXPECT_EQ(free_pages("n1"), 16u - 12u) << "closing the stores returned their spare pages";
}

TEST_F(StoreTest, FillingMemoryEvictsTheLeastRecentlyUsed) {
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  auto store = open();
  ASSERT_TRUE(store);
  std::vector<std::byte> data(2 * kPage);
  for (int i = 0; i < 4; ++i) {
    fill(data);
    ASSERT_TRUE(put_bytes(*store, "s" + std::to_string(i), data).is_ok());
  }
  ASSERT_TRUE(get_bytes(*store, "s0", data.size()).is_ok());  // s0 is now the most recent
  ASSERT_TRUE(put_bytes(*store, "s4", data).is_ok());         // the pool is full: s1 goes
  EXPECT_EQ(get_bytes(*store, "s1", data.size()).status().code(), StatusCode::kNotFound);
  for (const char* k : {"s0", "s2", "s3", "s4"}) EXPECT_TRUE(store->stat(k).is_ok()) << k;
  std::vector<std::string> chain{"s2", "s3", "s1", "s4"};
  EXPECT_EQ(store->contains_prefix(chain).value(), 2u);
}

std::uint64_t pending_records(metadata::Cell& cell) {
  auto r = cell.redis().command({"ZCARD", cell.prefix() + ":pending"});
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? static_cast<std::uint64_t>(r->integer()) : 0;
}

// What an operator sees of a node's pages: free, held by objects, reserved by puts under way,
// and in limbo (no object's, not free yet) while a reader still leases a removed object.
TEST_F(StoreTest, ANodesStatusTellsReservedPagesAndPagesInLimbo) {
  auto n = node("n1", "16MiB");
  ASSERT_TRUE(n);
  put_reservation_ = 0;
  auto store = open();
  ASSERT_TRUE(store);
  std::vector<std::byte> data(3 * kPage);
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "held", data).is_ok());
  auto stream = store->begin_put("under-way", 2 * kPage);
  ASSERT_TRUE(stream.is_ok());
  auto status = [&] {
    auto st = cell_->admin().node_status("n1");
    EXPECT_TRUE(st.is_ok()) << st.status().to_string();
    return st.is_ok() ? *st : metadata::NodeStatus{};
  };
  auto st = status();
  EXPECT_EQ(st.free_pages, 11u);
  EXPECT_EQ(st.object_pages(), 3u);
  EXPECT_EQ(st.reserved_pages, 2u) << "the put under way";
  EXPECT_EQ(st.limbo_pages, 0u);

  // A reader leases "held"; removed under it, its pages wait for the reader: limbo.
  auto lease = cell_->catalog().begin_get("held", "reader-1", 60s);
  ASSERT_TRUE(lease.is_ok()) << lease.status().to_string();
  ASSERT_TRUE(store->remove("held").is_ok());
  st = status();
  EXPECT_EQ(st.limbo_pages, 3u);
  EXPECT_EQ(st.object_pages(), 0u);
  EXPECT_EQ(st.free_pages, 11u);
  ASSERT_TRUE(cell_->catalog().end_get("reader-1", *lease).is_ok());
  stream->abort();
  st = status();
  EXPECT_EQ(st.limbo_pages, 0u) << "the reader left: the pages are free";
  EXPECT_EQ(st.reserved_pages, 0u);
  EXPECT_EQ(st.free_pages, 16u);
}

// Puts whose deadline passes while they write or commit fail kTimeout; their pages are theirs
// for far less than a put lease: every write of theirs has ended, so the pages go back at
// once (the client confirms it, or no write went out), and their reservations' records go
// with the last put that took from them. With the lease alone, a cell that turns over in
// milliseconds would fill with pages held for a minute.
// A put into a cell whose every page is busy for now waits (StoreOptions::wait_for_pages,
// within its deadline) for them to come back: here a reader's lease on the object that fills
// the pool, ended 150 ms into the put, which then evicts it. Without the wait (0) the same put
// is refused kNoSpace at once; one larger than the cell is refused at once either way.
TEST_F(StoreTest, APutWaitsForPagesThatAreOnlyBusy) {
  auto n = node("a", "4MiB");
  ASSERT_TRUE(n);
  std::vector<std::byte> full(4 * kPage), one(kPage), huge(5 * kPage);
  fill(full), fill(one);
  put_reservation_ = 0;
  for (const auto wait : {0ms, 2000ms}) {
    SCOPED_TRACE(wait.count());
    wait_for_pages_ = wait;
    auto store = open();
    ASSERT_TRUE(store);
    ASSERT_TRUE(put_bytes(*store, "held", full).is_ok());
    auto lease = cell_->catalog().begin_get("held", "reader", 30s);
    ASSERT_TRUE(lease.is_ok()) << lease.status().to_string();
    std::thread ender([&] {
      std::this_thread::sleep_for(150ms);
      EXPECT_TRUE(cell_->catalog().end_get("reader", *lease).is_ok());
    });
    const auto t0 = Clock::now();
    Status s = put_bytes(*store, "next", one);
    const auto took = Clock::now() - t0;
    ender.join();
    if (wait == 0ms) {
      EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.to_string();
      EXPECT_LT(took, 150ms) << "refused at once";
      ASSERT_TRUE(store->remove("held").is_ok());
    } else {
      EXPECT_TRUE(s.is_ok()) << s.to_string();
      EXPECT_GE(took, 150ms) << "it waited for the reader";
      EXPECT_EQ(store->get("held", {}).status().code(), StatusCode::kNotFound) << "evicted once unleased";
      ASSERT_TRUE(store->remove("next").is_ok());
    }
    const auto h0 = Clock::now();
    EXPECT_EQ(put_bytes(*store, "huge", huge).code(), StatusCode::kNoSpace);
    EXPECT_LT(Clock::now() - h0, 1s) << "no wait for pages the cell never has";
  }
}

// A put whose commit is held up on its way to Redis (here Redis itself stopped) returns
// kTimeout once its client stops waiting; the commit, reaching Redis later, must change
// nothing: the key keeps the object it had (a put that returned an error never becomes the
// object behind the caller's back, after later puts of the key). Without the commit's
// deadline in the script (commit_by), the get after Redis resumes returns the second put's
// bytes.
TEST_F(StoreTest, ACommitThatReachesRedisAfterItsPutGaveUpChangesNothing) {
  auto n = node("a", "16MiB");
  ASSERT_TRUE(n);
  StoreOptions o;
  o.redis_url = redis_->url();
  o.redis_password = redis_->password();
  o.engine.prefer = TransportKind::kShm;
  o.redis_timeout = 300ms;
  o.timeout = 5s;
  auto opened = Store::open(o);
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  auto& store = **opened;
  std::vector<std::byte> v1(64 << 10), v2(64 << 10), got(64 << 10);
  fill(v1), fill(v2);
  ASSERT_TRUE(put_bytes(store, "k", v1).is_ok());  // the store holds a reservation from here on
  ASSERT_EQ(::kill(redis_->pid(), SIGSTOP), 0);
  Status late = put_bytes(store, "k", v2, {.deadline = deadline_after(2s)});  // writes, then its commit waits
  ASSERT_EQ(::kill(redis_->pid(), SIGCONT), 0);
  EXPECT_EQ(late.code(), StatusCode::kTimeout) << late.to_string();
  std::this_thread::sleep_for(300ms);  // Redis has run whatever reached it meanwhile
  Slice into{got.data(), got.size()};
  auto r = store.get("k", {&into, 1});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(test::first_mismatch(got.data(), v1.data(), v1.size()), -1)
      << "the put that returned kTimeout became the object afterwards";
}

TEST_F(StoreTest, PagesOfPutsThatMissTheirDeadlineComeBackAtOnce) {
  auto n1 = node("n1", "16MiB"), n2 = node("n2", "16MiB");
  ASSERT_TRUE(n1 && n2);
  auto store = open();
  ASSERT_TRUE(store);
  std::vector<std::byte> data(8 * kPage);
  fill(data);
  std::mt19937 rng(5);
  std::map<StatusCode, int> outcomes;
  for (int i = 0; i < 400; ++i) {
    const std::size_t size = kPage + rng() % (7 * kPage);
    Slice slice{data.data(), size};
    const auto deadline = Clock::now() + std::chrono::microseconds(rng() % 4000);
    ++outcomes[store->put(numbered('k', i % 10), {&slice, 1}, {.deadline = deadline}).code()];
  }
  for (const auto& [code, count] : outcomes) {
    EXPECT_TRUE(code == StatusCode::kOk || code == StatusCode::kTimeout) << to_string(code) << " x" << count;
  }
  EXPECT_GT(outcomes[StatusCode::kTimeout], 20) << "the deadlines must have cut puts short";
  EXPECT_GT(outcomes[StatusCode::kOk], 20);
  for (int i = 0; i < 10; ++i) (void)store->remove(numbered('k', i));
  store.reset();  // its spare reserved pages go back; its background aborts finish
  EXPECT_EQ(free_pages("n1") + free_pages("n2"), 32u) << "pages of puts that missed their deadline are held";
  EXPECT_EQ(pending_records(*cell_), 0u) << "pending put or reservation records stayed behind";
}

// The case that once filled a cell with limbo: one client, puts as fast as it can over 20 keys
// of 4 KiB..8 MiB, a tenth with a short TTL and a quarter with a deadline of 1..50 ms. The
// cell is full and every put evicts or replaces, yet every put finds room, and the client's
// retired reservations leave no records behind.
TEST_F(StoreTest, AFullCellKeepsTakingPutsWhateverTheirDeadlines) {
  auto n1 = node("n1", "16MiB"), n2 = node("n2", "16MiB");
  ASSERT_TRUE(n1 && n2);
  auto store = open();
  ASSERT_TRUE(store);
  std::vector<std::byte> data(8 * kPage);
  fill(data);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(0, 1);
  // Outcomes of the puts with the default deadline, and of those with a short one (which may
  // time out on a loaded machine: that is their deadline, not the cell).
  std::map<StatusCode, int> outcomes, short_outcomes;
  int puts = 0;
  for (const auto end = Clock::now() + 6s; Clock::now() < end; ++puts) {
    const auto size = static_cast<std::size_t>(
        std::exp(std::log(4096.0) + (std::log(8.0 * kPage) - std::log(4096.0)) * u(rng)));
    PutOptions o;
    if (u(rng) < 0.1) o.ttl = std::chrono::milliseconds(200 + rng() % 1800);
    if (u(rng) < 0.25) o.deadline = Clock::now() + std::chrono::milliseconds(1 + rng() % 50);
    Slice slice{data.data(), size};
    ++(o.deadline ? short_outcomes : outcomes)[store->put(numbered('k', rng() % 20), {&slice, 1}, o).code()];
  }
  int plain = 0;
  for (const auto& [code, count] : outcomes) {
    plain += count;
    EXPECT_EQ(code, StatusCode::kOk) << count << " of " << puts << " puts with the default deadline";
  }
  for (const auto& [code, count] : short_outcomes) {
    EXPECT_TRUE(code == StatusCode::kOk || code == StatusCode::kTimeout)
        << to_string(code) << " x" << count << " of " << puts << " puts with a deadline of 1..50 ms";
  }
  EXPECT_GT(plain, 100) << "of " << puts << " puts";
  EXPECT_LE(pending_records(*cell_), 2u) << "retired reservations piled up";
}

// Two writers overwrite one key and fill the pool (forcing evictions) while readers get it
// thousands of times: every successful get must hold one version's bytes, whole. With a
// normal read lease the replaced pages wait for their readers; with a 1 ms lease they are
// reused under the readers, and generations and checksums must turn that into kStale.
class StoreRaceTest : public StoreTest, public ::testing::WithParamInterface<int> {};

INSTANTIATE_TEST_SUITE_P(ReadLease, StoreRaceTest, ::testing::Values(60000, 1),
                         [](const auto& info) { return std::to_string(info.param) + "ms"; });

TEST_P(StoreRaceTest, ReadersRacingEvictionAndOverwriteNeverSeeWrongBytes) {
  auto n = node("n1", "6MiB");
  ASSERT_TRUE(n);
  auto store = open(TransportKind::kShm, 60s, std::chrono::milliseconds(GetParam()));
  ASSERT_TRUE(store);
  constexpr std::size_t kSize = kPage + 4096;  // two pages
  const auto& pattern = versioned;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> next_version{1};
  std::atomic<int> puts_failed{0};
  auto writer = [&](const std::string& key) {
    std::vector<std::uint64_t> words(kSize / 8);
    while (!stop) {
      pattern(next_version++, words);
      Slice s{words.data(), kSize};
      Status st = store->put(key, {&s, 1});
      if (!st.is_ok() && st.code() != StatusCode::kNoSpace) ++puts_failed;
    }
  };
  std::vector<std::uint64_t> first(kSize / 8);
  pattern(0, first);
  Slice s0{first.data(), kSize};
  ASSERT_TRUE(store->put("hot", {&s0, 1}).is_ok());

  std::thread w1(writer, "hot"), w2(writer, "filler");
  std::atomic<int> ok{0}, stale{0}, missing{0}, wrong{0};
  std::vector<std::string> errors;
  std::mutex errors_mu;
  auto reader = [&] {
    std::vector<std::uint64_t> got(kSize / 8), want(kSize / 8);
    Slice s{got.data(), kSize};
    for (int i = 0; i < 700; ++i) {
      auto r = store->get("hot", {&s, 1});
      if (r.is_ok()) {
        pattern(got[0], want);
        if (r->size != kSize || std::memcmp(got.data(), want.data(), kSize) != 0) ++wrong;
        ++ok;
      } else if (r.status().code() == StatusCode::kStale) {
        ++stale;  // pages reused under an expired lease: refused, as it must be
      } else if (r.status().code() == StatusCode::kNotFound) {
        ++missing;  // evicted by the filler before this read began
      } else {
        std::lock_guard lock(errors_mu);
        errors.push_back(r.status().to_string());
      }
    }
  };
  std::thread r1(reader), r2(reader), r3(reader);
  r1.join(), r2.join(), r3.join();
  stop = true;
  w1.join(), w2.join();
  EXPECT_EQ(wrong, 0) << "a get returned bytes that no single put wrote";
  EXPECT_TRUE(errors.empty()) << errors.front();
  EXPECT_EQ(puts_failed, 0);
  EXPECT_GT(ok, 100) << "the race did not exercise successful reads";
  std::printf("[ info ] 2100 racing gets: %d whole versions, %d stale, %d not found; %llu puts\n", ok.load(),
              stale.load(), missing.load(), static_cast<unsigned long long>(next_version.load()));
}

// Objects with a 20 ms TTL are written and read back continuously: reads land before,
// during and after expiry. Never wrong bytes, and once it stops every page comes back.
TEST_F(StoreTest, TtlsExpiringUnderReadersNeverGiveWrongBytesAndLeakNothing) {
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  auto store = open();
  ASSERT_TRUE(store);
  constexpr std::size_t kSize = kPage + 4096;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> version{1};
  std::thread writer([&] {
    std::vector<std::uint64_t> words(kSize / 8);
    while (!stop) {
      versioned(version++, words);
      Slice s{words.data(), kSize};
      Status st = store->put(version % 3 == 0 ? "t0" : "t1", {&s, 1}, {.ttl = 20ms});
      EXPECT_TRUE(st.is_ok() || st.code() == StatusCode::kNoSpace) << st.to_string();
      if (version % 16 == 0) std::this_thread::sleep_for(30ms);  // let both expire now and then
    }
  });
  std::atomic<int> ok{0}, gone{0}, wrong{0};
  auto reader = [&](const char* key) {
    std::vector<std::uint64_t> got(kSize / 8), want(kSize / 8);
    Slice s{got.data(), kSize};
    for (int i = 0; i < 500; ++i) {
      auto r = store->get(key, {&s, 1});
      if (r.is_ok()) {
        versioned(got[0], want);
        wrong += std::memcmp(got.data(), want.data(), kSize) != 0;
        ++ok;
      } else {
        auto c = r.status().code();
        EXPECT_TRUE(c == StatusCode::kNotFound || c == StatusCode::kStale) << r.status().to_string();
        ++gone;
      }
    }
  };
  std::thread r1(reader, "t0"), r2(reader, "t1");
  r1.join(), r2.join();
  stop = true;
  writer.join();
  EXPECT_EQ(wrong, 0) << "a get returned bytes no single put wrote";
  EXPECT_GT(ok, 0);
  EXPECT_GT(gone, 0) << "no read met an expired object: the test did not exercise expiry";
  store.reset();  // what the store reserved and no put took goes back with it
  EXPECT_TRUE(eventually([&] { return free_pages("n1") == 8u; })) << "expired objects leaked pages";
}

TEST_F(StoreTest, AClientKilledBetweenBeginPutAndCommitLeaksNoPages) {
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  const char* client = std::getenv("KVSTASH_STORE_CLIENT");
  ASSERT_NE(client, nullptr) << "KVSTASH_STORE_CLIENT must name tests/store_client (meson sets it)";
  auto child = harness::ChildProcess::start(
      {.argv = {client, "begin-put", redis_->url(), "doomed", std::to_string(5 * kPage), "300"}});
  ASSERT_TRUE(child.is_ok()) << child.status().to_string();
  auto line = child->read_line(deadline_after(10s));
  ASSERT_EQ(line.value_or("<none>"), "pending");
  EXPECT_EQ(free_pages("n1"), 3u);
  child->kill();
  EXPECT_TRUE(eventually([&] { return free_pages("n1") == 8u; }))
      << "a dead client's pending put leaked pages";
  auto store = open();
  EXPECT_EQ(store->stat("doomed").status().code(), StatusCode::kNotFound);
}

TEST_F(StoreTest, NodeKilledMidGetFailsWithinTheDeadlineAndItsObjectsVanish) {
  auto n = node("n1", "72MiB");
  ASSERT_TRUE(n);
  auto store = open(TransportKind::kTcp);
  ASSERT_TRUE(store);
  std::vector<std::byte> data(64 * kPage);
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "victim", data).is_ok());

  std::atomic<bool> killed{false};
  std::vector<std::byte> out(data.size());
  std::thread killer([&] {
    std::this_thread::sleep_for(30ms);
    n->kill();
    killed = true;
  });
  int failures = 0;
  for (int i = 0; i < 200 && failures == 0; ++i) {
    Slice s{out.data(), out.size()};
    auto start = Clock::now();
    auto r = store->get("victim", {&s, 1}, {.deadline = deadline_after(3s)});
    EXPECT_LT(Clock::now() - start, 4s) << "a get outlived its deadline";
    if (r.is_ok()) {
      EXPECT_EQ(test::first_mismatch(out.data(), data.data(), data.size()), -1);
    } else {
      ++failures;
      auto c = r.status().code();
      EXPECT_TRUE(c == StatusCode::kUnavailable || c == StatusCode::kTimeout || c == StatusCode::kNotFound)
          << r.status().to_string();
    }
  }
  killer.join();
  EXPECT_TRUE(killed);
  EXPECT_EQ(failures, 1) << "gets kept succeeding after the node was killed";
  // After its heartbeat TTL (1 s) the node's objects are gone from the metadata.
  EXPECT_TRUE(eventually([&] { return store->stat("victim").status().code() == StatusCode::kNotFound; }))
      << "a dead node's object is still listed";
}

TEST_F(StoreTest, NodeKilledMidPutFailsWithinTheDeadlineAndLeaksNothingOnTheSurvivor) {
  auto victim = node("victim", "40MiB");
  auto survivor = node("survivor", "40MiB");
  ASSERT_TRUE(victim && survivor);
  auto store = open(TransportKind::kTcp);
  ASSERT_TRUE(store);
  std::vector<std::byte> data(64 * kPage);  // 64 pages: more than one node holds
  fill(data);
  std::thread killer([&] {
    std::this_thread::sleep_for(30ms);
    victim->kill();
  });
  int failures = 0;
  for (int i = 0; i < 200 && failures == 0; ++i) {
    auto start = Clock::now();
    Status s = put_bytes(*store, i % 2 ? "k1" : "k0", data, {.deadline = deadline_after(3s)});
    EXPECT_LT(Clock::now() - start, 4s) << "a put outlived its deadline";
    if (!s.is_ok()) {
      ++failures;
      auto c = s.code();
      EXPECT_TRUE(c == StatusCode::kUnavailable || c == StatusCode::kTimeout || c == StatusCode::kStale ||
                  c == StatusCode::kNoSpace)
          << s.to_string();
    }
  }
  killer.join();
  EXPECT_EQ(failures, 1) << "puts kept succeeding after a node of theirs was killed";
  // Once the victim is declared dead, every page on the survivor is free again: the failed
  // put's and those of the objects that spanned the victim.
  EXPECT_TRUE(eventually([&] { return free_pages("survivor") == 40u; })) << "pages leaked on the survivor";
}

// Between a node's death and the end of its heartbeat TTL, Redis still places pages on it.
// A put whose writes fail there is placed again on a live node within its deadline, and the
// puts after it take no pages from the dead node. With that avoidance off, the same puts fail
// kUnavailable: the baseline, measured in the same test.
TEST_F(StoreTest, APutOnANodeThatDiedUnnoticedIsPlacedAgainOnALiveOne) {
  auto victim = node("victim", "40MiB", {}, "30s");  // the cell declares it dead only after 30 s
  auto survivor = node("survivor", "24MiB");
  ASSERT_TRUE(victim && survivor);
  auto tcp_store = [&](std::chrono::milliseconds avoid) {
    avoid_unreachable_ = avoid;
    return open(TransportKind::kTcp);
  };
  auto avoiding = tcp_store(5s);
  auto baseline = tcp_store(0ms);
  ASSERT_TRUE(avoiding && baseline);
  std::vector<std::byte> data(3 * kPage);
  fill(data);
  // Both stores have live links to both nodes (an object of 50 pages spans them) before the
  // kill, so the failures come from writes on those links as well as from connecting anew.
  std::vector<std::byte> wide(50 * kPage);
  fill(wide);
  for (Store* s : {avoiding.get(), baseline.get()}) {
    ASSERT_TRUE(put_bytes(*s, "wide", wide).is_ok());
    ASSERT_TRUE(s->remove("wide").is_ok());
  }
  victim->kill();

  auto run = [&](Store& s, char prefix) {
    int failed = 0;
    for (int i = 0; i < 6; ++i) {
      const auto start = Clock::now();
      Status st = put_bytes(s, numbered(prefix, i), data, {.deadline = deadline_after(5s)});
      EXPECT_LT(Clock::now() - start, 6s) << "a put outlived its deadline";
      if (!st.is_ok()) {
        ++failed;
        EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
        continue;
      }
      auto back = get_bytes(s, numbered(prefix, i), data.size());
      EXPECT_TRUE(back.is_ok() && *back == data) << "a placed-again put reads back other bytes";
      auto info = s.stat(numbered(prefix, i));
      EXPECT_TRUE(info.is_ok() && info->nodes == std::vector<std::string>{"survivor"});
    }
    return failed;
  };
  EXPECT_GT(run(*baseline, 'b'), 0) << "the victim, most free, took no put: the test shows nothing";
  EXPECT_EQ(run(*avoiding, 'a'), 0) << "a put failed on the dead node instead of being placed again";
}

// PutOptions::replicas: copies on distinct nodes; the object stays readable when the node of
// one copy dies, and an overwrite with fewer copies leaves none of the older ones behind.
TEST_F(StoreTest, APutWithReplicasSurvivesTheDeathOfACopysNode) {
  auto a = node("a"), b = node("b"), c = node("c");
  ASSERT_TRUE(a && b && c);
  auto s = open();
  ASSERT_TRUE(s);
  std::vector<std::byte> data(3 * kPage);
  fill(data);
  ASSERT_TRUE(put_bytes(*s, "prompt", data, {.replicas = 3}).is_ok());
  std::set<std::string> used;
  for (std::uint32_t i = 0; i < 3; ++i) {
    auto info = s->stat(metadata::copy_key("prompt", i));
    ASSERT_TRUE(info.is_ok()) << "copy " << i << ": " << info.status().to_string();
    for (const auto& n : info->nodes) EXPECT_TRUE(used.insert(n).second) << "two copies share node " << n;
  }
  EXPECT_EQ(used.size(), 3u);

  // The node of the object itself dies: gets read a copy.
  const std::string first = s->stat("prompt").value().nodes.at(0);
  std::unique_ptr<LocalNode>* victim = first == "a" ? &a : first == "b" ? &b : &c;
  (*victim)->kill();
  victim->reset();
  // Once the cell declared the node dead, stat too describes a live copy.
  ASSERT_TRUE(eventually(
      [&] {
        auto info = s->stat("prompt");
        return info.is_ok() && info->nodes.at(0) != first;
      },
      10s))
      << "the cell never noticed the node's death";
  for (int i = 0; i < 5; ++i) {
    auto back = get_bytes(*s, "prompt", data.size());
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(*back, data);
  }
  auto found = s->contains_prefix(std::vector<std::string>{"prompt"});
  EXPECT_TRUE(found.is_ok() && *found == 1u) << "contains_prefix misses an object its copies hold";

  // Two nodes left: three copies no longer fit apart.
  EXPECT_EQ(put_bytes(*s, "wide", data, {.replicas = 3}).code(), StatusCode::kNoSpace);
  // An overwrite with one copy: no get ever returns the older bytes again.
  std::vector<std::byte> newer(2 * kPage);
  fill(newer);
  ASSERT_TRUE(put_bytes(*s, "prompt", newer).is_ok());
  for (std::uint32_t i = 1; i < 3; ++i) {
    EXPECT_EQ(s->stat(metadata::copy_key("prompt", i)).status().code(), StatusCode::kNotFound)
        << "copy " << i;
  }
  for (int i = 0; i < 5; ++i) {
    auto back = get_bytes(*s, "prompt", newer.size());
    ASSERT_TRUE(back.is_ok() && *back == newer) << "a get read an older copy";
  }
  ASSERT_TRUE(s->remove("prompt").is_ok());
  EXPECT_EQ(s->stat("prompt").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(put_bytes(*s, "x", data, {.replicas = 5}).code(), StatusCode::kInvalidArgument);
}

// A get leases the copy with the fewest readers: concurrent readers of a hot object spread
// over its copies' nodes.
// In a full cell each copy of a replicated put must still find a node of its own: a copy
// goes whole onto one node, evicting there, instead of spilling over both nodes (which left
// the next copy no node apart, kNoSpace, however many objects could have been evicted).
TEST_F(StoreTest, APutWithReplicasFindsNodesApartInAFullCell) {
  auto n1 = node("n1", "8MiB"), n2 = node("n2", "8MiB");
  ASSERT_TRUE(n1 && n2);
  put_reservation_ = 0;
  auto store = open();
  ASSERT_TRUE(store);
  std::vector<std::byte> small(kPage), big(3 * kPage);
  fill(small);
  fill(big);
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(put_bytes(*store, numbered('f', i), small).is_ok());
  EXPECT_EQ(free_pages("n1") + free_pages("n2"), 0u) << "the cell is full of evictable objects";
  for (int i = 0; i < 12; ++i) {
    const std::string key = numbered('r', i % 4);
    ASSERT_TRUE(put_bytes(*store, key, big, {.replicas = 2}).is_ok()) << key;
    auto copy = store->stat(metadata::copy_key(key, 1)), self = store->stat(key);
    ASSERT_TRUE(copy.is_ok() && self.is_ok());
    for (const auto& id : copy->nodes) {
      EXPECT_EQ(std::count(self->nodes.begin(), self->nodes.end(), id), 0)
          << key << ": copies share node " << id;
    }
  }
}

TEST_F(StoreTest, GetsOfAReplicatedObjectSpreadOverItsCopies) {
  auto a = node("a"), b = node("b");
  ASSERT_TRUE(a && b);
  auto s = open();
  ASSERT_TRUE(s);
  std::vector<std::byte> data(kPage);
  fill(data);
  ASSERT_TRUE(put_bytes(*s, "hot", data, {.replicas = 2}).is_ok());
  // Read leases held open (as long gets would): the catalog's begin_get, as a store's get.
  metadata::Catalog& cat = cell_->catalog();
  std::map<std::string, int> by_node;
  for (int i = 0; i < 6; ++i) {
    auto lease = cat.begin_get("hot", "reader-" + std::to_string(i), 60s);
    ASSERT_TRUE(lease.is_ok()) << lease.status().to_string();
    ++by_node[lease->placement.nodes.at(0).id];
  }
  EXPECT_EQ(by_node["a"], 3);
  EXPECT_EQ(by_node["b"], 3);
}

// A put over tcp to a stopped node times out while its writes sit in the sockets; the pool is
// exactly full, so another client's put (over shm, which needs nothing from the node) can only
// get the first put's pages. Those pages must not be handed out before the node has confirmed
// that the first put's writes can no longer land (its revoke or its fence), so whatever the
// second put stores reads back exactly, with the checksum off.
TEST_F(StoreTest, ATimedOutTcpPutNeverWritesIntoPagesAnotherPutWasGiven) {
  auto n = node("n1", "12MiB", {}, "30s");  // not declared dead while stopped
  ASSERT_TRUE(n);
  auto late = open(TransportKind::kTcp, /*put_lease=*/1500ms);
  auto other = open(TransportKind::kShm);
  ASSERT_TRUE(late && other);
  std::vector<std::byte> first(12 * kPage), second(12 * kPage);
  fill(first);
  // Both clients are connected before the node stops (a connect would need it).
  ASSERT_TRUE(put_bytes(*late, "warm", first).is_ok());
  ASSERT_TRUE(get_bytes(*other, "warm", first.size()).is_ok());
  ASSERT_TRUE(late->remove("warm").is_ok());
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    fill(second);
    ASSERT_EQ(::kill(n->pid(), SIGSTOP), 0);
    Status s = put_bytes(*late, "first", first, {.deadline = deadline_after(300ms)});
    EXPECT_FALSE(s.is_ok()) << "a put to a stopped node over tcp cannot finish";
    Status taken = put_bytes(*other, "second", second);
    EXPECT_TRUE(taken.is_ok() || taken.code() == StatusCode::kNoSpace) << taken.to_string();
    std::this_thread::sleep_for(200ms);
    ASSERT_EQ(::kill(n->pid(), SIGCONT), 0);
    // Once the node confirmed (or fenced) the timed-out put, its pages come back.
    if (!taken.is_ok()) {
      EXPECT_TRUE(eventually([&] { return put_bytes(*other, "second", second).is_ok(); }, 10s))
          << "the timed-out put's pages never came back";
    }
    std::this_thread::sleep_for(300ms);  // anything still queued at the node has landed by now
    std::vector<std::byte> back(second.size());
    Slice into{back.data(), back.size()};
    auto got = other->get("second", {&into, 1}, {.verify_checksum = false});
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    EXPECT_EQ(test::first_mismatch(back.data(), second.data(), second.size()), -1)
        << "the object holds bytes of a put that timed out";
    ASSERT_TRUE(other->remove("second").is_ok());
  }
}

// A node declared dead that rejoins from the same process (a pause past its heartbeat deadline)
// must not hand out pages that a put of its earlier life may still write. Here the put is still
// running, within its deadline, when the node rejoins and another put is given the same pages:
// its next writes must fail, not land.
TEST_F(StoreTest, ANodeThatRejoinsFencesThePutsOfItsEarlierLife) {
  auto n = node("n1", "8MiB");  // heartbeat ttl 1s
  ASSERT_TRUE(n);
  auto writer = open(TransportKind::kTcp);
  auto other = open(TransportKind::kShm);
  ASSERT_TRUE(writer && other);
  std::vector<std::byte> first(8 * kPage), second(8 * kPage);
  fill(first);
  fill(second);
  ASSERT_TRUE(put_bytes(*other, "warm", second).is_ok());  // connected before the node stops
  ASSERT_TRUE(other->remove("warm").is_ok());
  auto stream = writer->begin_put("first", first.size());
  ASSERT_TRUE(stream.is_ok()) << stream.status().to_string();
  Slice head{first.data(), 4 * kPage}, tail{first.data() + 4 * kPage, 4 * kPage};
  ASSERT_TRUE(stream->append({&head, 1}).is_ok());
  ASSERT_TRUE(stream->wait_written(4 * kPage).is_ok());
  const std::string epoch = cell_->admin().node_status("n1")->epoch;

  ASSERT_EQ(::kill(n->pid(), SIGSTOP), 0);
  std::this_thread::sleep_for(1500ms);                   // past the heartbeat deadline
  ASSERT_TRUE(cell_->node_catalog().reclaim().is_ok());  // what any other node's sweep does: declared dead
  ASSERT_EQ(::kill(n->pid(), SIGCONT), 0);
  ASSERT_TRUE(eventually([&] {
    auto st = cell_->admin().node_status("n1");
    return st.is_ok() && st->epoch != epoch && st->state == "up";
  })) << "the node did not register again";
  // The rejoined node's pool is whole again: the other put gets every page, the first put's too.
  ASSERT_TRUE(eventually([&] { return put_bytes(*other, "second", second).is_ok(); }));

  // The first put's writer still holds its lease; its next writes reach the rejoined node.
  Status more = stream->append({&tail, 1});
  if (more.is_ok()) more = stream->wait_written(first.size());
  EXPECT_FALSE(more.is_ok()) << "a write of the node's earlier life was accepted";
  EXPECT_FALSE(stream->commit().is_ok());

  std::vector<std::byte> back(second.size());
  Slice into{back.data(), back.size()};
  auto got = other->get("second", {&into, 1}, {.verify_checksum = false});
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(test::first_mismatch(back.data(), second.data(), second.size()), -1)
      << "the object holds bytes of a put from the node's earlier life";
}

// Every operation has a deadline, and it holds for each caller even when another one is
// stuck on the same peer: a caller with 100 ms returns in about 100 ms while another one
// waits on a black-holed node (connecting to it), and while Redis is black-holed too.
TEST_F(StoreTest, ACallerWithAShortDeadlineIsNotHeldBehindAnotherOnABlackHoledPeer) {
  auto n = node("n1", "8MiB", {}, "30s");
  ASSERT_TRUE(n);
  std::vector<std::byte> data(kPage);
  fill(data);
  {
    auto writer = open(TransportKind::kTcp);
    ASSERT_TRUE(writer && put_bytes(*writer, "k", data).is_ok());
  }
  auto store = open(TransportKind::kTcp);  // not connected to the node yet
  ASSERT_TRUE(store);
  ASSERT_TRUE(store->stat("k").is_ok());  // its Redis connection is up
  ASSERT_EQ(::kill(n->pid(), SIGSTOP), 0);
  std::vector<std::byte> a(kPage), b(kPage);
  auto slow = std::async(std::launch::async, [&] {
    Slice s{a.data(), a.size()};
    return store->get("k", {&s, 1}, {.deadline = deadline_after(5s)}).status();
  });
  std::this_thread::sleep_for(200ms);  // the slow caller is connecting to the stopped node
  Slice s{b.data(), b.size()};
  auto start = Clock::now();
  Status quick = store->get("k", {&s, 1}, {.deadline = deadline_after(100ms)}).status();
  auto took = Clock::now() - start;
  EXPECT_EQ(quick.code(), StatusCode::kTimeout) << quick.to_string();
  EXPECT_LT(took, 600ms) << "a 100 ms get waited for another caller's connect";

  // Redis black-holed as well: the metadata call is bounded by what is left of the deadline.
  ASSERT_EQ(::kill(redis_->pid(), SIGSTOP), 0);
  start = Clock::now();
  Status meta = store->stat("k", deadline_after(100ms)).status();
  took = Clock::now() - start;
  ASSERT_EQ(::kill(redis_->pid(), SIGCONT), 0);
  EXPECT_FALSE(meta.is_ok());
  EXPECT_LT(took, 600ms) << "a 100 ms stat waited on Redis past its deadline: " << meta.to_string();

  ASSERT_EQ(::kill(n->pid(), SIGCONT), 0);
  (void)slow.get();  // it ends by its own deadline, whichever way
}

TEST_F(StoreTest, StopSignalsDrainTheNodeAndItsObjectsLeaveAtOnce) {
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  auto store = open();
  std::vector<std::byte> data(kPage);
  ASSERT_TRUE(put_bytes(*store, "k", data).is_ok());
  EXPECT_EQ(n->terminate(deadline_after(10s)).value_or(-1), 0);
  EXPECT_EQ(store->stat("k").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(cell_->admin().node_status("n1")->state, "gone");
  EXPECT_EQ(put_bytes(*store, "k2", data).code(), StatusCode::kNoSpace) << "no node is left";

  // There is no reload: a hang-up drains too, rather than killing the node undrained.
  auto m = node("n2", "8MiB");
  ASSERT_TRUE(m);
  ASSERT_TRUE(put_bytes(*store, "k3", data).is_ok());
  ::kill(m->pid(), SIGHUP);
  EXPECT_TRUE(eventually([&] { return store->stat("k3").status().code() == StatusCode::kNotFound; }, 3s))
      << "SIGHUP did not drain the node";
  EXPECT_TRUE(eventually([&] { return cell_->admin().node_status("n2")->state == "gone"; }, 3s));
}

TEST_F(StoreTest, RedisRestartEmptyNodesRejoinAndClientsCarryOn) {
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  auto store = open();
  std::vector<std::byte> data(kPage);
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "before", data).is_ok());
  ASSERT_TRUE(redis_->restart().is_ok());  // no persistence: the metadata is gone
  // The node finds its heartbeat refused and registers again; the client reconnects.
  Status last;
  EXPECT_TRUE(eventually([&] { return (last = put_bytes(*store, "after", data)).is_ok(); }, 10s))
      << last.to_string();
  auto back = get_bytes(*store, "after", data.size());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(test::first_mismatch(back->data(), data.data(), data.size()), -1);
  EXPECT_EQ(store->stat("before").status().code(), StatusCode::kNotFound);
}

TEST_F(StoreTest, RedisRestartWithPersistenceKeepsTheObjects) {
  start_redis({.persistence = true});
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  auto store = open();
  std::vector<std::byte> data(3 * kPage + 5);
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "kept", data).is_ok());
  ASSERT_TRUE(redis_->restart().is_ok());
  Result<std::vector<std::byte>> back = Status::internal("unset");
  EXPECT_TRUE(eventually([&] { return (back = get_bytes(*store, "kept", data.size())).is_ok(); }, 10s))
      << back.status().to_string();
  if (back.is_ok()) {
    EXPECT_EQ(test::first_mismatch(back->data(), data.data(), data.size()), -1);
  }
}

TEST_F(StoreTest, CorruptRecordsAndChecksumMismatchesAreErrorsNotBytes) {
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  auto store = open();
  std::vector<std::byte> data(kPage);
  fill(data);
  ASSERT_TRUE(put_bytes(*store, "k", data).is_ok());
  const std::string obj = cell_->prefix() + ":obj:k";
  ASSERT_TRUE(cell_->redis().command({"HSET", obj, "checksum", "0123456789abcdef/4194304"}).is_ok());
  EXPECT_EQ(get_bytes(*store, "k", data.size()).status().code(), StatusCode::kCorrupt);
  ASSERT_TRUE(cell_->redis().command({"HSET", obj, "extents", "n1,0,1;garbage"}).is_ok());
  EXPECT_EQ(get_bytes(*store, "k", data.size()).status().code(), StatusCode::kCorrupt);
  ASSERT_TRUE(cell_->redis().command({"SET", cell_->prefix() + ":obj:foreign", "x"}).is_ok());
  EXPECT_EQ(get_bytes(*store, "foreign", 10).status().code(), StatusCode::kCorrupt);
}

TEST_F(StoreTest, BadInputGetsClearErrors) {
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n);
  auto store = open();
  std::vector<std::byte> data(2 * kPage);
  ASSERT_TRUE(put_bytes(*store, "k", data).is_ok());
  EXPECT_EQ(get_bytes(*store, "k", data.size() - 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(put_bytes(*store, "", data).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(put_bytes(*store, std::string(2000, 'k'), data).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(put_bytes(*store, "k", data, {.object_layout = std::string(70000, 'x')}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(get_bytes(*store, "absent", 10).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Store::open({.redis_url = "redis://127.0.0.1:1/0", .redis_timeout = 300ms}).status().code(),
            StatusCode::kUnavailable);
  EXPECT_EQ(Store::open({.redis_url = "http://nope"}).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(StoreTest, AsyncFormsRunConcurrently) {
  auto n = node("n1", "16MiB");
  ASSERT_TRUE(n);
  auto store = open();
  std::vector<std::vector<std::byte>> data(6, std::vector<std::byte>(kPage + 17));
  std::vector<std::future<Status>> puts;
  for (std::size_t i = 0; i < data.size(); ++i) {
    fill(data[i]);
    puts.push_back(store->put_async(numbered('a', i), {{data[i].data(), data[i].size()}}));
  }
  for (auto& f : puts) EXPECT_TRUE(f.get().is_ok());
  std::vector<std::vector<std::byte>> out(6, std::vector<std::byte>(kPage + 17));
  std::vector<std::future<Result<ObjectInfo>>> gets;
  for (std::size_t i = 0; i < out.size(); ++i) {
    gets.push_back(store->get_async(numbered('a', i), {{out[i].data(), out[i].size()}}));
  }
  for (std::size_t i = 0; i < gets.size(); ++i) {
    auto r = gets[i].get();
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(test::first_mismatch(out[i].data(), data[i].data(), data[i].size()), -1);
  }
  EXPECT_EQ(store->contains_prefix_async({"a0", "a1", "zz"}).get().value(), 2u);
  EXPECT_TRUE(store->touch_async("a0", 10s).get().is_ok());
  EXPECT_TRUE(store->remove_async("a0").get().is_ok());
  EXPECT_EQ(store->remove_async("a0").get().code(), StatusCode::kNotFound);
}

TEST_F(StoreTest, ContainsEachSaysOfEveryKeyWhetherItIsStored) {
  auto n = node("n1", "16MiB");
  ASSERT_TRUE(n);
  auto store = open();
  std::vector<std::byte> data(kPage);
  fill(data);
  for (const char* k : {"c0", "c2", "c3"}) ASSERT_TRUE(put_bytes(*store, k, data).is_ok());
  const std::vector<std::string> keys{"c0", "c1", "c2", "c3", "c4"};
  EXPECT_EQ(store->contains_prefix(keys).value(), 1u) << "a prefix count stops at the first gap";
  EXPECT_EQ(store->contains_each(keys).value(), (std::vector<bool>{true, false, true, true, false}))
      << "past a gap, each key is still answered";
  ASSERT_TRUE(store->remove("c2").is_ok());
  EXPECT_EQ(store->contains_each(keys).value(), (std::vector<bool>{true, false, false, true, false}));
  EXPECT_TRUE(store->contains_each(std::vector<std::string>{}).value().empty());
  EXPECT_EQ(store->contains_each(std::vector<std::string>{""}).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(StoreTest, RedisOverAUnixSocket) {
  const std::string sock = "/tmp/kvstash-store-test-" + std::to_string(getpid()) + ".sock";
  start_redis({.extra_args = {"--unixsocket", sock, "--unixsocketperm", "700"}});
  const std::string url = "unix://" + sock + "?db=0";
  auto n = LocalNode::start({.redis_url = url,
                             .capacity = "4MiB",
                             .page_size = "1MiB",
                             .node_id = "u1",
                             .extra_args = {"--huge-pages", "off"}});
  ASSERT_TRUE(n.is_ok()) << n.status().to_string();
  auto store = Store::open({.redis_url = url});
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  std::vector<std::byte> data(kPage + 3);
  fill(data);
  ASSERT_TRUE(put_bytes(**store, "k", data).is_ok());
  auto back = get_bytes(**store, "k", data.size());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(test::first_mismatch(back->data(), data.data(), data.size()), -1);
  (*n)->stop();
  redis_->stop();
  ::unlink(sock.c_str());  // a killed redis-server leaves its socket behind
}

class StoreAuthTest : public StoreTest {
 protected:
  void SetUp() override { start_redis({.password = "s3cret"}); }
};

TEST_F(StoreAuthTest, WrongPasswordAndUsersWithoutRightsArePermissionDenied) {
  auto n = node("n1", "8MiB");
  ASSERT_TRUE(n) << "kvstashd must authenticate with the password";
  StoreOptions o;
  o.redis_url = redis_->url();
  o.redis_password = "wrong";
  EXPECT_EQ(Store::open(o).status().code(), StatusCode::kPermissionDenied);
  // An ACL user that may only touch other keys.
  ASSERT_TRUE(
      cell_->redis().command({"ACL", "SETUSER", "outsider", "on", ">pw", "~other:*", "+@all"}).is_ok());
  ASSERT_TRUE(cell_->redis().command({"ACL", "SETUSER", "kvs", "on", ">pw", "~kvs:*", "+@all"}).is_ok());
  o.redis_url = "redis://outsider:pw@127.0.0.1:" + std::to_string(redis_->port()) + "/0";
  o.redis_password.clear();
  EXPECT_EQ(Store::open(o).status().code(), StatusCode::kPermissionDenied);
  o.redis_url = "redis://kvs:pw@127.0.0.1:" + std::to_string(redis_->port()) + "/0";
  auto store = Store::open(o);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  std::vector<std::byte> data(kPage);
  fill(data);
  ASSERT_TRUE(put_bytes(**store, "k", data).is_ok());
  EXPECT_TRUE(get_bytes(**store, "k", data.size()).is_ok());
}

}  // namespace
}  // namespace kvstash

// The verbs transport's wire formats: address, connection hello, remote key, lease messages
// and their framing, port matching. Pure logic (and a socket pair): runs on every machine.
#include "transport/verbs/verbs_wire.h"
#include "transport/verbs/verbs_device.h"
#include "transport/verbs/verbs_internal.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <thread>

namespace kvstash::transport::verbs {
namespace {

ibv_gid gid_of(const char* ip6) {
  ibv_gid g{};
  inet_pton(AF_INET6, ip6, g.raw);
  return g;
}

PortAddress roce(const char* ip6, std::uint64_t guid = 0x1122) {
  return {"rxe0", guid, 1, true, gid_of(ip6), 0, IBV_MTU_1024};
}

PortAddress ib(const char* ip6, std::uint16_t lid) {
  return {"mlx5_0", 0x33, 1, false, gid_of(ip6), lid, IBV_MTU_4096};
}

TEST(VerbsWire, AddressesRoundTripAndMalformedOnesAreRefused) {
  Address a{"192.168.77.1:7471", {roce("::ffff:192.168.77.1"), ib("fe80::1", 7)}};
  std::string bytes = encode_address(a);
  auto back = decode_address(bytes);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->control, a.control);
  ASSERT_EQ(back->ports.size(), 2u);
  EXPECT_EQ(back->ports[0], a.ports[0]);
  EXPECT_EQ(back->ports[1], a.ports[1]);

  for (std::size_t cut = 0; cut < bytes.size(); ++cut) {
    EXPECT_EQ(decode_address(bytes.substr(0, cut)).status().code(), StatusCode::kInvalidArgument) << cut;
  }
  EXPECT_EQ(decode_address(bytes + "x").status().code(), StatusCode::kInvalidArgument);
  std::string other_version = bytes;
  other_version[4] = 9;
  auto v = decode_address(other_version);
  EXPECT_EQ(v.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("version 9"), std::string::npos) << v.status().message();
  std::string bad_mtu = encode_address({"h:1", {{"d", 1, 1, true, {}, 0, static_cast<ibv_mtu>(9)}}});
  EXPECT_EQ(decode_address(bad_mtu).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_address(encode_address({"h:1", {}})).status().code(), StatusCode::kInvalidArgument)
      << "an address without ports is useless";
  EXPECT_EQ(decode_address(encode_address({"", {roce("::ffff:1.2.3.4")}})).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(VerbsWire, HellosRoundTripAndCarryOnlyValidQueuePairs) {
  Hello h;
  h.node_guid = 0xabcdef;
  h.peer_guid = 0x123456;
  h.qp = {0x123456, 0xfedcba, gid_of("::ffff:192.168.77.1"), 0, IBV_MTU_1024};
  h.max_rd_atomic = 16;
  h.nonce[0] = 7;
  h.nonce[15] = 9;
  h.token_required = true;
  h.mac[31] = 0x5a;
  auto back = decode_hello(encode_hello(h));
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->node_guid, h.node_guid);
  EXPECT_EQ(back->peer_guid, h.peer_guid);
  EXPECT_EQ(back->qp.qpn, h.qp.qpn);
  EXPECT_EQ(back->qp.psn, h.qp.psn);
  EXPECT_EQ(std::memcmp(back->qp.gid.raw, h.qp.gid.raw, 16), 0);
  EXPECT_EQ(back->qp.mtu, IBV_MTU_1024);
  EXPECT_EQ(back->max_rd_atomic, 16);
  EXPECT_EQ(back->nonce, h.nonce);
  EXPECT_TRUE(back->token_required);
  EXPECT_EQ(back->mac, h.mac);

  auto refused = [&](auto mutate) {
    Hello x = h;
    mutate(x);
    return decode_hello(encode_hello(x)).status().code() == StatusCode::kInvalidArgument;
  };
  EXPECT_TRUE(refused([](Hello& x) { x.qp.qpn = 1; })) << "QP 0 and 1 are special, never a peer";
  EXPECT_TRUE(refused([](Hello& x) { x.qp.qpn = 0x1000000; })) << "QPNs are 24-bit";
  EXPECT_TRUE(refused([](Hello& x) { x.qp.psn = 0x1000000; })) << "PSNs are 24-bit";
  EXPECT_TRUE(refused([](Hello& x) { x.max_rd_atomic = 0; }));
  EXPECT_TRUE(refused([](Hello& x) { x.qp.mtu = static_cast<ibv_mtu>(0); }));
  EXPECT_EQ(decode_hello(encode_address({"h:1", {roce("::ffff:1.2.3.4")}})).status().code(),
            StatusCode::kInvalidArgument)
      << "another message's magic";
}

// The target's challenge carries its device, its nonce and whether it requires the token:
// no queue pair and no mac (it proves nothing before the client proved the token).
TEST(VerbsWire, ChallengesRoundTripAndAreNotHellos) {
  Challenge c;
  c.node_guid = 0xabcdef;
  c.nonce[3] = 0x42;
  c.token_required = true;
  auto back = decode_challenge(encode_challenge(c));
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->node_guid, c.node_guid);
  EXPECT_EQ(back->nonce, c.nonce);
  EXPECT_TRUE(back->token_required);
  EXPECT_EQ(decode_hello(encode_challenge(c)).status().code(), StatusCode::kInvalidArgument);
  Hello h;
  h.qp = {2, 1, {}, 0, IBV_MTU_1024};
  EXPECT_EQ(decode_challenge(encode_hello(h)).status().code(), StatusCode::kInvalidArgument)
      << "a hello where the challenge belongs: a target of the older handshake, which proves first";
  std::string bytes = encode_challenge(c);
  EXPECT_FALSE(decode_challenge(bytes.substr(0, bytes.size() - 1)).is_ok());
  EXPECT_FALSE(decode_challenge(bytes + "x").is_ok());
  bytes.back() = 2;
  EXPECT_FALSE(decode_challenge(bytes).is_ok()) << "the token flag is 0 or 1";
}

TEST(VerbsWire, KeysRoundTripAndMalformedOnesAreRefused) {
  std::vector<KeyPart> parts{{0x1122, 0xdeadbeef, false}, {0x3344, 7, true}};
  std::string bytes = encode_key(parts);
  auto back = decode_key(bytes);
  ASSERT_TRUE(back.is_ok());
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ((*back)[0].node_guid, 0x1122u);
  EXPECT_EQ((*back)[0].rkey, 0xdeadbeefu);
  EXPECT_FALSE((*back)[0].leases_only);
  EXPECT_EQ((*back)[1].rkey, 7u);
  EXPECT_TRUE((*back)[1].leases_only);
  EXPECT_EQ(decode_key(bytes.substr(0, bytes.size() - 1)).status().code(), StatusCode::kInvalidArgument);
  std::string bad_flags = bytes;
  bad_flags.back() = 2;
  EXPECT_EQ(decode_key(bad_flags).status().code(), StatusCode::kInvalidArgument) << "unknown flag bits";
  EXPECT_EQ(decode_key(encode_key({})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_key("").status().code(), StatusCode::kInvalidArgument);
}

TEST(VerbsWire, LeaseMessagesRoundTripAndMalformedOnesAreRefused) {
  LeaseRequest q{.id = 42,
                 .region_rkey = 0xabcd,
                 .write = true,
                 .ttl_ms = 1500,
                 .fence = 1'790'000'000'123,
                 .ranges = {{0x1000, 4096}, {0x8000, 1u << 20}}};
  auto msg = decode_lease_message(encode_lease_request(q));
  ASSERT_TRUE(msg.is_ok()) << msg.status().to_string();
  const auto* back = std::get_if<LeaseRequest>(&*msg);
  ASSERT_NE(back, nullptr);
  EXPECT_EQ(back->id, 42u);
  EXPECT_EQ(back->region_rkey, 0xabcdu);
  EXPECT_TRUE(back->write);
  EXPECT_EQ(back->ttl_ms, 1500u);
  EXPECT_EQ(back->fence, 1'790'000'000'123u);
  ASSERT_EQ(back->ranges.size(), 2u);
  EXPECT_EQ(back->ranges[1].addr, 0x8000u);
  EXPECT_EQ(back->ranges[1].length, 1u << 20);

  auto rel = decode_lease_message(encode_lease_release({7}));
  ASSERT_TRUE(rel.is_ok());
  ASSERT_NE(std::get_if<LeaseRelease>(&*rel), nullptr);
  EXPECT_EQ(std::get<LeaseRelease>(*rel).id, 7u);

  // A revoke names the id and its tag; its answer names the id.
  auto rev = decode_lease_message(encode_lease_revoke({.id = 9, .fence = 77}));
  ASSERT_TRUE(rev.is_ok()) << rev.status().to_string();
  ASSERT_NE(std::get_if<LeaseRevoke>(&*rev), nullptr);
  EXPECT_EQ(std::get<LeaseRevoke>(*rev).id, 9u);
  EXPECT_EQ(std::get<LeaseRevoke>(*rev).fence, 77u);
  EXPECT_EQ(decode_lease_message(encode_lease_revoke({.id = 0, .fence = 1})).status().code(),
            StatusCode::kInvalidArgument)
      << "lease id 0 is no lease";
  const std::string revoke_bytes = encode_lease_revoke({.id = 9, .fence = 77});
  for (std::size_t cut = 0; cut < revoke_bytes.size(); ++cut) {
    EXPECT_EQ(decode_lease_message(revoke_bytes.substr(0, cut)).status().code(),
              StatusCode::kInvalidArgument);
  }
  auto ack = decode_lease_revoked(encode_lease_revoked({9}));
  ASSERT_TRUE(ack.is_ok()) << ack.status().to_string();
  EXPECT_EQ(ack->id, 9u);
  EXPECT_EQ(decode_lease_revoked(encode_lease_revoked({9}) + "x").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_lease_revoked(encode_lease_release({9})).status().code(), StatusCode::kInvalidArgument)
      << "a release is not a revoke's answer";
  EXPECT_EQ(decode_lease_reply(encode_lease_revoked({9})).status().code(), StatusCode::kInvalidArgument)
      << "a revoke's answer is not a lease reply";

  // What a target must refuse: no id, no ranges, an empty or wrapping range, no time, too many
  // ranges, trailing bytes, truncation.
  auto refused = [](LeaseRequest r) { return decode_lease_message(encode_lease_request(r)).status().code(); };
  LeaseRequest anonymous = q;
  anonymous.id = 0;
  EXPECT_EQ(refused(anonymous), StatusCode::kInvalidArgument);
  LeaseRequest none = q;
  none.ranges.clear();
  EXPECT_EQ(refused(none), StatusCode::kInvalidArgument);
  LeaseRequest empty = q;
  empty.ranges[0].length = 0;
  EXPECT_EQ(refused(empty), StatusCode::kInvalidArgument);
  LeaseRequest wrapping = q;
  wrapping.ranges[0] = {~0ull - 10, 100};
  EXPECT_EQ(refused(wrapping), StatusCode::kInvalidArgument);
  LeaseRequest timeless = q;
  timeless.ttl_ms = 0;
  EXPECT_EQ(refused(timeless), StatusCode::kInvalidArgument);
  LeaseRequest many = q;
  many.ranges.assign(kMaxLeaseRanges + 1, {0x1000, 1});
  EXPECT_EQ(refused(many), StatusCode::kInvalidArgument);
  const std::string bytes = encode_lease_request(q);
  EXPECT_EQ(decode_lease_message(bytes + "x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_lease_message(bytes.substr(0, bytes.size() - 3)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_lease_message(encode_key({})).status().code(), StatusCode::kInvalidArgument)
      << "another magic";

  // Replies: keys, or a refusal with its code and reason (never both).
  LeaseReply ok{.id = 42, .status = {}, .rkeys = {1, 2}};
  auto got = decode_lease_reply(encode_lease_reply(ok));
  ASSERT_TRUE(got.is_ok());
  EXPECT_EQ(got->id, 42u);
  EXPECT_TRUE(got->status.is_ok());
  EXPECT_EQ(got->rkeys, (std::vector<std::uint32_t>{1, 2}));
  LeaseReply no{.id = 43, .status = Status::no_space("out of windows"), .rkeys = {}};
  got = decode_lease_reply(encode_lease_reply(no));
  ASSERT_TRUE(got.is_ok());
  EXPECT_EQ(got->status.code(), StatusCode::kNoSpace);
  EXPECT_EQ(got->status.message(), "out of windows");
  LeaseReply both{.id = 44, .status = Status::no_space("x"), .rkeys = {1}};
  EXPECT_EQ(decode_lease_reply(encode_lease_reply(both)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_lease_reply(encode_lease_request(q)).status().code(), StatusCode::kInvalidArgument)
      << "a request is not a reply";
}

// A lease of kMaxLeaseRanges ranges, and the longest answer, fit one lease frame; a hello
// frame stays small. (Before kMaxLeaseFrame the setup frame was 4,096 bytes: 254 ranges.)
TEST(VerbsWire, TheLargestLeaseMessagesFitALeaseFrame) {
  LeaseRequest q{.id = ~0ull, .region_rkey = ~0u, .write = true, .ttl_ms = ~0u, .fence = ~0ull, .ranges = {}};
  for (std::size_t i = 0; i < kMaxLeaseRanges; ++i) q.ranges.push_back({(i + 1) << 20, 4096});
  const std::string request = encode_lease_request(q);
  EXPECT_LE(request.size(), kMaxLeaseFrame);
  EXPECT_GT(request.size(), 4096u) << "the size that used to drop the connection";
  auto back = decode_lease_message(request);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(std::get<LeaseRequest>(*back).ranges.size(), kMaxLeaseRanges);
  LeaseReply keys{.id = 1, .status = {}, .rkeys = std::vector<std::uint32_t>(kMaxLeaseRanges, ~0u)};
  EXPECT_LE(encode_lease_reply(keys).size(), kMaxLeaseFrame);
  LeaseReply refusal{.id = 1, .status = Status::no_space(std::string(5000, 'x')), .rkeys = {}};
  EXPECT_LE(encode_lease_reply(refusal).size(), kMaxLeaseFrame);
  Hello h;
  h.qp.qpn = 0xffffff;
  EXPECT_LE(encode_hello(h).size(), kMaxSetupFrame);
}

// The frames themselves, through a socket pair: a 1,024-range request crosses whole where a
// lease frame is expected, and is refused (kInvalidArgument, not a hang) where only a hello may
// come.
TEST(VerbsWire, SetupFramesCarryTheLargestLeaseAndRefuseOversizeOnes) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  LeaseRequest q{.id = 5, .region_rkey = 1, .write = false, .ttl_ms = 1000, .fence = 3, .ranges = {}};
  for (std::size_t i = 0; i < kMaxLeaseRanges; ++i) q.ranges.push_back({(i + 1) << 16, 512});
  const std::string request = encode_lease_request(q);
  const auto deadline = deadline_after(std::chrono::seconds(5));
  std::thread writer([&] { EXPECT_TRUE(write_frame(a.get(), request, deadline).is_ok()); });
  auto got = read_frame(b.get(), kMaxLeaseFrame, deadline);
  writer.join();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(*got, request);

  ASSERT_TRUE(write_frame(a.get(), "hi", deadline).is_ok());
  got = read_frame(b.get(), kMaxSetupFrame, deadline);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(*got, "hi");
  std::thread again([&] { (void)write_frame(a.get(), request, deadline); });
  got = read_frame(b.get(), kMaxSetupFrame, deadline);
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument) << got.status().to_string();
  b = UniqueFd();  // unblocks the writer
  again.join();
}

TEST(VerbsLeases, RevokedIdsAreForgottenOnceFencedAndBoundedInNumber) {
  RevokedLeases r;
  r.add(1, 0);
  r.add(2, 100);
  r.add(3, 200);
  r.add(2, 100);  // twice: once
  EXPECT_EQ(r.size(), 3u);
  r.fence(150);
  EXPECT_TRUE(r.contains(1)) << "an untagged lease is never fenced";
  EXPECT_FALSE(r.contains(2)) << "the fence refuses its tag from now on";
  EXPECT_TRUE(r.contains(3));
  for (std::uint64_t id = 10; id < 10 + RevokedLeases::kMaxRevokedLeases; ++id) r.add(id, 0);
  EXPECT_EQ(r.size(), RevokedLeases::kMaxRevokedLeases);
  EXPECT_FALSE(r.contains(1)) << "the oldest go first";
  EXPECT_FALSE(r.contains(3));
  EXPECT_TRUE(r.contains(10 + RevokedLeases::kMaxRevokedLeases - 1));
}

TEST(VerbsWire, PortsMatchByLinkLayerFamilyAndSubnet) {
  std::vector<PortAddress> v4{roce("::ffff:10.0.0.1")}, v6{roce("fd00::1")};
  std::vector<PortAddress> ib_a{ib("fe80::1", 1)}, ib_b{ib("fe80::2", 2)}, ib_other{ib("fe81::2", 3)};
  EXPECT_EQ(match_ports(v4, v4), std::make_optional(std::make_pair<std::size_t, std::size_t>(0, 0)));
  EXPECT_FALSE(match_ports(v4, v6)) << "IPv4-mapped RoCE GIDs cannot reach IPv6 ones";
  EXPECT_FALSE(match_ports(v4, ib_a)) << "RoCE cannot reach InfiniBand";
  EXPECT_TRUE(match_ports(ib_a, ib_b)) << "same subnet prefix";
  EXPECT_FALSE(match_ports(ib_a, ib_other)) << "another subnet";
  std::vector<PortAddress> both{ib("fe80::9", 9), roce("::ffff:10.0.0.9")};
  auto m = match_ports(both, v4);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->first, 1u);
  EXPECT_EQ(m->second, 0u);
}

TEST(VerbsWire, RailsPairDevicesByIndexAndFallBackToAnyReachablePort) {
  using Pairs = std::vector<std::pair<std::size_t, std::size_t>>;
  std::vector<PortAddress> two{roce("::ffff:10.0.0.1"), roce("::ffff:10.0.1.1")};
  std::vector<PortAddress> peer_two{roce("::ffff:10.0.0.2"), roce("::ffff:10.0.1.2")};
  EXPECT_EQ(pair_rails(two, peer_two), (Pairs{{0, 0}, {1, 1}})) << "rail i to rail i";
  std::vector<PortAddress> peer_one{roce("::ffff:10.0.0.2")};
  EXPECT_EQ(pair_rails(two, peer_one), (Pairs{{0, 0}, {1, 0}})) << "both lanes to the peer's only port";
  std::vector<PortAddress> four{roce("::ffff:10.0.0.1"), roce("::ffff:10.0.1.1"), roce("::ffff:10.0.2.1"),
                                roce("::ffff:10.0.3.1")};
  EXPECT_EQ(pair_rails(four, peer_two), (Pairs{{0, 0}, {1, 1}, {2, 0}, {3, 1}})) << "modulo the peer's count";
  // Our InfiniBand port reaches nothing of a RoCE-only peer: left out; the RoCE one goes to
  // the first port it can reach, not its (unreachable) rail.
  std::vector<PortAddress> mixed{ib("fe80::9", 9), roce("::ffff:10.0.0.9")};
  std::vector<PortAddress> peer_mixed{roce("::ffff:10.0.0.2"), ib("fe81::2", 2)};
  EXPECT_EQ(pair_rails(mixed, peer_mixed), (Pairs{{1, 0}}));
  EXPECT_TRUE(pair_rails(two, {}).empty());
}

TEST(VerbsDevices, AllDevicesByDefaultElseTheNumaLocalOnesFirstInListOrder) {
  std::vector<Device> devs(4);
  const int nodes[] = {0, 1, 1, 0};
  for (std::size_t i = 0; i < devs.size(); ++i) devs[i].numa_node = nodes[i];
  using Idx = std::vector<std::size_t>;
  EXPECT_EQ(choose_devices(devs, 1, 0), (Idx{0, 1, 2, 3})) << "no limit: every device, rail order";
  EXPECT_EQ(choose_devices(devs, 1, 2), (Idx{1, 2})) << "the two on node 1";
  EXPECT_EQ(choose_devices(devs, 1, 3), (Idx{0, 1, 2})) << "node 1's, then the first other";
  EXPECT_EQ(choose_devices(devs, -1, 2), (Idx{0, 1})) << "unknown node: the first ones";
  EXPECT_EQ(choose_devices(devs, 0, 9), (Idx{0, 1, 2, 3}));
  EXPECT_TRUE(choose_devices({}, 0, 2).empty());
}

TEST(VerbsDevices, MemoryThatPrefersDevicesGoesThroughTheirLanesElseAnyLane) {
  const std::vector<std::size_t> four{0, 1, 2, 3};  // lane i on device i
  for (std::uint32_t lane = 0; lane < 8; ++lane) {
    EXPECT_EQ(pick_lane(four, 0, lane), lane % 4) << "host memory: the engine's lane";
    EXPECT_EQ(pick_lane(four, 0b0100, lane), 2u) << "GPU memory with one nearest NIC: its lane only";
  }
  // Two nearest NICs (devices 1 and 3) take the engine's lanes in turn.
  EXPECT_EQ(pick_lane(four, 0b1010, 0), 1u);
  EXPECT_EQ(pick_lane(four, 0b1010, 1), 3u);
  EXPECT_EQ(pick_lane(four, 0b1010, 2), 1u);
  EXPECT_EQ(pick_lane(four, 0b1010, 3), 3u);
  // Two GPUs of one process, each with its own NIC, over the same connection.
  EXPECT_EQ(pick_lane(four, 0b0001, 5), 0u);
  EXPECT_EQ(pick_lane(four, 0b1000, 5), 3u);
  // The lanes run on devices 0 and 2 (device 1's lane did not come up): memory that prefers
  // device 1 goes over every lane rather than nowhere; device 2's maps to lane 1.
  const std::vector<std::size_t> two{0, 2};
  EXPECT_EQ(pick_lane(two, 0b0010, 0), 0u);
  EXPECT_EQ(pick_lane(two, 0b0010, 1), 1u);
  EXPECT_EQ(pick_lane(two, 0b0100, 0), 1u);
  EXPECT_EQ(pick_lane(two, 0b0100, 7), 1u);
  // A device index past the mask's 64 bits is never preferred.
  const std::vector<std::size_t> wide{63, 64};
  EXPECT_EQ(pick_lane(wide, ~std::uint64_t{0}, 1), 0u);
}

}  // namespace
}  // namespace kvstash::transport::verbs

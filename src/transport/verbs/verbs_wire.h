// What the verbs transport tells peers, byte for byte: its address (the control listener
// that sets up queue pairs, and the RDMA ports it serves), the connection hello (one queue
// pair's QPN, PSN, GID or LID and MTU), and the packed remote key (an rkey per device).
// Every decoder validates everything and answers kInvalidArgument, never trusting a length.
//
// Thread safety: pure functions.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "common/handshake.h"
#include "kvstash/grant.h"
#include "kvstash/status.h"
#include "transport/verbs/verbs_qp.h"

namespace kvstash::transport::verbs {

// Bumped on any change of the formats below; peers of another version are refused.
inline constexpr std::uint8_t kWireVersion = 3;

// One RDMA port a transport serves.
struct PortAddress {
  std::string device;  // "mlx5_0": for logs
  std::uint64_t node_guid = 0;
  std::uint8_t port = 1;
  bool ethernet = true;  // RoCE; otherwise InfiniBand
  ibv_gid gid{};         // what peers send to
  std::uint16_t lid = 0;
  ibv_mtu mtu = IBV_MTU_1024;
  bool operator==(const PortAddress& o) const;
};

struct Address {
  std::string control;  // "host:port" of the queue-pair listener
  std::vector<PortAddress> ports;
};

std::string encode_address(const Address& a);
Result<Address> decode_address(std::string_view bytes);

// The setup handshake, in this order:
//   client -> target  Hello      its device, queue pair and nonce; mac empty
//   target -> client  Challenge  the target's device and nonce, whether it requires the token
//   client -> target  the client's mac (32 bytes) over both nonces
//   target -> client  Hello      only once the client proved the token: the target's queue
//                                pair, created and brought up just now, and its own mac
// The target spends no queue pair or memory on a peer that has not proven the token, and
// proves the token only to one that has: a target that proved first would hand anyone an
// HMAC over a nonce of their choosing to attack offline.
struct Hello {
  std::uint64_t node_guid = 0;  // the sender's device
  std::uint64_t peer_guid = 0;  // the client's: which of the target's devices it connects to
  QpEndpoint qp;
  std::uint8_t max_rd_atomic = 1;  // READs this side accepts in flight
  handshake::Nonce nonce{};
  bool token_required = false;
  handshake::Mac mac{};
};

std::string encode_hello(const Hello& h);
Result<Hello> decode_hello(std::string_view bytes);

struct Challenge {
  std::uint64_t node_guid = 0;  // the target's device that will serve the queue pair
  handshake::Nonce nonce{};
  bool token_required = false;
};

std::string encode_challenge(const Challenge& c);
Result<Challenge> decode_challenge(std::string_view bytes);

// A region's key: its rkey on each device that registered it. With `leases_only` the rkey
// grants nothing remote by itself (the region was registered for memory windows only); it
// names the region in lease requests.
struct KeyPart {
  std::uint64_t node_guid = 0;
  std::uint32_t rkey = 0;
  bool leases_only = false;
};

std::string encode_key(std::span<const KeyPart> parts);
Result<std::vector<KeyPart>> decode_key(std::string_view bytes);

// Lease messages, on the setup connection once the queue pair is up. The client asks for
// windows over ranges of one region (named by the id its key carries: its MR's lkey, see
// Registration::region_id) for a time, under a lease id of its
// choosing (the same on every connection it uses the lease through) and the owner's fence
// tag; the target binds a type-2 memory window per range to this connection's queue pair and
// answers with their rkeys, in request order. A release revokes them early on this connection
// and is not answered; a revoke ends the lease id on every connection of the target and is
// answered once it did.
inline constexpr std::size_t kMaxLeaseRanges = 1024;

// Setup frames are a u32 length (network order) and the message. Before the queue pair is up
// only hellos and the token proof travel (small); afterwards lease messages, the largest a
// request of kMaxLeaseRanges ranges (header 33 bytes, 16 per range) and its grant (a u32
// length and at most kMaxGrantBytes), or its reply (at most 1,045 bytes of header and message,
// 4 per range).
inline constexpr std::size_t kMaxSetupFrame = 512;
inline constexpr std::size_t kMaxLeaseFrame = 64 + 16 * kMaxLeaseRanges + 4 + kMaxGrantBytes;

struct LeaseRange {
  std::uint64_t addr = 0;
  std::uint64_t length = 0;
};

struct LeaseRequest {
  std::uint64_t id = 0;  // never 0
  std::uint32_t region_rkey = 0;
  bool write = false;  // RDMA WRITE; otherwise READ
  std::uint32_t ttl_ms = 0;
  std::uint64_t fence = 0;  // the owner's fence tag (0: none)
  std::vector<LeaseRange> ranges;
  std::string grant;  // what the owner granted (kvstash/grant.h); empty: none
};

struct LeaseReply {
  std::uint64_t id = 0;
  Status status;                     // why the target refused, or OK
  std::vector<std::uint32_t> rkeys;  // one per range when OK
};

struct LeaseRelease {
  std::uint64_t id = 0;
};

// Asks the target to end lease `id` on every connection and to refuse it from now on.
struct LeaseRevoke {
  std::uint64_t id = 0;     // never 0
  std::uint64_t fence = 0;  // the lease's fence tag: the target forgets the id once fenced past it
};

// The target's answer to a revoke: no window of the lease is left.
struct LeaseRevoked {
  std::uint64_t id = 0;
};

std::string encode_lease_request(const LeaseRequest& r);
std::string encode_lease_reply(const LeaseReply& r);
std::string encode_lease_release(const LeaseRelease& r);
std::string encode_lease_revoke(const LeaseRevoke& r);
std::string encode_lease_revoked(const LeaseRevoked& r);

// What arrived on the target's side of the setup connection: a request, a release or a
// revoke.
using LeaseMessage = std::variant<LeaseRequest, LeaseRelease, LeaseRevoke>;
Result<LeaseMessage> decode_lease_message(std::string_view bytes);
Result<LeaseReply> decode_lease_reply(std::string_view bytes);
Result<LeaseRevoked> decode_lease_revoked(std::string_view bytes);

// Which of our ports can talk to which of the peer's: the same link layer, and on RoCE the
// same address family (IPv4-mapped GIDs talk to IPv4-mapped ones), on InfiniBand the same
// subnet prefix. The first usable pair in our order, or nullopt.
std::optional<std::pair<std::size_t, std::size_t>> match_ports(std::span<const PortAddress> ours,
                                                               std::span<const PortAddress> theirs);

// The lanes of a connection across several devices: for each of our ports, the peer's port on
// the same rail (the one at the same index, modulo the peer's count: multi-NIC hosts are
// cabled rail by rail) when it can be reached, else the first one that can; ports that reach
// none are left out. Pairs (ours, theirs) in our order; empty when nothing can be reached.
std::vector<std::pair<std::size_t, std::size_t>> pair_rails(std::span<const PortAddress> ours,
                                                            std::span<const PortAddress> theirs);

}  // namespace kvstash::transport::verbs

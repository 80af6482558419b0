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
#include <vector>

#include "kvstash/status.h"
#include "transport/verbs/verbs_qp.h"

namespace kvstash::transport::verbs {

// Bumped on any change of the formats below; peers of another version are refused.
inline constexpr std::uint8_t kWireVersion = 1;

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

// The first connection message of each side: which device it uses, its queue pair, and its
// half of the cluster-token handshake (common/handshake.h). The client's mac is empty; the
// server's proves the token when it requires one. The client answers with its own mac, and
// the server brings its queue pair up only after checking it.
struct Hello {
  std::uint64_t node_guid = 0;
  QpEndpoint qp;
  std::uint8_t max_rd_atomic = 1;  // READs this side accepts in flight
  std::array<std::uint8_t, 16> nonce{};
  bool token_required = false;
  std::array<std::uint8_t, 32> mac{};
};

std::string encode_hello(const Hello& h);
Result<Hello> decode_hello(std::string_view bytes);

// A region's key: its rkey on each device that registered it.
struct KeyPart {
  std::uint64_t node_guid = 0;
  std::uint32_t rkey = 0;
};

std::string encode_key(std::span<const KeyPart> parts);
Result<std::vector<KeyPart>> decode_key(std::string_view bytes);

// Which of our ports can talk to which of the peer's: the same link layer, and on RoCE the
// same address family (IPv4-mapped GIDs talk to IPv4-mapped ones), on InfiniBand the same
// subnet prefix. The first usable pair in our order, or nullopt.
std::optional<std::pair<std::size_t, std::size_t>> match_ports(std::span<const PortAddress> ours,
                                                               std::span<const PortAddress> theirs);

}  // namespace kvstash::transport::verbs

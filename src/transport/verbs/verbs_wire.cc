#include "transport/verbs/verbs_wire.h"

#include <cstring>

#include "common/wire.h"

namespace kvstash::transport::verbs {
namespace {

constexpr std::uint32_t kAddressMagic = 0x4256534b;  // "KSVB"
constexpr std::uint32_t kHelloMagic = 0x4856534b;    // "KSVH"
constexpr std::uint32_t kKeyMagic = 0x5256534b;      // "KSVR"
constexpr std::uint32_t kChallengeMagic = 0x4356534b;  // "KSVC"
constexpr std::uint32_t kLeaseMagic = 0x4c56534b;    // "KSVL"
constexpr std::uint8_t kLeaseRequestType = 'L';
constexpr std::uint8_t kLeaseReplyType = 'A';
constexpr std::uint8_t kLeaseReleaseType = 'X';
constexpr std::uint8_t kLeaseRevokeType = 'R';
constexpr std::uint8_t kLeaseRevokedType = 'K';
constexpr std::size_t kMaxMessage = 1024;
constexpr std::size_t kMaxPorts = 64;
constexpr std::size_t kMaxName = 64;
constexpr std::size_t kMaxControl = 262;  // "[" + 255-char host + "]:65535"

Status invalid(std::string_view what) {
  std::string m = "verbs: malformed ";
  m.append(what);
  return Status::invalid_argument(std::move(m));
}

// Fixed-size byte fields (GIDs, nonces, MACs).
void put_bytes(wire::Writer& w, const std::uint8_t* p, std::size_t n) {
  w.raw({reinterpret_cast<const char*>(p), n});
}

void get_bytes(wire::Reader& r, std::uint8_t* p, std::size_t n) {
  auto s = r.raw(n);
  if (s.size() == n) std::memcpy(p, s.data(), n);
}

void put_gid(wire::Writer& w, const ibv_gid& g) { put_bytes(w, g.raw, sizeof g.raw); }

ibv_gid get_gid(wire::Reader& r) {
  ibv_gid g{};
  get_bytes(r, g.raw, sizeof g.raw);
  return g;
}

bool valid_mtu(std::uint8_t m) { return m >= IBV_MTU_256 && m <= IBV_MTU_4096; }

// Checks the magic and version; false (with `why` set) when they do not match.
bool header(wire::Reader& r, std::uint32_t magic, std::string_view what, Status* why) {
  std::uint32_t m = r.u32();
  std::uint8_t v = r.u8();
  if (!r.ok() || m != magic) {
    *why = invalid(what);
    return false;
  }
  if (v != kWireVersion) {
    std::string msg = "verbs: peer speaks ";
    msg.append(what).append(" version ").append(std::to_string(v)).append(", this build ");
    msg.append(std::to_string(kWireVersion));
    *why = Status::invalid_argument(std::move(msg));
    return false;
  }
  return true;
}

}  // namespace

bool PortAddress::operator==(const PortAddress& o) const {
  return device == o.device && node_guid == o.node_guid && port == o.port && ethernet == o.ethernet &&
         std::memcmp(gid.raw, o.gid.raw, sizeof gid.raw) == 0 && lid == o.lid && mtu == o.mtu;
}

std::string encode_address(const Address& a) {
  wire::Writer w;
  w.u32(kAddressMagic);
  w.u8(kWireVersion);
  w.bytes(a.control);
  w.u8(static_cast<std::uint8_t>(a.ports.size()));
  for (const auto& p : a.ports) {
    w.bytes(p.device);
    w.u64(p.node_guid);
    w.u8(p.port);
    w.u8(p.ethernet ? 1 : 0);
    put_gid(w, p.gid);
    w.u16(p.lid);
    w.u8(static_cast<std::uint8_t>(p.mtu));
  }
  return w.take();
}

Result<Address> decode_address(std::string_view bytes) {
  wire::Reader r(bytes);
  Status why;
  if (!header(r, kAddressMagic, "address", &why)) return why;
  Address a;
  std::string_view control = r.bytes();
  if (control.empty() || control.size() > kMaxControl) return invalid("address (control endpoint)");
  a.control = std::string(control);
  std::size_t n = r.u8();
  if (n == 0 || n > kMaxPorts) return invalid("address (port count)");
  for (std::size_t i = 0; i < n; ++i) {
    PortAddress p;
    std::string_view name = r.bytes();
    if (name.size() > kMaxName) return invalid("address (device name)");
    p.device = std::string(name);
    p.node_guid = r.u64();
    p.port = r.u8();
    std::uint8_t eth = r.u8();
    p.gid = get_gid(r);
    p.lid = r.u16();
    std::uint8_t mtu = r.u8();
    if (!r.ok() || p.port == 0 || eth > 1 || !valid_mtu(mtu)) return invalid("address (port)");
    p.ethernet = eth == 1;
    p.mtu = static_cast<ibv_mtu>(mtu);
    a.ports.push_back(std::move(p));
  }
  if (!r.at_end()) return invalid("address (trailing bytes)");
  return a;
}

std::string encode_hello(const Hello& h) {
  wire::Writer w;
  w.u32(kHelloMagic);
  w.u8(kWireVersion);
  w.u64(h.node_guid);
  w.u64(h.peer_guid);
  w.u32(h.qp.qpn);
  w.u32(h.qp.psn);
  put_gid(w, h.qp.gid);
  w.u16(h.qp.lid);
  w.u8(static_cast<std::uint8_t>(h.qp.mtu));
  w.u8(h.max_rd_atomic);
  put_bytes(w, h.nonce.data(), h.nonce.size());
  w.u8(h.token_required ? 1 : 0);
  put_bytes(w, h.mac.data(), h.mac.size());
  return w.take();
}

Result<Hello> decode_hello(std::string_view bytes) {
  wire::Reader r(bytes);
  Status why;
  if (!header(r, kHelloMagic, "hello", &why)) return why;
  Hello h;
  h.node_guid = r.u64();
  h.peer_guid = r.u64();
  h.qp.qpn = r.u32();
  h.qp.psn = r.u32();
  h.qp.gid = get_gid(r);
  h.qp.lid = r.u16();
  std::uint8_t mtu = r.u8();
  h.max_rd_atomic = r.u8();
  get_bytes(r, h.nonce.data(), h.nonce.size());
  std::uint8_t token = r.u8();
  get_bytes(r, h.mac.data(), h.mac.size());
  h.token_required = token == 1;
  if (token > 1) return invalid("hello (token flag)");
  // QPNs and PSNs are 24-bit; QPN 0 and 1 are the special QPs, never an RC peer.
  if (!r.at_end() || h.qp.qpn < 2 || h.qp.qpn > 0xffffff || h.qp.psn > 0xffffff || !valid_mtu(mtu) ||
      h.max_rd_atomic == 0) {
    return invalid("hello");
  }
  h.qp.mtu = static_cast<ibv_mtu>(mtu);
  return h;
}

std::string encode_challenge(const Challenge& c) {
  wire::Writer w;
  w.u32(kChallengeMagic);
  w.u8(kWireVersion);
  w.u64(c.node_guid);
  put_bytes(w, c.nonce.data(), c.nonce.size());
  w.u8(c.token_required ? 1 : 0);
  return w.take();
}

Result<Challenge> decode_challenge(std::string_view bytes) {
  wire::Reader r(bytes);
  Status why;
  if (!header(r, kChallengeMagic, "challenge", &why)) return why;
  Challenge c;
  c.node_guid = r.u64();
  get_bytes(r, c.nonce.data(), c.nonce.size());
  const std::uint8_t token = r.u8();
  if (!r.at_end() || token > 1) return invalid("challenge");
  c.token_required = token == 1;
  return c;
}

std::string encode_key(std::span<const KeyPart> parts) {
  wire::Writer w;
  w.u32(kKeyMagic);
  w.u8(kWireVersion);
  w.u8(static_cast<std::uint8_t>(parts.size()));
  for (const auto& p : parts) {
    w.u64(p.node_guid);
    w.u32(p.rkey);
    w.u8(p.leases_only ? 1 : 0);
  }
  return w.take();
}

Result<std::vector<KeyPart>> decode_key(std::string_view bytes) {
  wire::Reader r(bytes);
  Status why;
  if (!header(r, kKeyMagic, "remote key", &why)) return why;
  std::size_t n = r.u8();
  if (n == 0 || n > kMaxPorts) return invalid("remote key (device count)");
  std::vector<KeyPart> out(n);
  for (auto& p : out) {
    p.node_guid = r.u64();
    p.rkey = r.u32();
    const std::uint8_t flags = r.u8();
    if (flags > 1) return invalid("remote key (flags)");
    p.leases_only = flags == 1;
  }
  if (!r.at_end()) return invalid("remote key");
  return out;
}

namespace {

void lease_header(wire::Writer& w, std::uint8_t type) {
  w.u32(kLeaseMagic);
  w.u8(kWireVersion);
  w.u8(type);
}

}  // namespace

std::string encode_lease_request(const LeaseRequest& r) {
  wire::Writer w;
  lease_header(w, kLeaseRequestType);
  w.u64(r.id);
  w.u32(r.region_rkey);
  w.u8(r.write ? 1 : 0);
  w.u32(r.ttl_ms);
  w.u64(r.fence);
  w.u16(static_cast<std::uint16_t>(r.ranges.size()));
  for (const auto& range : r.ranges) {
    w.u64(range.addr);
    w.u64(range.length);
  }
  w.bytes(r.grant);
  return w.take();
}

std::string encode_lease_reply(const LeaseReply& r) {
  wire::Writer w;
  lease_header(w, kLeaseReplyType);
  w.u64(r.id);
  w.u8(static_cast<std::uint8_t>(r.status.code()));
  w.bytes(r.status.message().substr(0, kMaxMessage));
  w.u16(static_cast<std::uint16_t>(r.rkeys.size()));
  for (std::uint32_t k : r.rkeys) w.u32(k);
  return w.take();
}

std::string encode_lease_release(const LeaseRelease& r) {
  wire::Writer w;
  lease_header(w, kLeaseReleaseType);
  w.u64(r.id);
  return w.take();
}

std::string encode_lease_revoke(const LeaseRevoke& r) {
  wire::Writer w;
  lease_header(w, kLeaseRevokeType);
  w.u64(r.id);
  w.u64(r.fence);
  return w.take();
}

std::string encode_lease_revoked(const LeaseRevoked& r) {
  wire::Writer w;
  lease_header(w, kLeaseRevokedType);
  w.u64(r.id);
  return w.take();
}

Result<LeaseMessage> decode_lease_message(std::string_view bytes) {
  wire::Reader r(bytes);
  Status why;
  if (!header(r, kLeaseMagic, "lease message", &why)) return why;
  const std::uint8_t type = r.u8();
  if (type == kLeaseReleaseType) {
    LeaseRelease rel{r.u64()};
    if (!r.at_end()) return invalid("lease release");
    return LeaseMessage(rel);
  }
  if (type == kLeaseRevokeType) {
    LeaseRevoke rev;
    rev.id = r.u64();
    rev.fence = r.u64();
    if (!r.at_end() || rev.id == 0) return invalid("lease revoke");
    return LeaseMessage(rev);
  }
  if (type != kLeaseRequestType) return invalid("lease message (type)");
  LeaseRequest q;
  q.id = r.u64();
  q.region_rkey = r.u32();
  const std::uint8_t write = r.u8();
  q.ttl_ms = r.u32();
  q.fence = r.u64();
  const std::size_t n = r.u16();
  if (!r.ok() || q.id == 0 || write > 1 || n == 0 || n > kMaxLeaseRanges || q.ttl_ms == 0) {
    return invalid("lease request");
  }
  q.write = write == 1;
  q.ranges.resize(n);
  for (auto& range : q.ranges) {
    range.addr = r.u64();
    range.length = r.u64();
    if (range.length == 0 || range.addr + range.length < range.addr) return invalid("lease request (range)");
  }
  q.grant = std::string(r.bytes());
  if (!r.ok() || q.grant.size() > kMaxGrantBytes) return invalid("lease request (grant)");
  if (!r.at_end()) return invalid("lease request");
  return LeaseMessage(std::move(q));
}

Result<LeaseReply> decode_lease_reply(std::string_view bytes) {
  wire::Reader r(bytes);
  Status why;
  if (!header(r, kLeaseMagic, "lease reply", &why)) return why;
  if (r.u8() != kLeaseReplyType) return invalid("lease reply (type)");
  LeaseReply a;
  a.id = r.u64();
  const std::uint8_t code = r.u8();
  const std::string_view message = r.bytes();
  const std::size_t n = r.u16();
  if (!r.ok() || code > static_cast<std::uint8_t>(StatusCode::kInternal) || message.size() > kMaxMessage ||
      n > kMaxLeaseRanges) {
    return invalid("lease reply");
  }
  a.rkeys.resize(n);
  for (auto& k : a.rkeys) k = r.u32();
  if (!r.at_end()) return invalid("lease reply");
  if (code != 0) {
    a.status = Status(static_cast<StatusCode>(code), std::string(message));
    if (n != 0) return invalid("lease reply (keys with a refusal)");
  }
  return a;
}

Result<LeaseRevoked> decode_lease_revoked(std::string_view bytes) {
  wire::Reader r(bytes);
  Status why;
  if (!header(r, kLeaseMagic, "lease revoke answer", &why)) return why;
  if (r.u8() != kLeaseRevokedType) return invalid("lease revoke answer (type)");
  LeaseRevoked a{r.u64()};
  if (!r.at_end()) return invalid("lease revoke answer");
  return a;
}

namespace {

bool can_talk(const PortAddress& a, const PortAddress& b) {
  if (a.ethernet != b.ethernet) return false;
  if (a.ethernet) return ipv4_mapped(a.gid) == ipv4_mapped(b.gid);
  // Another InfiniBand subnet: no route without a router we know nothing of.
  return std::memcmp(a.gid.raw, b.gid.raw, 8) == 0;
}

}  // namespace

std::optional<std::pair<std::size_t, std::size_t>> match_ports(std::span<const PortAddress> ours,
                                                               std::span<const PortAddress> theirs) {
  for (std::size_t i = 0; i < ours.size(); ++i) {
    for (std::size_t j = 0; j < theirs.size(); ++j) {
      if (can_talk(ours[i], theirs[j])) return std::make_pair(i, j);
    }
  }
  return std::nullopt;
}

std::vector<std::pair<std::size_t, std::size_t>> pair_rails(std::span<const PortAddress> ours,
                                                            std::span<const PortAddress> theirs) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  if (theirs.empty()) return out;
  for (std::size_t i = 0; i < ours.size(); ++i) {
    const std::size_t rail = i % theirs.size();
    if (can_talk(ours[i], theirs[rail])) {
      out.emplace_back(i, rail);
      continue;
    }
    for (std::size_t j = 0; j < theirs.size(); ++j) {
      if (can_talk(ours[i], theirs[j])) {
        out.emplace_back(i, j);
        break;
      }
    }
  }
  return out;
}

}  // namespace kvstash::transport::verbs

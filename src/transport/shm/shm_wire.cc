// The shm transport's codecs (shm_wire.h).
#include "transport/shm/shm_wire.h"

#include <sys/un.h>

#include <utility>

#include "common/wire.h"

namespace kvstash::transport::shm {

// ---- records -------------------------------------------------------------------------------

std::string encode_address(const Address& address) {
  wire::Writer w;
  w.u32(kAddressMagic);
  w.u16(kVersion);
  w.bytes(address.boot_id);
  w.u32(address.uid);
  w.bytes(address.socket_path);
  return w.take();
}

Result<Address> decode_address(std::string_view bytes) {
  wire::Reader r(bytes);
  const std::uint32_t magic = r.u32();
  const std::uint16_t version = r.u16();
  Address a;
  a.boot_id = std::string(r.bytes());
  a.uid = r.u32();
  a.socket_path = std::string(r.bytes());
  if (!r.at_end() || magic != kAddressMagic) {
    return Status::invalid_argument("malformed shm address");
  }
  if (version != kVersion) {
    return Status::invalid_argument("shm address version " + std::to_string(version) + " not supported");
  }
  if (a.socket_path.empty() || a.socket_path.size() >= sizeof(sockaddr_un::sun_path) ||
      a.socket_path.find('\0') != std::string::npos || a.boot_id.empty()) {
    return Status::invalid_argument("malformed shm address (socket path)");
  }
  return a;
}

std::string encode_key(const PackedKey& key) {
  wire::Writer w;
  w.u32(kKeyMagic);
  w.u16(kVersion);
  w.u32(key.slot);
  w.u64(key.key);
  w.u8(key.leased ? 1 : 0);
  return w.take();
}

Result<PackedKey> decode_key(std::string_view bytes) {
  wire::Reader r(bytes);
  const std::uint32_t magic = r.u32();
  const std::uint16_t version = r.u16();
  PackedKey k;
  k.slot = r.u32();
  k.key = r.u64();
  const std::uint8_t leased = r.u8();
  if (!r.at_end() || magic != kKeyMagic || version != kVersion || leased > 1) {
    return Status::invalid_argument("malformed shm remote key");
  }
  k.leased = leased == 1;
  if (k.slot < kFirstKeySlot || k.slot >= kKeySlots || k.key == 0) {
    return Status::invalid_argument("malformed shm remote key (slot or key out of range)");
  }
  return k;
}

// ---- requests and replies ------------------------------------------------------------------

std::string encode_request(MsgType type, std::uint64_t id, std::uint32_t slot, std::uint64_t key) {
  wire::Writer w;
  w.u32(kMessageMagic);
  w.u16(kVersion);
  w.u8(static_cast<std::uint8_t>(type));
  w.u64(id);
  if (type == MsgType::kImport) {
    w.u32(slot);
    w.u64(key);
  }
  return w.take();
}

Status decode_request(std::string_view bytes, Request* out) {
  wire::Reader r(bytes);
  const std::uint32_t magic = r.u32();
  out->version = r.u16();
  out->type = static_cast<MsgType>(r.u8());
  out->id = r.u64();
  if (!r.ok() || magic != kMessageMagic) return Status::invalid_argument("malformed shm request");
  if (out->version != kVersion) {
    return Status::unsupported("shm protocol version " + std::to_string(out->version));
  }
  switch (out->type) {
    case MsgType::kHello: break;
    case MsgType::kImport:
      out->slot = r.u32();
      out->key = r.u64();
      break;
    default: return Status::ok();
  }
  if (!r.at_end()) return Status::invalid_argument("malformed shm request (length)");
  return Status::ok();
}

std::string encode_reply(MsgType type, std::uint64_t id, const Status& s, std::uint64_t a, std::uint64_t b,
                         std::uint64_t c) {
  wire::Writer w;
  w.u32(kMessageMagic);
  w.u16(kVersion);
  w.u8(static_cast<std::uint8_t>(type));
  w.u64(id);
  w.u8(static_cast<std::uint8_t>(s.code()));
  w.bytes(s.message());
  w.u64(a);
  w.u64(b);
  w.u64(c);
  return w.take();
}

Result<Reply> decode_reply(std::string_view bytes) {
  wire::Reader r(bytes);
  Reply out;
  const std::uint32_t magic = r.u32();
  const std::uint16_t version = r.u16();
  out.type = static_cast<MsgType>(r.u8());
  out.id = r.u64();
  const std::uint8_t code = r.u8();
  std::string message(r.bytes());
  out.a = r.u64();
  out.b = r.u64();
  out.c = r.u64();
  if (!r.at_end() || magic != kMessageMagic || version != kVersion ||
      code > static_cast<std::uint8_t>(StatusCode::kInternal)) {
    return Status::corrupt("malformed reply from shm peer");
  }
  if (code != 0) out.status = Status(static_cast<StatusCode>(code), std::move(message));
  return out;
}

}  // namespace kvstash::transport::shm

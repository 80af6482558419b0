// The shm transport's records and messages as bytes: the address a transport advertises, the
// packed key of a registration, the layout of the key table, and the requests and replies
// of the control protocol (shm_socket.h carries them). Pure codecs: no I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/fd.h"
#include "kvstash/status.h"

namespace kvstash::transport::shm {

inline constexpr std::uint32_t kAddressMagic = 0x4d53564b;  // "KVSM"
inline constexpr std::uint32_t kKeyMagic = 0x4b53564b;      // "KVSK"
inline constexpr std::uint32_t kMessageMagic = 0x5053564b;  // "KVSP"
inline constexpr std::uint16_t kVersion = 2;

// ---- the key table -------------------------------------------------------------------------

// Slot 0 of the key table holds this magic (it includes the version), so a peer that maps
// something else notices. Slot 1 holds the fence (leases with a tag at or below it are
// over). Slots 2..kKeySlots-1 hold keys; 0 means free or revoked.
inline constexpr std::uint64_t kKeyTableMagic = 0x3230594b4853564bull;  // "KVSHKY02"
inline constexpr std::uint32_t kFenceSlot = 1;
inline constexpr std::uint32_t kFirstKeySlot = 2;
inline constexpr std::uint32_t kKeySlots = 8192;  // 64 KiB memfd

// ---- records -------------------------------------------------------------------------------

struct Address {
  std::string boot_id;
  std::uint32_t uid = 0;
  std::string socket_path;
};
std::string encode_address(const Address& address);
// kInvalidArgument unless `bytes` is exactly one well-formed record of this version.
Result<Address> decode_address(std::string_view bytes);

struct PackedKey {
  std::uint32_t slot = 0;
  std::uint64_t key = 0;
  bool leased = false;  // reachable through leases only
};
std::string encode_key(const PackedKey& key);
// kInvalidArgument unless well formed and naming a key slot with a non-zero key.
Result<PackedKey> decode_key(std::string_view bytes);

// ---- the request/response protocol ---------------------------------------------------------
//
// One SOCK_SEQPACKET message per request and per response, so no framing and no partial
// reads. request:  magic u32, version u16, type u8, id u64, [import: slot u32, key u64]
// response: magic u32, version u16, type u8, id u64, code u8, message bytes, a u64, b u64,
// c u64 (hello: a = slots; import: a = region address, b = length, c = fd offset), and on
// success one file descriptor (hello: the key table; import: the region's file).

enum class MsgType : std::uint8_t { kHello = 1, kImport = 2, kRefused = 3 };

// No message of either side is longer; a longer one is refused as oversized.
inline constexpr std::size_t kMaxMessage = 1024;

struct Request {
  std::uint16_t version = 0;
  MsgType type{};  // may be a value MsgType does not name: the server answers those
  std::uint64_t id = 0;
  std::uint32_t slot = 0;  // kImport
  std::uint64_t key = 0;   // kImport
};
std::string encode_request(MsgType type, std::uint64_t id, std::uint32_t slot = 0, std::uint64_t key = 0);
// Reads a request into `out`, as far as it goes. kInvalidArgument when the header is short
// or not ours, or a hello or import has the wrong length: the server hangs up without an
// answer. kUnsupported for another version, with `out`'s type and id read, so the refusal
// can name them. A type MsgType does not name is OK here (its body is not looked at).
Status decode_request(std::string_view bytes, Request* out);

struct Reply {
  MsgType type{};
  std::uint64_t id = 0;
  Status status;
  std::uint64_t a = 0, b = 0, c = 0;
  UniqueFd fd;  // the descriptor that came with the message (the receiver's to attach)
};
std::string encode_reply(MsgType type, std::uint64_t id, const Status& s, std::uint64_t a = 0,
                         std::uint64_t b = 0, std::uint64_t c = 0);
// kCorrupt unless well formed, of this version, with a status code that exists. The reply's
// fd is left empty.
Result<Reply> decode_reply(std::string_view bytes);

}  // namespace kvstash::transport::shm

// Grants as text: what a lease may reach, signed with the owner's key (HMAC-SHA1).
//
//   g1 <issuer> <epoch> <r|w> <deadline> <runs> <mac>
//
// issuer and epoch name the owner and its incarnation; deadline is the lease's fence tag;
// runs are `*` (the whole region) or `first+count,...` in the owner's unit (a memory node's
// pages, a KvExport's bytes); mac is the lowercase hex HMAC-SHA1 over everything before the
// space that precedes it. Memory nodes' grants are made by the cell's Lua scripts
// (prelude/grants.lua, grant_for), which have SHA1 (redis.sha1hex) and nothing stronger: HMAC-SHA1
// stays a sound MAC, SHA1's collisions notwithstanding.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash::grant {

inline constexpr std::size_t kKeyBytes = 32;

// The longest lease a cell grants (its scripts refuse a longer one: prelude/grants.lua's MAX_LEASE_MS),
// so no grant's deadline lies further than this past the cell's clock when it is signed; a
// memory node refuses one that does (a grant minted with a leaked key, for years).
inline constexpr std::chrono::milliseconds kMaxLease{600000};

struct Terms {
  std::string issuer;
  std::string epoch;
  TransferOp op = TransferOp::kRead;
  std::uint64_t deadline = 0;
  bool whole = false;                                         // runs `*`
  std::vector<std::pair<std::uint64_t, std::uint64_t>> runs;  // first, count
};

// The grant text for `t`, signed with `key`.
std::string sign(std::span<const std::uint8_t> key, const Terms& t);

// The terms of `text` when `key` signed it; kPermissionDenied for a wrong MAC, kInvalidArgument
// for malformed text (checked after the MAC: an unsigned text's shape is nobody's business).
Result<Terms> verify(std::span<const std::uint8_t> key, std::string_view text);

// A fresh random key, and its hex form (what a memory node hands its cell).
std::vector<std::uint8_t> new_key();
std::string hex(std::span<const std::uint8_t> bytes);

}  // namespace kvstash::grant

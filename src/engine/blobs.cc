#include "engine/blobs.h"

#include "common/wire.h"

namespace kvstash::blobs {

std::string encode_parts(std::uint32_t magic, std::uint64_t base, std::uint64_t length, const Parts& parts,
                         bool with_range) {
  wire::Writer w;
  w.u32(magic);
  if (with_range) {
    w.u64(base);
    w.u64(length);
  }
  w.u8(static_cast<std::uint8_t>(parts.size()));
  for (const auto& [kind, bytes] : parts) {
    w.u8(static_cast<std::uint8_t>(kind));
    w.bytes(bytes);
  }
  return w.take();
}

std::optional<Decoded> decode_parts(std::string_view blob, std::uint32_t magic, bool with_range) {
  wire::Reader r(blob);
  Decoded d;
  if (r.u32() != magic) return std::nullopt;
  if (with_range) {
    d.base = r.u64();
    d.length = r.u64();
  }
  std::size_t n = r.u8();
  if (n > kMaxParts) return std::nullopt;
  for (std::size_t i = 0; i < n && r.ok(); ++i) {
    auto kind = r.u8();
    auto bytes = r.bytes();
    // A kind this build lacks or does not know (a newer peer's) is kept: no transport here
    // claims it, so connect and import_key pass over it.
    d.parts.emplace_back(static_cast<TransportKind>(kind), std::string(bytes));
  }
  if (!r.at_end()) return std::nullopt;
  return d;
}

}  // namespace kvstash::blobs

#include "node/tier_headers.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <xxhash.h>

#include <algorithm>

#include "common/wire.h"
#include "kvstash/memory.h"
#include "node/ssd_device.h"

namespace kvstash::node {
namespace {

constexpr std::string_view kMagic = "KVSTHDR1";
// 2: unkeyed, an XXH3-64 of the header ends it; 3: keyed, an HMAC-SHA256 with the node's key.
constexpr std::uint32_t kUnkeyed = 2, kKeyed = 3;
constexpr std::size_t kFixed = 8 + 4 + 4;  // magic, version, length
constexpr std::size_t kReadChunk = 4 << 20;
constexpr std::size_t kMacBytes = 32;

std::size_t tail_bytes(std::span<const std::uint8_t> key) { return key.empty() ? 8 : kMacBytes; }

// What ends a header of `body` (every byte before it): the XXH3, or the MAC with `key`.
std::string tail_of(std::string_view body, std::span<const std::uint8_t> key) {
  if (key.empty()) {
    wire::Writer w;
    w.u64(XXH3_64bits(body.data(), body.size()));
    return w.take();
  }
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(body.data()), body.size(), mac, &len);
  return std::string(reinterpret_cast<const char*>(mac), kMacBytes);
}

}  // namespace

TierLayout::TierLayout(std::uint64_t capacity, std::uint64_t page, std::uint32_t block)
    : block_size(block), page_size(page) {
  header_unit = std::max<std::uint64_t>(4096, block);
  // The superblock's place, then per slot its header's and its page.
  slots = capacity > header_unit && page > 0 ? (capacity - header_unit) / (page + header_unit) : 0;
}

std::vector<std::uint8_t> tier_header_key(std::string_view secret) {
  if (secret.empty()) return {};
  constexpr std::string_view kPurpose = "kvstash NVMe tier headers";
  unsigned char key[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(kPurpose.data()), kPurpose.size(), key, &len);
  return {key, key + len};
}

Result<std::string> encode_tier_header(const TierHeader& h, std::size_t max_bytes,
                                       std::span<const std::uint8_t> key) {
  wire::Writer w;
  w.raw(kMagic);
  w.u32(key.empty() ? kUnkeyed : kKeyed);
  w.u32(0);  // the length, below
  w.u64(h.sequence);
  for (std::string_view s : {std::string_view(h.cell), std::string_view(h.key), std::string_view(h.token)})
    w.bytes(s);
  w.u64(h.size);
  w.bytes(h.checksum);
  w.bytes(h.layout);
  w.bytes(h.sum);
  w.u64(static_cast<std::uint64_t>(h.expires_ms));
  w.u32(static_cast<std::uint32_t>(h.runs.size()));
  for (auto [first, count] : h.runs) {
    w.u64(first);
    w.u64(count);
  }
  std::string out = w.take();
  const std::size_t length = out.size() + tail_bytes(key);
  if (length > max_bytes) {
    return Status::invalid_argument("tier header of " + std::to_string(length) + " bytes: at most " +
                                    std::to_string(max_bytes));
  }
  for (std::size_t i = 0; i < 4; ++i) out[12 + i] = static_cast<char>((length >> (8 * i)) & 0xff);
  out += tail_of(out, key);
  return out;
}

std::optional<TierHeader> decode_tier_header(std::string_view bytes, std::span<const std::uint8_t> key) {
  const std::size_t tail = tail_bytes(key);
  if (bytes.size() < kFixed + tail || bytes.substr(0, kMagic.size()) != kMagic) return std::nullopt;
  wire::Reader fixed(bytes.substr(kMagic.size(), 8));
  const std::uint32_t version = fixed.u32(), length = fixed.u32();
  // A node with a key admits only headers it signed: an unkeyed one is anyone's.
  if (version != (key.empty() ? kUnkeyed : kKeyed) || length < kFixed + tail || length > bytes.size()) {
    return std::nullopt;
  }
  const std::string expect = tail_of(bytes.substr(0, length - tail), key);
  if (CRYPTO_memcmp(expect.data(), bytes.data() + length - tail, tail) != 0) return std::nullopt;
  wire::Reader r(bytes.substr(kFixed, length - tail - kFixed));
  TierHeader h;
  h.sequence = r.u64();
  h.cell = r.bytes();
  h.key = r.bytes();
  h.token = r.bytes();
  h.size = r.u64();
  h.checksum = r.bytes();
  h.layout = r.bytes();
  h.sum = r.bytes();
  h.expires_ms = static_cast<std::int64_t>(r.u64());
  const std::uint32_t runs = r.u32();
  if (!r.ok() || runs > length / 16) return std::nullopt;
  for (std::uint32_t i = 0; i < runs; ++i) {
    const std::uint64_t first = r.u64(), count = r.u64();
    h.runs.emplace_back(first, count);
  }
  if (!r.ok() || !r.at_end()) return std::nullopt;
  return h;
}

Result<std::vector<std::pair<TierHeader, std::uint64_t>>> scan_tier_headers(
    SsdDevice& device, const TierLayout& layout, Deadline deadline, std::span<const std::uint8_t> key) {
  const std::uint64_t unit = layout.header_unit, per_read = std::max<std::uint64_t>(1, kReadChunk / unit);
  KVSTASH_ASSIGN_OR_RETURN(Buffer buffer, Buffer::allocate(per_read * unit));
  std::vector<std::pair<TierHeader, std::uint64_t>> found;
  for (std::uint64_t slot = 0; slot < layout.slots;) {
    const std::uint64_t n = std::min(per_read, layout.slots - slot);
    KVSTASH_RETURN_IF_ERROR(device.run(
        {{.write = false, .offset = layout.header_offset(slot), .buffer = buffer.data(), .length = n * unit}},
        deadline));
    const std::string_view chunk(reinterpret_cast<const char*>(buffer.data()), n * unit);
    for (std::uint64_t i = 0; i < n; ++i) {
      if (auto h = decode_tier_header(chunk.substr(i * unit, unit), key))
        found.emplace_back(std::move(*h), slot + i);
    }
    slot += n;
  }
  return found;
}

}  // namespace kvstash::node

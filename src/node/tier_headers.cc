#include "node/tier_headers.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "common/wire.h"
#include "kvstash/memory.h"
#include "node/ssd_device.h"

namespace kvstash::node {
namespace {

constexpr std::string_view kMagic = "KVSTHDR1";
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kFixed = 8 + 4 + 4;  // magic, version, length
constexpr std::size_t kReadChunk = 4 << 20;

std::uint64_t blocks_for(std::uint64_t bytes, std::uint32_t block) { return (bytes + block - 1) / block; }

}  // namespace

TierLayout::TierLayout(std::uint64_t capacity, std::uint64_t page, std::uint32_t block)
    : block_size(block), page_size(page) {
  header_blocks = std::max<std::uint64_t>(blocks_for(capacity / 256, block), blocks_for(kMaxTierHeaderBytes, block));
  const std::uint64_t header_bytes = header_blocks * block;
  slots = capacity > header_bytes && page > 0 ? (capacity - header_bytes) / page : 0;
}

Result<std::string> encode_tier_header(const TierHeader& h) {
  wire::Writer w;
  w.raw(kMagic);
  w.u32(kVersion);
  w.u32(0);  // the length, below
  w.u64(h.sequence);
  for (std::string_view s : {std::string_view(h.cell), std::string_view(h.key), std::string_view(h.token)}) w.bytes(s);
  w.u64(h.size);
  w.bytes(h.checksum);
  w.bytes(h.layout);
  w.bytes(h.epoch);
  w.u64(h.generation);
  w.u32(static_cast<std::uint32_t>(h.runs.size()));
  for (auto [first, count] : h.runs) {
    w.u64(first);
    w.u64(count);
  }
  std::string out = w.take();
  const std::size_t length = out.size() + 8;
  if (length > kMaxTierHeaderBytes) {
    return Status::invalid_argument("tier header of " + std::to_string(length) + " bytes: at most " +
                                    std::to_string(kMaxTierHeaderBytes));
  }
  for (std::size_t i = 0; i < 4; ++i) out[12 + i] = static_cast<char>((length >> (8 * i)) & 0xff);
  const std::uint64_t sum = XXH3_64bits(out.data(), out.size());
  wire::Writer tail;
  tail.u64(sum);
  out += tail.take();
  return out;
}

std::optional<std::pair<TierHeader, std::size_t>> decode_tier_header(std::string_view bytes) {
  if (bytes.size() < kFixed + 8 || bytes.substr(0, kMagic.size()) != kMagic) return std::nullopt;
  wire::Reader fixed(bytes.substr(kMagic.size(), 8));
  const std::uint32_t version = fixed.u32(), length = fixed.u32();
  if (version != kVersion || length < kFixed + 8 || length > kMaxTierHeaderBytes || length > bytes.size()) {
    return std::nullopt;
  }
  wire::Reader sum(bytes.substr(length - 8, 8));
  if (XXH3_64bits(bytes.data(), length - 8) != sum.u64()) return std::nullopt;
  wire::Reader r(bytes.substr(kFixed, length - 8 - kFixed));
  TierHeader h;
  h.sequence = r.u64();
  h.cell = r.bytes();
  h.key = r.bytes();
  h.token = r.bytes();
  h.size = r.u64();
  h.checksum = r.bytes();
  h.layout = r.bytes();
  h.epoch = r.bytes();
  h.generation = r.u64();
  const std::uint32_t runs = r.u32();
  if (!r.ok() || runs > kMaxTierHeaderBytes / 16) return std::nullopt;
  for (std::uint32_t i = 0; i < runs; ++i) {
    const std::uint64_t first = r.u64(), count = r.u64();
    h.runs.emplace_back(first, count);
  }
  if (!r.at_end()) return std::nullopt;
  return std::make_pair(std::move(h), static_cast<std::size_t>(length));
}

HeaderArea::HeaderArea(SsdDevice& device, const TierLayout& layout)
    : device_(device), layout_(layout), used_(layout.header_blocks, 0), in_use_(layout.header_blocks, false) {}

std::uint64_t HeaderArea::used_blocks() const {
  return static_cast<std::uint64_t>(std::count(in_use_.begin(), in_use_.end(), true));
}

std::optional<std::uint64_t> HeaderArea::allocate(std::uint64_t blocks) {
  std::uint64_t run = 0;
  for (std::uint64_t b = 0; b < in_use_.size(); ++b) {
    run = in_use_[b] ? 0 : run + 1;
    if (run == blocks) {
      const std::uint64_t first = b + 1 - blocks;
      for (std::uint64_t i = first; i <= b; ++i) in_use_[i] = true;
      used_[first] = static_cast<std::uint32_t>(blocks);
      return first;
    }
  }
  return std::nullopt;
}

Result<std::vector<std::pair<TierHeader, std::uint64_t>>> HeaderArea::scan(Deadline deadline) {
  const std::uint64_t bs = layout_.block_size, total = layout_.header_blocks;
  const std::uint64_t chunk_blocks = std::max<std::uint64_t>(kReadChunk / bs, blocks_for(kMaxTierHeaderBytes, bs));
  KVSTASH_ASSIGN_OR_RETURN(Buffer buffer, Buffer::allocate(chunk_blocks * bs));
  std::vector<std::pair<TierHeader, std::uint64_t>> found;
  std::fill(in_use_.begin(), in_use_.end(), false);
  std::fill(used_.begin(), used_.end(), 0);
  for (std::uint64_t pos = 0; pos < total;) {
    const std::uint64_t n = std::min(chunk_blocks, total - pos);
    KVSTASH_RETURN_IF_ERROR(device_.run({{.write = false, .offset = layout_.header_offset(pos),
                                          .buffer = buffer.data(), .length = n * bs}},
                                        deadline));
    const std::string_view chunk(reinterpret_cast<const char*>(buffer.data()), n * bs);
    std::uint64_t b = 0;
    while (b < n) {
      const std::string_view at = chunk.substr(b * bs);
      if (at.substr(0, kMagic.size()) != kMagic) {
        ++b;
        continue;
      }
      // A header that runs past this chunk is read again from its start, unless the area ends.
      wire::Reader fixed(at.substr(kMagic.size(), 8));
      fixed.u32();
      const std::uint64_t length = std::min<std::uint64_t>(fixed.u32(), kMaxTierHeaderBytes);
      if (b > 0 && at.size() < length && pos + n < total) break;
      if (auto h = decode_tier_header(at)) {
        const std::uint64_t blocks = blocks_for(h->second, bs);
        for (std::uint64_t i = 0; i < blocks; ++i) in_use_[pos + b + i] = true;
        used_[pos + b] = static_cast<std::uint32_t>(blocks);
        found.emplace_back(std::move(h->first), pos + b);
        b += blocks;
      } else {
        ++b;
      }
    }
    pos += b;
  }
  return found;
}

Result<std::uint64_t> HeaderArea::write(const TierHeader& h, Deadline deadline) {
  KVSTASH_ASSIGN_OR_RETURN(std::string bytes, encode_tier_header(h));
  const std::uint64_t blocks = blocks_for(bytes.size(), layout_.block_size);
  const auto first = allocate(blocks);
  if (!first) {
    return Status::no_space("the tier's header area has no run of " + std::to_string(blocks) + " free blocks");
  }
  auto buffer = Buffer::allocate(blocks * layout_.block_size);
  Status s = buffer.status();
  if (s.is_ok()) {
    std::memset(buffer->data(), 0, buffer->size());
    std::memcpy(buffer->data(), bytes.data(), bytes.size());
    s = device_.run({{.write = true, .offset = layout_.header_offset(*first), .buffer = buffer->data(),
                      .length = buffer->size()}},
                    deadline);
  }
  if (!s.is_ok()) {
    for (std::uint64_t i = 0; i < blocks; ++i) in_use_[*first + i] = false;
    used_[*first] = 0;
    return s;
  }
  return *first;
}

Status HeaderArea::erase(std::uint64_t first, Deadline deadline) {
  if (first >= used_.size() || used_[first] == 0) {
    return Status::not_found("no header at block " + std::to_string(first) + " of the tier's header area");
  }
  KVSTASH_ASSIGN_OR_RETURN(Buffer zero, Buffer::allocate(layout_.block_size));
  std::memset(zero.data(), 0, zero.size());
  KVSTASH_RETURN_IF_ERROR(device_.run(
      {{.write = true, .offset = layout_.header_offset(first), .buffer = zero.data(), .length = zero.size()}},
      deadline));
  for (std::uint64_t i = 0; i < used_[first]; ++i) in_use_[first + i] = false;
  used_[first] = 0;
  return {};
}

}  // namespace kvstash::node

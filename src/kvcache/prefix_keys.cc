// Prefix-chunk keys: a SHA-256 chain over token ids, salted with what changes the bytes.
// The exact bytes hashed are documented in docs/integration.md; keep the two in step.
#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "common/wire.h"
#include "kvstash/kvcache.h"

namespace kvstash {
namespace {

using Digest = std::array<std::uint8_t, 32>;

Digest sha256(std::string_view bytes) {
  Digest d{};
  unsigned int n = 0;
  EVP_Digest(bytes.data(), bytes.size(), d.data(), &n, EVP_sha256(), nullptr);
  return d;
}

// The first `bytes` bytes of `d` in lowercase hex.
std::string hex(const Digest& d, std::size_t bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < bytes; ++i) {
    out.push_back(kHex[d[i] >> 4]);
    out.push_back(kHex[d[i] & 15]);
  }
  return out;
}

// Length-prefixed (u32 little-endian) so that no two option sets serialize alike.
void put_string(wire::Writer& w, std::string_view s) { w.bytes(s); }

// The chain's keys alone, without the ends that name an object's layers and heads.
std::vector<std::string> chain_keys(const KvTokens& tokens, const PrefixKeyOptions& o) {
  std::vector<std::string> keys;
  if (o.chunk_tokens == 0) return keys;
  // A stage's tag counts its layers; the chain hashes the whole model's ("L<layers_total>...").
  // A group's objects differ in layout (a window's layers, a Mamba state): its key's end names
  // its layout, and the chain is every group's.
  std::string tag = o.group.empty() ? o.layout_tag : std::string("groups");
  if (o.group.empty() && o.layers_total != 0 && tag.starts_with('L')) {
    tag.replace(1, std::min(tag.find('.'), tag.size()) - 1, std::to_string(o.layers_total));
  }
  wire::Writer salt;
  salt.raw(std::string_view("kvstash.prefix.v1\0", 18));
  salt.u32(o.chunk_tokens);
  salt.u32(o.heads_total == 0 ? o.tp_rank : 0);  // by heads, as rank 0 of 1: no writer's rank
  salt.u32(o.heads_total == 0 ? o.tp_size : 1);
  put_string(salt, o.model);
  put_string(salt, tag);
  put_string(salt, o.extra);
  Digest h = sha256(salt.take());

  const std::size_t chunks = tokens.ids.size() / o.chunk_tokens;
  keys.reserve(chunks);
  // Every key carries its chain's root (the first chunk's first 64 bits) as its route tag:
  // in a deployment of several cells a chain lives in one (metadata/cell_routes.h).
  std::string root;
  for (std::size_t c = 0; c < chunks; ++c) {
    wire::Writer w;
    w.raw({reinterpret_cast<const char*>(h.data()), h.size()});
    for (std::size_t i = c * o.chunk_tokens; i < (c + 1) * o.chunk_tokens; ++i) w.u32(tokens.ids[i]);
    // A chunk's salt follows its ids, which are of fixed length: no two (ids, salt) pairs
    // hash alike, and a chunk without one hashes as before salts existed.
    if (c < tokens.chunk_salts.size() && !tokens.chunk_salts[c].empty()) {
      w.raw(std::string_view("salt", 4));
      put_string(w, tokens.chunk_salts[c]);
    }
    h = sha256(w.take());
    const std::string name = hex(h, 16);  // 128 bits name a chunk
    if (c == 0) root = name.substr(0, 16);
    std::string key = "kvp:{";
    key.append(root).append("}").append(name);
    keys.push_back(std::move(key));
  }
  return keys;
}

}  // namespace

std::vector<std::string> prefix_object_keys(const KvTokens& tokens, const PrefixKeyOptions& o,
                                            std::uint32_t groups) {
  // The chain is every stage's and every head's (a rank's salt would tie it to its writer); a
  // key's end names its layers and heads.
  std::string layers;
  if (o.layers_total != 0) {
    layers = ":l" + std::to_string(o.layer_first) + "+" + std::to_string(o.layer_count) + "/" +
             std::to_string(o.layers_total);
  }
  if (!o.group.empty()) layers.append(":g").append(o.group).append(".").append(hex(sha256(o.layout_tag), 4));
  std::vector<std::string> ends;
  for (std::uint32_t g = 0; g < std::max(groups, 1u); ++g) {
    ends.push_back(layers);
    if (o.heads_total == 0) continue;
    ends.back().append(":h" + std::to_string(o.head_first + g * o.head_count) + "+" +
                       std::to_string(o.head_count) + "/" + std::to_string(o.heads_total));
  }
  std::vector<std::string> keys;
  for (const std::string& chain : chain_keys(tokens, o)) {
    for (const std::string& end : ends) keys.push_back(chain + end);
  }
  return keys;
}

std::vector<std::string> prefix_chunk_keys(const KvTokens& tokens, const PrefixKeyOptions& o) {
  return prefix_object_keys(tokens, o, 1);
}

}  // namespace kvstash

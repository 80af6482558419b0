// KV-cache shapes, layouts (where each layer, part and block lives; runs of memory) and
// prefix-chunk keys. Pure logic: no store, no processes.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <set>
#include <vector>

#include "kvstash/kvcache.h"

namespace kvstash {
namespace {

KvCacheShape llama7b(std::uint32_t blocks = 64) {
  return {.num_layers = 32, .num_blocks = blocks, .block_size = 16, .num_kv_heads = 32, .head_dim = 128};
}

TEST(KvShape, BytesPerTokenIsTheKvArithmetic) {
  EXPECT_EQ(llama7b().bytes_per_token(), 524288u) << "Llama-2-7B fp16: 2 x 32 x 32 x 128 x 2";
  EXPECT_EQ(llama7b().block_bytes(), 16u * 32 * 128 * 2);
  KvCacheShape gqa = llama7b();
  gqa.num_kv_heads = 8;
  gqa.dtype = KvDType::kInt8;
  EXPECT_EQ(gqa.bytes_per_token(), 2u * 32 * 8 * 128);
  KvCacheShape mla{.num_layers = 61,
                   .num_blocks = 8,
                   .block_size = 64,
                   .num_kv_heads = 1,
                   .head_dim = 576,
                   .dtype = KvDType::kBFloat16,
                   .mla = true};
  EXPECT_EQ(mla.bytes_per_token(), 61u * 576 * 2) << "MLA: one latent, no K/V split";
  EXPECT_TRUE(mla.validate().is_ok());
  mla.num_kv_heads = 4;
  EXPECT_EQ(mla.validate().code(), StatusCode::kInvalidArgument);
  KvCacheShape zero = llama7b();
  zero.head_dim = 0;
  EXPECT_NE(zero.validate().message().find("head_dim"), std::string::npos);
  KvCacheShape huge = llama7b(~0u);
  huge.head_dim = ~0u;
  EXPECT_EQ(huge.validate().code(), StatusCode::kInvalidArgument) << "overflow";
}

TEST(KvShape, DTypesParseAndPrint) {
  for (KvDType t : {KvDType::kFloat16, KvDType::kBFloat16, KvDType::kFloat32, KvDType::kFloat8E4M3,
                    KvDType::kFloat8E5M2, KvDType::kInt8}) {
    EXPECT_EQ(parse_kv_dtype(to_string(t)), t);
  }
  EXPECT_EQ(parse_kv_dtype("fp8"), KvDType::kFloat8E4M3);
  EXPECT_FALSE(parse_kv_dtype("fp12"));
  EXPECT_EQ(dtype_bytes(KvDType::kFloat32), 4u);
}

// vLLM's per-layer (2, num_blocks, ...) tensors in host memory.
struct PerLayer {
  explicit PerLayer(const KvCacheShape& s) : shape(s), storage(s.num_layers) {
    for (auto& t : storage) {
      t.resize(2 * s.num_blocks * s.block_bytes());
      ptrs.push_back(t.data());
    }
  }
  KvCacheShape shape;
  std::vector<std::vector<std::byte>> storage;
  std::vector<void*> ptrs;
};

TEST(KvLayout, PerLayerMapsBlocksAndMergesNeighbours) {
  KvCacheShape shape{.num_layers = 2, .num_blocks = 10, .block_size = 4, .num_kv_heads = 2, .head_dim = 8};
  PerLayer t(shape);
  auto layout = KvLayout::per_layer(shape, t.ptrs);
  ASSERT_TRUE(layout.is_ok()) << layout.status().to_string();
  const std::uint64_t bb = shape.block_bytes();
  ASSERT_EQ(layout->regions().size(), 2u);
  EXPECT_EQ(layout->regions()[1].addr, t.ptrs[1]);
  EXPECT_EQ(layout->regions()[1].length, 2 * 10 * bb);

  // Scattered blocks: K of each, then V of each, in the given order, one run per block.
  std::vector<KvRun> runs;
  const std::uint32_t scattered[] = {7, 2, 5};
  ASSERT_TRUE(layout->layer_runs(1, scattered, runs).is_ok());
  ASSERT_EQ(runs.size(), 6u);
  auto* base = static_cast<std::byte*>(t.ptrs[1]);
  EXPECT_EQ(runs[0].addr, base + 7 * bb);
  EXPECT_EQ(runs[1].addr, base + 2 * bb);
  EXPECT_EQ(runs[3].addr, base + 10 * bb + 7 * bb) << "V of block 7: past the 10 K blocks";
  EXPECT_EQ(runs[5].region, 1u);
  for (const auto& r : runs) EXPECT_EQ(r.length, bb);

  // Contiguous blocks coalesce: 3,4,5,6 is one K run and one V run.
  runs.clear();
  const std::uint32_t contiguous[] = {3, 4, 5, 6};
  ASSERT_TRUE(layout->layer_runs(0, contiguous, runs).is_ok());
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].length, 4 * bb);
  EXPECT_EQ(runs[1].addr, static_cast<std::byte*>(t.ptrs[0]) + 13 * bb);
  // The whole cache in order: K and V meet in the middle, so one run per layer.
  runs.clear();
  std::vector<std::uint32_t> all(10);
  std::iota(all.begin(), all.end(), 0u);
  ASSERT_TRUE(layout->layer_runs(0, all, runs).is_ok());
  EXPECT_EQ(runs.size(), 1u);
  EXPECT_EQ(layout->layer_bytes(4), 2 * 4 * bb);

  // Out of range.
  const std::uint32_t bad[] = {10};
  EXPECT_EQ(layout->layer_runs(0, bad, runs).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(layout->layer_runs(2, contiguous, runs).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(KvLayout::per_layer(shape, std::span<void* const>(t.ptrs).first(1)).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(KvLayout, BlocksFirstAndCrossLayerPutABlocksPartsTogether) {
  KvCacheShape shape{.num_layers = 3, .num_blocks = 6, .block_size = 2, .num_kv_heads = 1, .head_dim = 4};
  const std::uint64_t bb = shape.block_bytes();
  PerLayer t(shape);
  auto bf = KvLayout::per_layer_blocks_first(shape, t.ptrs);
  ASSERT_TRUE(bf.is_ok()) << bf.status().to_string();
  std::vector<KvRun> runs;
  const std::uint32_t one[] = {4};
  ASSERT_TRUE(bf->layer_runs(2, one, runs).is_ok());
  // (num_blocks, 2, ...): K of block 4 then V of block 4, adjacent: one run.
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].addr, static_cast<std::byte*>(t.ptrs[2]) + 4 * 2 * bb);
  EXPECT_EQ(runs[0].length, 2 * bb);

  std::vector<std::byte> region(shape.num_blocks * shape.num_layers * 2 * bb);
  auto cross = KvLayout::cross_layer(shape, region.data());
  ASSERT_TRUE(cross.is_ok()) << cross.status().to_string();
  ASSERT_EQ(cross->regions().size(), 1u);
  runs.clear();
  const std::uint32_t two[] = {1, 2};
  ASSERT_TRUE(cross->layer_runs(1, two, runs).is_ok());
  // (num_blocks, num_layers, 2, ...): block 1 of layer 1 starts at 1 * (3 layers x 2 parts) + 1 x 2 parts.
  ASSERT_EQ(runs.size(), 4u) << "K1 K2 V1 V2: none adjacent";
  EXPECT_EQ(runs[0].addr, region.data() + (1 * 6 + 2) * bb);
  EXPECT_EQ(runs[2].addr, region.data() + (1 * 6 + 2 + 1) * bb);
  EXPECT_EQ(runs[0].region, 0u);
}

TEST(KvLayout, CustomStridesAreChecked) {
  KvCacheShape shape{.num_layers = 1, .num_blocks = 4, .block_size = 1, .num_kv_heads = 1, .head_dim = 8};
  const std::uint64_t bb = shape.block_bytes();
  std::vector<std::byte> mem(8 * bb);
  std::vector<MemoryRegion> regions{{mem.data(), mem.size()}};
  EXPECT_TRUE(KvLayout::custom(shape, {mem.data()}, 4 * bb, bb, regions).is_ok());
  EXPECT_EQ(KvLayout::custom(shape, {mem.data()}, 2 * bb, bb, regions).status().code(),
            StatusCode::kInvalidArgument)
      << "V of block 0 would be K of block 2";
  EXPECT_EQ(KvLayout::custom(shape, {mem.data() + bb}, 4 * bb, bb, regions).status().code(),
            StatusCode::kInvalidArgument)
      << "the last V block would run past the region";
  EXPECT_EQ(KvLayout::custom(shape, {mem.data()}, 4 * bb, bb, {}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(KvLayout, TagNamesEverythingThatChangesTheBytes) {
  PerLayer t(llama7b(4));
  auto nhd = KvLayout::per_layer(llama7b(4), t.ptrs).value();
  EXPECT_EQ(nhd.tag(), "L32.P2.H32.D128.B16.fp16.nhd");
  KvCacheShape hnd = llama7b(4);
  hnd.order = KvBlockOrder::kHND;
  EXPECT_EQ(KvLayout::per_layer(hnd, t.ptrs).value().tag(), "L32.P2.H32.D128.B16.fp16.hnd");
  // The block count is not in the tag: it does not change a block's bytes.
  EXPECT_EQ(KvLayout::per_layer(llama7b(8), PerLayer(llama7b(8)).ptrs).value().tag(), nhd.tag());
}

std::vector<std::uint32_t> tokens(std::size_t n) {
  std::vector<std::uint32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::uint32_t>((i * 2654435761u) % 32000);
  return t;
}

TEST(PrefixKeys, MatchAnIndependentImplementation) {
  // Computed with Python's hashlib from the format in docs/integration.md, not by this code.
  PrefixKeyOptions o{.model = "llama-2-7b", .layout_tag = "L32.P2.H32.D128.B16.fp16.nhd"};
  EXPECT_EQ(prefix_chunk_keys(tokens(600), o),
            (std::vector<std::string>{"kvp:{e740a556427b33dc}e740a556427b33dcee847a1a9eb8b03e",
                                      "kvp:{e740a556427b33dc}c46d0cf85be09926f252341fa4c827bb"}));
  std::vector<std::uint32_t> eight(8);
  std::iota(eight.begin(), eight.end(), 0u);
  PrefixKeyOptions p{
      .model = "m", .layout_tag = "t", .tp_rank = 1, .tp_size = 2, .chunk_tokens = 4, .extra = "lora:x"};
  EXPECT_EQ(prefix_chunk_keys(eight, p),
            (std::vector<std::string>{"kvp:{a4682b65c40bf75d}a4682b65c40bf75d011b8dafa989ef91",
                                      "kvp:{a4682b65c40bf75d}f137426bc29ab7694e09d2cd1caceb2b"}));
}

TEST(PrefixKeys, ChainOverEveryEarlierTokenAndSaltedByEveryOption) {
  PrefixKeyOptions o{.model = "llama-2-7b", .layout_tag = "L32.P2.H32.D128.B16.fp16.nhd", .chunk_tokens = 16};
  auto t = tokens(64);
  const auto base = prefix_chunk_keys(t, o);
  ASSERT_EQ(base.size(), 4u);
  EXPECT_EQ(prefix_chunk_keys(std::span(t).first(63), o).size(), 3u) << "a partial chunk has no key";
  EXPECT_EQ(prefix_chunk_keys(std::span(t).first(48), o),
            std::vector<std::string>(base.begin(), base.begin() + 3))
      << "later tokens do not change earlier keys";
  // A token changed in chunk 1 changes chunks 1.. and leaves chunk 0.
  auto changed = t;
  changed[20] ^= 1;
  auto k = prefix_chunk_keys(changed, o);
  EXPECT_EQ(k[0], base[0]);
  for (std::size_t i = 1; i < 4; ++i) EXPECT_NE(k[i], base[i]) << i;
  // Every salt changes every key.
  auto differs = [&](PrefixKeyOptions v) {
    auto kv = prefix_chunk_keys(t, v);
    for (std::size_t i = 0; i < 4; ++i) {
      if (kv[i] == base[i]) return false;
    }
    return true;
  };
  auto v = o;
  v.model = "llama-2-7b-chat";
  EXPECT_TRUE(differs(v)) << "model";
  v = o;
  v.layout_tag = "L32.P2.H32.D128.B16.fp16.hnd";
  EXPECT_TRUE(differs(v)) << "layout";
  v = o;
  v.tp_rank = 1;
  v.tp_size = 2;
  EXPECT_TRUE(differs(v)) << "tensor-parallel rank";
  v = o;
  v.extra = "lora:7";
  EXPECT_TRUE(differs(v)) << "extra";
  // Length prefixes keep fields apart: "ab"+"c" is not "a"+"bc".
  auto a = o, b = o;
  a.model = "ab";
  a.extra = "c";
  b.model = "a";
  b.extra = "bc";
  EXPECT_NE(prefix_chunk_keys(t, a)[0], prefix_chunk_keys(t, b)[0]);
  // Every key distinct, well formed.
  std::set<std::string> unique(base.begin(), base.end());
  EXPECT_EQ(unique.size(), 4u);
  for (const auto& key : base) {
    EXPECT_EQ(key.size(), 54u);
    // The chain's root, in braces: its route tag, the same for every chunk of the chain.
    EXPECT_EQ(key.substr(0, 22), "kvp:{" + base[0].substr(22, 16) + "}");
  }
  EXPECT_TRUE(prefix_chunk_keys(t, {.model = "m", .chunk_tokens = 0}).empty());
}

TEST(PrefixKeys, ChunkSaltsNameWhatTheTokensDoNot) {
  // Two requests with the same ids whose KV differs (an image behind the same placeholder
  // tokens, other prompt embeddings) share no chunk from the first one their inputs differ in.
  PrefixKeyOptions o{.model = "llama-2-7b", .layout_tag = "L32.P2.H32.D128.B16.fp16.nhd", .chunk_tokens = 16};
  auto t = tokens(64);
  const auto plain = prefix_chunk_keys(t, o);
  const std::vector<std::string> cat{"", "image:cat@3+20"}, dog{"", "image:dog@3+20"};
  const auto with_cat = prefix_chunk_keys(KvTokens(t, cat), o);
  const auto with_dog = prefix_chunk_keys(KvTokens(t, dog), o);
  ASSERT_EQ(with_cat.size(), 4u);
  EXPECT_EQ(with_cat[0], plain[0]) << "a chunk before the salted one keeps its key";
  for (std::size_t i = 1; i < 4; ++i) {
    EXPECT_NE(with_cat[i], plain[i]) << "the salted chunk and every later one: " << i;
    EXPECT_NE(with_cat[i], with_dog[i]) << i;
  }
  EXPECT_EQ(with_cat[0].substr(0, 22), plain[0].substr(0, 22)) << "one chain, one route tag";
  // An empty salt, or none, is no salt; salts past the tokens' chunks are not read.
  const std::vector<std::string> empty(4), longer{"", "image:cat@3+20", "", "", "x", "y"};
  EXPECT_EQ(prefix_chunk_keys(KvTokens(t, empty), o), plain);
  EXPECT_EQ(prefix_chunk_keys(KvTokens(t, longer), o), with_cat);
  // A salt is length-prefixed after ids of fixed length: ids and salt cannot trade bytes.
  const std::vector<std::string> zero{std::string(4, '\0')};
  EXPECT_NE(prefix_chunk_keys(KvTokens(t, zero), o)[0], plain[0]);
  // Computed with Python's hashlib from the format in docs/integration.md, not by this code.
  std::vector<std::uint32_t> eight(8);
  std::iota(eight.begin(), eight.end(), 0u);
  PrefixKeyOptions p{
      .model = "m", .layout_tag = "t", .tp_rank = 1, .tp_size = 2, .chunk_tokens = 4, .extra = "lora:x"};
  const std::vector<std::string> salts{"", std::string("img:\x01\x02", 6)};
  EXPECT_EQ(prefix_chunk_keys(KvTokens(eight, salts), p),
            (std::vector<std::string>{"kvp:{a4682b65c40bf75d}a4682b65c40bf75d011b8dafa989ef91",
                                      "kvp:{a4682b65c40bf75d}d6d1af138cb3f191b9ace3333ce2f6c8"}));
}

}  // namespace
}  // namespace kvstash

// KV-cache shapes and layouts: where each (layer, part, block) lives, and the runs of memory
// a list of blocks is made of.
#include <algorithm>
#include <limits>

#include "kvstash/kvcache.h"

namespace kvstash {
namespace {

constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();

// a * b, or nullopt on overflow.
std::optional<std::uint64_t> mul(std::uint64_t a, std::uint64_t b) {
  if (a != 0 && b > kMax / a) return std::nullopt;
  return a * b;
}

Status invalid(std::string what) { return Status::invalid_argument("kv layout: " + what); }

}  // namespace

std::size_t dtype_bytes(KvDType t) {
  switch (t) {
    case KvDType::kFloat16:
    case KvDType::kBFloat16: return 2;
    case KvDType::kFloat32: return 4;
    case KvDType::kFloat8E4M3:
    case KvDType::kFloat8E5M2:
    case KvDType::kInt8: return 1;
  }
  return 0;
}

std::string_view to_string(KvDType t) {
  switch (t) {
    case KvDType::kFloat16: return "fp16";
    case KvDType::kBFloat16: return "bf16";
    case KvDType::kFloat32: return "fp32";
    case KvDType::kFloat8E4M3: return "fp8_e4m3";
    case KvDType::kFloat8E5M2: return "fp8_e5m2";
    case KvDType::kInt8: return "int8";
  }
  return "?";
}

std::optional<KvDType> parse_kv_dtype(std::string_view s) {
  for (KvDType t : {KvDType::kFloat16, KvDType::kBFloat16, KvDType::kFloat32, KvDType::kFloat8E4M3,
                    KvDType::kFloat8E5M2, KvDType::kInt8}) {
    if (s == to_string(t)) return t;
  }
  if (s == "fp8") return KvDType::kFloat8E4M3;
  return std::nullopt;
}

std::uint64_t KvCacheShape::block_bytes() const {
  return std::uint64_t{block_size} * (mla ? 1 : num_kv_heads) * head_dim * dtype_bytes(dtype);
}

std::uint64_t KvCacheShape::bytes_per_token() const {
  return std::uint64_t{parts()} * num_layers * (mla ? 1 : num_kv_heads) * head_dim * dtype_bytes(dtype);
}

Status KvCacheShape::validate() const {
  const std::pair<const char*, std::uint32_t> dims[] = {{"num_layers", num_layers},
                                                        {"num_blocks", num_blocks},
                                                        {"block_size", block_size},
                                                        {"num_kv_heads", num_kv_heads},
                                                        {"head_dim", head_dim}};
  for (const auto& [name, v] : dims) {
    if (v == 0) return invalid(std::string(name) + " is 0");
  }
  if (dtype_bytes(dtype) == 0) return invalid("unknown dtype");
  if (mla && num_kv_heads != 1) return invalid("an MLA cache has one latent head (num_kv_heads = 1)");
  if (mla && joint_kv) return invalid("an MLA cache has no K and V to keep side by side (joint_kv)");
  // A whole layer must be addressable.
  auto layer = mul(block_bytes(), std::uint64_t{num_blocks});
  if (!layer || !mul(*layer, std::uint64_t{parts()} * num_layers))
    return invalid("the cache's size overflows");
  return {};
}

namespace {

// One tensor per layer, each holding every part of every block: `part_stride` and
// `block_stride` say how (kv-first or blocks-first).
Result<KvLayout> one_tensor_per_layer(const KvCacheShape& shape, std::span<void* const> layer_tensors,
                                      MemoryKind kind, std::uint64_t part_stride,
                                      std::uint64_t block_stride) {
  KVSTASH_RETURN_IF_ERROR(shape.validate());
  if (layer_tensors.size() != shape.num_layers) {
    return invalid(std::to_string(layer_tensors.size()) + " layer tensors for " +
                   std::to_string(shape.num_layers) + " layers");
  }
  const auto tensor_bytes = static_cast<std::size_t>(shape.parts() * shape.num_blocks * shape.block_bytes());
  std::vector<std::byte*> bases;
  std::vector<MemoryRegion> regions;
  for (void* t : layer_tensors) {
    bases.push_back(static_cast<std::byte*>(t));
    regions.push_back({t, tensor_bytes, kind});
  }
  return KvLayout::custom(shape, std::move(bases), part_stride, block_stride, std::move(regions));
}

}  // namespace

Result<KvLayout> KvLayout::per_layer(const KvCacheShape& shape, std::span<void* const> layer_tensors,
                                     MemoryKind memory_kind) {
  const std::uint64_t bb = shape.block_bytes();
  return one_tensor_per_layer(shape, layer_tensors, memory_kind, shape.num_blocks * bb, bb);
}

Result<KvLayout> KvLayout::per_layer_blocks_first(const KvCacheShape& shape,
                                                  std::span<void* const> layer_tensors,
                                                  MemoryKind memory_kind) {
  const std::uint64_t bb = shape.block_bytes();
  return one_tensor_per_layer(shape, layer_tensors, memory_kind, bb, shape.parts() * bb);
}

Result<KvLayout> KvLayout::cross_layer(const KvCacheShape& shape, void* base, MemoryKind memory_kind) {
  KVSTASH_RETURN_IF_ERROR(shape.validate());
  const std::uint64_t bb = shape.block_bytes();
  const std::uint64_t per_layer = shape.parts() * bb;  // one block of one layer, every part
  const std::uint64_t block_stride = per_layer * shape.num_layers;
  std::vector<std::byte*> bases;
  for (std::uint32_t l = 0; l < shape.num_layers; ++l)
    bases.push_back(static_cast<std::byte*>(base) + l * per_layer);
  std::vector<MemoryRegion> regions{
      {base, static_cast<std::size_t>(block_stride * shape.num_blocks), memory_kind}};
  return custom(shape, std::move(bases), bb, block_stride, std::move(regions));
}

Result<KvLayout> KvLayout::custom(const KvCacheShape& shape, std::vector<std::byte*> layer_base,
                                  std::uint64_t part_stride, std::uint64_t block_stride,
                                  std::vector<MemoryRegion> regions) {
  KVSTASH_RETURN_IF_ERROR(shape.validate());
  if (layer_base.size() != shape.num_layers) return invalid("one base address per layer");
  if (regions.empty()) return invalid("no memory regions");
  const std::uint64_t bb = shape.block_bytes();
  const std::uint64_t n = shape.num_blocks;
  // Blocks of one layer must not overlap: either parts apart by whole block arrays
  // (kv-first) or blocks apart by every part (blocks-first). MLA: blocks at least a block apart.
  const bool kv_first =
      block_stride >= bb && (shape.parts() == 1 || part_stride >= (n - 1) * block_stride + bb);
  const bool blocks_first = shape.parts() > 1 && part_stride >= bb && block_stride >= part_stride + bb;
  if (!kv_first && !blocks_first) return invalid("the strides make blocks overlap");
  const auto span = mul(n - 1, block_stride);
  if (!span) return invalid("the strides overflow");
  const std::uint64_t layer_extent = (shape.parts() - 1) * part_stride + *span + bb;

  KvLayout out;
  out.shape_ = shape;
  out.part_stride_ = part_stride;
  out.block_stride_ = block_stride;
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    const auto lo = reinterpret_cast<std::uintptr_t>(layer_base[l]);
    std::optional<std::uint32_t> found;
    for (std::uint32_t r = 0; r < regions.size(); ++r) {
      const auto rlo = reinterpret_cast<std::uintptr_t>(regions[r].addr);
      if (regions[r].addr != nullptr && lo >= rlo && lo - rlo <= regions[r].length &&
          layer_extent <= regions[r].length - (lo - rlo)) {
        found = r;
        break;
      }
    }
    if (!found) return invalid("layer " + std::to_string(l) + "'s blocks are not inside one of the regions");
    out.layer_region_.push_back(*found);
  }
  out.layer_base_ = std::move(layer_base);
  out.regions_ = std::move(regions);
  return out;
}

Result<KvLayout> KvLayout::heads(std::uint32_t first, std::uint32_t count) const {
  if (shape_.mla) return invalid("an MLA cache has no heads to divide");
  if (is_head_view()) return invalid("a view of some heads is not divided again");
  if (count == 0 || first >= shape_.num_kv_heads || count > shape_.num_kv_heads - first) {
    return invalid("heads [" + std::to_string(first) + ", +" + std::to_string(count) + ") of " +
                   std::to_string(shape_.num_kv_heads));
  }
  KvLayout view = *this;
  view.shape_.num_kv_heads = count;
  view.tensor_heads_ = shape_.num_kv_heads;
  view.head_first_ = first;
  return view;
}

Status KvLayout::layer_runs(std::uint32_t layer, std::span<const std::uint32_t> blocks,
                            std::vector<KvRun>& out) const {
  if (layer >= shape_.num_layers) return invalid("layer " + std::to_string(layer) + " out of range");
  for (std::uint32_t b : blocks) {
    if (b >= shape_.num_blocks) return invalid("block id " + std::to_string(b) + " out of range");
  }
  const std::uint32_t region = layer_region_[layer];
  const std::size_t first = out.size();
  // Appends `n` bytes at `addr`, merged with the run before when it ends there.
  auto add = [&](std::byte* addr, std::uint64_t n) {
    if (out.size() > first && out.back().addr + out.back().length == addr) {
      out.back().length += n;
    } else {
      out.push_back({addr, n, region});
    }
  };
  // Of each block, the heads this layout holds: the whole block, one run of the block (HND:
  // heads outermost), or one run per token (NHD: heads within each token).
  const std::uint64_t head_bytes = std::uint64_t{shape_.head_dim} * dtype_bytes(shape_.dtype);
  const bool whole = !is_head_view() || shape_.num_kv_heads == tensor_heads_;
  for (std::uint32_t p = 0; p < shape_.parts(); ++p) {
    for (std::uint32_t b : blocks) {
      std::byte* block = layer_base_[layer] + p * part_stride_ + b * block_stride_;
      if (whole) {
        add(block, shape_.block_bytes());
      } else if (shape_.order == KvBlockOrder::kHND) {
        add(block + head_first_ * shape_.block_size * head_bytes, shape_.block_bytes());
      } else {
        for (std::uint32_t t = 0; t < shape_.block_size; ++t)
          add(block + (std::uint64_t{t} * tensor_heads_ + head_first_) * head_bytes,
              shape_.num_kv_heads * head_bytes);
      }
    }
  }
  return {};
}

std::string KvLayout::tag() const {
  std::string t = "L";
  t.append(std::to_string(shape_.num_layers))
      .append(".P")
      .append(std::to_string(shape_.parts()))
      .append(".H")
      .append(std::to_string(shape_.num_kv_heads))
      .append(".D")
      .append(std::to_string(shape_.head_dim))
      .append(".B")
      .append(std::to_string(shape_.block_size))
      .append(".")
      .append(to_string(shape_.dtype))
      .append(shape_.order == KvBlockOrder::kNHD ? ".nhd" : ".hnd");
  return t;
}

}  // namespace kvstash

// KvCache: a request's chunks saved to and loaded from the store, one object per chunk.
#include <future>

#include "kvstash/engine.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"

namespace kvstash {

struct KvCache::Impl {
  Store* store = nullptr;
  KvLayout layout;
  PrefixKeyOptions keys;
  std::vector<MemoryHandle> handles;  // one per layout region
  std::uint32_t blocks_per_chunk = 0;

  // The slices of one chunk's object: every layer of `blocks`, in object order.
  Result<std::vector<Slice>> chunk_slices(std::span<const std::uint32_t> blocks) const {
    std::vector<KvRun> runs;
    for (std::uint32_t l = 0; l < layout.shape().num_layers; ++l) {
      KVSTASH_RETURN_IF_ERROR(layout.layer_runs(l, blocks, runs));
    }
    std::vector<Slice> slices;
    slices.reserve(runs.size());
    for (const KvRun& r : runs)
      slices.push_back({r.addr, static_cast<std::size_t>(r.length), &handles[r.region]});
    return slices;
  }

  // Checks that `tokens` and `block_ids` cover chunks [first, first + count).
  Status covers(std::span<const std::uint32_t> tokens, std::span<const std::uint32_t> block_ids,
                std::size_t first, std::size_t count) const {
    const std::size_t end = first + count;
    if (tokens.size() < end * keys.chunk_tokens) {
      return Status::invalid_argument("kvcache: " + std::to_string(tokens.size()) + " tokens do not cover " +
                                      std::to_string(end) + " chunks of " +
                                      std::to_string(keys.chunk_tokens));
    }
    if (block_ids.size() < end * blocks_per_chunk) {
      return Status::invalid_argument("kvcache: " + std::to_string(block_ids.size()) +
                                      " block ids do not cover " + std::to_string(end) + " chunks of " +
                                      std::to_string(blocks_per_chunk) + " blocks");
    }
    return {};
  }
};

KvCache::KvCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvCache::~KvCache() = default;

Result<std::unique_ptr<KvCache>> KvCache::open(Store& store, KvLayout layout, PrefixKeyOptions keys) {
  const std::uint32_t bs = layout.shape().block_size;
  if (keys.chunk_tokens == 0 || keys.chunk_tokens % bs != 0) {
    return Status::invalid_argument("kvcache: chunk_tokens (" + std::to_string(keys.chunk_tokens) +
                                    ") must be a positive multiple of the block size (" + std::to_string(bs) +
                                    ")");
  }
  if (keys.model.empty()) return Status::invalid_argument("kvcache: the model name salts every key: set it");
  if (keys.tp_size == 0 || keys.tp_rank >= keys.tp_size) {
    return Status::invalid_argument("kvcache: tp_rank must be below tp_size");
  }
  auto impl = std::make_unique<Impl>();
  impl->store = &store;
  keys.layout_tag = layout.tag();
  impl->keys = std::move(keys);
  impl->blocks_per_chunk = impl->keys.chunk_tokens / bs;
  for (const MemoryRegion& r : layout.regions()) {
    auto h = store.register_memory(r);
    if (!h.is_ok()) return h.status().with_context("kvcache: registering the KV cache");
    impl->handles.push_back(std::move(h).value());
  }
  impl->layout = std::move(layout);
  return std::unique_ptr<KvCache>(new KvCache(std::move(impl)));
}

const KvLayout& KvCache::layout() const { return impl_->layout; }
const PrefixKeyOptions& KvCache::key_options() const { return impl_->keys; }

std::vector<std::string> KvCache::keys(std::span<const std::uint32_t> tokens) const {
  return prefix_chunk_keys(tokens, impl_->keys);
}

std::uint64_t KvCache::chunk_bytes() const {
  return impl_->layout.layer_bytes(impl_->blocks_per_chunk) * impl_->layout.shape().num_layers;
}

Result<std::size_t> KvCache::contains_prefix(std::span<const std::uint32_t> tokens,
                                             std::optional<Deadline> deadline) {
  auto k = keys(tokens);
  if (k.empty()) return std::size_t{0};
  return impl_->store->contains_prefix(k, deadline);
}

std::vector<Status> KvCache::save(std::span<const std::uint32_t> tokens,
                                  std::span<const std::uint32_t> block_ids, std::size_t first,
                                  std::size_t count, std::optional<Deadline> deadline) {
  if (Status s = impl_->covers(tokens, block_ids, first, count); !s.is_ok())
    return std::vector<Status>(count, s);
  const auto k = keys(tokens.first((first + count) * impl_->keys.chunk_tokens));
  std::vector<Status> out(count);
  std::vector<std::pair<std::size_t, std::future<Status>>> pending;
  const std::string tag = impl_->keys.layout_tag;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t c = first + i;
    auto slices =
        impl_->chunk_slices(block_ids.subspan(c * impl_->blocks_per_chunk, impl_->blocks_per_chunk));
    if (!slices.is_ok()) {
      out[i] = slices.status();
      continue;
    }
    PutOptions po;
    po.layout = tag;
    po.deadline = deadline;
    pending.emplace_back(i, impl_->store->put_async(k[c], std::move(slices).value(), std::move(po)));
  }
  for (auto& [i, f] : pending) out[i] = f.get();
  return out;
}

std::vector<Status> KvCache::load(std::span<const std::uint32_t> tokens,
                                  std::span<const std::uint32_t> block_ids, std::size_t count,
                                  std::optional<Deadline> deadline) {
  if (Status s = impl_->covers(tokens, block_ids, 0, count); !s.is_ok()) return std::vector<Status>(count, s);
  const auto k = keys(tokens.first(count * impl_->keys.chunk_tokens));
  std::vector<Status> out(count);
  std::vector<std::pair<std::size_t, std::future<Result<ObjectInfo>>>> pending;
  for (std::size_t c = 0; c < count; ++c) {
    auto slices =
        impl_->chunk_slices(block_ids.subspan(c * impl_->blocks_per_chunk, impl_->blocks_per_chunk));
    if (!slices.is_ok()) {
      out[c] = slices.status();
      continue;
    }
    pending.emplace_back(c, impl_->store->get_async(k[c], std::move(slices).value(), {.deadline = deadline}));
  }
  for (auto& [c, f] : pending) {
    auto r = f.get();
    if (!r.is_ok()) {
      out[c] = r.status();
    } else if (r->layout != impl_->keys.layout_tag || r->size != chunk_bytes()) {
      // Same key, other bytes: a foreign writer, or a bug. Never hand such bytes to a model.
      out[c] = Status::corrupt("kvcache: chunk " + std::to_string(c) + " was stored with layout '" +
                               r->layout + "' and " + std::to_string(r->size) + " bytes, expected '" +
                               impl_->keys.layout_tag + "' and " + std::to_string(chunk_bytes()));
    }
  }
  return out;
}

}  // namespace kvstash

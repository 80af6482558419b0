// KvCache: a request's chunks saved to and loaded from the store, one object per chunk (keys
// by heads: one per group of heads, each saved and loaded as a unit), layer by layer. This file opens a cache
// (its options and keys checked, its data path chosen: data_path.cc), finds the CUDA device of GPU memory,
// and starts saves and loads: their state machines are kv_save.cc and kv_load.cc.
#include <cctype>
#include <chrono>
#include <thread>

#include "common/log.h"
#include "kvcache/data_path.h"
#include "kvcache/kv_cache_internal.h"

#if KVSTASH_HAVE_CUDA_KERNELS
#include "kvcache/cuda/cuda_device.h"
#endif

namespace kvstash {

Result<std::shared_ptr<KvDevice>> cuda_device(int gpu) {
#if KVSTASH_HAVE_CUDA_KERNELS
  return cuda::cuda_device(gpu);
#else
  (void)gpu;
  return Status::unsupported("kvcache: this build has no CUDA kernels");
#endif
}

Result<std::shared_ptr<KvDevice>> cuda_device_of(const KvLayout& layout) {
#if KVSTASH_HAVE_CUDA_KERNELS
  if (layout.regions().empty()) return Status::invalid_argument("kvcache: the layout has no memory");
  KVSTASH_ASSIGN_OR_RETURN(const int gpu, cuda::device_of(layout.regions().front().addr));
  return cuda_device(gpu);
#else
  (void)layout;
  return Status::unsupported("kvcache: this build has no CUDA kernels");
#endif
}

Status kvcache::split_by_heads(const KvLayout& layout, const PrefixKeyOptions& keys,
                               std::vector<KvLayout>& objects) {
  if (keys.heads_total == 0) {
    if (keys.head_first != 0 || keys.head_count != 0)
      return Status::invalid_argument("kvcache: head_first and head_count name heads of heads_total: set it");
    objects = {layout};
    return {};
  }
  const KvCacheShape& shape = layout.shape();
  const std::uint32_t heads = shape.num_kv_heads;
  if (shape.mla) return Status::invalid_argument("kvcache: an MLA cache has one latent, not heads to key by");
  if (keys.tp_rank != 0 || keys.tp_size != 1)
    return Status::invalid_argument("kvcache: keys by heads name no rank (tp_rank 0, tp_size 1)");
  if (keys.head_count == 0 || heads % keys.head_count != 0) {
    return Status::invalid_argument("kvcache: " + std::to_string(keys.head_count) +
                                    " heads per object do not divide the cache's " + std::to_string(heads) +
                                    " heads");
  }
  if (keys.head_first > keys.heads_total || heads > keys.heads_total - keys.head_first) {
    return Status::invalid_argument("kvcache: the cache's " + std::to_string(heads) + " heads from head " +
                                    std::to_string(keys.head_first) + " on are not among the model's " +
                                    std::to_string(keys.heads_total));
  }
  objects.clear();
  for (std::uint32_t h = 0; h < heads; h += keys.head_count) {
    KVSTASH_ASSIGN_OR_RETURN(KvLayout view, layout.heads(h, keys.head_count));
    objects.push_back(std::move(view));
  }
  return {};
}

std::vector<Status> kvcache::fold_objects(const std::vector<Status>& objects, std::size_t per_chunk) {
  std::vector<Status> out;
  for (std::size_t u = 0; u < objects.size(); ++u) {
    if (u % per_chunk == 0) {
      out.push_back(objects[u]);
    } else if (out.back().is_ok()) {
      out.back() = objects[u];
    }
  }
  return out;
}

Status KvCache::Impl::covers(std::span<const std::uint32_t> tokens, std::span<const std::uint32_t> block_ids,
                             std::size_t first, std::size_t count) const {
  const std::size_t end = first + count;
  if (tokens.size() < end * keys.chunk_tokens) {
    return Status::invalid_argument("kvcache: " + std::to_string(tokens.size()) + " tokens do not cover " +
                                    std::to_string(end) + " chunks of " + std::to_string(keys.chunk_tokens));
  }
  if (block_ids.size() < end * blocks_per_chunk) {
    return Status::invalid_argument("kvcache: " + std::to_string(block_ids.size()) +
                                    " block ids do not cover " + std::to_string(end) + " chunks of " +
                                    std::to_string(blocks_per_chunk) + " blocks");
  }
  return {};  // block ids out of range fail their chunk alone
}

void KvCache::Impl::retire(RetiredLoad load) {
  std::lock_guard lock(retired_mu);
  retired.push_back(std::move(load));
}

void KvCache::Impl::reap() {
  std::vector<RetiredLoad> passed;
  {
    std::lock_guard lock(retired_mu);
    for (auto it = retired.begin(); it != retired.end();) {
      if (it->handover->passed()) {
        passed.push_back(std::move(*it));
        it = retired.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (RetiredLoad& r : passed) {
    for (auto& b : r.bounces) load_bounces->give(std::move(b));
  }
}

KvCache::Impl::~Impl() {
  // Loads handed to the engine's streams leave work there that reads our bounce buffers:
  // wait for it a while; what has still not run by then is left allocated, never freed under
  // a stream that may read it.
  const Deadline until = deadline_after(std::chrono::seconds(10));
  for (;;) {
    reap();
    std::lock_guard lock(retired_mu);
    if (retired.empty()) return;
    if (Clock::now() >= until) {
      KVSTASH_LOG_ERROR(
          "kvcache: {} loads' work on the engine's streams did not run in 10 s; their buffers are "
          "left allocated",
          retired.size());
      for (RetiredLoad& r : retired) {
        (void)r.handover.release();
        for (auto& b : r.bounces) (void)b.release();
      }
      retired.clear();
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

KvCache::KvCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvCache::~KvCache() = default;

Result<std::unique_ptr<KvCache>> KvCache::open(Store& store, KvLayout layout, PrefixKeyOptions keys,
                                               KvCacheOptions options) {
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
  if (keys.layers_total != 0) {
    keys.layer_count = layout.shape().num_layers;  // a stage's layers are its layout's
    if (keys.layer_first > keys.layers_total || keys.layer_count > keys.layers_total - keys.layer_first) {
      return Status::invalid_argument("kvcache: the cache's " + std::to_string(keys.layer_count) +
                                      " layers from layer " + std::to_string(keys.layer_first) +
                                      " on are not among the model's " + std::to_string(keys.layers_total));
    }
  } else if (keys.layer_first != 0 || keys.layer_count != 0) {
    return Status::invalid_argument(
        "kvcache: layer_first and layer_count name layers of layers_total: set it");
  }
  for (char c : keys.group) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return Status::invalid_argument("kvcache: group '" + keys.group + "' is not of [A-Za-z0-9._-]");
    }
  }
  KVSTASH_RETURN_IF_ERROR(kvcache::split_by_heads(layout, keys, impl->objects));
  keys.layout_tag = impl->objects.front().tag();
  impl->keys = std::move(keys);
  impl->blocks_per_chunk = impl->keys.chunk_tokens / bs;
  if (options.bounce_slots == 0) return Status::invalid_argument("kvcache: bounce_slots must be at least 1");
  impl->options = std::move(options);
  KVSTASH_ASSIGN_OR_RETURN(kvcache::DataPath path, kvcache::choose_data_path(store, layout, impl->options));
  impl->handles = std::move(path.handles);
  impl->device = std::move(path.device);
  impl->staged_path = path.staged;
  impl->device_memory = path.device_memory;
  if (impl->staged()) {
    const std::uint64_t lb = impl->layer_bytes();
    impl->save_bounces = std::make_unique<kvcache::BouncePool>(
        &store, impl->device.get(), static_cast<std::size_t>(lb * impl->options.bounce_slots));
    impl->load_bounces = std::make_unique<kvcache::BouncePool>(
        &store, impl->device.get(), static_cast<std::size_t>(lb * layout.shape().num_layers));
  }
  // Everything a warm save or load uses on the device, sized now: an object's layer is a
  // run per block and part, or by heads in NHD order, a run per token.
  const KvCacheShape& shape = layout.shape();
  const bool per_token = impl->per_chunk() > 1 && shape.order == KvBlockOrder::kNHD;
  KVSTASH_RETURN_IF_ERROR(
      impl->device->reserve({.runs_per_layer = std::size_t{shape.parts()} * impl->blocks_per_chunk *
                                               (per_token ? shape.block_size : 1),
                             .layer_bytes = impl->layer_bytes(),
                             .layers = shape.num_layers}));
  impl->layout = std::move(layout);
  return std::unique_ptr<KvCache>(new KvCache(std::move(impl)));
}

const KvLayout& KvCache::layout() const { return impl_->layout; }
std::string_view KvCache::data_path() const { return impl_->staged() ? "staged" : "direct"; }
const KvDevice& KvCache::device() const { return *impl_->device; }
const PrefixKeyOptions& KvCache::key_options() const { return impl_->keys; }

std::vector<std::string> KvCache::keys(const KvTokens& tokens) const {
  return prefix_object_keys(tokens, impl_->keys, static_cast<std::uint32_t>(impl_->per_chunk()));
}

std::size_t KvCache::objects_per_chunk() const { return impl_->per_chunk(); }

std::uint64_t KvCache::chunk_bytes() const { return impl_->chunk_bytes(); }

Result<std::size_t> KvCache::contains_prefix(const KvTokens& tokens, std::optional<Deadline> deadline) {
  auto k = keys(tokens);
  if (k.empty()) return std::size_t{0};
  // Chunk by chunk, every object: the leading objects stored, in whole chunks.
  KVSTASH_ASSIGN_OR_RETURN(const std::size_t objects, impl_->store->contains_prefix(k, deadline));
  return objects / impl_->per_chunk();
}

Result<KvLookup> KvCache::lookup_prefix(const KvTokens& tokens, std::optional<Deadline> deadline) {
  const auto k = keys(tokens);
  const std::size_t per_chunk = impl_->per_chunk();
  KvLookup out;
  out.keep.chunks = static_cast<std::uint32_t>(k.size() / per_chunk);
  if (k.empty()) return out;
  KVSTASH_ASSIGN_OR_RETURN(const PrefixLookup found, impl_->store->lookup_prefix(k, deadline));
  out.chunks = found.hit / per_chunk;
  out.keep.turn = found.turn;
  out.keep.looked_up = found.clock;
  out.keep.split_hash =
      KeepHint::hash_key(k[std::min<std::size_t>(out.chunks, out.keep.chunks - 1) * per_chunk]);
  return out;
}

namespace {
// Chunk `chunk`'s object `key` as a use of the request `keep` describes.
std::optional<KeepHint> keep_hint(const std::optional<KvKeep>& keep, std::size_t chunk,
                                  std::size_t chunk_tokens, std::string_view key) {
  if (!keep) return std::nullopt;
  return KeepHint{.turn = keep->turn,
                  .chunks = std::max(keep->chunks, static_cast<std::uint32_t>(chunk + 1)),
                  .index = static_cast<std::uint32_t>(chunk),
                  .tokens = static_cast<std::uint32_t>(chunk_tokens),
                  .key_hash = KeepHint::hash_key(key),
                  .split_hash = keep->split_hash,
                  .looked_up = keep->looked_up};
}
}  // namespace

Result<KvSave> KvCache::begin_save(const KvTokens& tokens, std::span<const std::uint32_t> block_ids,
                                   std::size_t first, std::size_t count, std::optional<Deadline> deadline,
                                   const std::optional<KvKeep>& keep, std::span<const std::string> events) {
  KVSTASH_RETURN_IF_ERROR(impl_->covers(tokens.ids, block_ids, first, count));
  if (!events.empty() && events.size() != count) {
    return Status::invalid_argument("kvcache: " + std::to_string(events.size()) +
                                    " chunks' event data for a save of " + std::to_string(count) + " chunks");
  }
  const auto k = keys(tokens.first((first + count) * impl_->keys.chunk_tokens));
  auto st = std::make_unique<KvSave::State>();
  st->kv = impl_.get();
  st->deadline = deadline.value_or(deadline_after(std::chrono::seconds(30)));
  const std::size_t per_chunk = impl_->per_chunk();
  for (std::size_t u = first * per_chunk; u < (first + count) * per_chunk; ++u) {
    auto& chunk = st->chunks.emplace_back();
    chunk.key = k[u];
    chunk.object = u % per_chunk;
    chunk.blocks = impl_->chunk_blocks(block_ids, u / per_chunk);
    if (impl_->staged()) {
      auto b = impl_->save_bounces->take();
      if (!b.is_ok()) {
        chunk.status = b.status().with_context("kvcache: bounce buffer");
        continue;
      }
      chunk.bounce = std::move(b).value();
    }
    // One checksum segment per layer: each layer's sum is the one its device computed. A
    // router hears of a chunk by its first object.
    const bool announces = !events.empty() && chunk.object == 0;
    auto stream =
        impl_->store->begin_put(chunk.key, impl_->chunk_bytes(),
                                {.deadline = deadline,
                                 .checksum_segment = impl_->layer_bytes(),
                                 .keep = keep_hint(keep, u / per_chunk, impl_->keys.chunk_tokens, chunk.key),
                                 .event = announces ? events[u / per_chunk - first] : std::string()});
    if (stream.is_ok()) {
      chunk.stream = std::move(stream).value();
    } else {
      chunk.status = stream.status();
    }
  }
  KvSave save;
  save.state_ = std::move(st);
  return save;
}

Result<KvLoad> KvCache::begin_load(const KvTokens& tokens, std::span<const std::uint32_t> block_ids,
                                   std::size_t count, std::optional<Deadline> deadline, const KvSync& after,
                                   const std::optional<KvKeep>& keep) {
  return begin_load_range(tokens, block_ids, 0, count, deadline, after, keep);
}

Result<KvLoad> KvCache::begin_load_range(const KvTokens& tokens, std::span<const std::uint32_t> block_ids,
                                         std::size_t first, std::size_t count,
                                         std::optional<Deadline> deadline, const KvSync& after,
                                         const std::optional<KvKeep>& keep) {
  KVSTASH_RETURN_IF_ERROR(impl_->covers(tokens.ids, block_ids, first, count));
  impl_->reap();  // earlier loads' bounce buffers the engine's streams are done with
  const auto k = keys(tokens.first((first + count) * impl_->keys.chunk_tokens));
  auto st = std::make_shared<KvLoad::State>();
  st->kv = impl_.get();
  st->layer_waits = &impl_->store->metrics().histogram(
      "kvstash_kvcache_layer_wait_duration_seconds",
      "How long the engine waited for a layer of a load (KvLoad::wait_layer)");
  st->device = impl_->device;
  st->layers = impl_->layout.shape().num_layers;
  st->deadline = deadline;
  KVSTASH_ASSIGN_OR_RETURN(st->after, impl_->device->mark(after));
  // The load's units are objects: per_chunk of them a chunk.
  const std::size_t per_chunk = impl_->per_chunk();
  const std::size_t units = count * per_chunk;
  st->landed.assign(units, 0);
  st->placed.assign(units, 0);
  st->done.assign(units, std::nullopt);
  st->late.assign(units, Status::ok());
  st->bounces.resize(units);
  st->tainted.assign(units, 0);
  st->sums.resize(units);
  st->unusable.assign(units, Status::ok());
  st->queued.assign(st->layers, 0);
  st->host_placed.assign(st->layers, 0);
  // Every object's blocks and runs are in place before any task runs (the tasks read them).
  st->runs.resize(units);
  for (std::size_t c = 0; c < units; ++c) {
    st->blocks.push_back(impl_->chunk_blocks(block_ids, first + c / per_chunk));
    st->runs[c].resize(st->layers);
    for (std::uint32_t l = 0; l < st->layers && st->unusable[c].is_ok(); ++l) {
      auto r = impl_->layer_runs(c % per_chunk, l, st->blocks[c]);
      if (r.is_ok()) {
        st->runs[c][l] = std::move(r).value();
      } else {
        st->unusable[c] = r.status();  // block ids out of range fail their chunk alone
        st->runs[c].assign(st->layers, {});
      }
    }
  }
  // One Redis round trip leases every chunk (a chunk's get without one leases for itself).
  const auto unit_keys = std::span(k).subspan(first * per_chunk, units);
  std::vector<KeepHint> hints;
  for (std::size_t c = 0; keep && c < units; ++c) {
    hints.push_back(*keep_hint(keep, first + c / per_chunk, impl_->keys.chunk_tokens, unit_keys[c]));
  }
  if (auto leases = impl_->store->lease_reads(unit_keys, deadline, hints); leases.is_ok()) {
    st->leases = std::move(leases).value();
  } else {
    KVSTASH_LOG_DEBUG("kvcache: leasing {} chunks at once failed, each leases for itself: {}", count,
                      leases.status().to_string());
  }
  // The tasks hold the state by address: ~KvLoad waits for them before it goes.
  for (std::size_t c = 0; c < units; ++c) {  // unit c is object c % per_chunk of chunk first + c / per_chunk
    st->tasks.push_back(
        impl_->loaders->submit([s = st.get(), c, key = unit_keys[c]] { s->load_chunk(c, key); }));
  }
  KvLoad load;
  load.state_ = std::move(st);
  return load;
}

std::vector<Status> KvCache::save(const KvTokens& tokens, std::span<const std::uint32_t> block_ids,
                                  std::size_t first, std::size_t count, std::optional<Deadline> deadline,
                                  const std::optional<KvKeep>& keep) {
  auto s = begin_save(tokens, block_ids, first, count, deadline, keep);
  if (!s.is_ok()) return std::vector<Status>(count, s.status());
  for (std::uint32_t l = 0; l < impl_->layout.shape().num_layers; ++l) (void)s->save_layer(l);
  return s->wait();
}

std::vector<Status> KvCache::load(const KvTokens& tokens, std::span<const std::uint32_t> block_ids,
                                  std::size_t count, std::optional<Deadline> deadline,
                                  const std::optional<KvKeep>& keep) {
  auto l = begin_load(tokens, block_ids, count, deadline, {}, keep);
  if (!l.is_ok()) return std::vector<Status>(count, l.status());
  return l->wait();
}

void count_chunks(Store& store, std::string_view op, std::span<const Status> outcomes) {
  metrics::Registry& r = store.metrics();
  for (const Status& s : outcomes) {
    r.counter("kvstash_kvcache_chunks_total",
              "KV-cache chunks loaded or saved, by outcome (a load's failed chunks are computed again)",
              {{"op", std::string(op)}, {"status", std::string(to_string(s.code()))}})
        .add();
  }
}

}  // namespace kvstash

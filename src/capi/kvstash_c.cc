// The C API (include/kvstash/c_api.h): opaque handles over Store and KvCache, statuses as
// codes, messages in a thread-local slot. Through the public C++ API only.
#include "kvstash/c_api.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "common/system.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"
#include "kvstash/types.h"

struct kvstash_store {
  std::unique_ptr<kvstash::Store> store;
};
struct kvstash_kvcache {
  std::unique_ptr<kvstash::KvCache> kv;
};
struct kvstash_save {
  kvstash::KvSave save;
  std::size_t chunks = 0;
};
struct kvstash_load {
  kvstash::KvLoad load;
  std::size_t chunks = 0;
};

// The C enums mirror the C++ ones value for value (tests/unit/bindings/parity_test.py checks the names).
static_assert(KVSTASH_INTERNAL == static_cast<int>(kvstash::StatusCode::kInternal));
static_assert(KVSTASH_CANCELLED == static_cast<int>(kvstash::StatusCode::kCancelled));
static_assert(KVSTASH_INT8 == static_cast<int>(kvstash::KvDType::kInt8));
static_assert(KVSTASH_FP8_E4M3 == static_cast<int>(kvstash::KvDType::kFloat8E4M3));
static_assert(KVSTASH_HND == static_cast<int>(kvstash::KvBlockOrder::kHND));
static_assert(KVSTASH_MEMORY_CUDA == static_cast<int>(kvstash::MemoryKind::kCuda));

namespace {

thread_local std::string t_error;

kvstash_status report(const kvstash::Status& s) {
  t_error = s.is_ok() ? std::string() : s.to_string();
  return static_cast<kvstash_status>(s.code());
}

kvstash_status invalid(const char* why) { return report(kvstash::Status::invalid_argument(why)); }

std::optional<kvstash::Deadline> deadline_of(std::uint32_t timeout_ms) {
  if (timeout_ms == 0) return std::nullopt;
  return kvstash::deadline_after(std::chrono::milliseconds(timeout_ms));
}

// KvSync of a kvstash_sync; kInvalidArgument for a kind C does not know.
kvstash::Result<kvstash::KvSync> sync_of(const kvstash_sync& s) {
  switch (s.kind) {
    case KVSTASH_SYNC_STREAM: return kvstash::KvSync::stream(s.handle);
    case KVSTASH_SYNC_EVENT: return kvstash::KvSync::event(s.handle);
    case KVSTASH_SYNC_NONE: return kvstash::KvSync::none();
  }
  return kvstash::Status::invalid_argument("kvstash_sync: unknown kind " +
                                           std::to_string(static_cast<int>(s.kind)));
}

// Zero (NULL) fields are the C++ defaults. Precondition: keys.model is set.
kvstash::PrefixKeyOptions key_options_of(const kvstash_key_options& keys) {
  kvstash::PrefixKeyOptions k;
  k.model = keys.model;
  if (keys.layout_tag != nullptr) k.layout_tag = keys.layout_tag;
  k.tp_rank = keys.tp_rank;
  if (keys.tp_size != 0) k.tp_size = keys.tp_size;
  if (keys.chunk_tokens != 0) k.chunk_tokens = keys.chunk_tokens;
  if (keys.extra != nullptr) k.extra = keys.extra;
  return k;
}

// The first failure of a per-chunk list, and the list copied out when asked for.
kvstash_status per_chunk_result(const std::vector<kvstash::Status>& all, kvstash_status* per_chunk) {
  kvstash::Status first;
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (per_chunk != nullptr) per_chunk[i] = static_cast<kvstash_status>(all[i].code());
    if (first.is_ok() && !all[i].is_ok()) first = all[i];
  }
  return report(first);
}

// A request's keep fields as the C++ API takes them (C++ linkage: it returns a C++ type).
std::optional<kvstash::KvKeep> keep_of(const kvstash_kv_keep* keep) {
  if (keep == nullptr) return std::nullopt;
  return kvstash::KvKeep{keep->turn, keep->looked_up, keep->chunks, keep->split_hash};
}
}  // namespace

extern "C" {

const char* kvstash_status_name(kvstash_status status) {
  static const char* const kNames[] = {
      "ok",          "not_found",        "stale",   "timeout",           "unavailable",
      "no_space",    "invalid_argument", "corrupt", "permission_denied", "cancelled",
      "unsupported", "io_error",         "internal"};
  const auto i = static_cast<unsigned>(status);
  return i < sizeof kNames / sizeof kNames[0] ? kNames[i] : "unknown";
}

const char* kvstash_last_error(void) { return t_error.c_str(); }

kvstash_status kvstash_store_open(const kvstash_store_options* options, kvstash_store** out) {
  if (options == nullptr || out == nullptr || options->redis_url == nullptr) {
    return invalid("kvstash_store_open: options, redis_url and out are required");
  }
  *out = nullptr;
  kvstash::StoreOptions so;
  so.redis_url = options->redis_url;
  if (options->redis_password != nullptr) so.redis_password = options->redis_password;
  if (options->cell != nullptr) so.cell = options->cell;
  if (options->timeout_ms != 0) so.timeout = std::chrono::milliseconds(options->timeout_ms);
  if (options->cluster_token != nullptr) {
    kvstash::Status token =
        kvstash::sys::check_cluster_token(options->cluster_token, "kvstash_store_open: cluster_token");
    if (!token.is_ok()) return report(token);
    so.engine.cluster_token = options->cluster_token;
  }
  if (options->transports != nullptr) {
    auto kinds = kvstash::parse_transport_list(options->transports);
    if (!kinds.is_ok()) return report(kinds.status());
    so.engine.transports = std::move(kinds).value();
  }
  auto store = kvstash::Store::open(so);
  if (!store.is_ok()) return report(store.status());
  *out = new kvstash_store{std::move(store).value()};
  return report({});
}

void kvstash_store_close(kvstash_store* store) { delete store; }

kvstash_status kvstash_put(kvstash_store* store, const char* key, const void* data, size_t length,
                           uint64_t ttl_ms) {
  if (store == nullptr || key == nullptr || (data == nullptr && length != 0)) {
    return invalid("kvstash_put: store, key and data are required");
  }
  kvstash::Slice s{const_cast<void*>(data), length};
  return report(store->store->put(key, {&s, 1}, {.ttl = std::chrono::milliseconds(ttl_ms)}));
}

kvstash_status kvstash_get(kvstash_store* store, const char* key, void* out, size_t capacity, size_t* size) {
  if (store == nullptr || key == nullptr || size == nullptr || (out == nullptr && capacity != 0)) {
    return invalid("kvstash_get: store, key, out and size are required");
  }
  auto r = store->store->get_unsized(
      key, [&](std::uint64_t object_size) -> kvstash::Result<std::vector<kvstash::Slice>> {
        *size = object_size;
        if (object_size > capacity) {
          return kvstash::Status::invalid_argument(
              "kvstash_get: the object is larger than the buffer (see *size)");
        }
        return std::vector<kvstash::Slice>{{out, capacity}};
      });
  if (!r.is_ok()) return report(r.status());
  *size = r->size;
  return report({});
}

kvstash_status kvstash_remove(kvstash_store* store, const char* key, uint32_t timeout_ms) {
  if (store == nullptr || key == nullptr) return invalid("kvstash_remove: store and key are required");
  return report(store->store->remove(key, deadline_of(timeout_ms)));
}

kvstash_status kvstash_remove_corrupt(kvstash_store* store, const char* key, uint32_t timeout_ms) {
  if (store == nullptr || key == nullptr)
    return invalid("kvstash_remove_corrupt: store and key are required");
  return report(store->store->remove_corrupt(key, deadline_of(timeout_ms)));
}

kvstash_status kvstash_announce(kvstash_store* store, const char* const* item_keys,
                                const void* const* item_data, const size_t* item_lengths, size_t n,
                                uint32_t timeout_ms, int64_t* announced) {
  if (store == nullptr ||
      (n != 0 && (item_keys == nullptr || item_data == nullptr || item_lengths == nullptr)) ||
      announced == nullptr) {
    return invalid("kvstash_announce: store, keys, data, lengths and announced are required");
  }
  std::vector<std::pair<std::string, std::string>> items;
  items.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (item_keys[i] == nullptr || item_data[i] == nullptr)
      return invalid("kvstash_announce: a key or its data is NULL");
    items.emplace_back(item_keys[i], std::string(static_cast<const char*>(item_data[i]), item_lengths[i]));
  }
  auto r = store->store->announce(items, deadline_of(timeout_ms));
  if (!r.is_ok()) return report(r.status());
  *announced = r->has_value() ? static_cast<int64_t>(**r) : -1;
  return report({});
}

namespace {

// The C strings of a key list as C++ strings; false on a NULL key.
bool copy_keys(const char* const* keys, size_t n_keys, std::vector<std::string>& out) {
  out.reserve(n_keys);
  for (size_t i = 0; i < n_keys; ++i) {
    if (keys[i] == nullptr) return false;
    out.emplace_back(keys[i]);
  }
  return true;
}

}  // namespace

kvstash_status kvstash_contains_prefix(kvstash_store* store, const char* const* keys, size_t n_keys,
                                       uint32_t timeout_ms, size_t* count) {
  if (store == nullptr || (keys == nullptr && n_keys != 0) || count == nullptr) {
    return invalid("kvstash_contains_prefix: store, keys and count are required");
  }
  std::vector<std::string> k;
  if (!copy_keys(keys, n_keys, k)) return invalid("kvstash_contains_prefix: a key is NULL");
  auto n = store->store->contains_prefix(k, deadline_of(timeout_ms));
  if (!n.is_ok()) return report(n.status());
  *count = *n;
  return report({});
}

kvstash_status kvstash_lookup_prefix(kvstash_store* store, const char* const* keys, size_t n_keys,
                                     uint32_t timeout_ms, kvstash_prefix_lookup* out) {
  if (store == nullptr || (keys == nullptr && n_keys != 0) || out == nullptr) {
    return invalid("kvstash_lookup_prefix: store, keys and out are required");
  }
  std::vector<std::string> k;
  if (!copy_keys(keys, n_keys, k)) return invalid("kvstash_lookup_prefix: a key is NULL");
  auto found = store->store->lookup_prefix(k, deadline_of(timeout_ms));
  if (!found.is_ok()) return report(found.status());
  out->hit = found->hit;
  out->turn = found->turn;
  out->clock = found->clock;
  return report({});
}

kvstash_status kvstash_contains_each(kvstash_store* store, const char* const* keys, size_t n_keys,
                                     uint32_t timeout_ms, uint8_t* out) {
  if (store == nullptr || (keys == nullptr && n_keys != 0) || (out == nullptr && n_keys != 0)) {
    return invalid("kvstash_contains_each: store, keys and out are required");
  }
  std::vector<std::string> k;
  if (!copy_keys(keys, n_keys, k)) return invalid("kvstash_contains_each: a key is NULL");
  auto each = store->store->contains_each(k, deadline_of(timeout_ms));
  if (!each.is_ok()) return report(each.status());
  for (size_t i = 0; i < each->size(); ++i) out[i] = (*each)[i] ? 1 : 0;
  return report({});
}

kvstash_status kvstash_prefix_tiers(kvstash_store* store, const char* const* keys, size_t n_keys,
                                    uint32_t timeout_ms, uint8_t* out, size_t* count) {
  if (store == nullptr || (keys == nullptr && n_keys != 0) || count == nullptr ||
      (out == nullptr && n_keys != 0)) {
    return invalid("kvstash_prefix_tiers: store, keys, out and count are required");
  }
  std::vector<std::string> k;
  if (!copy_keys(keys, n_keys, k)) return invalid("kvstash_prefix_tiers: a key is NULL");
  auto where = store->store->prefix_tiers(k, deadline_of(timeout_ms));
  if (!where.is_ok()) return report(where.status());
  for (size_t i = 0; i < where->size(); ++i)
    out[i] = (*where)[i] == kvstash::Tier::kSsd ? KVSTASH_TIER_SSD : KVSTASH_TIER_DRAM;
  *count = where->size();
  return report({});
}

kvstash_status kvstash_kvcache_open(kvstash_store* store, const kvstash_kv_layout* layout,
                                    const kvstash_key_options* keys, kvstash_kvcache** out) {
  if (store == nullptr || layout == nullptr || keys == nullptr || out == nullptr || keys->model == nullptr) {
    return invalid("kvstash_kvcache_open: store, layout, keys (with a model) and out are required");
  }
  *out = nullptr;
  if (layout->dtype < KVSTASH_FP16 || layout->dtype > KVSTASH_INT8)
    return invalid("kvstash_kvcache_open: unknown dtype");
  if (layout->order != KVSTASH_NHD && layout->order != KVSTASH_HND)
    return invalid("kvstash_kvcache_open: unknown order");
  if (layout->memory_kind != KVSTASH_MEMORY_HOST && layout->memory_kind != KVSTASH_MEMORY_CUDA)
    return invalid("kvstash_kvcache_open: unknown memory_kind");
  kvstash::KvCacheShape shape{.num_layers = layout->num_layers,
                              .num_blocks = layout->num_blocks,
                              .block_size = layout->block_size,
                              .num_kv_heads = layout->num_kv_heads,
                              .head_dim = layout->head_dim,
                              .dtype = static_cast<kvstash::KvDType>(layout->dtype),
                              .order = static_cast<kvstash::KvBlockOrder>(layout->order),
                              .mla = layout->mla != 0,
                              .joint_kv = layout->joint_kv != 0};
  const auto kind = static_cast<kvstash::MemoryKind>(layout->memory_kind);
  kvstash::Result<kvstash::KvLayout> l = kvstash::Status::internal("unset");
  switch (layout->arrangement) {
    case KVSTASH_PER_LAYER:
    case KVSTASH_PER_LAYER_BLOCKS_FIRST: {
      if (layout->layer_tensors == nullptr) return invalid("kvstash_kvcache_open: layer_tensors is required");
      std::span<void* const> tensors(layout->layer_tensors, layout->num_layers);
      l = layout->arrangement == KVSTASH_PER_LAYER
              ? kvstash::KvLayout::per_layer(shape, tensors, kind)
              : kvstash::KvLayout::per_layer_blocks_first(shape, tensors, kind);
      break;
    }
    case KVSTASH_CROSS_LAYER:
      if (layout->base == nullptr) return invalid("kvstash_kvcache_open: base is required");
      l = kvstash::KvLayout::cross_layer(shape, layout->base, kind);
      break;
    default: return invalid("kvstash_kvcache_open: unknown arrangement");
  }
  if (!l.is_ok()) return report(l.status());
  kvstash::PrefixKeyOptions k = key_options_of(*keys);
  kvstash::KvCacheOptions options;
  switch (layout->staging) {
    case KVSTASH_STAGING_AUTO: break;
    case KVSTASH_STAGING_NONE: options.path = kvstash::KvPath::kDirect; break;
    case KVSTASH_STAGING_HOST:
      options.device = kvstash::host_device();
      options.path = kvstash::KvPath::kStaged;
      break;
    case KVSTASH_STAGING_CUDA: {
      auto c = kvstash::cuda_device_of(*l);  // on the GPU that owns the tensors, not GPU 0
      if (!c.is_ok()) return report(c.status().with_context("kvstash_kvcache_open"));
      options.device = std::move(c).value();
      options.path = kvstash::KvPath::kStaged;
      break;
    }
    default: return invalid("kvstash_kvcache_open: unknown staging");
  }
  auto kv = kvstash::KvCache::open(*store->store, std::move(l).value(), std::move(k), std::move(options));
  if (!kv.is_ok()) return report(kv.status());
  *out = new kvstash_kvcache{std::move(kv).value()};
  return report({});
}

void kvstash_kvcache_close(kvstash_kvcache* kv) { delete kv; }

const char* kvstash_kvcache_data_path(const kvstash_kvcache* kv) {
  return kv == nullptr ? "" : kv->kv->data_path().data();  // names of static storage
}

const char* kvstash_kvcache_device(const kvstash_kvcache* kv) {
  return kv == nullptr ? "" : kv->kv->device().name().data();  // names of static storage
}

uint64_t kvstash_kvcache_chunk_bytes(const kvstash_kvcache* kv) {
  return kv == nullptr ? 0 : kv->kv->chunk_bytes();
}

uint32_t kvstash_kvcache_chunk_tokens(const kvstash_kvcache* kv) {
  return kv == nullptr ? 0 : kv->kv->key_options().chunk_tokens;
}

const char* kvstash_kvcache_layout_tag(const kvstash_kvcache* kv) {
  return kv == nullptr ? "" : kv->kv->key_options().layout_tag.c_str();
}

kvstash_status kvstash_metrics_text(kvstash_store* store, char* out, size_t capacity, size_t* size) {
  if (store == nullptr || size == nullptr || (out == nullptr && capacity > 0)) {
    return invalid("kvstash_metrics_text: store and size are required (out with a capacity)");
  }
  const std::string text = store->store->metrics_text();
  *size = text.size() + 1;
  if (capacity < *size) return invalid("kvstash_metrics_text: out holds fewer bytes than *size");
  text.copy(out, text.size());
  out[text.size()] = '\0';
  return report({});
}

kvstash_status kvstash_prefix_chunk_key(const uint32_t* tokens, size_t n_tokens, size_t index,
                                        const kvstash_key_options* options, char* out, size_t out_size) {
  if ((tokens == nullptr && n_tokens != 0) || options == nullptr || options->model == nullptr ||
      out == nullptr) {
    return invalid("kvstash_prefix_chunk_key: tokens, options (with a model) and out are required");
  }
  const std::vector<std::string> all =
      kvstash::prefix_chunk_keys(std::span<const std::uint32_t>(tokens, n_tokens), key_options_of(*options));
  if (index >= all.size()) return invalid("kvstash_prefix_chunk_key: the tokens hold no such full chunk");
  if (out_size <= all[index].size())
    return invalid("kvstash_prefix_chunk_key: out is smaller than KVSTASH_KEY_SIZE bytes");
  all[index].copy(out, all[index].size());
  out[all[index].size()] = '\0';
  return report({});
}

kvstash_status kvstash_kvcache_key(const kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                   size_t index, char* out, size_t out_size) {
  if (kv == nullptr || (tokens == nullptr && n_tokens != 0) || out == nullptr) {
    return invalid("kvstash_kvcache_key: kv, tokens and out are required");
  }
  auto keys = kv->kv->keys(std::span<const std::uint32_t>(tokens, n_tokens));
  if (index >= keys.size()) return invalid("kvstash_kvcache_key: the tokens hold no such full chunk");
  if (out_size <= keys[index].size())
    return invalid("kvstash_kvcache_key: out is smaller than KVSTASH_KEY_SIZE bytes");
  keys[index].copy(out, keys[index].size());
  out[keys[index].size()] = '\0';
  return report({});
}

kvstash_status kvstash_kvcache_contains_prefix(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                               uint32_t timeout_ms, size_t* chunks) {
  if (kv == nullptr || (tokens == nullptr && n_tokens != 0) || chunks == nullptr) {
    return invalid("kvstash_kvcache_contains_prefix: kv, tokens and chunks are required");
  }
  auto n = kv->kv->contains_prefix(std::span<const std::uint32_t>(tokens, n_tokens), deadline_of(timeout_ms));
  if (!n.is_ok()) return report(n.status());
  *chunks = *n;
  return report({});
}

kvstash_status kvstash_kvcache_lookup_prefix(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                             uint32_t timeout_ms, size_t* chunks, kvstash_kv_keep* keep) {
  if (kv == nullptr || (tokens == nullptr && n_tokens != 0) || chunks == nullptr || keep == nullptr) {
    return invalid("kvstash_kvcache_lookup_prefix: kv, tokens, chunks and keep are required");
  }
  auto found =
      kv->kv->lookup_prefix(std::span<const std::uint32_t>(tokens, n_tokens), deadline_of(timeout_ms));
  if (!found.is_ok()) return report(found.status());
  *chunks = found->chunks;
  *keep = {found->keep.turn, found->keep.looked_up, found->keep.chunks, found->keep.split_hash};
  return report({});
}

kvstash_status kvstash_kvcache_begin_save(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                          const uint32_t* block_ids, size_t n_block_ids, size_t first,
                                          size_t count, uint32_t timeout_ms, kvstash_save** out) {
  return kvstash_kvcache_begin_save_keep(kv, tokens, n_tokens, block_ids, n_block_ids, first, count,
                                         timeout_ms, nullptr, out);
}

kvstash_status kvstash_kvcache_begin_save_keep(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                               const uint32_t* block_ids, size_t n_block_ids, size_t first,
                                               size_t count, uint32_t timeout_ms, const kvstash_kv_keep* keep,
                                               kvstash_save** out) {
  if (kv == nullptr || tokens == nullptr || block_ids == nullptr || out == nullptr) {
    return invalid("kvstash_kvcache_begin_save: kv, tokens, block_ids and out are required");
  }
  *out = nullptr;
  auto s = kv->kv->begin_save(std::span<const std::uint32_t>(tokens, n_tokens), {block_ids, n_block_ids},
                              first, count, deadline_of(timeout_ms), keep_of(keep));
  if (!s.is_ok()) return report(s.status());
  *out = new kvstash_save{std::move(s).value(), count};
  return report({});
}

kvstash_status kvstash_save_layer(kvstash_save* save, uint32_t layer) {
  if (save == nullptr) return invalid("kvstash_save_layer: save is required");
  return report(save->save.save_layer(layer));
}

kvstash_status kvstash_save_layer_after(kvstash_save* save, uint32_t layer, kvstash_sync after) {
  if (save == nullptr) return invalid("kvstash_save_layer_after: save is required");
  auto sync = sync_of(after);
  if (!sync.is_ok()) return report(sync.status());
  return report(save->save.save_layer(layer, *sync));
}

kvstash_status kvstash_save_finish(kvstash_save* save, kvstash_status* per_chunk) {
  if (save == nullptr) return invalid("kvstash_save_finish: save is required");
  std::unique_ptr<kvstash_save> owned(save);
  return per_chunk_result(owned->save.wait(), per_chunk);
}

void kvstash_save_free(kvstash_save* save) { delete save; }

kvstash_status kvstash_kvcache_begin_load(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                          const uint32_t* block_ids, size_t n_block_ids, size_t count,
                                          uint32_t timeout_ms, kvstash_sync after, kvstash_load** out) {
  return kvstash_kvcache_begin_load_range(kv, tokens, n_tokens, block_ids, n_block_ids, 0, count, timeout_ms,
                                          after, out);
}

kvstash_status kvstash_kvcache_begin_load_range(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                                const uint32_t* block_ids, size_t n_block_ids, size_t first,
                                                size_t count, uint32_t timeout_ms, kvstash_sync after,
                                                kvstash_load** out) {
  return kvstash_kvcache_begin_load_range_keep(kv, tokens, n_tokens, block_ids, n_block_ids, first, count,
                                               timeout_ms, after, nullptr, out);
}

kvstash_status kvstash_kvcache_begin_load_range_keep(kvstash_kvcache* kv, const uint32_t* tokens,
                                                     size_t n_tokens, const uint32_t* block_ids,
                                                     size_t n_block_ids, size_t first, size_t count,
                                                     uint32_t timeout_ms, kvstash_sync after,
                                                     const kvstash_kv_keep* keep, kvstash_load** out) {
  if (kv == nullptr || tokens == nullptr || block_ids == nullptr || out == nullptr) {
    return invalid("kvstash_kvcache_begin_load: kv, tokens, block_ids and out are required");
  }
  *out = nullptr;
  auto sync = sync_of(after);
  if (!sync.is_ok()) return report(sync.status());
  auto l =
      kv->kv->begin_load_range(std::span<const std::uint32_t>(tokens, n_tokens), {block_ids, n_block_ids},
                               first, count, deadline_of(timeout_ms), *sync, keep_of(keep));
  if (!l.is_ok()) return report(l.status());
  *out = new kvstash_load{std::move(l).value(), count};
  return report({});
}

kvstash_status kvstash_load_wait_layer(kvstash_load* load, uint32_t layer) {
  if (load == nullptr) return invalid("kvstash_load_wait_layer: load is required");
  return report(load->load.wait_layer(layer));
}

int kvstash_load_layer_ready(const kvstash_load* load, uint32_t layer) {
  return load != nullptr && load->load.layer_ready(layer) ? 1 : 0;
}

kvstash_status kvstash_load_layer_event(kvstash_load* load, uint32_t layer, void** event) {
  if (load == nullptr || event == nullptr)
    return invalid("kvstash_load_layer_event: load and event are required");
  *event = nullptr;
  auto e = load->load.layer_event(layer);
  if (!e.is_ok()) return report(e.status());
  *event = *e;
  return report({});
}

kvstash_status kvstash_load_wait_layer_on(kvstash_load* load, uint32_t layer, void* stream) {
  if (load == nullptr) return invalid("kvstash_load_wait_layer_on: load is required");
  return report(load->load.wait_layer_on(layer, stream));
}

kvstash_status kvstash_load_finish(kvstash_load* load, kvstash_status* per_chunk) {
  if (load == nullptr) return invalid("kvstash_load_finish: load is required");
  std::unique_ptr<kvstash_load> owned(load);
  return per_chunk_result(owned->load.wait(), per_chunk);
}

void kvstash_load_free(kvstash_load* load) { delete load; }  // ~KvLoad waits for the transfers

kvstash_status kvstash_load_failed_blocks(kvstash_load* load, uint32_t* out, size_t capacity, size_t* n) {
  if (load == nullptr || n == nullptr || (out == nullptr && capacity > 0)) {
    return invalid("kvstash_load_failed_blocks: load and n are required, out when capacity > 0");
  }
  const std::vector<std::uint32_t> failed = load->load.failed_blocks();
  *n = failed.size();
  if (failed.size() > capacity) {
    return report(
        kvstash::Status::invalid_argument("kvstash_load_failed_blocks: " + std::to_string(failed.size()) +
                                          " blocks do not fit in " + std::to_string(capacity)));
  }
  std::copy(failed.begin(), failed.end(), out);
  return report({});
}

void kvstash_load_cancel(kvstash_load* load) {
  if (load != nullptr) load->load.cancel();
}

void kvstash_save_cancel(kvstash_save* save) {
  if (save != nullptr) save->save.cancel();
}

}  // extern "C"

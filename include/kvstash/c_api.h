/* kvstash/c_api.h: the C API, for engines written in other languages.
 *
 * A translation of the C++ API (include/kvstash/store.h, kvcache.h), name for name: opaque
 * handles over Store and KvCache; kvstash_<type>_<method> for Type::method; option structs
 * whose fields are the C++ fields (a std::chrono::milliseconds `x` is `x_ms`; a deadline is a
 * `timeout_ms` from now); enums that mirror the C++ ones value for value. tests/unit/bindings/parity_test.py
 * checks this header and the Python module against the C++ headers.
 *
 * Open a store, register a KV cache, ask how much of a prompt is stored, save and load a
 * request's chunks layer by layer, close. Every call returns a kvstash_status; on failure
 * kvstash_last_error() holds the message (per thread, until this thread's next call).
 *
 *   kvstash_store* store;
 *   kvstash_store_options so = {.redis_url = "redis://127.0.0.1:6379/0"};
 *   if (kvstash_store_open(&so, &store) != KVSTASH_OK) puts(kvstash_last_error());
 *   kvstash_kv_layout layout = {.num_layers = 32, ..., .layer_tensors = ptrs};
 *   kvstash_key_options keys = {.model = "llama-2-7b"};
 *   kvstash_kvcache* kv;
 *   kvstash_kvcache_open(store, &layout, &keys, &kv);
 *   size_t hit;
 *   kvstash_kvcache_contains_prefix(kv, tokens, n_tokens, 0, &hit);
 *   kvstash_load* load;
 *   kvstash_kvcache_begin_load(kv, tokens, n_tokens, block_ids, n_block_ids, hit, 0, &load);
 *   for (uint32_t l = 0; l < 32; ++l) kvstash_load_wait_layer(load, l);
 *   kvstash_load_finish(load, per_chunk_status);   // frees the handle
 *   kvstash_kvcache_close(kv);
 *   kvstash_store_close(store);
 *
 * Thread safety: a store and a KV cache may be used from several threads; a save or load
 * handle by one thread at a time. Handles must be closed children first (saves and loads,
 * then KV caches, then the store). Timeouts are in milliseconds; 0 means the store's default.
 */
#ifndef KVSTASH_C_API_H
#define KVSTASH_C_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Mirrors kvstash::StatusCode. */
typedef enum kvstash_status {
  KVSTASH_OK = 0,
  KVSTASH_NOT_FOUND = 1,
  KVSTASH_STALE = 2,
  KVSTASH_TIMEOUT = 3,
  KVSTASH_UNAVAILABLE = 4,
  KVSTASH_NO_SPACE = 5,
  KVSTASH_INVALID_ARGUMENT = 6,
  KVSTASH_CORRUPT = 7,
  KVSTASH_PERMISSION_DENIED = 8,
  KVSTASH_CANCELLED = 9,
  KVSTASH_UNSUPPORTED = 10,
  KVSTASH_IO_ERROR = 11,
  KVSTASH_INTERNAL = 12
} kvstash_status;

/* "ok", "not_found", ... */
const char* kvstash_status_name(kvstash_status status);
/* The message of this thread's last failed call ("" after a success). Valid until this
 * thread's next kvstash call. */
const char* kvstash_last_error(void);

typedef struct kvstash_store kvstash_store;
typedef struct kvstash_kvcache kvstash_kvcache;
typedef struct kvstash_save kvstash_save;
typedef struct kvstash_load kvstash_load;

/* StoreOptions. Fields are only ever added at the end: a caller that zero-fills the struct
 * (= {0}, or designated initializers) gets every later field's default, the C++ one. */
typedef struct kvstash_store_options {
  const char* redis_url;      /* required: redis://[user@]host:port/db or unix:///path */
  const char* redis_password; /* NULL: none (or in the URL) */
  const char* cell;           /* NULL: "default" */
  const char* transports;     /* engine.transports: NULL: every one built in; else "shm,tcp,verbs" */
  uint32_t timeout_ms;        /* timeout, per operation; 0: the default (30000) */
  /* engine.cluster_token. NULL: none. The cell's shared secret (kvstashd --cluster-token-file),
   * proved on every tcp connection and verbs queue-pair setup; without it, nodes that require
   * one refuse the data path with KVSTASH_PERMISSION_DENIED. An empty (or all-whitespace)
   * string is refused with KVSTASH_INVALID_ARGUMENT: it would turn authentication off; so is
   * one shorter than 16 bytes. UCX does not start with one. */
  const char* cluster_token;
} kvstash_store_options;

kvstash_status kvstash_store_open(const kvstash_store_options* options, kvstash_store** out);
void kvstash_store_close(kvstash_store* store);

/* Plain objects (debugging, small blobs): Store::put, get, remove and contains_prefix, named
 * kvstash_<method> (the store is the root handle). */
kvstash_status kvstash_put(kvstash_store* store, const char* key, const void* data, size_t length,
                           uint64_t ttl_ms);
/* Reads into `out` (capacity bytes); *size gets the object's size. KVSTASH_INVALID_ARGUMENT
 * when it does not fit (nothing read; *size says how much is needed). One Redis script
 * (Store::get_unsized): the size and the bytes are the same object's. */
kvstash_status kvstash_get(kvstash_store* store, const char* key, void* out, size_t capacity, size_t* size);
kvstash_status kvstash_remove(kvstash_store* store, const char* key, uint32_t timeout_ms);
/* kvstash_remove of an object whose bytes the caller found bad: `kvstash explain` says corrupt. */
kvstash_status kvstash_remove_corrupt(kvstash_store* store, const char* key, uint32_t timeout_ms);
/* KV events for routers (Store::announce, docs/events.md): each of the n keys present now
 * carries its event data (item_data[i], item_lengths[i] bytes of msgpack) and is published as stored;
 * its removal later with the same data. *announced: how many were, or -1 when the cell's
 * events are off. */
kvstash_status kvstash_announce(kvstash_store* store, const char* const* item_keys,
                                const void* const* item_data, const size_t* item_lengths, size_t n,
                                uint32_t timeout_ms, int64_t* announced);
/* How many of `keys`, from the first, are stored (*count): a scheduler's prefix check, with
 * the keys of kvstash_kvcache_key. */
kvstash_status kvstash_contains_prefix(kvstash_store* store, const char* const* keys, size_t n_keys,
                                       uint32_t timeout_ms, size_t* count);
/* kvstash_contains_prefix (out->hit), and the request's conversation turn and the cell's
 * turn-ttl clock (0 under another policy): what a turn-ttl cell's keep hints name
 * (docs/operations.md, "Choosing an eviction policy"). */
typedef struct kvstash_prefix_lookup {
  size_t hit;
  uint32_t turn;
  double clock;
} kvstash_prefix_lookup;
kvstash_status kvstash_lookup_prefix(kvstash_store* store, const char* const* keys, size_t n_keys,
                                     uint32_t timeout_ms, kvstash_prefix_lookup* out);
/* Whether each of `keys` (one chain's objects) is stored: out[i] is 1 or 0 (`out`
 * holds n_keys). One round trip: a hybrid model's lookup, whose KV-cache groups need
 * different chunks of a prefix. */
kvstash_status kvstash_contains_each(kvstash_store* store, const char* const* keys, size_t n_keys,
                                     uint32_t timeout_ms, uint8_t* out);
/* kvstash_contains_prefix, and where each of those *count leading keys is: out[i] is
 * KVSTASH_TIER_DRAM (in a memory node's pool) or KVSTASH_TIER_SSD (on its NVMe tier: a get
 * stages it back first, one round trip and a device read more). `out` holds n_keys. */
#define KVSTASH_TIER_DRAM 0
#define KVSTASH_TIER_SSD 1
kvstash_status kvstash_prefix_tiers(kvstash_store* store, const char* const* keys, size_t n_keys,
                                    uint32_t timeout_ms, uint8_t* out, size_t* count);

/* KvDType; the names are the dtype's text form ("fp16", ...), as Python spells it. */
typedef enum kvstash_dtype {
  KVSTASH_FP16 = 0,
  KVSTASH_BF16 = 1,
  KVSTASH_FP32 = 2,
  KVSTASH_FP8_E4M3 = 3,
  KVSTASH_FP8_E5M2 = 4,
  KVSTASH_INT8 = 5
} kvstash_dtype;

/* KvBlockOrder: one block's elements. */
typedef enum kvstash_block_order {
  KVSTASH_NHD = 0, /* (block_size, num_kv_heads, head_dim) */
  KVSTASH_HND = 1  /* (num_kv_heads, block_size, head_dim) */
} kvstash_block_order;

/* MemoryKind: where the cache's tensors are. */
typedef enum kvstash_memory_kind {
  KVSTASH_MEMORY_HOST = 0,
  KVSTASH_MEMORY_CUDA = 1 /* CUDA device memory */
} kvstash_memory_kind;

/* KvSync::Kind: what a kvstash_sync names. */
typedef enum kvstash_sync_kind {
  KVSTASH_SYNC_STREAM = 0, /* everything queued on a cudaStream_t so far; NULL is CUDA's legacy
                              default stream (torch's default stream has handle 0) */
  KVSTASH_SYNC_EVENT = 1,  /* a cudaEvent_t the engine recorded, as recorded at the call */
  KVSTASH_SYNC_NONE = 2    /* nothing to wait for: the engine vouches the memory is final */
} kvstash_sync_kind;

/* KvSync: a point in the engine's GPU work that kvstash orders its own after. Zero-filled
 * ((kvstash_sync){0}) it is the legacy default stream, never "nothing". */
typedef struct kvstash_sync {
  kvstash_sync_kind kind;
  void* handle; /* the cudaStream_t or cudaEvent_t */
} kvstash_sync;

/* Which KvLayout constructor describes the tensors (KvLayout::per_layer, ...). */
typedef enum kvstash_arrangement {
  KVSTASH_PER_LAYER = 0,              /* vLLM: per layer (2, num_blocks, block_size, heads, head_dim) */
  KVSTASH_PER_LAYER_BLOCKS_FIRST = 1, /* per layer (num_blocks, 2, block_size, heads, head_dim) */
  KVSTASH_CROSS_LAYER = 2             /* one region (num_blocks, num_layers, 2, block_size, heads,
                                         head_dim) */
} kvstash_arrangement;

/* How the bytes reach the cache's memory: KvCacheOptions::path and ::device in one (C cannot
 * pass a KvDevice). */
typedef enum kvstash_staging {
  KVSTASH_STAGING_AUTO = 0, /* the transports register it (host memory; GPU memory with GPUDirect);
                               GPU memory none of them reaches is staged by the CUDA device of
                               the GPU that owns the tensors */
  KVSTASH_STAGING_HOST = 1, /* through host bounce buffers, memcpy (host memory only): host_device() */
  KVSTASH_STAGING_CUDA = 2, /* through pinned bounce buffers, a CUDA kernel per layer on the GPU
                               that owns the tensors: cuda_device_of() (KVSTASH_UNSUPPORTED where
                               the build has no CUDA kernels) */
  KVSTASH_STAGING_NONE = 3  /* KvPath::kDirect: the transports register it, or
                               kvstash_kvcache_open fails */
} kvstash_staging;

/* KvCacheShape's fields, then the KvLayout constructor's arguments, then how bytes travel.
 * Zero-filled: fp16, NHD, per-layer tensors in host memory, KvPath::kAuto. */
typedef struct kvstash_kv_layout {
  uint32_t num_layers, num_blocks, block_size, num_kv_heads, head_dim;
  kvstash_dtype dtype;
  kvstash_block_order order;
  int mla; /* 1: one latent tensor per layer (num_kv_heads = 1) */
  kvstash_arrangement arrangement;
  void* const* layer_tensors; /* num_layers pointers (per-layer arrangements) */
  void* base;                 /* the region (cross-layer) */
  kvstash_memory_kind memory_kind;
  kvstash_staging staging;
  int joint_kv; /* 1: one part per layer, K and V side by side in each head (head_dim: both) */
} kvstash_kv_layout;

/* PrefixKeyOptions. */
typedef struct kvstash_key_options {
  const char* model;     /* required */
  uint32_t tp_rank;      /* default 0 */
  uint32_t tp_size;      /* 0 means 1 */
  uint32_t chunk_tokens; /* 0 means 256 */
  const char* extra;     /* NULL: "" */
  /* KvLayout::tag() of the cache ("L32.P2.H32.D128.B16.fp16.nhd"), for kvstash_prefix_chunk_key;
   * kvstash_kvcache_open sets it from the layout (as KvCache::open does). NULL: "". */
  const char* layout_tag;
} kvstash_key_options;

/* The store's own metrics in Prometheus' text exposition format (Store::metrics_text), for an
 * engine to serve on its /metrics: `out` gets them NUL-terminated when `capacity` holds them,
 * and `*size` says how many bytes they take with the NUL either way (KVSTASH_INVALID_ARGUMENT,
 * nothing written, when `capacity` is smaller: call again with a buffer of `*size`). */
kvstash_status kvstash_metrics_text(kvstash_store* store, char* out, size_t capacity, size_t* size);

/* Bytes a chunk key takes with its NUL: "kvp:{" + the chain's root (16 hex) + "}" + 32 hex. */
#define KVSTASH_KEY_SIZE 55

/* The key of chunk `index` of `tokens` salted with `options` (prefix_chunk_keys: what a
 * scheduler computes without a cache) into `out` (NUL-terminated; at least KVSTASH_KEY_SIZE
 * bytes). KVSTASH_INVALID_ARGUMENT when the tokens hold no such full chunk. */
kvstash_status kvstash_prefix_chunk_key(const uint32_t* tokens, size_t n_tokens, size_t index,
                                        const kvstash_key_options* options, char* out, size_t out_size);

kvstash_status kvstash_kvcache_open(kvstash_store* store, const kvstash_kv_layout* layout,
                                    const kvstash_key_options* keys, kvstash_kvcache** out);
/* "direct" or "staged": how this cache's bytes move (see kvstash_staging). */
const char* kvstash_kvcache_data_path(const kvstash_kvcache* kv);
/* "host" or "cuda": the device that copies and checksums the cache's memory. */
const char* kvstash_kvcache_device(const kvstash_kvcache* kv);
void kvstash_kvcache_close(kvstash_kvcache* kv);
/* Bytes of one chunk's object. */
uint64_t kvstash_kvcache_chunk_bytes(const kvstash_kvcache* kv);
/* KvCache::key_options(): chunk size in tokens; the layout tag keys are salted with (valid
 * while the cache is open). */
uint32_t kvstash_kvcache_chunk_tokens(const kvstash_kvcache* kv);
const char* kvstash_kvcache_layout_tag(const kvstash_kvcache* kv);

/* The key of chunk `index` of `tokens` (NUL-terminated) into `out` (at least KVSTASH_KEY_SIZE
 * bytes). KVSTASH_INVALID_ARGUMENT when the tokens hold no such full chunk. */
kvstash_status kvstash_kvcache_key(const kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                   size_t index, char* out, size_t out_size);

/* How many leading full chunks of `tokens` are stored. */
kvstash_status kvstash_kvcache_contains_prefix(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                               uint32_t timeout_ms, size_t* chunks);

/* What a request's loads and saves tell a cell whose eviction policy is turn-ttl (KvKeep): its
 * conversation turn, the cell's clock at its lookup, the prompt's chunks, the hash of its first
 * missing chunk's key. */
typedef struct kvstash_kv_keep {
  uint32_t turn;
  double looked_up;
  uint32_t chunks;
  uint64_t split_hash;
} kvstash_kv_keep;
/* kvstash_kvcache_contains_prefix, with the request's keep (KvCache::lookup_prefix): pass it to
 * kvstash_kvcache_begin_save_keep and kvstash_kvcache_begin_load_range_keep. */
kvstash_status kvstash_kvcache_lookup_prefix(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                             uint32_t timeout_ms, size_t* chunks, kvstash_kv_keep* keep);

/* Layer-wise save of chunks [first, first + count): block_ids[i] holds tokens [i * block_size,
 * (i + 1) * block_size). Then kvstash_save_layer for layers 0, 1, ... in order as each is
 * written, and kvstash_save_finish (KvSave::wait: commits; per_chunk gets `count` statuses
 * when not NULL; returns the first failure; frees the handle). kvstash_save_free drops an
 * unfinished save (nothing becomes visible) and frees the handle. */
kvstash_status kvstash_kvcache_begin_save(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                          const uint32_t* block_ids, size_t n_block_ids, size_t first,
                                          size_t count, uint32_t timeout_ms, kvstash_save** out);
/* With the request's keep (kvstash_kvcache_lookup_prefix; NULL: none). */
kvstash_status kvstash_kvcache_begin_save_keep(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                               const uint32_t* block_ids, size_t n_block_ids, size_t first,
                                               size_t count, uint32_t timeout_ms, const kvstash_kv_keep* keep,
                                               kvstash_save** out);
/* Saves the layer once CUDA's legacy default stream's work up to this call is done (for a
 * host cache: at once). */
kvstash_status kvstash_save_layer(kvstash_save* save, uint32_t layer);
/* Stream-ordered form: the layer is written once the engine's GPU work up to `after` is done
 * (kvstash_sync). The cache's threads wait for it; this call does not block. */
kvstash_status kvstash_save_layer_after(kvstash_save* save, uint32_t layer, kvstash_sync after);
kvstash_status kvstash_save_finish(kvstash_save* save, kvstash_status* per_chunk);
void kvstash_save_free(kvstash_save* save);

/* Layer-wise load of the first `count` chunks into `block_ids`. kvstash_load_wait_layer blocks
 * until that layer of every chunk is in place and checked (or returns the first failed
 * chunk's status); kvstash_load_layer_ready polls (1 ready, 0 not). kvstash_load_finish
 * (KvLoad::wait) waits for everything, fills per_chunk (count entries) when not NULL, returns
 * the first failure, and frees the handle; kvstash_load_free frees it without the statuses. */
/* No byte of the blocks is written before the engine's work up to `after` is done (the blocks
 * may have been another request's, whose kernels still read them): pass the stream the engine
 * computes on, or (kvstash_sync){0} for the legacy default stream. */
kvstash_status kvstash_kvcache_begin_load(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                          const uint32_t* block_ids, size_t n_block_ids, size_t count,
                                          uint32_t timeout_ms, kvstash_sync after, kvstash_load** out);
/* Chunks [first, first + count) only (the engine holds the ones before); per_chunk then counts
 * from chunk `first`. */
kvstash_status kvstash_kvcache_begin_load_range(kvstash_kvcache* kv, const uint32_t* tokens, size_t n_tokens,
                                                const uint32_t* block_ids, size_t n_block_ids, size_t first,
                                                size_t count, uint32_t timeout_ms, kvstash_sync after,
                                                kvstash_load** out);
/* With the request's keep (kvstash_kvcache_lookup_prefix; NULL: none). */
kvstash_status kvstash_kvcache_begin_load_range_keep(kvstash_kvcache* kv, const uint32_t* tokens,
                                                     size_t n_tokens, const uint32_t* block_ids,
                                                     size_t n_block_ids, size_t first, size_t count,
                                                     uint32_t timeout_ms, kvstash_sync after,
                                                     const kvstash_kv_keep* keep, kvstash_load** out);
kvstash_status kvstash_load_wait_layer(kvstash_load* load, uint32_t layer);
int kvstash_load_layer_ready(const kvstash_load* load, uint32_t layer);
/* KvLoad::wait_layer_on: `stream` (a cudaStream_t; NULL is the legacy default stream) waits on
 * the GPU for the layer's bytes and then places or checks them itself, before its later work.
 * Does not block. It goes on for failed chunks too (see kvstash_load_failed_blocks).
 * KVSTASH_UNSUPPORTED for a cache in host memory (use kvstash_load_wait_layer). */
kvstash_status kvstash_load_wait_layer_on(kvstash_load* load, uint32_t layer, void* stream);
/* The same on a stream of the load's own, as a cudaEvent_t for cudaStreamWaitEvent. Owned by
 * the load: valid until kvstash_load_finish or kvstash_load_free. */
kvstash_status kvstash_load_layer_event(kvstash_load* load, uint32_t layer, void** event);
kvstash_status kvstash_load_finish(kvstash_load* load, kvstash_status* per_chunk);
/* Drops a load: waits until nothing writes into the cache any more (kvstash_load_cancel first
 * to stop it sooner), then frees the handle. What landed stays; nothing says what. */
void kvstash_load_free(kvstash_load* load);
/* Stops a load: returns once nothing writes into the cache any more. Chunks not landed by then
 * end KVSTASH_CANCELLED (recompute their blocks); kvstash_load_finish still frees the handle. */
void kvstash_load_cancel(kvstash_load* load);
/* Waits for the load, then writes the ids of the blocks whose chunk did not load whole (what to
 * recompute) to `out` (room for `capacity`) and their number to `*n`; KVSTASH_INVALID_ARGUMENT
 * (and the number needed in *n) when they do not fit. Call before kvstash_load_finish. */
kvstash_status kvstash_load_failed_blocks(kvstash_load* load, uint32_t* out, size_t capacity, size_t* n);
/* Drops a save: returns once nothing reads the cache any more; nothing becomes visible.
 * kvstash_save_finish then reports KVSTASH_CANCELLED per chunk (or kvstash_save_free it). */
void kvstash_save_cancel(kvstash_save* save);

#ifdef __cplusplus
}
#endif

#endif /* KVSTASH_C_API_H */

/* A C program over the C API (compiled as C: the header must be plain C). Given a cell's
 * Redis URL it puts and gets an object, registers a small paged KV cache, saves two chunks
 * of scattered blocks layer by layer, loads them into other blocks of a second cache layer by
 * layer, compares every byte, and checks the error paths. Given the cluster token of the cell
 * "secured" on the same Redis (its node requires one), it checks that the data path needs it.
 * Prints "ok" and exits 0, or says what failed and exits 1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstash/c_api.h"

#define CHECK(cond, what)                                                          \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      fprintf(stderr, "capi_client: %s failed: %s\n", what, kvstash_last_error()); \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

enum { LAYERS = 3, BLOCKS = 16, BLOCK_SIZE = 4, HEADS = 2, HEAD_DIM = 16, CHUNK = 8 };
enum { BLOCK_BYTES = BLOCK_SIZE * HEADS * HEAD_DIM * 2, LAYER_BYTES = 2 * BLOCKS * BLOCK_BYTES };

static unsigned char* block_of(unsigned char* layer, int part, unsigned block) {
  return layer + (part * BLOCKS + block) * BLOCK_BYTES;
}

/* The cell "secured", served over tcp only by a node that requires `token`: without the token
 * the data path is refused, with it an object goes and comes back; an empty or blank token is
 * refused outright instead of being taken as none. */
static int check_cluster_token(const char* url, const char* token) {
  kvstash_store* store = NULL;
  kvstash_store_options so = {0};
  so.redis_url = url;
  so.cell = "secured";
  so.transports = "tcp";
  so.timeout_ms = 10000;
  so.cluster_token = "";
  CHECK(kvstash_store_open(&so, &store) == KVSTASH_INVALID_ARGUMENT && store == NULL,
        "an empty cluster token is refused");
  CHECK(strstr(kvstash_last_error(), "cluster_token") != NULL, "the message names the field");
  so.cluster_token = " \n";
  CHECK(kvstash_store_open(&so, &store) == KVSTASH_INVALID_ARGUMENT && store == NULL,
        "a blank cluster token is refused");
  so.cluster_token = "guess";
  CHECK(kvstash_store_open(&so, &store) == KVSTASH_INVALID_ARGUMENT && store == NULL,
        "a cluster token shorter than 16 bytes is refused");
  CHECK(strstr(kvstash_last_error(), "at least 16 bytes") != NULL, "the message says how long");

  const char secret[] = "bytes behind the cluster token";
  char back[64];
  size_t size = 0;
  so.cluster_token = NULL;
  CHECK(kvstash_store_open(&so, &store) == KVSTASH_OK, "open without a token (Redis needs none)");
  CHECK(kvstash_put(store, "c:guarded", secret, sizeof secret, 0) == KVSTASH_PERMISSION_DENIED,
        "a put without the token is refused");
  CHECK(strstr(kvstash_last_error(), "cluster token") != NULL, "the message says why");

  kvstash_store* wrong = NULL;
  so.cluster_token = "guess-guess-guess-guess";
  CHECK(kvstash_store_open(&so, &wrong) == KVSTASH_OK, "open with a wrong token");
  CHECK(kvstash_put(wrong, "c:guarded", secret, sizeof secret, 0) == KVSTASH_PERMISSION_DENIED,
        "a put with a wrong token is refused");

  kvstash_store* right = NULL;
  so.cluster_token = token;
  CHECK(kvstash_store_open(&so, &right) == KVSTASH_OK, "open with the token");
  CHECK(kvstash_put(right, "c:guarded", secret, sizeof secret, 0) == KVSTASH_OK, "a put with the token");
  CHECK(kvstash_get(right, "c:guarded", back, sizeof back, &size) == KVSTASH_OK && size == sizeof secret &&
            memcmp(back, secret, size) == 0,
        "a get with the token");
  CHECK(kvstash_get(store, "c:guarded", back, sizeof back, &size) == KVSTASH_PERMISSION_DENIED,
        "a get without the token is refused");
  CHECK(kvstash_get(wrong, "c:guarded", back, sizeof back, &size) == KVSTASH_PERMISSION_DENIED,
        "a get with a wrong token is refused");
  kvstash_store_close(right);
  kvstash_store_close(wrong);
  kvstash_store_close(store);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: capi_client REDIS_URL CLUSTER_TOKEN_OF_CELL_SECURED\n");
    return 2;
  }
  if (check_cluster_token(argv[1], argv[2]) != 0) return 1;
  /* Errors: a status and a message. */
  kvstash_store* store = NULL;
  kvstash_store_options bad = {0};
  CHECK(kvstash_store_open(&bad, &store) == KVSTASH_INVALID_ARGUMENT, "open without a URL");
  CHECK(strlen(kvstash_last_error()) > 0, "an error message");
  CHECK(strcmp(kvstash_status_name(KVSTASH_NOT_FOUND), "not_found") == 0, "status names");

  kvstash_store_options so = {0};
  so.redis_url = argv[1];
  so.transports = "shm,tcp";
  so.timeout_ms = 10000;
  CHECK(kvstash_store_open(&so, &store) == KVSTASH_OK, "kvstash_store_open");
  CHECK(strcmp(kvstash_last_error(), "") == 0, "no message after a success");

  /* A plain object. */
  const char hello[] = "hello from C";
  char back[64];
  size_t size = 0;
  CHECK(kvstash_put(store, "c:hello", hello, sizeof hello, 0) == KVSTASH_OK, "kvstash_put");
  CHECK(kvstash_get(store, "c:hello", back, sizeof back, &size) == KVSTASH_OK, "kvstash_get");
  CHECK(size == sizeof hello && memcmp(back, hello, size) == 0, "the object's bytes");
  CHECK(kvstash_get(store, "c:hello", back, 4, &size) == KVSTASH_INVALID_ARGUMENT && size == sizeof hello,
        "a buffer too small says how much is needed");
  CHECK(kvstash_get(store, "c:absent", back, sizeof back, &size) == KVSTASH_NOT_FOUND, "absent key");
  /* KV events: this cell's are off, so an announce records nothing and says so. */
  const char* ev_key[] = {"c:hello"};
  const void* ev_data[] = {"\x96"};
  size_t ev_len[] = {1};
  int64_t announced = 0;
  CHECK(kvstash_announce(store, ev_key, ev_data, ev_len, 1, 0, &announced) == KVSTASH_OK && announced == -1,
        "kvstash_announce: -1 while the cell's events are off");
  ev_len[0] = 0;
  CHECK(kvstash_announce(store, ev_key, ev_data, ev_len, 1, 0, &announced) == KVSTASH_INVALID_ARGUMENT,
        "kvstash_announce: empty event data is refused");
  CHECK(kvstash_remove(store, "c:hello", 0) == KVSTASH_OK, "kvstash_remove");

  /* Two caches laid out like vLLM's per-layer tensors. */
  unsigned char* a[LAYERS];
  unsigned char* b[LAYERS];
  void* pa[LAYERS];
  void* pb[LAYERS];
  unsigned seed = 12345;
  for (int l = 0; l < LAYERS; ++l) {
    a[l] = malloc(LAYER_BYTES);
    b[l] = calloc(1, LAYER_BYTES);
    for (int i = 0; i < LAYER_BYTES; ++i)
      a[l][i] = (unsigned char)((seed = seed * 1103515245u + 12345u) >> 16);
    pa[l] = a[l];
    pb[l] = b[l];
  }
  kvstash_kv_layout layout = {0};
  layout.num_layers = LAYERS;
  layout.num_blocks = BLOCKS;
  layout.block_size = BLOCK_SIZE;
  layout.num_kv_heads = HEADS;
  layout.head_dim = HEAD_DIM;
  layout.dtype = KVSTASH_FP16;
  layout.order = KVSTASH_NHD;
  layout.arrangement = KVSTASH_PER_LAYER;
  layout.memory_kind = KVSTASH_MEMORY_HOST;
  layout.layer_tensors = pa;
  kvstash_key_options keys = {0};
  keys.model = "c-model";
  keys.chunk_tokens = CHUNK;
  kvstash_kvcache* kva = NULL;
  kvstash_kvcache* kvb = NULL;
  CHECK(kvstash_kvcache_open(store, &layout, &keys, &kva) == KVSTASH_OK, "kvstash_kvcache_open a");
  layout.layer_tensors = pb;
  CHECK(kvstash_kvcache_open(store, &layout, &keys, &kvb) == KVSTASH_OK, "kvstash_kvcache_open b");
  CHECK(kvstash_kvcache_chunk_tokens(kva) == CHUNK, "chunk tokens");
  CHECK(kvstash_kvcache_chunk_bytes(kva) == (uint64_t)LAYERS * 2 * (CHUNK / BLOCK_SIZE) * BLOCK_BYTES,
        "chunk bytes");

  uint32_t tokens[2 * CHUNK + 3];
  for (unsigned i = 0; i < sizeof tokens / sizeof tokens[0]; ++i) tokens[i] = 1000 + i * 7;
  const size_t n_tokens = sizeof tokens / sizeof tokens[0];
  const uint32_t blocks_a[] = {9, 2, 14, 5};
  const uint32_t blocks_b[] = {0, 11, 7, 3};
  char key[KVSTASH_KEY_SIZE];
  CHECK(kvstash_kvcache_key(kva, tokens, n_tokens, 1, key, sizeof key) == KVSTASH_OK &&
            strncmp(key, "kvp:", 4) == 0 && strlen(key) == KVSTASH_KEY_SIZE - 1,
        "chunk key");
  /* A scheduler computes the same key without a cache, from the key options and the tag. */
  CHECK(strcmp(kvstash_kvcache_layout_tag(kva), "L3.P2.H2.D16.B4.fp16.nhd") == 0, "layout tag");
  kvstash_key_options scheduler = keys;
  scheduler.layout_tag = kvstash_kvcache_layout_tag(kva);
  char sk[KVSTASH_KEY_SIZE];
  CHECK(kvstash_prefix_chunk_key(tokens, n_tokens, 1, &scheduler, sk, sizeof sk) == KVSTASH_OK &&
            strcmp(sk, key) == 0,
        "kvstash_prefix_chunk_key");
  CHECK(kvstash_prefix_chunk_key(tokens, n_tokens, 2, &scheduler, sk, sizeof sk) == KVSTASH_INVALID_ARGUMENT,
        "no scheduler key for a partial chunk");
  CHECK(kvstash_kvcache_key(kva, tokens, n_tokens, 2, key, sizeof key) == KVSTASH_INVALID_ARGUMENT,
        "no key for a partial chunk");
  size_t hit = 99;
  CHECK(kvstash_kvcache_contains_prefix(kva, tokens, n_tokens, 0, &hit) == KVSTASH_OK && hit == 0,
        "nothing stored");

  kvstash_save* save = NULL;
  CHECK(kvstash_kvcache_begin_save(kva, tokens, n_tokens, blocks_a, 4, 0, 2, 0, &save) == KVSTASH_OK,
        "begin_save");
  /* Layer 0 plainly (the legacy default stream: a host cache has no GPU work to wait for),
   * layer 1 after a zero-filled kvstash_sync (the same), the rest after KVSTASH_SYNC_NONE. A
   * host cache has no streams: a stream handle is refused. */
  CHECK(kvstash_save_layer(save, 0) == KVSTASH_OK, "save_layer");
  kvstash_sync legacy = {0};
  kvstash_sync some_stream = {KVSTASH_SYNC_STREAM, (void*)0x1};
  kvstash_sync nothing = {KVSTASH_SYNC_NONE, NULL};
  kvstash_sync bad_kind = {(kvstash_sync_kind)7, NULL};
  CHECK(kvstash_save_layer_after(save, 1, some_stream) == KVSTASH_INVALID_ARGUMENT,
        "a host cache has no streams to wait for");
  CHECK(kvstash_save_layer_after(save, 1, bad_kind) == KVSTASH_INVALID_ARGUMENT, "an unknown sync kind");
  CHECK(kvstash_save_layer_after(save, 1, legacy) == KVSTASH_OK, "save_layer_after the legacy stream");
  for (uint32_t l = 2; l < LAYERS; ++l)
    CHECK(kvstash_save_layer_after(save, l, nothing) == KVSTASH_OK, "save_layer_after");
  kvstash_status saved[2];
  CHECK(kvstash_save_finish(save, saved) == KVSTASH_OK && saved[0] == KVSTASH_OK && saved[1] == KVSTASH_OK,
        "save_finish");
  CHECK(kvstash_kvcache_contains_prefix(kvb, tokens, n_tokens, 0, &hit) == KVSTASH_OK && hit == 2,
        "both stored");
  /* The scheduler's form: the store alone, over the chunks' keys. */
  char key0[KVSTASH_KEY_SIZE], key1[KVSTASH_KEY_SIZE];
  const char* chunk_keys[] = {key0, key1, "kvp:absent"};
  CHECK(kvstash_kvcache_key(kva, tokens, n_tokens, 0, key0, sizeof key0) == KVSTASH_OK &&
            kvstash_kvcache_key(kva, tokens, n_tokens, 1, key1, sizeof key1) == KVSTASH_OK,
        "chunk keys");
  hit = 99;
  CHECK(kvstash_contains_prefix(store, chunk_keys, 3, 0, &hit) == KVSTASH_OK && hit == 2,
        "the store's prefix check");
  kvstash_prefix_lookup found = {99, 99, -1};
  CHECK(kvstash_lookup_prefix(store, chunk_keys, 3, 0, &found) == KVSTASH_OK && found.hit == 2 &&
            found.turn == 1 && found.clock == 0,
        "the store's prefix lookup: under lru, a first turn and no turn-ttl clock");
  size_t chunks = 99;
  kvstash_kv_keep keep = {99, -1, 99, 0};
  CHECK(kvstash_kvcache_lookup_prefix(kvb, tokens, n_tokens, 0, &chunks, &keep) == KVSTASH_OK &&
            chunks == 2 && keep.turn == 1 && keep.looked_up == 0 && keep.chunks == 2,
        "the cache's prefix lookup: 2 chunks, a first turn, no turn-ttl clock under lru");
  kvstash_load* kept = NULL;
  kvstash_status kept_chunks[1];
  CHECK(kvstash_kvcache_begin_load_range_keep(kvb, tokens, n_tokens, blocks_b, 4, 1, 1, 0, legacy, &keep,
                                              &kept) == KVSTASH_OK &&
            kvstash_load_finish(kept, kept_chunks) == KVSTASH_OK && kept_chunks[0] == KVSTASH_OK,
        "a load with the lookup's keep");
  CHECK(kvstash_kvcache_lookup_prefix(kvb, tokens, n_tokens, 0, &chunks, NULL) == KVSTASH_INVALID_ARGUMENT,
        "a lookup needs somewhere to put the keep");
  const char* gapped[] = {"kvp:absent", key1, key0};
  uint8_t each[3] = {9, 9, 9};
  CHECK(kvstash_contains_each(store, gapped, 3, 0, each) == KVSTASH_OK && each[0] == 0 && each[1] == 1 &&
            each[2] == 1,
        "the store's check of each key, past a gap");

  kvstash_load* load = NULL;
  CHECK(kvstash_kvcache_begin_load(kvb, tokens, n_tokens, blocks_b, 4, 2, 0, legacy, &load) == KVSTASH_OK,
        "begin_load");
  for (uint32_t l = 0; l < LAYERS; ++l) {
    CHECK(kvstash_load_wait_layer(load, l) == KVSTASH_OK, "load_wait_layer");
    CHECK(kvstash_load_layer_ready(load, l) == 1, "a waited layer is ready");
    void* event = (void*)0x1;
    CHECK(kvstash_load_layer_event(load, l, &event) == KVSTASH_UNSUPPORTED && event == NULL,
          "a host cache has no device events");
    CHECK(kvstash_load_wait_layer_on(load, l, (void*)0x1) == KVSTASH_UNSUPPORTED, "nor streams to wait");
    for (int i = 0; i < 4; ++i) {
      for (int p = 0; p < 2; ++p) {
        CHECK(memcmp(block_of(a[l], p, blocks_a[i]), block_of(b[l], p, blocks_b[i]), BLOCK_BYTES) == 0,
              "loaded bytes equal saved bytes");
      }
    }
  }
  kvstash_status loaded[2];
  CHECK(kvstash_load_finish(load, loaded) == KVSTASH_OK && loaded[0] == KVSTASH_OK && loaded[1] == KVSTASH_OK,
        "load_finish");

  /* Chunk 1 alone (the engine holds chunk 0): one status, counted from chunk 1. */
  CHECK(kvstash_kvcache_begin_load_range(kvb, tokens, n_tokens, blocks_b, 4, 1, 1, 0, legacy, &load) ==
            KVSTASH_OK,
        "begin_load_range");
  size_t n_failed = 99;
  uint32_t failed[8];
  CHECK(kvstash_load_failed_blocks(load, failed, 8, &n_failed) == KVSTASH_OK && n_failed == 0,
        "nothing failed");
  CHECK(kvstash_load_finish(load, loaded) == KVSTASH_OK && loaded[0] == KVSTASH_OK, "range load_finish");
  CHECK(kvstash_kvcache_begin_load_range(kvb, tokens, n_tokens, blocks_b, 4, 2, 1, 0, legacy, &load) ==
            KVSTASH_INVALID_ARGUMENT,
        "no chunk 2");

  /* Cancelled: a save leaves nothing (chunk 0 again, under other tokens), a load ends each
   * chunk landed or cancelled. */
  uint32_t other[CHUNK];
  for (size_t i = 0; i < CHUNK; ++i) other[i] = tokens[i] + 1;
  CHECK(kvstash_kvcache_begin_save(kva, other, CHUNK, blocks_a, 4, 0, 1, 0, &save) == KVSTASH_OK,
        "begin_save 2");
  CHECK(kvstash_save_layer(save, 0) == KVSTASH_OK, "save_layer 0");
  kvstash_save_cancel(save);
  CHECK(kvstash_save_layer(save, 1) == KVSTASH_CANCELLED, "no layer after cancel");
  CHECK(kvstash_save_finish(save, saved) == KVSTASH_CANCELLED && saved[0] == KVSTASH_CANCELLED,
        "cancelled save");
  CHECK(kvstash_kvcache_contains_prefix(kva, other, CHUNK, 0, &hit) == KVSTASH_OK && hit == 0,
        "nothing visible");
  CHECK(kvstash_kvcache_begin_load(kvb, tokens, n_tokens, blocks_b, 4, 2, 0, legacy, &load) == KVSTASH_OK,
        "begin_load 2");
  kvstash_load_cancel(load);
  kvstash_load_finish(load, loaded);
  CHECK((loaded[0] == KVSTASH_OK || loaded[0] == KVSTASH_CANCELLED) &&
            (loaded[1] == KVSTASH_OK || loaded[1] == KVSTASH_CANCELLED),
        "a cancelled load's chunks landed or were cancelled");
  /* Dropped unfinished, as a save can be: the handle is freed once nothing writes any more. */
  CHECK(kvstash_kvcache_begin_load(kvb, tokens, n_tokens, blocks_b, 4, 2, 0, legacy, &load) == KVSTASH_OK,
        "begin_load 3");
  kvstash_load_free(load);
  CHECK(kvstash_kvcache_begin_save(kva, other, CHUNK, blocks_a, 4, 0, 1, 0, &save) == KVSTASH_OK,
        "begin_save 3");
  kvstash_save_free(save);

  /* The same through host bounce buffers: a staged cache reads what a direct one wrote. */
  kvstash_kvcache* kvs = NULL;
  layout.layer_tensors = pb;
  layout.staging = KVSTASH_STAGING_HOST;
  for (int l = 0; l < LAYERS; ++l) memset(b[l], 0, LAYER_BYTES);
  CHECK(kvstash_kvcache_open(store, &layout, &keys, &kvs) == KVSTASH_OK, "kvstash_kvcache_open staged");
  CHECK(strcmp(kvstash_kvcache_data_path(kvs), "staged") == 0 &&
            strcmp(kvstash_kvcache_data_path(kva), "direct") == 0,
        "data paths");
  CHECK(strcmp(kvstash_kvcache_device(kvs), "host") == 0, "the host device stages it");
  CHECK(kvstash_kvcache_begin_load(kvs, tokens, n_tokens, blocks_b, 4, 2, 0, legacy, &load) == KVSTASH_OK,
        "staged load");
  CHECK(kvstash_load_finish(load, loaded) == KVSTASH_OK, "staged load_finish");
  for (uint32_t l = 0; l < LAYERS; ++l) {
    for (int i = 0; i < 4; ++i) {
      for (int p = 0; p < 2; ++p) {
        CHECK(memcmp(block_of(a[l], p, blocks_a[i]), block_of(b[l], p, blocks_b[i]), BLOCK_BYTES) == 0,
              "staged bytes equal saved bytes");
      }
    }
  }
  kvstash_kvcache_close(kvs);
  layout.staging = (kvstash_staging)7;
  CHECK(kvstash_kvcache_open(store, &layout, &keys, &kvs) == KVSTASH_INVALID_ARGUMENT, "unknown staging");
  layout.staging = KVSTASH_STAGING_AUTO;
  layout.order = (kvstash_block_order)5;
  CHECK(kvstash_kvcache_open(store, &layout, &keys, &kvs) == KVSTASH_INVALID_ARGUMENT, "unknown order");
  layout.order = KVSTASH_NHD;
  layout.memory_kind = (kvstash_memory_kind)5;
  CHECK(kvstash_kvcache_open(store, &layout, &keys, &kvs) == KVSTASH_INVALID_ARGUMENT, "unknown memory kind");
  layout.memory_kind = KVSTASH_MEMORY_HOST;

  /* A save of chunks the tokens do not hold: refused before anything moves. */
  CHECK(kvstash_kvcache_begin_save(kva, tokens, n_tokens, blocks_a, 4, 1, 2, 0, &save) ==
            KVSTASH_INVALID_ARGUMENT,
        "a chunk without tokens");

  kvstash_kvcache_close(kva);
  kvstash_kvcache_close(kvb);
  kvstash_store_close(store);
  for (int l = 0; l < LAYERS; ++l) {
    free(a[l]);
    free(b[l]);
  }
  puts("ok");
  return 0;
}

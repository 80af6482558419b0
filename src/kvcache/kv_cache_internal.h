// Private to src/kvcache: the state KvCache, KvSave and KvLoad share. KvCache::Impl is a
// cache's (its layout, keys, data path, bounce pools and threads; kv_cache.cc opens it),
// KvSave::State a save's (kv_save.cc), KvLoad::State a load's (kv_load.cc). kv_cache.cc's
// begin_save and begin_load_range fill the latter two in.
//
// Thread safety: an Impl is read-only once open() returned (its pools and the store lock
// themselves); each State says what guards it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "kvcache/bounce_pool.h"
#include "kvstash/engine.h"
#include "kvstash/kvcache.h"
#include "kvstash/metrics.h"
#include "kvstash/status.h"
#include "kvstash/store.h"
#include "kvstash/types.h"

namespace kvstash {

namespace kvcache {

// What each object of a chunk of `layout` holds under `keys`: the whole layout (keys by
// rank), or by heads a view of head_count heads each, in key order (prefix_object_keys).
// kInvalidArgument for heads that do not fit (PrefixKeyOptions).
Status split_by_heads(const KvLayout& layout, const PrefixKeyOptions& keys, std::vector<KvLayout>& objects);

// Loads in flight at once per cache (each is one store get, its transfers already parallel).
inline constexpr unsigned kLoadThreads = 4;
// Threads submitting saves' layers (and checksumming them while the writes fly).
inline constexpr unsigned kSaveThreads = 4;

}  // namespace kvcache

// A load's device handover and the bounce buffers its queued work still reads, kept after
// the load is gone until the engine's streams passed that work (KvCache::Impl::retire).
struct RetiredLoad {
  std::unique_ptr<KvDeviceHandover> handover;
  std::vector<std::unique_ptr<kvcache::Bounce>> bounces;
};

// Members are destroyed bottom up: the thread pools finish their tasks before the bounce
// pools and the registrations they use go. ~Impl first waits (a bounded time) for retired
// loads' device work.
struct KvCache::Impl {
  ~Impl();
  Store* store = nullptr;
  KvLayout layout;  // the whole cache
  // What each object of a chunk holds: the whole layout, or by heads one view per object
  // (KvLayout::heads), in key order.
  std::vector<KvLayout> objects;
  PrefixKeyOptions keys;                              // layout_tag: one object's
  KvCacheOptions options;                             // .device: see `device`
  std::vector<MemoryHandle> handles;                  // one per layout region (direct data path)
  std::unique_ptr<kvcache::BouncePool> save_bounces;  // bounce_slots layers each (staged data path)
  std::unique_ptr<kvcache::BouncePool> load_bounces;  // one chunk each
  std::uint32_t blocks_per_chunk = 0;
  std::unique_ptr<ThreadPool> loaders = std::make_unique<ThreadPool>(kvcache::kLoadThreads);
  std::unique_ptr<ThreadPool> savers = std::make_unique<ThreadPool>(kvcache::kSaveThreads);

  // A save's or load's units are objects: unit u is object u % per_chunk() of its chunk.
  std::size_t per_chunk() const { return objects.size(); }

  // Layer `l` of object `object` of a chunk's blocks, as runs of the cache's memory.
  Result<std::vector<KvRun>> layer_runs(std::size_t object, std::uint32_t l,
                                        std::span<const std::uint32_t> blocks) const {
    std::vector<KvRun> runs;
    KVSTASH_RETURN_IF_ERROR(objects[object].layer_runs(l, blocks, runs));
    return runs;
  }

  // Bytes of one layer of one object.
  std::uint64_t layer_bytes() const { return objects.front().layer_bytes(blocks_per_chunk); }

  // Appends `runs` to `out` as slices of the cache's registered memory (the direct data path).
  void append_slices(std::span<const KvRun> runs, std::vector<Slice>& out) const {
    for (const KvRun& r : runs)
      out.push_back({r.addr, static_cast<std::size_t>(r.length), &handles[r.region]});
  }
  std::vector<Slice> slices(const std::vector<KvRun>& runs) const {
    std::vector<Slice> out;
    out.reserve(runs.size());
    append_slices(runs, out);
    return out;
  }

  std::uint64_t chunk_bytes() const { return layer_bytes() * layout.shape().num_layers; }
  bool staged() const { return staged_path; }
  // The cache's bytes, on the direct path, are summed by the device (the host must not read
  // them); host memory is summed by the store while its writes fly.
  bool device_sums() const { return !staged_path && device_memory; }

  std::shared_ptr<KvDevice> device;
  bool staged_path = false;
  bool device_memory = false;  // some region is not host memory

  // The blocks of chunk `c` of a request (covers() checked that there are that many).
  std::vector<std::uint32_t> chunk_blocks(std::span<const std::uint32_t> block_ids, std::size_t c) const {
    const auto first = block_ids.begin() + static_cast<std::ptrdiff_t>(c * blocks_per_chunk);
    return {first, first + static_cast<std::ptrdiff_t>(blocks_per_chunk)};
  }

  // Checks that `tokens` and `block_ids` cover chunks [first, first + count): kInvalidArgument
  // saying which falls short.
  Status covers(std::span<const std::uint32_t> tokens, std::span<const std::uint32_t> block_ids,
                std::size_t first, std::size_t count) const;

  // Keeps `load` until its device work passed; frees what passed already. Never blocks.
  void retire(RetiredLoad load);
  // Frees the retired loads whose device work passed.
  void reap();
  std::mutex retired_mu;
  std::vector<RetiredLoad> retired;
};

namespace kvcache {

// One status per chunk from one per object (`per_chunk` objects a chunk, in order): a chunk
// is whole when every object of it is; else the first object's failure.
std::vector<Status> fold_objects(const std::vector<Status>& objects, std::size_t per_chunk);

}  // namespace kvcache

// A save's objects ("chunks" below: KvCache::Impl::per_chunk() of them make one of the
// request's chunks). save_layer (the caller's thread) queues one task per object and layer
// on the cache's savers; an object's tasks run one after another (each waits for `last`), so
// a Chunk is touched by one thread at a time. `cancelled` is the one field read across threads.
struct KvSave::State {
  const KvCache::Impl* kv = nullptr;
  struct Chunk {
    std::string key;
    std::size_t object = 0;  // which object of its chunk (KvCache::Impl::objects)
    std::vector<std::uint32_t> blocks;
    PutStream stream;
    Status status;                            // the first failure
    std::shared_future<void> last;            // the chunk's latest layer task: its next one waits for it
    std::unique_ptr<kvcache::Bounce> bounce;  // staged: bounce_slots layers
    bool bounce_tainted = false;              // a gather into it did not finish: never reuse it
  };
  std::vector<Chunk> chunks;
  Deadline deadline;  // the save's: a layer whose engine work is not done by then fails
  std::uint32_t next_layer = 0;
  bool waited = false;
  std::atomic<bool> cancelled = false;
  std::size_t announced = 0;  // chunks whose event data the commit recorded (wait's)

  // A saver's task: once the engine's work up to `written` is done, starts writing `layer` of
  // `c` (summed by the device on the direct path to device memory; gathered into a bounce
  // slot, staged), its checksum one segment of the chunk's stream. Does nothing for a chunk that failed;
  // the first failure goes to c.status. Blocks until the engine's mark passes (or the
  // deadline, or cancel()), and, staged, until the slot's previous layer was written.
  void write_layer(Chunk& c, std::uint32_t layer, KvDeviceMark& written);
  // Waits for the engine's mark in short steps, so that cancel() is not held up by engine
  // work that never finishes: OK, the mark's error, kTimeout at the deadline, kCancelled.
  Status wait_for(KvDeviceMark& mark) const;
  // Waits for every layer task (they touch the chunks).
  void drain();
  // Drains, then aborts every stream and gives the bounce buffers back.
  ~State();
};

// A load's chunks and layers. A "chunk" here is one object (KvCache::Impl::per_chunk() of
// them make one of the request's chunks; the public statuses are folded per chunk). Each is
// one store get on a loader thread (load_chunk);
// as its layers land they become final on the host (`landed`: landed, and staged, checked)
// and, until the load hands layers to the engine's streams, are placed at once by the
// cache's own device streams (`placed`: scattered, staged; checked on the device, direct).
// From the first wait_layer_on/layer_event (to_streams) the loaders only land layers: a
// layer is placed by the stream it was handed to (the device handover), or by a host waiter
// (wait_layer, wait) on the cache's own streams.
//
// `mu` guards every vector below but `blocks`, `runs` and `tasks`, which are written before
// the first task runs and read-only after.
struct KvLoad::State {
  KvCache::Impl* kv = nullptr;
  metrics::Histogram* layer_waits = nullptr;  // how long wait_layer waited (the store's metrics)
  std::shared_ptr<KvDevice> device;
  std::uint32_t layers = 0;
  std::optional<Deadline> deadline;
  std::unique_ptr<KvDeviceMark> after;                // the engine's earlier work on the blocks
  std::vector<std::vector<std::uint32_t>> blocks;     // per chunk: where it loads
  std::vector<std::vector<std::vector<KvRun>>> runs;  // per chunk and layer: its memory
  std::vector<Status> unusable;                       // per chunk: its blocks do not exist
  std::vector<std::future<void>> tasks;
  CancelToken cancel = CancelToken::make();  // every chunk's get holds it
  ReadLeases leases;  // every chunk's read lease, taken in one Redis round trip at the start

  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<std::uint32_t> landed;        // per chunk: leading layers final on the host
  std::vector<std::uint32_t> placed;        // per chunk: leading layers placed by the loaders
  std::vector<std::optional<Status>> done;  // per chunk: its get's final status
  std::vector<Status> late;                 // per chunk: a layer that failed after its get
  std::vector<std::unique_ptr<kvcache::Bounce>>
      bounces;                        // staged: per chunk, kept while layers may be placed
  std::vector<std::uint8_t> tainted;  // per chunk: a scatter from its bounce timed out
  std::vector<std::optional<std::vector<std::uint64_t>>> sums;  // per chunk: each layer's recorded checksum
  bool after_passed = false;                                    // `after` was waited for
  std::unique_ptr<KvDeviceHandover> handover;                   // made by to_streams()
  bool streams = false;                       // layers go to streams; loaders only land them
  bool releasing = false;                     // the handover is given what landed before
  std::uint32_t lane_busy = 0;                // loader placements in flight
  std::vector<std::uint8_t> queued;           // per layer: handed to a stream
  std::vector<std::uint8_t> host_placed;      // per layer: 1 being, 2 placed by a host waiter
  std::optional<std::vector<Status>> result;  // wait()'s, once known
  std::vector<Status> objects;                // per object, once `result` is known

  // A loader task: chunk `c` from the object `key` (its contract is in kv_load.cc).
  void load_chunk(std::size_t c, const std::string& key);
  // Switches the load to handing layers to streams (first wait_layer_on/layer_event): waits for
  // the loaders' placements in flight, makes the device handover, gives it the layers that
  // landed unplaced, and releases what is final. OK once done (again: nothing).
  Status to_streams();
  // Stream mode, a host waiter: places layer `l` once (the first waiter claims it; the others
  // wait for it), releasing `lock` (on `mu`) meanwhile. Returns with the layer placed.
  void place_on_host(std::unique_lock<std::mutex>& lock, std::uint32_t l);
  // Places layer `l` on the cache's own streams for every chunk that landed it unplaced:
  // staged scatter, direct check (a failure goes to late[c]). Called without `mu`.
  void place_layer(std::uint32_t l);
  // wait_layer_on and layer_event: switches to streams and marks `layer` handed to one; false
  // (nothing to hand) when a host waiter placed it already, unless `even_if_placed`.
  Result<bool> hand_to_stream(std::uint32_t layer, bool even_if_placed);
  // The stream refused the layer: a host waiter or wait() places it.
  void unhand(std::uint32_t layer);
  // Waits for the engine's `after`, once per load; OK or its error.
  Status wait_after();

  // Whether every chunk has `layer` final on the host, or ended. Holds `mu`.
  bool ready_locked(std::uint32_t layer) const;
  // Whether every chunk has `layer` placed by the loaders, or ended. Holds `mu`.
  bool placed_locked(std::uint32_t layer) const;
  // The first failure of a chunk that did not bring `layer` (or every layer, for -1). Holds `mu`.
  Status failure_locked(std::uint32_t layer) const;
  // Wakes waiters and releases the layers now final to the streams. Holds `mu`.
  void progress_locked();
  // Returns every chunk's bounce buffer to the cache's pool (quarantines a tainted one).
  void give_bounces();
  // A scatter from chunk `c`'s bounce buffer did not finish by its deadline: never reuse it.
  void taint(std::size_t c);
  // Gives the bounce buffers back, or retires them with the handover while streams may read them.
  ~State();

 private:
  class ChunkLoad;  // load_chunk's steps (kv_load.cc)
};

// Counts chunks of a load or save (`op`) by their outcome in the store's metrics
// (kvstash_kvcache_chunks_total): a load's failed chunks are those its engine computes again.
void count_chunks(Store& store, std::string_view op, std::span<const Status> outcomes);

}  // namespace kvstash
